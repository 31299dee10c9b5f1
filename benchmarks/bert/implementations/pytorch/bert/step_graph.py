"""The training step, made ready before run_start: warm-up on synthetic batches with the
state put back exactly, and (on CUDA) the step captured as CUDA graphs.

Two costs the timed run should not pay, and what this module does about them:

- **First-step costs.** torch.compile, cuBLAS/cuDNN autotuning, the caching allocator's
  first allocations and CUDA graph capture all happen the first time a shape is seen.
  ``warm_up`` runs ``run.warmup_steps`` full training steps per batch shape on *synthetic*
  batches (random tokens, made here: no training or eval file is touched, which MLPerf
  allows before run_start), then puts the model, optimizer,
  scheduler, loss scaler, gradient-sync state and every RNG back exactly as they were
  (``snapshot``/``restore``), so the timed run starts from the true initial state. The
  caller prints the time it took, outside the timed region. ``bert.evaluate.warm_up_eval``
  does the same for evaluation.
- **Launch overhead.** An eager BERT-Large step issues thousands of small kernels; at local
  batch 16 on an H200 the GPU waits on the host. ``GraphedStep`` replays the step as CUDA
  graphs: one graph of forward + backward per batch shape (a micro-batch), and one of the
  rest (unscale, clip, optimizer step, zeroing the gradients). Graphs need static shapes:
  ``data.token_budgets`` pads every micro-batch's token count to one of a few budgets
  (bert/budget.py), so there are a few shapes, each captured once during the warm-up.

What graph capture requires, and where it is checked (``bert.config.check_cuda_graphs``): CUDA; one process (DDP's
reducer and our comm hooks are not captured here); not fp16 (GradScaler's step syncs the
host to decide whether to skip); a capturable optimizer (step count and learning rate on
the device: ``build_optimizer(..., capturable=True)``; the scheduler fills the learning-rate
tensors in place); static batch shapes (``data.token_budgets``). Inside a
captured step nothing may sync the host, and dropout draws its random numbers from torch's
CUDA generator, whose Philox offset a replay advances, so every replay draws fresh masks.

Gradients are persistent in graph mode: allocated once before capture (outside the graphs'
memory pool), accumulated in place by backward (AccumulateGrad adds into an existing
``.grad``), read by the optimizer graph and zeroed in place at its end. A batch whose shape
was not captured runs its forward + backward eagerly into the same gradients (correct,
slower; noted once per shape). ``bert.evaluate.GraphedEval`` captures evaluation the same
way with ``CudaGraphs``.

Compiles: with ``model.compile_layers`` (one ``dynamic=True`` compile of the encoder
layer, shared by its 24 instances) a run compiles the training step once and evaluation
once, both during these warm-ups; ``compile_seconds`` reads dynamo's own clock, so the
caller can report the compile apart from the warm-up and the capture.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import random
import time
from typing import Any, Callable, Iterator

import numpy as np
import torch

from .config import ConfigError
from .batches import LABEL_KEYS, to_device
from .model import pretraining_loss
from .state import Learner

# Eager forward + backward passes on a side stream before each capture: the first use of
# a cuBLAS handle, of autograd's engine and of each allocation size must not be recorded
# (torch's documented warm-up for whole-network capture). Three, as torch's examples use.
CAPTURE_WARMUP_ITERS = 3

log = logging.getLogger(__name__)
# A training step: (micro-batches, micro-batches per optimizer step) -> (mean loss, skipped),
# both on the device (bert.trainer.train_step, GraphedStep).
Step = Callable[[Iterator[dict], int], tuple[torch.Tensor, Any]]


def shape_key(batch: dict) -> tuple:
    """What a captured graph is specialised to: every tensor's shape and dtype, and the
    Python ints (max_seqlen) the model reads."""
    return tuple(sorted((k, tuple(v.shape), str(v.dtype)) if torch.is_tensor(v) else (k, v)
                        for k, v in batch.items()))


# ---------------------------------------------------------------- exact state put back


@dataclasses.dataclass
class Snapshot:
    """Copies of everything a training step changes (see ``snapshot``)."""

    model: dict[str, torch.Tensor]
    groups: list[dict[str, Any]]  # each param group's settings (lr, apex's group step), 'params' left out
    state: list[dict[str, Any] | None]  # per parameter, in group order: its optimizer state, or None
    scheduler: dict[str, Any]
    scaler: dict[str, Any]
    grad_sync: dict[str, Any]
    rng: tuple


def _clone(v: Any) -> Any:
    return v.detach().clone() if torch.is_tensor(v) else copy.deepcopy(v)


def _params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in opt.param_groups for p in g["params"]]


def snapshot(learner: Learner) -> Snapshot:
    """Copy the train state (one extra copy of weights and optimizer state in memory, freed
    after ``restore``)."""
    opt = learner.optimizer
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    return Snapshot(
        model={k: v.detach().clone() for k, v in learner.model.state_dict().items()},
        groups=[{k: _clone(v) for k, v in g.items() if k != "params"} for g in opt.param_groups],
        state=[({k: _clone(v) for k, v in opt.state[p].items()} if p in opt.state else None) for p in _params(opt)],
        scheduler=copy.deepcopy(learner.scheduler.state_dict()),
        scaler=copy.deepcopy(learner.scaler.state_dict()),
        grad_sync=copy.deepcopy(learner.grad_sync.state_dict()),
        rng=(random.getstate(), np.random.get_state(), torch.get_rng_state(),
             torch.cuda.get_rng_state_all() if cuda else None),
    )


def _put(container: dict, key: str, value: Any) -> None:
    """Write ``value`` into ``container[key]`` in place when both are tensors (a captured
    graph holds the old tensor's address), else replace it."""
    old = container.get(key)
    if torch.is_tensor(old) and torch.is_tensor(value):
        old.copy_(value)
    elif torch.is_tensor(old):
        old.fill_(value)
    else:
        container[key] = _clone(value)


def restore(learner: Learner, snap: Snapshot) -> None:
    """Put back what ``snapshot`` copied, in place: tensors keep their storage (captured
    graphs read and write those addresses).

    Optimizer state that the warm-up created (a fresh run has none) is zeroed instead of
    deleted: zero moments and step 0 are exactly the state a lazily initialised Adam or LAMB
    starts from (its first update is then bit-for-bit the same), and the tensors a graph
    captured stay valid. Gradients are zeroed in place when persistent, else dropped.
    """
    with torch.no_grad():
        current = learner.model.state_dict()
        for k, v in snap.model.items():
            current[k].copy_(v)
        opt = learner.optimizer
        for group, saved in zip(opt.param_groups, snap.groups):
            for k, v in saved.items():
                _put(group, k, v)
        for p, saved in zip(_params(opt), snap.state):
            state = opt.state.get(p)
            if state is None:
                continue
            if saved is None:
                for k, v in state.items():
                    if torch.is_tensor(v):
                        v.zero_()
                    elif isinstance(v, (int, float)) and not isinstance(v, bool):
                        state[k] = type(v)(0)
            else:
                for k, v in saved.items():
                    _put(state, k, v)
    learner.scheduler.load_state_dict(snap.scheduler)
    learner.scaler.load_state_dict(snap.scaler)  # fills its scale tensor in place
    if snap.grad_sync:
        learner.grad_sync.load_state_dict(snap.grad_sync, learner.device)
    random.setstate(snap.rng[0])
    np.random.set_state(snap.rng[1])
    torch.set_rng_state(snap.rng[2])
    if snap.rng[3] is not None:
        torch.cuda.set_rng_state_all(snap.rng[3])


# ---------------------------------------------------------------- the graphed step


class CudaGraphs:
    """Capture with ``torch.cuda.CUDAGraph``; every graph of the step shares one memory pool
    (they never run concurrently, and what outlives a replay -- the losses, the gradients --
    is allocated outside the pool or held alive), so N shapes cost about one step's
    activations, not N."""

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, fn: Callable[[], None]) -> Callable[[], None]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(CAPTURE_WARMUP_ITERS):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            fn()
        return graph.replay


