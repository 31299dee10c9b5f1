"""BERT-Large phase 2 (seq 512) train-step throughput on one GPU, each technique on and off.

    python bench/gpu_bert_large.py --out results/gpu_bert_large.json   # on a GPU, ~5-8 min
    python bench/gpu_bert_large.py --cpu-smoke --out /tmp/smoke.json    # every path, tiny, CPU

Batches are drawn from the MLPerf Wikipedia length histogram (seq 512, 15% masked, at most
76), collated and moved to the device before timing. Every case trains with the loop's own
``bert.train.train_step`` (global-norm clipping 1.0, the optimizer, the schedule) under
bf16 autocast, for ``--warmup`` untimed and ``--steps`` timed steps, and reports:

- ``seq_per_s`` and useful (non-padding) ``tokens_per_s``;
- ``mfu``: useful model FLOP/s (bench.flops: real tokens, per-sequence attention, MLM head on
  masked rows; training = 3x forward) over the bf16 GEMM peak measured in the same run
  (the best of square matmuls; ``gemm_peak``);
- ``max_memory_gb`` (CUDA peak allocated) and the optimizer implementation used.

Cases, in this order (each a fresh model, so memory readings are per case):

1. ``sweep``: the default stack (unpadded, LAMB with ``optim.impl=auto``: apex when
   importable, else our foreach LAMB) at each ``--batches`` local batch;
2. ``padded``: the same at ``--ablation-batch`` with ``model.unpad=False``;
3. ``adamw_fused`` / ``adamw_foreach``: torch AdamW, fused kernel vs foreach (the fused
   optimizer technique where a fused kernel exists for certain);
4. ``lamb_foreach``: LAMB with ``optim.impl=torch`` (our foreach LAMB; equal to case 1
   when apex is missing);
5. ``compiled``: case 1 at ``--ablation-batch`` with the model under ``torch.compile``
   (dynamic shapes: the token count changes with every batch); compile time is reported
   separately and not in the throughput.

The JSON file is rewritten after every case, so a run cut short by the device window keeps
what it measured; ``--budget-s`` skips the cases that would start after it. A case that
runs out of memory is recorded as such and the run continues.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common, flops  # noqa: E402
from bert import grad_sync  # noqa: E402
from bert.config import GradSyncConfig, ModelConfig, OptimConfig, PrecisionConfig  # noqa: E402
from bert.model import BertForPreTraining  # noqa: E402
from bert.optim import build_optimizer, build_scheduler  # noqa: E402
from bert.precision import build_precision, build_scaler  # noqa: E402
from bert.train import Parts, train_step  # noqa: E402

LARGE = ModelConfig()  # the config defaults are BERT-Large (hidden 1024, 24 layers, 16 heads)
SMOKE = ModelConfig(vocab_size=1000, hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128,
                    max_position_embeddings=64)


@dataclasses.dataclass
class Case:
    name: str
    batch: int
    unpad: bool = True
    optim: str = "lamb"
    impl: str = "auto"
    compile: bool = False


def cases(args) -> list[Case]:
    ab = args.ablation_batch
    out = [Case(f"sweep_b{b}", b) for b in args.batches]
    out += [Case("padded", ab, unpad=False),
            Case("adamw_fused", ab, optim="adamw", impl="auto"),
            Case("adamw_foreach", ab, optim="adamw", impl="foreach"),
            Case("lamb_foreach", ab, impl="torch"),
            Case("compiled", ab, compile=True)]
    return out


def build(case: Case, mcfg: ModelConfig, device: torch.device, batches: list[dict], compile_backend: str):
    """The model, optimizer and loop parts of one case (a fresh model every time)."""
    torch.manual_seed(0)
    model = BertForPreTraining(dataclasses.replace(mcfg, unpad=case.unpad), device.type).to(device)
    model.train()
    ocfg = OptimConfig(name=case.optim, impl="torch" if case.impl == "foreach" else case.impl,
                       lr=1e-4, warmup_steps=0, total_steps=10**9)
    opt, impl = build_optimizer(model, ocfg, device.type)
    if case.impl == "foreach":  # torch AdamW's multi-tensor path instead of its fused kernel
        opt = torch.optim.AdamW(opt.param_groups, lr=ocfg.lr, betas=(ocfg.beta1, ocfg.beta2),
                                eps=ocfg.eps, foreach=True)
        impl = f"{case.optim}:torch-foreach"
    train_model = model
    if case.compile:
        train_model = torch.compile(model, dynamic=True, backend=compile_backend)
        impl += f" + compile({compile_backend})"

    def feed():
        k = 0
        while True:
            yield batches[k % len(batches)]
            k += 1

    # fp32 Precision (no-op autocast, disabled scaler): run_case wraps the step in bf16 itself.
    pcfg = PrecisionConfig(dtype="fp32")
    prec = build_precision(pcfg, device.type)
    clip = grad_sync.build(GradSyncConfig(), None, model.parameters(), 1.0)  # global norm 1.0
    parts = Parts(model, train_model, opt, build_scheduler(opt, ocfg), build_scaler(pcfg, prec, device.type), prec,
                  clip, feed(), [], 0, device,
                  case.batch, 1, 1)
    return parts, impl


def run_case(case: Case, args, mcfg: ModelConfig, device: torch.device, peak: float) -> dict:
    seq, max_pred = args.seq_len, args.max_pred
    samples = common.make_batches(args.num_batches, case.batch, seq, max_pred, mcfg.vocab_size, args.seed)
    unpadded, padded = common.collate_both(samples, seq)
    on_dev = [{k: (v.to(device) if torch.is_tensor(v) else v) for k, v in b.items()}
              for b in (unpadded if case.unpad else padded)]
    shape = common.shape_of(mcfg)
    useful = [flops.useful_forward_flops(shape, *common.batch_stats(b)) for b in samples]
    tokens = [sum(common.batch_stats(b)[0]) for b in samples]
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    parts, impl = build(case, mcfg, device, on_dev, args.compile_backend)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)
    t0 = time.perf_counter()
    for _ in range(args.warmup):
        with autocast:
            train_step(parts, 1)
    common.sync(device)
    warmup_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(args.steps):
        with autocast:
            loss = train_step(parts, 1)
    common.sync(device)
    secs = time.perf_counter() - t0
    done = range(args.warmup, args.warmup + args.steps)  # batch index k % num_batches
    n = len(samples)
    fl = 3 * sum(useful[k % n] for k in done)
    tok = sum(tokens[k % n] for k in done)
    loss = loss[0] if isinstance(loss, tuple) else loss
    return {**dataclasses.asdict(case), "status": "ok", "optimizer_impl": impl,
            "attention": parts.model.attn_backend.name,
            "seq_per_s": case.batch * args.steps / secs, "tokens_per_s": tok / secs,
            "step_ms": 1000 * secs / args.steps, "useful_tflops_per_s": fl / secs / 1e12,
            "mfu": fl / secs / peak, "warmup_s": warmup_s, "final_loss": float(loss),
            "max_memory_gb": (torch.cuda.max_memory_allocated(device) / 2**30
                              if device.type == "cuda" else None)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="results/gpu_bert_large.json")
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[16, 32, 48, 64],
                    help="local batch sizes of the sweep, comma-separated")
    ap.add_argument("--ablation-batch", type=int, default=32, help="local batch of the on/off cases")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--num-batches", type=int, default=8, help="distinct batches cycled through")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--max-pred", type=int, default=76)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget-s", type=float, default=480.0, help="start no case after this many seconds")
    ap.add_argument("--compile-backend", default="inductor")
    ap.add_argument("--only", default="", help="comma-separated case names to run (default all)")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="tiny model on the CPU, 1+1 steps per case, compile via the eager backend: "
                         "exercises every path and the output file, measures nothing")
    args = ap.parse_args(argv)
    if args.cpu_smoke:
        mcfg, device = SMOKE, torch.device("cpu")
        args.batches, args.ablation_batch, args.steps, args.warmup = [2, 4], 2, 1, 1
        args.num_batches, args.seq_len, args.max_pred = 2, 64, 10
        if args.compile_backend == "inductor":
            args.compile_backend = "eager"
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: use --cpu-smoke to check the script on a CPU", file=sys.stderr)
            return 2
        mcfg, device = LARGE, torch.device("cuda")
        torch.backends.cuda.matmul.allow_tf32 = True
    start = time.perf_counter()
    peak = common.gemm_peak(torch.bfloat16, device, sizes=(512,) if args.cpu_smoke else (4096, 8192),
                            reps=3 if args.cpu_smoke else 10)
    result = {"machine": common.machine(), "model": dataclasses.asdict(mcfg), "dtype": "bf16 autocast",
              "seq_len": args.seq_len, "steps": args.steps, "warmup": args.warmup,
              "gemm_peak_bf16_tflops": peak["flops_per_s"] / 1e12, "gemm_peak_n": peak["n"],
              "cpu_smoke": args.cpu_smoke, "cases": []}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    only = set(filter(None, args.only.split(",")))
    for case in cases(args):
        if only and case.name not in only:
            continue
        if time.perf_counter() - start > args.budget_s:
            result["cases"].append({**dataclasses.asdict(case), "status": "skipped: budget"})
            continue
        try:
            r = run_case(case, args, mcfg, device, peak["flops_per_s"])
        except torch.OutOfMemoryError:
            r = {**dataclasses.asdict(case), "status": "oom"}
        except Exception as e:  # noqa: BLE001 - keep the other cases' results; say what failed
            r = {**dataclasses.asdict(case), "status": f"error: {type(e).__name__}: {e}",
                 "traceback": traceback.format_exc(limit=4)}
        result["cases"].append(r)
        result["elapsed_s"] = time.perf_counter() - start
        out.write_text(json.dumps(result, indent=2) + "\n")
        if r["status"] == "ok":
            print(f"{r['name']:14s} b={r['batch']:3d} {r['seq_per_s']:9.1f} seq/s "
                  f"{r['tokens_per_s']:10.0f} tok/s  MFU {r['mfu']:6.1%}  "
                  f"{r['step_ms']:8.1f} ms/step  mem {r['max_memory_gb'] or 0:6.1f} GB  {r['optimizer_impl']}",
                  flush=True)
        else:
            print(f"{r['name']:14s} b={r['batch']:3d} {r['status']}", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(f"bf16 GEMM peak {result['gemm_peak_bf16_tflops']:.1f} TFLOP/s (n={peak['n']}); "
          f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
