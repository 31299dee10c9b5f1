#!/usr/bin/env python3
"""Train-step throughput in *useful* (real) tokens per second: padded vs unpadded (and packed).

Batches are drawn from the Wikipedia length histogram (seq 512; ~15% of each sample masked,
at most 76), the model is big enough for attention to matter (default hidden 256, 4 layers,
4 heads, the real 30,522-token vocab). Each layout trains the same batches from the same
initial weights: forward, backward, AdamW step; ``--warmup`` untimed steps first; the
layouts' steps are interleaved so a shared machine's load hits them alike. The
padded layout computes every op on [B, 512] and the MLM head on every position (Hugging
Face's arithmetic); the unpadded one on the real tokens and the masked rows; the packed one
on rows of up to 3 sequences.

    python bench/unpad.py --json                # prints padded/unpadded tokens/s and the ratio
    python bench/unpad.py --out results/unpad.json

A benchmark, not a test: numbers depend on the machine (and, on a shared one, its load).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

PKG = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(PKG))

from bert.config import ModelConfig  # noqa: E402
from bert.batches import collate, collate_packed  # noqa: E402
from bert.model import BertForPreTraining, pretraining_loss  # noqa: E402
from bert.shards import Sample  # noqa: E402

HISTOGRAM = PKG / "data" / "wikipedia_seqlen_histogram_512.txt"
LABELS = ("mlm_labels", "nsp_labels")


def draw_batches(n: int, batch: int, vocab: int, seed: int, max_len: int = 512) -> list[list[Sample]]:
    hist = np.loadtxt(HISTOGRAM, dtype=np.int64)
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        lengths = rng.choice(hist[:, 0], size=batch, p=hist[:, 1] / hist[:, 1].sum())
        samples = []
        for length in np.minimum(lengths, max_len):
            ids = rng.integers(1000, vocab, size=length)
            ids[0], ids[-1] = 101, 102
            seg = (np.arange(length) > length // 2).astype(np.int8)
            m = int(max(1, min(76, round(0.15 * length), length - 2)))
            pos = np.sort(rng.choice(np.arange(1, length - 1), size=m, replace=False)) if length > 2 else np.array([1])
            samples.append(Sample(ids.astype(np.int64), seg, pos.astype(np.int64),
                                  rng.integers(1000, vocab, size=len(pos)), int(rng.integers(0, 2))))
        out.append(samples)
    return out


def make_stepper(layout: str, cfg: ModelConfig, seed: int):
    """A model, optimizer and collate for ``layout``; returns step(samples) -> None."""
    mcfg = dataclasses.replace(cfg, unpad=layout == "unpadded", pack=layout == "packed")
    torch.manual_seed(seed)
    model = BertForPreTraining(mcfg).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    fn = (lambda b: collate_packed(b, 512)) if layout == "packed" else (lambda b: collate(b, layout == "unpadded", 512))

    def step(batch: dict) -> None:
        inputs = {k: v for k, v in batch.items() if k not in LABELS}
        mlm, nsp = model(**inputs)
        pretraining_loss(mlm, nsp, batch["mlm_labels"], batch["nsp_labels"]).backward()
        opt.step()
        opt.zero_grad()

    return fn, step


def run_layouts(layouts: list[str], cfg: ModelConfig, batches: list[list[Sample]], warmup: int, seed: int) -> dict:
    """Interleaved: step i runs in every layout before step i + 1 runs in any, so a shared
    machine's changing load hits all layouts alike. Collation is outside the timed region."""
    steppers = {name: make_stepper(name, cfg, seed) for name in layouts}
    collated = {name: [fn(b) for b in batches] for name, (fn, _) in steppers.items()}
    seconds = dict.fromkeys(layouts, 0.0)
    for i in range(len(batches)):
        for name, (_, step) in steppers.items():
            t0 = time.perf_counter()
            step(collated[name][i])
            if i >= warmup:
                seconds[name] += time.perf_counter() - t0
    real = sum(len(s.input_ids) for b in batches[warmup:] for s in b)
    return {name: {"tokens_per_s": real / seconds[name], "seconds": seconds[name], "real_tokens": real,
                   "steps": len(batches) - warmup} for name in layouts}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=30522)
    ap.add_argument("--batch", type=int, default=8, help="samples per step")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per layout")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's choice)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--packed", action="store_true", help="also time the packed layout")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads,
                      intermediate_size=4 * args.hidden, attention_backend="sdpa")
    batches = draw_batches(args.warmup + args.steps, args.batch, args.vocab, args.seed)
    layouts = ["padded", "unpadded"] + (["packed"] if args.packed else [])
    res = run_layouts(layouts, cfg, batches, args.warmup, args.seed)
    out = {"padded_tokens_per_s": res["padded"]["tokens_per_s"],
           "unpadded_tokens_per_s": res["unpadded"]["tokens_per_s"],
           "ratio": res["unpadded"]["tokens_per_s"] / res["padded"]["tokens_per_s"],
           "detail": res, "model": dataclasses.asdict(cfg), "batch": args.batch,
           "torch_threads": torch.get_num_threads(), "torch": torch.__version__}
    if args.packed:
        out["packed_tokens_per_s"] = res["packed"]["tokens_per_s"]
    text = json.dumps(out)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1))
    if args.json:
        print(text)
    else:
        for name in layouts:
            print(f"{name:9s}: {res[name]['tokens_per_s']:9.1f} useful tokens/s ({res[name]['steps']} steps, "
                  f"{res[name]['seconds']:.1f} s)")
        print(f"unpadded / padded: {out['ratio']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
