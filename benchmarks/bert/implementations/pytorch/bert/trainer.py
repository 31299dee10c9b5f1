"""The Trainer: every part of a run on ``self``, and the one training loop.

A ``Trainer`` is built in the order MLPerf's clock rules want: ``__init__`` builds the
learner (model and the phase-1 weights, precision, DDP, gradient sync, optimizer, schedule)
and touches no data; ``prepare`` warms up (and captures) the training step and the
evaluation on synthetic batches; ``open_data`` opens the training stream and the eval set,
the run's first touch of the data, after run_start; ``train`` is the loop; ``finish`` the
end. ``run`` does all of it for one timed (or resumed) run; tests and benchmarks call the
pieces.

The loop is the same for the benchmark (``run.mode=mlperf``: masked-LM accuracy, ends at
the target or the sample limit; ``Target``) and for pretraining (``run.mode=pretrain``: the
held-out metrics and curves, ends at the last step; bert/pretrain.py's ``Phase``): the mode
chooses the evaluation and the goal, once, here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from . import checkpoint, distributed, fp8, grad_sync, loader, rng, step_graph, storage
from .batches import split_labels, to_device
from .budget import Layout
from .config import (Config, ConfigError, check_for_device, dumps, eval_interval_samples, global_batch_size,
                     is_benchmark_model, max_samples, read_timeout_s, start_notes)
from .curves import Curves
from .evaluate import held_out_metrics, mlm_accuracy, warm_up_eval
from .exit_status import ExitStatus
from .loader import EvalSet, check_eval_dir
from .mlperf_log import MLPerfLogger, clock_ms, hyperparameters
from .model import BertForPreTraining, pretraining_loss
from .optim import build_optimizer, build_scheduler
from .precision import build_precision, build_scaler, loss_scale
from .pretrain import Phase
from .shards import Bounds, DataError
from .state import Learner, TrainState
from .trace import SampleTrace
from .weights import load_weights, tf_tensor_names

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunFiles:
    """Where a run writes: its MLPerf log, the resolved config beside it, its checkpoints."""

    log: Path
    config: Path
    checkpoints: Path

    @classmethod
    def of(cls, cfg: Config) -> RunFiles:
        log_path = Path(cfg.log.output_dir) / cfg.log.log_file
        return cls(log_path, log_path.with_name(log_path.stem + "_config.json"),
                   checkpoint.checkpoint_dir(cfg.ckpt, cfg.log.output_dir))


# ---------------------------------------------------------------- the step


def train_step(learner: Learner, batches: Iterator[dict], accum: int) -> tuple[torch.Tensor, torch.Tensor | int]:
    """One optimizer step over ``accum`` micro-batches of ``batches``; returns the mean loss
    (on device) and whether fp16 loss scaling skipped the step (see bert.precision)."""
    p = learner
    total = torch.zeros((), device=p.device)
    for i in range(accum):
        inputs, labels = split_labels(to_device(next(batches), p.device))
        # no_sync: the allreduce (and a bucket-wise clip) runs once, on the last micro-step.
        sync = i == accum - 1 or not isinstance(p.train_model, DDP)
        with contextlib.nullcontext() if sync else p.train_model.no_sync():
            with p.precision.train_autocast():  # forward and loss only; backward follows it
                mlm_logits, nsp_logits = p.train_model(**inputs)
                loss = pretraining_loss(mlm_logits, nsp_logits, labels["mlm_labels"], labels["nsp_labels"]) / accum
            p.scaler.scale(loss).backward()
        total += loss.detach()
    p.scaler.unscale_(p.optimizer)  # fp16: true gradients from here on (no-op otherwise)
    p.grad_sync.after_sync()  # closed division: global-norm clip after the allreduce; else nothing
    skipped = p.precision.step(p.scaler, p.optimizer)
    # The schedule advances on a skipped step too: the samples were consumed (no sync).
    p.scheduler.step()
    p.optimizer.zero_grad()  # sets grads to None (torch and apex alike): no memset
    return total, skipped


def _scale_or_one(scaler: torch.amp.GradScaler) -> torch.Tensor | float:
    scale = loss_scale(scaler)  # a device tensor, no sync; None before the first scaled loss
    return 1.0 if scale is None else scale


def build_learner(cfg: Config, world_size: int, device: torch.device) -> tuple[Learner, str]:
    """The model (and the phase-1 weights), precision, DDP, gradient sync, optimizer and
    schedule, and the optimizer implementation's name. Touches no training or eval file."""
    # What CUDA graphs and FP8 GEMMs cannot do on this device and world size, refused by name.
    check_for_device(cfg, device.type, world_size, torch.cuda.get_device_capability if device.type == "cuda" else None)
    # Built on the device (factories and the normal init there): BERT-Large's 335 M
    # parameters are neither initialised on the host nor copied over. The init then draws
    # from the device's generator (seeded like the host's).
    with torch.device(device):
        model = BertForPreTraining(cfg.model, device.type)
    if cfg.run.init_checkpoint:
        # TF phase-1 checkpoint, HF weights or ours; names and shapes checked against cfg.model.
        model.load_state_dict(load_weights(cfg.run.init_checkpoint, cfg.model))
    if cfg.precision.fp8 != "off":
        # Module swap in place, same parameters: before compile and DDP see the layers.
        fp8.convert(model, cfg.precision.fp8, device.type)
    # Before DDP: a comm hook that sees scaled gradients reads precision.loss_scale(scaler).
    # Graphs: autocast's weight-cast cache off everywhere (capture needs it off; the eager
    # warm-up and evaluation must match it, or torch.compile recompiles on the change).
    precision = build_precision(cfg.precision, device.type, autocast_cache=not cfg.run.cuda_graphs)
    scaler = build_scaler(cfg.precision, precision, device.type)
    if cfg.model.compile_layers:
        # Per layer, in place (nn.Module.compile): parameter names and the state dict are
        # unchanged, and DDP wraps the same modules. Compiles on first call, not here: one
        # compile serves all the layers (same code, parameters as inputs). dynamic=True:
        # the token count (each budget rung, each eval batch) and max_seqlen stay symbolic,
        # so training compiles once and evaluation once (no_grad is a guard); the default
        # would compile the first shape static and recompile at the second.
        for layer in model.bert.encoder.layer:
            layer.compile(dynamic=True)
    train_model: torch.nn.Module = model
    if world_size > 1:
        buckets, note = grad_sync.ddp_bucket_args(cfg.grad_sync)
        if note:
            log.info(f"note: {note}")
        train_model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None, **buckets)
    # The bucket-clip hook sees scaled fp16 gradients: its thresholds follow the live scale.
    hook_scale = functools.partial(_scale_or_one, scaler) if scaler.is_enabled() else None
    sync = grad_sync.build(cfg.grad_sync, train_model if isinstance(train_model, DDP) else None,
                           model.parameters(), cfg.optim.max_grad_norm, hook_scale,
                           keep_norm=bool(cfg.log.tensorboard_dir))  # the curves' gradient norm
    # Graphs: step counts and learning rates on the device, read by the optimizer graph.
    optimizer, impl = build_optimizer(model, cfg.optim, device.type, capturable=cfg.run.cuda_graphs)
    scheduler = build_scheduler(optimizer, cfg.optim)
    return Learner(model=model, train_model=train_model, optimizer=optimizer, scheduler=scheduler, scaler=scaler,
                   precision=precision, grad_sync=sync, device=device), impl