def note_uncaptured(seen: set[tuple], key: tuple, what: str, runs: str) -> None:
    """Say once per shape that it was not captured (it then runs eagerly)."""
    if key not in seen:
        seen.add(key)
        log.info(f"note: {what} {dict((k[0], k[1]) for k in key)} was not captured in the warm-up: "
                 f"{runs} eagerly (correct, slower)")


class GraphedStep:
    """``bert.trainer.train_step`` as CUDA graphs (see the module docstring), bound to its
    ``learner`` as the trainer binds the eager one: ``step(batches, accum)`` gives the same
    result, ``(mean loss over the micro-batches, skipped)``, with skipped always 0
    (fp16 is refused). ``graphs`` does the capturing (``CudaGraphs``; tests pass a stand-in
    that calls the captured function on every replay, which checks everything here except
    CUDA's own recording). ``capture(batch)`` prepares a shape; ``__call__`` replays."""

    def __init__(self, learner: Learner, accum: int, precision: str, graphs: Any) -> None:
        self.learner, self.accum, self.graphs = learner, accum, graphs
        # Autocast's weight-cast cache must be off under capture: a cached cast made in one
        # replay would be stale in the next (torch's rule for autocast + graphs). The same
        # factory as the eager warm-up steps' (bert.trainer.build_learner makes it uncached for
        # a graphed run): a different cache setting there would be a recompile at capture.
        self.autocast = learner.precision.train_autocast
        if uncached_autocast_required(precision) and _autocast_cache(self.autocast) is not False:
            raise ConfigError("run.cuda_graphs: the training autocast caches weight casts; build the precision "
                              "with build_precision(..., autocast_cache=False) (bert.trainer.build_learner does)")
        self.params = [p for p in learner.model.parameters() if p.requires_grad]
        with torch.no_grad():
            for p in self.params:  # persistent, outside any graph pool; zeroed in place
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                else:
                    p.grad.zero_()
        self.grads = [p.grad for p in self.params]
        self.micro: dict[tuple, tuple[Callable[[], None], dict, torch.Tensor]] = {}
        self.eager_shapes: set[tuple] = set()
        self.finish = graphs.capture(self._finish)

    def _forward_backward(self, batch: dict, loss_out: torch.Tensor) -> None:
        inputs = {k: v for k, v in batch.items() if k not in LABEL_KEYS}
        with self.autocast():
            mlm, nsp = self.learner.model(**inputs)
            loss = pretraining_loss(mlm, nsp, batch["mlm_labels"], batch["nsp_labels"]) / self.accum
        loss.backward()  # into the persistent .grad tensors, in place
        loss_out.copy_(loss.detach())

    def _finish(self) -> None:
        self.learner.grad_sync.after_sync()  # global clip (or the 1-process bucket clip): no host sync
        self.learner.optimizer.step()  # capturable: step count and lr read from device tensors
        torch._foreach_zero_(self.grads)

    def capture(self, batch: dict) -> tuple:
        """Capture forward + backward for ``batch``'s shape (its values seed the static
        inputs). Runs the side-stream warm-up passes, which add into the gradients: the
        caller zeroes them (``warm_up`` restores the whole state afterwards)."""
        key = shape_key(batch)
        if key not in self.micro:
            static = {k: (v.to(self.learner.device).clone() if torch.is_tensor(v) else v) for k, v in batch.items()}
            loss = torch.zeros((), device=self.learner.device)
            replay = self.graphs.capture(lambda: self._forward_backward(static, loss))
            self.micro[key] = (replay, static, loss)
        return key

    def __call__(self, batches: Iterator[dict], accum: int) -> tuple[torch.Tensor, int]:
        device = self.learner.device
        total = torch.zeros((), device=device)
        for _ in range(accum):
            batch = next(batches)
            key = shape_key(batch)
            entry = self.micro.get(key)
            if entry is None:
                note_uncaptured(self.eager_shapes, key, "batch shape", "its forward + backward run")
                loss = torch.zeros((), device=device)
                self._forward_backward(to_device(batch, device), loss)
            else:
                replay, static, loss = entry
                for k, v in batch.items():
                    if torch.is_tensor(v):
                        static[k].copy_(v, non_blocking=True)
                replay()
            total += loss
        self.finish()
        self.learner.scheduler.step()  # fills the device lr tensors in place: the next replay reads them
        return total, 0


