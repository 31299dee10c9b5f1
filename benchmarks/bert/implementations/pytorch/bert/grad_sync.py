"""Gradient synchronisation: DDP communication hooks, chosen once from ``GradSyncConfig``.

Two ways to bound the gradient norm, never both (``config.validate`` enforces it):

closed division (the reference): DDP allreduces (mean) every bucket as backward fills it;
after the allreduce the whole gradient is clipped on its global L2 norm
(``torch.nn.utils.clip_grad_norm_``, foreach). Costs one norm pass over all gradients after
the last bucket arrived; nothing can start before the whole gradient exists.

open division, bucket-wise clipping before the allreduce (Kim et al. 2024): on every rank,
as soon as DDP has filled bucket b (numel n_b, flat local gradient g_b), scale it down to
its threshold t_b and start its allreduce at once:

    g_b <- g_b * min(1, t_b / (||g_b|| + 1e-6))          (local norm, no communication)
    rule "count": t_b = C / sqrt(B)                       (B = number of DDP buckets, or
                                                           grad_sync.bucket_clip_count)
    rule "size":  t_b = C * sqrt(n_b / N)                 (N = sum of n_b)

Both rules satisfy sum_b t_b^2 = C^2, so every rank's clipped local gradient has norm at
most C, and so does the mean (triangle inequality): ||mean_r g_r|| <= C. The bound is
looser than the global clip (each bucket is capped separately, and by its local norm), but
no bucket waits for any other: its allreduce overlaps the rest of backward. B and n_b are
read from DDP, never assumed: DDP starts with one bucket holding every gradient and
rebuilds its buckets (in the order backward produced them) at the second forward; the
layout is read at attach time and once more right after that rebuild (a forward pre-hook
that then removes itself). Each read allocates one zero gradient-sized copy, once.

Communication of a bucket (after the optional clip):
- "none": torch's allreduce hook (divide by world size, sum) on the bucket as is.
- "fp16" / "bf16": our own cast hook (torch's bf16 hook is NCCL-only): divide by world
  size in fp32 (a sum of scaled fp16 gradients overflows where the mean does not), cast
  (allocates half the bucket), allreduce, copy back into the bucket. Error: that dtype's
  rounding of the mean, plus its rounding of the partial sums.
- ``reduce_scale`` > 0 (with "none", "fp16" or "bf16"): multiply by that constant instead of
  dividing by the world size, then sum: the published recipe's reduction (sqrt(22)/4908.98
  per rank, an effective 1/1046.6 at 1,024 ranks where the mean is 1/1024).
- "powersgd": torch's PowerSGD hook (Vogels et al. 2019; open division only, for slow
  networks): each gradient matrix M (n x m) of the bucket is sent as two rank-r factors,
  P = M Q (n x r, allreduced, orthogonalised) and Q = M^T P (m x r, allreduced): r(n+m)
  numbers instead of nm; vectors (biases, LayerNorm) go uncompressed, as do matrices where
  that would not halve the bytes. Error feedback keeps each rank's residual M - P Q^T and
  adds it to the next step's gradient, so nothing is lost, only delayed; warm start reuses
  Q. The first ``powersgd_start_step`` steps use plain allreduce (early gradients change
  too fast to compress). Its state (step count, residuals, P and Q, per rank) goes into
  train-state checkpoints (``GradSync.state_dict``); a resumed run continues with them,
  its first step reduced exactly (see ``PowerSGD``), so not bit for bit.
  On NCCL torch's hook runs as is (its follow-up collectives are queued in order on the
  stream). On gloo a bucket's follow-up collectives start from completion callbacks on
  gloo's threads, racing the next bucket's first one into a different order on each rank
  (observed here as a size-mismatch abort): so on gloo each compressed bucket is finished
  before the hook returns, serialising compressed communication with backward (cheap: it is
  a small fraction of the bytes, which is the point of compressing).

Gradient accumulation: the training loop runs the first k-1 micro-steps under
``DDP.no_sync`` (no hook, gradients add up locally); the hook clips and reduces the
accumulated gradient on the last one.

Mixed precision (loss scaling): pass ``loss_scale``, a callable returning the current scale
(a float or a device tensor: no host sync). The hook sees scaled gradients S*g and clips
them to S*t_b, i.e. clips the unscaled gradient to t_b. A bucket whose norm is not finite is
left untouched (multiplied by 1), so its inf/nan reaches every rank through the allreduce
and the scaler skips the step; clipping never turns an overflow into zeros. In the closed
division the caller unscales before ``after_sync`` clips (GradScaler.unscale_).
"""


import functools
import inspect
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.nn.parallel import DistributedDataParallel as DDP

from . import rng
from .config import GradSyncConfig

EPS = 1e-6  # the same guard torch.nn.utils.clip_grad_norm_ adds to the norm

