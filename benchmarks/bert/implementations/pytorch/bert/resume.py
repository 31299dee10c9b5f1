"""Train-state checkpoints (write atomically, find the newest, restore exactly) and the stop
flag that SIGTERM / SIGUSR1 raise.

A checkpoint is a directory ``step_000000123/`` holding

  train.pt     (rank 0) model, optimizer, LR schedule, grad scaler (when there is one), the
               loop's TrainState, and what must match on resume (world size, global batch)
  rank_<r>.pt  (every rank) its RNG states (python, numpy, torch CPU, CUDA), the position
               of its training-data stream (``batches.state_dict()``), and its gradient-sync
               state (PowerSGD's residuals and factors; empty otherwise)
  meta.json    written last by rank 0: step, samples, world size, files

It is assembled as ``.step_000000123.tmp/`` (each file written under a temporary name,
fsynced, renamed), then, after a barrier, renamed into place by rank 0 and the directory
fsynced. So a ``step_*`` directory is always complete: a kill at any instant leaves the
previous checkpoints, or those plus the new one, never a torn one. The newest ``keep`` are
kept. The optimizer state is replicated (DDP), so rank 0's copy is everyone's.

Files are read with ``torch.load(weights_only=True)``: a checkpoint is data, never code.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import re
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from . import distributed
from .checkpoint import CheckpointError  # one error type for every checkpoint problem
from .config import CheckpointConfig

STEP_DIR = re.compile(r"step_(\d{9})")
FINISHED = "finished.json"  # the run these checkpoints belong to has ended: never resume it
EXIT_PREEMPTED = 3  # exit status after a signal-triggered checkpoint: resume to continue


# ---------------------------------------------------------------- files


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _save_atomic(obj: Any, path: Path) -> None:
    """torch.save to ``path.part``, fsync, rename: a reader sees the whole file or none."""
    tmp = path.with_name(path.name + ".part")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _load(path: Path) -> dict[str, Any]:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing (checkpoint incomplete, or written by another world size)") from None
    except Exception as e:  # noqa: BLE001 - any unpickling failure is a bad file; name it
        raise CheckpointError(f"{path}: cannot read checkpoint: {e}") from None


def checkpoint_dir(cfg: CheckpointConfig, output_dir: str | Path) -> Path:
    return Path(cfg.dir) if cfg.dir else Path(output_dir) / "checkpoints"


def complete_checkpoints(directory: Path) -> list[Path]:
    """Complete checkpoints (those with meta.json), oldest first."""
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if STEP_DIR.fullmatch(p.name) and (p / "meta.json").is_file()]
    return sorted(found, key=lambda p: p.name)


def plan(directory: Path, mode: str) -> Path | None:
    """The checkpoint to resume from (None = start fresh); every rank computes the same.

    Raises ``CheckpointError`` when ``mode`` is "require" and there is nothing to resume, and
    when a fresh start would mix its checkpoints with an unfinished run's ("off").
    """
    found = complete_checkpoints(directory)
    finished = (directory / FINISHED).is_file()
    if mode == "require" and (not found or finished):
        why = "holds only checkpoints of a finished run" if found else "holds no complete checkpoint"
        raise CheckpointError(f"--resume / ckpt.resume=require: {directory} {why}")
    if mode == "off" and found and not finished:
        raise CheckpointError(f"ckpt.resume=off but {directory} holds checkpoints of an unfinished run "
                              f"(newest {found[-1].name}); resume it, or use another ckpt.dir / log.output_dir")
    return found[-1] if found and not finished and mode != "off" else None


def clear(directory: Path) -> None:
    """Rank 0, fresh start: drop a finished run's checkpoints and any torn temp directories."""
    if not directory.is_dir():
        return
    for p in directory.iterdir():
        if STEP_DIR.fullmatch(p.name) or (p.name.startswith(".step_") and p.name.endswith(".tmp")):
            shutil.rmtree(p)
    (directory / FINISHED).unlink(missing_ok=True)


def mark_finished(directory: Path, status: str, step: int) -> None:
    """Rank 0, at run_stop: the checkpoints here must not be resumed by a later auto start."""
    if directory.is_dir():
        (directory / FINISHED).write_text(json.dumps({"status": status, "step": step}) + "\n")


# ---------------------------------------------------------------- RNG