# ---------------------------------------------------------------- choosing and preparing


def capturable(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer reads its step counts and learning rates from device tensors
    (our ``Lamb(capturable=True)``, torch's ``AdamW(capturable=True)`` with tensor lrs, as
    ``bert.optim.build_optimizer(..., capturable=True)`` builds them): what a captured update
    needs, since a Python number would be frozen into the graph at capture."""
    if getattr(optimizer, "capturable", False) is True:  # bert.optim.Lamb
        return True
    return all(g.get("capturable") and torch.is_tensor(g["lr"]) for g in optimizer.param_groups)


def uncached_autocast_required(precision: str) -> bool:
    """Whether a graphed step in ``precision`` runs under autocast (fp32 runs under none)."""
    return precision != "fp32"


def _autocast_cache(factory: Callable[[], Any]) -> bool | None:
    """The ``cache_enabled`` a ``bert.precision`` autocast factory passes (None: not one)."""
    return getattr(factory, "keywords", {}).get("cache_enabled")


def compile_seconds() -> float:
    """Seconds torch.compile has spent compiling in this process so far (dynamo's own
    clock: tracing, AOT autograd and the backend's compile of each frame; a lazily compiled
    backward is counted where dynamo's clock sees it)."""
    metrics = getattr(torch._dynamo.utils, "compilation_time_metrics", {})
    return float(sum(metrics.get("_compile.compile_inner", ())))


def compiled_frames() -> int:
    """Frames torch.compile has compiled in this process so far (a recompile is one more)."""
    return int(torch._dynamo.utils.counters["frames"]["ok"])


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def warm_up(learner: Learner, train_batches: list[dict], step: Step, steps: int, accum: int,
            graphs: Any = None) -> tuple[Step, dict[str, Any]]:
    """Run ``steps`` eager optimizer steps of ``accum`` micro-batches on each batch of
    ``train_batches`` (one per shape), then, with ``graphs``, build the ``GraphedStep`` and
    capture each shape, and restore the state exactly.

    ``step`` is the eager ``bert.trainer.train_step`` bound to ``learner``. The eager steps
    come first: they create the optimizer state that the optimizer graph captures (and
    compile what torch.compile compiles). Returns the step the loop should call (the graphed
    one, or ``step``) and what happened, for the caller to print: ``seconds`` in all, of which
    ``warmup_s`` the eager steps (``compile_s`` of them compiling) and ``capture_s`` the
    captures; ``compiled_frames`` the compiles it caused.
    """
    t0, c0, f0 = time.perf_counter(), compile_seconds(), compiled_frames()
    snap = snapshot(learner)
    for batch in train_batches:
        feed = iter([batch] * steps * accum)
        for _ in range(steps):
            step(feed, accum)
    sync(learner.device)
    t1 = time.perf_counter()
    graphed = None
    if graphs is not None:
        graphed = GraphedStep(learner, accum, learner.precision.train, graphs)
        for batch in train_batches:
            graphed.capture(batch)
    sync(learner.device)
    t2 = time.perf_counter()
    restore(learner, snap)
    if graphed is not None:
        torch._foreach_zero_(graphed.grads)  # the capture warm-ups added into them
    else:
        learner.optimizer.zero_grad()
    info = {"seconds": time.perf_counter() - t0, "warmup_s": t1 - t0, "capture_s": t2 - t1,
            "compile_s": compile_seconds() - c0, "compiled_frames": compiled_frames() - f0,
            "steps": steps * len(train_batches), "shapes": len({shape_key(b) for b in train_batches}),
            "graphs": len(graphed.micro) + 1 if graphed is not None else 0}
    return (graphed if graphed is not None else step), info