Comm = Callable[[dist.GradBucket], torch.futures.Future]  # reduces one bucket to its mean
LossScale = Callable[[], "float | torch.Tensor"]


def bucket_thresholds(max_norm: float, numels: list[int], rule: str, count: int = 0) -> list[float]:
    """Per-bucket thresholds t_b with sum_b t_b^2 = max_norm^2 (see the module docstring).

    ``count`` > 0 (rule "count" only) fixes the B of C/sqrt(B) instead of the number of
    buckets, as the published recipe does (22); the sum is then max_norm^2 * len/count.
    """
    if rule == "count":
        return [max_norm / math.sqrt(count or len(numels))] * len(numels)
    if rule == "size":
        total = sum(numels)
        return [max_norm * math.sqrt(n / total) for n in numels]
    raise ValueError(f"unknown bucket threshold rule {rule!r}")


def clip_(tensors: list[torch.Tensor], threshold: "float | torch.Tensor") -> torch.Tensor:
    """Scale ``tensors`` in place so their joint L2 norm is at most ``threshold``.

    Returns the norm before clipping (fp32, on device). No host sync: the coefficient is
    chosen on device. A non-finite norm leaves the tensors as they are (inf/nan must reach
    the loss scaler). Costs one norm kernel per tensor and one multiply.
    """
    if len(tensors) == 1:
        norm = torch.linalg.vector_norm(tensors[0], dtype=torch.float32)
    else:
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float32)))
    coef = torch.clamp(threshold / (norm + EPS), max=1.0)
    coef = torch.where(torch.isfinite(norm), coef, torch.ones_like(coef))
    torch._foreach_mul_(tensors, coef.to(tensors[0].dtype))
    return norm


def _reducer_layout(ddp: DDP) -> list[int]:
    """Numel of each DDP bucket, in bucket-index order, as DDP's reducer holds them now.

    Allocates a zero copy of every bucket (the reducer's only public-ish view of its
    layout); must not run inside a comm hook (the reducer holds its lock there).
    """
    return [b.buffer().numel() for b in ddp.reducer._get_zeros_like_grad_buckets()]


class BucketClip:
    """Bucket-wise clipping state: DDP's bucket layout and each bucket's threshold."""

    def __init__(self, max_norm: float, rule: str, loss_scale: LossScale | None = None, count: int = 0) -> None:
        self.max_norm = max_norm
        self.rule = rule
        self.count = count  # fixed B of rule "count"; 0 = the layout's bucket count
        self.loss_scale: LossScale = loss_scale if loss_scale is not None else (lambda: 1.0)
        self.layout: list[int] = []  # numel per bucket index
        self.thresholds: list[float] = []  # unscaled t_b per bucket index

    def set_layout(self, numels: list[int]) -> None:
        self.layout = list(numels)
        self.thresholds = bucket_thresholds(self.max_norm, self.layout, self.rule, self.count)

    def watch(self, ddp: DDP) -> None:
        """Read DDP's layout now and again right after its one-time bucket rebuild."""
        self.set_layout(_reducer_layout(ddp))
        handle: Any = None

        def after_rebuild(_module: torch.nn.Module, _args: Any) -> None:
            # DDP rebuilds in its own pre-forward, before calling the wrapped module.
            if ddp._has_rebuilt_buckets:
                self.set_layout(_reducer_layout(ddp))
                handle.remove()  # layout is final: no per-forward cost from here on

        handle = ddp.module.register_forward_pre_hook(after_rebuild)

    def __call__(self, bucket: dist.GradBucket) -> torch.Tensor:
        i, buf = bucket.index(), bucket.buffer()
        if i >= len(self.layout) or self.layout[i] != buf.numel():
            raise RuntimeError(f"grad_sync: DDP bucket {i} ({buf.numel()} elements) is not in the layout "
                               f"read from DDP {self.layout}; did DDP rebuild its buckets again?")
        return clip_([buf], self.thresholds[i] * self.loss_scale())


def _allreduce(dtype: torch.dtype | None, scale: float | None, group: dist.ProcessGroup | None,
               bucket: dist.GradBucket) -> torch.futures.Future:
    """Scale the bucket (``scale`` per rank, None = 1/world: the mean), cast it for the wire
    (``dtype``; None = as is) and sum it over the ranks into the bucket."""
    buf = bucket.buffer()
    if scale is None:
        buf.div_(dist.get_world_size(group))  # in the bucket's dtype, before any cast
    else:
        buf.mul_(scale)
    wire = buf if dtype is None else buf.to(dtype)  # the cast allocates (half the bucket)
    fut = dist.all_reduce(wire, group=group, async_op=True).get_future()

    def back(f: torch.futures.Future) -> torch.Tensor:
        if wire is not buf:
            buf.copy_(f.value()[0])
        return buf

    return fut.then(back)


