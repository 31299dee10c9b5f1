"""Which samples each rank trains on at each step: stratified sampling, local presorting,
global exchange and packing (the load-balance techniques of Kim et al. 2024).

Every policy (``Policy``) names the samples one rank trains on by global id, a row of a
shard, draw after draw (``Draw``); the loader (bert/loader.py) reads whatever is named the
same way, so the sampling modes differ here only. The closed division's ``ShardOrder`` deals
whole shards to ranks (each rank reads its own shards, whole; no index needed, the shard
sizes come from their metadata). Every other mode works on dense ids (sample ``i`` of the
dataset = row ``i - offset[s]`` of shard ``s``) and a length per id (``LengthIndex``, from
the data pipeline's ``length_index.npz`` or measured once at start-up), so that any rank can
compute what any other rank of its group will draw without exchanging anything, and read
exactly its own samples by row (``IdOrder``; ``GatherDeal`` learns the lengths by exchange).

Modes (``SamplerConfig``), each a pure function of (seed, step), hence deterministic and
resumable from the step counter alone:

- ``random``: one stratum holding every sample; each epoch is a fresh uniform permutation.
- ``stratified``: samples are binned by length into strata (the manifest's, or finer
  virtual strata of ``strata_width`` tokens cut from the length index); every draw unit (a
  rank, or a group of ranks with ``draw=group``) takes a fixed count per stratum at every
  step, by largest-remainder rounding of the strata's shares (``counts`` overrides);
  ``rounding=carry`` rounds each step's running deficit instead (``CountSchedule``), which
  fine strata need to keep every stratum's share exact over time.

  *Epoch.* Each stratum k is an endless stream: epoch e of stratum k is the permutation
  ``rng(seed, k, e)`` of its ids, and step t takes positions
  ``[U * n_k(t), U * n_k(t + 1))`` of the concatenated stream (U draw units, n_k(t) =
  samples of stratum k one unit took before step t; ``t * c_k`` under fixed counts). Within a stratum epoch every sample is drawn exactly once: none repeated, none
  lost; a step that straddles the end takes the tail of epoch e and the head of e + 1.
  Strata run through their epochs at slightly different rates (c_k / (U c_k) vs N_k / N
  differ by the rounding), so "the data epoch" is nominal: ``total_samples / global
  batch`` steps.
- a ``deal`` over groups of ``group_size`` ranks (a node): the group's samples are sorted
  by length and dealt back, ``B`` to each rank (counts stay equal). ``snake`` is the
  paper's boustrophedon deal; ``greedy`` puts each sample, longest first, on the rank with
  the fewest tokens that still has room; ``cost`` does the same on a FLOP model with
  attention's quadratic term. ``group_size=0`` deals over all ranks: NVIDIA's global
  exchange padding, as a comparison.
- ``lengths=gather``: the group learns its lengths by an all_gather of each rank's own
  draw (one collective per step, a sync point) instead of from the index; the deal is the
  same. Without a length index this is the only way; with one it costs time for nothing.

What a run builds from these (``train_batches``) is in bert/loader.py; packing in bert/batches.py.
"""

from __future__ import annotations

import heapq
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol, Sequence

import numpy as np
import torch

from .config import ConfigError, SamplerConfig  # ConfigError: a ValueError
from .reader import ShardReader
from .shards import DataError, Sample, list_shards, row_offsets

MANIFEST_FORMAT = "mlperf-bert-strata/1"
DEALS = ("none", "snake", "greedy", "cost")


# ---------------------------------------------------------------- pure arithmetic


def largest_remainder(shares: Sequence[float], total: int) -> np.ndarray:
    """Integers proportional to ``shares`` summing to ``total`` (Hamilton's method): floors
    first, then one more to the largest fractional parts (ties to the lower index)."""
    w = np.asarray(shares, dtype=np.float64)
    if total < 0 or w.ndim != 1 or not len(w) or (w < 0).any() or w.sum() <= 0:
        raise ValueError(f"largest_remainder: need non-negative shares with a positive sum, got {shares}")
    exact = w / w.sum() * total
    out = np.floor(exact).astype(np.int64)
    rest = exact - out
    order = np.lexsort((np.arange(len(w)), -rest))  # largest remainder first, stable
    out[order[: total - int(out.sum())]] += 1
    return out


