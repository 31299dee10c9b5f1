#!/usr/bin/env python3
"""model.activation's two GELUs -- gelu_tanh (the reference's, the default) and gelu_erf --
on this machine's CPU, on every path the GELU runs through.

- **steps**: the training step the loop runs (``bert.trainer.build_learner`` and
  ``train_step``: forward, backward, global-norm clip 1.0, the config's LAMB, the schedule)
  on unpadded batches of MLPerf Wikipedia lengths (seq 512, 15% masked), for each activation
  on each path: ``eager``; ``compiled`` (``model.compile_layers``: inductor compiles each
  encoder layer, the GELU fused into its neighbours' kernels); ``fp8`` (``precision.fp8=
  tensorwise``, torchao's float8 training: on a CPU its emulation, whose GEMMs are not the
  GPU's, so its times say only whether the GELU's share moves). Steps are interleaved across
  the variants (who goes first rotates), from the same weights and batches; the first
  ``--warmup`` of each (the compiles) are not timed.
- **ops**: forward + backward, eager and (with the compiled path) under torch.compile,
  ``--op-reps`` times each, of the GELU alone on [tokens, 4 hidden] and of the feed-forward
  layer's first half (``bert.model.Intermediate``: the [tokens, hidden] x [hidden, 4 hidden]
  GEMM, its bias and the GELU).

Every variant attends with the same backend (``--attention``, default ``math``: sdpa's
varlen path raises an InductorError under compile_layers' dynamic shapes on a CPU with torch
2.13, with either GELU; attention holds no GELU, so the choice moves both columns alike).

Times are the stepping thread's CPU time (``time.thread_time``; one torch thread by default,
so the work and inductor's kernels run on that thread): on a busy shared machine another
process's load stretches the wall clock but this much less. Reported: medians and minima,
and tanh / erf as the median of the ratios of paired samples (the same batch, the same
repetition), which the batches' sizes and the load move far less; every sample is in the
JSON. Also the largest difference between the two activations' losses (they are different
functions: they train alike, not identically).

    python bench/activation.py                       # the table
    python bench/activation.py --out results/activation.json

A benchmark, not a test: the times depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common  # noqa: E402
from bert.batches import collate  # noqa: E402
from bert.config import build_config  # noqa: E402
from bert.model import BertForPreTraining, Intermediate  # noqa: E402
from bert.trainer import build_learner, train_step  # noqa: E402

ACTIVATIONS = ("gelu_tanh", "gelu_erf")
PATHS = {"eager": {}, "compiled": {"model.compile_layers": "true"}, "fp8": {"precision.fp8": "tensorwise"}}


def _stats(seconds: list[float]) -> dict:
    return {"median_ms": 1000 * statistics.median(seconds), "min_ms": 1000 * min(seconds),
            "all_ms": [1000 * s for s in seconds]}


def _rotations(names: list, i: int) -> list:
    return names[i % len(names):] + names[: i % len(names)]


def _paired(tanh: list[float], erf: list[float]) -> float:
    """Median over the repetitions of tanh's time / erf's on the same batch or input: the
    batches' sizes and the machine's load move both alike, the ratio far less."""
    return statistics.median(t / e for t, e in zip(tanh, erf))


def model_overrides(args) -> dict[str, str]:
    return {"model.vocab_size": str(args.vocab), "model.hidden_size": str(args.hidden),
            "model.num_layers": str(args.layers), "model.num_heads": str(args.heads),
            "model.intermediate_size": str(4 * args.hidden), "model.attention_backend": args.attention,
            "data.max_seq_length": str(args.seq), "data.max_predictions_per_seq": str(args.max_pred),
            "model.max_position_embeddings": str(args.seq), "precision.dtype": "fp32"}


def steps(args, paths: list[str]) -> dict:
    """Every (path, activation) variant trains the same batches from the same weights."""
    samples = common.make_batches(args.warmup + args.steps, args.batch, args.seq, args.max_pred, args.vocab, args.seed)
    batches = [collate(b, True, args.seq) for b in samples]
    base = model_overrides(args)
    torch.manual_seed(args.seed)
    weights = BertForPreTraining(build_config(base).model).state_dict()
    built = {}
    for path in paths:
        for act in ACTIVATIONS:
            cfg = build_config({**base, **PATHS[path], "model.activation": act,
                                "run.local_batch_size": str(args.batch)})
            learner, impl = build_learner(cfg, 1, torch.device("cpu"))
            learner.model.load_state_dict(weights)
            learner.model.train()
            built[(path, act)] = learner
    names = list(built)
    cpu = {n: [] for n in names}
    wall = {n: [] for n in names}
    losses = {n: [] for n in names}
    for i, b in enumerate(batches):
        for name in _rotations(names, i):
            torch.manual_seed(args.seed + i)  # the same dropout masks in every variant
            t0, c0 = time.perf_counter(), time.thread_time()
            loss, _ = train_step(built[name], iter([b]), 1)
            losses[name].append(float(loss))
            if i >= args.warmup:
                wall[name].append(time.perf_counter() - t0)
                cpu[name].append(time.thread_time() - c0)
    out = {}
    for path in paths:
        tanh, erf = (path, "gelu_tanh"), (path, "gelu_erf")
        out[path] = {"gelu_tanh": {"step_cpu": _stats(cpu[tanh]), "step_wall": _stats(wall[tanh])},
                     "gelu_erf": {"step_cpu": _stats(cpu[erf]), "step_wall": _stats(wall[erf])},
                     "tanh_over_erf": _paired(cpu[tanh], cpu[erf]),
                     "max_loss_diff": max(abs(a - c) for a, c in zip(losses[tanh], losses[erf])),
                     "losses": {"gelu_tanh": losses[tanh], "gelu_erf": losses[erf]}}
    tokens = [int(b["input_ids"].numel()) for b in batches[args.warmup:]]
    return {"paths": out, "tokens_per_step": statistics.mean(tokens), "optimizer": impl}


def ops(args, kinds: list[str]) -> dict:
    """Forward + backward, per activation, for each of ``kinds`` ("eager", "compiled"), of
    two ops: ``gelu``, the activation alone on a [tokens, 4 hidden] input, and
    ``intermediate``, the feed-forward layer's first half (bert.model.Intermediate: the GEMM,
    its bias and the GELU) on [tokens, hidden]."""
    tokens = int(args.batch * args.seq * 0.5)  # about a batch's real tokens (the mean length is half of 512)
    base = build_config(model_overrides(args)).model
    g = torch.Generator().manual_seed(args.seed)
    inputs = {"gelu": torch.randn(tokens, 4 * args.hidden, generator=g, requires_grad=True),
              "intermediate": torch.randn(tokens, args.hidden, generator=g, requires_grad=True)}
    calls = {}
    for act in ACTIVATIONS:
        torch.manual_seed(args.seed)
        layer = Intermediate(dataclasses.replace(base, activation=act))
        alone = functools.partial(F.gelu, approximate=layer.approximate)
        for kind in kinds:
            for op, fn in (("gelu", alone), ("intermediate", layer)):
                calls[(op, kind, act)] = torch.compile(fn) if kind == "compiled" else fn
    names = list(calls)
    cpu = {n: [] for n in names}
    for i in range(args.op_reps + 2):
        for name in _rotations(names, i):
            x = inputs[name[0]]
            c0 = time.thread_time()
            calls[name](x).sum().backward()
            if i >= 2:
                cpu[name].append(time.thread_time() - c0)
    return {op: {kind: {**{act: _stats(cpu[(op, kind, act)]) for act in ACTIVATIONS},
                        "tanh_over_erf": _paired(cpu[(op, kind, "gelu_tanh")], cpu[(op, kind, "gelu_erf")])}
                 for kind in kinds} for op in inputs} | {"tokens": tokens}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_model_args(ap)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--max-pred", type=int, default=76)
    ap.add_argument("--warmup", type=int, default=2, help="untimed first steps per variant (the compiles)")
    ap.add_argument("--op-reps", type=int, default=20, help="timed repetitions of the op per variant")
    ap.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated, of {', '.join(PATHS)}")
    ap.add_argument("--attention", default="math",
                    help="model.attention_backend of every variant (default math: on a CPU with torch 2.13, sdpa's "
                         "varlen path does not compile under model.compile_layers' dynamic shapes, whichever the GELU)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0 = torch's choice)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    args = ap.parse_args(argv)
    paths = [p for p in args.paths.split(",") if p]
    unknown = [p for p in paths if p not in PATHS]
    if unknown:
        ap.error(f"--paths: unknown {unknown}; known: {list(PATHS)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    kinds = ["eager"] + (["compiled"] if "compiled" in paths else [])
    doc = {"steps": steps(args, paths), "ops": ops(args, kinds), "args": {k: str(v) for k, v in vars(args).items()},
           "machine": common.machine()}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
    s = doc["steps"]
    print(f"CPU ms a step (median, min) over {args.steps} steps of {s['tokens_per_step']:.0f} tokens, "
          f"{s['optimizer']}; tanh/erf: the median of the steps' paired ratios; load average "
          f"{doc['machine']['loadavg']}")
    for path, r in s["paths"].items():
        cells = "  ".join(f"{act} {r[act]['step_cpu']['median_ms']:8.1f} ({r[act]['step_cpu']['min_ms']:8.1f})"
                          for act in ACTIVATIONS)
        print(f"{path:9s} {cells}  tanh/erf {r['tanh_over_erf']:.3f}  max |loss tanh - erf| {r['max_loss_diff']:.1e}")
    o = doc["ops"]
    print(f"on {o['tokens']} tokens, forward + backward, CPU ms (median); tanh/erf: the median of paired ratios")
    for op in ("gelu", "intermediate"):
        for kind in kinds:
            cells = "  ".join(f"{act} {o[op][kind][act]['median_ms']:7.2f}" for act in ACTIVATIONS)
            print(f"{op:12s} {kind:9s} {cells}  tanh/erf {o[op][kind]['tanh_over_erf']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
