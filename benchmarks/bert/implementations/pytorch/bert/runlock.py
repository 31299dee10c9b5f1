"""One run per directory: rank 0 holds an exclusive lock on the run's MLPerf log and on its
checkpoint directory for the run's whole life.

Without it, a second run started on the same ``log.output_dir`` / ``log.log_file`` or
``ckpt.dir`` replaced the first's log and checkpoints, or resumed the live run and trained
into the same directory beside it. With it, the second is refused before it writes
anything, with the holder's host and PID (``InUse``, exit 2 on every rank).

The locks are POSIX record locks (``fcntl.lockf``) on ``<output_dir>/.<log_file>.lock`` and
``<ckpt.dir>/.lock``, whose text names the holder. The kernel drops a lock when its process
ends, however it ends, so a run killed by ``kill -9`` leaves no lock: the next run takes the
file over and says so (the text of a holder that never released it is still there). A run
that ends releases it by emptying the file (never by removing it: a run waiting to lock the
old file would then hold a lock on a name nobody else sees).

Shared filesystems. Only rank 0 locks (the ranks of one run share the directories). POSIX
locks are what cluster filesystems keep coherent across nodes: NFSv4 always, NFSv3 through
lockd (without it the call fails: ENOLCK); Lustre only when mounted with ``-o flock``
(``-o localflock`` locks per node only: two nodes could both hold it; without either option
the call fails); GPFS and BeeGFS across nodes. A lock held by a node that died stays until
the filesystem recovers it (NFSv4: the lease, 90 s by default). Where locks fail the run is
refused (``NoLocks``) rather than run unprotected, unless ``run.exclusive=false``.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path


class InUse(ValueError):
    """Another live run holds the lock; the message names it."""


class NoLocks(ValueError):
    """The filesystem refuses locks; the message says what to do."""


@dataclass
class Lock:
    path: Path
    fd: int

    def release(self) -> None:
        """Empty the file (this run ended as it should) and drop the lock."""
        try:
            os.ftruncate(self.fd, 0)
        except OSError:  # a vanished or full filesystem: the lock still goes with the fd
            pass
        os.close(self.fd)


def _holder_text() -> str:
    return f"host {socket.gethostname()}, pid {os.getpid()}, since {time.strftime('%Y-%m-%d %H:%M:%S %Z')}"


def _read(fd: int) -> str:
    os.lseek(fd, 0, os.SEEK_SET)
    return os.read(fd, 4096).decode(errors="replace").strip()


def acquire(path: Path, what: str, fix: str) -> tuple[Lock, str | None]:
    """Lock ``path`` (created, with its directory, where missing). Returns the lock and, when a
    run that died holding it left its text, a note saying it was taken over. Raises ``InUse``
    naming the live holder, ``NoLocks`` where the filesystem refuses locks. ``what`` names
    the protected thing in messages, ``fix`` says which settings point a run elsewhere."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise NoLocks(f"{path}: cannot create the lock of {what}: {e.strerror} (errno {e.errno})") from None
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        holder = _read(fd) or "a holder that has not written its name yet"
        os.close(fd)
        if e.errno in (errno.EACCES, errno.EAGAIN):
            raise InUse(f"{what} is in use by another run ({holder}; lock {path}): let it end, or {fix}") from None
        raise NoLocks(f"{path}: the filesystem refuses locks ({os.strerror(e.errno)}, errno {e.errno}), so "
                      f"one run per directory cannot be enforced there (Lustre: mount with -o flock; NFSv3: "
                      f"run lockd); or set run.exclusive=false and make sure no other run uses {what}") from None
    previous = _read(fd)
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, (_holder_text() + "\n").encode())
    os.fsync(fd)
    note = (f"note: {what}: taking over the lock of a run that ended without releasing it ({previous})"
            if previous else None)
    return Lock(path, fd), note


def acquire_run(log_path: Path, ckpt_dir: Path) -> tuple[list[Lock], list[str]]:
    """Rank 0, before the run writes anything: the MLPerf log's lock, then the checkpoint
    directory's. Returns the locks (release them at the end) and the notes to print."""
    locks: list[Lock] = []
    notes: list[str] = []
    wanted = ((log_path.with_name(f".{log_path.name}.lock"), f"the MLPerf log {log_path}",
               "give this run another log.output_dir or log.log_file (LOGDIR, LOGFILE)"),
              (ckpt_dir / ".lock", f"the checkpoint directory {ckpt_dir}", "give this run another ckpt.dir (CKPT_DIR)"))
    try:
        for path, what, fix in wanted:
            lock, note = acquire(path, what, fix)
            locks.append(lock)
            notes += [note] if note else []
    except (InUse, NoLocks):
        for lock in locks:
            lock.release()  # this run never started: nothing of it to take over later
        raise
    return locks, notes
