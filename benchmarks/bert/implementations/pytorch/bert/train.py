"""Entry point: build the parts from the config, train, evaluate every N samples, stop.

    python -m bert.train [--config FILE] [--dry-run] key.sub=value ...

Exit status: 0 when the eval masked-LM accuracy reached the target (run_stop success),
1 when the sample limit came first (run_stop aborted), 2 for a bad configuration.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from . import distributed, sampler
from .config import Config, ConfigError, build_config, dump, eval_interval_samples, global_batch_size, max_samples, parse_overrides
from .checkpoint import load_weights, tf_tensor_names
from .data import EvalSet
from .mlperf_log import MLPerfLogger, hyperparameters
from .model import BertForPreTraining, mlm_correct_and_count, pretraining_loss
from .optim import build_optimizer, build_scheduler

LABEL_KEYS = ("mlm_labels", "nsp_labels")


@dataclass
class TrainState:
    """Everything the loop advances; what a resume would restore beside the modules."""

    step: int = 0
    samples: int = 0
    next_eval: int = 0


@dataclass
class Parts:
    model: torch.nn.Module  # the bare module (eval, checkpoints)
    train_model: torch.nn.Module  # what the loop calls: DDP-wrapped when distributed
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    batches: Iterator[dict]
    eval_batches: list[dict]  # collated once at init: the eval set never changes
    eval_samples: int  # across all ranks
    device: torch.device
    global_batch: int
    eval_interval: int
    max_samples: int


def _to(batch: dict, device: torch.device) -> dict:
    # non_blocking: overlaps the host-to-device copy with compute on GPU; free on CPU.
    return {k: (v.to(device, non_blocking=True) if torch.is_tensor(v) else v) for k, v in batch.items()}


def _split(batch: dict) -> tuple[dict, dict]:
    return {k: v for k, v in batch.items() if k not in LABEL_KEYS}, {k: batch[k] for k in LABEL_KEYS}


def evaluate(model: torch.nn.Module, eval_batches: list[dict], device: torch.device) -> float:
    """Masked-LM accuracy over the whole eval set: counts summed across ranks, then divided."""
    was_training = model.training
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    with torch.no_grad():
        for batch in eval_batches:
            inputs, labels = _split(_to(batch, device))
            mlm_logits, _ = model(**inputs)
            correct, count = mlm_correct_and_count(mlm_logits, labels["mlm_labels"])
            totals[0] += correct
            totals[1] += count
    distributed.all_reduce_sum(totals)
    model.train(was_training)
    correct, count = totals.tolist()  # sync point, once per evaluation
    return correct / count if count else 0.0


def train_step(p: Parts, accum: int, clip: float) -> torch.Tensor:
    """One optimizer step over ``accum`` micro-batches; returns the mean loss (on device)."""
    total = torch.zeros((), device=p.device)
    for i in range(accum):
        inputs, labels = _split(_to(next(p.batches), p.device))
        # no_sync: the allreduce runs once, on the last micro-step's backward.
        sync = i == accum - 1 or not isinstance(p.train_model, DDP)
        with contextlib.nullcontext() if sync else p.train_model.no_sync():
            mlm_logits, nsp_logits = p.train_model(**inputs)
            loss = pretraining_loss(mlm_logits, nsp_logits, labels["mlm_labels"], labels["nsp_labels"]) / accum
            loss.backward()
        total += loss.detach()
    if clip > 0:  # closed-division clipping: global norm, after the allreduce
        torch.nn.utils.clip_grad_norm_(p.model.parameters(), clip, foreach=True)
    p.optimizer.step()
    p.scheduler.step()
    p.optimizer.zero_grad()  # sets grads to None (torch and apex alike): no memset
    return total


def train(p: Parts, cfg: Config, log: MLPerfLogger, say: Callable[[str], None]) -> tuple[str, TrainState]:
    s = TrainState(next_eval=p.eval_interval)
    last_t, last_samples = time.perf_counter(), 0
    log.block_start(s.samples, p.eval_interval)
    while True:
        loss = train_step(p, cfg.run.grad_accum_steps, cfg.optim.max_grad_norm)
        s.step += 1
        s.samples += p.global_batch
        if s.step % cfg.log.progress_interval_steps == 0:
            now = time.perf_counter()  # loss.item() below is the interval's one host sync
            rate = (s.samples - last_samples) / (now - last_t)
            say(f"step {s.step:6d} | samples {s.samples:9d} | loss {loss.item():7.4f} | "
                f"lr {p.scheduler.get_last_lr()[0]:.3e} | {rate:8.1f} samples/s")
            last_t, last_samples = now, s.samples
        if s.samples >= s.next_eval or s.samples >= p.max_samples:
            log.block_stop(s.next_eval - p.eval_interval, s.samples)
            log.eval_start(s.samples)
            acc = evaluate(p.model, p.eval_batches, p.device)
            log.eval_stop(s.samples)
            log.eval_accuracy(acc, s.samples)
            say(f"eval  @ {s.samples} samples: masked-LM accuracy {acc:.4f} (target {cfg.eval.target_accuracy})")
            if acc >= cfg.eval.target_accuracy:
                return "success", s
            if s.samples >= p.max_samples:
                return "aborted", s
            while s.next_eval <= s.samples:
                s.next_eval += p.eval_interval
            log.block_start(s.samples, p.eval_interval)
            last_t = time.perf_counter()  # the eval's time is not training throughput


def build(cfg: Config, denv: distributed.DistEnv, device: torch.device) -> tuple[Parts, str]:
    model = BertForPreTraining(cfg.model, device.type).to(device)
    if cfg.run.init_checkpoint:
        # TF phase-1 checkpoint, HF weights or ours; names and shapes checked against cfg.model.
        model.load_state_dict(load_weights(cfg.run.init_checkpoint, cfg.model))
    train_model: torch.nn.Module = model
    if denv.world_size > 1:
        train_model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                          bucket_cap_mb=cfg.grad_sync.bucket_cap_mb)
    optimizer, impl = build_optimizer(model, cfg.optim, device.type)
    scheduler = build_scheduler(optimizer, cfg.optim)
    d = cfg.data
    batches = sampler.train_batches(cfg, denv.rank, denv.world_size)  # picks the mode once
    eval_set = EvalSet(d.eval_dir, denv.rank, denv.world_size, d.eval_samples, d.max_seq_length)
    eval_batches = sampler.eval_batches(eval_set, cfg.eval.batch_size, cfg.model.unpad, cfg.model.pack,
                                        d.max_seq_length)
    ws = denv.world_size
    parts = Parts(model, train_model, optimizer, scheduler, iter(batches), eval_batches,
                  eval_set.total_samples, device,
                  global_batch_size(cfg, ws), eval_interval_samples(cfg, ws), max_samples(cfg, ws))
    return parts, impl


def save_weights(model: torch.nn.Module, path: str) -> None:
    """Write the state dict atomically: a temp file renamed into place, never a torn file."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, tmp)
    tmp.replace(target)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def run(cfg: Config, dry_run: bool = False) -> int:
    denv = distributed.job_env(cfg.dist)
    device = distributed.device_for(cfg.run.device, denv.local_rank)
    if cfg.run.threads > 0:
        torch.set_num_threads(cfg.run.threads)
    out_dir = Path(cfg.log.output_dir)
    log_path = out_dir / cfg.log.log_file
    log = MLPerfLogger(log_path if denv.is_main else None, enabled=denv.is_main)
    say = print if denv.is_main else (lambda _msg: None)
    try:
        log.init_start(cfg.run.cache_cleared)
        distributed.init_process_group(denv, cfg.dist, device)
        seed_everything(cfg.run.seed)  # identical initial weights on every rank
        parts, impl = build(cfg, denv, device)
        seed_everything(cfg.run.seed + denv.rank)  # distinct dropout streams per rank
        log.submission(cfg.run.division, cfg.log.submitter, cfg.log.platform or cfg.log.system, cfg.log.status)
        log.hyperparameters(hyperparameters(cfg, denv.world_size, parts.global_batch, impl))
        if cfg.log.compat:  # the tensors build() just initialized, by their TF checkpoint names
            log.weights_initialization(tf_tensor_names(cfg.model))
        if denv.is_main:
            dump(cfg, log_path.with_name(log_path.stem + "_config.json"),
                 {"world_size": denv.world_size, "launcher": denv.launcher, "device": str(device),
                  "optimizer_impl": impl, "global_batch_size": parts.global_batch,
                  "eval_interval_samples": parts.eval_interval, "max_samples": parts.max_samples})
        say(f"bert: {denv.world_size} rank(s) via {denv.launcher} on {device}; optimizer {impl}; "
            f"global batch {parts.global_batch}; eval every {parts.eval_interval} samples; "
            f"abort after {parts.max_samples}")
        if dry_run:
            say("dry run: everything built, nothing trained")
            return 0
        log.init_stop()
        log.run_start()
        status, state = train(parts, cfg, log, say)
        log.run_stop(status, state.samples, parts.eval_samples)
        if cfg.run.save_checkpoint and denv.is_main:
            save_weights(parts.model, cfg.run.save_checkpoint)
        say(f"run_stop {status} after {state.step} steps, {state.samples} samples")
        return 0 if status == "success" else 1
    finally:
        log.close()
        distributed.shutdown()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bert.train", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="YAML or JSON file of config sections (overrides the defaults)")
    ap.add_argument("--dry-run", action="store_true", help="build every part, train nothing")
    ap.add_argument("overrides", nargs="*", help="key.sub=value (applied after --config)")
    args = ap.parse_intermixed_args(argv)
    try:
        cfg = build_config(parse_overrides(args.overrides), args.config)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    return run(cfg, dry_run=args.dry_run)


if __name__ == "__main__":
    sys.exit(main())
