"""stats: length histogram, tokens, padding fraction of a dataset; JSON plus a PNG plot.

Reads every shard under the directory (recursively: a stratified directory works too), checked
against the directory's md5 list and read through the run's reader (inputs.py), before it
writes anything.
The padding fraction is the share of padding when every sample is padded to
``max_seq_length``: the work the unpadded model path saves. The [UNK] rate is the share of
[UNK] among the samples' tokens, masked positions counted as their labels.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from bert.config import PREP_READ_TIMEOUT_S
from bert.shards import Bounds

from .checksum import find_shards
from .common import atomic_write, write_json
from .copies import restored_tokens
from .inputs import open_inputs

MLPERF_UNK_ID = 100  # [UNK] in the MLPerf uncased vocab


def dataset_stats(directory: str | Path, max_seq_length: int = 512, unk_id: int = MLPERF_UNK_ID, *,
                  vocab_size: int | None = None,
                  read_timeout_s: float = PREP_READ_TIMEOUT_S) -> tuple[dict, np.ndarray]:
    """(summary, histogram) where histogram[L] = samples of real length L; ``vocab_size`` (the
    vocab's, where known): every id checked against it."""
    hist = np.zeros(max_seq_length + 1, dtype=np.int64)
    preds = nsp_random = unk = 0
    d = Path(directory)
    paths = find_shards(d)
    inputs = open_inputs(d, paths, every_listed=True, max_seq_length=max_seq_length,
                         bounds=Bounds(vocab_size, vocab_key="the vocab size (--vocab)") if vocab_size else None,
                         timeout_s=read_timeout_s, fingerprint=False)
    for p in paths:
        s = inputs.read(p)
        hist += np.bincount(s.lengths, minlength=max_seq_length + 1)
        preds += len(s.mlm_ids)
        nsp_random += int(s.nsp.sum())
        unk += int((restored_tokens(s.tokens, s.offsets, s.mlm_positions, s.mlm_ids, s.mlm_offsets) == unk_id).sum())
    n = int(hist.sum())
    lengths = np.arange(max_seq_length + 1)
    tokens = int((hist * lengths).sum())
    cdf = np.cumsum(hist)
    summary = {
        "directory": str(d), "samples": n, "tokens": tokens, "max_seq_length": max_seq_length,
        "mean_length": round(tokens / n, 2), "median_length": int(np.searchsorted(cdf, (n + 1) // 2)),
        "min_length": int(np.nonzero(hist)[0][0]), "max_length": int(np.nonzero(hist)[0][-1]),
        "fraction_at_max_length": round(int(hist[max_seq_length]) / n, 4),
        "padding_fraction": round(1 - tokens / (n * max_seq_length), 4),
        "predictions_per_sample": round(preds / n, 2), "nsp_random_fraction": round(nsp_random / n, 4),
        "unk_rate": round(unk / tokens, 6), "unk_id": unk_id, "inputs_verified_against": inputs.verified_by(),
    }
    return summary, hist


def _plot(path: Path, hist: np.ndarray, summary: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar(np.arange(len(hist)), hist, width=1.0, color="#3b6ea5")
    ax.set_xlabel("real sequence length (tokens)")
    ax.set_ylabel("samples")
    ax.set_title(f"{summary['samples']:,} samples, mean {summary['mean_length']}, "
                 f"padding {summary['padding_fraction']:.1%} at {summary['max_seq_length']}")
    fig.tight_layout()
    atomic_write(path, lambda t: fig.savefig(t, format="png", dpi=100))
    plt.close(fig)


def stats(directory: str | Path, output_dir: str | Path, max_seq_length: int = 512, unk_id: int = MLPERF_UNK_ID, *,
          vocab_size: int | None = None, read_timeout_s: float = PREP_READ_TIMEOUT_S) -> dict:
    """Write ``stats.json`` (summary + histogram) and ``length_histogram.png`` to ``output_dir``,
    once every shard is read."""
    summary, hist = dataset_stats(directory, max_seq_length, unk_id, vocab_size=vocab_size,
                                  read_timeout_s=read_timeout_s)
    out = Path(output_dir)
    write_json(out / "stats.json", {**summary, "length_histogram": hist.tolist()})
    _plot(out / "length_histogram.png", hist, summary)
    return summary
