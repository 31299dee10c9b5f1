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
holds ``MIN_COPY_TOKENS`` tokens); two different samples share a key about once in 2^63 pairs,
so over 10^8 samples a false repeat has about one chance in two thousand.

Memory: ``KeyTable`` holds one key per training sample, 8 bytes, in shard order, and finds the
repeats one 1/``PARTITIONS`` of the key range at a time (that part's keys, their positions and
their sort order, and the repeats among them), scanning ``_CHUNK`` keys at a time: a little
over 8 bytes a sample (BENCHMARKS.md measures it at MLPerf's size). Counts per pair of shards
are kept for the pairs that share samples, with ``EXAMPLES_PER_PAIR`` sample rows each.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from bert.shards import example_records  # the one record format (check's examples_md5, the run's probe)

MIN_COPY_TOKENS = 32
PARTITIONS = 64
EXAMPLES_PER_PAIR = 3
_CHUNK = 1 << 20  # keys scanned at once while a partition is gathered (8 MiB of temporaries)


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
    """Repeated samples: each occurrence after the first of its key is a repeat of that first."""

    pairs: dict[tuple[int, int], PairCount]  # (shard of the first, shard of the repeat), copies only
    per_shard: np.ndarray  # copies (long repeats) found in each shard
    copies: int  # repeats of examples of at least MIN_COPY_TOKENS tokens
    short: int  # shorter repeats (chance; not a defect)


class KeyTable:
    """One key per sample of every shard, in shard order (8 bytes a sample, allocated once)."""

    def __init__(self, sizes: list[int]):
        self.starts = np.zeros(len(sizes) + 1, np.int64)
        np.cumsum(sizes, out=self.starts[1:])
        self.keys = np.zeros(int(self.starts[-1]), np.uint64)
        self.filled = np.zeros(len(sizes), bool)

    def put(self, shard: int, keys: np.ndarray) -> None:
        """A shard's keys; a shard whose count differs from its listed size is left out."""
        lo, hi = self.starts[shard], self.starts[shard + 1]
        if len(keys) == hi - lo:
            self.keys[lo:hi] = keys
            self.filled[shard] = True

    def repeats(self) -> Repeats:
        num = len(self.filled)
        pairs: dict[tuple[int, int], PairCount] = {}
        per_shard = np.zeros(num, np.int64)
        copies = short = 0
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
            long = is_long(vals[rep])
            short += int((~long).sum())
            a_idx, b_idx = first[rep][long], idx[rep][long]
            copies += len(b_idx)
            a = np.searchsorted(self.starts, a_idx, side="right") - 1
            b = np.searchsorted(self.starts, b_idx, side="right") - 1
            per_shard += np.bincount(b, minlength=num)
            code = a * num + b
            codes, at, counts = np.unique(code, return_index=True, return_counts=True)
            for c, i, k in zip(codes.tolist(), at.tolist(), counts.tolist()):
                pc = pairs.setdefault(divmod(c, num), PairCount())
                pc.samples += k
                if len(pc.rows) < EXAMPLES_PER_PAIR:
                    pc.rows.append((int(a_idx[i] - self.starts[a[i]]), int(b_idx[i] - self.starts[b[i]])))
        return Repeats(pairs, per_shard, copies, short)
