#!/usr/bin/env python3
"""What static token budgets cost: the ``auto`` ladder of ``bert/budget.py`` per local batch
and sampler mode, its expected padding, and how many rungs a run actually hits.

For each (sampler mode, local batch) the ladder is built exactly as a run builds it
(``bert.budget.layout_for`` on the config, before any data is touched), then checked on
``--steps`` held-out micro-batches drawn with another seed: uniform random sampling draws
i.i.d. lengths from the histogram (what the closed division's per-shard permutations give);
the stratified modes run the project's own ``IndexSampler`` (strata counts, rounding, deal)
over a synthetic population drawn from the histogram. Columns:

- ``rungs``: the ladder (tokens; the last is the full grid local_batch x max_seq_length);
- ``pad_expected``: E[rung(T) - T] / E[T] under the distribution the ladder was fit to;
- ``pad_measured``: the same on the held-out draws; ``hit``: rungs used at least once;
  ``full_grid``: share of steps that needed the top rung;
- ``flops_tokens``: the padding's share of a BERT-Large training step's FLOPs (pad rows run
  every per-token GEMM, never attention); ``flops_masked``: the same for the static masked
  count (local_batch x max_predictions_per_seq head rows instead of the real ones).

Modes: ``random`` (closed division), ``stratified`` (the stratify step's 4 strata, counts
6/3/2/5 of 16, per rank, no deal), ``stratified+best`` (docs/load_balance.md's measured best: strata of 8
tokens, drawn per group of 8 ranks with carried rounding, greedy deal).

    python tools/budget_ladder.py                      # the table (BENCHMARKS.md)
    python tools/budget_ladder.py --json               # one JSON list
    python tools/budget_ladder.py --sweep 16           # padding vs number of rungs, random, batch 16
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

PKG = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(PKG))

from bert.flops import Shape, attention_flops, head_flops, layer_flops  # noqa: E402
from bert import budget  # noqa: E402
from bert.trainer import train_layout  # noqa: E402
from bert.config import build_config  # noqa: E402

MODES = {
    "random": {},
    "stratified": {"sampler.mode": "stratified"},
    "stratified+best": {"sampler.mode": "stratified", "sampler.strata_width": 8, "sampler.draw": "group",
                        "sampler.rounding": "carry", "sampler.deal": "greedy", "sampler.group_size": 8},
}
LARGE = Shape(hidden=1024, layers=24, intermediate=4096, vocab=30522)  # BERT-Large


def config(mode: str, local_batch: int, max_seq_length: int, max_pred: int):
    over = {"run.local_batch_size": local_batch, "data.token_budgets": "auto", "run.seed": 1,
            "data.max_seq_length": max_seq_length, "model.max_position_embeddings": max(512, max_seq_length),
            "data.max_predictions_per_seq": max_pred, **MODES[mode]}
    if mode != "random":
        over.update({"run.division": "open", "optim.name": "adam"})
    return build_config(over)


def held_out(cfg, world_size: int, steps: int, seed: int) -> np.ndarray:
    """Real tokens of ``steps`` micro-batches drawn with a seed the ladder never saw."""
    pmf = budget.length_pmf(cfg.data.max_seq_length)
    if cfg.sampler.mode == "random" and cfg.sampler.deal == "none":
        rng = np.random.default_rng(seed)
        return rng.choice(len(pmf), size=(steps, cfg.run.local_batch_size), p=pmf).sum(1)
    return budget.simulated_token_counts(cfg.sampler, max_seq_length=cfg.data.max_seq_length,
                                         local_batch=cfg.run.local_batch_size, world_size=world_size,
                                         hidden=cfg.model.hidden_size, pmf=pmf, draws=steps, seed=seed)


def step_flops(pmf: np.ndarray, local_batch: int, max_pred: int) -> tuple[float, float]:
    """(expected useful training FLOPs of a micro-batch, expected real masked rows per sample)
    for BERT-Large; masking as create_pretraining_data: min(P, max(1, round(0.15 L)))."""
    lengths = np.arange(len(pmf))
    masked = np.minimum(max_pred, np.maximum(1, np.round(0.15 * lengths)))
    mean_len, mean_masked = float((pmf * lengths).sum()), float((pmf * masked).sum())
    att = sum(p * attention_flops(LARGE, int(n)) for n, p in enumerate(pmf) if p)
    fwd = layer_flops(LARGE, 1) * mean_len + att + head_flops(LARGE, 1, 0) + head_flops(LARGE, 0, 1) * mean_masked
    return 3.0 * local_batch * fwd, mean_masked


def measure(mode: str, local_batch: int, world_size: int, steps: int, max_seq_length: int, max_pred: int) -> dict:
    cfg = config(mode, local_batch, max_seq_length, max_pred)
    layout = train_layout(cfg, world_size)
    pmf = budget.token_pmf(cfg.sampler, max_seq_length, local_batch, world_size, cfg.model.hidden_size)
    rungs = np.array(layout.rungs)
    t = held_out(cfg, world_size, steps, seed=12345)
    used = rungs[np.searchsorted(rungs, t)]
    length_pmf = budget.length_pmf(max_seq_length)
    useful, mean_masked = step_flops(length_pmf, local_batch, max_pred)
    pad_tokens = float((used - t).mean())
    return {"mode": mode, "local_batch": local_batch, "world_size": world_size, "steps": steps,
            "rungs": [int(r) for r in rungs], "pad_expected": budget.expected_padding(pmf, layout.rungs),
            "pad_measured": pad_tokens / float(t.mean()), "hit": int(len(np.unique(used))),
            "full_grid": float((used == rungs[-1]).mean()), "tokens_mean": float(t.mean()),
            "tokens_std": float(t.std()),
            "flops_tokens": 3.0 * layer_flops(LARGE, 1) * pad_tokens / useful,
            "masked_slots": layout.masked_slots, "masked_real_mean": local_batch * mean_masked,
            "flops_masked": 3.0 * head_flops(LARGE, 0, 1) * (layout.masked_slots - local_batch * mean_masked) / useful}


def sweep(local_batch: int, max_seq_length: int) -> list[dict]:
    """Expected padding of the best ladder with 1..8 rungs (``bert.budget.ladder``; random sampling)."""
    pmf = budget.random_token_pmf(budget.length_pmf(max_seq_length), local_batch)
    top = local_batch * max_seq_length
    out = []
    for k in range(1, budget.MAX_RUNGS + 1):
        rungs = budget.ladder(pmf, top, k)
        out.append({"rungs_count": k, "rungs": list(rungs), "pad_expected": budget.expected_padding(pmf, rungs)})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--local-batch", default="16,32,64,96")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--world-size", type=int, default=8, help="ranks (the deal groups are min(8, this))")
    ap.add_argument("--steps", type=int, default=4096, help="held-out micro-batches per case")
    ap.add_argument("--max-seq-length", type=int, default=512)
    ap.add_argument("--max-pred", type=int, default=76)
    ap.add_argument("--sweep", type=int, default=0, metavar="B",
                    help="instead: padding vs number of rungs under random sampling at local batch B")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.sweep:
        rows = sweep(args.sweep, args.max_seq_length)
        if args.json:
            print(json.dumps(rows))
        else:
            print("| rungs | expected padding | ladder |\n|---|---|---|")
            for r in rows:
                print(f"| {r['rungs_count']} | {100 * r['pad_expected']:.2f}% | {', '.join(map(str, r['rungs']))} |")
        return 0
    rows = [measure(m, int(b), args.world_size, args.steps, args.max_seq_length, args.max_pred)
            for m in args.modes.split(",") for b in args.local_batch.split(",")]
    if args.json:
        print(json.dumps(rows))
        return 0
    print("| mode | local batch | real tokens mean (std) | ladder | pad expected | pad measured | rungs hit "
          "| full grid | FLOPs: pad tokens | FLOPs: masked slots |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| `{r['mode']}` | {r['local_batch']} | {r['tokens_mean']:.0f} ({r['tokens_std']:.0f}) | "
              f"{', '.join(map(str, r['rungs']))} | {100 * r['pad_expected']:.2f}% | {100 * r['pad_measured']:.2f}% | "
              f"{r['hit']} of {len(r['rungs'])} | {100 * r['full_grid']:.2f}% | {100 * r['flops_tokens']:.2f}% | "
              f"{100 * r['flops_masked']:.2f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
