"""Optimizers (LAMB, Adam/AdamW), their parameter groups, and the learning-rate schedule.

Everything here is decided once, in ``build_optimizer`` / ``build_scheduler``; the training
loop only calls ``optimizer.step()`` and ``scheduler.step()``.

Gradient clipping is *not* done here. The caller clips on the global norm after the
allreduce (closed division) or the DDP comm hook clips per bucket before it (open
division); a second clip inside the optimizer would change the update.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from bert.config import ConfigError, OptimConfig, lr_decay_end

# ---------------------------------------------------------------- parameter groups

# Module types whose parameters never take weight decay. Name rules below catch the same
# parameters in models that build LayerNorm some other way (fused kernels, TF-style names).
_NORM_TYPES: tuple[type[nn.Module], ...] = (nn.LayerNorm,) + (
    (nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()
)


def _no_decay(module: nn.Module, local_name: str, param: nn.Parameter) -> bool:
    """Biases, LayerNorm gain/shift and any other 1-D parameter: no weight decay.

    Matches the reference's exclusion list ("LayerNorm", "layer_norm", "bias"): in BERT
    every 1-D parameter is a bias or a LayerNorm parameter, and every >= 2-D one (weights,
    embeddings, the tied decoder) is decayed.
    """
    return (
        isinstance(module, _NORM_TYPES)
        or local_name == "bias"
        or param.ndim <= 1
    )


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two optimizer groups: ``weight_decay`` on weights, 0 on biases and LayerNorm.

    Each trainable parameter appears exactly once, in the order the model first names it;
    a tied parameter (the MLM decoder sharing the word embedding) is listed once. If any
    use of a tied parameter says "no decay", it gets none. Frozen parameters are left out.
    An empty group is dropped.
    """
    order: dict[int, nn.Parameter] = {}
    no_decay: set[int] = set()
    full_names: dict[int, str] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for local_name, p in module.named_parameters(recurse=False, remove_duplicate=False):
            if not p.requires_grad:
                continue
            key = id(p)
            order.setdefault(key, p)
            full = f"{mod_name}.{local_name}" if mod_name else local_name
            full_names.setdefault(key, full)
            if _no_decay(module, local_name, p) or full.endswith(
                ("LayerNorm.weight", "LayerNorm.bias", "layer_norm.weight", "layer_norm.bias")
            ):
                no_decay.add(key)
    decay_params = [p for k, p in order.items() if k not in no_decay]
    plain_params = [p for k, p in order.items() if k in no_decay]
    groups = [
        {"params": decay_params, "weight_decay": float(weight_decay)},
        {"params": plain_params, "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


# ---------------------------------------------------------------- LAMB


class Lamb(torch.optim.Optimizer):
    """LAMB (You et al., 2019) with the arithmetic of apex ``FusedLAMB`` (``adam_w_mode=True``,
    ``grad_averaging=True``, ``use_nvlamb=False``), written with ``torch._foreach_*`` ops.

    Per parameter p with gradient g, at its step t (1-based):

        m = b1 m + (1 - b1) g            v = b2 v + (1 - b2) g^2
        m_hat = m / (1 - b1^t)           v_hat = v / (1 - b2^t)     (if bias_correction)
        u = m_hat / (sqrt(v_hat) + eps) + wd p
        r = ||p|| / ||u||  if both norms > 0 else 1                 (only where wd != 0)
        p = p - lr r u

    The trust ratio is applied only in groups with non-zero weight decay, as apex does with
    ``use_nvlamb=False`` and as the MLCommons TF reference does (its layer-adaptation
    exclusions default to its weight-decay exclusions): biases and LayerNorm parameters get
    a plain Adam step. No gradient clipping happens here (the caller clips the global norm).

    Cost per step and (device, dtype) bucket: about a dozen multi-tensor kernels, two
    transient param-sized buffers (denominator, update), and no host sync: the trust ratio
    is chosen on device with ``torch.where``, bias corrections are Python floats computed
    from the integer step counts kept in the state. Scaling each update by its own ratio
    goes through foreach's per-tensor path (one small kernel per tensor) because the ratios
    are 0-dim tensors; on GPU the apex kernel is preferred for this reason.

    The step count is a Python ``int`` per parameter in ``state[p]["step"]``, so
    ``state_dict``/``load_state_dict`` round-trip it unchanged. ``lr`` must be a float.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        bias_correction: bool = True,
    ) -> None:
        if not lr >= 0.0:
            raise ValueError(f"Lamb: invalid lr {lr}")
        if not eps >= 0.0:
            raise ValueError(f"Lamb: invalid eps {eps}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"Lamb: invalid betas {betas}")
        if not weight_decay >= 0.0:
            raise ValueError(f"Lamb: invalid weight_decay {weight_decay}")
        defaults = dict(
            lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
            bias_correction=bias_correction,
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            # foreach kernels need one device and dtype per call: bucket once per step
            # (a Python loop over the parameter list, no device work).
            buckets: dict[tuple[torch.device, torch.dtype], list[list[Any]]] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("Lamb does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                b = buckets.setdefault((p.device, p.dtype), [[], [], [], [], []])
                b[0].append(p)
                b[1].append(p.grad)
                b[2].append(state["exp_avg"])
                b[3].append(state["exp_avg_sq"])
                b[4].append(state["step"])
            for params, grads, exp_avgs, exp_avg_sqs, steps in buckets.values():
                self._update(group, params, grads, exp_avgs, exp_avg_sqs, steps)
        return loss

    @staticmethod
    def _update(
        group: dict[str, Any],
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        exp_avgs: list[torch.Tensor],
        exp_avg_sqs: list[torch.Tensor],
        steps: list[int],
    ) -> None:
        beta1, beta2 = group["betas"]
        lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]

        torch._foreach_mul_(exp_avgs, beta1)
        torch._foreach_add_(exp_avgs, grads, alpha=1.0 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - beta2)

        # Two transient param-sized buffers (allocates): the denominator and the update.
        if group["bias_correction"]:
            denom = torch._foreach_div(exp_avg_sqs, [1.0 - beta2**t for t in steps])
            torch._foreach_sqrt_(denom)
            updates = torch._foreach_div(exp_avgs, [1.0 - beta1**t for t in steps])
        else:
            denom = torch._foreach_sqrt(exp_avg_sqs)
            updates = torch._foreach_mul(exp_avgs, 1.0)
        torch._foreach_add_(denom, eps)
        torch._foreach_div_(updates, denom)
        del denom

        if wd != 0.0:
            torch._foreach_add_(updates, params, alpha=wd)
            p_norm = torch.stack(torch._foreach_norm(params))
            u_norm = torch.stack(torch._foreach_norm(updates))
            # On device, no sync: ratio 1 where either norm is 0 (zero-initialized weight,
            # all-zero update). The division's inf/nan there is discarded by where.
            ratio = torch.where((p_norm > 0) & (u_norm > 0), p_norm / u_norm, 1.0)
            torch._foreach_mul_(updates, list(ratio.unbind()))
        torch._foreach_add_(params, updates, alpha=-lr)


# ---------------------------------------------------------------- building


def _load_apex() -> Any | None:
    """apex.optimizers when importable *with* its CUDA extensions, else None.

    A bare ``import apex`` can succeed without the compiled multi-tensor kernels, in which
    case FusedLAMB/FusedAdam raise at construction; treat that as "no apex".
    """
    try:
        import apex.optimizers as apex_optimizers
        from apex.multi_tensor_apply import multi_tensor_applier
    except ImportError:
        return None
    return apex_optimizers if getattr(multi_tensor_applier, "available", False) else None


def build_optimizer(
    model: nn.Module, cfg: OptimConfig, device_type: str
) -> tuple[torch.optim.Optimizer, str]:
    """The optimizer for ``cfg`` on ``device_type`` ("cpu", "cuda", ...), chosen once.

    Returns ``(optimizer, impl_name)``; ``impl_name`` (e.g. ``lamb:apex-fused``,
    ``lamb:foreach``, ``adamw:torch-fused``, ``adam:torch-foreach``) is for the log.

    - ``lamb``: apex ``FusedLAMB`` when ``cfg.impl`` is auto/apex, apex is importable and
      the device is CUDA; else ``Lamb`` above (same arithmetic).
    - ``adamw`` and ``adam``: the same math, Adam with *decoupled* weight decay (AdamW).
      The paper's "Adam" recipe (weight decay 0.00289) ran apex ``FusedAdam`` with its
      default ``adam_w_mode=True`` (published v1.1 open-division code), i.e. decoupled
      decay; ``adam`` is kept as a name so configs can say what the paper says. apex
      ``FusedAdam`` on CUDA when allowed, else ``torch.optim.AdamW`` (``fused=True`` on
      CUDA and CPU, ``foreach=True`` elsewhere).

    ``cfg.impl`` narrows the choice: ``apex`` raises ``ConfigError`` unless apex (with CUDA
    extensions) is importable and the device is CUDA; ``torch`` never takes apex; ``fused``
    is torch's fused AdamW on any device it supports (CPU included; LAMB has none, which
    ``config.validate`` rejects); ``foreach`` never fuses, the baseline a benchmark
    compares the fused kernels against. Parameters must already be on the device.

    Under fp16 loss scaling the optimizer only ever sees unscaled float32 gradients (the
    training step unscales before clipping). torch's fused AdamW takes the scaler's inf
    flag on device, so its skipped steps cost no host sync; the others are stepped or not
    by ``GradScaler.step`` after one sync.
    """
    groups = param_groups(model, cfg.weight_decay)
    betas = (cfg.beta1, cfg.beta2)
    on_cuda = device_type == "cuda"

    apex_opt = None
    if cfg.impl in ("auto", "apex"):
        apex_opt = _load_apex() if on_cuda else None
        if cfg.impl == "apex" and apex_opt is None:
            why = (
                "apex (with its CUDA extensions) is not importable"
                if on_cuda
                else f"apex's fused optimizers need CUDA, device is {device_type!r}"
            )
            raise ConfigError(f"optim.impl: 'apex' requested but {why}; use 'auto' or 'torch'")

    if cfg.name == "lamb":
        if cfg.impl == "fused":
            raise ConfigError("optim.impl: 'fused' is torch's fused AdamW; torch has no LAMB "
                              "(use auto, apex or foreach)")
        if apex_opt is not None:
            # max_grad_norm=inf, not 0: FusedLAMB divides the gradients by
            # global_norm / max_grad_norm whenever global_norm > max_grad_norm, so 0 would
            # zero every gradient. inf turns its clip off (the caller clips after the
            # allreduce); FusedLAMB still computes the global norm (one extra multi-tensor
            # L2 pass per step). FusedLAMB takes fp16/fp32 parameters only.
            opt = apex_opt.FusedLAMB(
                groups, lr=cfg.lr, betas=betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
                bias_correction=True, adam_w_mode=True, grad_averaging=True,
                max_grad_norm=float("inf"), use_nvlamb=False,
            )
            return opt, "lamb:apex-fused"
        opt = Lamb(groups, lr=cfg.lr, betas=betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
        return opt, "lamb:foreach"

    if cfg.name in ("adamw", "adam"):
        if apex_opt is not None:
            opt = apex_opt.FusedAdam(
                groups, lr=cfg.lr, betas=betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
                bias_correction=True, adam_w_mode=True,
            )
            return opt, f"{cfg.name}:apex-fused"
        # torch's fused AdamW has CUDA and CPU kernels (one pass per tensor instead of a
        # dozen foreach passes: ~4x faster on the CPU benchmark's 11M parameters); foreach
        # elsewhere, or when asked for (impl=foreach, the baseline the fused kernel is
        # measured against).
        fused = cfg.impl == "fused" or (device_type in ("cuda", "cpu") and cfg.impl in ("auto", "torch"))
        kind = {"fused": True} if fused else {"foreach": True}
        opt = torch.optim.AdamW(
            groups, lr=cfg.lr, betas=betas, eps=cfg.eps, weight_decay=cfg.weight_decay, **kind
        )
        return opt, f"{cfg.name}:torch-{'fused' if fused else 'foreach'}"

    raise ConfigError(f"optim.name: unknown optimizer {cfg.name!r}")


# ---------------------------------------------------------------- schedule


def lr_at(step: int, cfg: OptimConfig) -> float:
    """Learning rate for the update that follows ``step`` updates (0-based), by
    ``cfg.schedule``: ``mlcommons`` (below) or ``published`` (``published_lr_at``).

    The MLCommons TF reference: linear warmup from ``start_warmup_step`` over
    ``warmup_steps`` updates, otherwise polynomial decay of degree ``decay_power`` from
    ``lr`` to ``end_lr`` at the decay end (``lr_max_steps``, else ``total_steps``), flat
    after. The decay is a function of ``step`` itself, not of the offset: a negative
    ``start_warmup_step`` starts partway through warmup (start -25, warmup 100: step 0 runs
    at lr * 0.25) and warmup ends at step ``start_warmup_step + warmup_steps``.

    One deviation: with a positive ``start_warmup_step`` the reference formula gives a
    negative rate before the start; we hold 0 there (no shipped config does this).
    """
    if cfg.schedule == "published":
        return published_lr_at(step, cfg)
    base = cfg.lr
    since_start = step - cfg.start_warmup_step
    if cfg.warmup_steps > 0 and since_start < cfg.warmup_steps:
        return base * max(since_start, 0) / cfg.warmup_steps
    end = lr_decay_end(cfg)
    done = min(step, end) / end
    return (base - cfg.end_lr) * (1.0 - done) ** cfg.decay_power + cfg.end_lr


def published_step_count(step: int, cfg: OptimConfig) -> int:
    """The published scheduler's own step count ``e`` when update ``step`` (0-based) runs.

    The published open-division code (Samsung, MLPerf v1.1/v2.0, ``schedulers.py`` and
    ``run_pretraining.py``) steps its scheduler *before* each optimizer step and sets ``e``
    to apex FusedAdam's step count + 1, i.e. ``e = step + 1``. Before training, the
    scheduler's constructor (torch's ``_LRScheduler`` calls ``step()``: e = 0) and a "first
    step to fit the initial warmup lr" (taken when the warmup or its start is non-zero:
    e = 1) have already advanced it, and the first update's own scheduler step, seeing no
    optimizer step count yet, adds one more: so with a warmup the first two updates both
    run at e = 2, and update k at e = k + 1 from then on.
    """
    if step == 0:
        return 2 if (cfg.start_warmup_step or cfg.warmup_steps) else 1
    return step + 1


def published_rate(e: int, cfg: OptimConfig) -> float:
    """The published ``LinearWarmupPolyDecayScheduler`` at its step count ``e``.

    Warmup while ``e - start < warmup`` (rate ``lr (e - start) / warmup``); after it
    ``progress = min((e - warmup) / (end - warmup), 1)`` and rate
    ``(lr - end_lr) (1 - progress)^power + end_lr``; ``end_lr`` once ``e > end`` (end =
    ``lr_max_steps``, else ``total_steps``). The decay is measured from step ``warmup``,
    not from where warmup ends (``start + warmup``): with a negative start the progress is
    negative when warmup ends, so the rate jumps *above* ``lr`` there (published values:
    4.50e-4 against lr 3.93e-4 at e = 66) and comes down to ``lr`` only at e = warmup.
    Like ``lr_at``, a positive start holds 0 before it instead of a negative rate.
    """
    end = lr_decay_end(cfg)
    if e > end:
        return cfg.end_lr
    since_start = e - cfg.start_warmup_step
    if since_start < cfg.warmup_steps:
        return cfg.lr * max(since_start, 0) / cfg.warmup_steps
    progress = min((e - cfg.warmup_steps) / (end - cfg.warmup_steps), 1.0)
    return (cfg.lr - cfg.end_lr) * (1.0 - progress) ** cfg.decay_power + cfg.end_lr


def published_lr_at(step: int, cfg: OptimConfig) -> float:
    """The published schedule's rate for update ``step`` (0-based); see the two above.

    One difference remains under fp16: the published scheduler reads apex's optimizer step
    count, which does not advance on a step skipped for an overflow, so every skipped step
    delays its schedule by one update; ours advances on every step (the samples were
    consumed, and reading a skip flag before the rate would cost a host sync per step).
    """
    return published_rate(published_step_count(step, cfg), cfg)


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimConfig
) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` whose multiplier is ``lr_at(step) / cfg.lr``.

    Call ``scheduler.step()`` after each ``optimizer.step()``; the k-th update (0-based)
    then runs at ``lr_at(k)``. The optimizer must have been built with ``lr=cfg.lr``.
    Its ``state_dict`` (the step count) checkpoints with the train state; the multiplier is
    a closure, so the schedule itself comes from the config on resume, not the checkpoint.
    """
    base = cfg.lr

    def multiplier(step: int) -> float:
        return lr_at(step, cfg) / base

    return torch.optim.lr_scheduler.LambdaLR(optimizer, multiplier)


__all__ = [
    "Lamb",
    "build_optimizer",
    "build_scheduler",
    "lr_at",
    "param_groups",
    "published_lr_at",
    "published_rate",
    "published_step_count",
]
