"""Entry point: build the parts from the config, train, evaluate every N samples, stop.

    python -m bert.train [--config FILE] [--dry-run] key.sub=value ...

Exit status: 0 when the eval masked-LM accuracy reached the target (run_stop success),
1 when the sample limit came first or the loss stayed NaN/inf (run_stop aborted), 2 for a
bad configuration, input file or checkpoint, 3 when SIGTERM/SIGUSR1 stopped the run after a
checkpoint (rerun, or ``--resume``, to continue), 4 when a peer rank died or a collective
timed out, 5 when a file could not be written (a checkpoint, the final weights, the resolved
config, the MLPerf log: a full disk, any OSError; every rank says which, and which complete
checkpoint a rerun resumes from; run_stop aborted), 130 when Ctrl-C (SIGINT) stopped it
(run_stop aborted; a second Ctrl-C ends it at once).

``--exit-status-dir DIR`` (what run_and_time.sh passes): each rank writes that status, and
whether it trained, to ``DIR/rank_<R>`` and exits 0 for these expected ends. torchrun turns
any non-zero worker exit into 1 and a ChildFailedError traceback; this way the launcher
script reads the true status and torchrun stays quiet. A crash still exits non-zero.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import random
import secrets
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from . import distributed, fp8, grad_sync, ladder, pretrain, resume, runlock, sampler, step_graph, storage
from .config import (Config, ConfigError, build_config, dumps, eval_interval_samples, global_batch_size,
                     is_benchmark_model, max_samples, parse_overrides, read_timeout_s, timed_run_problems)
from .checkpoint import load_weights, tf_tensor_names
from .data import EvalSet, check_eval_dir
from .mlperf_log import MLPerfLogger, clock_ms, hyperparameters, logged_seed
from .model import BertForPreTraining, pretraining_loss
from .optim import build_optimizer, build_scheduler
from .precision import Precision, build_precision, build_scaler, loss_scale
from .shards import Bounds, DataError

LABEL_KEYS = ("mlm_labels", "nsp_labels")
BAD_INPUT = (ConfigError, DataError, resume.CheckpointError, runlock.InUse, runlock.NoLocks)  # exit 2, no traceback
EXIT_COMM_FAILURE = 4
EXIT_WRITE_FAILED = 5


@dataclass
class TrainState:
    """Everything the loop advances; checkpointed beside the modules (bert/resume.py)."""

    step: int = 0
    samples: int = 0
    next_eval: int = 0
    # [steps with a NaN/inf loss in all, in a row now]: kept on the device so counting
    # costs no host sync; read with the progress line's loss.
    nonfinite: torch.Tensor = field(default_factory=lambda: torch.zeros(2, dtype=torch.int64))
    # fp16 steps skipped for inf/nan gradients: a 0-d int64 on the device, summed without a
    # host sync and read at the progress lines and evaluations.
    skipped_steps: torch.Tensor | int = 0

    def advance(self, loss: torch.Tensor, skipped: torch.Tensor | int, global_batch: int) -> None:
        """Count one optimizer step (both loops): samples, NaN/inf losses, skipped steps."""
        self.step += 1
        self.samples += global_batch
        bad = (~torch.isfinite(loss)).long()  # device-side count: no sync
        self.nonfinite = torch.stack([self.nonfinite[0] + bad, (self.nonfinite[1] + 1) * bad])
        self.skipped_steps += skipped
    # The run's seed (resolve_seed): a resumed run keeps the seed of the run it continues,
    # so its data order is the same one.
    seed: int = -1


@dataclass
class Parts:
    model: torch.nn.Module  # the bare module (eval, checkpoints)
    train_model: torch.nn.Module  # what the loop calls: DDP-wrapped when distributed
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler  # fp16 loss scaling; disabled (no-op calls) otherwise
    precision: Precision
    grad_sync: grad_sync.GradSync  # after_sync(): global clip (closed) or nothing; its bucket layout
    batches: Iterator[dict]
    eval_batches: list[dict]  # collated once, after run_start (open_data): the eval set never changes
    eval_samples: int  # across all ranks
    device: torch.device
    global_batch: int
    eval_interval: int
    max_samples: int
    # (eval batch on the device) -> (correct, labelled): the graphed evaluation of
    # bert/step_graph.py once prepare_eval captured it; None = the eager one.
    eval_counts: Callable[[dict], tuple[torch.Tensor, torch.Tensor]] | None = None


def _to(batch: dict, device: torch.device) -> dict:
    # non_blocking: overlaps the host-to-device copy with compute on GPU; free on CPU.
    return {k: (v.to(device, non_blocking=True) if torch.is_tensor(v) else v) for k, v in batch.items()}


def _split(batch: dict) -> tuple[dict, dict]:
    return {k: v for k, v in batch.items() if k not in LABEL_KEYS}, {k: batch[k] for k in LABEL_KEYS}


def evaluate(model: torch.nn.Module, eval_batches: list[dict], device: torch.device,
             autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
             counts: Callable[[dict], tuple[torch.Tensor, torch.Tensor]] | None = None,
             interrupted: Callable[[], bool] = lambda: False) -> float | None:
    """Masked-LM accuracy over the whole eval set: counts summed across ranks, then divided.
    ``counts`` (``Parts.eval_counts``): the graphed per-batch step, else the eager one. None
    when Ctrl-C reached a rank during it (``interrupted``): that rank stops after its batch,
    and every rank learns it from the sum that ends every evaluation."""
    was_training = model.training
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # correct, count, ranks interrupted
    with torch.no_grad():
        for batch in eval_batches:
            if interrupted():
                totals[2] = 1
                break
            if counts is None:
                correct, count = step_graph.eval_counts(model, _to(batch, device), autocast)
            else:
                correct, count = counts(batch)
            totals[0] += correct
            totals[1] += count
    distributed.all_reduce_sum(totals)
    model.train(was_training)
    correct, count, stopped = totals.tolist()  # sync point, once per evaluation
    if stopped:
        return None
    return correct / count if count else 0.0


def train_step(p: Parts, accum: int) -> tuple[torch.Tensor, torch.Tensor | int]:
    """One optimizer step over ``accum`` micro-batches; returns the mean loss (on device)
    and whether fp16 loss scaling skipped the step (see bert.precision)."""
    total = torch.zeros((), device=p.device)
    for i in range(accum):
        inputs, labels = _split(_to(next(p.batches), p.device))
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


def train(p: Parts, cfg: Config, log: MLPerfLogger, say: Callable[[str], None], s: TrainState,
          ckpt: resume.Checkpointer, step: Callable[[Parts, int], tuple] = train_step) -> tuple[str, TrainState]:
    """The benchmark loop; ``step`` is ``train_step`` or its graphed twin (bert/step_graph.py)."""
    last_t, last_samples = time.perf_counter(), s.samples
    # The open block's first sample count (its block_stop repeats it) and when it began:
    # the throughput logged at each eval is over the block's training time, evals excluded.
    block_first, block_t = s.samples, last_t
    log.block_start(s.samples, p.eval_interval)
    while True:
        loss, skipped = step(p, cfg.run.grad_accum_steps)
        s.advance(loss, skipped, p.global_batch)
        if s.step % cfg.log.progress_interval_steps == 0:
            now = time.perf_counter()
            # One host sync for the device-side counters; get_scale() is a second one, fp16 only.
            value, streak, skipped_n = torch.stack(
                [loss.double(), s.nonfinite[1].double(), torch.as_tensor(s.skipped_steps, device=loss.device).double()]
            ).tolist()
            rate = (s.samples - last_samples) / (now - last_t)
            say(f"step {s.step:6d} | samples {s.samples:9d} | loss {value:7.4f} | "
                f"lr {p.scheduler.get_last_lr()[0]:.3e} | skipped {int(skipped_n)} | "
                f"scale {p.scaler.get_scale():.0f} | {rate:8.1f} samples/s")
            last_t, last_samples = now, s.samples
            if streak >= cfg.run.max_nonfinite_steps:
                say(f"loss NaN/inf for the last {int(streak)} steps (run.max_nonfinite_steps="
                    f"{cfg.run.max_nonfinite_steps}): ending the run")
                return "aborted", s
        if s.samples >= s.next_eval or s.samples >= p.max_samples:
            log.throughput((s.samples - block_first) / (time.perf_counter() - block_t), s.samples)
            log.block_stop(block_first, s.samples)
            log.eval_start(s.samples)
            acc = evaluate(p.model, p.eval_batches, p.device, p.precision.eval_autocast, p.eval_counts,
                           lambda: ckpt.stop.interrupted)
            if acc is None:  # Ctrl-C during the evaluation: every rank stops here, nothing saved
                return "interrupted", s
            log.eval_stop(s.samples)
            log.eval_accuracy(acc, s.samples)
            log.skipped_steps(int(s.skipped_steps), s.samples)  # a sync; the eval had one
            say(f"eval  @ {s.samples} samples: masked-LM accuracy {acc:.4f} (target {cfg.eval.target_accuracy})")
            if acc >= cfg.eval.target_accuracy:
                return "success", s
            if s.samples >= p.max_samples:
                return "aborted", s
            while s.next_eval <= s.samples:
                s.next_eval += p.eval_interval
            log.block_start(s.samples, p.eval_interval)
            last_t = time.perf_counter()  # the eval's time is not training throughput
            block_first, block_t = s.samples, last_t
        stop = ckpt.at_boundary(p, s, say)  # after the eval: a resume continues past it, never repeats it
        if stop:
            return stop, s


def _scale_or_one(scaler: torch.amp.GradScaler) -> torch.Tensor | float:
    scale = loss_scale(scaler)  # a device tensor, no sync; None before the first scaled loss
    return 1.0 if scale is None else scale


def build_model(cfg: Config, denv: distributed.DistEnv, device: torch.device) -> tuple[Parts, str]:
    """Everything but the data: model (and the phase-1 checkpoint), precision, DDP, gradient
    sync, optimizer, schedule. Touches no training or eval file, so it runs before
    run_start; ``open_data`` fills in the batches after it (MLPerf's clock rule)."""
    fp8.check(cfg, device.type)  # what FP8 GEMMs cannot do, refused by name
    # Built on the device (factories and the normal init there): BERT-Large's 335 M
    # parameters are neither initialised on the host nor copied over. The init then draws
    # from the device's generator (seeded by seed_everything like the host's).
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
    if denv.world_size > 1:
        buckets, note = grad_sync.ddp_bucket_args(cfg.grad_sync)
        if note and denv.is_main:
            print(f"note: {note}")
        train_model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None, **buckets)
    # The bucket-clip hook sees scaled fp16 gradients: its thresholds follow the live scale.
    hook_scale = functools.partial(_scale_or_one, scaler) if scaler.is_enabled() else None
    sync = grad_sync.build(cfg.grad_sync, train_model if isinstance(train_model, DDP) else None,
                           model.parameters(), cfg.optim.max_grad_norm, hook_scale)
    step_graph.check(cfg, device, denv.world_size)  # what CUDA graphs cannot do, refused by name
    # Graphs: step counts and learning rates on the device, read by the optimizer graph.
    optimizer, impl = build_optimizer(model, cfg.optim, device.type, capturable=cfg.run.cuda_graphs)
    scheduler = build_scheduler(optimizer, cfg.optim)
    ws = denv.world_size
    parts = Parts(model, train_model, optimizer, scheduler, scaler, precision, sync, iter(()), [], 0, device,
                  global_batch_size(cfg, ws), eval_interval_samples(cfg, ws), max_samples(cfg, ws))
    return parts, impl


def open_data(parts: Parts, cfg: Config, denv: distributed.DistEnv, timed: bool = True) -> Parts:
    """The training stream and the eval set: the run's first touch of the data (listing,
    manifest, length index, hdf5 opens), so called only after run_start. Reading and
    collating the eval set (10,000 samples, ~1 s) is therefore timed, as the rules want."""
    d = cfg.data
    pin = parts.device.type == "cuda"  # pinned host batches: the copies to the device are asynchronous
    batches = sampler.train_batches(cfg, denv.rank, denv.world_size,  # picks the mode once
                                    ladder.layout_for(cfg, denv.world_size), pin=pin)
    check_eval_dir(d.train_dir, d.eval_dir)  # never evaluate on training samples
    eval_set = EvalSet(d.eval_dir, denv.rank, denv.world_size, d.eval_samples, d.max_seq_length,
                       bounds=Bounds(cfg.model.vocab_size, cfg.model.type_vocab_size), verify_md5=d.verify_md5,
                       read_timeout_s=read_timeout_s(cfg))
    if timed and is_benchmark_model(cfg) and cfg.run.division == "closed" and eval_set.total_samples != 10000:
        raise DataError(f"data.eval_dir={d.eval_dir} holds {eval_set.total_samples} samples; a closed BERT-Large "
                        "run evaluates on the full 10,000-sample eval set: point data.eval_dir (EVALDIR) at it")
    eval_batches = sampler.eval_batches(eval_set, cfg.eval.batch_size, cfg.model.unpad, cfg.model.pack,
                                        d.max_seq_length, ladder.eval_layout_for(cfg, denv.world_size), pin=pin)
    return dataclasses.replace(parts, batches=iter(batches), eval_batches=eval_batches,
                               eval_samples=eval_set.total_samples)


