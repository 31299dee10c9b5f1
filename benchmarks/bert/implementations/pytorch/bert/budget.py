"""Static token budgets: the batch format. An unpadded micro-batch's token COUNT is padded
up to one of a few fixed sizes, so every training step has one of a few static shapes (what
CUDA graphs and inductor without dynamic shapes need). Where the sizes go is
``bert/ladder.py``; the config key is parsed in ``bert/config.py`` (``parse_budgets``).

The unpadded layout (``bert.data.collate(..., unpad=True)``) packs a batch's real tokens
into ``[T]``; T changes every step. A *ladder* of budgets ``r_1 < ... < r_K`` (tokens) fixes
the shape: a batch of T real tokens is padded to the smallest rung ``r >= T`` (the rows past
T are pad tokens: id 0, segment 0, position 0). The top rung is always the full grid
``local_batch * max_seq_length``, the most tokens a batch can hold, so every batch fits a
rung: a budget pads tokens, it never drops or adds a sample.

The batch keeps the unpadded keys: ``input_ids``, ``token_type_ids``, ``position_ids``
exactly budget-long; ``cu_seqlens`` [B + 1] over the B real samples (pad rows lie past
``cu_seqlens[-1]``; every attention backend gives them output 0 and never attends to them,
see bert/attention.py); ``max_seqlen`` the constant ``max_seq_length``; ``masked_index`` /
``mlm_labels`` padded to a static count of ``local_batch * max_predictions_per_seq`` slots
(pad labels IGNORE_INDEX, pad indices row 0, a valid row whose prediction the loss
ignores). The graph key of a batch is therefore its rung alone.

Masked count: fixed at ``local_batch * max_predictions_per_seq`` (the most the data can
hold: one graph key per rung, not per (rung, count)). Wikipedia samples carry ~38.5 of the
76 slots on average, so the MLM head runs on ~2x its rows: +1.47% of a BERT-Large training
step's FLOPs at any local batch (tools/budget_ladder.py prints it; BENCHMARKS.md).

Evaluation gets static shapes too (``bert.ladder.eval_layout_for``): a ladder for
``eval.batch_size`` samples, and a rank's last, short batch filled up to that many with
one-token samples that hold no prediction (``BudgetCollate(..., samples=N)``, ``FILLER``),
so evaluation compiles (and, with CUDA graphs, is captured) once per rung before run_start.
Accuracy is exact: the filler and the pad slots are never labelled.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from .data import IGNORE_INDEX, collate
from .shards import Sample


@dataclass(frozen=True)
class Layout:
    """What a budget batch's shapes are: the token rungs and the masked slots."""

    rungs: tuple[int, ...]  # increasing; the last is local_batch * max_seq_length
    masked_slots: int  # static length of masked_index / mlm_labels
    max_seq_length: int  # static max_seqlen

    def rung(self, tokens: int) -> int:
        """The smallest rung that holds ``tokens`` real tokens."""
        i = bisect.bisect_left(self.rungs, tokens)
        if i == len(self.rungs):  # impossible from a valid collate: the top is the full grid
            raise ValueError(f"{tokens} tokens exceed the top token budget {self.rungs[-1]}")
        return self.rungs[i]


# ---------------------------------------------------------------- padding a batch


def pad_batch(batch: dict[str, Any], layout: Layout) -> dict[str, Any]:
    """An unpadded batch (``collate(..., unpad=True)``) padded to its rung and the static
    masked count. Allocates one copy of the per-token tensors (host side, in the loader)."""
    total = batch["input_ids"].numel()
    pad = layout.rung(total) - total
    m = batch["masked_index"].numel()
    if m > layout.masked_slots:  # never drop a prediction: refuse instead
        raise ValueError(f"a batch holds {m} masked positions > run.local_batch_size x "
                         f"data.max_predictions_per_seq = {layout.masked_slots}: data made with more "
                         "predictions per sample; raise data.max_predictions_per_seq")
    out = dict(batch)
    for key in ("input_ids", "token_type_ids", "position_ids"):
        out[key] = torch.nn.functional.pad(batch[key], (0, pad))  # id 0, segment 0, position 0
    extra = layout.masked_slots - m
    out["masked_index"] = torch.nn.functional.pad(batch["masked_index"], (0, extra))  # row 0: valid
    out["mlm_labels"] = torch.nn.functional.pad(batch["mlm_labels"], (0, extra), value=IGNORE_INDEX)
    out["max_seqlen"] = layout.max_seq_length  # static: a Python int >= every length
    return out


FILLER = Sample(np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64), np.zeros(0, dtype=np.int64),
                np.zeros(0, dtype=np.int64), 0)  # one pad token, no prediction


class BudgetCollate:
    """The loaders' collate in budget mode: unpadded collate, then ``pad_batch``. With
    ``samples``, a batch of fewer samples is first filled up to that many with ``FILLER``
    (evaluation's last batch: one ``cu_seqlens`` shape for every batch)."""

    def __init__(self, layout: Layout, samples: int | None = None):
        self.layout, self.samples = layout, samples

    def __call__(self, samples: Sequence[Sample]) -> dict[str, Any]:
        if self.samples is not None and len(samples) < self.samples:
            samples = [*samples, *[FILLER] * (self.samples - len(samples))]
        return pad_batch(collate(samples, True, self.layout.max_seq_length), self.layout)
