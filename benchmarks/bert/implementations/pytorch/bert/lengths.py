"""The shipped length histogram of real Wikipedia samples at sequence length 512
(``data/wikipedia_seqlen_histogram_512.txt``): what the static token budgets' ladder
(bert/budget.py), the demo data and the benchmarks draw lengths from. No torch."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .shards import DataError

HISTOGRAM = Path(__file__).resolve().parent.parent / "data" / "wikipedia_seqlen_histogram_512.txt"


def length_distribution(seq_len: int, path: Path = HISTOGRAM) -> tuple[np.ndarray, np.ndarray]:
    """(lengths, probabilities) of real sample lengths, Wikipedia's 512 histogram scaled to
    ``seq_len`` (lengths clipped to [5, seq_len])."""
    try:
        table = np.loadtxt(path, comments="#", dtype=np.int64).reshape(-1, 2)
    except OSError as e:
        raise DataError(f"{path}: cannot read the length histogram: {e.strerror}") from None
    scaled = np.clip(np.round(table[:, 0] * seq_len / 512.0).astype(np.int64), 5, seq_len)
    counts = np.bincount(scaled, weights=table[:, 1].astype(np.float64), minlength=seq_len + 1)
    lengths = np.nonzero(counts)[0]
    return lengths, counts[lengths] / counts.sum()