class PowerSGD:
    """torch's PowerSGD hook as a bucket reduction, plus what torch leaves out:

    - in order (gloo): each compressed bucket is completed before the hook returns (see the
      module docstring); plain-allreduce warm-up buckets stay asynchronous;
    - the CUDA RNG: the hook seeds its random initial Q with ``torch.manual_seed`` inside a
      CPU-only ``fork_rng``, which reseeds every CUDA generator identically on every rank
      (the dropout streams would stop differing between ranks); it is saved and put back
      around each bucket's first compressed step (once per bucket per run);
    - ``state_dict`` / ``load_state_dict``: step count, error-feedback residuals, warm-start
      P and Q, and the seed generator, per rank, for train-state checkpoints. The state is
      keyed by bucket index, valid for the layout DDP rebuilds after its first step; a
      resumed process's first step still has DDP's initial layout, so that step is reduced
      exactly (plain allreduce, state untouched) and compression resumes on the next.
    """

    def __init__(self, cfg: GradSyncConfig, group: dist.ProcessGroup | None = None) -> None:
        self.state = powersgd.PowerSGDState(process_group=group, matrix_approximation_rank=cfg.powersgd_rank,
                                            start_powerSGD_iter=cfg.powersgd_start_step, use_error_feedback=True,
                                            warm_start=True, random_seed=0)
        self.in_order = dist.get_backend(group) != "nccl"
        self.group = group
        self.ddp: DDP | None = None  # set by ``attach``: its bucket layout must be final

    def __call__(self, bucket: dist.GradBucket) -> torch.futures.Future:
        st = self.state
        compressing = st.iter >= st.start_powerSGD_iter  # the hook's own branch condition
        if compressing and self.ddp is not None and not self.ddp._has_rebuilt_buckets:
            return default_hooks.allreduce_hook(self.group, bucket)  # resumed: initial layout
        first = compressing and bucket.index() not in st.p_memory_dict
        cuda_rng = torch.cuda.get_rng_state_all() if first and torch.cuda.is_initialized() else None
        fut = powersgd.powerSGD_hook(st, bucket)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        if not (compressing and self.in_order):
            return fut
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(fut.wait())
        return done

    def state_dict(self) -> dict[str, Any]:
        st = self.state
        return {"iter": st.iter,
                "error": {str(k): v for k, v in st.error_dict.items()},
                "p": {str(k): v for k, v in st.p_memory_dict.items()},
                "q": {str(k): v for k, v in st.q_memory_dict.items()},
                "rng": rng.numpy_to_dict(st.rng.get_state())}

    def load_state_dict(self, sd: dict[str, Any], device: torch.device) -> None:
        st = self.state
        st.iter = sd["iter"]
        for key, target in (("error", st.error_dict), ("p", st.p_memory_dict), ("q", st.q_memory_dict)):
            target.clear()
            target.update({int(k): v.to(device) for k, v in sd[key].items()})
        st.rng.set_state(rng.numpy_from_dict(sd["rng"]))


def make_comm(cfg: GradSyncConfig, group: dist.ProcessGroup | None = None) -> Comm:
    """The bucket reduction chosen by ``cfg.compression`` (a function of the bucket)."""
    scale = cfg.reduce_scale or None
    if cfg.compression == "none" and scale is None:
        return functools.partial(default_hooks.allreduce_hook, group)
    if cfg.compression in ("none", "fp16", "bf16"):
        dtype = {"none": None, "fp16": torch.float16, "bf16": torch.bfloat16}[cfg.compression]
        return functools.partial(_allreduce, dtype, scale, group)
    if cfg.compression == "powersgd":
        return PowerSGD(cfg, group)
    raise ValueError(f"unknown grad_sync.compression {cfg.compression!r}")


@dataclass
class HookState:
    comm: Comm
    clip: BucketClip | None = None


def _comm_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    return state.comm(bucket)


def _clip_comm_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    state.clip(bucket)  # type: ignore[misc]  # registered only when clip is set
    return state.comm(bucket)


def attach(ddp: DDP, comm: Comm, clip: BucketClip | None = None) -> HookState:
    """Register the hook on ``ddp``: optional bucket clip, then ``comm``. Once per DDP."""
    state = HookState(comm, clip)
    if clip is not None:
        clip.watch(ddp)
    if isinstance(comm, PowerSGD):
        comm.ddp = ddp
    ddp.register_comm_hook(state, _clip_comm_hook if clip is not None else _comm_hook)
    return state