def numpy_rng_to_dict(state: tuple) -> dict[str, Any]:
    """A numpy RandomState state as tensors and numbers (what weights_only loading accepts)."""
    name, keys, pos, has_gauss, gauss = state
    return {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
            "has_gauss": int(has_gauss), "gauss": float(gauss)}


def numpy_rng_from_dict(d: dict[str, Any]) -> tuple:
    return d["name"], d["keys"].numpy().astype(np.uint32), d["pos"], d["has_gauss"], d["gauss"]


def _rng_state(device: torch.device) -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": numpy_rng_to_dict(np.random.get_state()),
             "torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    random.setstate(state["python"])
    np.random.set_state(numpy_rng_from_dict(state["numpy"]))
    torch.set_rng_state(state["torch"])
    if device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


# ---------------------------------------------------------------- save and restore


def _shape_mismatch(own: dict[str, torch.Tensor], theirs: dict[str, Any]) -> str | None:
    missing, extra = sorted(own.keys() - theirs.keys()), sorted(theirs.keys() - own.keys())
    if missing or extra:
        return f"parameters missing there: {missing[:3]}, unknown here: {extra[:3]}"
    for k, v in own.items():
        if tuple(theirs[k].shape) != tuple(v.shape):
            return f"{k} has shape {tuple(theirs[k].shape)} there, {tuple(v.shape)} here"
    return None


def _optimizer_mismatch(optimizer: torch.optim.Optimizer, theirs: dict[str, Any]) -> str | None:
    """torch's ``Optimizer.load_state_dict`` checks parameter counts, not shapes: a moment
    of another shape would only fail (or broadcast) at the next step."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    ids = [i for g in theirs.get("param_groups", []) for i in g["params"]]
    for i, p in zip(ids, params):
        for k, v in theirs.get("state", {}).get(i, {}).items():
            if torch.is_tensor(v) and v.dim() > 0 and tuple(v.shape) != tuple(p.shape):
                return (f"optimizer state {k!r} of a {tuple(p.shape)} parameter has shape {tuple(v.shape)}: "
                        "model.vocab_pad_multiple pads the vocabulary rows inside the model")
    return None


def restore(path: Path, parts: Any, state: Any, rank: int, world_size: int) -> dict[str, Any]:
    """Load checkpoint ``path`` into the built ``parts`` and the loop's ``state``, in place.

    Returns this rank's data-stream position for ``parts.batches.load_state_dict``: the
    caller applies it once the data is open, after run_start (bert.train.open_data)."""
    meta_path = path / "meta.json"
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{meta_path}: cannot read: {e}") from None
    for key, mine in (("world_size", world_size), ("global_batch", parts.global_batch)):
        if meta.get(key) != mine:
            raise CheckpointError(f"{path}: written with {key}={meta.get(key)}, this run has {mine}; "
                                  "a resume must keep the world size and batch")
    shared = _load(path / "train.pt")
    why = (_shape_mismatch(parts.model.state_dict(), shared["model"])
           or _optimizer_mismatch(parts.optimizer, shared["optimizer"]))
    if why:
        raise CheckpointError(f"{path / 'train.pt'}: written for a different model ({why}); "
                              "check the model.* settings")
    parts.model.load_state_dict(shared["model"])
    parts.optimizer.load_state_dict(shared["optimizer"])
    parts.scheduler.load_state_dict(shared["scheduler"])
    scaler = getattr(parts, "scaler", None)
    if (scaler is None) != (shared.get("scaler") is None):
        raise CheckpointError(f"{path / 'train.pt'}: grad scaler {'absent' if scaler is None else 'present'} "
                              "here but not there (precision settings differ)")
    if scaler is not None:
        scaler.load_state_dict(shared["scaler"])
    for k, v in shared["train_state"].items():
        old = getattr(state, k)
        setattr(state, k, v.to(old.device) if torch.is_tensor(old) else type(old)(v))
    mine = _load(path / f"rank_{rank}.pt")
    try:  # PowerSGD's residuals and factors; nothing for the other modes
        parts.grad_sync.load_state_dict(mine.get("grad_sync", {}), parts.device)
    except ValueError as e:
        raise CheckpointError(f"{path / f'rank_{rank}.pt'}: {e}") from None
    _set_rng_state(mine["rng"], parts.device)
    return mine["batches"]


class StopFlag:
    """Set by SIGTERM / SIGUSR1, read by the loop at its next poll.

    The handler only stores the signal number: no I/O and no locks, which could deadlock
    when the signal lands inside a collective or a write.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self) -> None:
        self.signum = 0

    def _handle(self, signum: int, _frame: Any) -> None:
        self.signum = signum

    @contextlib.contextmanager
    def installed(self, enabled: bool) -> Iterator[StopFlag]:
        """Handlers for the duration (main thread only: Python delivers signals there)."""
        if not enabled or threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        try:
            yield self
        finally:
            for s, h in previous.items():
                signal.signal(s, h)