def prepare_step(parts: Parts, cfg: Config, world_size: int, say: Callable[[str], None]) -> Callable[[Parts, int], tuple]:
    """The step the loop calls, chosen once: ``train_step``, after ``run.warmup_steps`` steps
    per batch shape on synthetic batches (and, with ``run.cuda_graphs``, the step captured
    per shape), the state then put back exactly (bert/step_graph.py). Before run_start:
    the warm-up touches no data file, and its time is printed, not timed."""
    r, d, m = cfg.run, cfg.data, cfg.model
    if r.warmup_steps == 0:
        return train_step
    layout = ladder.layout_for(cfg, world_size)  # the shapes the loader will produce
    batches = step_graph.synthetic_batches(
        sampler.batch_collate(m.unpad, m.pack, d.max_seq_length, layout), step_graph.warmup_token_counts(cfg, layout),
        r.local_batch_size, d.max_seq_length, d.max_predictions_per_seq, m.vocab_size, seed=r.seed)
    graphs = None
    if r.cuda_graphs:
        if not step_graph.capturable(parts.optimizer):  # build_model asks for one; a safety net
            raise ConfigError("run.cuda_graphs: the optimizer keeps its step count or learning rate on "
                              "the host; it must be built with build_optimizer(..., capturable=True)")
        graphs = step_graph.CudaGraphs()
    step, info = step_graph.warm_up(parts, cfg, batches, train_step, graphs)
    say(f"warm-up before run_start: {info['steps']} steps on synthetic batches ({info['shapes']} shape(s)), "
        f"{info['graphs']} CUDA graph(s) captured, {info['seconds']:.3f} s (compile {info['compile_s']:.3f} s, "
        f"capture {info['capture_s']:.3f} s); model, optimizer, schedule and RNG restored")
    return step


