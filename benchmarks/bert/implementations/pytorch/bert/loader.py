"""What a run reads: the training stream and the eval set, and how their samples become
batches (``BatchPlan``), chosen once from the data, sampler and model sections.

One road for every sampling mode. A policy (bert/sampler.py) names the samples a rank trains
on, in order, by global id (a shard of the listing and a row in it): the closed division's
random shard order and every id-based mode (stratified sampling, the deals, packed rows, a
strata directory) differ in that policy only. ``TrainLoader`` reads what the policy names
through one ``ShardReader`` (bert/reader.py: the watchdog, the md5 list, the model's bounds),
the next draw while the current one trains, and cuts batches; every sampling mode gives the
loop the same ``TrainStream``. The eval set is read through the same reader.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol, Sequence, runtime_checkable

import numpy as np

from . import budget as budgets
from . import watchdog
from .batches import collate, collate_packed, pinned, synthetic_batches, warmup_token_counts
from .budget import BudgetCollate, Layout
from .config import DataConfig, ModelConfig, SamplerConfig
from .reader import ShardReader
from .sampler import Canon, Draw, LengthIndex, Policy, Position, ShardOrder, build_policy
from .shards import SHARD_SUFFIXES, Bounds, DataError, Sample, Shard, examples_md5, list_shards

# ---------------------------------------------------------------- the batch plan


def batch_collate(unpad: bool, pack: bool, max_seq_length: int, budget: Layout | None = None, *,
                  samples: int | None = None, pin: bool = False) -> Callable[[Sequence[Sample]], dict]:
    """The collate of the model's layout, chosen once: packed rows, unpadded (padded to a
    static token budget when ``budget``, a ``bert.budget.Layout``, is given; with
    ``samples``, short batches filled up to that many samples), or padded. ``pin``: the
    batches come in pinned host memory (``pinned``; for a CUDA device)."""
    if budget is not None:
        fn: Callable[[Sequence[Sample]], dict] = BudgetCollate(budget, samples)
    elif pack:
        fn = lambda b: collate_packed(b, max_seq_length)  # noqa: E731
    else:
        fn = lambda b: collate(b, unpad, max_seq_length)  # noqa: E731
    return (lambda b: pinned(fn(b))) if pin else fn


@dataclass(frozen=True)
class BatchPlan:
    """How a rank's samples become batches, decided once from the config, before any data is
    read: the model's layout (padded, unpadded, packed rows; static token budgets ``layout``,
    None: off) for ``batch_size`` samples, and the synthetic batches the warm-up compiles
    and captures, one per shape the run will see. ``fill``: a short batch (evaluation's
    last) is filled up to ``batch_size`` samples where budgets are on, so it has a captured
    shape too."""

    unpad: bool
    pack: bool
    layout: Layout | None
    batch_size: int
    max_seq_length: int
    max_predictions: int
    vocab_size: int
    fill: bool = False
    pin: bool = False  # batches in pinned host memory (a CUDA device)

    @classmethod
    def training(cls, d: DataConfig, sm: SamplerConfig, m: ModelConfig, *, local_batch: int, world_size: int,
                 pin: bool = False) -> BatchPlan:
        """The training batches: ``local_batch`` samples per rank, the sampler's token budgets."""
        return cls(m.unpad, m.pack, budgets.layout_for(d, sm, local_batch, world_size, m.hidden_size), local_batch,
                   d.max_seq_length, d.max_predictions_per_seq, m.vocab_size, pin=pin)

    @classmethod
    def evaluation(cls, d: DataConfig, m: ModelConfig, *, batch_size: int, budgeted: bool,
                   pin: bool = False) -> BatchPlan:
        """The eval batches; ``budgeted``: static token budgets where data.token_budgets is set
        (not for an evaluation that also scores next-sentence prediction, which a filler
        sample would join)."""
        layout = budgets.eval_layout_for(d, batch_size) if budgeted else None
        return cls(m.unpad, m.pack, layout, batch_size, d.max_seq_length, d.max_predictions_per_seq, m.vocab_size,
                   fill=True, pin=pin)

    @property
    def collate(self) -> Callable[[Sequence[Sample]], dict]:
        return batch_collate(self.unpad, self.pack, self.max_seq_length, self.layout,
                             samples=self.batch_size if self.fill and self.layout is not None else None, pin=self.pin)

    def warmup_batches(self, seed: int) -> list[dict]:
        """One synthetic batch per shape the run will see (``warmup_token_counts``), in host
        memory: what the warm-up before run_start compiles and captures; no data read."""
        fn = batch_collate(self.unpad, self.pack, self.max_seq_length, self.layout)
        return synthetic_batches(fn, warmup_token_counts(self.layout, self.batch_size, self.max_seq_length),
                                 self.batch_size, self.max_seq_length, self.max_predictions, self.vocab_size,
                                 seed=seed)


# ---------------------------------------------------------------- the training stream


# Samples of the last batch a checkpoint names and a resume reads again (each in a shard of its
# own on the id-based roads: a row read each). Data made again differs in every sample; one
# changed sample in place is the md5 list's to find.
PROBE = 4


class ResumeRefused(DataError):
    """A stream state that this stream cannot continue: drawn by another road, from other
    data, or (its probe) from other samples under the same names."""


@runtime_checkable
class TrainStream(Protocol):
    """The training batches the loop draws from, whatever the sampling mode: endless
    collated batches of one rank; its position (``state_dict``: what a checkpoint saves,
    ``load_state_dict`` refusing a position drawn from other data); a read ahead of the loop
    that failed or overran (``failure``: the checkpoint poll asks); its end (``close``)."""

    def __iter__(self) -> Iterator[dict]: ...

    def __next__(self) -> dict: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def failure(self) -> str | None: ...

    def close(self) -> None: ...


class Watched:
    """A training stream handed to the loop through something that watches each batch go by
    (the curves' counts, the sample trace): ``__next__`` is the watcher's, the state, failure
    and close are the stream's own."""

    def __init__(self, batches: TrainStream) -> None:
        self.batches = batches

    def __iter__(self) -> Watched:
        return self

    def __next__(self) -> dict:
        return next(self.batches)

    def state_dict(self) -> dict[str, Any]:
        return self.batches.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.batches.load_state_dict(state)

    def failure(self) -> str | None:
        return self.batches.failure()

    def close(self) -> None:
        self.batches.close()