class Checkpointer:
    """Decides when to write (every N steps, every M minutes, on a signal) and writes."""

    def __init__(self, cfg: CheckpointConfig, directory: Path, rank: int, world_size: int,
                 device: torch.device, stop: StopFlag):
        self.cfg, self.dir, self.rank, self.world_size, self.device, self.stop = cfg, directory, rank, world_size, device, stop
        self.polls = cfg.on_signal or cfg.interval_minutes > 0  # else a poll has nothing to learn
        self.last_write = time.monotonic()
        self.stop_requested = False
        self.written: list[Path] = []

    def due(self, step: int) -> bool:
        """Write a checkpoint after this step? Same answer on every rank."""
        periodic = self.cfg.interval_steps > 0 and step % self.cfg.interval_steps == 0
        if not self.polls or step % self.cfg.poll_steps:
            return periodic
        clock = self.cfg.interval_minutes > 0 and time.monotonic() - self.last_write >= 60 * self.cfg.interval_minutes
        # A rank may get the signal (or cross the minute mark) a step before another: agree
        # by max. One 8-byte all_reduce and a host sync per poll.
        flags = torch.tensor([self.stop.signum != 0, clock], dtype=torch.int32, device=self.device)
        signaled, clock = distributed.all_reduce_max(flags).tolist()
        self.stop_requested = bool(signaled)
        return periodic or bool(signaled) or bool(clock)

    def save(self, parts: Any, state: Any) -> Path:
        """Every rank calls this at the same step; returns the checkpoint's directory."""
        name = f"step_{state.step:09d}"
        tmp = self.dir / f".{name}.tmp"
        tmp.mkdir(parents=True, exist_ok=True)  # every rank: the directory is on a shared filesystem
        _save_atomic({"rng": _rng_state(self.device), "batches": parts.batches.state_dict(),
                      "grad_sync": parts.grad_sync.state_dict()},
                     tmp / f"rank_{self.rank}.pt")
        if self.rank == 0:
            scaler = getattr(parts, "scaler", None)
            _save_atomic({"model": parts.model.state_dict(), "optimizer": parts.optimizer.state_dict(),
                          "scheduler": parts.scheduler.state_dict(),
                          "scaler": scaler.state_dict() if scaler is not None else None,
                          "train_state": dataclasses.asdict(state)}, tmp / "train.pt")
        distributed.barrier()  # every rank's file is in place before the directory is named complete
        final = self.dir / name
        if self.rank == 0:
            meta = {"step": state.step, "samples": state.samples, "world_size": self.world_size,
                    "global_batch": parts.global_batch,
                    "files": ["train.pt"] + [f"rank_{r}.pt" for r in range(self.world_size)]}
            (tmp / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
            _fsync_dir(tmp)
            if final.exists():  # a torn-then-redone save of the same step after a resume
                shutil.rmtree(final)
            os.replace(tmp, final)
            _fsync_dir(self.dir)
            self._prune(final)
        self.last_write = time.monotonic()
        self.written.append(final)
        return final

    def _prune(self, newest: Path) -> None:
        keep = complete_checkpoints(self.dir)[-self.cfg.keep:]
        for p in self.dir.iterdir():
            # Only temp dirs of earlier steps: another rank may already be filling the next one.
            m = re.fullmatch(r"\.(step_\d{9})\.tmp", p.name)
            stale_tmp = m is not None and m.group(1) < newest.name
            old = STEP_DIR.fullmatch(p.name) is not None and p not in keep and p != newest
            if stale_tmp or old:
                shutil.rmtree(p, ignore_errors=True)
