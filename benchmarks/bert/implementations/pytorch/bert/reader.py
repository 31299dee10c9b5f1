"""Every read of training or eval data, under every guard: the one road all samples take.

A ``ShardReader`` serves one data directory (a plain directory of shards, a strata
directory, the eval set), whatever the sampling mode, the layout or the thread: whole shards
(the closed division's shard order, the length index, the eval set) and rows by id (every
other sampling mode). Each read of a file

- runs under the watchdog (bert/watchdog.py): the rank that waits for it waits at most
  ``data.read_timeout_s`` per file, and a stop (SIGTERM, Ctrl-C) ends the wait;
- is checked against the directory's md5 list (bert/integrity.py; a strata directory's
  ``md5sums.txt`` lists its stratum files), each file hashed the first time this process
  reads it;
- is decoded by bert/shards.py, which checks its structure and values and, with the
  model's ``Bounds``, what the model can take, rows by id as whole shards.

Torch-free.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Callable

import numpy as np

from . import watchdog
from .integrity import Manifest
from .shards import Bounds, Findings, Shard, Specials, read_rows, read_shard, read_stored, scan_shard, shard_size


class ShardReader:
    """Reads the shards of ``root`` (and its subdirectories, for strata) under every guard.

    ``bounds``: what the model can take (None: structure and values only); ``verify_md5``:
    check against ``root/md5sums.txt`` where there is one; ``timeout_s``: the watchdog's
    bound per file (``timeout_key``: the setting that sets it, for messages); ``stopped()``:
    why the run must stop now, asked while a wait polls."""

    def __init__(self, root: str | Path, *, max_seq_length: int | None, bounds: Bounds | None, verify_md5: bool,
                 timeout_s: float, stopped: Callable[[], str | None] | None = None,
                 timeout_key: str = "data.read_timeout_s"):
        self.root = Path(root)
        self.manifest = Manifest.find(self.root) if verify_md5 else None
        self.max_seq_length, self.bounds = max_seq_length, bounds
        self.timeout_s, self.stopped, self.timeout_key = timeout_s, stopped, timeout_key

    def only(self, paths: list[Path]) -> ShardReader:
        """This reader for ``paths`` alone (the md5 list's entries of those files, what is
        verified of them kept): what a worker process that reads them is handed."""
        part = copy.copy(self)
        part.manifest = self.manifest.only(paths) if self.manifest is not None else None
        return part

    def whole(self, read: watchdog.Read, path: Path) -> Shard:
        """Every sample of ``path``; inside ``read`` (``start``/``wait``)."""
        read.at(path)
        if self.manifest is not None:
            self.manifest.check(path)
        return read_shard(path, self.max_seq_length, self.bounds)

    def rows(self, read: watchdog.Read, path: Path, rows: np.ndarray) -> Shard:
        """Rows ``rows`` of ``path`` in that order; inside ``read``."""
        read.at(path)
        if self.manifest is not None:
            self.manifest.check(path)
        return read_rows(path, rows, self.max_seq_length, self.bounds)

    def scan(self, read: watchdog.Read, path: Path, specials: Specials | None = None) -> Findings:
        """Every defect of every sample of ``path`` (``shards.scan_shard``: what ``check``
        counts), in the words ``whole`` raises; inside ``read``. A file that differs from the md5
        list raises instead: that is its copy's fault, not a defect of the shard it was made as."""
        read.at(path)
        if self.manifest is not None:
            self.manifest.check(path)
        return scan_shard(path, self.max_seq_length, self.bounds, specials)

    def stored(self, read: watchdog.Read, path: Path) -> Shard:
        """Every sample of ``path`` as stored, no rule judged (``shards.read_stored``: a second look
        at samples ``scan`` has judged); inside ``read``."""
        read.at(path)
        if self.manifest is not None:
            self.manifest.check(path)
        return read_stored(path)

    def size(self, read: watchdog.Read, path: Path) -> int:
        """Samples in ``path``, from its metadata (no data read, nothing hashed); inside ``read``."""
        read.at(path)
        return shard_size(path)

    def start(self, what: str | Path, fn: Callable[[watchdog.Read], Any]) -> watchdog.Read:
        """``fn(read)`` in a thread of its own, under the bound; its ``result()`` waits."""
        return watchdog.Read(what, fn, self.timeout_s, self.stopped, timeout_key=self.timeout_key)

    def wait(self, what: str | Path, fn: Callable[[watchdog.Read], Any]) -> Any:
        """``fn(read)`` under the bound, waited for here."""
        return self.start(what, fn).result()
