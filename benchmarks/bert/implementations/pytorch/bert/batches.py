"""Batch assembly: a list of samples (bert/shards.py) -> the model's keyword arguments
plus its labels, as torch tensors, in the layout the model was built for.

``collate`` decides the batch layout:

* padded (``unpad=False``): [B, max_seq_length] tensors plus ``attention_mask``, labels
  [B, S] with -100 everywhere but the masked positions (Hugging Face's convention);
* unpadded (``unpad=True``): the batch's real tokens packed into [T] with ``cu_seqlens``,
  ``position_ids`` and ``masked_index`` (where each prediction sits in the packed tokens);

``collate_packed`` puts up to 3 sequences per ``max_seq_length`` row (``pack_ffd``) for
padded kernels; static token budgets pad the unpadded layout to a few fixed sizes
(bert/budget.py). ``to_device``, ``pinned`` and ``split_labels`` are what the loop does
with a batch. ``synthetic_batches`` are batches of random samples of given token counts: what
the warm-up before run_start compiles and captures (bert/step_graph.py), no data read.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
import torch

from .model import IGNORE_INDEX
from .shards import Sample, row_offsets

LABEL_KEYS = ("mlm_labels", "nsp_labels")  # what collate adds to the model's keyword arguments


def collate(samples: Sequence[Sample], unpad: bool, max_seq_length: int) -> dict[str, Any]:
    """Stack samples into the model's keyword arguments plus ``mlm_labels``/``nsp_labels``.

    Padded: ``input_ids``, ``token_type_ids``, ``attention_mask``, ``mlm_labels`` [B, S]
    (S = ``max_seq_length``), ``nsp_labels`` [B]. Unpadded: ``input_ids``,
    ``token_type_ids``, ``position_ids`` [T]; ``cu_seqlens`` int32 [B+1]; ``max_seqlen``
    (int, this batch's longest sample); ``masked_index`` [M] into the T packed tokens;
    ``mlm_labels`` [M]; ``nsp_labels`` [B]. All integer tensors are int64 except
    ``cu_seqlens``. CPU tensors; moving (and pinning) is the caller's choice.
    """
    b = len(samples)
    if b == 0:
        raise ValueError("collate: empty batch")
    lengths = np.fromiter((len(s.input_ids) for s in samples), dtype=np.int64, count=b)
    if lengths.max() > max_seq_length:
        i = int(np.argmax(lengths))
        raise ValueError(f"collate: sample {i} of the batch has {int(lengths[i])} tokens > "
                         f"max_seq_length {max_seq_length}")
    n_pred = np.fromiter((len(s.masked_positions) for s in samples), dtype=np.int64, count=b)
    tokens = np.concatenate([s.input_ids for s in samples]).astype(np.int64)
    segments = np.concatenate([s.segment_ids for s in samples]).astype(np.int64)
    positions = np.concatenate([s.masked_positions for s in samples]).astype(np.int64)
    labels = np.concatenate([s.masked_ids for s in samples]).astype(np.int64)
    nsp = torch.tensor([s.nsp_label for s in samples], dtype=torch.int64)
    row_of_pred = np.repeat(np.arange(b), n_pred)

    if unpad:
        cu = row_offsets(lengths)
        starts = cu[:-1]
        return {
            "input_ids": torch.from_numpy(tokens),
            "token_type_ids": torch.from_numpy(segments),
            "position_ids": torch.from_numpy(np.arange(cu[-1]) - np.repeat(starts, lengths)),
            "cu_seqlens": torch.from_numpy(cu.astype(np.int32)),
            "max_seqlen": int(lengths.max()),
            "masked_index": torch.from_numpy(positions + starts[row_of_pred]),
            "mlm_labels": torch.from_numpy(labels),
            "nsp_labels": nsp,
        }
    mask = np.arange(max_seq_length)[None, :] < lengths[:, None]
    input_ids = np.zeros((b, max_seq_length), dtype=np.int64)
    input_ids[mask] = tokens  # row-major boolean assignment fills each row's prefix in order
    token_type_ids = np.zeros((b, max_seq_length), dtype=np.int64)
    token_type_ids[mask] = segments
    mlm_labels = np.full((b, max_seq_length), IGNORE_INDEX, dtype=np.int64)
    mlm_labels[row_of_pred, positions] = labels
    return {
        "input_ids": torch.from_numpy(input_ids),
        "token_type_ids": torch.from_numpy(token_type_ids),
        "attention_mask": torch.from_numpy(mask.astype(np.int64)),
        "mlm_labels": torch.from_numpy(mlm_labels),
        "nsp_labels": nsp,
    }


def pack_ffd(lengths: Sequence[int], capacity: int, max_per_row: int = 3) -> list[list[int]]:
    """First-fit decreasing: indices of ``lengths`` grouped into rows of at most
    ``capacity`` tokens and ``max_per_row`` sequences, longest first (deterministic)."""
    lengths = np.asarray(lengths)
    if len(lengths) and lengths.max() > capacity:
        raise ValueError(f"pack_ffd: a sequence of {int(lengths.max())} tokens exceeds {capacity}")
    rows: list[list[int]] = []
    room: list[int] = []
    for i in np.lexsort((np.arange(len(lengths)), -lengths)):
        for r, free in enumerate(room):
            if free >= lengths[i] and len(rows[r]) < max_per_row:
                rows[r].append(int(i))
                room[r] -= int(lengths[i])
                break
        else:
            rows.append([int(i)])
            room.append(capacity - int(lengths[i]))
    return rows


def collate_packed(samples: Sequence[Sample], max_seq_length: int, max_per_row: int = 3) -> dict[str, Any]:
    """Pack the batch into rows of ``max_seq_length`` (``pack_ffd``, at most ``max_per_row``
    sequences each) for ``BertForPreTraining.forward_packed``.

    Row tensors ``input_ids``, ``token_type_ids``, ``position_ids`` [R, S] (positions restart
    at 0 in each sequence); ``real_index`` [T]: grid cell (row * S + column) of every real
    token, samples in batch order; ``cu_seqlens`` int32 [B+1] and ``max_seqlen`` over those T
    tokens; ``masked_index`` [M] and ``first_index`` [B] grid cells of the predictions and of
    each sample's [CLS]; labels ``mlm_labels`` [M], ``nsp_labels`` [B] as in the unpadded
    collate, so the two layouts give the same outputs in the same order.
    """
    flat = collate(samples, True, max_seq_length)  # the unpadded batch, in batch order
    lengths = np.array([len(s.input_ids) for s in samples], dtype=np.int64)
    rows = pack_ffd(lengths, max_seq_length, max_per_row)
    start = np.zeros(len(samples), dtype=np.int64)  # grid cell of each sample's first token
    for r, members in enumerate(rows):
        col = 0
        for i in members:
            start[i] = r * max_seq_length + col
            col += int(lengths[i])
    cu = flat["cu_seqlens"].numpy().astype(np.int64)
    real_index = torch.from_numpy(np.repeat(start - cu[:-1], lengths) + np.arange(cu[-1]))
    grid = len(rows) * max_seq_length

    def place(values: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(grid, dtype=values.dtype)
        out[real_index] = values
        return out.view(len(rows), max_seq_length)

    return {
        "input_ids": place(flat["input_ids"]),
        "token_type_ids": place(flat["token_type_ids"]),
        "position_ids": place(flat["position_ids"]),
        "real_index": real_index,
        "cu_seqlens": flat["cu_seqlens"],
        "max_seqlen": flat["max_seqlen"],
        "masked_index": real_index[flat["masked_index"]],
        "first_index": torch.from_numpy(start),
        "mlm_labels": flat["mlm_labels"],
        "nsp_labels": flat["nsp_labels"],
    }


def to_device(batch: dict, device: torch.device) -> dict:
    # non_blocking: overlaps the host-to-device copy with compute on GPU (from pinned
    # memory); free on CPU.
    return {k: (v.to(device, non_blocking=True) if torch.is_tensor(v) else v) for k, v in batch.items()}


def pinned(batch: dict) -> dict:
    """The batch with its tensors in page-locked host memory, so the loop's
    ``to(device, non_blocking=True)`` is a true asynchronous copy (from pageable memory CUDA
    stages it through a pinned bounce buffer and the host waits). Costs one host copy per
    batch, from torch's caching host allocator (no cudaHostAlloc per batch). CUDA only."""
    return {k: (v.pin_memory() if torch.is_tensor(v) else v) for k, v in batch.items()}


def split_labels(batch: dict) -> tuple[dict, dict]:
    """(the model's keyword arguments, the labels)."""
    return {k: v for k, v in batch.items() if k not in LABEL_KEYS}, {k: batch[k] for k in LABEL_KEYS}


# ---------------------------------------------------------------- synthetic batches


def synthetic_samples(total_tokens: int, n: int, max_seq_length: int, max_pred: int, vocab_size: int,
                      rng: np.random.Generator) -> list[Sample]:
    """``n`` random samples holding ``total_tokens`` tokens in all (lengths as equal as
    possible, each in [2, max_seq_length]), ~15% of each masked (at most ``max_pred``).
    Shapes, not content, matter here: the values only have to be valid ids."""
    total = min(max(total_tokens, 2 * n), n * max_seq_length)
    lengths = np.full(n, total // n, dtype=np.int64)
    lengths[: total % n] += 1
    out = []
    for length in lengths.tolist():
        ids = rng.integers(1, vocab_size, size=length, dtype=np.int64)
        segments = (np.arange(length) >= length // 2).astype(np.int64)
        k = min(max_pred, max(1, round(0.15 * (length - 1))))
        positions = np.sort(rng.choice(np.arange(1, length), size=k, replace=False)).astype(np.int64)
        out.append(Sample(ids, segments, positions, ids[positions].copy(), int(rng.integers(2))))
    return out


def synthetic_batches(collate: Callable[[list[Sample]], dict], token_counts: list[int], n: int,
                      max_seq_length: int, max_pred: int, vocab_size: int, seed: int = 0) -> list[dict]:
    """One collated batch of ``n`` synthetic samples per entry of ``token_counts``."""
    rng = np.random.default_rng(seed)
    return [collate(synthetic_samples(t, n, max_seq_length, max_pred, vocab_size, rng)) for t in token_counts]


def warmup_token_counts(layout: Any, batch_size: int, max_seq_length: int) -> list[int]:
    """Token counts of the warm-up's synthetic micro-batches: one per shape the run can see.
    With token budgets (``layout``, a ``bert.budget.Layout``) each rung, filled exactly, so
    every shape the run will meet is compiled and captured; without, every batch has its
    own shape, and one typical batch (half the grid) warms up what does not depend on it."""
    if layout is not None:
        return list(layout.rungs)
    return [batch_size * max_seq_length // 2]
