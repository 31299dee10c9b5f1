"""Reads that cannot hang: every shard and eval read runs in a thread of its own, and whoever
needs its data waits at most ``data.read_timeout_s`` per file, polling, never forever.

A damaged hdf5 file (4 KiB of zeros where a sector was lost) can make HDF5 spin inside one
call, for good: a wait without a bound (``future.result()``) then hangs the rank, its peers
time out, and the launcher waits forever. HDF5's spin cannot be stopped from Python, but
h5py releases the GIL while HDF5 works, so the waiting thread runs on: past the bound it
raises ``DataError`` naming the file, and the run ends (exit 2) with the stuck thread still in
it (daemon threads: the process exits without joining them). A thread per read costs ~50 us.

The wait also ends when the run is asked to stop (``stopped``: SIGTERM, SIGUSR1, Ctrl-C):
the signal's handler runs in the waiting (main) thread at its next poll, and a rank that
waits for data cannot reach the step boundary where a stop is agreed, so it raises
``Stopped`` instead of waiting out the bound.

``Read.failure`` lets the checkpoint poll find a read that failed or overran while the loop
was still busy with the data before it, so every rank learns of it at one poll. An
``OSError`` inside a read (a file removed, an I/O error) is a ``DataError`` naming the file
being read: bad input, exit 2, whichever code hit it.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any, Callable

from .shards import DataError

POLL_S = 0.5  # how often a waiting thread wakes (its signal handlers run, the clock is read)


class Stopped(Exception):
    """The run was asked to stop (``why``: what asked) while this rank waited for ``what``."""

    def __init__(self, why: str, what: str, waited_s: float):
        super().__init__(f"{why} while waiting {waited_s:.0f} s for {what} (a read not finished; "
                         "data.read_timeout_s bounds it): no checkpoint written, as no rank can reach the "
                         "step where the ranks agree on one")
        self.why = why


class Read:
    """``fn(read)`` running in a daemon thread; ``fn`` calls ``read.at(path)`` before each file,
    which names it in messages and starts its clock. ``stopped()``: why the run must stop
    now ("" or None: it need not), asked while a wait polls; ``timeout_key``: the setting
    that sets the bound, named when a read overruns it."""

    def __init__(self, what: str | Path, fn: Callable[[Read], Any], timeout_s: float,
                 stopped: Callable[[], str | None] | None = None, *, timeout_key: str = "data.read_timeout_s"):
        self.what, self.timeout_s, self.stopped, self.timeout_key = str(what), timeout_s, stopped, timeout_key
        self.started = time.monotonic()
        self.future: Future = Future()
        threading.Thread(target=self._run, args=(fn,), daemon=True, name="bounded-read").start()

    def _run(self, fn: Callable[[Read], Any]) -> None:
        try:
            self.future.set_result(fn(self))
        except OSError as e:  # whatever raised it, a file of this read: name it
            self.future.set_exception(DataError(f"{self.what}: cannot read: {e}"))
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits
            self.future.set_exception(e)

    def at(self, path: str | Path) -> None:
        self.what, self.started = str(path), time.monotonic()

    def _overdue(self) -> str | None:
        if self.future.done() or time.monotonic() - self.started <= self.timeout_s:
            return None
        return (f"{self.what}: reading took longer than {self.timeout_key}={self.timeout_s:g} s: a damaged file "
                "(HDF5 can spin for good on a lost sector) or a hung filesystem; check the directory against "
                "its md5sums.txt (python -m input_preprocessing verify --input DIR)")

    def failure(self) -> str | None:
        """Why this read cannot deliver (it failed on bad data, or overran), or None (done
        well, or still within its bound). No waiting."""
        if self.future.done():
            err = self.future.exception()
            return str(err) if isinstance(err, DataError) else None
        return self._overdue()

    def result(self) -> Any:
        """The data; ``DataError`` once a file has taken longer than the bound, ``Stopped``
        when the run is asked to stop while it waits."""
        waiting = time.monotonic()
        while True:
            try:
                return self.future.result(timeout=POLL_S)
            except FutureTimeout:
                late = self._overdue()
                if late:
                    raise DataError(late) from None
                why = self.stopped() if self.stopped is not None else None
                if why:
                    raise Stopped(why, self.what, time.monotonic() - waiting) from None


    def settle(self) -> None:
        """Wait, at most until the read overruns its bound, for it to end, whatever it ends
        with: a reader that is let go waits for its read in flight, which holds h5py's lock,
        so that the process does not begin to exit under it (a daemon thread inside h5py at
        interpreter exit deadlocks the exit)."""
        while not self.future.done() and self._overdue() is None:
            try:
                self.future.exception(timeout=POLL_S)
            except FutureTimeout:
                pass


def read(what: str | Path, fn: Callable[[Read], Any], timeout_s: float,
         stopped: Callable[[], str | None] | None = None) -> Any:
    """``fn`` under the bound, waited for here."""
    return Read(what, fn, timeout_s, stopped).result()
