#!/usr/bin/env python3
"""Load-balance simulator: how unequal are the ranks' steps under each sampling mode?

Draws sequence lengths from a length histogram (the shipped Wikipedia one by default; the
dataset is large enough that drawing with replacement is exact), forms every rank's local
batch as ``bert/sampler.py`` would (same strata counts, same deal functions), and reports
per step, averaged over ``--steps`` steps:

- ``tokens_max_over_mean``: the busiest rank's real tokens / the mean (unpadded compute);
- ``attention_max_over_mean``: the same for the attention cost sum(L^2);
- ``cost_max_over_mean``: the same for the FLOP model L + L^2/(6 hidden) of BERT-Large;
- ``padding_fraction``: padding share of the computed tokens when each rank pads its batch
  to its own longest sample (``packing``: its packed rows of ``max_len``);
- ``computed_max_over_mean``: the busiest rank's computed tokens (real + padding) / the mean.

Modes: ``random``, ``stratified`` (per-rank counts, e.g. 6/3/2/5 of 16), ``<base>+snake``,
``<base>+greedy``, ``<base>+cost`` (deal within groups of ``--group`` ranks), ``exchange``
(random, then a greedy deal over all ranks: NVIDIA's exchange padding), ``packing`` (random,
then up to 3 per row), and ``stratified+best``: the policy picked by measurement (see
``BEST``): strata of 8 tokens drawn per group with carried rounding, greedy deal.

Two more outputs say whether a stratified mode still samples the data's length mix:
``stratum_share_tv`` (total variation between the strata shares drawn over all simulated
steps and the true ones) and ``step_share_tv`` (the same for one step's batch).

    python tools/balance.py --ranks 1024 --local-batch 16 --group 8 --mode stratified+best --json
    python tools/balance.py --table --steps 20 > table.md   # every mode at 8..4096 ranks
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

PKG = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(PKG))

from bert.batches import pack_ffd  # noqa: E402
from bert.sampler import Strata, attention_cost, deal, even_bounds  # noqa: E402

DEFAULT_HISTOGRAM = PKG / "data" / "wikipedia_seqlen_histogram_512.txt"
# The manifest's strata (input_preprocessing's stratify step): four of 128 tokens at length 512.
MANIFEST_WIDTH = 128
# stratified+best, chosen by measurement (docs/load_balance.md): virtual strata of 8 tokens cut from
# the length index, counts drawn per group of ranks with carried rounding (exact shares),
# greedy longest-first deal inside the group.
BEST = {"strata_width": 8, "draw": "group", "deal": "greedy", "rounding": "carry"}
MODES = ("random", "random+snake", "random+greedy", "stratified", "stratified+snake",
         "stratified+greedy", "stratified+cost", "stratified+best", "exchange", "packing")


def load_histogram(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """(lengths, counts) from 'length count' lines; '#' starts a comment."""
    rows = [line.split("#")[0].split() for line in Path(path).read_text().splitlines()]
    arr = np.array([[int(a), int(b)] for a, b in (r for r in rows if r)], dtype=np.int64)
    return arr[:, 0], arr[:, 1]


def parse_mode(mode: str) -> dict:
    if mode not in MODES:
        raise SystemExit(f"--mode {mode!r} is not one of {', '.join(MODES)}")
    if mode == "stratified+best":
        return {"base": "stratified", **BEST}
    if mode == "exchange":
        return {"base": "random", "deal": "greedy", "draw": "rank", "strata_width": 0, "global": True}
    if mode == "packing":
        return {"base": "random", "deal": "none", "draw": "rank", "strata_width": 0, "pack": True}
    base, _, how = mode.partition("+")
    return {"base": base, "deal": how or "none", "draw": "rank", "strata_width": MANIFEST_WIDTH}


def draw_step(rng, lengths, probs, strata, counts, units, unit_size):
    """[units, unit_size] lengths: each unit takes counts[k] from stratum k (conditional)."""
    if strata is None:
        return rng.choice(lengths, size=(units, unit_size), p=probs)
    parts = []
    k_of = strata.of(lengths)
    for k, c in enumerate(counts):
        if c:
            p = np.where(k_of == k, probs, 0.0)
            parts.append(rng.choice(lengths, size=(units, int(c)), p=p / p.sum()))
    return np.concatenate(parts, axis=1)


def simulate(mode: str, ranks: int, local_batch: int, group: int, steps: int, seed: int,
             lengths: np.ndarray, counts: np.ndarray, max_len: int = 512, hidden: int = 1024,
             strata_width: int = 0, draw: str = "", rounding: str = "") -> dict:
    """One mode; ``strata_width`` / ``draw`` override the mode's for stratified modes."""
    spec = parse_mode(mode)
    if spec["base"] == "stratified":
        spec["strata_width"] = strata_width or spec["strata_width"]
        spec["draw"] = draw or spec["draw"]
        spec["rounding"] = rounding or spec.get("rounding", "fixed")
    group = ranks if spec.get("global") or group <= 0 else group
    if ranks % group:
        raise SystemExit(f"--group {group} does not divide --ranks {ranks}")
    probs = counts / counts.sum()
    strata = None
    if spec["base"] == "stratified":
        strata = Strata.from_histogram(lengths, counts, even_bounds(max_len, spec["strata_width"]))
    per_group = spec["draw"] == "group"
    unit_size = local_batch * (group if per_group else 1)
    units = ranks // (group if per_group else 1)
    schedule = strata.schedule(unit_size, spec.get("rounding", "fixed")) if strata else None
    rng = np.random.default_rng(seed)
    acc = {k: [] for k in ("tokens", "attention", "cost", "padding", "computed")}
    for t in range(steps):
        unit_counts = schedule.counts(t) if schedule else None
        drawn = draw_step(rng, lengths, probs, strata, unit_counts, units, unit_size)
        batch = drawn.reshape(ranks // group, group * local_batch)  # rank-major inside a group
        if spec["deal"] != "none":
            dealt = []
            for g in batch:
                owner = deal(g, group, spec["deal"], hidden)
                dealt.append(np.stack([g[owner == r] for r in range(group)]))
            per_rank = np.concatenate(dealt)
        else:
            per_rank = batch.reshape(ranks, local_batch)
        tok = per_rank.sum(1)
        att = (per_rank.astype(np.float64) ** 2).sum(1)
        cost = attention_cost(per_rank, hidden).sum(1)
        if spec.get("pack"):
            computed = np.array([len(pack_ffd(r, max_len)) * max_len for r in per_rank])
        else:
            computed = per_rank.max(1) * local_batch
        acc["tokens"].append(tok.max() / tok.mean())
        acc["attention"].append(att.max() / att.mean())
        acc["cost"].append(cost.max() / cost.mean())
        acc["padding"].append(1.0 - tok.sum() / computed.sum())
        acc["computed"].append(computed.max() / computed.mean())
    out = {"mode": mode, "ranks": ranks, "local_batch": local_batch, "group": group, "steps": steps,
           "seed": seed, "tokens_max_over_mean": float(np.mean(acc["tokens"])),
           "attention_max_over_mean": float(np.mean(acc["attention"])),
           "cost_max_over_mean": float(np.mean(acc["cost"])),
           "padding_fraction": float(np.mean(acc["padding"])),
           "computed_max_over_mean": float(np.mean(acc["computed"])),
           "tokens_max_over_mean_worst_step": float(np.max(acc["tokens"]))}
    if strata is not None:
        out["strata"] = [list(b) for b in strata.bounds]
        out["counts_per_unit"] = [int(c) for c in schedule.counts(0)]
        out["draw"], out["rounding"] = spec["draw"], schedule.rounding
        # How far the drawn mix is from the data's: total variation distance between the
        # strata shares actually drawn over the simulated steps and the true shares.
        drawn_share = schedule.taken(steps) / (steps * unit_size)
        out["stratum_share_tv"] = float(0.5 * np.abs(drawn_share - np.array(strata.shares)).sum())
        # The same for one step's mix (every unit takes the same counts in a step): how
        # skewed a single global batch is, averaged over steps.
        shares = np.array(strata.shares)
        out["step_share_tv"] = float(np.mean([0.5 * np.abs(schedule.counts(t) / unit_size - shares).sum()
                                              for t in range(steps)]))
        out["strata_never_drawn"] = int(((schedule.taken(steps) == 0) & (np.array(strata.shares) > 0)).sum())
    return out


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    modes = sorted({r["mode"] for r in results}, key=MODES.index)
    for mode in modes:
        rs = sorted((r for r in results if r["mode"] == mode), key=lambda r: r["ranks"])
        ax.plot([r["ranks"] for r in rs], [r["tokens_max_over_mean"] for r in rs], marker="o", label=mode)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("ranks")
    ax.set_ylabel("worst / mean real tokens per step")
    ax.axhline(1.01, color="gray", linestyle=":", linewidth=1)
    ax.legend(fontsize=7, ncol=2)
    ax.set_title("Load balance by sampling mode (Wikipedia lengths, seq 512)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def table(results: list[dict]) -> str:
    rank_counts = sorted({r["ranks"] for r in results})
    by = {(r["mode"], r["ranks"]): r for r in results}
    lines = ["| mode | " + " | ".join(f"{n} ranks: tokens / attention / padding" for n in rank_counts) + " |",
             "|---|" + "---|" * len(rank_counts)]
    for mode in sorted({r["mode"] for r in results}, key=MODES.index):
        cells = []
        for n in rank_counts:
            r = by[(mode, n)]
            cells.append(f"{r['tokens_max_over_mean']:.3f} / {r['attention_max_over_mean']:.3f} / "
                         f"{r['padding_fraction']:.3f}")
        lines.append(f"| `{mode}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--local-batch", type=int, default=16)
    ap.add_argument("--group", type=int, default=8, help="ranks per deal group (a node)")
    ap.add_argument("--mode", default="stratified+best", help=", ".join(MODES))
    ap.add_argument("--steps", type=int, default=50, help="steps averaged over")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--histogram", type=Path, default=DEFAULT_HISTOGRAM)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=1024, help="hidden size of the cost model")
    ap.add_argument("--strata-width", type=int, default=0,
                    help="stratified modes: strata of this many tokens (0 = the mode's: 128, best: 16)")
    ap.add_argument("--draw", choices=("rank", "group"), default="",
                    help="stratified modes: who takes the strata counts (default: the mode's)")
    ap.add_argument("--rounding", choices=("fixed", "carry"), default="",
                    help="stratified modes: fixed counts or carried deficits (default: the mode's)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--table", action="store_true",
                    help="every mode at --table-ranks: markdown table on stdout")
    ap.add_argument("--table-ranks", default="8,64,1024,4096")
    ap.add_argument("--out-json", type=Path, help="write the result(s) here")
    ap.add_argument("--plot", type=Path, help="write a PNG (with --table: worst/mean vs ranks)")
    args = ap.parse_args(argv)
    lengths, counts = load_histogram(args.histogram)
    common = dict(local_batch=args.local_batch, group=args.group, steps=args.steps, seed=args.seed,
                  lengths=lengths, counts=counts, max_len=args.max_len, hidden=args.hidden,
                  strata_width=args.strata_width, draw=args.draw, rounding=args.rounding)
    if args.table:
        results = [simulate(m, int(n), **common) for n in args.table_ranks.split(",") for m in MODES]
        print(table(results))
    else:
        results = [simulate(args.mode, args.ranks, **common)]
        r = results[0]
        if args.json:
            print(json.dumps(r))
        else:
            print(f"{r['mode']}: {r['ranks']} ranks x {r['local_batch']}, group {r['group']}: worst/mean tokens "
                  f"{r['tokens_max_over_mean']:.4f}, attention {r['attention_max_over_mean']:.4f}, "
                  f"padding {r['padding_fraction']:.3f}")
    if args.out_json:
        args.out_json.write_text(json.dumps(results, indent=1))
    if args.plot:
        plot(results, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
