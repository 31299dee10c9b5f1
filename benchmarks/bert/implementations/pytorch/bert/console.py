"""What a person reads while a run goes: the progress, evaluation, checkpoint and verdict
lines. Modules log them through ``logging`` (loggers under "bert"); ``rank_zero`` sends them
to stdout, from rank 0 only, for the duration of a run. Errors every rank must report go
through ``bert.distributed.rank_line`` instead (stderr, one write per line)."""

from __future__ import annotations

import contextlib
import logging
import sys
from typing import Iterator

ROOT = "bert"


class _Stdout(logging.Handler):
    """Writes to whatever ``sys.stdout`` is when a record comes (a redirect, pytest's capture),
    flushed at once: launchers and tests read the lines as they come."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stdout.write(self.format(record) + "\n")
            sys.stdout.flush()
        except Exception:  # noqa: BLE001 - logging's contract: report, never raise from emit
            self.handleError(record)


class RankZero(logging.Filter):
    """Passes records on rank 0 only: every rank runs the same code and logs the same lines."""

    def __init__(self, is_main: bool) -> None:
        super().__init__()
        self.is_main = is_main

    def filter(self, record: logging.LogRecord) -> bool:
        return self.is_main


@contextlib.contextmanager
def rank_zero(is_main: bool) -> Iterator[logging.Logger]:
    """The "bert" loggers print plain lines on stdout, rank 0's only, until the block ends
    (then the logger is as it was: a process may run several times, as tests do)."""
    logger = logging.getLogger(ROOT)
    handler = _Stdout()
    handler.setFormatter(logging.Formatter("%(message)s"))
    handler.addFilter(RankZero(is_main))
    level, propagate = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False  # the root logger's handlers (pytest's, a library's) would print it twice
    try:
        yield logger
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate
