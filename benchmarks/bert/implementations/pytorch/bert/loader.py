"""What a run reads: the training batch iterator and the eval set, chosen once from the
data, sampler and model sections (``train_batches``, ``EvalSet``, ``eval_batches``).

Shards (bert/shards.py) are read under a watchdog (bert/watchdog.py), checked against the
directory's md5 manifest (bert/integrity.py) and the model's bounds, and collated into
batches (bert/batches.py; static token budgets: bert/budget.py).

Sampling is kept apart from reading: ``RandomShardOrder`` says which shards a rank reads in
an epoch and in which order it takes their samples; ``SampleStream`` reads what the policy
names; ``TrainLoader`` only cuts the stream into batches. A different policy (stratified
sampling, ``bert/sampler.py``) replaces the first piece and reuses the other two;
its id-based ``IndexLoader`` serves every mode but the closed division's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterator, Protocol, Sequence

import numpy as np

from . import watchdog
from .batches import collate, collate_packed, pinned
from .budget import BudgetCollate, Layout
from .config import DataConfig, ModelConfig, SamplerConfig
from .reader import ShardReader
from .sampler import IdReader, IndexLoader, LengthIndex, build_sampler
from .shards import SHARD_SUFFIXES, Bounds, DataError, Sample, Shard, list_shards, shard_size


# ---------------------------------------------------------------- sampling policy


class ShardPolicy(Protocol):
    """Which shards a rank reads in an epoch, and which of their samples, in what order."""

    def shards(self, epoch: int) -> list[int]: ...

    def select(self, epoch: int, shard: int, num_samples: int) -> np.ndarray: ...


class RandomShardOrder:
    """Closed-division random order, deterministic from ``seed``.

    Epoch e shuffles the shard list with ``seed + e``. With at least as many shards as
    ranks, the shuffled list is dealt round-robin (rank r reads shards r, r+W, ...), so each
    sample is read by exactly one rank per epoch; with fewer shards every rank reads every
    shard and keeps samples r, r+W, ... of its permutation. Inside a shard the samples are
    permuted with (seed, epoch, shard index in the sorted list).
    """

    def __init__(self, num_shards: int, rank: int, world_size: int, seed: int):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        self.num_shards, self.rank, self.world_size, self.seed = num_shards, rank, world_size, seed
        self.dealt = num_shards >= world_size

    def shards(self, epoch: int) -> list[int]:
        order = np.random.default_rng(self.seed + epoch).permutation(self.num_shards)
        return order[self.rank::self.world_size].tolist() if self.dealt else order.tolist()

    def select(self, epoch: int, shard: int, num_samples: int) -> np.ndarray:
        perm = np.random.default_rng([self.seed, epoch, shard]).permutation(num_samples)
        return perm if self.dealt else perm[self.rank::self.world_size]


# ---------------------------------------------------------------- reading what the policy names


class SampleStream:
    """Endless samples of one rank: epoch after epoch of what ``policy`` names.

    Yields ``(epoch, offset, sample)``, ``offset`` counting this rank's samples within the
    epoch, so a position can be saved and resumed. With ``prefetch`` the next shard is read
    while the current one is consumed, so file I/O overlaps the training step (torch kernels
    release the GIL); costs one extra shard in memory. Every read goes through ``reader``
    (bert/reader.py: the watchdog, the md5 list, the model's bounds).
    """

    def __init__(self, paths: Sequence[Path], policy: ShardPolicy, reader: ShardReader, prefetch: bool = True):
        self.paths, self.policy, self.reader, self.prefetch = list(paths), policy, reader, prefetch
        self.pending: watchdog.Read | None = None  # the read in flight (the poll looks at it)

    def _count(self, epoch: int, shard: int) -> int:
        path = self.paths[shard]

        def size(read: watchdog.Read) -> int:
            read.at(path)
            return shard_size(path)

        return len(self.policy.select(epoch, shard, self.reader.wait(path, size)))

    def _plan(self, epoch: int, offset: int) -> Iterator[tuple[int, int, int]]:
        """Endless (epoch, shard, samples of it to skip), starting at ``offset`` of ``epoch``.

        Resuming skips whole shards from metadata alone (one file open each, no data read);
        only the shard that holds the offset is read and partly skipped.
        """
        skip = offset
        while True:
            for shard in self.policy.shards(epoch):
                if skip:
                    n = self._count(epoch, shard)
                    if skip >= n:
                        skip -= n
                        continue
                yield epoch, shard, skip
                skip = 0
            epoch, skip = epoch + 1, 0

    def _read(self, epoch: int, shard: int) -> watchdog.Read:
        path = self.paths[shard]

        def load(read: watchdog.Read) -> tuple[Shard, np.ndarray]:
            data = self.reader.whole(read, path)
            return data, self.policy.select(epoch, shard, len(data))

        self.pending = self.reader.start(path, load)
        return self.pending

    def failure(self) -> str | None:
        """Why the read in flight cannot deliver (bad data, or past its bound), without waiting."""
        return self.pending.failure() if self.pending is not None else None

    def __call__(self, epoch: int = 0, offset: int = 0) -> Iterator[tuple[int, int, Sample]]:
        """Samples from ``offset`` (this rank's count within ``epoch``) on."""
        plan = self._plan(epoch, offset)
        ep, shard, skip = next(plan)
        pos = offset if ep == epoch else 0
        pending = self._read(ep, shard)
        idle = 0  # consecutive shards that gave this rank nothing
        while True:
            data, order = pending.result()  # waits at most read_timeout_s past the read's start
            nxt = next(plan)
            if self.prefetch:
                pending = self._read(nxt[0], nxt[1])
            for i in order[skip:]:
                yield ep, pos, data[int(i)]
                pos += 1
            idle = idle + 1 if len(order) <= skip else 0
            if idle > 2 * len(self.paths):  # else a rank with nothing to read spins forever
                raise DataError(f"{self.paths[0].parent}: this rank got no samples from {idle} "
                                "shards in a row; too few samples for the world size")
            if nxt[0] != ep:
                pos = 0
            ep, shard, skip = nxt
            if not self.prefetch:
                pending = self._read(ep, shard)


class TrainLoader:
    """Endless local training batches of one rank (every rank yields forever, so ranks never
    disagree on the number of steps; an epoch ends at different steps on different ranks).

    ``state_dict()`` is the stream position of the next sample not yet handed out, so a
    resumed run continues with the same batches.
    """

    def __init__(self, train_dir: str | Path, rank: int, world_size: int, local_batch_size: int,
                 seed: int, unpad: bool, max_seq_length: int, *, prefetch: bool = True,
                 policy: ShardPolicy | None = None, collate_fn: Any = None, reader: ShardReader | None = None):
        if local_batch_size <= 0:
            raise ValueError(f"local_batch_size must be positive, got {local_batch_size}")
        self.paths = list_shards(train_dir)
        self.policy = policy or RandomShardOrder(len(self.paths), rank, world_size, seed)
        # None: structure and values checked, the md5 list where there is one, no model bounds
        reader = reader or ShardReader(train_dir, max_seq_length=max_seq_length, bounds=None, verify_md5=True,
                                       timeout_s=60.0)
        self.stream = SampleStream(self.paths, self.policy, reader, prefetch)
        self.rank, self.world_size = rank, world_size
        self.local_batch_size, self.unpad, self.max_seq_length = local_batch_size, unpad, max_seq_length
        # samples -> batch; None = ``collate`` in the ``unpad`` layout (bert.budget's pads it).
        self.collate_fn = collate_fn
        self._epoch, self._offset = 0, 0
        self._it: Iterator[tuple[int, int, Sample]] | None = None

    @property
    def epoch(self) -> int:
        """Epoch of the next sample to be handed out."""
        return self._epoch

    def __iter__(self) -> TrainLoader:
        return self

    def __next__(self) -> dict[str, Any]:
        if self._it is None:
            self._it = self.stream(self._epoch, self._offset)
        batch = []
        for _ in range(self.local_batch_size):
            ep, off, sample = next(self._it)
            batch.append(sample)
        self._epoch, self._offset = ep, off + 1
        if self.collate_fn is not None:
            return self.collate_fn(batch)
        return collate(batch, self.unpad, self.max_seq_length)

    def failure(self) -> str | None:
        """A shard read that failed or overran ahead of the loop (bert.checkpoint's poll asks)."""
        return self.stream.failure()

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self._epoch, "offset": self._offset, "rank": self.rank,
                "world_size": self.world_size, "num_shards": len(self.paths)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        for key, mine in (("world_size", self.world_size), ("num_shards", len(self.paths))):
            if key in state and state[key] != mine:
                raise ValueError(f"loader state was saved with {key}={state[key]}, this run has {mine}")
        self.close()
        self._epoch, self._offset = int(state["epoch"]), int(state["offset"])

    def close(self) -> None:
        """Stop the prefetch thread (also happens when the loader is garbage-collected)."""
        if self._it is not None:
            self._it.close()  # type: ignore[attr-defined]
            self._it = None


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


# ---------------------------------------------------------------- what the trainer builds


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


def train_batches(d: DataConfig, sm: SamplerConfig, m: ModelConfig, local_batch: int, seed: int, rank: int,
                  world_size: int, budget: Layout | None = None, pin: bool = False,
                  read_timeout_s: float = 60.0, stopped: Callable[[], str | None] | None = None) -> Any:
    """The training batch iterator of ``local_batch`` samples per rank, chosen once from the
    data, sampler and model sections; ``budget`` is the static token budget layout
    (``bert.budget.layout_for``; None when data.token_budgets is off); ``read_timeout_s``
    the seconds a shard may take to read (``config.read_timeout_s``); ``stopped()`` why the
    run must stop now (a wait for data ends on it).

    Closed-division sampling (random, no deal) on a plain directory keeps ``TrainLoader``
    (each rank reads its own shards). Everything else -- a strata manifest, a deal, packed
    rows -- goes through the id-based ``IndexLoader`` (bert/sampler.py); its ``random`` is a
    uniform permutation of all samples per epoch. Both read through one ``ShardReader``
    (bert/reader.py), under the same guards. ``pin``: batches in pinned host memory (a CUDA
    run).
    """
    # Static token budgets (data.token_budgets): training batches only; eval stays exact.
    fn = batch_collate(m.unpad, m.pack, d.max_seq_length, budget, pin=pin)
    reader = ShardReader(d.train_dir, max_seq_length=d.max_seq_length, bounds=Bounds(m.vocab_size, m.type_vocab_size),
                         verify_md5=d.verify_md5, timeout_s=read_timeout_s, stopped=stopped)
    stratified_dir = check_train_dir(d.train_dir, sm)
    if sm.mode == "random" and sm.deal == "none" and not stratified_dir and not m.pack:
        return TrainLoader(d.train_dir, rank, world_size, local_batch, seed, m.unpad, d.max_seq_length,
                           collate_fn=fn, reader=reader)
    index = LengthIndex.from_dir(d.train_dir, reader)
    sampler = build_sampler(sm, index, rank, world_size, local_batch, seed, d.max_seq_length, m.hidden_size)
    return IndexLoader(sampler, IdReader(index, reader), fn, gather=sm.lengths == "gather")


def eval_batches(eval_set: Any, batch_size: int, unpad: bool, pack: bool, max_seq_length: int,
                 layout: Any = None, pin: bool = False) -> list[dict]:
    """The eval set's batches in the model's layout (collated once at start-up); with
    ``layout`` (``bert.ladder.eval_layout_for``) each padded to a static token budget and the
    last one filled up to ``batch_size`` samples, so every batch has a captured shape."""
    fn = batch_collate(unpad, pack, max_seq_length, layout, samples=batch_size if layout is not None else None,
                       pin=pin)
    shard = eval_set.shard
    return [fn([shard[i] for i in range(a, min(a + batch_size, len(shard)))])
            for a in range(0, len(shard), batch_size)]
