"""The run's files, written so that a failed write loses nothing and every rank says the same.

Every file a run writes (train-state checkpoints, the final weights, the resolved config) is
written under a temporary name, fsynced and renamed: a reader sees the whole file or none, and
a write that fails leaves no partial file behind. A write fails with an ``OSError`` (a full
disk, a quota, EIO, a read-only or vanished filesystem, a permission) on one rank, while the
others go on: they must learn of it, or they block in their next collective and report a dead
peer. So the ranks agree at points where they meet anyway (``check`` after a checkpoint's
files, the checkpoint poll of bert/checkpoint.py, the end of the run): one integer in a
collective that is there already, or costs nothing where it is added (start and end of the
run, checkpoint steps). Only when some rank failed does a second collective gather what
each rank saw, and every rank then raises the same ``WriteFailed`` (bert.train: one line
per rank, ``run_stop`` aborted, exit 5).

torch.save wraps the ``OSError`` of a full disk in a ``RuntimeError`` ("unexpected pos");
``os_error`` finds it in the exception chain. Saving through a Python file object (not a
path) is what keeps it there: torch's own file writer reports only "iostream error".
"""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, NoReturn

import torch

from . import distributed


@dataclass(frozen=True)
class Failure:
    """A write that failed on this rank: what it was, where it went, why, and the setting
    that points it elsewhere."""

    what: str  # "checkpoint step_000000080", "the final weights", ...
    path: Path  # the file, or the directory of a checkpoint
    error: OSError
    setting: str  # the config key (and launcher variable) that chooses ``path``

    def __str__(self) -> str:
        e = self.error
        if e.errno:
            why = f"{e.strerror or os.strerror(e.errno)} (errno {e.errno})"
        else:
            why = str(e) or type(e).__name__
        return f"{self.what} could not be written to {self.path}: {why}"


class WriteFailed(Exception):
    """A write failed on some rank; every rank raises it at the same point with the same text."""

    def __init__(self, failures: list[tuple[int, Failure]]):
        self.failures = failures  # (rank, what it saw), rank order; never empty
        rank, first = failures[0]
        ranks = [r for r, _ in failures]
        where = f"rank {rank}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks[:8]))}" + (
            ", ..." if len(ranks) > 8 else "")
        self.first = first
        super().__init__(f"{first} (on {where})")


def os_error(e: BaseException) -> OSError | None:
    """The OSError that caused ``e`` (``e`` itself, or one in its chain), or None."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, OSError):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


@dataclass(frozen=True)
class Sum:
    """A file's CRC-32 and size: what a checkpoint's meta.json records of each file, and what
    restoring checks (bert/checkpoint.py). CRC-32 because it is what bit rot needs (every burst of
    up to 32 flipped bits, anything else but 1 in 2^32) at several times a cryptographic hash's
    speed (BENCHMARKS.md section 10); a checkpoint is guarded against accidents, not against an
    attacker."""

    crc32: str  # 8 hex digits
    size: int

    def as_dict(self) -> dict[str, Any]:
        return {"crc32": self.crc32, "bytes": self.size}


class _Summing:
    """A file object that sums what is written through it (one pass: no second read)."""

    def __init__(self, f: Any):
        self.f, self.crc, self.size = f, 0, 0

    def write(self, data: Any) -> int:
        self.crc = zlib.crc32(data, self.crc)
        self.size += memoryview(data).nbytes
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()

    def sum(self) -> Sum:
        return Sum(f"{self.crc:08x}", self.size)


def sum_file(path: Path, chunk: int = 1 << 24) -> Sum:
    """The CRC-32 and size of a file as it is on disk (zlib releases the GIL on big blocks)."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            crc, size = zlib.crc32(block, crc), size + len(block)
    return Sum(f"{crc:08x}", size)


def _write_atomic(path: Path, write: Callable[[Any], None]) -> Sum:
    """``write(file)`` into ``path.part``, fsync, rename onto ``path``; the part file is
    removed when anything fails. Returns the sum of the bytes written."""
    tmp = path.with_name(path.name + ".part")
    try:
        with open(tmp, "wb") as f:
            summing = _Summing(f)
            write(summing)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return summing.sum()


def save_torch(obj: Any, path: Path) -> Sum:
    """torch.save, atomically (see the module docstring for why through a file object);
    returns the file's sum."""
    return _write_atomic(Path(path), lambda f: torch.save(obj, f))


def write_text(path: Path, text: str) -> Sum:
    return _write_atomic(Path(path), lambda f: f.write(text.encode()))


def attempt(what: str, path: Path, setting: str, write: Callable[[], None]) -> Failure | None:
    """Run ``write``; a failure caused by an OSError becomes this rank's ``Failure``. Any other
    exception is a bug, not the storage: raised as it is."""
    try:
        write()
    except Exception as e:
        err = os_error(e)
        if err is None:
            raise
        return Failure(what, Path(path), err, setting)
    return None


def check(failure: Failure | None, device: torch.device) -> None:
    """Every rank calls this at the same point: does any rank report a failed write? One
    4-byte all_reduce and a host sync (a no-op on one process); raises ``WriteFailed`` on
    every rank when some rank does."""
    flag = torch.tensor([failure is not None], dtype=torch.int32, device=device)
    if distributed.all_reduce_max(flag).item():
        raise_agreed(failure)


def raise_agreed(failure: Failure | None) -> NoReturn:
    """Every rank has learned, from one collective, that some rank's write failed: gather what
    each rank saw (a second collective, on this failure path only) and raise it everywhere."""
    seen = distributed.all_gather_object(failure)
    raise WriteFailed([(r, f) for r, f in enumerate(seen) if f is not None])
