"""Processes that end with the process that launched them (Linux's parent-death signal).

``run_and_time.sh`` starts torchrun, torchrun starts the training processes. Killed by a
signal it cannot trap (``kill -9``, the OOM killer), the script dies alone: torchrun and its
workers are reparented to PID 1 and train on, writing checkpoints and the log that a requeued
run then shares. Tethered, each ends with its parent: ``PR_SET_PDEATHSIG`` has the kernel
send it SIGKILL when the thread that forked it exits, and it survives ``execve``.

Two pieces, both called by the launcher scripts:

* ``python -m bert.tether --parent PID -- COMMAND ...`` (what run_and_time.sh runs torchrun
  through): tethers itself to PID, exports ``BERT_PARENT_PID`` = its own PID (the PID
  COMMAND keeps: exec replaces the program, not the process), then execs COMMAND.
* ``tether(parent)`` (bert.distributed.tether_to_launcher, at the start of every training
  process that ``BERT_PARENT_PID`` names a parent for): the same for the process itself.

A parent that died before the call would never send the signal: after arming it, each
checks that its parent is still ``parent`` and ends at once if not. Costs one system call;
this module imports nothing heavy (the wrapper starts in ~20 ms, before torchrun's import).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import sys

PARENT_VAR = "BERT_PARENT_PID"  # read only by bert.distributed (the one reader of the environment)
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
EXIT_ORPHANED = 129  # 128 + SIGHUP, what a shell reports for a job whose terminal went away


def tether(parent: int, signum: int = signal.SIGKILL) -> bool:
    """Arm the parent-death signal for this process; False when ``parent`` is no longer its
    parent (it died before the signal was armed). A no-op (True) off Linux."""
    if not sys.platform.startswith("linux"):
        return True
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG): {os.strerror(err)}")
    return os.getppid() == parent


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bert.tether", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parent", type=int, required=True, help="the PID this process must end with")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ARGS...")
    args = ap.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        ap.error("no command to run")
    if not tether(args.parent):
        print(f"bert.tether: parent {args.parent} ended before {command[0]} started: not starting it",
              file=sys.stderr)
        return EXIT_ORPHANED
    os.environ[PARENT_VAR] = str(os.getpid())  # COMMAND keeps this PID; its children tether to it
    try:
        os.execvp(command[0], command)
    except OSError as e:
        print(f"bert.tether: cannot run {command[0]}: {e.strerror}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(main())
