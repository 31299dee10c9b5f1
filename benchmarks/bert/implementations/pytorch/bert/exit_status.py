"""The exit statuses of a training run, in one place: ``python -m bert.train`` returns them,
``run_and_time.sh`` passes the worst rank's on, ``run.sub`` acts on them, and the docs list
them; tests check each of those against this enum."""

from __future__ import annotations

import enum


class ExitStatus(enum.IntEnum):
    SUCCESS = 0
    NOT_CONVERGED = 1
    BAD_INPUT = 2
    PREEMPTED = 3
    PEER_FAILED = 4
    WRITE_FAILED = 5
    DIVERGED = 6
    INTERRUPTED = 130  # 128 + SIGINT, what shells report for Ctrl-C

    @property
    def meaning(self) -> str:
        return _MEANING[self]


# The README's table says the same, word for word (tests/unit/test_exit_status.py).
_MEANING = {
    ExitStatus.SUCCESS: "target reached (`run_stop` `success`); `run.mode=pretrain`: the phase ran to its last step",
    ExitStatus.NOT_CONVERGED: "sample limit reached first (`run_stop` `aborted`)",
    ExitStatus.BAD_INPUT: "bad configuration, input file or checkpoint (nothing is written)",
    ExitStatus.PREEMPTED: "stopped by SIGTERM/SIGUSR1 after writing a checkpoint: run the same command again to resume",
    ExitStatus.PEER_FAILED: "a peer rank died or a collective timed out",
    ExitStatus.WRITE_FAILED: "a file could not be written (a checkpoint, the final weights, the resolved config, the "
                             "MLPerf log: a full disk, any `OSError`); every rank says which and why, and which "
                             "complete checkpoint the same command resumes from (`run_stop` `aborted`)",
    ExitStatus.DIVERGED: "the run diverged: the loss stayed NaN/inf for `run.max_nonfinite_steps` steps, or the "
                         "weights hold NaN/inf (`run_stop` `aborted`); no checkpoint and no final weights are written "
                         "from such a state, and the newest finite checkpoint is kept",
    ExitStatus.INTERRUPTED: "stopped by Ctrl-C (SIGINT; `run_stop` `aborted`); a second Ctrl-C ends the run at once",
}


def describe() -> str:
    """One line per status, for ``--help``."""
    return "\n".join(f"  {s.value:3d}  {s.meaning}" for s in ExitStatus)


def markdown_table() -> str:
    """The README's table."""
    return "\n".join(["| status | meaning |", "|---|---|", *(f"| {s.value} | {s.meaning} |" for s in ExitStatus)])
