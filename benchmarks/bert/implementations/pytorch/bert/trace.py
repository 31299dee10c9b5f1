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
the road has one), the same policy the loader follows, so its lines equal the trace's. A run
resumed on another world size (or another split of its global batch) is followed stretch by
stretch, as its MLPerf log records them (each run's world size, global batch and
accumulation, and the step it resumed at): each stretch's streams are worked out to where the
next began and continued from there as the resumed run continued them (on the id-based roads
a step's samples do not depend on the world size anyway; on the shard order they do:
docs/faults.md). ``--checkpoint`` continues a checkpoint's saved stream instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import storage
from .config import COMMAND_LINE, RESOLVED, Config, ConfigError, Setting, parse_overrides, resolve
from .loader import TrainingData, TrainLoader, Watched
from .mlperf_log import read_events
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


@dataclass(frozen=True)
class Part:
    """One stretch of a run between its start and resumes: begun with ``first`` steps done, on
    ``ranks`` ranks of ``local_batch`` samples a micro-step and ``accum`` micro-steps a step."""

    first: int
    ranks: int
    local_batch: int
    accum: int


def parts_of_log(log: str | Path) -> list[Part]:
    """The stretches of the run whose MLPerf log is ``log`` (a resumed run appends to its run's
    log): each begins at an init_start, with its world size, global batch and accumulation in
    its hyperparameters and, resumed, the step of the checkpoint it continued."""
    parts: list[dict[str, int]] = []
    for e in read_events(log):
        key = e["key"]
        if key == "init_start":
            parts.append({"first": 0})
        elif parts and key in ("world_size", "global_batch_size", "gradient_accumulation_steps"):
            parts[-1][key] = int(e["value"])
        elif parts and key == "resumed_from_checkpoint":
            parts[-1]["first"] = int(e["metadata"]["step"])
    out = []
    for p in parts:
        if {"world_size", "global_batch_size", "gradient_accumulation_steps"} <= p.keys():
            ranks, accum = p["world_size"], p["gradient_accumulation_steps"]
            out.append(Part(p["first"], ranks, p["global_batch_size"] // (ranks * accum), accum))
    if not out:
        raise ValueError(f"{log}: no run's world size and batch in it (not a run's MLPerf log?)")
    return out


def streams(cfg: Config, part: Part, resume: dict[str, Any] | None = None) -> list[TrainLoader]:
    """Every rank's training stream in ``part`` of a run of ``cfg``, at its start, or
    continuing the stream ``resume`` (as a resumed run opens it: its samples proven). Nothing
    trained; the gather deal's lengths come from the length index (the deal is the same where
    the index is right, which the loader checks as it reads)."""
    sampler = dataclasses.replace(cfg.sampler, lengths="index")  # the gather deal's collective is the run's only
    train = TrainingData.open(data=cfg.data, sampler=sampler, model=cfg.model)
    out = []
    for rank in range(part.ranks):
        policy = train.policy(data=cfg.data, sampler=sampler, model=cfg.model, rank=rank, world_size=part.ranks,
                              local_batch=part.local_batch, accum=part.accum, seed=cfg.run.seed, resume=resume)
        stream = TrainLoader(policy=policy, reader=train.reader, paths=train.paths, collate=list,
                             batch_size=part.local_batch, world_size=part.ranks, rank=rank, data=train.identity,
                             prefetch=False)
        if resume is not None:
            stream.load_state_dict(resume)
        out.append(stream)
    return out


def step_lines(cfg: Config, parts: list[Part], step: int, checkpoint: Path | None = None) -> list[dict[str, Any]]:
    """The trace lines of optimizer step ``step`` (1-based), rank by rank, of the run whose
    stretches are ``parts`` (each continuing the one before where it began, its streams
    worked out to there); with ``checkpoint``, the last part continues that checkpoint's
    saved stream instead (``parts[-1].first`` its step)."""
    if checkpoint is not None:
        saved = json.loads((checkpoint / "stream.json").read_text())
        parts, state = [dataclasses.replace(parts[-1], first=int(saved["step"]))], saved
    else:
        state = None
        if parts[0].first:
            raise ValueError(f"the run's log begins with a resume at step {parts[0].first} (its earlier stretches are "
                             "logged elsewhere): give that log, or the checkpoint it resumed (--checkpoint)")
    if step <= parts[0].first:
        raise ValueError(f"step {step} was trained before step {parts[0].first}, where this stream begins")
    last = max(i for i, p in enumerate(parts) if p.first < step)  # the stretch that trained it
    for i, part in enumerate(parts[:last + 1]):
        ranks = streams(cfg, part, state)
        end = parts[i + 1].first if i < last else step - 1
        for s in ranks:
            s.skip((end - part.first) * part.local_batch * part.accum)
        if i < last:
            state = {"world_size": part.ranks, "ranks": [s.state_dict() for s in ranks]}
            for s in ranks:
                s.close()
    per_step = part.local_batch * part.accum
    lines = [{"step": step, "rank": r, "samples": s.ahead(per_step)} for r, s in enumerate(ranks)]
    for s in ranks:
        s.close()
    return lines


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
                    "...]}. Worked out from the run's config, data and seed, and its MLPerf log's world sizes "
                    "(a run resumed on another number of ranks); nothing trained.")
    ap.add_argument("--config", help="the run's resolved config (the *_config.json beside its MLPerf log: it holds "
                                     "the seed the run used), or any config file")
    ap.add_argument("--step", type=int, required=True, help="the optimizer step (1 = the first)")
    ap.add_argument("--log", help="the run's MLPerf log, for the world size and batch split of each stretch between "
                                  "its start and its resumes (default: the log beside a resolved config, X.txt "
                                  "for X_config.json)")
    ap.add_argument("--world-size", type=int, default=0,
                    help="without a log: the ranks of the run (default: the resolved config's)")
    ap.add_argument("--checkpoint", help="continue from this checkpoint's saved stream instead (the steps after it, "
                                         "on the world size of the log's last stretch or --world-size)")
    ap.add_argument("--vocab", help="also print each sample's text, decoded with this vocab.txt")
    ap.add_argument("overrides", nargs="*", help="key.sub=value, as the run had them")
    args = ap.parse_intermixed_args(argv)
    try:
        settings = [Setting(k, v, COMMAND_LINE) for k, v in parse_overrides(args.overrides).items()]
        cfg, _ = resolve(settings, args.config)
        if cfg.run.seed < 0:
            raise ConfigError("run.seed is unset: give the seed the run used (its resolved config, or the seed line "
                              "of its MLPerf log)")
        if args.step < 1:
            raise ConfigError("--step counts from 1")
        parts = _parts(args, cfg)
        lines = step_lines(cfg, parts, args.step, Path(args.checkpoint) if args.checkpoint else None)
        texts = [_text(streams(cfg, parts[0])[0], line["samples"], Path(args.vocab)) for line in lines] \
            if args.vocab else []
    except (ConfigError, DataError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for line in lines:
        print(json.dumps(line))
    for line, text in zip(lines, texts):
        for (name, row), words in zip(line["samples"], text):
            print(f"rank {line['rank']} {name} row {row}: {words}")
    return 0


def _parts(args: argparse.Namespace, cfg: Config) -> list[Part]:
    """The run's stretches: from its MLPerf log (``--log``, or the one beside a resolved
    config), else one, of ``--world-size`` or the resolved config's ranks."""
    log = Path(args.log) if args.log else None
    if log is None and args.config and Path(args.config).name.endswith("_config.json"):
        beside = Path(args.config).with_name(Path(args.config).name.removesuffix("_config.json") + ".txt")
        log = beside if beside.is_file() and not args.world_size else None
    if log is not None:
        return parts_of_log(log)
    resolved = json.loads(Path(args.config).read_text()).get(RESOLVED, {}) if args.config else {}
    ranks = args.world_size or int(resolved.get("world_size", 0))
    if ranks <= 0:
        raise ConfigError("--world-size: the ranks of the run (no MLPerf log beside its config, and its resolved "
                          "config does not say)")
    return [Part(0, ranks, cfg.run.local_batch_size, cfg.run.grad_accum_steps)]


if __name__ == "__main__":
    sys.exit(main())
