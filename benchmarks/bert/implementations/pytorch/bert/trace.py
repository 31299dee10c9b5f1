"""Which samples each step took: the trace a run writes (``log.sample_trace=DIR``), and the
same list worked out from a run's config, data and seed without training
(``python -m bert.trace``).

The trace: each rank appends to ``DIR/rank_<r>.jsonl`` one line per optimizer step,
``{"step": k, "rank": r, "samples": [[shard, row], ...]}``: step k is the k-th step trained
(the progress lines' and checkpoints' count), ``shard`` the file's path relative to the
training directory, ``row`` its index in the file, in the order the rank trained them (its
micro-batches one after another). A run that starts at step s (fresh: 0; resumed: the
checkpoint's) first drops the lines past s that an earlier run left (a run killed after its
last checkpoint wrote steps that the resume trains again), so the files hold each step once.
A line is written when the step's last micro-batch is handed to the loop, flushed, and costs a
write per step per rank (BENCHMARKS.md section 17).

The command reads no sample (except with ``--vocab``, which prints their text): the sampling
policy of each rank says which rows it takes (from the shards' sizes, the length index where
the road has one), the same policy the loader follows, so its lines equal the trace's. Across
a resume on another world size, the roads whose global batch does not depend on the world
size (every id-based road) take the same samples at each step whatever the ranks; on the
shard-order road, ``--checkpoint`` continues from the stream a checkpoint saved, as the
resumed run did (docs/faults.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from . import storage
from .config import COMMAND_LINE, RESOLVED, Config, ConfigError, Setting, parse_overrides, resolve
from .loader import TrainingData, TrainLoader, Watched
from .shards import DataError, Shard


def trace_file(directory: str | Path, rank: int) -> Path:
    return Path(directory) / f"rank_{rank}.jsonl"


def _kept(path: Path, step: int) -> str:
    """The lines of trace file ``path`` up to step ``step`` (a torn last line dropped)."""
    keep = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= step:
                keep.append(line + "\n")
        except (ValueError, KeyError, TypeError):
            continue  # the last line of a run killed while writing it
    return "".join(keep)


class SampleTrace(Watched):
    """The training stream (``loader.TrainLoader``), each optimizer step's samples appended to
    this rank's trace file as its last micro-batch is handed out; state, failure and close are
    the stream's own. ``step``: the steps already trained (the lines past it are dropped first:
    this rank's file, and those of ranks the run no longer has, ``r % world_size == rank``).
    A failed write is kept (``write_error``) for the next agreement point, as the MLPerf log's."""

    def __init__(self, batches: TrainLoader, directory: str | Path, *, rank: int, world_size: int, accum: int,
                 step: int):
        super().__init__(batches)
        self.rank, self.accum, self.step = rank, accum, step
        self.path = trace_file(directory, rank)
        self.write_error: OSError | None = None
        self.pending: list[list[Any]] = []
        self.micro = 0
        Path(directory).mkdir(parents=True, exist_ok=True)
        for path in sorted(Path(directory).glob("rank_*.jsonl")):
            r = path.stem.removeprefix("rank_")
            if r.isdigit() and int(r) % world_size == rank:
                storage.write_text(path, _kept(path, step))
        self.file = open(self.path, "a")

    def __next__(self) -> dict:
        batch = next(self.batches)
        self.pending += self.batches.last
        self.micro += 1
        if self.micro == self.accum:
            self.step += 1
            line = json.dumps({"step": self.step, "rank": self.rank, "samples": self.pending})
            self.pending, self.micro = [], 0
            if self.write_error is None:
                try:
                    self.file.write(line + "\n")
                    self.file.flush()
                except OSError as e:
                    self.write_error = e
        return batch

    def close(self) -> None:
        super().close()
        self.file.close()


def read_trace(directory: str | Path) -> dict[int, dict[int, list[list[Any]]]]:
    """{step: {rank: samples}} of every trace file in ``directory``."""
    out: dict[int, dict[int, list[list[Any]]]] = {}
    for path in sorted(Path(directory).glob("rank_*.jsonl")):
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            out.setdefault(entry["step"], {})[entry["rank"]] = entry["samples"]
    return out


# ---------------------------------------------------------------- the samples of a step, worked out