class CountSchedule:
    """Samples per stratum per draw unit at each step, and how many were taken before it.

    ``fixed``: the same largest-remainder counts every step (the paper's 6/3/2/5 of 16).
    Fine strata round badly at a fixed count (a stratum with a share of 0.3 samples per
    unit gets 0 or 1 forever), so ``carry`` rounds each step's deficit instead:
    ``c(t) = largest_remainder(max((t + 1) * unit * share - taken(t), 0))``, which keeps
    every stratum within about one sample of its exact share at every step while the
    per-step counts vary a little. The table grows as steps are asked for (K int64 per
    step; resuming at step t computes t rows once).
    """

    def __init__(self, shares: Sequence[float], unit: int, rounding: str = "fixed",
                 override: np.ndarray | None = None):
        if rounding not in ("fixed", "carry"):
            raise ValueError(f"sampler.rounding={rounding!r} is not 'fixed' or 'carry'")
        self.shares = np.asarray(shares, dtype=np.float64) / float(np.sum(shares))
        self.unit, self.rounding = unit, rounding
        self.fixed = override if override is not None else largest_remainder(self.shares, unit)
        self._taken = np.zeros((1, len(self.shares)), dtype=np.int64)  # taken before step t

    def _grow(self, steps: int) -> None:
        rows = [self._taken[-1]]
        for t in range(len(self._taken) - 1, steps):
            d = (t + 1) * self.unit * self.shares - rows[-1]
            rows.append(rows[-1] + largest_remainder(np.maximum(d, 0.0), self.unit))
        self._taken = np.concatenate([self._taken, np.array(rows[1:]).reshape(-1, len(self.shares))])

    def taken(self, step: int) -> np.ndarray:
        """Samples of each stratum one unit took in steps 0..step-1."""
        if self.rounding == "fixed":
            return step * self.fixed
        if step >= len(self._taken):
            self._grow(step)
        return self._taken[step]

    def counts(self, step: int) -> np.ndarray:
        return self.taken(step + 1) - self.taken(step)


def attention_cost(lengths: np.ndarray, hidden: int = 1024) -> np.ndarray:
    """FLOP model of one sample, in token units: per layer the GEMMs cost 24 h^2 per token
    and attention (QK^T and PV) 4 h L per token, so cost = L + L^2 / (6 h)."""
    lengths = np.asarray(lengths, dtype=np.float64)
    return lengths + lengths * lengths / (6.0 * hidden)


def deal(lengths: np.ndarray, ranks: int, policy: str, hidden: int = 1024) -> np.ndarray:
    """Rank (0..ranks-1) of each of ``len(lengths)`` samples, ``len / ranks`` per rank.

    snake: sort longest first, deal 0,1,..,G-1,G-1,..,0,0,1,... (the paper's).
    greedy / cost: longest first, each onto the rank with the smallest load (tokens, or
    ``attention_cost``) that has fewer than its share: LPT under equal counts. A heap makes
    it O(n log G).
    """
    n = len(lengths)
    if n % ranks:
        raise ValueError(f"deal: {n} samples do not split evenly over {ranks} ranks")
    per = n // ranks
    order = np.lexsort((np.arange(n), -np.asarray(lengths)))  # longest first, stable
    out = np.empty(n, dtype=np.int64)
    if policy == "snake":
        rounds = np.arange(n) // ranks
        pos = np.arange(n) % ranks
        out[order] = np.where(rounds % 2 == 0, pos, ranks - 1 - pos)
        return out
    if policy not in ("greedy", "cost"):
        raise ValueError(f"deal policy {policy!r} is not one of {list(DEALS[1:])}")
    weight = attention_cost(lengths, hidden) if policy == "cost" else np.asarray(lengths, np.float64)
    heap = [(0.0, r) for r in range(ranks)]  # (load, rank) of ranks with room
    count = np.zeros(ranks, dtype=np.int64)
    for i in order:
        load, r = heapq.heappop(heap)
        out[i] = r
        count[r] += 1
        if count[r] < per:
            heapq.heappush(heap, (load + float(weight[i]), r))
    return out


# ---------------------------------------------------------------- strata


@dataclass(frozen=True)
class Strata:
    """Length bins ``[lo_k, hi_k]`` (inclusive, ascending, disjoint) and their shares."""

    bounds: tuple[tuple[int, int], ...]
    shares: tuple[float, ...]  # fraction of the samples in each stratum

    def of(self, lengths: np.ndarray) -> np.ndarray:
        """Stratum index of each length (-1 when outside every stratum)."""
        lengths = np.asarray(lengths)
        his = np.array([hi for _, hi in self.bounds])
        k = np.searchsorted(his, lengths)
        los = np.array([lo for lo, _ in self.bounds] + [np.iinfo(np.int64).max])
        return np.where((k < len(his)) & (lengths >= los[np.minimum(k, len(his))]), k, -1)

    def counts(self, unit: int, override: Sequence[int] = ()) -> np.ndarray:
        """Samples per stratum per draw unit of ``unit`` samples: largest-remainder rounding
        of the shares, or ``override`` ([6, 3, 2, 5]), which must sum to ``unit``."""
        return self.schedule(unit, override=override).fixed

    def schedule(self, unit: int, rounding: str = "fixed", override: Sequence[int] = ()) -> CountSchedule:
        c = None
        if len(override):
            if rounding != "fixed":
                raise ConfigError("sampler.counts fixes the counts; it needs sampler.rounding=fixed")
            c = np.array(override, dtype=np.int64)
            if len(c) != len(self.bounds) or c.sum() != unit or (c < 0).any():
                raise ConfigError(f"sampler.counts={list(override)}: need {len(self.bounds)} "
                                 f"non-negative counts summing to {unit}")
        return CountSchedule(self.shares, unit, rounding, c)

    @staticmethod
    def from_lengths(lengths: np.ndarray, bounds: Sequence[tuple[int, int]]) -> Strata:
        hist = np.bincount(np.asarray(lengths, dtype=np.int64))
        return Strata.from_histogram(np.arange(len(hist)), hist, bounds)

    @staticmethod
    def from_histogram(lengths: np.ndarray, counts: np.ndarray, bounds: Sequence[tuple[int, int]]) -> Strata:
        lengths, counts = np.asarray(lengths), np.asarray(counts, dtype=np.float64)
        n = [counts[(lengths >= lo) & (lengths <= hi)].sum() for lo, hi in bounds]
        return Strata(tuple((int(lo), int(hi)) for lo, hi in bounds), tuple(float(x / sum(n)) for x in n))


