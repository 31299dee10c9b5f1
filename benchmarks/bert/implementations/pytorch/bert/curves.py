"""TensorBoard curves of the training loop (``log.tensorboard_dir``; off when empty).

The Trainer calls ``Curves`` at the two points where it already stops to look: the progress
poll (every ``log.progress_interval_steps`` steps, where the loss is already read back) and
each evaluation. Rank 0 writes; every rank takes part in the one collective per poll.

At the poll, x = global step (tags under ``train/``, ``speed/``, ``balance/``):
``train/loss`` (the last step's), ``train/learning_rate``, ``train/grad_norm`` (the global
L2 norm before clipping, where the run clips on it: ``optim.max_grad_norm`` > 0 or a
one-process bucket clip), ``train/loss_scale`` and ``train/skipped_steps`` (fp16 loss
scaling), ``speed/samples_per_s``, ``speed/tokens_per_s`` (real tokens, every rank),
``speed/model_flops_per_s`` (the useful FLOP count of bert/flops.py on the batches actually
trained: real tokens, attention per sequence, the MLM head on masked rows, 3x the forward)
and ``speed/mfu`` (that over ``log.peak_flops_per_s`` x ranks, when the peak is given), and
``balance/busiest_over_mean_tokens``: per step, the busiest rank's real tokens over the mean
of all ranks' (1.0 = perfectly balanced), one point per step of the interval.
At each evaluation: ``eval/<metric>`` against the step, and in the ``samples`` subfolder
(a second run in TensorBoard) the same against samples trained, the MLPerf log's x axis.

Counting costs a sum over each micro-batch's lengths on the host (the batch is on the host
before the step moves it); the counts of the interval are gathered at the poll, one small
``all_gather_object``. A resumed run writes to the same folder with ``purge_step`` at its
checkpoint's step + 1 (samples + 1 in ``samples``): TensorBoard drops what the interrupted
run wrote past the checkpoint, so the curves continue without duplicated points.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import torch

from . import distributed
from .config import ConfigError, ModelConfig
from .flops import Shape, attention_flops, head_flops, layer_flops, train_flops
from .loader import Watched
from .model import IGNORE_INDEX


def batch_counts(batch: dict) -> tuple[int, int, int, int]:
    """(sequences, real tokens, sum of squared lengths, masked positions) of one collated
    batch, either layout (bert/batches.py); filler rows of a token budget have length 0 and
    count nowhere."""
    if "cu_seqlens" in batch:
        lengths = torch.diff(batch["cu_seqlens"].long())
    else:
        lengths = batch["attention_mask"].sum(1)
    lengths = lengths[lengths > 0]
    masked = int((batch["mlm_labels"] != IGNORE_INDEX).sum())
    return int(lengths.numel()), int(lengths.sum()), int((lengths * lengths).sum()), masked


class Counted(Watched):
    """The training stream (a ``bert.loader.TrainStream``), counting each micro-batch it
    hands out (``batch_counts``); its state, failure and close are the stream's own."""

    def __init__(self, batches: Any) -> None:
        super().__init__(batches)
        self.counts: list[tuple[int, int, int, int]] = []  # since the last ``take``

    def __next__(self) -> dict:
        batch = next(self.batches)
        self.counts.append(batch_counts(batch))
        return batch

    def take(self) -> list[tuple[int, int, int, int]]:
        counts, self.counts = self.counts, []
        return counts


def step_totals(counts: list[tuple[int, int, int, int]], accum: int) -> list[list[int]]:
    """Per optimizer step (``accum`` micro-batches each), the four counts summed."""
    return [[sum(c[k] for c in counts[i:i + accum]) for k in range(4)] for i in range(0, len(counts), accum)]


def imbalance(per_rank: list[list[list[int]]]) -> list[float]:
    """Per step, the busiest rank's real tokens over the ranks' mean (``per_rank[r][step]``
    as ``step_totals`` makes them); 1.0 where no rank had a token."""
    out = []
    for step in zip(*per_rank):
        tokens = [s[1] for s in step]
        mean = sum(tokens) / len(tokens)
        out.append(max(tokens) / mean if mean > 0 else 1.0)
    return out