def streams(cfg: Config, world_size: int, checkpoint: Path | None = None) -> tuple[list[TrainLoader], int]:
    """Every rank's training stream of a run of ``cfg`` on ``world_size`` ranks, at its start
    or continued from ``checkpoint`` as a resume continues it (the stream it saved; its
    samples proven as a resume proves them), and the steps done there. Nothing trained; the
    gather deal's lengths come from the length index (the deal is the same where the index
    is right, which the loader checks as it reads)."""
    sampler = dataclasses.replace(cfg.sampler, lengths="index")  # the gather deal's collective is the run's only
    train = TrainingData.open(data=cfg.data, sampler=sampler, model=cfg.model)
    r = cfg.run
    out = []
    for rank in range(world_size):
        policy = train.policy(data=cfg.data, sampler=sampler, model=cfg.model, rank=rank, world_size=world_size,
                              local_batch=r.local_batch_size, accum=r.grad_accum_steps, seed=r.seed)
        out.append(TrainLoader(policy=policy, reader=train.reader, paths=train.paths, collate=list,
                               batch_size=r.local_batch_size, world_size=world_size, rank=rank, data=train.identity,
                               prefetch=False))
    done = 0
    if checkpoint is not None:
        saved = json.loads((checkpoint / "stream.json").read_text())
        done = int(saved["step"])
        for stream in out:
            stream.load_state_dict(saved)
    return out, done


def step_lines(all_ranks: list[TrainLoader], done: int, cfg: Config, step: int) -> list[dict[str, Any]]:
    """The trace lines of optimizer step ``step`` (1-based) of the run whose ranks' streams
    (``streams``) stand after step ``done``, rank by rank."""
    if step <= done:
        raise ValueError(f"step {step} was trained before the checkpoint (step {done}): ask the run that trained it")
    per_step = cfg.run.local_batch_size * cfg.run.grad_accum_steps
    return [{"step": step, "rank": rank, "samples": stream.ahead((step - 1 - done) * per_step, per_step)}
            for rank, stream in enumerate(all_ranks)]


def _text(stream: TrainLoader, samples: list[list[Any]], vocab: Path) -> list[str]:
    """Each sample's tokens as text (masked positions as the model saw them, [MASK] or not)."""
    words = vocab.read_text(encoding="utf-8").splitlines()
    shard = Shard.from_samples(stream.read_named(samples))
    return [" ".join(words[t] if t < len(words) else f"[{t}]" for t in shard[i].input_ids.tolist())
            for i in range(len(shard))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bert.trace",
        description="Print the samples optimizer step STEP of a run took, rank by rank, as its sample trace "
                    "(log.sample_trace) writes them: one JSON line per rank, {step, rank, samples: [[shard, row], "
                    "...]}. Worked out from the run's config, data and seed; nothing trained.")
    ap.add_argument("--config", help="the run's resolved config (the *_config.json beside its MLPerf log: it holds "
                                     "the seed and world size the run used), or any config file")
    ap.add_argument("--step", type=int, required=True, help="the optimizer step (1 = the first)")
    ap.add_argument("--world-size", type=int, default=0, help="ranks of the run (default: the resolved config's)")
    ap.add_argument("--checkpoint", help="continue from this checkpoint's stream (a run resumed on another world "
                                         "size: the steps after it)")
    ap.add_argument("--vocab", help="also print each sample's text, decoded with this vocab.txt")
    ap.add_argument("overrides", nargs="*", help="key.sub=value, as the run had them")
    args = ap.parse_intermixed_args(argv)
    try:
        settings = [Setting(k, v, COMMAND_LINE) for k, v in parse_overrides(args.overrides).items()]
        cfg, _ = resolve(settings, args.config)
        resolved = json.loads(Path(args.config).read_text()).get(RESOLVED, {}) if args.config else {}
        world_size = args.world_size or int(resolved.get("world_size", 0))
        if world_size <= 0:
            raise ConfigError("--world-size: the ranks of the run (its resolved config does not say)")
        if cfg.run.seed < 0:
            raise ConfigError("run.seed is unset: give the seed the run used (its resolved config, or the seed line "
                              "of its MLPerf log)")
        if args.step < 1:
            raise ConfigError("--step counts from 1")
        all_ranks, done = streams(cfg, world_size, Path(args.checkpoint) if args.checkpoint else None)
        lines = step_lines(all_ranks, done, cfg, args.step)
        texts = [_text(all_ranks[0], line["samples"], Path(args.vocab)) for line in lines] if args.vocab else []
    except (ConfigError, DataError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for line in lines:
        print(json.dumps(line))
    for line, text in zip(lines, texts):
        for (name, row), words in zip(line["samples"], text):
            print(f"rank {line['rank']} {name} row {row}: {words}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
