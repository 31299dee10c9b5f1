"""Train-state checkpoints (write atomically, find the newest, restore exactly), the stop
flag that SIGTERM / SIGUSR1 / SIGINT raise, and what the training loop does at a step boundary.

A checkpoint is a directory ``step_000000123/`` holding

  train.pt     (rank 0) model, optimizer, LR schedule, grad scaler (when there is one), the
               loop's TrainState
  rank_<r>.pt  (every rank) its RNG states (python, numpy, torch CPU, CUDA), its
               gradient-sync state (PowerSGD's residuals and factors; empty otherwise), and
               the step
  stream.json  (rank 0) every rank's position in the training stream (``batches.state_dict()``:
               its sampling road and what the road needs to continue, the identity of the
               training data and the samples last trained on, which a resume must match),
               gathered, so that a run of any world size can continue it
  config.json  (rank 0) the run's settings (bert.config.dumps), what a resume is compared
               with (``check_settings``)
  meta.json    written last by rank 0: step, samples, world size, global batch, and each
               file's CRC-32 and size (summed as the bytes were written: bert/storage.py)

It is assembled as ``.step_000000123.tmp/`` (each file written under a temporary name,
fsynced, renamed: bert/storage.py), then, once every rank's file is in place, renamed into
place by rank 0 and the directory fsynced. So a ``step_*`` directory is always complete: a
kill at any instant leaves the previous checkpoints, or those plus the new one, never a torn
one. The newest ``keep`` are kept. A checkpoint is written only from finite weights and
optimizer state (``agree_finite``; the run ends as diverged instead), so pruning never removes
the newest finite checkpoint for a NaN one. The optimizer state is replicated (DDP), so rank
0's copy is everyone's, on any number of ranks: a run of another world size resumes it when
it keeps the global batch (``restore``), each rank then continuing the gathered stream
(bert/loader.py), its RNG streams reseeded and PowerSGD's residuals begun afresh (they were
the old ranks' own). A write that fails on any rank (a full disk: any OSError) is learned by
every rank from the collective that ends the write; rank 0 removes the temp directory and
every rank raises ``storage.WriteFailed`` (bert.train: exit 5).

A checkpoint proves its bytes before it is resumed (``choose``): every rank sums the files it
reads and compares them with meta.json (torch.load checks no CRC of its own: a flipped bit
in a tensor loads as another number), and restoring cross-checks the step and samples of
meta.json, the train state and the rank files. One that fails is named; ``ckpt.resume=auto``
moves it aside and resumes from the newest checkpoint that verifies, ``require`` refuses. A
resume under settings the checkpointed run did not have is refused, naming them
(``check_settings``; which may differ: bert.config.RESUME_MAY_DIFFER, the world size and the
split of the global batch among them).

A run that ends (its target, or its limit) writes its final weights, then ``finished.json``
(``mark_finished``: status, step, samples, what ended it); one ended by its limit writes a
checkpoint at its last step first, where it checkpoints periodically (bert/trainer.py
``finish``). A plain rerun (auto, off) starts fresh over a finished run, naming what it
removes (``clear``); ``--resume`` continues it when the new limits lie past its end, and
refuses naming why when they do not (``plan``); the continuation takes the mark away as it
begins to train (``reopen``) and writes it again when it ends.

Files are read with ``torch.load(weights_only=True)``: a checkpoint is data, never code.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch

from . import distributed, rng, storage
from .config import CheckpointConfig, Config, resume_changes
from .loader import TrainStream
from .shards import DataError
from .state import Learner, TrainState
from .weights import CheckpointError  # one error type for every checkpoint problem

STEP_DIR = re.compile(r"step_(\d{9})")
FINISHED = "finished.json"  # the run these checkpoints belong to has ended (``ended``)
SETTINGS = "config.json"  # in a checkpoint: the settings of the run that wrote it
STREAM = "stream.json"  # in a checkpoint: every rank's training-stream state

log = logging.getLogger(__name__)


# ---------------------------------------------------------------- files


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


def ended(directory: Path) -> dict[str, Any] | None:
    """How the run whose checkpoints these are ended (its finished mark: status, step, samples,
    what ended it, its last evaluation), or None while it is unfinished. A mark written before
    marks held the sample count has it from the newest checkpoint's global batch (a run keeps
    its global batch)."""
    file = directory / FINISHED
    if not file.is_file():
        return None
    try:
        mark = json.loads(file.read_text())
        step = int(mark["step"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{file}: cannot read the finished mark: {e}; remove it if its run did not end") from None
    if "samples" not in mark:
        found = complete_checkpoints(directory)
        mark["samples"] = step * _meta(found[-1]).get("global_batch", 0) if found else 0
    return mark


def _past_end(mark: dict[str, Any], *, end_samples: int, target: float | None) -> str | None:
    """Why limits that end a run at ``end_samples`` (and, in the benchmark mode, at ``target``)
    do not lie past the end of the finished run ``mark`` describes; None: they do."""
    done = mark["samples"]
    reached = (mark.get("eval") or {}).get("mlm_accuracy")
    if target is not None and mark.get("ended_by") == "target" and reached is not None and target <= reached:
        return (f"it ended at step {mark['step']} by its target (masked-LM accuracy {reached:.6g}), and this run's "
                f"eval.target_accuracy={target:g} is reached already: raise it above {reached:.6g} to continue it")
    if end_samples <= done:
        per_step = done // mark["step"] if mark["step"] else 0
        at = f"step {-(-end_samples // per_step)} ({end_samples} samples)" if per_step else f"{end_samples} samples"
        fix = ("run.max_steps past it (up to optim.total_steps, where a pretraining phase ends)" if target is None
               else "run.max_steps or run.max_samples past it")
        return (f"it ended at step {mark['step']} ({done} samples), and this run's limits end it at {at}, not past "
                f"that: raise {fix} to continue it")
    return None


def plan(directory: Path, mode: str, *, end_samples: int, target: float | None) -> Path | None:
    """The checkpoint to resume from (None = start fresh); every rank computes the same.

    ``end_samples``: the sample count this run's limits end it at (bert.config.max_samples);
    ``target``: the benchmark mode's eval.target_accuracy (None in pretraining). An unfinished
    run's newest checkpoint is resumed (auto, require). A finished run (``ended``) is continued
    only by "require", and only when this run's limits lie past its end; auto and off start
    fresh over it (``clear`` then names what it removes): a plain rerun of a finished run is a
    new run, as MLPerf's reruns are.

    Raises ``CheckpointError`` when ``mode`` is "require" and there is nothing to resume or the
    finished run's end is not passed (naming why), and when a fresh start would mix its
    checkpoints with an unfinished run's ("off").
    """
    found = complete_checkpoints(directory)
    mark = ended(directory)
    if mode == "require":
        if not found:
            raise CheckpointError(f"--resume / ckpt.resume=require: {directory} holds no complete checkpoint")
        why = _past_end(mark, end_samples=end_samples, target=target) if mark else None
        if why:
            raise CheckpointError(f"--resume / ckpt.resume=require: {directory} holds a finished run: {why}, or "
                                  "drop --resume to start a fresh run there")
        return found[-1]
    if mode == "off" and found and mark is None:
        raise CheckpointError(f"ckpt.resume=off but {directory} holds checkpoints of an unfinished run "
                              f"(newest {found[-1].name}); resume it, or use another ckpt.dir / log.output_dir")
    return found[-1] if found and mark is None and mode != "off" else None


def clear(directory: Path) -> None:
    """Rank 0, fresh start: drop a finished run's checkpoints, its mark and any torn temp
    directories, naming them in one line (nothing a run wrote goes without a word)."""
    if not directory.is_dir():
        return
    mark = ended(directory)
    gone = sorted(p for p in directory.iterdir()
                  if STEP_DIR.fullmatch(p.name) or (p.name.startswith(".step_") and p.name.endswith(".tmp")))
    if not gone and mark is None:
        return
    names = ", ".join(p.name for p in gone) or FINISHED
    if mark is not None:
        whose = (f"{'the checkpoints' if gone else 'the mark'} of a finished run (it ended at step {mark['step']}, "
                 f"run_stop {mark.get('status')}); --resume continues a finished run instead, to limits past its end")
    else:
        whose = "unfinished writes of a run that stopped during them"
    log.info(f"starting fresh in {directory}: removing {names}, {whose}")
    for p in gone:
        shutil.rmtree(p)
    (directory / FINISHED).unlink(missing_ok=True)


def reopen(directory: Path) -> None:
    """Rank 0, as a continuation of a finished run begins to train (every refusal behind it):
    its finished mark goes, so that a stop before it ends again leaves an unfinished run that
    the same command resumes. Before this point a stop leaves the finished run as it was."""
    (directory / FINISHED).unlink(missing_ok=True)


def mark_finished(directory: Path, *, status: str, step: int, samples: int, ended_by: str,
                  metrics: dict[str, float]) -> None:
    """Rank 0, at run_stop, once the final weights are safe: the run these checkpoints belong
    to ended (``ended_by``: "target" or "limit"), at ``step`` after ``samples``, its last
    evaluation ``metrics``. A later auto start begins afresh over them; --resume continues
    them only to limits past this end (``plan``)."""
    if directory.is_dir():
        mark = {"status": status, "step": step, "samples": samples, "ended_by": ended_by, "eval": metrics}
        storage.write_text(directory / FINISHED, json.dumps(mark) + "\n")


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


def _meta(path: Path) -> dict[str, Any]:
    meta_path = path / "meta.json"
    try:
        return json.loads(meta_path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{meta_path}: cannot read: {e}") from None


def verify(path: Path, rank: int, world_size: int) -> str | None:
    """Why checkpoint ``path`` does not prove its bytes to this rank (None: it does): each file
    this rank reads (train.pt, config.json, stream.json, and its rank file when the checkpoint
    is of this world size) must have the CRC-32 and size meta.json records. A checkpoint
    written before meta.json held sums is taken as it is, and one written before checkpoints
    held their settings (or the gathered stream) has no such file to check."""
    try:
        meta = _meta(path)
    except CheckpointError as e:
        return str(e)
    files = meta.get("files")
    if not isinstance(files, dict):
        return None  # no sums recorded (an older checkpoint): nothing to check against
    own = [f"rank_{rank}.pt"] if meta.get("world_size") == world_size else []
    for name in ("train.pt", *own, *[n for n in (SETTINGS, STREAM) if n in files]):
        want = files.get(name)
        if not isinstance(want, dict):
            return f"{path / 'meta.json'}: records no sum of {name}"
        try:
            got = storage.sum_file(path / name)
        except OSError as e:
            return f"{path / name}: cannot read: {e.strerror}"
        if (got.crc32, got.size) != (want.get("crc32"), want.get("bytes")):
            return (f"{path / name}: crc32 {got.crc32} ({got.size} bytes), but meta.json says {want.get('crc32')} "
                    f"({want.get('bytes')} bytes): damaged since it was written")
    return None


def choose(directory: Path, newest: Path, mode: str, rank: int, world_size: int) -> Path:
    """The checkpoint to resume from, every rank agreeing, starting at ``newest`` (``plan``):
    the newest one that verifies (``verify`` on every rank; one small gather per checkpoint
    tried). Under ``ckpt.resume=auto`` a damaged one is moved aside (``<name>.damaged``, rank 0;
    kept for a look) and the next older one tried, saying so; ``require`` refuses, naming the
    damage and the newest checkpoint that verifies. None verifying: refused. A checkpoint of
    another world size is verified by what this run reads of it (not the rank files of ranks
    it does not have)."""
    candidates = [p for p in complete_checkpoints(directory) if p.name <= newest.name][::-1]
    damaged: list[tuple[Path, str]] = []
    for path in candidates:
        seen = distributed.all_gather_object(verify(path, rank, world_size))
        why = next((f"{t} (on rank {r})" for r, t in enumerate(seen) if t is not None), None)
        if why is None:
            break
        damaged.append((path, why))
    else:
        path = None
    if not damaged:
        return path
    first, why = damaged[0]
    if mode == "require" or path is None:
        found = f"the newest checkpoint that verifies is {path.name}" if path else f"no checkpoint in {directory} verifies"
        fix = ("ckpt.resume=auto (the default) resumes from it, moving the damaged ones aside" if path else
               "move the damaged ones aside to start fresh, or copy good ones back")
        raise CheckpointError(f"{why}; {found}: {fix}")
    if rank == 0:
        for bad, _ in damaged:
            os.replace(bad, bad.with_name(bad.name + ".damaged"))
    distributed.barrier()  # every rank past its reads of the damaged ones before they move
    log.warning(f"warning: checkpoint {first.name} does not verify: {why}; resuming from {path.name}, the newest "
                f"checkpoint that verifies ({', '.join(b.name for b, _ in damaged)} moved aside to *.damaged)")
    return path


def check_settings(path: Path, cfg: Config) -> None:
    """Refuse (``CheckpointError``) to resume checkpoint ``path`` (verified: ``choose``) under
    settings its run did not have, naming each (bert.config.resume_changes). A checkpoint
    written before checkpoints held their settings has none to compare with."""
    file = path / SETTINGS
    if not file.is_file():
        return
    try:
        saved = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{file}: cannot read: {e}") from None
    changed = resume_changes(saved, cfg)
    if changed:
        raise CheckpointError(
            f"{path}: a resume continues the checkpointed run, but this run's settings differ from it: "
            f"{'; '.join(changed)}. Set them back (that run's are in {file}), or start a fresh run with another "
            "ckpt.dir and log.output_dir; only paths, ckpt.*, log.*, dist.*, the run's guards and its end (target, "
            "sample and step limits) may differ (bert/config.py RESUME_MAY_DIFFER)")


def ranks(n: int) -> str:
    return f"{n} rank" if n == 1 else f"{n} ranks"


def batch_sizes(global_batch: int, world_size: int) -> str:
    """What keeps ``global_batch`` on ``world_size`` ranks, in words (a refusal's fix)."""
    if global_batch % world_size:
        near = [w for w in range(1, global_batch + 1) if global_batch % w == 0 and w <= 2 * world_size][-4:]
        return (f"{global_batch} samples do not split over {ranks(world_size)}; numbers of ranks that divide it: "
                f"{', '.join(map(str, near))}")
    per = global_batch // world_size
    splits = [f"run.local_batch_size={per // a} with run.grad_accum_steps={a}"
              for a in range(1, per + 1) if per % a == 0][:3]
    return f"on {ranks(world_size)}: {' or '.join(splits)} (BATCHSIZE, GRADIENT_STEPS)"


@dataclasses.dataclass
class Restored:
    """What a resume continues besides the learner and the train state: the training stream
    (``TrainStream.load_state_dict``'s argument, applied once the data is open, after
    run_start) and, on another world size, what could not carry over (a line each)."""

    stream: dict[str, Any]
    world_size: int  # of the run that wrote it
    reset: list[str]


def restore(path: Path, learner: Learner, state: TrainState, rank: int, world_size: int,
            global_batch: int) -> Restored:
    """Load checkpoint ``path`` into the built ``learner`` and the loop's ``state``, in place.

    A checkpoint of another world size resumes when this run keeps its global batch (the
    learning-rate schedule, the sample count and the eval cadence count in its units); the
    model and optimizer state are replicated, so they carry over whole. What was per rank
    cannot: each rank's RNG streams are reseeded from (seed, step, rank), PowerSGD's residuals
    and factors begin afresh. The stream position is the gathered one (stream.json)."""
    meta = _meta(path)
    then = int(meta.get("world_size") or 0)
    if meta.get("global_batch") != global_batch:
        raise CheckpointError(f"{path}: written with global batch {meta.get('global_batch')} ({ranks(then)}), this "
                              f"run has {global_batch} ({ranks(world_size)}); a resume keeps the global batch (the "
                              f"schedule and the data stream count in it): {batch_sizes(meta.get('global_batch') or 0, world_size)}")
    elastic = then != world_size
    if elastic and not (path / STREAM).is_file():
        raise CheckpointError(f"{path}: written by {ranks(then)} before checkpoints gathered every rank's data stream "
                              f"(no {STREAM}): it resumes on {ranks(then)} only")
    shared = _load(path / "train.pt")
    why = (_shape_mismatch(learner.model.state_dict(), shared["model"])
           or _optimizer_mismatch(learner.optimizer, shared["optimizer"]))
    if why:
        raise CheckpointError(f"{path / 'train.pt'}: written for a different model ({why}); "
                              "check the model.* settings")
    learner.model.load_state_dict(shared["model"])
    learner.optimizer.load_state_dict(shared["optimizer"])
    learner.scheduler.load_state_dict(shared["scheduler"])
    if shared.get("scaler") is None:
        raise CheckpointError(f"{path / 'train.pt'}: no grad scaler state (not a checkpoint of this trainer)")
    learner.scaler.load_state_dict(shared["scaler"])
    # The bookkeeping three ways: meta.json, the train state, the stream and each rank's file.
    # Damage that the sums miss (meta.json has none of its own) must not resume at the wrong step.
    saved = shared["train_state"]
    mine = {} if elastic else _load(path / f"rank_{rank}.pt")
    stream = _stream(path) if (path / STREAM).is_file() else {"world_size": then, "ranks": None}
    checks = [("step", "train.pt", saved.get("step")), ("samples", "train.pt", saved.get("samples")),
              ("step", STREAM, stream.get("step", meta.get("step")))]
    if not elastic:
        checks.append(("step", f"rank_{rank}.pt", mine.get("step", meta.get("step"))))
    for key, name, got in checks:
        if got != meta.get(key):
            raise CheckpointError(f"{path}: meta.json says {key} {meta.get(key)}, {name} says {got}: the checkpoint "
                                  "contradicts itself; resume from another one (move this one aside)")
    for k, v in saved.items():
        old = getattr(state, k)
        setattr(state, k, v.to(old.device) if torch.is_tensor(old) else type(old)(v))
    reset = []
    if elastic:
        rng.seed_everything(int(np.random.SeedSequence([state.seed, state.step, rank]).generate_state(1)[0]))
        reset.append("each rank's RNG streams (dropout, masking) reseeded from (seed, step, rank)")
        if learner.grad_sync.state_dict():
            reset.append("PowerSGD's residuals and factors begun afresh (they were each old rank's own), its "
                         "uncompressed warm-up steps too")
    else:
        try:  # PowerSGD's residuals and factors; nothing for the other modes
            learner.grad_sync.load_state_dict(mine.get("grad_sync", {}), learner.device)
        except ValueError as e:
            raise CheckpointError(f"{path / f'rank_{rank}.pt'}: {e}") from None
        rng.set_state(mine["rng"], learner.device)
    if stream["ranks"] is None:  # written before the stream was gathered: this rank's own, in its rank file
        stream = mine["batches"]
    return Restored(stream, then, reset)


def _stream(path: Path) -> dict[str, Any]:
    try:
        stream = json.loads((path / STREAM).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path / STREAM}: cannot read: {e}") from None
    if not isinstance(stream, dict) or not isinstance(stream.get("ranks"), list):
        raise CheckpointError(f"{path / STREAM}: holds no list of the ranks' stream states")
    return stream


def finite(learner: Learner) -> torch.Tensor:
    """Whether every weight and every floating optimizer tensor is finite: a 0-d bool on the
    device (no sync). One isfinite per tensor (a norm could overflow on large finite values);
    called at checkpoint steps and before the final weights only."""
    tensors = [p.detach() for p in learner.model.parameters()]
    tensors += [v for st in learner.optimizer.state.values() for v in st.values()
                if torch.is_tensor(v) and v.is_floating_point()]
    return torch.stack([torch.isfinite(t).all() for t in tensors]).all()


def agree_finite(learner: Learner, device: torch.device) -> bool:
    """``finite`` on every rank (each rank's copy of the replicated state): one 4-byte
    all_reduce and a host sync."""
    bad = (~finite(learner)).to(torch.int32).reshape(1).to(device)
    return not distributed.all_reduce_max(bad).item()


class StopFlag:
    """Set by signals, read by the training loop at its next poll (``Checkpointer.at_boundary``) and
    between evaluation batches (``interrupted``).

    SIGTERM / SIGUSR1 (``ckpt.on_signal``): write a checkpoint, then stop (exit 3); without
    ``ckpt.on_signal`` they end the process as their default action would. SIGINT (Ctrl-C;
    always): stop (exit 130). Its handler then gives SIGINT its default action back, so a
    second Ctrl-C ends the process at once: a Python handler would run only once the main
    thread is back in the interpreter, not inside a collective or a long kernel.

    The handlers only store a number and reset a disposition: no I/O and no locks, which
    could deadlock when the signal lands inside a collective or a write.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self) -> None:
        self.signum = 0  # SIGTERM / SIGUSR1
        self.interrupted = False  # SIGINT

    def reason(self) -> str | None:
        """What asked the run to stop, in words (None: nothing did): for a wait that cannot
        reach the next poll (bert/watchdog.py)."""
        if self.interrupted:
            return "interrupted (Ctrl-C)"
        return f"stopped by signal {signal.Signals(self.signum).name}" if self.signum else None

    def _handle(self, signum: int, _frame: Any) -> None:
        self.signum = signum

    def _interrupt(self, _signum: int, _frame: Any) -> None:
        self.interrupted = True
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    @staticmethod
    def _default(signum: int, _frame: Any) -> None:
        # Caught (so that run_and_time.sh sees a handler and delivers it), then what the
        # default action does: end the process by this signal.
        signal.signal(signum, signal.SIG_DFL)
        signal.raise_signal(signum)

    @contextlib.contextmanager
    def installed(self, on_signal: bool, pending: Path | None = None) -> Iterator[StopFlag]:
        """Handlers for the duration (main thread only: Python delivers signals there).

        ``pending``: the file where run_and_time.sh notes each signal it got
        (``<--exit-status-dir>/signals``, one name a line) before sending it to the
        processes that catch it; read once the handlers are in place, so that a signal
        that came before (before this process existed, or could catch it) is acted on too.
        One noted and also delivered acts once: the flags are set, not counted."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        other = self._handle if on_signal else self._default
        handlers = {signal.SIGINT: self._interrupt, **{s: other for s in self.SIGNALS}}
        previous = {s: signal.signal(s, h) for s, h in handlers.items()}
        try:
            for signum in _pending_signals(pending):
                if signum == signal.SIGINT:
                    self.interrupted = True  # the launcher ends the run on a second Ctrl-C itself
                elif on_signal:
                    self.signum = signum
                else:
                    signal.raise_signal(signum)
            yield self
        finally:
            for s, h in previous.items():
                signal.signal(s, h)


def _pending_signals(path: Path | None) -> list[signal.Signals]:
    if path is None:
        return []
    try:
        names = path.read_text().split()
    except FileNotFoundError:
        return []
    known = {"USR1": signal.SIGUSR1, "TERM": signal.SIGTERM, "INT": signal.SIGINT}
    return [known[n] for n in names if n in known]


class Checkpointer:
    """What the training loop does after every step: write a checkpoint when one is due (every N steps,
    every M minutes, on SIGTERM/SIGUSR1, on Ctrl-C where asked), and stop where the ranks
    agreed to."""

    def __init__(self, *, cfg: CheckpointConfig, directory: Path, rank: int, world_size: int,
                 device: torch.device, global_batch: int, stop: StopFlag,
                 pending: Callable[[], storage.Failure | None] = lambda: None, max_nonfinite_steps: int = 0,
                 settings: str = ""):
        self.cfg, self.dir, self.rank, self.world_size, self.device = cfg, directory, rank, world_size, device
        self.global_batch, self.stop = global_batch, stop
        self.settings = settings  # the run's config (bert.config.dumps) for config.json; "" = none
        # The NaN guard (run.max_nonfinite_steps; 0 = off): a streak of NaN/inf losses that
        # long on any rank, seen at a poll, ends the run on every rank ("diverged").
        self.max_nonfinite_steps = max_nonfinite_steps
        self.diverged = ""  # why the ranks agreed the run diverged
        # Ctrl-C writes a checkpoint before it stops only where the user chose where they go.
        self.saves_on_interrupt = cfg.on_signal and bool(cfg.dir)
        self.pending = pending  # a write that failed between polls (rank 0's MLPerf log)
        self.last_write = time.monotonic()
        self.written: list[Path] = []
        self.stop_checkpoint: Path | None = None  # the one written by the stop the ranks agreed on
        self.signum = 0  # the SIGTERM / SIGUSR1 the ranks agreed to stop for (the largest number)

    def at_boundary(self, learner: Learner, state: TrainState, batches: TrainStream) -> str | None:
        """After a step; the same answer on every rank. None: go on. "preempted" (SIGTERM /
        SIGUSR1; a checkpoint written) or "interrupted" (Ctrl-C; a checkpoint written first
        where ``saves_on_interrupt``): stop. Raises storage.WriteFailed when a write failed."""
        due = self.cfg.interval_steps > 0 and state.step % self.cfg.interval_steps == 0
        signaled = interrupted = False
        if state.step % self.cfg.poll_steps == 0:
            signaled, clock, interrupted, streak = self._poll(batches, state)
            due = due or clock
            if streak:
                self.diverged = (f"loss NaN/inf for the last {streak} steps on some rank (run.max_nonfinite_steps="
                                 f"{self.max_nonfinite_steps})")
                return "diverged"
        if interrupted and not self.saves_on_interrupt:
            return "interrupted"
        if due or signaled or interrupted:
            # Only from finite state: a NaN checkpoint would be resumed, and prune a good one.
            if not agree_finite(learner, self.device):
                self.diverged = f"the weights or optimizer state hold NaN/inf at step {state.step}"
                return "diverged"
            path = self.save(learner, state, batches)
            log.info(f"checkpoint {path}")
            if signaled or interrupted:
                self.stop_checkpoint = path
                return "interrupted" if interrupted else "preempted"
        return None

    def _poll(self, batches: TrainStream, state: TrainState) -> tuple[bool, bool, bool, int]:
        clock = self.cfg.interval_minutes > 0 and time.monotonic() - self.last_write >= 60 * self.cfg.interval_minutes
        # A shard read ahead of the loop that failed or overran its bound (bert/watchdog.py:
        # the stream's ``failure``) stops every rank here with its message (exit 2).
        failure = self.pending()
        bad_data = batches.failure()
        # A rank may get a signal (or cross the minute mark, or fail a write or a read) a step
        # before another: agree by max. One 24-byte all_reduce and a host sync per poll.
        flags = torch.tensor([self.stop.signum, clock, self.stop.interrupted, failure is not None, bad_data is not None],
                             dtype=torch.int32, device=self.device)
        # The NaN streak is on the device already: it rides along, no extra sync.
        flags = torch.cat([flags, state.nonfinite[1:2].to(device=self.device, dtype=torch.int32)])
        signum, clock, interrupted, failed, data_failed, streak = distributed.all_reduce_max(flags).tolist()
        if data_failed:  # bad input outranks the rest: every rank names the file (exit 2)
            seen = distributed.all_gather_object(bad_data)
            rank, text = next((r, t) for r, t in enumerate(seen) if t is not None)
            raise DataError(f"{text} (on rank {rank})")
        if failed:
            storage.raise_agreed(failure)
        self.signum = self.signum or signum  # the signal some rank got: every rank names it
        limit = self.max_nonfinite_steps
        return bool(signum), bool(clock), bool(interrupted), streak if limit and streak >= limit else 0

    def save(self, learner: Learner, state: TrainState, batches: TrainStream) -> Path:
        """Every rank calls this at the same step; returns the checkpoint's directory.
        ``batches``: the training stream (its ``state_dict`` is this rank's position). A failed
        write on any rank: the temp directory removed, storage.WriteFailed on every rank."""
        name = f"step_{state.step:09d}"
        tmp, final = self.dir / f".{name}.tmp", self.dir / name
        what = f"checkpoint {name}"

        sums: dict[str, dict[str, Any]] = {}  # this rank's files -> their CRC-32 and size
        # The stream's position first, outside the write: describing its data (the first time)
        # can find a shard gone, which is bad input (exit 2), with no directory begun for it.
        position = batches.state_dict()

        def own_files() -> None:
            tmp.mkdir(parents=True, exist_ok=True)  # every rank: the directory is on a shared filesystem
            name = f"rank_{self.rank}.pt"
            sums[name] = storage.save_torch({"rng": rng.state(self.device), "grad_sync": learner.grad_sync.state_dict(),
                                             "step": state.step}, tmp / name).as_dict()
            if self.rank == 0:
                sums["train.pt"] = storage.save_torch(
                    {"model": learner.model.state_dict(), "optimizer": learner.optimizer.state_dict(),
                     "scheduler": learner.scheduler.state_dict(), "scaler": learner.scaler.state_dict(),
                     "train_state": dataclasses.asdict(state)}, tmp / "train.pt").as_dict()
                if self.settings:
                    sums[SETTINGS] = storage.write_text(tmp / SETTINGS, self.settings).as_dict()

        def complete() -> None:
            files = {name: every[name] for every, _ in gathered for name in every}
            stream = {"step": state.step, "world_size": self.world_size, "ranks": [p for _, p in gathered]}
            files[STREAM] = storage.write_text(tmp / STREAM, json.dumps(stream) + "\n").as_dict()
            meta = {"step": state.step, "samples": state.samples, "world_size": self.world_size,
                    "global_batch": self.global_batch, "files": dict(sorted(files.items()))}
            (tmp / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
            _fsync_dir(tmp)
            if final.exists():  # a torn-then-redone save of the same step after a resume
                shutil.rmtree(final)
            os.replace(tmp, final)
            _fsync_dir(self.dir)
            self._prune(final)

        # The collective that ends the write (it was a barrier): every rank's file is in place,
        # or every rank learns which failed, before rank 0 names the directory complete.
        self._agree(storage.attempt(what, self.dir, "ckpt.dir", own_files), tmp)
        # Every rank's sums and stream position, for rank 0's meta.json and stream.json: one small
        # gather, in checkpoint steps only.
        gathered = distributed.all_gather_object((sums, position))
        # Rank 0's meta.json, rename and fsyncs: one more 4-byte collective, in checkpoint steps only.
        self._agree(storage.attempt(what, self.dir, "ckpt.dir", complete) if self.rank == 0 else None, tmp)
        self.last_write = time.monotonic()
        self.written.append(final)
        return final

    def _agree(self, failure: storage.Failure | None, tmp: Path) -> None:
        try:
            storage.check(failure, self.device)
        except storage.WriteFailed:
            if self.rank == 0:  # every rank is past its write: nothing fills the directory any more
                shutil.rmtree(tmp, ignore_errors=True)
            raise

    def _prune(self, newest: Path) -> None:
        keep = complete_checkpoints(self.dir)[-self.cfg.keep:]  # finite, all of them (at_boundary)
        for p in self.dir.iterdir():
            # Only temp dirs of earlier steps: another rank may already be filling the next one.
            m = re.fullmatch(r"\.(step_\d{9})\.tmp", p.name)
            stale_tmp = m is not None and m.group(1) < newest.name
            old = STEP_DIR.fullmatch(p.name) is not None and p not in keep and p != newest
            if stale_tmp or old:
                shutil.rmtree(p, ignore_errors=True)
