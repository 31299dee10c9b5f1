"""Training and evaluation arithmetic (fp32, bf16, fp16), resolved once at build time.

Precision is applied from outside the model: the model's parameters stay float32 (the
"master weights"), and reduced precision comes from ``torch.autocast``, which casts each
eligible op's inputs (GEMMs, attention) to bf16/fp16 and keeps the numerically sensitive
ones (softmax, LayerNorm, cross-entropy) in float32. Gradients land in the parameters'
dtype, float32, so the optimizer and its state see float32 only.

fp16 has a narrow exponent range: small activation gradients underflow to zero. So with
fp16 the loss is multiplied by a dynamic scale before backward (``torch.amp.GradScaler``,
the maintained implementation), the gradients are divided by it before clipping and the
update, and a step whose gradients hold an inf or nan is skipped: the weights and the
optimizer state stay untouched, the scale is multiplied by ``backoff`` and the step is
counted. After ``growth_interval`` finite steps in a row the scale is multiplied by
``growth``. bf16 has fp32's exponent range and needs no scaling; fp32 and bf16 runs get a
*disabled* GradScaler whose calls are no-ops, so the loop has a single code path.

The loop's order, which clipping relies on::

    with precision.train_autocast(): loss = ...
    scaler.scale(loss).backward()          # scaled gradients (fp16), plain otherwise
    scaler.unscale_(optimizer)             # true gradients from here on; records inf/nan
    clip_grad_norm_(...)                   # on true gradients
    skipped = precision.step(scaler, optimizer)

A DDP comm hook runs inside backward, before ``unscale_``: it sees gradients multiplied
by ``loss_scale(scaler)`` and must scale any threshold it applies by that (see
``loss_scale``).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any, Callable, ContextManager

import torch

from .config import PrecisionConfig

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve(name: str, device_type: str) -> str:
    """"auto" -> "bf16" on CUDA (tensor cores, fp32 range), "fp32" elsewhere (a CPU without
    bf16 units emulates it, and the CPU demo is a correctness run, not a speed run)."""
    if name == "auto":
        return "bf16" if device_type == "cuda" else "fp32"
    return name


def _autocast_factory(name: str, device_type: str, cache: bool = True) -> Callable[[], ContextManager]:
    if name == "fp32":
        return contextlib.nullcontext
    return functools.partial(torch.autocast, device_type=device_type, dtype=DTYPES[name], cache_enabled=cache)


def loss_scale(scaler: torch.amp.GradScaler) -> torch.Tensor | None:
    """The factor the gradients currently carry, as a 0-d float32 tensor on the device
    (reading it is no host sync), or None when nothing scales them (fp32/bf16, or before
    the first ``scaler.scale``). The interface for code that sees gradients before
    ``unscale_`` (DDP comm hooks): a norm threshold T on true gradients is T * scale on
    these. The tensor is the scaler's own, updated in place by ``scaler.update()``: read
    it, don't write it.
    """
    if not scaler.is_enabled():
        return None
    # GradScaler keeps its scale as a device tensor; _get_scale_async is its accessor that
    # does not sync (get_scale() calls .item()).
    return scaler._get_scale_async()


def _step_plain(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> int:
    optimizer.step()
    return 0


def _step_scaled(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> torch.Tensor:
    # A step is skipped exactly when update() backs the scale off (backoff < 1 < growth,
    # and nothing else lowers it), so comparing the scale before and after tells it
    # without a host sync: two tiny device ops. (scaler.step itself syncs once to decide
    # whether to call optimizer.step, except for optimizers that take the inf flag on
    # device, such as torch's fused AdamW.)
    before = loss_scale(scaler).clone()
    scaler.step(optimizer)
    scaler.update()
    return (loss_scale(scaler) < before).to(torch.int64)


@dataclass(frozen=True)
class Precision:
    """A run's resolved arithmetic: what to wrap forward passes in, and how to step."""

    train: str  # "fp32" | "bf16" | "fp16"
    eval: str
    train_autocast: Callable[[], ContextManager]  # wraps forward + loss (not backward)
    eval_autocast: Callable[[], ContextManager]
    # (scaler, optimizer) -> 1 if the step was skipped (0-d int64 on device), else 0.
    # Calls optimizer.step(), and with fp16 scaler.step + scaler.update.
    step: Callable[[torch.amp.GradScaler, torch.optim.Optimizer], Any]

    def hyperparameters(self, cfg: PrecisionConfig) -> dict[str, Any]:
        """What the log and the resolved config record (loss-scale settings apply to fp16)."""
        return {
            "precision": self.train,
            "eval_precision": self.eval,
            "loss_scaling": "dynamic" if self.train == "fp16" else "none",
            "loss_scale_init": cfg.loss_scale_init,
            "loss_scale_growth_factor": cfg.loss_scale_growth,
            "loss_scale_backoff_factor": cfg.loss_scale_backoff,
            "loss_scale_growth_interval": cfg.loss_scale_growth_interval,
            # Not an MLPerf key: the encoder's GEMMs in FP8 (bert/fp8.py), or "off".
            "fp8_gemms": cfg.fp8,
        }


def build_precision(cfg: PrecisionConfig, device_type: str, autocast_cache: bool = True) -> Precision:
    """``autocast_cache=False`` turns off autocast's cache of casted weights in both
    contexts: CUDA graphs need it off (a cast cached in one replay would be stale in the
    next), and every step of such a run -- the eager warm-up, the capture, evaluation --
    must run under the same setting, since torch.compile guards on it (a change is a
    recompile). Costs nothing measurable for BERT: each weight is cast once per forward
    either way (the cache only saves repeated casts of one weight inside one region)."""
    train = resolve(cfg.dtype, device_type)
    ev = train if cfg.eval_dtype == "train" else cfg.eval_dtype
    return Precision(train, ev, _autocast_factory(train, device_type, autocast_cache),
                     _autocast_factory(ev, device_type, autocast_cache),
                     _step_scaled if train == "fp16" else _step_plain)


def build_scaler(cfg: PrecisionConfig, precision: Precision, device_type: str) -> torch.amp.GradScaler:
    """Enabled for fp16 training only; disabled, every call is a no-op (scale returns its
    input, step calls optimizer.step) and its state_dict is empty. Checkpoint it beside the
    optimizer: the scale and growth tracker are part of the train state."""
    return torch.amp.GradScaler(
        device_type, init_scale=cfg.loss_scale_init, growth_factor=cfg.loss_scale_growth,
        backoff_factor=cfg.loss_scale_backoff, growth_interval=cfg.loss_scale_growth_interval,
        enabled=precision.train == "fp16",
    )


__all__ = ["DTYPES", "Precision", "build_precision", "build_scaler", "loss_scale", "resolve"]
