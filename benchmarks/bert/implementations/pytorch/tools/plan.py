#!/usr/bin/env python3
"""The plan before the spend: wall-clock days of each pretraining phase on given hardware.

    python tools/plan.py --configs config_A100PCIE_8x4_pretrain_large_phase1.sh \\
        config_A100PCIE_8x4_pretrain_large_phase2.sh --throughput 410,95 --link-gbps 25
    python tools/plan.py --recipe nvidia-large --nodes 4 --gpus-per-node 8 \\
        --bench results/gpu_bert_large.json --link-gbps 100 --wire bf16 --json
    python tools/plan.py --check-bench gs_1.json gs_3.json gs_10.json gs_100.json gs_none.json

The model, per optimizer step of a phase (global batch B on N nodes x G GPUs, A micro-steps):

compute   B / (N G) / throughput: the per-GPU samples/s of that phase's sequence length,
          given (``--throughput p1,p2``) or read from ``bench/gpu_bert_large.py``'s JSON (its
          best seq-512 case; phase 1's rate from it by the FLOP ratio of ``bert/flops.py``).
comm      the gradient (its element count from the model shape) as DDP's buckets (``--bucket-mb``,
          reverse parameter order, the tied word embedding last, complete only when backward
          ends), each through a ring allreduce over two serial links in turn: inside the node
          (2(G-1)/G of its bytes at ``--intra-gbps``) and between nodes (2(N-1)/N of its bytes
          at ``--link-gbps``, the node's NIC bandwidth), ``--wire`` bytes per element
          (fp32 4, bf16/fp16 2, powersgd: ``--powersgd-ratio`` of fp32).
overlap   buckets become ready over the backward of the *last* micro-step (2/3 of its
          compute: accumulation shrinks the window), earlier buckets on the wire while later
          ones are computed; exposed = when the last bucket is through - when backward ends.
          ``--overlap F`` replaces this by: hidden = min(F x comm, window).
eval      one pass over ``--eval-samples`` every ``--eval-every`` steps, forward only (1/3 of a
          training sample's cost), over all GPUs (with ``--configs``: the config's
          data.eval_samples, or ``--eval-samples`` where it evaluates on the whole held-out set).
ckpt      a train-state checkpoint (weights + two optimizer moments: 12 bytes per
          parameter) every ``--ckpt-minutes`` at ``--ckpt-gbps`` of storage bandwidth, plus
          ``--requeue-minutes`` of lost work and restart per ``--preempt-hours`` of running.

``--configs`` reads each config as the launchers do (bert/config_script.py: what you set in
your environment over it, each such setting named on stderr) and refuses (exit 2) a phase
that could not start from the phase before's weights, naming the model setting (a phase 1
with 128 positions for a phase 2 at 512), before any job is submitted.

It prints each phase's days and where the time goes, then the knob that helps most (each
knob changed alone: 2x link, bf16 on the wire, perfect overlap, 2x nodes, half the
accumulation, half the evaluations). ``--check-bench`` runs the same communication model
on ``bench/grad_sync.py --json`` outputs (2 ranks, simulated links; its real loopback
allreduce is the first serial link, calibrated from the no-link file) and reports the error
of the predicted exposed communication, with and without overlap.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(PKG))

from bert import config_script  # noqa: E402
from bert.config import Config, ConfigError, ModelConfig, global_batch_size, handover_problems, padded_vocab_size  # noqa: E402

WIRE_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0}


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    intermediate: int
    vocab: int
    positions: int
    vocab_pad: int  # model.vocab_pad_multiple: the model's rows (and gradients) are padded

    @classmethod
    def of(cls, m: ModelConfig) -> Shape:
        return cls(m.hidden_size, m.num_layers, m.num_heads, m.intermediate_size, m.vocab_size,
                   m.max_position_embeddings, m.vocab_pad_multiple)

    @property
    def vocab_rows(self) -> int:
        return padded_vocab_size(ModelConfig(vocab_size=self.vocab, vocab_pad_multiple=self.vocab_pad))


LARGE = Shape.of(ModelConfig())  # the benchmark's model: the config's defaults
BASE = Shape.of(ModelConfig(hidden_size=768, num_layers=12, num_heads=12, intermediate_size=3072))


def param_groups(s: Shape) -> list[tuple[str, int]]:
    """(name, elements) of every parameter in BertForPreTraining's order (tied decoder once)."""
    h, i = s.hidden, s.intermediate
    out = [("word_embeddings", s.vocab_rows * h), ("position_embeddings", s.positions * h), ("token_type", 2 * h),
           ("embeddings_ln", 2 * h)]
    for k in range(s.layers):
        out += [(f"layer{k}.qkv", 3 * (h * h + h)), (f"layer{k}.attn_out", h * h + h), (f"layer{k}.ln1", 2 * h),
                (f"layer{k}.ffn_in", h * i + i), (f"layer{k}.ffn_out", i * h + h), (f"layer{k}.ln2", 2 * h)]
    out += [("pooler", h * h + h), ("mlm_transform", h * h + h + 2 * h), ("mlm_bias", s.vocab_rows), ("nsp", 2 * h + 2)]
    return out