def eval_warmup_batches(cfg: Config, world_size: int) -> list[dict]:
    """Synthetic eval batches, one per shape evaluation will see: each eval budget rung filled
    exactly (``ladder.eval_layout_for``), or one typical batch (half the grid) without
    budgets, where every eval batch has its own shape."""
    d, m, e = cfg.data, cfg.model, cfg.eval
    layout = ladder.eval_layout_for(cfg, world_size)
    counts = list(layout.rungs) if layout is not None else [e.batch_size * d.max_seq_length // 2]
    collate = sampler.batch_collate(m.unpad, m.pack, d.max_seq_length, layout)
    return step_graph.synthetic_batches(collate, counts, e.batch_size, d.max_seq_length, d.max_predictions_per_seq,
                                        m.vocab_size, seed=cfg.run.seed)


def prepare_eval(parts: Parts, cfg: Config, world_size: int, say: Callable[[str], None]) -> Parts:
    """``parts`` with its evaluation made ready before run_start, with ``run.warmup_steps``:
    one no-grad forward per eval shape on synthetic batches (its compile paid here), and
    with ``run.cuda_graphs`` each shape captured (``Parts.eval_counts``). Touches no data."""
    if cfg.run.warmup_steps == 0:
        return parts
    graphs = step_graph.CudaGraphs() if cfg.run.cuda_graphs else None
    counts, info = step_graph.warm_up_eval(parts, eval_warmup_batches(cfg, world_size), graphs)
    say(f"eval warm-up before run_start: {info['shapes']} shape(s), {info['graphs']} CUDA graph(s) captured, "
        f"{info['seconds']:.3f} s (compile {info['compile_s']:.3f} s)")  # ms: a small eval warms in 0.0x s
    return dataclasses.replace(parts, eval_counts=counts)


def resolve_seed(cfg: Config) -> Config:
    """``cfg`` with its seed decided: run.seed as given, or (-1, unset) a fresh one from the
    OS, drawn by rank 0 and broadcast (one small collective) so every rank uses the same."""
    if cfg.run.seed >= 0:
        return cfg
    seed = distributed.broadcast_object(secrets.randbelow(2**31))
    return dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, seed=seed))