def resolve_seed(cfg: Config) -> Config:
    """``cfg`` with its seed decided: run.seed as given, or (-1, unset) a fresh one from the
    OS, drawn by rank 0 and broadcast (one small collective) so every rank uses the same."""
    if cfg.run.seed >= 0:
        return cfg
    seed = distributed.broadcast_object(secrets.randbelow(2**31))
    return dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, seed=seed))


@dataclass
class Data:
    batches: loader.TrainStream  # the training stream, whatever the sampling mode
    eval_batches: list[dict]  # collated once: the eval set never changes
    eval_samples: int  # across all ranks


def open_data(cfg: Config, rank: int, world_size: int, pin: bool = False, timed: bool = True,
              stopped: Callable[[], str | None] | None = None, resume: dict[str, Any] | None = None) -> Data:
    """The training stream and the eval set: the run's first touch of the data (listing,
    manifest, length index, hdf5 opens), so called only after run_start. Reading and
    collating the eval set (10,000 samples, ~1 s) is therefore timed, as the rules want.
    ``pin``: batches in pinned host memory (a CUDA device); ``timed``: a timed run's rules
    apply (the closed division's full eval set); ``stopped()``: why the run must stop now
    (a wait for data ends on it); ``resume``: the training stream a checkpoint saved, continued
    (``loader.train_batches``)."""
    d = cfg.data
    batches = loader.train_batches(data=d, sampler=cfg.sampler, model=cfg.model, plan=train_plan(cfg, world_size, pin),
                                   seed=cfg.run.seed, rank=rank, world_size=world_size, accum=cfg.run.grad_accum_steps,
                                   read_timeout_s=read_timeout_s(cfg), stopped=stopped, resume=resume)
    check_eval_dir(d.train_dir, d.eval_dir)  # never evaluate on training samples
    eval_set = EvalSet(d.eval_dir, rank, world_size, d.eval_samples, d.max_seq_length,
                       bounds=Bounds(cfg.model.vocab_size, cfg.model.type_vocab_size), verify_md5=d.verify_md5,
                       read_timeout_s=read_timeout_s(cfg), stopped=stopped)
    if timed and is_benchmark_model(cfg) and cfg.run.division == "closed" and eval_set.total_samples != 10000:
        raise DataError(f"data.eval_dir={d.eval_dir} holds {eval_set.total_samples} samples; a closed BERT-Large "
                        "run evaluates on the full 10,000-sample eval set: point data.eval_dir (EVALDIR) at it")
    eval_batches = loader.eval_batches(eval_set, eval_plan(cfg, pin))
    return Data(batches, eval_batches, eval_set.total_samples)