def grad_elements(s: Shape) -> int:
    return sum(n for _, n in param_groups(s))


def buckets(s: Shape, cap_mb: float) -> list[tuple[int, bool]]:
    """DDP-like buckets in the order backward fills them: (elements, holds the word
    embedding, whose tied gradient is complete only at the end of backward)."""
    cap = cap_mb * 2**20 / 4
    out, cur, emb = [], 0, False
    for name, n in reversed(param_groups(s)):
        cur += n
        emb |= name == "word_embeddings"
        if cur >= cap:
            out.append((cur, emb))
            cur, emb = 0, False
    if cur:
        out.append((cur, emb))
    return out


def pipeline_finish(ready: list[float], costs: list[list[float]]) -> float:
    """When the last bucket leaves the last of the serial links: bucket k enters link j once
    it left link j-1 and link j finished bucket k-1; ``costs[j][k]`` its time on link j."""
    free = [0.0] * len(costs)
    done = 0.0
    for k, t in enumerate(ready):
        for j, c in enumerate(costs):
            t = max(t, free[j]) + c[k]
            free[j] = t
        done = t
    return done


def exposed_comm(s: Shape, cap_mb: float, links: list[tuple[float, float]], window: float,
                 overlap: float | None = None) -> tuple[float, float]:
    """(communication time with nothing overlapped, exposed time) of one step whose last
    backward takes ``window`` seconds; ``links``: (seconds per byte, bytes per element) of
    each serial link a bucket crosses."""
    bs = buckets(s, cap_mb)
    costs = [[n * nbytes * per_byte for n, _ in bs] for per_byte, nbytes in links]
    total = pipeline_finish([0.0] * len(bs), costs)
    if overlap is not None:
        return total, total - min(overlap * total, window)
    all_n = sum(n for n, _ in bs)
    cum, ready = 0.0, []
    for n, emb in bs:
        cum += n
        ready.append(window if emb else window * cum / all_n)
    return total, max(0.0, pipeline_finish(ready, costs) - window)


# ---------------------------------------------------------------- recipes and hardware


@dataclass(frozen=True)
class Phase:
    name: str
    seq: int
    max_pred: int
    global_batch: int
    steps: int
    accum: int  # micro-steps per optimizer step on every GPU
    eval_every: int = 0  # steps between evaluations (0 = none)
    eval_samples: int = 0


# NVIDIA DeepLearningExamples BERT (PyTorch) two-phase LAMB recipe for BERT-Large on 8 DGX
# A100s: phase 1 seq 128 / 20 predictions, batch 65,536, 7,038 steps, lr 6e-3, warmup 28.43%;
# phase 2 seq 512 / 80 predictions, batch 32,768, 1,563 steps, lr 4e-3, warmup 12.8%.
RECIPES = {
    "nvidia-large": (LARGE, [Phase("phase1", 128, 20, 65536, 7038, 64), Phase("phase2", 512, 80, 32768, 1563, 128)]),
    "nvidia-base": (BASE, [Phase("phase1", 128, 20, 65536, 7038, 32), Phase("phase2", 512, 80, 32768, 1563, 64)]),
}


@dataclass(frozen=True)
class Hardware:
    nodes: int = 1
    gpus_per_node: int = 8
    link_gbps: float = 100.0  # between nodes, per node (its NICs together)
    intra_gbps: float = 2400.0  # inside a node (NVLink 3: ~300 GB/s); PCIe 4 x16 ~ 200
    wire: str = "fp32"
    powersgd_ratio: float = 0.01
    bucket_mb: float = 25.0
    overlap: float | None = None  # None: the bucket model
    ckpt_minutes: float = 60.0
    ckpt_gbps: float = 8.0  # storage write bandwidth, Gb/s
    preempt_hours: float = 0.0  # mean running time between preemptions; 0 = none
    requeue_minutes: float = 10.0  # lost work + queue + restart per preemption