def even_bounds(max_len: int, width: int) -> list[tuple[int, int]]:
    """Strata of ``width`` tokens: [1, w], [w+1, 2w], ... up to ``max_len``."""
    if width <= 0:
        raise ValueError(f"strata width must be positive, got {width}")
    return [(lo, min(lo + width - 1, max_len)) for lo in range(1, max_len + 1, width)]


# ---------------------------------------------------------------- the length index


@dataclass
class LengthIndex:
    """Every shard of a dataset with the real length of each of its samples.

    Global id i lives in shard ``s = searchsorted(offsets, i, 'right') - 1`` at row
    ``i - offsets[s]``. Memory: 2 bytes per sample (uint16) plus the ids per stratum.
    """

    paths: list[Path]
    lengths: np.ndarray  # uint16 [N], concatenated in ``paths`` order
    offsets: np.ndarray  # int64 [len(paths) + 1]
    bounds: tuple[tuple[int, int], ...] = ()  # the manifest's strata, if any

    @staticmethod
    def from_manifest(root: str | Path) -> LengthIndex:
        """Read ``manifest.json`` and its ``length_index.npz`` (``python -m input_preprocessing stratify``)."""
        root = Path(root)
        try:
            man = json.loads((root / "manifest.json").read_text())
        except (OSError, ValueError) as e:
            raise DataError(f"{root}/manifest.json: cannot read: {e}") from None
        if man.get("format") != MANIFEST_FORMAT:
            raise DataError(f"{root}/manifest.json: format {man.get('format')!r}, expected {MANIFEST_FORMAT!r}")
        with np.load(root / man.get("length_index", "length_index.npz")) as npz:
            index = {k: npz[k] for k in npz.files}
        paths, parts, bounds = [], [], []
        for st in man["strata"]:
            bounds.append((int(st["min_len"]), int(st["max_len"])))
            for rel in st["shards"]:
                if rel not in index:
                    raise DataError(f"{root}: shard {rel} of the manifest is not in its length index")
                paths.append(root / rel)
                parts.append(index[rel].astype(np.uint16))
        lengths = np.concatenate(parts) if parts else np.zeros(0, np.uint16)
        if int(man.get("total_samples", len(lengths))) != len(lengths):
            raise DataError(f"{root}: manifest says {man['total_samples']} samples, the index holds {len(lengths)}")
        return LengthIndex(paths, lengths, row_offsets(np.array([len(p) for p in parts])), tuple(bounds))

    @staticmethod
    def from_dir(directory: str | Path, reader: ShardReader) -> LengthIndex:
        """A stratified dir (it has ``manifest.json``), else a plain dir of shards whose
        lengths are measured here: one full read of the data at start-up, every shard read
        through ``reader`` (watchdog, md5 list, bounds: those shards are then hashed for the
        run)."""
        d = Path(directory)
        if (d / "manifest.json").exists():
            return LengthIndex.from_manifest(d)
        paths = list_shards(d)
        parts = reader.wait(d, lambda read: [reader.whole(read, p).lengths.astype(np.uint16) for p in paths])
        return LengthIndex(paths, np.concatenate(parts), row_offsets(np.array([len(p) for p in parts])))

    def locate(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        shard = np.searchsorted(self.offsets, ids, side="right") - 1
        return shard, ids - self.offsets[shard]


# ---------------------------------------------------------------- the sampler


@dataclass(frozen=True)
class Canon:
    """How the stream a run continues was cut when it began, whatever the world size now:
    ``units`` draw units of ``unit`` samples each (the first run's ranks, or its groups with
    ``sampler.draw=group``, and their share) per micro-step, ``accum`` micro-steps per optimizer
    step. Optimizer step k's samples are the units of canonical micro-steps k*accum ...
    k*accum + accum - 1, laid out unit after unit: a list of ``global_batch`` ids that no later
    world size changes (Mosaic streaming's canonical nodes). A run on another number of ranks
    cuts its micro-steps out of that list (``IndexSampler.holder_ids``)."""

    unit: int
    units: int
    accum: int

    @property
    def global_batch(self) -> int:
        return self.unit * self.units * self.accum



class IndexSampler:
    """Global ids of the samples rank ``rank`` trains on at step t; see the module doc.

    ``strata=None`` is ``random`` (one stratum of everything). ``draw`` is "rank" (each rank
    takes the strata counts of ``local_batch``) or "group" (the group takes the counts of
    ``group * local_batch``, which rounds finer). ``group=0`` means all ranks.
    """

    def __init__(self, lengths: np.ndarray, strata: Strata | None, *, rank: int, world_size: int,
                 local_batch: int, seed: int, group: int = 1, draw: str = "rank",
                 deal_policy: str = "none", counts: Sequence[int] = (), rounding: str = "fixed",
                 hidden: int = 1024, accum: int = 1, canon: Canon | None = None):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        group = min(group or world_size, world_size)  # a job smaller than a node: one group
        if deal_policy != "none" and world_size % group:
            raise ValueError(f"sampler.group_size={group} does not divide world size {world_size}")
        if deal_policy not in DEALS:
            raise ValueError(f"sampler.deal={deal_policy!r} is not one of {list(DEALS)}")
        if draw not in ("rank", "group"):
            raise ValueError(f"sampler.draw={draw!r} is not 'rank' or 'group'")
        self.lengths = np.asarray(lengths)
        self.rank, self.world_size, self.local_batch, self.seed = rank, world_size, local_batch, seed
        self.group, self.draw, self.deal_policy, self.hidden = group, draw, deal_policy, hidden
        if draw == "group" and deal_policy == "none":
            raise ValueError("sampler.draw=group needs a deal to split the group's samples")
        # The holders of this run: ranks, or groups with draw=group; each takes ``share``
        # samples a micro-step. The stream is cut in the canonical units (``Canon``): this
        # run's own holders, unless it continues a stream begun on another world size.
        self.share = local_batch * (group if draw == "group" else 1)
        self.holders = world_size // (group if draw == "group" else 1)
        self.accum = accum
        self.canon = canon or Canon(self.share, self.holders, accum)
        if self.canon.global_batch != self.share * self.holders * accum:
            raise ValueError(f"the stream's global batch {self.canon.global_batch} is not this run's "
                             f"{self.share * self.holders * accum}")
        unit = self.canon.unit
        if strata is None:
            self.members = [np.arange(len(self.lengths), dtype=np.int32)]
            self.schedule = CountSchedule([1.0], unit)
        else:
            k = strata.of(self.lengths)
            if (k < 0).any():
                bad = int(self.lengths[np.argmax(k < 0)])
                raise DataError(f"a sample of length {bad} lies outside every stratum {strata.bounds}")
            # ids as int32 (4 bytes per sample; a dataset is far below 2^31 samples)
            self.members = [np.flatnonzero(k == j).astype(np.int32) for j in range(len(strata.bounds))]
            self.schedule = strata.schedule(unit, rounding, counts)
        self.counts = self.schedule.fixed  # per unit per step under rounding=fixed
        for j, (m, c) in enumerate(zip(self.members, self.counts)):
            if rounding == "fixed" and c and not len(m):
                raise DataError(f"stratum {j} is empty but the batch takes {c} samples from it")
            if rounding == "fixed" and len(m) and not c:
                raise DataError(f"stratum {j} holds {len(m)} samples but rounds to 0 per draw: they "
                                "would never be drawn; use sampler.rounding=carry or wider strata")
        self._stratum = np.zeros(len(self.lengths), dtype=np.int16)
        for j, m in enumerate(self.members):
            self._stratum[m] = j
        self.units = self.canon.units
        self._perm_cache: dict[tuple[int, int], np.ndarray] = {}

    def members_of(self, ids: np.ndarray) -> np.ndarray:
        """Stratum index of each id."""
        return self._stratum[ids]

    def _epoch_perm(self, k: int, epoch: int) -> np.ndarray:
        # One permutation per stratum epoch, kept until the next one is needed: costs
        # 4 bytes per sample of the stratum (two epochs at a boundary) and one shuffle.
        key = (k, epoch)
        if key not in self._perm_cache:
            for old in [x for x in self._perm_cache if x[0] == k and x[1] < epoch - 1]:
                del self._perm_cache[old]
            rng = np.random.default_rng([self.seed, k, epoch])
            self._perm_cache[key] = self.members[k][rng.permutation(len(self.members[k]))]
        return self._perm_cache[key]

    def _take(self, k: int, start: int, n: int) -> np.ndarray:
        size = len(self.members[k])
        pos = np.arange(start, start + n)
        out = np.empty(n, dtype=np.int64)
        for e in np.unique(pos // size):
            sel = pos // size == e
            out[sel] = self._epoch_perm(k, int(e))[pos[sel] % size]
        return out

    def unit_ids(self, step: int, unit: int) -> np.ndarray:
        """What canonical draw unit ``unit`` takes at canonical micro-step ``step``, stratum by stratum."""
        taken, counts = self.schedule.taken(step), self.schedule.counts(step)
        parts = [self._take(k, int(taken[k]) * self.units + unit * int(c), int(c))
                 for k, c in enumerate(counts) if c]
        return np.concatenate(parts)

    def _step_units(self, k: int, first: int, count: int) -> np.ndarray:
        """Units ``first`` .. ``first + count - 1`` of optimizer step ``k``'s list (``Canon``)."""
        c = self.canon
        return np.concatenate([self.unit_ids(k * c.accum + q // c.units, q % c.units)
                               for q in range(first, first + count)])

    def holder_ids(self, step: int, holder: int) -> np.ndarray:
        """What holder ``holder`` (a rank, or a group with draw=group) of this run takes at its
        micro-step ``step``: its cut of the optimizer step's canonical list. Whole units where
        this run's micro-step is whole units that split evenly over its holders (each holder
        then has the exact strata counts of the units it takes; a run on the stream's own
        world size takes unit ``holder`` of canonical micro-step ``step``, as ever); otherwise
        the micro-step's samples ordered by stratum and dealt round-robin, so each holder's
        count of every stratum is within one of its share."""
        c, m = self.canon, self.share * self.holders
        k, j = divmod(step, self.accum)
        start = j * m  # where this micro-step begins in step k's list
        if start % c.unit == 0 and m % c.unit == 0 and (m // c.unit) % self.holders == 0:
            n = m // c.unit // self.holders
            return self._step_units(k, start // c.unit + holder * n, n)
        first, last = start // c.unit, (start + m - 1) // c.unit
        ids = self._step_units(k, first, last - first + 1)[start - first * c.unit:][:m]
        return ids[np.argsort(self._stratum[ids], kind="stable")][holder::self.holders]

    def group_ids(self, step: int) -> np.ndarray:
        """The undealt samples of this rank's group (rank-major when drawn per rank)."""
        g = self.rank // self.group
        if self.draw == "group":
            return self.holder_ids(step, g)
        return np.concatenate([self.holder_ids(step, r) for r in range(g * self.group, (g + 1) * self.group)])

    def deal_group(self, ids: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """This rank's share of the group's ``ids`` given their ``lengths``."""
        owner = deal(lengths, self.group, self.deal_policy, self.hidden)
        return ids[owner == self.rank % self.group]

    def ids(self, step: int) -> np.ndarray:
        """This rank's ``local_batch`` ids at ``step``, from the length index (no exchange)."""
        if self.deal_policy == "none":
            return self.holder_ids(step, self.rank)
        ids = self.group_ids(step)
        return self.deal_group(ids, self.lengths[ids])


def build_sampler(cfg: SamplerConfig, index: LengthIndex, *, rank: int, world_size: int, local_batch: int,
                  seed: int, max_seq_length: int, hidden: int, accum: int = 1,
                  canon: Canon | None = None) -> IndexSampler:
    """``cfg`` is a ``SamplerConfig``; strata from ``cfg.strata_width`` or the manifest;
    ``canon``: the cut of the stream this run continues (None: its own)."""
    strata = None
    if cfg.mode == "stratified":
        bounds = even_bounds(max_seq_length, cfg.strata_width) if cfg.strata_width else list(index.bounds)
        if not bounds:
            raise DataError("sampler.mode=stratified needs a strata manifest or sampler.strata_width > 0")
        strata = Strata.from_lengths(index.lengths, bounds)
    return IndexSampler(index.lengths, strata, rank=rank, world_size=world_size, local_batch=local_batch, seed=seed,
                        group=cfg.group_size, draw=cfg.draw, deal_policy=cfg.deal,
                        counts=cfg.counts, rounding=cfg.rounding, hidden=hidden, accum=accum, canon=canon)


# ---------------------------------------------------------------- what a rank draws, by global id

# Where a rank's stream is: (epoch, samples of the epoch taken) for the shard order, or (PLAN,
# samples of its plan taken) while it finishes the epochs a run of another world size began;
# (micro-step, samples of it taken) for the id-based policies. What a checkpoint saves, with
# what ``Policy.state`` adds.
Position = tuple[int, int]
PLAN = -1

@dataclass
class Draw:
    """The samples a rank takes next, in training order, by global id: sample i is row
    ``row[i]`` of shard ``shard[i]`` (its index in the listing of the training directory, or
    of the strata manifest). ``at`` is the position of its first sample, ``end`` the position
    after its last. ``lengths``: what the length index says each holds (None: no index),
    checked as the rows are read; ``known``: samples already read, by their place in the
    draw (the gather deal reads a rank's own draw to learn its lengths)."""

    shard: np.ndarray  # int64 [n]
    row: np.ndarray  # int64 [n]
    at: Position
    end: Position
    lengths: np.ndarray | None = None
    known: dict[int, Sample] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.row)

    def after(self, i: int) -> Position:
        """The position after sample ``i``: where a resume continues."""
        return self.end if i + 1 == len(self) else (self.at[0], self.at[1] + i + 1)


class Source(Protocol):
    """What a policy may ask of the data while it draws (the loader's, under the guards)."""

    def size(self, shard: int) -> int:
        """Samples in ``shard`` (its metadata only)."""
        ...

    def samples(self, draw: Draw) -> list[Sample]:
        """The samples of ``draw``, read and checked."""
        ...


class Policy(Protocol):
    """Which samples one rank trains on, in which order: endless draws from a position on,
    each a pure function of the seed, the rank and the position (so a resume continues
    exactly). ``main_thread``: its draws hold a collective, so they are made in the main
    thread, in step order, and not read ahead. ``name``: what a checkpoint records.

    ``state(position)``: what a resume needs besides the position (JSON values). ``resume``:
    continue the stream whose ranks had ``states`` (each ``state`` plus its "position") in a
    run of ``world_size`` ranks, on this run's rank and world size: the policy set up, this
    rank's position returned; on the same world size each rank continues its own position,
    bit for bit. ``seek``: the position ``samples`` samples of this rank's stream after
    ``position`` (no data read; shard sizes from their metadata)."""

    name: str
    main_thread: bool

    def draws(self, position: Position, source: Source) -> Iterator[Draw]: ...

    def state(self, position: Position, source: Source) -> dict[str, Any]: ...

    def resume(self, states: Sequence[dict[str, Any]], world_size: int, source: Source) -> Position: ...

    def seek(self, position: Position, samples: int, source: Source) -> Position: ...


# (epoch, shard, start, step): rows ``start``, ``start + step``, ... of the shard's permutation in
# that epoch. A rank's share of an epoch is a list of them; so is what it has left.
Segment = tuple[int, int, int, int]


class ShardOrder:
    """The closed division's random order, deterministic from ``seed``.

    Epoch e shuffles the shard list with ``seed + e``. With at least as many shards as
    ranks, the shuffled list is dealt round-robin (rank r reads shards r, r+W, ...), so each
    sample is read by exactly one rank per epoch; with fewer shards every rank reads every
    shard and keeps samples r, r+W, ... of its permutation. Inside a shard the samples are
    permuted with (seed, epoch, shard index in the sorted list). A draw is one shard's
    samples (the loader reads it whole); the positions are (epoch, samples of it taken), so
    a resume skips whole shards from their metadata alone (one open each, no data read).

    On another world size (``resume``) the ranks finish the epochs the earlier run had begun
    before any new one: what each earlier rank had left of them (its shards, the rest of the
    one it was in: its ``state``, from the sizes of the shards it had drawn) is pooled in
    epoch order and dealt round-robin to the new ranks as their ``plan``, and epoch
    ``plan_end`` (the first no earlier rank had begun) is dealt the usual way: no shard is
    sized for it. Every sample is still taken once an epoch; which step takes it is the new world
    size's (the order is per rank by construction)."""

    name, main_thread = "shard_order", False

    def __init__(self, num_shards: int, rank: int, world_size: int, seed: int):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        self.num_shards, self.rank, self.world_size, self.seed = num_shards, rank, world_size, seed
        self.dealt = num_shards >= world_size
        self.plan: list[Segment] = []  # this rank's share of epochs an earlier world size began
        self.plan_end = 0  # the epoch after them

    def order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng(self.seed + epoch).permutation(self.num_shards)

    def shards(self, epoch: int) -> list[int]:
        order = self.order(epoch)
        return order[self.rank::self.world_size].tolist() if self.dealt else order.tolist()

    def select(self, epoch: int, shard: int, num_samples: int) -> np.ndarray:
        perm = np.random.default_rng([self.seed, epoch, shard]).permutation(num_samples)
        return perm if self.dealt else perm[self.rank::self.world_size]

    def share(self, epoch: int) -> list[Segment]:
        """This rank's share of ``epoch``, in its order."""
        return [(epoch, s, 0, 1) if self.dealt else (epoch, s, self.rank, self.world_size) for s in self.shards(epoch)]

    def rows(self, seg: Segment, source: Source) -> np.ndarray:
        epoch, shard, start, step = seg
        return np.random.default_rng([self.seed, epoch, shard]).permutation(source.size(shard))[start::step]

    def draws(self, position: Position, source: Source) -> Iterator[Draw]:
        idle = 0  # shards in a row that gave this rank nothing

        def region(key: int, segments: list[Segment], skip: int, after: Position) -> Iterator[Draw]:
            nonlocal idle
            taken = 0
            for j, seg in enumerate(segments):
                rows = self.rows(seg, source)
                n = len(rows)
                if skip and skip >= n:  # wholly before the position
                    skip, taken = skip - n, taken + n
                    continue
                first, rows = taken + skip, rows[skip:]
                taken, skip = taken + n, 0
                if not len(rows):
                    idle += 1
                    if idle > 2 * self.num_shards:  # else a rank with nothing to read spins forever
                        raise DataError(f"this rank got no samples from {idle} shards in a row: too few samples "
                                        "for the world size")
                    continue
                idle = 0
                end = after if j == len(segments) - 1 else (key, taken)
                yield Draw(np.full(len(rows), seg[1], dtype=np.int64), rows.astype(np.int64), (key, first), end)

        key, skip = position
        if key == PLAN:
            yield from region(PLAN, self.plan, skip, (self.plan_end, 0))
            key, skip = self.plan_end, 0
        while True:
            yield from region(key, self.share(key), skip, (key + 1, 0))
            key, skip = key + 1, 0

    def state(self, position: Position, source: Source) -> dict[str, Any]:
        """``left``: what this rank has left of the epochs it has begun, ``next``: the epoch it
        would begin next (what a run of another world size pools); and its plan while it is in
        one (what a run of this world size continues). Sizes only the shards it has drawn."""
        left, after = self._left(position, source)
        out: dict[str, Any] = {"left": [list(seg) for seg in left], "next": after}
        if position[0] == PLAN:
            out |= {"plan": [list(seg) for seg in self.plan], "plan_end": self.plan_end}
        return out

    def _left(self, position: Position, source: Source) -> tuple[list[Segment], int]:
        key, skip = position
        segments, after = (self.plan, self.plan_end) if key == PLAN else (self.share(key), key + 1)
        left = []
        for j, (epoch, shard, start, step) in enumerate(segments):
            if not skip:  # the rest untouched: no size needed
                left += segments[j:]
                break
            n = len(range(start, source.size(shard), step))
            if skip >= n:
                skip -= n
                continue
            left.append((epoch, shard, start + skip * step, step))
            skip = 0
        return left, after

    def resume(self, states: Sequence[dict[str, Any]], world_size: int, source: Source) -> Position:
        if world_size == self.world_size:
            mine = states[self.rank]
            self.plan = [tuple(int(x) for x in seg) for seg in mine.get("plan", [])]  # type: ignore[misc]
            self.plan_end = int(mine.get("plan_end", 0))
            return int(mine["position"][0]), int(mine["position"][1])
        pool: list[Segment] = []
        begun = []
        for r in range(world_size):  # no shard sized: each earlier rank said what it had left
            pool += [tuple(int(x) for x in seg) for seg in states[r]["left"]]  # type: ignore[misc]
            begun.append((ShardOrder(self.num_shards, r, world_size, self.seed), int(states[r]["next"])))
        end = max(after for _, after in begun)
        for old, after in begun:  # epochs some rank began and this one had not: its whole share
            for epoch in range(after, end):
                pool += old.share(epoch)
        place = {e: np.argsort(self.order(e)) for e in {seg[0] for seg in pool}}  # shard -> its place in the epoch
        pool.sort(key=lambda seg: (seg[0], int(place[seg[0]][seg[1]]), seg[2]))
        self.plan, self.plan_end = pool[self.rank::self.world_size], end
        return (PLAN, 0) if self.plan else (end, 0)

    def seek(self, position: Position, samples: int, source: Source) -> Position:
        for d in self.draws(position, source):
            if samples < len(d):
                return (d.at[0], d.at[1] + samples) if samples else d.at
            samples -= len(d)
        raise AssertionError("draws are endless")


class IdOrder:
    """An ``IndexSampler``'s draws (stratified or random, any deal from the length index): one
    draw per micro-step, located in the index's shards (``name`` "ids"). ``rebuild(canon)``:
    the sampler again, cutting the stream as ``canon`` says (a resume of a stream begun on
    another world size or batch split)."""

    name, main_thread = "ids", False

    def __init__(self, sampler: IndexSampler, index: LengthIndex,
                 rebuild: Callable[[Canon], IndexSampler] | None = None):
        self.sampler, self.index, self.rebuild = sampler, index, rebuild

    def _draw(self, step: int, ids: np.ndarray, known: dict[int, Sample] | None = None) -> Draw:
        shard, row = self.index.locate(ids)
        return Draw(shard.astype(np.int64), row.astype(np.int64), (step, 0), (step + 1, 0),
                    self.index.lengths[ids], known or {})

    def draws(self, position: Position, source: Source) -> Iterator[Draw]:
        step, skip = position
        while True:
            d = self._draw(step, self.sampler.ids(step))
            if skip:  # a position inside a step: only from a batch cut across steps
                d = Draw(d.shard[skip:], d.row[skip:], (step, skip), d.end, d.lengths[skip:])
            yield d
            step, skip = step + 1, 0

    @property
    def micro_batch(self) -> int:
        """Samples all ranks take in one micro-step."""
        return self.sampler.share * self.sampler.holders

    def state(self, position: Position, source: Source) -> dict[str, Any]:
        c = self.sampler.canon
        # The global count (Megatron's consumed samples): a position on any world size.
        return {"canon": [c.unit, c.units, c.accum], "micro_batch": self.micro_batch,
                "consumed": position[0] * self.micro_batch}

    def resume(self, states: Sequence[dict[str, Any]], world_size: int, source: Source) -> Position:
        first = states[0]
        if "canon" in first:
            canon = Canon(*(int(x) for x in first["canon"]))
            if canon != self.sampler.canon:
                if self.rebuild is None:
                    raise ValueError("this policy cannot cut the stream another way")
                self.sampler = self.rebuild(canon)
        if world_size == self.sampler.world_size and first.get("micro_batch", self.micro_batch) == self.micro_batch:
            step, skip = states[self.sampler.rank]["position"]
            return int(step), int(skip)
        consumed, m = int(first["consumed"]), self.micro_batch
        if any(int(st["position"][1]) for st in states) or consumed % m:
            raise DataError(f"the stream stopped inside a micro-step ({consumed} samples consumed), which a run of "
                            f"{m} samples a micro-step cannot continue")
        return consumed // m, 0

    def seek(self, position: Position, samples: int, source: Source) -> Position:
        step, skip = position
        more, skip = divmod(skip + samples, self.sampler.local_batch)
        return step + more, skip


class GatherDeal(IdOrder):
    """The deal with the group's lengths learnt by exchange (``sampler.lengths=gather``):
    each rank reads its own draw, all_gathers the lengths within its group (one small
    collective per step: a sync point), so the same deal is computed without trusting the
    index's lengths; the rows it read are not read again."""

    name, main_thread = "ids", True

    def __init__(self, sampler: IndexSampler, index: LengthIndex,
                 rebuild: Callable[[Canon], IndexSampler] | None = None):
        import torch.distributed as dist  # only this policy exchanges anything

        super().__init__(sampler, index, rebuild)
        if sampler.draw != "rank":
            raise ConfigError("sampler.lengths=gather needs sampler.draw=rank (each rank draws its own)")
        self.dist = dist
        g, size = sampler.rank // sampler.group, sampler.group
        self.pg = None
        if size == 1:  # one rank (a single-process run): nothing to exchange
            return
        for j in range(sampler.world_size // size):  # every rank must create every group
            # gloo groups: the lengths are host tensors, whatever the main backend (NCCL).
            pg = dist.new_group(list(range(j * size, (j + 1) * size)), backend="gloo")
            if j == g:
                self.pg = pg

    def draws(self, position: Position, source: Source) -> Iterator[Draw]:
        step, s = position[0], self.sampler
        while True:
            own = s.holder_ids(step, s.rank)
            have = dict(zip(own.tolist(), source.samples(self._draw(step, own))))
            mine = torch.tensor([len(have[i].input_ids) for i in own.tolist()], dtype=torch.int64)
            if self.pg is None:
                lengths = mine.numpy()
            else:
                parts = [torch.empty_like(mine) for _ in range(s.group)]
                self.dist.all_gather(parts, mine, group=self.pg)
                lengths = torch.cat(parts).numpy()
            ids = s.deal_group(s.group_ids(step), lengths)
            yield self._draw(step, ids, {j: have[i] for j, i in enumerate(ids.tolist()) if i in have})
            step += 1


def build_policy(cfg: SamplerConfig, index: LengthIndex, *, rank: int, world_size: int, local_batch: int,
                 seed: int, max_seq_length: int, hidden: int, accum: int = 1, canon: Canon | None = None) -> IdOrder:
    """The id-based policy of ``cfg`` over ``index`` (``build_sampler``'s draws), cutting the
    stream as ``canon`` says (None: as this run begins it)."""

    def build(canon: Canon | None) -> IndexSampler:
        return build_sampler(cfg, index, rank=rank, world_size=world_size, local_batch=local_batch, seed=seed,
                             max_seq_length=max_seq_length, hidden=hidden, accum=accum, canon=canon)

    return (GatherDeal if cfg.lengths == "gather" else IdOrder)(build(canon), index, rebuild=build)