def train_plan(cfg: Config, world_size: int, pin: bool = False) -> loader.BatchPlan:
    """How the training samples become batches (the loader's, decided before any data)."""
    return loader.BatchPlan.training(cfg.data, cfg.sampler, cfg.model, local_batch=cfg.run.local_batch_size,
                                     world_size=world_size, pin=pin)


def eval_plan(cfg: Config, pin: bool = False) -> loader.BatchPlan:
    """How the eval samples become batches (token budgets as the run's mode allows)."""
    return loader.BatchPlan.evaluation(cfg.data, cfg.model, batch_size=cfg.eval.batch_size,
                                       budgeted=run_mode(cfg).eval_budgeted, pin=pin)


def train_layout(cfg: Config, world_size: int) -> Layout | None:
    """The training batches' static token budgets (None: off): the shapes the loader makes."""
    return train_plan(cfg, world_size).layout


def eval_layout(cfg: Config) -> Layout | None:
    """The eval batches' (None: off)."""
    return eval_plan(cfg).layout


# ---------------------------------------------------------------- the benchmark's goal


class Target:
    """The benchmark's goal (``run.mode=mlperf``): success when the eval masked-LM accuracy
    reaches ``target``; aborted at the sample limit."""

    def __init__(self, target: float) -> None:
        self.target = target

    def line(self, state: TrainState, metrics: dict[str, float]) -> str:
        return f"eval  @ {state.samples} samples: masked-LM accuracy {metrics['mlm_accuracy']:.4f} (target {self.target})"

    def after_eval(self, state: TrainState, metrics: dict[str, float], train_loss: float, done: bool) -> str | None:
        if metrics["mlm_accuracy"] >= self.target:
            return "success"
        return "aborted" if done else None


# ---------------------------------------------------------------- what run.mode decides, once

Evaluation = Callable[[Learner, list[dict], Any, Callable[[], bool]], "dict[str, float] | None"]


def _mlm_accuracy(p: Learner, batches: list[dict], counts: Any, interrupted: Callable[[], bool]) -> dict | None:
    acc = mlm_accuracy(p.model, batches, p.device, p.precision.eval_autocast, counts, interrupted)
    return None if acc is None else {"mlm_accuracy": acc}


def _held_out(p: Learner, batches: list[dict], _counts: Any, interrupted: Callable[[], bool]) -> dict | None:
    return held_out_metrics(p.model, batches, p.device, p.precision.eval_autocast, interrupted)


@dataclass(frozen=True)
class RunMode:
    """What ``run.mode`` decides (``run_mode``, the one place it is read): the evaluation
    (``evaluate(learner, eval batches, graphed eval counts, interrupted)``; None: Ctrl-C
    reached a rank during it), whether eval batches take token budgets (not the pretraining
    mode's, whose evaluation also scores next-sentence prediction, which a filler sample would
    join), and the goal the loop ends at."""

    evaluate: Evaluation
    eval_budgeted: bool
    goal: Callable[[Config, RunFiles, bool], "Target | Phase"]


def run_mode(cfg: Config) -> RunMode:
    if cfg.run.mode == "pretrain":
        return RunMode(_held_out, False, lambda _cfg, files, is_main: Phase(files.log, is_main))
    return RunMode(_mlm_accuracy, True, lambda c, _files, _is_main: Target(c.eval.target_accuracy))


# ---------------------------------------------------------------- the trainer


