#!/usr/bin/env python3
"""Fused QKV and vocabulary padding on and off: exactness and CPU time, on this machine.

Four variants of one model (``model.fused_qkv`` off/on x ``model.vocab_pad_multiple`` 1/64),
from the same weights:

- **steps**: each trains the same unpadded batches (MLPerf Wikipedia lengths, seq 512, 15%
  masked; dropout drawn from the same seed) with the config's LAMB: forward, backward,
  global-norm clip 1.0, step. Recorded: the largest difference from the plain model (fused
  off, no padding) in every step's loss and in every parameter at the end (through
  ``state_dict``, so at vocab_size rows), and each step's wall and CPU time.
- **ops**: the two pieces the keys change, alone, forward + backward, ``--op-reps`` times
  each: the first layer's Q/K/V projection (``SelfAttention`` with attention replaced by
  q + k + v) on a batch's tokens, and the MLM head plus its cross-entropy on the masked rows.

Steps and repetitions are interleaved across the variants (who goes first rotates). Times are
the stepping thread's CPU time (``time.thread_time``; one torch thread by default, so the work
runs on that thread): on a busy shared machine another process's load stretches the wall
clock many times over but this much less. Medians and minima; ratios against the plain model.

    python bench/model_levers.py                      # the table
    python bench/model_levers.py --out results/levers.json

A benchmark, not a test: the times depend on the machine and its load. The default model
(hidden 256, 2 layers, 4 samples a step) keeps the real 30,522-token vocabulary, so the
decoder GEMMs that padding changes are the benchmark's own.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common  # noqa: E402
from bert.config import ModelConfig, OptimConfig  # noqa: E402
from bert.batches import collate  # noqa: E402
from bert.model import BertForPreTraining, pretraining_loss  # noqa: E402
from bert.optim import build_optimizer  # noqa: E402

LABELS = ("mlm_labels", "nsp_labels")
VARIANTS = {"plain": (False, 1), "fused_qkv": (True, 1), "vocab_pad_64": (False, 64), "both": (True, 64)}


def make_variant(cfg: ModelConfig, fused: bool, pad: int, weights: dict[str, torch.Tensor]):
    """A model of the variant loaded with ``weights`` (HF names, vocab_size rows), its LAMB,
    and step(batch) -> loss."""
    model = BertForPreTraining(dataclasses.replace(cfg, fused_qkv=fused, vocab_pad_multiple=pad)).train()
    model.load_state_dict(weights)
    opt, _ = build_optimizer(model, OptimConfig(), "cpu")

    def step(batch: dict) -> float:
        mlm, nsp = model(**{k: v for k, v in batch.items() if k not in LABELS})
        loss = pretraining_loss(mlm, nsp, batch["mlm_labels"], batch["nsp_labels"])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        return float(loss.detach())

    return model, step


def op_calls(model: BertForPreTraining, hidden: torch.Tensor, masked: torch.Tensor,
             labels: torch.Tensor) -> dict[str, Callable[[], None]]:
    """The two pieces, forward + backward, on fixed activations (gradients accumulate:
    their cost does not depend on the values)."""
    attn = model.bert.encoder.layer[0].attention.self

    def qkv() -> None:
        attn(hidden, lambda q, k, v, dropout_p: q + k + v).sum().backward()

    def head() -> None:
        F.cross_entropy(model.cls.predictions(masked), labels).backward()

    return {"qkv": qkv, "head": head}


def _stats(seconds: list[float]) -> dict[str, float]:
    return {"median_ms": 1000 * statistics.median(seconds), "min_ms": 1000 * min(seconds)}


def _rotations(names: list[str], i: int) -> list[str]:
    return names[i % len(names):] + names[: i % len(names)]


def run(cfg: ModelConfig, batch: int, steps: int, warmup: int, op_reps: int, seed: int) -> dict:
    samples = common.make_batches(warmup + steps, batch, 512, 76, cfg.vocab_size, seed)
    batches = [collate(b, True, 512) for b in samples]
    torch.manual_seed(seed)
    weights = BertForPreTraining(cfg).state_dict()
    built = {name: make_variant(cfg, f, p, weights) for name, (f, p) in VARIANTS.items()}
    names = list(built)
    step_cpu: dict[str, list[float]] = {n: [] for n in names}
    step_wall: dict[str, list[float]] = {n: [] for n in names}
    losses: dict[str, list[float]] = {n: [] for n in names}
    for i, b in enumerate(batches):
        for name in _rotations(names, i):
            torch.manual_seed(seed + i)  # the same dropout masks in every variant
            t0, c0 = time.perf_counter(), time.thread_time()
            losses[name].append(built[name][1](b))
            if i >= warmup:
                step_wall[name].append(time.perf_counter() - t0)
                step_cpu[name].append(time.thread_time() - c0)
    g = torch.Generator().manual_seed(seed)
    tokens, masked = batches[0]["input_ids"].numel(), batches[0]["mlm_labels"].numel()
    hidden = torch.randn(tokens, cfg.hidden_size, generator=g, requires_grad=True)
    head_in = torch.randn(masked, cfg.hidden_size, generator=g, requires_grad=True)
    labels = torch.randint(0, cfg.vocab_size, (masked,), generator=g)
    calls = {name: op_calls(model, hidden, head_in, labels) for name, (model, _) in built.items()}
    op_cpu: dict[str, dict[str, list[float]]] = {n: {"qkv": [], "head": []} for n in names}
    for i in range(op_reps + 2):
        for name in _rotations(names, i):
            for op, call in calls[name].items():
                c0 = time.thread_time()
                call()
                if i >= 2:
                    op_cpu[name][op].append(time.thread_time() - c0)
    plain = built["plain"][0].state_dict()
    out = {}
    for name, (model, _) in built.items():
        final = model.state_dict()
        r = {"fused_qkv": VARIANTS[name][0], "vocab_pad_multiple": VARIANTS[name][1],
             "vocab_rows": model.bert.embeddings.word_embeddings.weight.shape[0],
             "max_loss_diff": max(abs(a - b) for a, b in zip(losses[name], losses["plain"])),
             "max_param_diff": max(float((final[k] - v).abs().max()) for k, v in plain.items()),
             "step_cpu": _stats(step_cpu[name]), "step_wall": _stats(step_wall[name]),
             **{f"{op}_cpu": _stats(op_cpu[name][op]) for op in ("qkv", "head")}}
        for part in ("step_cpu", "qkv_cpu", "head_cpu"):
            r[part]["vs_plain"] = r[part]["median_ms"] / (1000 * statistics.median(
                step_cpu["plain"] if part == "step_cpu" else op_cpu["plain"][part[:-4]]))
        out[name] = r
    return {"variants": out, "tokens": tokens, "masked_rows": masked}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_model_args(ap)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--op-reps", type=int, default=20, help="timed repetitions of each op per variant")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0 = torch's choice)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads,
                      intermediate_size=4 * args.hidden, attention_backend="sdpa", vocab_pad_multiple=1)
    res = run(cfg, args.batch, args.steps, args.warmup, args.op_reps, args.seed)
    doc = {**res, "model": dataclasses.asdict(cfg), "batch": args.batch, "steps": args.steps, "warmup": args.warmup,
           "op_reps": args.op_reps, "torch_threads": torch.get_num_threads(), "machine": common.machine()}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"CPU ms (median; x plain) over {args.steps} steps of {res['tokens']} tokens and {args.op_reps} op reps; "
          f"load average {doc['machine']['loadavg']}")
    for name, r in res["variants"].items():
        parts = "  ".join(f"{p} {r[p + '_cpu']['median_ms']:7.1f} ({r[p + '_cpu']['vs_plain']:.3f}x)"
                          for p in ("step", "qkv", "head"))
        print(f"{name:13s} rows {r['vocab_rows']:6d}  {parts}  max |loss diff| {r['max_loss_diff']:.1e}"
              f"  max |param diff| {r['max_param_diff']:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