class TrainLoader:
    """One rank's training stream, for every sampling mode: ``policy`` names the samples by
    global id, draw by draw; each draw is read through ``reader`` (every guard), the next
    one while the current one trains (one draw in memory extra: a shard under the shard
    order, a step's rows otherwise; not ahead for a policy that draws in the main thread),
    and every ``batch_size`` samples collated into a batch. Every rank yields forever, so the
    ranks never disagree on the number of steps.

    ``state_dict()`` is the position of the next sample not handed out, with what it is a
    position of (the policy and what it needs to continue, the world size, the training
    data's identity: ``data()``, described once, when a checkpoint first asks) and the last
    batch handed out (its samples by shard and row, and their examples' md5: the probe a
    resume reads again to prove the data holds the same samples). A checkpoint keeps every
    rank's; ``load_state_dict`` continues from them on this rank, on the same world size or
    another, or refuses naming what differs. ``last`` names the last batch's samples
    (shard relative to the training directory, row), for the sample trace."""

    def __init__(self, *, policy: Policy, reader: ShardReader, paths: Sequence[Path],
                 collate: Callable[[Sequence[Sample]], dict], batch_size: int, world_size: int,
                 data: Callable[[], dict[str, Any]], prefetch: bool = True, rank: int = 0):
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        self.policy, self.reader, self.paths, self.collate = policy, reader, list(paths), collate
        self.batch_size, self.world_size, self.rank, self._describe = batch_size, world_size, rank, data
        self.names = [p.relative_to(reader.root).as_posix() for p in self.paths]
        self._data: dict[str, Any] | None = None
        self.prefetch = prefetch and not policy.main_thread
        self._position: Position = (0, 0)
        self._last: tuple[list[Sample], np.ndarray] | None = None  # the last batch: samples, [n, 2] (shard, row)
        self._sizes: dict[int, int] = {}  # samples in each shard sized so far (a metadata open each, once)
        self._it: Iterator[tuple[list[Sample], np.ndarray, Position]] | None = None
        self._pending: watchdog.Read | None = None  # the read in flight (the poll looks at it)
        self._reading: watchdog.Read | None = None  # the read whose thread draws now

    # -- what the policy may ask (sampler.Source), inside the read that draws

    def size(self, shard: int) -> int:
        if shard in self._sizes:
            return self._sizes[shard]
        path, read = self.paths[shard], self._reading
        if read is None:
            n = self.reader.wait(path, lambda r: self.reader.size(r, path))
        else:
            n = self.reader.size(read, path)
        self._sizes[shard] = n
        return n

    def samples(self, draw: Draw) -> list[Sample]:
        if self._reading is None:
            data, where = self.reader.wait(self.reader.root, lambda r: self._read(r, draw))
        else:
            data, where = self._read(self._reading, draw)
        return [data[int(i)] for i in where]

    def _read(self, read: watchdog.Read, draw: Draw) -> tuple[Shard, np.ndarray]:
        """``draw``'s samples: one Shard of the rows read (each shard's rows in file order,
        read once) and where each sample of the draw lies in it."""
        where = np.empty(len(draw), dtype=np.int64)
        known = np.array(sorted(draw.known), dtype=np.int64)
        need = np.setdiff1d(np.arange(len(draw)), known)
        parts, base = [], 0
        for s in np.unique(draw.shard[need]):
            sel = need[draw.shard[need] == s]
            rows, back = np.unique(draw.row[sel], return_inverse=True)
            path = self.paths[int(s)]
            part = self.reader.rows(read, path, rows)
            if draw.lengths is not None:
                wrong = np.flatnonzero(part.lengths[back] != draw.lengths[sel])
                if len(wrong):
                    j = int(wrong[0])
                    raise DataError(f"{path}: sample {int(draw.row[sel][j])} has {int(part.lengths[back][j])} tokens, "
                                    f"but the length index of {self.reader.root} says {int(draw.lengths[sel][j])}: the "
                                    "index was made for other data (remake the strata: python -m input_preprocessing "
                                    "stratify)")
            parts.append(part)
            where[sel] = base + back
            base += len(part)
        if len(known):
            parts.append(Shard.from_samples([draw.known[int(j)] for j in known]))
            where[known] = base + np.arange(len(known))
        return (parts[0] if len(parts) == 1 else Shard.concat(parts)), where

    # -- the stream

    def _start(self, draws: Iterator[Draw]) -> watchdog.Read:
        if self.policy.main_thread:
            draw = next(draws)  # its collective, in step order
            self._pending = self.reader.start(self.reader.root, lambda r: (draw, self._read(r, draw)))
        else:
            def load(read: watchdog.Read) -> tuple[Draw, tuple[Shard, np.ndarray]]:
                self._reading = read
                try:
                    draw = next(draws)
                    return draw, self._read(read, draw)
                finally:
                    self._reading = None

            self._pending = self.reader.start(self.reader.root, load)
        return self._pending

    def _batches(self) -> Iterator[tuple[list[Sample], np.ndarray, Position]]:
        """Endless (a batch's samples, their (shard, row), the position after its last) from
        ``self._position`` on; a batch may span draws."""
        draws = self.policy.draws(self._position, self)
        pending = self._start(draws)
        batch: list[Sample] = []
        ids: list[np.ndarray] = []
        while True:
            draw, (data, where) = pending.result()  # bounded: data.read_timeout_s per file
            if self.prefetch:
                pending = self._start(draws)
            order, i = where.tolist(), 0
            while i < len(order):
                take = order[i:i + self.batch_size - len(batch)]
                batch += [data[j] for j in take]
                ids.append(np.stack([draw.shard[i:i + len(take)], draw.row[i:i + len(take)]], axis=1))
                i += len(take)
                if len(batch) == self.batch_size:
                    yield batch, np.concatenate(ids), draw.after(i - 1)
                    batch, ids = [], []
            if not self.prefetch:
                pending = self._start(draws)

    def __iter__(self) -> TrainLoader:
        return self

    def __next__(self) -> dict:
        if self._it is None:
            self._it = self._batches()
        batch, ids, self._position = next(self._it)
        self._last = batch, ids
        return self.collate(batch)

    @property
    def last(self) -> list[list[Any]]:
        """The last batch handed out, sample by sample: [shard relative to the training
        directory, row]."""
        return [] if self._last is None else [[self.names[s], r] for s, r in self._last[1].tolist()]

    def failure(self) -> str | None:
        """Why the read in flight cannot deliver (bad data, or past its bound), without waiting."""
        return self._pending.failure() if self._pending is not None else None

    @property
    def data(self) -> dict[str, Any]:
        """The training data's identity (``describe_data``), described once."""
        if self._data is None:
            self._data = self._describe()
        return self._data

    def state_dict(self) -> dict[str, Any]:
        out = {"policy": self.policy.name, "position": [int(x) for x in self._position], "world_size": self.world_size,
               "data": self.data, **self.policy.state(self._position, self)}
        if self._last is not None:  # hashed here, at a checkpoint, never per step
            samples, _ = self._last
            out["probe"] = {"samples": self.last[:PROBE],
                            "examples_md5": examples_md5(Shard.from_samples(samples[:PROBE]))}
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the stream ``state`` describes: every rank's ``state_dict`` as a checkpoint
        keeps them (``{"world_size": W, "ranks": [...]}``), or this rank's own (a run of the
        same world size). ``DataError`` naming what differs when it was drawn by another
        sampling road or from other training data (a part of the identity that one side lacks,
        an md5 list, is not compared), or when the samples it last trained on (each earlier
        rank's probe, read again here by rank ``r % world_size``) are not what these files hold."""
        states = [_current(st) for st in state["ranks"]] if "ranks" in state else None
        first = states[0] if states else _current(state)
        then = int(state.get("world_size") or first.get("world_size") or self.world_size)
        states = states or [first] * (then if then == self.world_size else 1)
        theirs = {"policy": first.get("policy"), **first.get("data", {})}
        mine = {"policy": self.policy.name, **self.data}
        differ = [f"{k} {theirs.get(k)} there, {v} here" for k, v in mine.items()
                  if theirs.get(k) != v and v is not None and (theirs.get(k) is not None or not first.get("older"))
                  and not (k == "md5sums.txt" and theirs.get(k) is None)]
        if differ:
            raise ResumeRefused(f"its training stream was drawn otherwise: {'; '.join(differ)}")
        if len(states) != then or (first.get("older") and then != self.world_size):
            raise ResumeRefused(f"its training stream was saved as one rank's own position (world_size {then} there, "
                                f"{self.world_size} here): it resumes on {then} ranks only; every rank's, gathered "
                                "(a checkpoint's stream.json), resumes on any")
        self.close()
        for r in range(self.rank, len(states), self.world_size):
            self._check_probe(states[r].get("probe"), r)
        try:
            self._position = self.policy.resume(states, then, self)
        except ValueError as e:  # DataError stays what it is: a file of the data
            if isinstance(e, DataError):
                raise
            raise ResumeRefused(f"its training stream cannot continue here: {e}") from None

    def read_named(self, samples: Sequence[Sequence[Any]]) -> list[Sample]:
        """The samples named [shard relative to the training directory, row], read (every guard)."""
        where = {name: i for i, name in enumerate(self.names)}
        missing = sorted({name for name, _ in samples if name not in where})
        if missing:
            raise DataError(f"{self.reader.root} holds no {missing[0]}")
        shard = np.array([where[name] for name, _ in samples], dtype=np.int64)
        row = np.array([r for _, r in samples], dtype=np.int64)
        return self.samples(Draw(shard, row, (0, 0), (0, 0)))

    def skip(self, samples: int) -> None:
        """Move the position ``samples`` samples on, from the policy alone (no sample read): a
        stream worked out, not trained (bert/trace.py)."""
        self.close()
        self._position = self.policy.seek(self._position, samples, self)

    def ahead(self, count: int) -> list[list[Any]]:
        """[shard, row] of the next ``count`` samples this stream hands out, from its policy
        alone (shard sizes from their metadata; no sample read)."""
        out: list[list[Any]] = []
        for d in self.policy.draws(self._position, self):
            out += [[self.names[s], r] for s, r in zip(d.shard.tolist(), d.row.tolist())]
            if len(out) >= count:
                return out[:count]
        raise AssertionError("draws are endless")

    def _check_probe(self, probe: dict[str, Any] | None, rank: int) -> None:
        """Read rank ``rank``'s last batch again (every guard) and compare its examples' md5:
        files regenerated under the same names and sizes hold other samples."""
        if not probe or not probe.get("samples"):
            return
        got = examples_md5(Shard.from_samples(self.read_named(probe["samples"])))
        if got != probe["examples_md5"]:
            files = ", ".join(sorted({name for name, _ in probe["samples"]})[:3])
            raise ResumeRefused(f"the samples rank {rank} trained on last (rows of {files}) are other samples here "
                                f"(examples md5 {got}, {probe['examples_md5']} there): {self.reader.root} holds other "
                                "data under the same names and sizes (made again?)")

    def close(self) -> None:
        """Stop drawing: the generator ends, and the read in flight is waited for (at most its
        bound; a read ahead takes milliseconds), its data unused."""
        if self._it is not None:
            self._it.close()  # type: ignore[attr-defined]
            self._it = None
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.settle()


def _current(state: dict[str, Any]) -> dict[str, Any]:
    """A stream state in today's form: the two loaders' states of checkpoints written before
    one loader served every road (an epoch and offset, or a step), with what they recorded."""
    if "position" in state:
        return state
    if "epoch" in state:
        return {"policy": "shard_order", "position": [state["epoch"], state["offset"]], "older": True,
                "world_size": state.get("world_size"), "data": {"shards": state.get("num_shards")}}
    if "step" in state:
        return {"policy": "ids", "position": [state["step"], 0], "world_size": state.get("world_size"), "older": True,
                "data": {"samples": state.get("samples")}}
    raise ResumeRefused(f"its training stream's position is not one this loader knows: {sorted(state)}")


def _digest(obj: Any) -> str:
    return hashlib.md5(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        pass
    # Raised outside the handler: no OSError in its context, so the checkpoint write that asked
    # does not take it for its own failure (bert/storage.py os_error): bad input, exit 2.
    raise DataError(f"{path}: no such file (removed or moved since the directory was listed?)")


def describe_data(root: Path, paths: Sequence[Path], index: LengthIndex | None) -> dict[str, Any]:
    """The training data's identity, what a checkpoint records and a resume must match: the
    kind of directory, its shards (their names relative to it and sizes: the same data
    under another path is the same), the strata's bounds and manifest, the length index's
    sample count, and the md5 list where there is one. Stats every shard and reads the two
    small lists: after run_start, and only when a checkpoint or a resume asks."""
    names = [[p.relative_to(root).as_posix(), _size(p)] for p in paths]
    md5 = root / "md5sums.txt"
    out: dict[str, Any] = {
        "directory": "strata" if (root / "manifest.json").exists() else "plain", "shards": len(paths),
        "files": _digest(names), "md5sums.txt": _digest(md5.read_text()) if md5.is_file() else None}
    if index is not None:
        out["samples"] = int(len(index.lengths))
    if index is not None and index.bounds:
        out["strata bounds"] = [list(b) for b in index.bounds]
        out["manifest.json"] = _digest((root / "manifest.json").read_text())
    return out


COPY_FIX = ("one shard copied over another trains its samples twice an epoch and some never (a shuffle that "
            "wrote one shard twice stalled MLPerf runs near 0.63 masked-LM accuracy instead of 0.72); make the data "
            "again, or remove the copy (and its md5sums.txt line)")


def check_copies(root: Path, reader: ShardReader, index: LengthIndex | None) -> None:
    """Refuse a training directory that holds the same shard twice, from what start-up reads
    anyway: the md5 list (two files, one md5), and the length index where the sampling mode
    has one (two shards with the same lengths, row for row, compared by a key of each: its
    count and first and last 32 lengths, then confirmed by reading both: equal lengths alone
    are not a copy). One dictionary over the md5 list and one sort of the keys (BENCHMARKS.md
    section 15); nothing read unless two shards look alike."""
    if reader.manifest is not None:
        first: dict[str, str] = {}
        for rel, digest in sorted(reader.manifest.sums.items()):
            if digest in first:
                raise DataError(f"data.train_dir={root}: {first[digest]} and {rel} are the same file (md5 {digest} in "
                                f"{reader.manifest.path}): {COPY_FIX}")
            first[digest] = rel
    if index is None:
        return
    starts, ends = index.offsets[:-1], index.offsets[1:]
    shards = np.flatnonzero(ends > starts)  # an empty shard holds nothing twice
    if not len(shards):
        return
    k = np.arange(32)
    first = index.lengths[np.minimum(starts[shards, None] + k, ends[shards, None] - 1)]
    last = index.lengths[np.maximum(ends[shards, None] - 32 + k, starts[shards, None])]
    keys = np.ascontiguousarray(np.concatenate([(ends - starts)[shards, None], first, last], axis=1))
    # one opaque value per shard: one sort of byte strings, not a 65-key lexsort
    _, group_of, count = np.unique(keys.view(np.dtype((np.void, keys.itemsize * keys.shape[1]))).reshape(-1),
                                   return_inverse=True, return_counts=True)
    for g in np.flatnonzero(count > 1):
        group = shards[group_of == g].tolist()
        for j, a in enumerate(group):
            for b in group[j + 1:]:
                la = index.lengths[index.offsets[a]:index.offsets[a + 1]]
                lb = index.lengths[index.offsets[b]:index.offsets[b + 1]]
                if np.array_equal(la, lb) and _same_samples(reader, index.paths[a], index.paths[b]):
                    ra, rb = (p.relative_to(root).as_posix() for p in (index.paths[a], index.paths[b]))
                    raise DataError(f"data.train_dir={root}: {ra} and {rb} hold the same samples: {COPY_FIX}")


def _same_samples(reader: ShardReader, a: Path, b: Path) -> bool:
    x, y = reader.wait(a, lambda read: (reader.whole(read, a), reader.whole(read, b)))
    return all(np.array_equal(getattr(x, k), getattr(y, k)) for k in
               ("tokens", "segments", "offsets", "mlm_positions", "mlm_ids", "mlm_offsets", "nsp"))


def check_train_dir(train_dir: str, sm: SamplerConfig) -> bool:
    """Whether ``train_dir`` is a strata directory (``input_preprocessing stratify``'s, with
    its manifest.json), refusing the kinds of directory a run cannot use as asked: one stratum
    of a strata directory (it would train on one length range only, and its md5 list is one
    level up), and a plain directory given to the stratified sampler without
    ``sampler.strata_width``. A strata directory serves every sampler: the closed division's
    uniform order reads it by id, through the same guards. Two stats; after run_start."""
    root = Path(train_dir)
    if not train_dir:
        return False
    if (root / "manifest.json").exists():
        return True
    if root.name.startswith("stratum_") and (root.parent / "manifest.json").exists():
        raise DataError(f"data.train_dir={train_dir} is one stratum of the strata directory {root.parent}: a run on "
                        f"it would train on one range of lengths only; point data.train_dir (DATADIR) at {root.parent}")
    if sm.mode == "stratified" and not sm.strata_width:
        raise DataError(f"sampler.mode=stratified needs length strata, but data.train_dir={train_dir} is a plain "
                        "directory of shards (no manifest.json): point data.train_dir (DATADIR) at the strata directory "
                        "made from it by `python -m input_preprocessing stratify` (prepare_data.sh: "
                        "hdf5/training_<N>_strata), or set sampler.strata_width to cut strata from its lengths")
    return False


@dataclass
class TrainingData:
    """The training directory opened for reading: its reader (every guard), its shards in the
    order global ids count them, and the length index where the sampling mode needs one."""

    reader: ShardReader
    paths: list[Path]
    index: LengthIndex | None

    @classmethod
    def open(cls, *, data: DataConfig, sampler: SamplerConfig, model: ModelConfig, read_timeout_s: float = 60.0,
             stopped: Callable[[], str | None] | None = None) -> TrainingData:
        """Closed-division sampling (random, no deal) over a plain directory draws by
        ``ShardOrder`` (each rank reads its own shards, whole; no index). Everything else -- a
        strata directory, a deal, packed rows -- draws by id from the length index (its
        ``random`` is a uniform permutation of all samples per epoch)."""
        d, sm, m = data, sampler, model
        reader = ShardReader(d.train_dir, max_seq_length=d.max_seq_length,
                             bounds=Bounds(m.vocab_size, m.type_vocab_size), verify_md5=d.verify_md5,
                             timeout_s=read_timeout_s, stopped=stopped)
        stratified_dir = check_train_dir(d.train_dir, sm)
        if sm.mode == "random" and sm.deal == "none" and not stratified_dir and not m.pack:
            return cls(reader, list_shards(d.train_dir), None)
        index = LengthIndex.from_dir(d.train_dir, reader)
        return cls(reader, index.paths, index)

    def policy(self, *, data: DataConfig, sampler: SamplerConfig, model: ModelConfig, rank: int, world_size: int,
               local_batch: int, accum: int, seed: int, resume: dict[str, Any] | None = None) -> Policy:
        """Rank ``rank``'s policy (of ``world_size``), for ``local_batch`` samples a micro-step and
        ``accum`` micro-steps a step; cutting the stream as the one ``resume`` (a stream state:
        ``TrainLoader.load_state_dict``'s argument) was cut, where it began on another world
        size or batch split (its draw units decide the strata counts, not this run's)."""
        if self.index is None:
            return ShardOrder(len(self.paths), rank, world_size, seed)
        saved = ((resume.get("ranks") or [resume])[0] or {}).get("canon") if resume else None
        return build_policy(sampler, self.index, rank=rank, world_size=world_size, local_batch=local_batch, seed=seed,
                            max_seq_length=data.max_seq_length, hidden=model.hidden_size, accum=accum,
                            canon=Canon(*(int(x) for x in saved)) if saved else None)

    def identity(self) -> dict[str, Any]:
        return describe_data(self.reader.root, self.paths, self.index)


def train_batches(*, data: DataConfig, sampler: SamplerConfig, model: ModelConfig, plan: BatchPlan, seed: int,
                  rank: int, world_size: int, accum: int = 1, read_timeout_s: float = 60.0,
                  stopped: Callable[[], str | None] | None = None, prefetch: bool = True,
                  resume: dict[str, Any] | None = None) -> TrainLoader:
    """The training stream of ``plan.batch_size`` samples per rank (``accum`` micro-batches a
    step), its policy chosen once from the data, sampler and model sections
    (``TrainingData``); ``read_timeout_s`` the seconds a shard may take to read
    (``config.read_timeout_s``); ``stopped()`` why the run must stop now (a wait for data
    ends on it); ``resume``: the stream a checkpoint saved, continued (``load_state_dict``).
    One reader, one loader, whichever the policy."""
    train = TrainingData.open(data=data, sampler=sampler, model=model, read_timeout_s=read_timeout_s, stopped=stopped)
    policy = train.policy(data=data, sampler=sampler, model=model, rank=rank, world_size=world_size,
                          local_batch=plan.batch_size, accum=accum, seed=seed, resume=resume)
    check_copies(Path(data.train_dir), train.reader, train.index)
    stream = TrainLoader(policy=policy, reader=train.reader, paths=train.paths, collate=plan.collate,
                         batch_size=plan.batch_size, world_size=world_size, rank=rank, data=train.identity,
                         prefetch=prefetch)
    if resume is not None:
        stream.load_state_dict(resume)
    return stream


# ---------------------------------------------------------------- evaluation


def check_eval_dir(train_dir: str | Path, eval_dir: str | Path) -> None:
    """Refuse an eval set that is the training directory, lies inside it, or shares a file
    with it (the same inode: a hard link or symlink counts): the run would "evaluate" on
    training samples. Lists and stats every training shard (4,320 stats on the full set,
    well under a second on a local disk); a touch of the data, so only after run_start."""
    t, e = Path(train_dir).resolve(), Path(eval_dir).resolve()
    fix = "point data.eval_dir (EVALDIR) at the separate eval set (10,000 samples for the benchmark)"
    if e == t or t in e.parents:
        raise DataError(f"data.eval_dir={eval_dir} is, or lies inside, data.train_dir={train_dir}: {fix}")
    if not e.exists():
        return  # EvalSet says so, naming the path
    train_files = {(st.st_dev, st.st_ino) for st in
                   (q.stat() for q in t.rglob("*") if q.suffix in SHARD_SUFFIXES and q.is_file())}
    for q in [e] if e.is_file() else list_shards(e):
        st = q.stat()
        if (st.st_dev, st.st_ino) in train_files:
            raise DataError(f"data.eval_dir={eval_dir}: {q.name} is also a file of data.train_dir={train_dir}: {fix}")


class EvalSet:
    """The first ``limit`` samples (0 = all) of a file or a directory of files (sorted),
    of which rank r keeps samples r, r+W, ...; held in memory (10,000 samples ~ 10 MB).

    Ranks may hold one sample more than others and so yield different batch counts; the
    caller sums correct/total counts across ranks once per evaluation.
    """

    def __init__(self, eval_dir_or_file: str | Path, rank: int, world_size: int, limit: int = 0,
                 max_seq_length: int | None = None, *, bounds: Bounds | None = None, verify_md5: bool = True,
                 read_timeout_s: float = 60.0, stopped: Callable[[], str | None] | None = None):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        if limit < 0:
            raise ValueError(f"limit must be >= 0 (0 = all), got {limit}")
        p = Path(eval_dir_or_file)
        if not p.exists():
            raise DataError(f"{p}: no such eval file or directory")
        paths = [p] if p.is_file() else list_shards(p)
        reader = ShardReader(p.parent if p.is_file() else p, max_seq_length=max_seq_length, bounds=bounds,
                             verify_md5=verify_md5, timeout_s=read_timeout_s, stopped=stopped)

        def load(read: watchdog.Read) -> tuple[list[Shard], int]:
            parts, total = [], 0
            for path in paths:  # each file under the watchdog's bound, checked as training shards are
                shard = reader.whole(read, path)
                if limit and total + len(shard) > limit:
                    shard = shard.subset(np.arange(limit - total))
                parts.append(shard)
                total += len(shard)
                if limit and total >= limit:
                    break
            return parts, total

        parts, total = reader.wait(p, load)
        if limit and total < limit:
            raise DataError(f"data.eval_samples={limit} but {p} holds {total} samples: set data.eval_samples="
                            f"{total} (or 0 = all), or point data.eval_dir (EVALDIR) at the full eval set")
        self.total_samples = total  # across all ranks
        self.shard = Shard.concat(parts, str(p)).subset(np.arange(rank, total, world_size))

    def __len__(self) -> int:
        return len(self.shard)


def eval_batches(eval_set: EvalSet, plan: BatchPlan) -> list[dict]:
    """The eval set's batches by ``plan`` (collated once at start-up): with token budgets
    each padded to a static budget and the last one filled up to the batch size, so every
    batch has a captured shape."""
    fn, shard, n = plan.collate, eval_set.shard, plan.batch_size
    return [fn([shard[i] for i in range(a, min(a + n, len(shard)))]) for a in range(0, len(shard), n)]
