"""The train state: what a checkpoint saves (bert/checkpoint.py) and the warm-up puts back
exactly (bert/step_graph.py). ``Learner`` is the model and everything that updates it;
``TrainState`` is what the loop counts. (The data stream's position and the RNG states are
saved beside them, per rank.)"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .grad_sync import GradSync
from .precision import Precision


@dataclass(kw_only=True)
class Learner:
    model: torch.nn.Module  # the bare module: evaluation, checkpoints, exports
    train_model: torch.nn.Module  # what a training step calls: DDP-wrapped when distributed
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler  # fp16 loss scaling; disabled (no-op calls) otherwise
    precision: Precision
    grad_sync: GradSync  # after_sync(): global clip (closed) or nothing; its bucket layout
    device: torch.device


@dataclass
class TrainState:
    """Everything the loop advances."""

    step: int = 0
    samples: int = 0
    next_eval: int = 0
    # [steps with a NaN/inf loss in all, in a row now]: kept on the device so counting
    # costs no host sync; read with the progress line's loss.
    nonfinite: torch.Tensor = field(default_factory=lambda: torch.zeros(2, dtype=torch.int64))
    # fp16 steps skipped for inf/nan gradients: a 0-d int64 on the device, summed without a
    # host sync and read at the progress lines and evaluations.
    skipped_steps: torch.Tensor | int = 0
    # The run's seed (bert.trainer.resolve_seed): a resumed run keeps the seed of the run it
    # continues, so its data order is the same one.
    seed: int = -1

    def advance(self, loss: torch.Tensor, skipped: torch.Tensor | int, global_batch: int) -> None:
        """Count one optimizer step: samples, NaN/inf losses, skipped steps."""
        self.step += 1
        self.samples += global_batch
        bad = (~torch.isfinite(loss)).long()  # device-side count: no sync
        self.nonfinite = torch.stack([self.nonfinite[0] + bad, (self.nonfinite[1] + 1) * bad])
        self.skipped_steps += skipped