def build(cfg: Config, denv: distributed.DistEnv, device: torch.device) -> tuple[Parts, str]:
    """``build_model`` then ``open_data``: every part at once (tests, tools; not a timed run)."""
    cfg = resolve_seed(cfg)
    parts, impl = build_model(cfg, denv, device)
    return open_data(parts, cfg, denv, timed=False), impl


def save_weights(model: torch.nn.Module, path: str | Path) -> None:
    """Write the state dict atomically: a temp file renamed into place, never a torn file."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    storage.save_torch({k: v.detach().cpu() for k, v in model.state_dict().items()}, Path(path))


def save_outputs(cfg: Config, model: torch.nn.Module, ckpt_dir: Path, status: str, step: int) -> storage.Failure | None:
    """Rank 0, after the timed run: the final weights (run.save_checkpoint), then the mark that
    ends this run's checkpoints; never before the weights are safe, so that a rerun after a
    failed write resumes. Returns what could not be written."""
    if cfg.run.save_checkpoint:
        path = Path(cfg.run.save_checkpoint)
        failure = storage.attempt("the final weights", path, "run.save_checkpoint", lambda: save_weights(model, path))
        if failure:
            return failure
    return storage.attempt("the finished mark", ckpt_dir / resume.FINISHED, "ckpt.dir",
                           lambda: resume.mark_finished(ckpt_dir, status, step))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def run(cfg: Config, dry_run: bool = False, pending_signals: Path | None = None) -> int:
    """``pending_signals``: signals the launcher got before this process could catch them
    (resume.StopFlag.installed)."""
    denv = distributed.job_env(cfg.dist)
    device = distributed.device_for(cfg.run.device, denv.local_rank)
    if cfg.run.threads > 0:
        torch.set_num_threads(cfg.run.threads)
    out_dir = Path(cfg.log.output_dir)
    log_path = out_dir / cfg.log.log_file
    ckpt_dir = resume.checkpoint_dir(cfg.ckpt, out_dir)
    # One run per log and checkpoint directory (bert/runlock.py): rank 0 locks them before
    # anything is read or written there; a refusal reaches every rank at the first collective.
    locks: list[runlock.Lock] = []
    refused = None
    if denv.is_main and cfg.run.exclusive:
        try:
            locks, notes = runlock.acquire_run(log_path, ckpt_dir)
        except (runlock.InUse, runlock.NoLocks) as e:
            refused = str(e)
        else:
            for note in notes:
                print(note)
    try:
        start_from = resume.plan(ckpt_dir, cfg.ckpt.resume)  # filesystem only: before the log opens
    except resume.CheckpointError as e:
        distributed.rank_line(f"error: {e}")
        return 2
    # A resumed run appends to the log of the run it continues, so the log shows both parts
    # (and the compliance checker rejects it: a timed result must not be resumed). A refused
    # run never opens it: it is another run's.
    mine = denv.is_main and refused is None
    log = MLPerfLogger(log_path if mine else None, enabled=mine, echo=cfg.log.echo_mllog,
                       append=start_from is not None)
    say = print if denv.is_main else (lambda _msg: None)
    stop = resume.StopFlag()
    peers = distributed.Peers()
    comm_failed = False
    try:
        with stop.installed(cfg.ckpt.on_signal, pending_signals):
            return _run(cfg, denv, device, log, say, log_path, ckpt_dir, start_from, stop, dry_run, refused, peers)
    except BAD_INPUT as e:
        distributed.rank_line(f"error: rank {denv.rank}: {e}")
        # Bad input outranks a dead peer: the others learn what it was, not just that this
        # rank is gone (distributed.Peers), and exit 2 too.
        peers.report(str(e))
        peers.abort()
        peers.linger(cfg.dist.timeout_s + 10)
        comm_failed = peers.store is not None  # the group is aborted: nothing to destroy
        return 2
    except storage.WriteFailed as e:  # every rank, at the same point, with the same text
        distributed.rank_line(f"error: rank {denv.rank} of {denv.world_size}: {e}; "
                              f"{_after_write_failure(e, ckpt_dir)}")
        return EXIT_WRITE_FAILED
    except distributed.ConnectError as e:  # names the addresses and interfaces; not a peer's death
        comm_failed = True
        distributed.rank_line(f"error: {e}")
        return EXIT_COMM_FAILURE
    except Exception as e:
        if denv.world_size == 1 or not distributed.is_comm_failure(e):
            raise
        comm_failed = True  # destroying the group could block on the dead peer: skip it
        bad = peers.reported()
        if bad is not None:  # the peer stopped on bad input: that is what this run ended on
            distributed.rank_line(f"error: rank {denv.rank} of {denv.world_size}: rank {bad[0]} stopped on bad "
                                  f"input: {bad[1]}")
            return 2
        distributed.rank_line(f"error: rank {denv.rank} of {denv.world_size}: a collective failed: another rank "
                              f"died or did not answer within dist.timeout_s={cfg.dist.timeout_s:g} s ({e})")
        return EXIT_COMM_FAILURE
    finally:
        log.close()
        for lock in locks:
            lock.release()
        if not comm_failed:
            distributed.shutdown()


def _after_write_failure(e: storage.WriteFailed, ckpt_dir: Path) -> str:
    """What a rerun continues from, and what to change first."""
    try:
        found = resume.complete_checkpoints(ckpt_dir)
    except OSError:
        found = []
    setting = e.first.setting
    where = f"free space or point {setting} elsewhere" + (" (with that checkpoint copied there)"
                                                         if found and setting == "ckpt.dir" else "")
    if not found:
        return f"no complete checkpoint to resume from; {where}, then rerun the same command"
    return f"the newest complete checkpoint is {found[-1].name}; {where}, then rerun the same command to resume"


def _log_failure(log: MLPerfLogger, path: Path) -> storage.Failure | None:
    """Rank 0's MLPerf log, when a line could not be written: read at every agreement point."""
    err = log.write_error
    return storage.Failure("the MLPerf log", path, err, "log.output_dir") if err else None