@dataclass
class GradSync:
    """What ``build`` chose. ``after_sync()`` runs once per step after the last backward."""

    after_sync: Callable[[], Any]
    clip: BucketClip | None  # the bucket-wise clipping state, when the hook clips
    mode: str  # human-readable: "global clip after allreduce", "bucket clip (count) + bf16", ...
    comm: Comm | None = None  # the registered bucket reduction (None: DDP's own allreduce)
    # With build(keep_norm=True) and a global norm to keep (a global clip, or the one-process
    # bucket clip): the last step's gradient norm before clipping, a 0-d fp32 device tensor
    # (bert/curves.py reads it at the progress poll). One scalar copy per step; None otherwise.
    norm: torch.Tensor | None = None

    def state_dict(self) -> dict[str, Any]:
        """Per-rank state a resumed run needs (PowerSGD's); empty for the stateless modes."""
        return self.comm.state_dict() if isinstance(self.comm, PowerSGD) else {}

    def load_state_dict(self, sd: dict[str, Any], device: torch.device) -> None:
        if isinstance(self.comm, PowerSGD):
            if not sd:
                raise ValueError("the checkpoint holds no PowerSGD state (written without grad_sync.compression=powersgd)")
            self.comm.load_state_dict(sd, device)
        elif sd:
            raise ValueError("the checkpoint holds PowerSGD state but grad_sync.compression is not powersgd")


def ddp_bucket_args(cfg: GradSyncConfig) -> tuple[dict[str, Any], str]:
    """DDP's bucket keyword arguments for ``cfg``, chosen once, and a note ("" if none).

    A first bucket smaller than the cap (``first_bucket_mb``) needs DDP's
    ``bucket_cap_mb_list`` (first limit, then the cap for every later bucket); a torch
    without it gets the cap alone, and the note says so (the log's bucket layout shows it).
    """
    if cfg.first_bucket_mb <= 0 or cfg.first_bucket_mb == cfg.bucket_cap_mb:
        return {"bucket_cap_mb": cfg.bucket_cap_mb}, ""
    if "bucket_cap_mb_list" in inspect.signature(DDP.__init__).parameters:
        return {"bucket_cap_mb_list": [cfg.first_bucket_mb, cfg.bucket_cap_mb]}, ""
    return {"bucket_cap_mb": cfg.bucket_cap_mb}, (
        f"grad_sync.first_bucket_mb={cfg.first_bucket_mb:g} ignored: torch {torch.__version__}'s DDP has no "
        f"bucket_cap_mb_list; every bucket is capped at {cfg.bucket_cap_mb:g} MB")


def _noop() -> None:
    return None


def _keeping(clip: Callable[[], torch.Tensor], norm: torch.Tensor) -> Callable[[], None]:
    """``clip``, its returned norm copied into ``norm`` (in place: a CUDA graph replays it)."""
    def after() -> None:
        norm.copy_(clip())
    return after


def build(cfg: GradSyncConfig, ddp: DDP | None, params: Iterable[torch.nn.Parameter], max_grad_norm: float,
          loss_scale: LossScale | None = None, keep_norm: bool = False) -> GradSync:
    """Choose the gradient synchronisation once.

    ``ddp`` is None in a single process: no communication; bucket-wise clipping then sees
    one bucket holding the whole gradient (B = 1, t = C), i.e. the global clip, which is
    also what DDP's own first step does before its bucket rebuild. ``keep_norm``: keep the
    norm before clipping where there is a global one (``GradSync.norm``).
    """
    params = [p for p in params if p.requires_grad]
    norm = torch.zeros((), dtype=torch.float32, device=params[0].device) if keep_norm and params else None
    if cfg.bucket_clip_norm > 0:
        clip = BucketClip(cfg.bucket_clip_norm, cfg.bucket_clip_rule, loss_scale, cfg.bucket_clip_count)
        mode = f"bucket clip ({cfg.bucket_clip_rule}) before allreduce"
        if ddp is None:
            # after_sync runs after scaler.unscale_ (bert.trainer.train_step): true gradients,
            # so the threshold is not scaled here. One bucket: C, or C/sqrt(count) when fixed.
            clip.set_layout([sum(p.numel() for p in params)])

            def one_bucket() -> torch.Tensor:
                return clip_([p.grad for p in params if p.grad is not None], clip.thresholds[0])
            return GradSync(one_bucket if norm is None else _keeping(one_bucket, norm), clip, mode + ", 1 process",
                            norm=norm)
        comm = make_comm(cfg)
        attach(ddp, comm, clip)
        return GradSync(_noop, clip, f"{mode} + {cfg.compression}", comm)
    comm = None
    if ddp is not None and (cfg.compression != "none" or cfg.reduce_scale > 0):
        comm = make_comm(cfg)
        attach(ddp, comm)
    if max_grad_norm > 0:  # closed-division semantics: global norm after the allreduce
        after = functools.partial(torch.nn.utils.clip_grad_norm_, params, max_grad_norm, foreach=True)
        return GradSync(after if norm is None else _keeping(after, norm), None,
                        f"global clip after allreduce + {cfg.compression}", comm, norm)
    return GradSync(_noop, None, f"no clipping + {cfg.compression}", comm)
