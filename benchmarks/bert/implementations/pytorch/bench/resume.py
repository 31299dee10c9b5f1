"""What a run's stream costs to prove and continue: the data's identity and the probe of the
samples last trained (at a checkpoint, and read back at a resume), the time to the first batch
of a resume on the same and on another number of ranks, and the sample trace per step.

    python bench/resume.py [--shards 4320] [--rows 40] [--world 8] [--to 4] [--batch 56] [--steps 400]

Makes a directory of ``--shards`` small shards (``--rows`` samples each, the MLPerf length
histogram, fixed layout at seq 512) in a temporary folder, then, in this process, one thread:

- the identity a checkpoint records (``describe_data``: a stat of every shard, the md5 list's
  digest) and one rank's whole stream state at a checkpoint (the probe's md5 of ``--batch``
  samples included), best of 5;
- the time to a resumed stream's first batch, on both roads (the closed shard order; the snake
  deal over the length index), for a fresh start, a resume on the same ``--world`` ranks and a
  resume on ``--to`` ranks (the global batch kept), rank 0's, best of 3: the probe read back
  and, on the shard order, every earlier rank's remaining shards sized (one open each);
- the trace: ``--steps`` steps of ``--batch`` samples through ``bert.trace.SampleTrace``, the
  time of its own work (the line built, written, flushed) apart from the stream's.

Prints a table and writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from common import PKG, machine  # noqa: F401 - PKG: puts this checkout's bert on sys.path

from bert.config import build_config
from bert.loader import TrainingData, describe_data, train_batches
from bert.shards import Shard, write_shard
from bert.trace import SampleTrace
from bert.trainer import train_plan


def make_shards(root: Path, shards: int, rows: int) -> None:
    from bert import lengths

    rng = np.random.default_rng(0)
    values, probs = lengths.length_distribution(512)
    root.mkdir(parents=True)
    for i in range(shards):
        n = rng.choice(values, size=rows, p=probs).astype(np.int64)
        tokens = rng.integers(5, 30000, size=int(n.sum())).astype(np.int16)
        starts = np.concatenate([[0], np.cumsum(n)[:-1]])
        tokens[starts] = 101
        tokens[starts + n - 1] = 102
        pos = np.stack([np.ones(rows, np.int16), np.maximum(n // 2, 1).astype(np.int16)], axis=1).reshape(-1)
        offsets = np.concatenate([[0], np.cumsum(n)])
        shard = Shard(f"part_{i:05d}.hdf5", tokens, np.zeros(len(tokens), np.int8), offsets, pos,
                      np.full(len(pos), 7, np.int16), np.arange(rows + 1, dtype=np.int64) * 2,
                      (np.arange(rows) % 2).astype(np.int8))
        write_shard(root / f"part_{i:05d}.hdf5", shard, "fixed", 512, 76)


def best(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


class Timed:
    """A stream, the seconds spent in its own ``next`` counted (what the trace adds is the rest)."""

    def __init__(self, stream):
        self.stream, self.seconds = stream, 0.0

    def __next__(self) -> dict:
        t = time.perf_counter()
        batch = next(self.stream)
        self.seconds += time.perf_counter() - t
        return batch

    @property
    def last(self) -> list:
        return self.stream.last

    def close(self) -> None:
        self.stream.close()


ROADS = {"shard order": {}, "snake deal, length index": {"run.division": "open", "sampler.deal": "snake",
                                                         "sampler.group_size": 2}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shards", type=int, default=4320)
    ap.add_argument("--rows", type=int, default=40)
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--to", type=int, default=4)
    ap.add_argument("--batch", type=int, default=56)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    out: dict = {"machine": machine(), "args": vars(args)}
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "train"
        t = time.perf_counter()
        make_shards(data, args.shards, args.rows)
        print(f"{args.shards} shards of {args.rows} samples written in {time.perf_counter() - t:.1f} s")

        def cfg(road: str, world: int):
            b = args.batch * args.world // world
            return build_config({"data.train_dir": str(data), "run.local_batch_size": b, "run.seed": 7,
                                 "data.verify_md5": False, **ROADS[road]})

        def stream(road: str, world: int, rank: int = 0, resume=None):
            c = cfg(road, world)
            return train_batches(data=c.data, sampler=c.sampler, model=c.model, plan=train_plan(c, world), seed=7,
                                 rank=rank, world_size=world, prefetch=False, resume=resume)

        first = stream("shard order", args.world)
        next(first)
        paths = first.paths
        out["identity_s"] = best(lambda: describe_data(data, paths, None), 5)
        out["state_dict_s"] = best(first.state_dict, 5)  # the identity described once, then cached
        first.close()
        print(f"identity of {args.shards} shards (stat each, at the first checkpoint): {out['identity_s']:.4f} s; "
              f"a rank's stream state after it (the probe's md5): {out['state_dict_s']:.5f} s")
        out["first_batch_s"] = {}
        for road in ROADS:
            ranks = [stream(road, args.world, r) for r in range(args.world)]
            for _ in range(3):
                for s in ranks:
                    next(s)
            saved = {"world_size": args.world, "ranks": [s.state_dict() for s in ranks]}
            for s in ranks:
                s.close()
            row = {}
            for label, world, resume in (("fresh", args.world, None), ("same ranks", args.world, saved),
                                         (f"{args.world} -> {args.to} ranks", args.to, saved)):
                def go(world=world, resume=resume):
                    s = stream(road, world, 0, resume)
                    next(s)
                    s.close()
                row[label] = best(go, 3)
            out["first_batch_s"][road] = row
            print(f"{road}: first batch " + ", ".join(f"{k} {v:.3f} s" for k, v in row.items()))
        trace_dir = Path(tmp) / "trace"
        inner = Timed(stream("shard order", args.world))
        traced = SampleTrace(inner, trace_dir, rank=0, world_size=args.world, accum=1, step=0)
        outer = 0.0
        for _ in range(args.steps):
            t = time.perf_counter()
            next(traced)
            outer += time.perf_counter() - t
        traced.close()
        out["trace_us_per_step"] = (outer - inner.seconds) / args.steps * 1e6
        out["trace_bytes_per_step"] = (trace_dir / "rank_0.jsonl").stat().st_size / args.steps
        print(f"trace: {out['trace_us_per_step']:.1f} us of its own per step of {args.batch} samples, "
              f"{out['trace_bytes_per_step']:.0f} bytes a line (off: not constructed, nothing)")
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