def _run(cfg: Config, denv: distributed.DistEnv, device: torch.device, log: MLPerfLogger,
         say: Callable[[str], None], log_path: Path, ckpt_dir: Path, start_from: Path | None,
         stop: resume.StopFlag, dry_run: bool, refused: str | None = None,
         peers: distributed.Peers | None = None) -> int:
    problems = timed_run_problems(cfg)
    if problems and not dry_run:
        raise ConfigError("; ".join(problems))
    log.init_start(cfg.run.cache_cleared)
    distributed.init_process_group(denv, cfg.dist, device, peers)
    # Every rank must pick the same checkpoint; they differ when ckpt.dir is not shared.
    chosen, refused = distributed.broadcast_object((str(start_from), refused))
    if refused:  # rank 0 could not lock the log or the checkpoint directory
        raise runlock.InUse(refused)
    if chosen != str(start_from):
        raise resume.CheckpointError(f"rank {denv.rank} found checkpoint {start_from} but rank 0 found "
                                     f"{chosen}: ckpt.dir={ckpt_dir} must be one shared directory")
    if start_from is None and denv.is_main:
        resume.clear(ckpt_dir)  # a finished run's checkpoints must not mix with this run's
    cfg = resolve_seed(cfg)  # unset: fresh from the OS, the same on every rank; logged below
    seed_everything(cfg.run.seed)  # identical initial weights on every rank
    parts, impl = build_model(cfg, denv, device)  # no data touched before run_start
    seed_everything(cfg.run.seed + denv.rank)  # distinct dropout streams per rank
    state = TrainState(next_eval=parts.eval_interval, skipped_steps=torch.zeros((), dtype=torch.int64, device=device),
                       seed=cfg.run.seed)
    loader_state = None  # the data stream's position, applied once the data is open
    if start_from is not None:
        loader_state = resume.restore(start_from, parts, state, denv.rank, denv.world_size)
        if state.seed != cfg.run.seed:  # the continued run's seed decides its data order
            say(f"resuming: run.seed {state.seed} of the checkpointed run replaces {cfg.run.seed}")
            cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, seed=state.seed))
    state.nonfinite = state.nonfinite.to(device)
    log.submission(cfg.run.division, cfg.log.submitter, cfg.log.platform or cfg.log.system, cfg.log.status)
    prec_hp = parts.precision.hyperparameters(cfg.precision)
    log.hyperparameters(hyperparameters(cfg, denv.world_size, parts.global_batch, impl, prec_hp))
    if cfg.log.compat and cfg.run.init_checkpoint:  # the tensors loaded, by their TF checkpoint names
        log.weights_initialization(tf_tensor_names(cfg.model))
    if start_from is not None:
        # Not an MLPerf key (the checker ignores unknown keys); says this log is not one timed run.
        log.event("resumed_from_checkpoint", str(start_from), step=state.step, samples_count=state.samples)
        say(f"resumed from {start_from} at step {state.step}, {state.samples} samples")
    log_failure = functools.partial(_log_failure, log, log_path)
    try:
        failure = None
        if denv.is_main:
            path = log_path.with_name(log_path.stem + "_config.json")
            text = dumps(cfg, {"world_size": denv.world_size, "launcher": denv.launcher, "device": str(device),
                               "optimizer_impl": impl, "global_batch_size": parts.global_batch,
                               "eval_interval_samples": parts.eval_interval, "max_samples": parts.max_samples,
                               "resumed_from": str(start_from or ""), **prec_hp})
            failure = storage.attempt("the resolved config", path, "log.output_dir",
                                      lambda: storage.write_text(path, text))
        storage.check(failure or log_failure(), device)  # one small collective, before run_start
        say(f"bert: {denv.world_size} rank(s) via {denv.launcher} on {device}; optimizer {impl}; "
            f"precision {parts.precision.train} (eval {parts.precision.eval}, loss scaling "
            f"{prec_hp['loss_scaling']}); global batch {parts.global_batch}; eval every {parts.eval_interval} samples; "
            f"abort after {parts.max_samples}")
        if dry_run:
            open_data(parts, cfg, denv, timed=False)  # not timed: reading the data checks it
            for problem in problems:
                say(f"warning: a timed run would exit 2: {problem}")
            say("dry run: everything built, nothing trained")
            return 0
        step = prepare_step(parts, cfg, denv.world_size, say)  # warm-up (and graph capture) on synthetic batches
        parts = prepare_eval(parts, cfg, denv.world_size, say)  # the same for evaluation
        log.init_stop()
        log.run_start()
        parts = open_data(parts, cfg, denv)  # the clock runs: only now is the data touched
        if loader_state is not None:
            parts.batches.load_state_dict(loader_state)
        ckpt = resume.Checkpointer(cfg.ckpt, ckpt_dir, denv.rank, denv.world_size, device, stop, log_failure,
                                   data_failure=getattr(parts.batches, "failure", lambda: None))
        # Chosen once: the benchmark loop, or a from-scratch phase's (bert/pretrain.py).
        loop = (pretrain.loop(step, log_path, denv.is_main) if cfg.run.mode == "pretrain"
                else functools.partial(train, step=step))
        status, state = loop(parts, cfg, log, say, state, ckpt)
        return _finish(status, state, parts, cfg, denv, log, say, ckpt, ckpt_dir, log_failure)
    except Exception:  # a failed write, bad input, a dead peer: the log ends with the run's end
        if not log.stopped:
            log.run_stop("aborted", state.samples, parts.eval_samples)  # as far as the log can still be written
        raise