def wire_bytes(hw: Hardware) -> float:
    return 4.0 * hw.powersgd_ratio if hw.wire == "powersgd" else WIRE_BYTES[hw.wire]


def links_of(hw: Hardware) -> list[tuple[float, float]]:
    """(seconds per byte, bytes per element) of the intra-node and inter-node ring stages."""
    g, n, wb = hw.gpus_per_node, hw.nodes, wire_bytes(hw)
    out = []
    if g > 1:
        out.append((2 * (g - 1) / g * 8 / (hw.intra_gbps * 1e9), wb))
    if n > 1:
        out.append((2 * (n - 1) / n * 8 / (hw.link_gbps * 1e9), wb))
    return out or [(0.0, wb)]


def train_sample_flops(s: Shape, seq: int, max_pred: int) -> float:
    """A full-length sample (pretraining data is mostly full at 128; the 512 rate is the
    bench's, on Wikipedia's length mix, so both sides use what the bench saw)."""
    from bert import flops

    shape = flops.Shape(s.hidden, s.layers, s.intermediate, s.vocab)
    return float(flops.train_flops(flops.useful_forward_flops(shape, [seq], max_pred)))


def throughputs_from_bench(path: str, s: Shape, phases: list[Phase]) -> list[float]:
    """Per-GPU samples/s of each phase from bench/gpu_bert_large.py's JSON: its best ok case
    gives useful FLOP/s; each phase's rate = that / the FLOPs of one of its samples."""
    data = json.loads(Path(path).read_text())
    ok = [c for c in data.get("cases", []) if c.get("status") == "ok"]
    if not ok:
        raise SystemExit(f"{path}: no successful case")
    best = max(ok, key=lambda c: c["useful_tflops_per_s"])
    rate = best["useful_tflops_per_s"] * 1e12
    return [rate / train_sample_flops(s, p.seq, p.max_pred) for p in phases]