def useful_train_flops(shape: Shape, sequences: int, tokens: int, squares: int, masked: int) -> int:
    """bert/flops.py's useful training FLOPs of batches with these totals (attention's
    per-sequence L^2 summed over the sequences: ``squares``)."""
    attention = attention_flops(shape, 1) * squares  # attention_flops is linear in L^2
    return train_flops(layer_flops(shape, tokens) + attention + head_flops(shape, sequences, masked))


class Curves:
    """One rank's part of the curves: counts on every rank, the event files on rank 0."""

    def __init__(self, log_dir: str | Path, *, model: ModelConfig, rank: int, world_size: int, accum: int,
                 peak_flops_per_s: float, start_step: int, start_samples: int) -> None:
        if importlib.util.find_spec("tensorboard") is None:  # every rank: none is left waiting at a gather
            raise ConfigError(f"log.tensorboard_dir={str(log_dir)!r}: the tensorboard package is not installed "
                              "(pip install '.[tensorboard]'), or leave log.tensorboard_dir empty")
        self.rank, self.world_size, self.accum = rank, world_size, accum
        self.shape = Shape(model.hidden_size, model.num_layers, model.intermediate_size, model.vocab_size)
        self.peak = peak_flops_per_s
        self.counted: Counted | None = None
        self.writer = self.by_samples = None
        if rank == 0:
            from torch.utils.tensorboard import SummaryWriter  # optional dependency: the [tensorboard] extra

            # purge_step: TensorBoard drops the earlier points at or past it (what an interrupted
            # run wrote after the checkpoint this run resumes from). A fresh run marks its start
            # too: TensorBoard's server takes a folder's first start mark as the first run's and
            # purges only at later ones.
            self.writer = SummaryWriter(str(log_dir), purge_step=start_step + 1)
            self.by_samples = SummaryWriter(str(Path(log_dir) / "samples"), purge_step=start_samples + 1)

    def count(self, batches: Any) -> Counted:
        """``batches``, counted (the Trainer trains from what this returns)."""
        self.counted = Counted(batches)
        return self.counted

    def progress(self, step: int, values: dict[str, float], samples_per_s: float) -> None:
        """At the progress poll (every rank: the counts are gathered here). ``values``: the
        scalars the loop read (loss, learning_rate, grad_norm, loss_scale, skipped_steps)."""
        mine = step_totals(self.counted.take() if self.counted is not None else [], self.accum)
        per_rank = distributed.all_gather_object(mine)
        if self.writer is None:
            return
        for k, v in values.items():
            self.writer.add_scalar(f"train/{k}", v, step)
        self.writer.add_scalar("speed/samples_per_s", samples_per_s, step)
        totals = [sum(s[k] for r in per_rank for s in r) for k in range(4)]
        if totals[0] > 0:
            per_sample = samples_per_s / totals[0]  # optimizer steps' samples are the sequences counted
            self.writer.add_scalar("speed/tokens_per_s", totals[1] * per_sample, step)
            flops_per_s = useful_train_flops(self.shape, *totals) * per_sample
            self.writer.add_scalar("speed/model_flops_per_s", flops_per_s, step)
            if self.peak > 0:
                self.writer.add_scalar("speed/mfu", flops_per_s / (self.peak * self.world_size), step)
        ratios = imbalance(per_rank)
        for i, r in enumerate(ratios):  # the interval's steps, one point each, the last at ``step``
            self.writer.add_scalar("balance/busiest_over_mean_tokens", r, step - len(ratios) + 1 + i)

    def evaluate(self, step: int, samples: int, metrics: dict[str, float]) -> None:
        """At each evaluation (rank 0 writes; the others return)."""
        if self.writer is None:
            return
        for k, v in metrics.items():
            self.writer.add_scalar(f"eval/{k}", v, step)
            self.by_samples.add_scalar(f"eval/{k}", v, samples)
        self.writer.flush()
        self.by_samples.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.by_samples.close()