def _finish(status: str, state: TrainState, parts: Parts, cfg: Config, denv: distributed.DistEnv,
            log: MLPerfLogger, say: Callable[[str], None], ckpt: resume.Checkpointer, ckpt_dir: Path,
            log_failure: Callable[[], storage.Failure | None]) -> int:
    """The run's end: its last log lines, the final outputs (rank 0), the line a person reads,
    the exit status."""
    stopped_ms = clock_ms()  # run_stop's time: the final outputs below are written after it, untimed
    total_nonfinite = int(state.nonfinite[0])  # host sync, once
    log.event("nonfinite_loss_steps", total_nonfinite)  # not an MLPerf key; skipped/NaN steps
    clip = parts.grad_sync.clip
    if clip is not None:  # the layout DDP settled on (after its rebuild) and the thresholds
        log.event("grad_sync_bucket_thresholds", clip.thresholds, bucket_numels=clip.layout)
    if status in ("preempted", "interrupted"):
        log.run_stop("aborted", state.samples, parts.eval_samples)
        saved = ckpt.stop_checkpoint
        if status == "preempted":
            say(f"stopped by signal {ckpt.signum} after step {state.step}: resume from {saved}")
            return resume.EXIT_PREEMPTED
        said = f"checkpoint {saved} written: rerun the same command to resume" if saved else "nothing saved"
        found = resume.complete_checkpoints(ckpt_dir) if not saved and denv.is_main else []
        if found:  # periodic checkpoints: what a rerun continues from
            said += f"; a rerun resumes from {found[-1].name}"
        say(f"interrupted (Ctrl-C): stopped at step {state.step}; {said}")
        return resume.EXIT_INTERRUPTED
    failure = save_outputs(cfg, parts.model, ckpt_dir, status, state.step) if denv.is_main else None
    storage.check(failure or log_failure(), parts.device)  # one small collective, after the timed run
    log.run_stop(status, state.samples, parts.eval_samples, time_ms=stopped_ms)
    say(f"run_stop {status} after {state.step} steps, {state.samples} samples, "
        f"{int(state.skipped_steps)} skipped"
        + (f"; {total_nonfinite} steps had a NaN/inf loss" if total_nonfinite else ""))
    return 0 if status == "success" else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bert.train", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="YAML or JSON file of config sections (overrides the defaults)")
    ap.add_argument("--dry-run", action="store_true", help="build every part, train nothing")
    ap.add_argument("--resume", action="store_true",
                    help="continue from the newest checkpoint in ckpt.dir; fail if there is none "
                         "(same as ckpt.resume=require; the default, auto, resumes when one exists)")
    ap.add_argument("overrides", nargs="*", help="key.sub=value (applied after --config)")
    ap.add_argument("--exit-status-dir", metavar="DIR",
                    help="write '<exit status> trained|none [seed]' to DIR/rank_<R> and exit 0 for the expected "
                         "ends (the statuses above; seed: rank 0's, as its MLPerf log has it, for a run that "
                         "trained; for launcher scripts: torchrun reports any non-zero exit as a failure)")
    args = ap.parse_intermixed_args(argv)
    distributed.tether_to_launcher()  # killed with run_and_time.sh / torchrun, whatever kills them
    rank = distributed.launch_rank()
    try:
        overrides = parse_overrides(args.overrides)
        if args.resume:
            overrides["ckpt.resume"] = "require"
        cfg = build_config(overrides, args.config)
    except ConfigError as e:
        if rank == 0:  # every rank reads the same arguments: say it once
            print(f"config error: {e}", file=sys.stderr)
        code = 2
    else:
        code = run(cfg, dry_run=args.dry_run,
                   pending_signals=Path(args.exit_status_dir, "signals") if args.exit_status_dir else None)
    if args.exit_status_dir is None:
        return code
    # 0 and 1 end a run that trained (run_stop logged); a dry run or an error trained nothing.
    trained = code in (0, 1) and not args.dry_run
    line = f"{code} {'trained' if trained else 'none'}"
    if trained and rank == 0:  # the seed the run used (drawn when unset; a resume keeps its run's)
        line += f" {logged_seed(Path(cfg.log.output_dir) / cfg.log.log_file)}"
    Path(args.exit_status_dir, f"rank_{rank}").write_text(line + "\n")
    return 0


if __name__ == "__main__":
    distributed.exit_process(main())  # not sys.exit: see exit_process (a torch 2.13 gloo race)
