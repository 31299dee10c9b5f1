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

from bert.config import ConfigError, OptimConfig, check_optim_impl, lr_decay_end

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

    Three variants, one arithmetic, chosen once at construction (n = parameter tensors,
    398 for BERT-Large, n_d of them in the decayed group, 150; a "multi-tensor" op is one
    launch per chunk of tensors on CUDA, one loop on the CPU):

    - **plain** (``capturable=False``): the step count is a Python ``int`` per parameter and
      the bias corrections are Python floats, ``lr`` a float: the foreach ops take them as
      scalar lists, so the moments, denominator and update are about a dozen multi-tensor
      ops. The per-tensor trust ratios are 0-dim tensors, and scaling each update by its own
      ratio goes through foreach's per-tensor path: n_d small kernels. About n_d + 12
      multi-tensor launches per step; launch-bound on GPU, hence apex's kernel when present.
      Not graph-safe: a captured CUDA graph would bake step 1's bias corrections and lr.
    - **capturable** (``capturable=True``): the step count is a float32 0-dim tensor per
      parameter on its device (exact to 2^24 steps) and ``lr`` a 0-dim tensor per group on
      the parameters' device (``LambdaLR`` fills it in place); bias corrections are computed
      on device (in float64, so float32 rounding of ``b2^t`` cannot move ``1 - b2^t``). No
      host sync and no host value that changes between steps: safe to capture in a CUDA
      graph. The cost is the per-tensor path for the bias corrections too: dividing each
      moment by its own 0-dim correction is one kernel per tensor, so about 2n + n_d + 15
      launches (inside a captured graph each costs ~1-2 us of GPU time instead of ~5 us of
      host time). ``group_correction=True`` (optim.lamb_bias_correction=group) takes one
      correction per parameter group (per (device, dtype) bucket of it) from the most steps
      any of its tensors took -- apex FusedLAMB's one step count per group -- and divides
      each moment list by that one 0-dim tensor: a multi-tensor kernel, n_d + 17 launches.
      The same update whenever a group's tensors all stepped together (every step of BERT).
    - **compiled** (``compile_backend="inductor"``, implies capturable state): the capturable
      update runs under ``torch.compile(fullgraph=True, dynamic=False)``; inductor fuses
      the foreach chains horizontally, across tensors and ops: on the CPU it emits one C++
      kernel per group for the whole update. On CUDA a reduction ends a Triton kernel, so
      expect a few kernels per group (moments, update and the per-tensor norms in one
      pass, the trust-ratio scaling and parameter write in another: bench/lamb_step.py
      counts them), instead of ~n. The first step compiles: warm-up time, before
      ``run_start``, and long (minutes for BERT-Large's 398 tensors: inductor's scheduler and
      codegen grow with the number of tensors, not their size, and run in Python), once per
      machine: inductor's FX graph cache serves later processes. Guards see only tensors and
      constant hyperparameters, so it never recompiles while the parameter list, shapes and
      dtypes stay the same (a step where some parameter has no gradient is another list: one
      more compile). The update is memory-bound; its time against foreach's: BENCHMARKS.md
      section 5.

    Transient memory: plain and capturable allocate two param-sized buffers per step
    (denominator and update); compiled needs at most one (inductor keeps the update it
    must norm before applying, and fuses the denominator away).

    ``state_dict``/``load_state_dict`` round-trip across variants: a step saved as an
    ``int`` loads as a device tensor into a capturable optimizer and vice versa (one host
    read at load time), and a tensor ``lr`` in the checkpoint becomes a float for a plain
    one. A capturable optimizer loads *into* its existing state tensors and lr tensors
    (copies), so a CUDA graph captured before the load still reads and writes the right
    memory. State is created on the first ``step()``: take one eager step before capture.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        bias_correction: bool = True,
        *,
        capturable: bool = False,
        compile_backend: str | None = None,
        group_correction: bool = False,
    ) -> None:
        if not float(lr) >= 0.0:  # a tensor lr is read once here, at construction
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
        # Instance attributes, not group options: a group option would travel in the
        # state_dict and a checkpoint would switch the variant of the optimizer it loads into.
        self.capturable = bool(capturable or compile_backend is not None)
        self.compile_backend = compile_backend
        self.group_correction = bool(group_correction)
        self._update_fn: Callable[..., None] = _update_capturable if self.capturable else _update_plain
        if compile_backend is not None:
            # One compiled function over all buckets of all groups (one graph, one guard
            # set). dynamic=False: shapes never change, and a symbolic shape would only
            # add guards and slow the kernels.
            self._update_fn = torch.compile(
                _update_capturable, fullgraph=True, dynamic=False, backend=compile_backend
            )
        if self.capturable:
            for group in self.param_groups:
                group["lr"] = self._lr_tensor(group, group["lr"])

    @staticmethod
    def _lr_tensor(group: dict[str, Any], value: float | torch.Tensor) -> torch.Tensor:
        """A 0-dim lr tensor of the group's own (never shared between groups: ``LambdaLR``
        fills each group's in place), on the parameters' device, float64 so that it holds
        the same value a Python float lr would (the kernels round it to the parameters'
        dtype, as they round a float)."""
        device = group["params"][0].device if group["params"] else torch.device("cpu")
        if isinstance(value, torch.Tensor):
            return value.detach().to(device=device, dtype=torch.float64).reshape(()).clone()
        return torch.tensor(float(value), dtype=torch.float64, device=device)

    def _new_state(self, p: torch.Tensor) -> dict[str, Any]:
        step: int | torch.Tensor = (
            torch.zeros((), dtype=torch.float32, device=p.device) if self.capturable else 0
        )
        return {
            "step": step,
            "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
            "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
        }

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = []
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
                    state.update(self._new_state(p))
                if not self.capturable:
                    state["step"] += 1  # capturable: counted on device, in the update
                b = buckets.setdefault((p.device, p.dtype), [[], [], [], [], []])
                b[0].append(p)
                b[1].append(p.grad)
                b[2].append(state["exp_avg"])
                b[3].append(state["exp_avg_sq"])
                b[4].append(state["step"])
            if not buckets:
                continue
            lr = group["lr"]
            if self.capturable:
                lr = group["lr"] = (lr if isinstance(lr, torch.Tensor) and lr.dtype == torch.float64
                                    else self._lr_tensor(group, lr))
            elif isinstance(lr, torch.Tensor):
                # A tensor lr in a plain optimizer (a scheduler state saved by a capturable
                # one): one host read per step. Capturable optimizers never take this path.
                lr = float(lr)
            hyper = (group["betas"][0], group["betas"][1], group["eps"],
                     group["weight_decay"], bool(group["bias_correction"]), self.group_correction)
            work.append((lr, hyper, [tuple(b) for b in buckets.values()]))
        if work:
            self._update_fn(work)
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load, then the step and lr put in this variant's form; a capturable
        optimizer copies into the tensors it already holds (a captured graph keeps its
        addresses)."""
        held_state = {p: dict(s) for p, s in self.state.items()} if self.capturable else {}
        held_lr = [g["lr"] for g in self.param_groups]
        super().load_state_dict(state_dict)
        for group, old_lr in zip(self.param_groups, held_lr):
            if self.capturable:
                if isinstance(old_lr, torch.Tensor):
                    old_lr.copy_(torch.as_tensor(group["lr"], dtype=old_lr.dtype))
                    group["lr"] = old_lr
                else:
                    group["lr"] = self._lr_tensor(group, group["lr"])
            elif isinstance(group["lr"], torch.Tensor):
                group["lr"] = float(group["lr"])  # host read, at load time only
            for p in group["params"]:
                state = self.state.get(p)
                if not state:
                    continue
                step = state["step"]
                if not self.capturable:
                    state["step"] = int(step.item()) if isinstance(step, torch.Tensor) else int(step)
                    continue
                state["step"] = torch.as_tensor(float(step) if not isinstance(step, torch.Tensor) else step,
                                                dtype=torch.float32).to(p.device).reshape(())
                old = held_state.get(p)
                if old:  # keep the tensors a captured graph points at
                    for key in ("step", "exp_avg", "exp_avg_sq"):
                        old[key].copy_(state[key])
                        state[key] = old[key]


def _direction(grads: list, exp_avgs: list, exp_avg_sqs: list, beta1: float, beta2: float, eps: float,
               corrections: tuple[list, list] | None) -> list[torch.Tensor]:
    """Both variants' Adam part: the moments updated in place, then the new list
    m_hat / (sqrt(v_hat) + eps). ``corrections`` = (1 - b1^t, 1 - b2^t) per tensor, as host
    floats (plain) or 0-d device tensors (capturable), or one 0-d device tensor each for the
    whole list (capturable, group_correction), or None without bias correction.
    Two transient param-sized buffers (allocates): the denominator and the result."""
    torch._foreach_mul_(exp_avgs, beta1)
    torch._foreach_add_(exp_avgs, grads, alpha=1.0 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1.0 - beta2)
    if corrections is not None:
        denom = torch._foreach_div(exp_avg_sqs, corrections[1])
        torch._foreach_sqrt_(denom)
        updates = torch._foreach_div(exp_avgs, corrections[0])
    else:
        denom = torch._foreach_sqrt(exp_avg_sqs)
        updates = torch._foreach_mul(exp_avgs, 1.0)
    torch._foreach_add_(denom, eps)
    torch._foreach_div_(updates, denom)
    return updates


def _update_plain(work: list[tuple[float, tuple, list]]) -> None:
    """The plain variant: host scalars (lr, Python-int steps) in scalar-list foreach ops (one
    multi-tensor kernel each already: ``group_correction`` changes nothing here)."""
    for lr, (beta1, beta2, eps, wd, bias_correction, _group_correction), buckets in work:
        for params, grads, exp_avgs, exp_avg_sqs, steps in buckets:
            corrections = ([1.0 - beta1**t for t in steps], [1.0 - beta2**t for t in steps]) if bias_correction else None
            updates = _direction(grads, exp_avgs, exp_avg_sqs, beta1, beta2, eps, corrections)
            if wd != 0.0:
                torch._foreach_add_(updates, params, alpha=wd)
                torch._foreach_mul_(updates, _trust_ratios(params, updates).unbind())
            torch._foreach_add_(params, updates, alpha=-lr)


def _trust_ratios(params: list[torch.Tensor], updates: list[torch.Tensor]) -> torch.Tensor:
    """||p|| / ||u|| per tensor, 1 where either norm is 0 (a zero-initialized weight, an
    all-zero update), on device with ``torch.where``: no sync; the division's inf/nan there
    is discarded."""
    p_norm = torch.stack(torch._foreach_norm(params))
    u_norm = torch.stack(torch._foreach_norm(updates))
    return torch.where((p_norm > 0) & (u_norm > 0), p_norm / u_norm, 1.0)


def _update_capturable(work: list[tuple[torch.Tensor, tuple, list]]) -> None:
    """The capturable variant (and, under torch.compile, the compiled one): every value
    that changes between steps (step counts, lr) is read from device tensors, every host
    value (betas, eps, weight decay) is a constant of the optimizer. Same arithmetic as
    ``_update_plain``, in the same order, except that lr scales the update before it is
    subtracted (lr r u instead of lr (r u): a rounding difference only)."""
    for lr, (beta1, beta2, eps, wd, bias_correction, group_correction), buckets in work:
        for params, grads, exp_avgs, exp_avg_sqs, steps in buckets:
            torch._foreach_add_(steps, 1.0)
            corrections = None
            if bias_correction:
                # 1 - b^t per tensor on device, in float64 (a float32 b2^t = 0.999 is off by
                # 6e-8, which moves 1 - b2^t = 1e-3 by 6e-5 relative). Each division by its
                # own 0-dim tensor is a per-tensor kernel in eager; compiled, it fuses.
                t = torch.stack(steps).to(torch.float64)
                if group_correction:  # one 0-dim tensor for the list: one multi-tensor kernel
                    t = t.amax()
                    corrections = (1.0 - torch.pow(beta1, t), 1.0 - torch.pow(beta2, t))
                else:
                    corrections = ((1.0 - torch.pow(beta1, t)).unbind(), (1.0 - torch.pow(beta2, t)).unbind())
            updates = _direction(grads, exp_avgs, exp_avg_sqs, beta1, beta2, eps, corrections)
            if wd != 0.0:
                torch._foreach_add_(updates, params, alpha=wd)
                scale = _trust_ratios(params, updates) * lr
                torch._foreach_mul_(updates, scale.unbind())
            else:
                torch._foreach_mul_(updates, lr)
            torch._foreach_sub_(params, updates)


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
    model: nn.Module, cfg: OptimConfig, device_type: str, capturable: bool = False,
    *, compile_backend: str = "inductor",
) -> tuple[torch.optim.Optimizer, str]:
    """The optimizer for ``cfg`` on ``device_type`` ("cpu", "cuda", ...), chosen once.

    Returns ``(optimizer, impl_name)``; ``impl_name`` (e.g. ``lamb:apex-fused``,
    ``lamb:foreach``, ``lamb:foreach-capturable``, ``lamb:compiled``,
    ``adamw:torch-fused``, ``adam:torch-foreach-capturable``) is for the log.

    - ``lamb``: apex ``FusedLAMB`` when ``cfg.impl`` is auto/apex, apex is importable and
      the device is CUDA; else ``Lamb`` above (same arithmetic); ``compiled``: ``Lamb``
      with its update under ``torch.compile`` (``compile_backend``, inductor unless a test
      asks for a cheaper one), a few fused kernels per step.
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
    compares the fused kernels against; ``compiled`` is LAMB's (torch's fused AdamW is
    already one multi-tensor kernel per step: compiling it would buy nothing).
    Parameters must already be on the device.

    ``capturable=True`` (CUDA graph capture of the step, bert/step_graph.py) asks for an
    optimizer whose step keeps every per-step value on the device: step counts and lr are
    tensors (``LambdaLR`` fills the lr tensors in place) and nothing syncs the host. LAMB
    gets ``Lamb(capturable=True)`` (or the compiled one, always capturable); AdamW gets
    torch's ``AdamW(capturable=True)`` with a tensor lr per group (fused or foreach as
    above; torch's capturable foreach runs on CUDA only). apex is never taken then: its
    FusedLAMB counts steps and computes bias corrections on the host (``impl=apex`` with
    ``capturable`` is a ``ConfigError``).

    Under fp16 loss scaling the optimizer only ever sees unscaled float32 gradients (the
    training step unscales before clipping). torch's fused AdamW takes the scaler's inf
    flag on device, so its skipped steps cost no host sync; the others are stepped or not
    by ``GradScaler.step`` after one sync.
    """
    groups = param_groups(model, cfg.weight_decay)
    betas = (cfg.beta1, cfg.beta2)
    on_cuda = device_type == "cuda"

    check_optim_impl(cfg)
    if cfg.impl == "apex" and capturable:
        raise ConfigError("optim.impl: 'apex' keeps its step count and bias corrections on the host: "
                          "not CUDA-graph capturable (use auto, torch or compiled)")
    apex_opt = None
    if cfg.impl in ("auto", "apex") and not capturable:
        apex_opt = _load_apex() if on_cuda else None
        if cfg.impl == "apex" and apex_opt is None:
            why = (
                "apex (with its CUDA extensions) is not importable"
                if on_cuda
                else f"apex's fused optimizers need CUDA, device is {device_type!r}"
            )
            raise ConfigError(f"optim.impl: 'apex' requested but {why}; use 'auto' or 'torch'")

    if cfg.name == "lamb":
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
        per_group = cfg.lamb_bias_correction == "group"
        if cfg.impl == "compiled":
            opt = Lamb(groups, lr=cfg.lr, betas=betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
                       compile_backend=compile_backend, group_correction=per_group)
            return opt, "lamb:compiled"
        opt = Lamb(groups, lr=cfg.lr, betas=betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
                   capturable=capturable, group_correction=per_group)
        return opt, "lamb:foreach-capturable" if capturable else "lamb:foreach"

    if cfg.name in ("adamw", "adam"):
        if apex_opt is not None:
            opt = apex_opt.FusedAdam(
                groups, lr=cfg.lr, betas=betas, eps=cfg.eps, weight_decay=cfg.weight_decay,
                bias_correction=True, adam_w_mode=True,
            )
            return opt, f"{cfg.name}:apex-fused"
        # torch's fused AdamW has CUDA and CPU kernels (one pass per tensor instead of a
        # dozen foreach passes); foreach
        # elsewhere, or when asked for (impl=foreach, the baseline the fused kernel is
        # measured against).
        fused = cfg.impl == "fused" or (device_type in ("cuda", "cpu") and cfg.impl in ("auto", "torch"))
        kind: dict[str, Any] = {"fused": True} if fused else {"foreach": True}
        if capturable:
            if not fused and not on_cuda:
                raise ConfigError(f"optim.impl: torch's capturable foreach AdamW runs on CUDA only, "
                                  f"device is {device_type!r} (use auto, torch or fused)")
            # A tensor lr per group (never one shared tensor: the scheduler fills each
            # group's in place), on the parameters' device; float32: torch's fused kernels
            # read it as a float pointer.
            for g in groups:
                g["lr"] = torch.tensor(cfg.lr, dtype=torch.float32, device=g["params"][0].device)
            kind["capturable"] = True
        opt = torch.optim.AdamW(
            groups, lr=cfg.lr, betas=betas, eps=cfg.eps, weight_decay=cfg.weight_decay, **kind
        )
        name = f"{cfg.name}:torch-{'fused' if fused else 'foreach'}"
        return opt, name + ("-capturable" if capturable else "")

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
