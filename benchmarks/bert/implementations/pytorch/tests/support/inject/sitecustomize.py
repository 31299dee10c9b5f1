"""Holds for fault tests, injected into the real trainer from outside: every Python process
started with this directory on PYTHONPATH imports this module first (site.py's
``sitecustomize``), and where ``BERT_TEST_HOLD`` is set it wraps a few of bert.checkpoint's
functions as soon as that module is imported. Nothing else changes, so the trainer runs as
the launchers start it (directly, under torchrun, under srun in a SLURM job).

A fault test that sends its fault "after step 5" and hopes it lands before the run's natural
end races the machine: on a fast idle one the run is over first. Held, the run cannot move
past the point until the fault is there, whatever the speed.

    BERT_TEST_HOLD="WHERE:RANK:STEP:UNTIL[:if=TEXT][;...]"  BERT_TEST_HELD_DIR=DIR

WHERE (for rank RANK, ``*`` = every rank, at optimizer step STEP):
  boundary     after the step, before its checkpoint poll (``Checkpointer.at_boundary``)
  checkpoint   once the checkpoint of that step is complete (renamed into place)
  writing      inside that checkpoint's write, before this rank's own file (rank 0's files
               are in place meanwhile; it then waits in the collective that ends the write)
  poison       not a hold: after the step, this rank's first weight is set to NaN (a run
               that diverges there; UNTIL is ignored)
UNTIL:
  signal       the rank's stop flag is set (SIGTERM / SIGUSR1 / SIGINT reached its handler)
  file=NAME    DIR/NAME exists (the test releases it)
  never        forever (the test kills it)

if=TEXT: only a process whose arguments hold TEXT (``log.log_file=x.log``) or whose
environment has it (``LOGFILE=rq_2.log``: one run of a job's several, as run.sub hands it
to run_and_time.sh; ``SLURM_ARRAY_TASK_ID=0``).

A hold holds once per held directory: the rank that reaches it first creates
``DIR/held_rank<R>_step<STEP>`` (its PID; the test waits for it) and waits; a rank that finds
it there goes on (a requeued run passing the same step again, a second run at once).
While one rank is held the others wait in their next collective (dist.timeout_s).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
import time
from pathlib import Path

SPEC, HELD_DIR = os.environ.get("BERT_TEST_HOLD", ""), os.environ.get("BERT_TEST_HELD_DIR", "")


def _install(checkpoint, where: str, rank: str, step: int, until: str, held_dir: Path, only: str) -> None:
    from bert import distributed, storage

    me = distributed.launch_rank()
    if rank not in ("*", str(me)) or (only and only not in sys.argv and only not in
                                      {f"{k}={v}" for k, v in os.environ.items()}):
        return

    def hold(stop) -> None:
        held_dir.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(held_dir / f"held_rank{me}_step{step}", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        except FileExistsError:
            return  # held once already
        os.write(fd, f"{os.getpid()}\n".encode())
        os.close(fd)
        while not ((until == "signal" and stop is not None and (stop.signum or stop.interrupted))
                   or (until.startswith("file=") and (held_dir / until[5:]).exists())):
            time.sleep(0.01)

    if where == "poison":
        at_boundary = checkpoint.Checkpointer.at_boundary

        def poisoned_boundary(self, learner, state, *rest):
            if state.step == step:
                import torch

                with torch.no_grad():
                    next(learner.model.parameters()).fill_(float("nan"))
            return at_boundary(self, learner, state, *rest)

        checkpoint.Checkpointer.at_boundary = poisoned_boundary
    elif where == "boundary":
        at_boundary = checkpoint.Checkpointer.at_boundary

        def held_boundary(self, learner, state, *rest):
            if state.step == step:
                hold(self.stop)
            return at_boundary(self, learner, state, *rest)

        checkpoint.Checkpointer.at_boundary = held_boundary
    elif where == "checkpoint":
        save = checkpoint.Checkpointer.save

        def held_save(self, learner, state, *rest):
            path = save(self, learner, state, *rest)
            if state.step == step:
                hold(self.stop)
            return path

        checkpoint.Checkpointer.save = held_save
    elif where == "writing":
        save_torch = storage.save_torch

        def held_save_torch(obj, path):
            p = Path(path)
            if p.name == f"rank_{me}.pt" and p.parent.name == f".step_{step:09d}.tmp":
                hold(None)
            return save_torch(obj, p)

        storage.save_torch = held_save_torch
    else:
        raise SystemExit(f"BERT_TEST_HOLD: unknown hold point {where!r}")


class _AfterCheckpoint(importlib.abc.MetaPathFinder):
    """Finds bert.checkpoint as usual, and installs the holds once it has been executed."""

    def find_spec(self, name, path, target=None):
        if name != "bert.checkpoint":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            for item in filter(None, SPEC.split(";")):
                where, rank, step, rest = item.split(":", 3)
                until, _, only = rest.partition(":if=")
                _install(module, where, rank, int(step), until, Path(HELD_DIR), only)

        spec.loader.exec_module = exec_module
        return spec


if SPEC:
    sys.meta_path.insert(0, _AfterCheckpoint())
