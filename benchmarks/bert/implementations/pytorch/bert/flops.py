"""Matmul FLOPs of one BERT pre-training forward, counted from the shapes (2 per multiply-add).

Only the matrix products are counted (the projections, the two attention products, the
pooler, the NSP and MLM heads), as ``torch.utils.flop_counter`` does; LayerNorm, GELU,
softmax and the embedding lookups are a fraction of a percent at BERT's sizes. A training
step is taken as 3x the forward (the backward computes two products per forward product),
the usual convention for MFU.

Two accountings of the same batch:

- ``padded``: what Hugging Face ``BertForPreTraining`` computes on ``[B, S]`` padded inputs:
  every layer over all S positions, attention over S x S, the MLM head over all B * S rows.
- ``useful``: the work that changes the result: each sequence's real tokens only, attention
  over L x L per sequence, the MLM head only on the masked rows. This is the floor any
  implementation has to compute; ``padded / useful`` is the speed-up unpadding can approach.

``attention_lengths`` lets a caller charge attention at a length other than the real one,
e.g. the batch's longest sequence, which is what a pad-to-the-batch-maximum varlen
fallback executes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Shape:
    """The model dimensions the count needs (ModelConfig and HF BertConfig both map here)."""

    hidden: int
    layers: int
    intermediate: int
    vocab: int


def layer_flops(s: Shape, tokens: int) -> int:
    """Per-token GEMMs of all layers for ``tokens`` tokens: Q, K, V, output, FFN in and out."""
    e, i = s.hidden, s.intermediate
    return s.layers * 2 * tokens * (4 * e * e + 2 * e * i)


def attention_flops(s: Shape, length: int) -> int:
    """QK^T and PV of one sequence of ``length`` tokens, all heads, all layers."""
    return s.layers * 2 * 2 * length * length * s.hidden


def head_flops(s: Shape, sequences: int, mlm_rows: int) -> int:
    """Pooler and NSP (per sequence) and the MLM transform and decoder (per predicted row)."""
    e = s.hidden
    return 2 * sequences * (e * e + 2 * e) + 2 * mlm_rows * (e * e + e * s.vocab)


def forward_flops(s: Shape, lengths: Sequence[int], mlm_rows: int,
                  attention_lengths: Sequence[int] | None = None) -> int:
    """One forward over sequences of real ``lengths`` with ``mlm_rows`` MLM head rows."""
    att = attention_lengths if attention_lengths is not None else lengths
    return (layer_flops(s, sum(lengths)) + sum(attention_flops(s, n) for n in att)
            + head_flops(s, len(lengths), mlm_rows))


def useful_forward_flops(s: Shape, lengths: Sequence[int], masked: int) -> int:
    """Real tokens only, attention per sequence, MLM head on the ``masked`` rows only."""
    return forward_flops(s, lengths, masked)


def padded_forward_flops(s: Shape, batch: int, seq_len: int) -> int:
    """Hugging Face's padded forward: ``batch`` rows of ``seq_len``, head on every position."""
    return forward_flops(s, [seq_len] * batch, batch * seq_len)


def train_flops(forward: int) -> int:
    """Forward + backward: 3x the forward's products."""
    return 3 * forward