def plan_phase(s: Shape, p: Phase, hw: Hardware, throughput: float) -> dict:
    gpus = hw.nodes * hw.gpus_per_node
    step_compute = p.global_batch / gpus / throughput
    window = 2 / 3 * step_compute / p.accum  # backward of the last micro-step
    total_comm, exposed = exposed_comm(s, hw.bucket_mb, links_of(hw), window, hw.overlap)
    train_s = p.steps * (step_compute + exposed)
    evals = p.steps // p.eval_every if p.eval_every else 0
    eval_s = evals * p.eval_samples / gpus / (3 * throughput)
    ckpt_bytes = 12 * grad_elements(s)
    run_s = train_s + eval_s
    n_ckpt = int(run_s // (hw.ckpt_minutes * 60)) if hw.ckpt_minutes > 0 else 0
    ckpt_s = n_ckpt * ckpt_bytes * 8 / (hw.ckpt_gbps * 1e9)
    preempt_s = ((run_s + ckpt_s) / 3600 / hw.preempt_hours * hw.requeue_minutes * 60) if hw.preempt_hours > 0 else 0.0
    parts = {"compute": p.steps * step_compute, "exposed_comm": p.steps * exposed, "eval": eval_s,
             "checkpoint": ckpt_s, "preemption": preempt_s}
    total = sum(parts.values())
    return {"phase": p.name, "days": total / 86400, "seconds": parts, "step_s": step_compute + exposed,
            "comm_per_step_s": total_comm, "exposed_per_step_s": exposed, "hidden_fraction":
            (1 - exposed / total_comm) if total_comm > 0 else None, "samples_per_s": p.global_batch / (step_compute + exposed),
            "global_batch": p.global_batch, "steps": p.steps, "accum": p.accum, "gpus": gpus,
            "throughput_per_gpu": throughput}


def plan(s: Shape, phases: list[Phase], hw: Hardware, throughputs: list[float]) -> dict:
    rows = [plan_phase(s, p, hw, t) for p, t in zip(phases, throughputs)]
    base = sum(r["days"] for r in rows)

    def days(hw2: Hardware, phases2: list[Phase], thr=throughputs) -> float:
        return sum(plan_phase(s, p, hw2, t)["days"] for p, t in zip(phases2, thr))

    knobs = {
        "2x link bandwidth": days(replace(hw, link_gbps=2 * hw.link_gbps), phases),
        "bf16 gradients on the wire": days(replace(hw, wire="bf16"), phases) if wire_bytes(hw) > 2 else base,
        "perfect overlap": days(replace(hw, overlap=1.0), phases),
        "2x nodes": days(replace(hw, nodes=2 * hw.nodes), phases),
        "half the accumulation (2x micro-batch, if memory allows)":
            days(hw, [replace(p, accum=max(1, p.accum // 2)) for p in phases]),
        "half as many evaluations": days(hw, [replace(p, eval_every=2 * p.eval_every) for p in phases]),
    }
    best = min(knobs, key=knobs.get)
    return {"phases": rows, "total_days": base, "knobs_days": knobs, "best_knob": best,
            "hardware": hw.__dict__, "grad_elements": grad_elements(s)}


def print_plan(out: dict) -> None:
    hw = out["hardware"]
    print(f"{hw['nodes']} node(s) x {hw['gpus_per_node']} GPU(s), link {hw['link_gbps']:g} Gb/s, intra "
          f"{hw['intra_gbps']:g} Gb/s, {hw['wire']} on the wire, gradient {out['grad_elements'] / 1e6:.1f} M elements")
    for r in out["phases"]:
        sec = r["seconds"]
        tot = sum(sec.values())
        share = ", ".join(f"{k} {v / 86400:.2f} d ({v / tot:.0%})" for k, v in sec.items() if v)
        hf = r["hidden_fraction"]
        print(f"{r['phase']}: {r['days']:.2f} days = {share}")
        print(f"   {r['steps']} steps of {r['global_batch']} ({r['accum']} micro-steps), {r['step_s']:.2f} s/step, "
              f"{r['samples_per_s']:.0f} samples/s; allreduce {r['comm_per_step_s']:.3f} s/step, exposed "
              f"{r['exposed_per_step_s']:.3f} s" + (f" (hidden {hf:.0%})" if hf is not None else ""))
    print(f"total: {out['total_days']:.2f} days")
    for k, v in sorted(out["knobs_days"].items(), key=lambda kv: kv[1]):
        print(f"   {k:58s} {v:7.2f} days ({v - out['total_days']:+.2f})")
    print(f"helps most: {out['best_knob']}")


# ---------------------------------------------------------------- configs


def phase_from_config(path: str, name: str, caller: dict[str, str], eval_samples: int
                      ) -> tuple[Shape, Phase, Config, dict[str, str]]:
    """A phase as its config script runs it for a caller with environment ``caller`` (the
    launchers' own reading: bert.config_script); ``eval_samples`` where the config evaluates
    on the whole held-out set (data.eval_samples=0)."""
    cfg, env, origins = config_script.load(path, caller)
    for key, origin in origins.items():
        if not origin.endswith(f" in {Path(path).name}"):
            print(f"{name}: {key} from {origin}, over the config", file=sys.stderr)
    gpus = int(env["DGXNNODES"]) * int(env["DGXNGPU"])
    gbs = global_batch_size(cfg, gpus)
    interval = cfg.eval.interval_samples
    d = cfg.data
    phase = Phase(name, d.max_seq_length, d.max_predictions_per_seq, gbs, cfg.optim.total_steps,
                  cfg.run.grad_accum_steps, interval // gbs if interval > 0 else 0, d.eval_samples or eval_samples)
    return Shape.of(cfg.model), phase, cfg, env


# ---------------------------------------------------------------- the check against bench/grad_sync.py


def check_bench(runs: list[dict]) -> dict:
    """Model vs bench/grad_sync.py: exposed communication of clip_then_allreduce (nothing
    overlapped) and bucketwise (overlapped) at each simulated link speed."""
    none = [r for r in runs if not r.get("link_gbps")]
    if not none:
        raise SystemExit("--check-bench needs one run without --link-gbps (calibrates the loopback allreduce)")
    model = runs[0]["model"]
    s = BASE if model == "bert-base" else Shape.of(ModelConfig(vocab_size=512, hidden_size=64, num_layers=2, num_heads=4,
                                                            intermediate_size=128, max_position_embeddings=64))
    cap = runs[0]["bucket_cap_mb"]
    nbytes = 4.0 * grad_elements(s)
    if grad_elements(s) != runs[0]["grad_numel"]:
        raise SystemExit(f"model shape mismatch: {grad_elements(s)} elements here, {runs[0]['grad_numel']} in the bench")
    # the real gloo allreduce on 2 shared cores: a serial link of this per-byte cost
    loop = none[0]["exposed"]["clip_then_allreduce"] / nbytes
    rows = []
    for r in sorted(runs, key=lambda r: r.get("link_gbps") or math.inf):
        gbps = r.get("link_gbps")
        window = 2 / 3 * r["to_last_grad"]["compute_only"]
        row = {"link_gbps": gbps}
        for variant, overlapped, wb in (("clip_then_allreduce", False, 4.0), ("bucketwise", True, 4.0),
                                        ("bucketwise_bf16", True, 2.0)):
            if variant not in r["exposed"]:
                continue
            # gloo's loopback: calibrated per fp32 byte; the simulated link charges the wire bytes
            links = [(loop * 4.0 / wb, wb)] + ([(2 * (2 - 1) / 2 * 8 / (gbps * 1e9), wb)] if gbps else [])
            total, exposed = exposed_comm(s, cap, links, window)
            pred = exposed if overlapped else total
            meas = r["exposed"][variant]
            row[variant] = {"predicted": pred, "measured": meas, "error": (pred - meas) / meas if meas > 0 else None}
        rows.append(row)
    errs = [abs(v["error"]) for row in rows for k, v in row.items() if isinstance(v, dict) and v["error"] is not None
            and row["link_gbps"]]
    return {"rows": rows, "max_abs_error": max(errs) if errs else None,
            "mean_abs_error": sum(errs) / len(errs) if errs else None,
            "note": "exposed = step tail after the last gradient minus compute_only's; loopback calibrated "
                    "from the no-link run's clip_then_allreduce, so its error there is 0 by construction"}


def runs_from_doc(path: str | Path) -> list[dict]:
    """The measured "Tail / to_last_grad" table of docs/grad_sync.md (BERT-base, 2 ranks,
    25 MB buckets) as bench/grad_sync.py --json would report it."""
    lines = Path(path).read_text().splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith("Tail / to_last_grad per step")), None)
    if start is None:
        raise SystemExit(f"error: {path} holds no 'Tail / to_last_grad per step' table; the grad-sync "
                         "benchmark's measured table is in docs/grad_sync.md")
    header = [c.strip() for c in lines[start + 2].strip("|").split("|")]
    names = [h.split(" (")[0] for h in header[1:-1]]
    names = ["clip_after_allreduce" if n == "clip_after" else n for n in names]
    runs = []
    for ln in lines[start + 4:]:
        if not ln.startswith("|"):
            break
        cells = [c.strip() for c in ln.strip("|").split("|")]
        pairs = [tuple(float(x) for x in c.split(" / ")) for c in cells[1:-1]]
        tail = dict(zip(names, (t for t, _ in pairs)))
        link = None if cells[0] == "none" else float(cells[0].split()[0])
        runs.append({"link_gbps": link, "model": "bert-base", "bucket_cap_mb": 25.0,
                     "grad_numel": grad_elements(BASE),
                     "exposed": {k: v - tail["compute_only"] for k, v in tail.items() if k != "compute_only"},
                     "to_last_grad": dict(zip(names, (g for _, g in pairs)))})
    return runs


def print_check(out: dict) -> None:
    print(f"{'link':>8s} | {'variant':20s} | {'predicted':>9s} | {'measured':>9s} | error")
    for row in out["rows"]:
        for k, v in row.items():
            if isinstance(v, dict):
                err = f"{v['error']:+.0%}" if v["error"] is not None else "-"
                link = f"{row['link_gbps']:g} Gb/s" if row["link_gbps"] else "none"
                print(f"{link:>8s} | {k:20s} | {v['predicted']:9.3f} | {v['measured']:9.3f} | {err}")
    if out["max_abs_error"] is not None:
        print(f"simulated links: mean |error| {out['mean_abs_error']:.0%}, max {out['max_abs_error']:.0%}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", choices=sorted(RECIPES), default="nvidia-large")
    ap.add_argument("--configs", nargs="+", metavar="CONFIG_SH",
                    help="config_*.sh of each phase (batch, accumulation, steps, nodes, GPUs, model, eval "
                         "interval from them; the flags below override the hardware)")
    ap.add_argument("--throughput", default="", help="per-GPU samples/s of each phase, comma-separated")
    ap.add_argument("--bench", default="", help="bench/gpu_bert_large.py JSON instead of --throughput")
    ap.add_argument("--nodes", type=int)
    ap.add_argument("--gpus-per-node", type=int)
    ap.add_argument("--accum", default="", help="micro-steps per optimizer step of each phase, comma-separated")
    d = Hardware()
    ap.add_argument("--link-gbps", type=float, default=d.link_gbps, help="inter-node bandwidth per node")
    ap.add_argument("--intra-gbps", type=float, default=d.intra_gbps)
    ap.add_argument("--wire", choices=(*WIRE_BYTES, "powersgd"), default=d.wire)
    ap.add_argument("--powersgd-ratio", type=float, default=d.powersgd_ratio)
    ap.add_argument("--bucket-mb", type=float, default=d.bucket_mb)
    ap.add_argument("--overlap", type=float, default=None,
                    help="hidden share of the communication (default: the bucket model)")
    ap.add_argument("--eval-every", type=int, default=None, help="steps between evaluations")
    ap.add_argument("--eval-samples", type=int, default=10000)
    ap.add_argument("--ckpt-minutes", type=float, default=d.ckpt_minutes)
    ap.add_argument("--ckpt-gbps", type=float, default=d.ckpt_gbps)
    ap.add_argument("--preempt-hours", type=float, default=d.preempt_hours)
    ap.add_argument("--requeue-minutes", type=float, default=d.requeue_minutes)
    ap.add_argument("--check-bench", nargs="+", metavar="JSON", help="bench/grad_sync.py --json outputs")
    ap.add_argument("--check-doc", "--check-readme", dest="check_doc", metavar="MD",
                    help="the same check on the measured table of docs/grad_sync.md (--check-readme: its old name)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if a.check_bench or a.check_doc:
        runs = runs_from_doc(a.check_doc) if a.check_doc else []
        out = check_bench(runs + [json.loads(Path(p).read_text()) for p in a.check_bench or []])
        print(json.dumps(out, indent=1)) if a.json else print_check(out)
        return 0
    nodes, gpn = 1, 8
    if a.configs:
        try:
            loaded = [phase_from_config(c, f"phase{i + 1}", dict(os.environ), a.eval_samples)
                      for i, c in enumerate(a.configs)]
        except ConfigError as e:
            print(f"plan.py: {e}", file=sys.stderr)
            return 2
        # Each phase starts from the one before: the same model, or its weights cannot load.
        for (_, _, before, _), (_, _, after, _), i in zip(loaded, loaded[1:], range(2, len(loaded) + 1)):
            problems = handover_problems(before, after)
            if problems:
                print(f"plan.py: phase {i} ({a.configs[i - 1]}) could not start from phase {i - 1}'s weights "
                      f"({a.configs[i - 2]}): " + "; ".join(problems), file=sys.stderr)
                return 2
        shape, phases = loaded[0][0], [p for _, p, _, _ in loaded]
        first, env = loaded[0][2], loaded[0][3]
        nodes, gpn = int(env["DGXNNODES"]), int(env["DGXNGPU"])
        # the config's gradient sync, unless the command line says otherwise
        comp = first.grad_sync.compression
        if a.wire == d.wire and comp != "none":
            a.wire = comp
        if a.bucket_mb == d.bucket_mb:
            a.bucket_mb = first.grad_sync.bucket_cap_mb
    else:
        shape, phases = RECIPES[a.recipe]
    nodes, gpn = a.nodes or nodes, a.gpus_per_node or gpn
    if a.accum:
        phases = [replace(p, accum=int(x)) for p, x in zip(phases, a.accum.split(","))]
    phases = [replace(p, eval_every=a.eval_every if a.eval_every is not None else p.eval_every,
                      eval_samples=a.eval_samples if not a.configs else p.eval_samples) for p in phases]
    if a.bench:
        thr = throughputs_from_bench(a.bench, shape, phases)
    elif a.throughput:
        thr = [float(x) for x in a.throughput.split(",")]
    else:
        ap.error("give --throughput (per-GPU samples/s of each phase) or --bench")
    if len(thr) != len(phases):
        ap.error(f"{len(phases)} phases but {len(thr)} throughputs")
    hw = Hardware(nodes, gpn, a.link_gbps, a.intra_gbps, a.wire, a.powersgd_ratio, a.bucket_mb, a.overlap,
                  a.ckpt_minutes, a.ckpt_gbps, a.preempt_hours, a.requeue_minutes)
    out = plan(shape, phases, hw, thr)
    print(json.dumps(out, indent=1)) if a.json else print_plan(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
