"""copies: the same examples twice in a training set, and eval samples inside it.

What counts as a copy. An *example* is everything a shard stores of one sample: its tokens
(masked positions as masked), segment ids, masked positions, their labels and its next-sentence
label. The reference's dupe factor makes the same sentences ten times with other masks and
other pairings: those are other examples, not copies. Two equal examples are a copy when
they hold at least ``MIN_COPY_TOKENS`` tokens; shorter ones are counted apart
(``short_repeats``) and are not a defect: the reference makes the same short example twice
by chance (a short document, the same split, the same few masked positions drawn again):
0 to 2 in 13,000-73,000 samples of the texts measured (BENCHMARKS.md), while at 32 tokens its
five masked positions, one of 118,755 choices, make a chance repeat rarer than one in a
hundred thousand even for the same text and split.

An eval sample is *in the training set* when a training sample holds exactly its text: its
tokens with every masked position restored from its label, so the same text masked otherwise
still matches; again from ``MIN_COPY_TOKENS`` tokens (shorter matches are counted apart:
a pair of short sentences can occur in two documents, and the demo data's random chains of
its 123 content tokens meet by chance in short samples). Text cut into other samples is not
found: held-out text must be kept apart by document, and this catches where it was not (the
eval shard copied among the training shards, or the held-out text also given to ``create``).

Every sample is reduced to a 64-bit key (blake2b of its record; the lowest bit says whether it
holds ``MIN_COPY_TOKENS`` tokens) to find the candidates, and every candidate is confirmed by
comparing the two records, byte for byte: two different samples that share a key (about once
in 2^63 pairs: over 10^8 samples, about one run in two thousand has such a pair) are never
called a repeat; they are counted apart (``collisions``) and sorted out by their records, so a
real repeat among them is still found. The eval samples found in the training shards are
confirmed the same way, by their text.

Memory: ``KeyTable`` holds one key per training sample, 8 bytes, in shard order, and one bit a
sample (marking the repeats), and finds the repeats one 1/``PARTITIONS`` of the key range at a
time (that part's keys, their positions and their sort order), scanning ``_CHUNK`` keys at a
time; a repeat's slot then holds, in place of its key, the position of the first sample with
that key: a little over 8 bytes a sample whatever the number of repeats (BENCHMARKS.md
measures it). ``check`` puts each shard's keys into it as the shard's scan returns, and holds no
other copy. The confirmation reads again each shard that holds a repeat (and the shards they
repeat, a few held at a time): nothing more on clean data; on a set of copies, one more read of
each. Counts per pair of shards are kept for the pairs that share samples, with
``EXAMPLES_PER_PAIR`` sample rows each.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from bert.shards import example_records  # the one record format (check's examples_md5, the run's probe)

MIN_COPY_TOKENS = 32
PARTITIONS = 64
EXAMPLES_PER_PAIR = 3
_CHUNK = 1 << 20  # keys scanned at once while a partition is gathered (8 MiB of temporaries)
_HELD = 4  # shards' records held at once while repeats are confirmed
_COMPARED = 1 << 22  # record elements compared at once (int32; ~100 MiB of temporaries)

Records = Callable[[int], "tuple[np.ndarray, np.ndarray]"]  # shard -> its example_records (records, starts)


def restored_tokens(tokens: np.ndarray, offsets: np.ndarray, positions: np.ndarray, labels: np.ndarray,
                    poffsets: np.ndarray) -> np.ndarray:
    """The samples' tokens with each masked position holding its label: the text before
    masking. Positions outside their sample (a defect ``check`` counts) are left out."""
    n = len(offsets) - 1
    prow = np.repeat(np.arange(n), np.diff(poffsets))
    inside = (positions >= 0) & (positions < np.diff(offsets)[prow])
    out = np.array(tokens, copy=True)
    out[offsets[:-1][prow[inside]] + positions[inside]] = labels[inside]
    return out


def _keys(data: np.ndarray, bounds: np.ndarray, long: np.ndarray) -> np.ndarray:
    """blake2b (8 bytes) of each slice ``data[bounds[i]:bounds[i+1]]`` of an int32 array, as
    uint64 with the lowest bit set where ``long``."""
    raw = memoryview(np.ascontiguousarray(data, "<i4")).cast("B")
    b = (np.asarray(bounds, np.int64) * 4).tolist()
    blake = hashlib.blake2b
    keys = np.fromiter((int.from_bytes(blake(raw[b[i]:b[i + 1]], digest_size=8).digest(), "little")
                        for i in range(len(b) - 1)), np.uint64, len(b) - 1)
    return (keys & ~np.uint64(1)) | np.asarray(long, np.uint64)


def example_keys(records: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """One key per example, from ``example_records``."""
    return _keys(records, starts, lengths >= MIN_COPY_TOKENS)


def text_keys(restored: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """One key per sample, from its restored tokens alone (``restored_tokens``)."""
    return _keys(restored, offsets, np.diff(offsets) >= MIN_COPY_TOKENS)


def is_long(keys: np.ndarray) -> np.ndarray:
    return (keys & np.uint64(1)).astype(bool)


def same_digest_groups(digests: Mapping[str, str]) -> list[list[str]]:
    """Names that share a digest, each group in the mapping's order, groups by their first
    member: [[first, copy, ...], ...]."""
    by: dict[str, list[str]] = {}
    for name, d in digests.items():
        by.setdefault(d, []).append(name)
    return [g for g in by.values() if len(g) > 1]


@dataclass
class PairCount:
    samples: int = 0
    rows: list[tuple[int, int]] = field(default_factory=list)  # (row in the first shard, row in the second)


@dataclass
class Repeats:
    """Repeated samples: each sample whose record an earlier sample has is a repeat of the first."""

    pairs: dict[tuple[int, int], PairCount]  # (shard of the first, shard of the repeat), copies only
    per_shard: np.ndarray  # copies (long repeats) found in each shard
    copies: int  # repeats of examples of at least MIN_COPY_TOKENS tokens
    short: int  # shorter repeats (chance; not a defect)
    collisions: int = 0  # samples that shared a key with an earlier sample and not its record: not repeats


class KeyTable:
    """One key per sample of every shard, in shard order, and a bit a sample marking repeats
    (a little over 8 bytes a sample, allocated once)."""

    def __init__(self, sizes: list[int]):
        self.starts = np.zeros(len(sizes) + 1, np.int64)
        np.cumsum(sizes, out=self.starts[1:])
        self.keys = np.zeros(int(self.starts[-1]), np.uint64)
        self.marks = np.zeros((len(self.keys) + 7) // 8, np.uint8)  # bit i: sample i repeats an earlier key
        self.filled = np.zeros(len(sizes), bool)

    def put(self, shard: int, keys: np.ndarray) -> None:
        """A shard's keys; a shard whose count differs from its listed size is left out."""
        lo, hi = self.starts[shard], self.starts[shard + 1]
        if len(keys) == hi - lo:
            self.keys[lo:hi] = keys
            self.filled[shard] = True

    def repeats(self, records_of: Records) -> Repeats:
        """The repeats, each confirmed by the records ``records_of(shard)`` gives (the shards'
        ``example_records``: only the shards that hold a repeat or its first are asked for).
        Consumes the table: the keys of the repeats are overwritten."""
        self._search()
        return self._confirm(records_of)

    def _search(self) -> None:
        """Mark every sample whose key an earlier sample has, and write in its slot, in place of
        its key, the index of the first sample with that key (shifted left one bit, its
        length's bit kept). Partitions are searched in order of the key's top bits; a rewritten
        slot (an index < 2^57) falls in partition 0, searched first, so no later search sees it."""
        shift = np.uint64(64 - int(np.log2(PARTITIONS)))
        for part in range(PARTITIONS):
            idx = np.concatenate([np.flatnonzero((self.keys[c:c + _CHUNK] >> shift) == part) + c
                                  for c in range(0, len(self.keys), _CHUNK)] or [np.zeros(0, np.int64)])
            if not self.filled.all():  # unreadable shards hold no keys
                idx = idx[self.filled[np.searchsorted(self.starts, idx, side="right") - 1]]
            if len(idx) < 2:
                continue
            vals = self.keys[idx]
            order = np.argsort(vals, kind="stable")  # equal keys stay in shard order: the first is the original
            idx, vals = idx[order], vals[order]
            del order
            new = np.ones(len(vals), bool)
            new[1:] = vals[1:] != vals[:-1]
            if new.all():
                continue
            first = idx[np.flatnonzero(new)][np.cumsum(new) - 1]  # the first occurrence of each element's key
            rep = ~new
            self.keys[idx[rep]] = (first[rep].astype(np.uint64) << np.uint64(1)) | (vals[rep] & np.uint64(1))
            np.bitwise_or.at(self.marks, idx[rep] >> 3, (1 << (idx[rep] & 7)).astype(np.uint8))

    def _marked(self, shard: int) -> np.ndarray:
        """The global indices of ``shard``'s marked samples."""
        lo, hi = int(self.starts[shard]), int(self.starts[shard + 1])
        bits = np.unpackbits(self.marks[lo // 8:(hi + 7) // 8], bitorder="little")[lo % 8:lo % 8 + hi - lo]
        return lo + np.flatnonzero(bits)

    def _confirm(self, records_of: Records) -> Repeats:
        """Each marked sample against the first of its key, one shard of repeats at a time (the
        shards of their firsts held a few at a time), counted as it is confirmed."""
        held: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()

        def records(shard: int) -> tuple[np.ndarray, np.ndarray]:
            if shard not in held:
                held[shard] = records_of(shard)
                if len(held) > _HELD:
                    held.popitem(last=False)
            held.move_to_end(shard)
            return held[shard]

        rep = Repeats({}, np.zeros(len(self.filled), np.int64), 0, 0)
        aside: dict[int, list[int]] = {}  # first -> samples that share its key, not its record
        for b in range(len(self.filled)):
            b_idx = self._marked(b)
            if not len(b_idx):
                continue
            vals = self.keys[b_idx]
            a_idx, long = (vals >> np.uint64(1)).astype(np.int64), (vals & np.uint64(1)).astype(bool)
            a_shard = np.searchsorted(self.starts, a_idx, side="right") - 1
            same = np.zeros(len(b_idx), bool)
            for k in _groups(a_shard):  # the firsts in one shard at a time
                a = int(a_shard[k[0]])
                same[k] = _same_records(records(a), a_idx[k] - self.starts[a], records(b), b_idx[k] - self.starts[b])
            self._add(rep, a_idx[same], b_idx[same], long[same])
            for a, r in zip(a_idx[~same].tolist(), b_idx[~same].tolist()):
                aside.setdefault(a, []).append(r)
        rep.collisions = sum(len(v) for v in aside.values())
        self._sort_out(rep, aside, records)
        return rep

    def _sort_out(self, rep: Repeats, aside: dict[int, list[int]],
                  records: Callable[[int], tuple[np.ndarray, np.ndarray]]) -> None:
        """The samples that shared a key with a first but not its record (none, but for a
        collision of the keys): among themselves, each whose record an earlier one of them has
        is a repeat of that one. One record at a time (there are so few)."""
        for samples in aside.values():
            seen: dict[bytes, int] = {}
            for i in samples:  # in shard order
                shard = int(np.searchsorted(self.starts, i, side="right") - 1)
                recs, starts = records(shard)
                row = i - int(self.starts[shard])
                body = recs[starts[row]:starts[row + 1]].tobytes()
                if body in seen:
                    self._add(rep, np.array([seen[body]]), np.array([i]), np.array([bool(self.keys[i] & np.uint64(1))]))
                else:
                    seen[body] = i

    def _add(self, rep: Repeats, a_idx: np.ndarray, b_idx: np.ndarray, long: np.ndarray) -> None:
        """Count confirmed repeats ``b_idx`` of ``a_idx`` (global indices): the short ones apart,
        the copies per pair of shards with a few rows each."""
        num = len(self.filled)
        rep.short += int((~long).sum())
        a_idx, b_idx = a_idx[long], b_idx[long]
        rep.copies += len(b_idx)
        a = np.searchsorted(self.starts, a_idx, side="right") - 1
        b = np.searchsorted(self.starts, b_idx, side="right") - 1
        rep.per_shard += np.bincount(b, minlength=num)
        for k in _groups(a * num + b):  # one pair of shards at a time
            sa, sb = int(a[k[0]]), int(b[k[0]])
            pc = rep.pairs.setdefault((sa, sb), PairCount())
            pc.samples += len(k)
            pc.rows += [(int(a_idx[i] - self.starts[sa]), int(b_idx[i] - self.starts[sb]))
                        for i in k[:EXAMPLES_PER_PAIR - len(pc.rows)].tolist()]


def _groups(values: np.ndarray) -> list[np.ndarray]:
    """The positions of each distinct value of ``values``, in order, groups by value."""
    order = np.argsort(values, kind="stable")
    cut = np.flatnonzero(np.diff(values[order])) + 1
    return np.split(order, cut) if len(order) else []


def _same_records(a: tuple[np.ndarray, np.ndarray], a_rows: np.ndarray, b: tuple[np.ndarray, np.ndarray],
                  b_rows: np.ndarray) -> np.ndarray:
    """Whether record ``a_rows[i]`` of ``a`` equals record ``b_rows[i]`` of ``b`` (both
    ``example_records``' (records, starts)), element for element; ``_COMPARED`` elements at a time."""
    (ra, sa), (rb, sb) = a, b
    length = sa[a_rows + 1] - sa[a_rows]
    same = length == sb[b_rows + 1] - sb[b_rows]
    todo = np.flatnonzero(same)
    ends = np.cumsum(length[todo])
    lo = 0
    while lo < len(todo):  # a run of pairs whose records hold at most _COMPARED elements (one pair at least)
        hi = max(lo + 1, int(np.searchsorted(ends, (ends[lo - 1] if lo else 0) + _COMPARED, side="right")))
        k = todo[lo:hi]
        n = length[k]
        pos = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
        differ = ra[np.repeat(sa[a_rows[k]], n) + pos] != rb[np.repeat(sb[b_rows[k]], n) + pos]
        same[k] = np.bincount(np.repeat(np.arange(len(k)), n), weights=differ, minlength=len(k)) == 0
        lo = hi
    return same