class Trainer:
    """One rank's run: the learner, the data, the evaluation and its goal, the checkpointer,
    the MLPerf log and the loop's counters, all on ``self``."""

    def __init__(self, cfg: Config, denv: distributed.DistEnv, device: torch.device,
                 mllog: MLPerfLogger | None = None, stop: checkpoint.StopFlag | None = None) -> None:
        """Everything but the data (which ``open_data`` opens after run_start). ``cfg``'s
        seed is resolved here (a fresh one when unset: a collective); the initial weights are
        drawn from it on every rank, then each rank's generators reseeded with seed + rank
        (distinct dropout streams)."""
        cfg = resolve_seed(cfg)
        self.cfg, self.denv, self.device = cfg, denv, device
        self.mllog = mllog or MLPerfLogger(None, enabled=False, echo=False)
        self.files = RunFiles.of(cfg)
        ws = denv.world_size
        self.global_batch = global_batch_size(cfg, ws)
        self.eval_interval = eval_interval_samples(cfg, ws)
        self.max_samples = max_samples(cfg, ws)
        rng.seed_everything(cfg.run.seed)  # identical initial weights on every rank
        self.learner, self.optimizer_impl = build_learner(cfg, ws, device)
        rng.seed_everything(cfg.run.seed + denv.rank)
        self.state = TrainState(next_eval=self.eval_interval, nonfinite=torch.zeros(2, dtype=torch.int64, device=device),
                                skipped_steps=torch.zeros((), dtype=torch.int64, device=device), seed=cfg.run.seed)
        self.checkpointer = checkpoint.Checkpointer(
            cfg=cfg.ckpt, directory=self.files.checkpoints, rank=denv.rank, world_size=ws, device=device,
            global_batch=self.global_batch, stop=stop or checkpoint.StopFlag(), pending=self._log_failure,
            max_nonfinite_steps=cfg.run.max_nonfinite_steps, settings=dumps(cfg))
        self.mode = run_mode(cfg)
        self.goal = self.mode.goal(cfg, self.files, denv.is_main)
        # What the loop calls: the eager step, or its graphed twin once ``prepare`` captured it.
        self.step: step_graph.Step = functools.partial(train_step, self.learner)
        self.eval_counts: Callable[[dict], tuple[torch.Tensor, torch.Tensor]] | None = None  # graphed eval
        self.batches: loader.TrainStream | None = None  # the training stream (open_data)
        self.eval_batches: list[dict] = []  # collated once (open_data): the eval set never changes
        self.eval_samples = 0  # across all ranks
        self._loader_state: dict[str, Any] | None = None  # a resumed stream's position, for open_data
        self._resumed_from: Path | None = None  # the checkpoint it came from
        self.curves: Curves | None = None  # TensorBoard (log.tensorboard_dir), opened by ``train``
        self.trace: SampleTrace | None = None  # the sample trace (log.sample_trace), opened by ``train``
        self.last_eval: dict[str, float] = {}  # the newest evaluation's metrics (the finished mark records them)

    @property
    def precision_hyperparameters(self) -> dict[str, Any]:
        return self.learner.precision.hyperparameters(self.cfg.precision)

    def restore(self, path: Path) -> None:
        """Continue from checkpoint ``path``: the learner, the counters and this rank's RNG
        now; the data stream's position once ``open_data`` opens it. The checkpointed run's
        seed replaces this one's (it decides the data order)."""
        s = self.state
        restored = checkpoint.restore(path, self.learner, s, self.denv.rank, self.denv.world_size, self.global_batch)
        self._loader_state = restored.stream
        self._resumed_from = path
        if restored.world_size != self.denv.world_size:
            log.info(f"resuming a run of {checkpoint.ranks(restored.world_size)} on {self.denv.world_size}: its global batch "
                     f"{self.global_batch} kept, the data stream continued (docs/faults.md says what each sampling "
                     f"road keeps); " + "; ".join(restored.reset))
        s.nonfinite = s.nonfinite.to(self.device)
        if s.seed != self.cfg.run.seed:
            log.info(f"resuming: run.seed {s.seed} of the checkpointed run replaces {self.cfg.run.seed}")
            self.cfg = dataclasses.replace(self.cfg, run=dataclasses.replace(self.cfg.run, seed=s.seed))
            self.checkpointer.settings = dumps(self.cfg)  # the seed the checkpoints continue with

    def prepare(self) -> None:
        """Before run_start: ``prepare_step``, then ``prepare_eval``. Touches no data file;
        the time is printed, not timed."""
        self.prepare_step()
        self.prepare_eval()

    def prepare_step(self) -> None:
        """With ``run.warmup_steps``: the training step warmed up on synthetic batches, one
        per shape the loader will produce (and with ``run.cuda_graphs`` captured per shape,
        ``self.step`` then the graphed step), the state put back exactly (bert/step_graph.py)."""
        cfg, r = self.cfg, self.cfg.run
        if r.warmup_steps == 0:
            return
        batches = train_plan(cfg, self.denv.world_size).warmup_batches(r.seed)  # the shapes the loader makes
        graphs = None
        if r.cuda_graphs:
            if not step_graph.capturable(self.learner.optimizer):  # build_learner asks for one; a safety net
                raise ConfigError("run.cuda_graphs: the optimizer keeps its step count or learning rate on "
                                  "the host; it must be built with build_optimizer(..., capturable=True)")
            graphs = step_graph.CudaGraphs()
        self.step, info = step_graph.warm_up(self.learner, batches, self.step, r.warmup_steps, r.grad_accum_steps,
                                             graphs)
        log.info(f"warm-up before run_start: {info['steps']} steps on synthetic batches ({info['shapes']} shape(s)), "
                 f"{info['graphs']} CUDA graph(s) captured, {info['seconds']:.3f} s (compile {info['compile_s']:.3f} "
                 f"s, capture {info['capture_s']:.3f} s); model, optimizer, schedule and RNG restored")

    def prepare_eval(self) -> None:
        """With ``run.warmup_steps``: one no-grad forward per eval shape on synthetic batches
        (its compile paid here), and with ``run.cuda_graphs`` each shape captured
        (``self.eval_counts``, bert/evaluate.py)."""
        if self.cfg.run.warmup_steps == 0:
            return
        r, learner = self.cfg.run, self.learner
        self.eval_counts, info = warm_up_eval(learner.model, learner.precision.eval_autocast, learner.device,
                                              self.eval_warmup_batches(), step_graph.CudaGraphs() if r.cuda_graphs
                                              else None)
        log.info(f"eval warm-up before run_start: {info['shapes']} shape(s), {info['graphs']} CUDA graph(s) "
                 f"captured, {info['seconds']:.3f} s (compile {info['compile_s']:.3f} s)")

    def eval_warmup_batches(self) -> list[dict]:
        """Synthetic eval batches, one per shape evaluation will see: each eval budget rung
        filled exactly (``budget.eval_layout_for``), or one typical batch (half the grid)
        without budgets, where every eval batch has its own shape."""
        return eval_plan(self.cfg).warmup_batches(self.cfg.run.seed)

    def open_data(self, timed: bool = True) -> None:
        """The training stream and the eval set (``open_data``), after run_start; a resumed
        stream continues where its checkpoint left it."""
        try:
            data = open_data(self.cfg, self.denv.rank, self.denv.world_size, pin=self.device.type == "cuda",
                             timed=timed, stopped=self.checkpointer.stop.reason, resume=self._loader_state)
        except loader.ResumeRefused as e:  # not this checkpoint's data: nothing trained on the wrong stream
            raise checkpoint.CheckpointError(
                f"{self._resumed_from}: a resume continues the checkpointed run, but {e}. Point data.train_dir "
                "(DATADIR) at the data that run trained on, with its sampler settings, or start a fresh run with "
                "another ckpt.dir and log.output_dir") from None
        self.batches, self.eval_batches, self.eval_samples = data.batches, data.eval_batches, data.eval_samples

    def evaluate(self, interrupted: Callable[[], bool] = lambda: False) -> dict[str, float] | None:
        """The mode's evaluation over the eval set (None: Ctrl-C reached a rank during it)."""
        return self.mode.evaluate(self.learner, self.eval_batches, self.eval_counts, interrupted)

    # ------------------------------------------------------------ the loop

    def train(self) -> str:
        """The loop, until the goal, the sample limit or a stop the ranks agreed on; returns
        the run_stop status ("success", "aborted") or why it stopped ("preempted",
        "interrupted", "diverged": a NaN/inf streak, or NaN/inf state at a checkpoint)."""
        cfg, s, mllog = self.cfg, self.state, self.mllog
        ended = self._before_the_loop()
        if ended:
            return ended
        last_t, last_samples = time.perf_counter(), s.samples
        # The open block's first sample count (its block_stop repeats it) and when it began:
        # the throughput logged at each eval is over the block's training time, evals excluded.
        block_first, block_t = s.samples, last_t
        mllog.block_start(s.samples, self.eval_interval)
        while True:
            loss, skipped = self.step(self.batches, cfg.run.grad_accum_steps)
            s.advance(loss, skipped, self.global_batch)
            if s.step % cfg.log.progress_interval_steps == 0:
                now = time.perf_counter()
                self._progress(loss, (s.samples - last_samples) / (now - last_t))
                last_t, last_samples = now, s.samples
            done = s.samples >= self.max_samples
            if s.samples >= s.next_eval or done:
                mllog.throughput((s.samples - block_first) / (time.perf_counter() - block_t), s.samples)
                mllog.block_stop(block_first, s.samples)
                status = self._evaluate(loss, done)
                if status:
                    return status
                mllog.block_start(s.samples, self.eval_interval)
                last_t, last_samples = time.perf_counter(), s.samples  # the eval's time is not training throughput
                block_first, block_t = s.samples, last_t
            stop = self.checkpointer.at_boundary(self.learner, s, self.batches)  # after the eval: never repeated
            if stop:
                return stop

    def _before_the_loop(self) -> str | None:
        """The outputs that follow every step, from this run's first (the sample trace, on the
        loader itself: it names each batch's samples; the curves), and what a resume decides
        before it trains: at or past this run's end (the checkpoint of its last step, its
        outputs not all written; or a limit lowered) no step is trained and its evaluation
        decides (that status returned); a finished run continued (--resume past its end) is
        unfinished again from here on."""
        cfg, s = self.cfg, self.state
        if cfg.log.sample_trace and self.trace is None:
            self.trace = SampleTrace(self.batches, cfg.log.sample_trace, rank=self.denv.rank,
                                     world_size=self.denv.world_size, accum=cfg.run.grad_accum_steps, step=s.step)
            self.batches = self.trace
        if cfg.log.tensorboard_dir and self.curves is None:  # from this run's first step: a resume continues
            self.curves = Curves(cfg.log.tensorboard_dir, model=cfg.model, rank=self.denv.rank,
                                 world_size=self.denv.world_size, accum=cfg.run.grad_accum_steps,
                                 peak_flops_per_s=cfg.log.peak_flops_per_s, start_step=s.step,
                                 start_samples=s.samples)
            self.batches = self.curves.count(self.batches)
        if self._resumed_from is None:
            return None
        if s.samples >= self.max_samples:
            log.info(f"resumed at step {s.step}, at or past this run's end ({self.max_samples} samples): "
                     "no step trained")
            return self._evaluate(torch.full((), float("nan")), done=True) or "aborted"
        failure = storage.attempt("the finished mark", self.files.checkpoints / checkpoint.FINISHED, "ckpt.dir",
                                  lambda: checkpoint.reopen(self.files.checkpoints)) if self.denv.is_main else None
        storage.check(failure, self.device)  # one small collective, once per resume
        return None

    def _progress(self, loss: torch.Tensor, rate: float) -> None:
        """The progress line (the NaN guard is the checkpoint poll's: every rank agrees there)."""
        s, p = self.state, self.learner
        # One host sync for the device-side counters (and the curves' gradient norm);
        # get_scale() is a second one, fp16 only.
        norm = p.grad_sync.norm if self.curves is not None else None
        value, streak, skipped, *grad_norm = torch.stack(
            [loss.double(), s.nonfinite[1].double(), torch.as_tensor(s.skipped_steps, device=loss.device).double()]
            + ([norm.double()] if norm is not None else [])
        ).tolist()
        lr, scale = p.scheduler.get_last_lr()[0], p.scaler.get_scale()
        log.info(f"step {s.step:6d} | samples {s.samples:9d} | loss {value:7.4f} | "
                 f"lr {lr:.3e} | skipped {int(skipped)} | "
                 f"scale {scale:.0f} | {rate:8.1f} samples/s"
                 + (f" | NaN/inf loss {int(streak)} steps in a row" if streak else ""))
        if self.curves is not None:  # every rank: the token counts are gathered here
            values = {"loss": value, "learning_rate": lr, "loss_scale": scale, "skipped_steps": skipped}
            self.curves.progress(s.step, values | ({"grad_norm": grad_norm[0]} if grad_norm else {}), rate)

    def _evaluate(self, loss: torch.Tensor, done: bool) -> str | None:
        """One evaluation, logged; what the goal makes of it (None: go on)."""
        s, mllog = self.state, self.mllog
        mllog.eval_start(s.samples)
        metrics = self.evaluate(lambda: self.checkpointer.stop.interrupted)
        if metrics is None:  # Ctrl-C during the evaluation: every rank stops here, nothing saved
            return "interrupted"
        mllog.eval_stop(s.samples)
        mllog.eval_accuracy(metrics["mlm_accuracy"], s.samples)
        for k, v in metrics.items():  # own keys: never a dict holding "eval_accuracy" (RCP checker)
            if k != "mlm_accuracy":
                mllog.event(f"eval_{k}", v, epoch_num=s.samples)
        mllog.skipped_steps(int(s.skipped_steps), s.samples)  # a sync; the eval had one
        log.info(self.goal.line(s, metrics))
        self.last_eval = metrics
        if self.curves is not None:
            self.curves.evaluate(s.step, s.samples, metrics)
        status = self.goal.after_eval(s, metrics, float(loss), done)
        while s.next_eval <= s.samples:
            s.next_eval += self.eval_interval
        return status

    # ------------------------------------------------------------ one run, start to end

    def run(self, start_from: Path | None, dry_run: bool = False) -> ExitStatus:
        """A run from here: resume ``start_from`` (None: fresh), log the run's facts, write
        the resolved config, warm up, run_start, open the data, train, finish."""
        cfg, denv, mllog = self.cfg, self.denv, self.mllog
        if start_from is not None:
            self.restore(start_from)
            cfg = self.cfg
        mllog.submission(cfg.run.division, cfg.log.submitter, cfg.log.platform or cfg.log.system, cfg.log.status)
        prec_hp = self.precision_hyperparameters
        mllog.hyperparameters(hyperparameters(cfg.optim, cfg.grad_sync, cfg.data, cfg.run, world_size=denv.world_size,
                                              global_batch=self.global_batch, optimizer_impl=self.optimizer_impl,
                                              precision=prec_hp))
        if cfg.log.compat and cfg.run.init_checkpoint:  # the tensors loaded, by their TF checkpoint names
            mllog.weights_initialization(tf_tensor_names(cfg.model))
        if start_from is not None:
            # Not an MLPerf key (the checker ignores unknown keys); says this log is not one timed run.
            mllog.event("resumed_from_checkpoint", str(start_from), step=self.state.step,
                        samples_count=self.state.samples)
            log.info(f"resumed from {start_from} at step {self.state.step}, {self.state.samples} samples")
        try:
            failure = None
            if denv.is_main:
                text = dumps(cfg, {"world_size": denv.world_size, "launcher": denv.launcher, "device": str(self.device),
                                   "optimizer_impl": self.optimizer_impl, "global_batch_size": self.global_batch,
                                   "eval_interval_samples": self.eval_interval, "max_samples": self.max_samples,
                                   "resumed_from": str(start_from or ""), **prec_hp})
                failure = storage.attempt("the resolved config", self.files.config, "log.output_dir",
                                          lambda: storage.write_text(self.files.config, text))
            storage.check(failure or self._log_failure(), self.device)  # one small collective, before run_start
            log.info(f"bert: {denv.world_size} rank(s) via {denv.launcher} on {self.device}; optimizer "
                     f"{self.optimizer_impl}; precision {self.learner.precision.train} (eval "
                     f"{self.learner.precision.eval}, loss scaling {prec_hp['loss_scaling']}); activation "
                     f"{cfg.model.activation}; global batch {self.global_batch}; eval every {self.eval_interval} "
                     f"samples; abort after {self.max_samples}")
            for note in start_notes(cfg, denv.world_size):
                log.info(f"note: {note}")
            if dry_run:
                self.open_data(timed=False)  # not timed: reading the data checks it
                return ExitStatus.SUCCESS
            self.prepare()  # warm-up (and graph capture) on synthetic batches
            mllog.init_stop()
            mllog.run_start()
            self.open_data()  # the clock runs: only now is the data touched
            return self.finish(self.train())
        except Exception:  # a failed write, bad input, a dead peer: the log ends with the run's end
            if not mllog.stopped:  # as far as the log can still be written
                mllog.run_stop("aborted", self.state.samples, self.eval_samples)
            raise

    def finish(self, status: str) -> ExitStatus:
        """The run's end: its last log lines, a checkpoint of its last step where its limit
        ended it (``_checkpoints_its_end``), the final outputs (rank 0), the line a person
        reads, the exit status."""
        s, mllog, ckpt = self.state, self.mllog, self.checkpointer
        stopped_ms = clock_ms()  # run_stop's time: the final outputs below are written after it, untimed
        if self.curves is not None:
            self.curves.close()
        if self.trace is not None:
            self.trace.close()
        total_nonfinite = int(s.nonfinite[0])  # host sync, once
        mllog.event("nonfinite_loss_steps", total_nonfinite)  # not an MLPerf key; skipped/NaN steps
        clip = self.learner.grad_sync.clip
        if clip is not None:  # the layout DDP settled on (after its rebuild) and the thresholds
            mllog.event("grad_sync_bucket_thresholds", clip.thresholds, bucket_numels=clip.layout)
        if status in ("success", "aborted") and not checkpoint.agree_finite(self.learner, self.device):  # never NaN weights
            ckpt.diverged = f"the weights or optimizer state hold NaN/inf at the end, step {s.step}"
            status = "diverged"
        if status == "diverged":  # every checkpoint here was written from finite state (at_boundary)
            mllog.run_stop("aborted", s.samples, self.eval_samples)
            found = checkpoint.complete_checkpoints(self.files.checkpoints)
            kept = (f"the newest finite checkpoint, {found[-1].name}, is kept: the same command resumes from it, and "
                    "repeats the divergence if the settings caused it (not if a fault did, e.g. a bad GPU)"
                    if found else "there is no checkpoint to resume")
            log.info(f"diverged: {ckpt.diverged}: ending the run; no checkpoint and no final weights written from "
                     f"it; {kept}. Other settings (a lower optim.lr): a fresh run, with another ckpt.dir and "
                     "log.output_dir")
            return ExitStatus.DIVERGED
        if status in ("preempted", "interrupted"):
            mllog.run_stop("aborted", s.samples, self.eval_samples)
            saved = ckpt.stop_checkpoint
            if status == "preempted":
                log.info(f"stopped by signal {ckpt.signum} after step {s.step}: resume from {saved}")
                return ExitStatus.PREEMPTED
            said = f"checkpoint {saved} written: rerun the same command to resume" if saved else "nothing saved"
            found = checkpoint.complete_checkpoints(self.files.checkpoints) if not saved and self.denv.is_main else []
            if found:  # periodic checkpoints: what a rerun continues from
                said += f"; a rerun resumes from {found[-1].name}"
            log.info(f"interrupted (Ctrl-C): stopped at step {s.step}; {said}")
            return ExitStatus.INTERRUPTED
        if self._checkpoints_its_end():  # before the final weights and the mark: nothing trained is lost
            log.info(f"checkpoint {ckpt.save(self.learner, s, self.batches)} (the run's last step)")
        failure = self._save_outputs(status) if self.denv.is_main else None
        storage.check(failure or self._log_failure(), self.device)  # one small collective, after the timed run
        mllog.run_stop(status, s.samples, self.eval_samples, time_ms=stopped_ms)
        log.info(f"run_stop {status} after {s.step} steps, {s.samples} samples, {int(s.skipped_steps)} skipped"
                 + (f"; {total_nonfinite} steps had a NaN/inf loss" if total_nonfinite else ""))
        return ExitStatus.SUCCESS if status == "success" else ExitStatus.NOT_CONVERGED

    def _checkpoints_its_end(self) -> bool:
        """Whether a run that ended (finite) writes a checkpoint at its last step, the same
        answer on every rank: where its limit ended it (a resume there trains nothing:
        ``train``), it checkpoints periodically (ckpt.interval_steps or interval_minutes) and
        has no checkpoint of that step yet. A later --resume to a later limit continues from
        there, not from the last periodic one. A run without periodic checkpoints (a timed
        MLPerf run) pays nothing; with them, one write after run_stop's time. Not at a target
        reached before the limit: a rerun of that run (its final weights unwritten) resuming
        there would train past it; it resumes from the last periodic one and reaches it again."""
        c, s, name = self.cfg.ckpt, self.state, f"step_{self.state.step:09d}"
        have = {p.name for p in self.checkpointer.written} | {self._resumed_from.name if self._resumed_from else ""}
        return s.samples >= self.max_samples and (c.interval_steps > 0 or c.interval_minutes > 0) and name not in have

    def _save_outputs(self, status: str) -> storage.Failure | None:
        """Rank 0, after the timed run: the final weights (run.save_checkpoint), then the mark
        that ends this run's checkpoints; never before the weights are safe, so that a rerun
        after a failed write resumes. Returns what could not be written."""
        if self.cfg.run.save_checkpoint:
            path = Path(self.cfg.run.save_checkpoint)
            failure = storage.attempt("the final weights", path, "run.save_checkpoint",
                                      lambda: save_weights(self.learner.model, path))
            if failure:
                return failure
        directory, s = self.files.checkpoints, self.state
        ended_by = "target" if self.cfg.run.mode == "mlperf" and status == "success" else "limit"
        return storage.attempt("the finished mark", directory / checkpoint.FINISHED, "ckpt.dir",
                               lambda: checkpoint.mark_finished(directory, status=status, step=s.step,
                                                                samples=s.samples, ended_by=ended_by,
                                                                metrics=self.last_eval))

    def _log_failure(self) -> storage.Failure | None:
        """Rank 0's MLPerf log, or this rank's sample trace, when a line could not be written:
        read at every agreement point."""
        err = self.mllog.write_error
        if err:
            return storage.Failure("the MLPerf log", self.files.log, err, "log.output_dir")
        if self.trace is not None and self.trace.write_error is not None:
            return storage.Failure("the sample trace", self.trace.path, self.trace.write_error, "log.sample_trace")
        return None


def save_weights(model: torch.nn.Module, path: str | Path) -> None:
    """Write the state dict atomically: a temp file renamed into place, never a torn file."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    storage.save_torch({k: v.detach().cpu() for k, v in model.state_dict().items()}, Path(path))
