"""``python -m bert.train`` with one point of the run held until a test's fault has reached it.

    python tests/held_train.py --hold WHERE:RANK:STEP:UNTIL --held-dir DIR -- <bert.train arguments>

A fault test that sends its fault "after step 5" and hopes it lands before the run's natural
end races the machine: on a fast idle one the run is over first. Held here, the run cannot
move past the point until the fault is there, whatever the speed. The trainer is the real
one, started as the launchers start it; only the hold is added, from outside (the functions
below wrap bert.resume's, which both loops call).

WHERE (for rank RANK, ``*`` = every rank, at optimizer step STEP):
  boundary     after the step, before its checkpoint poll (``Checkpointer.at_boundary``)
  checkpoint   once the checkpoint of that step is complete (renamed into place)
  writing      inside that checkpoint's write, before this rank's own file (rank 0's files
               are in place meanwhile; it then waits in the collective that ends the write)
UNTIL:
  signal       the rank's stop flag is set (SIGTERM / SIGUSR1 / SIGINT reached its handler)
  file=NAME    DIR/NAME exists (the test releases it)
  never        forever (the test kills it)

On reaching the hold the rank writes ``DIR/held_rank<R>_step<STEP>`` (the test waits for it).
While one rank is held, the others wait in their next collective (up to dist.timeout_s).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the package, from any cwd

from bert import distributed, resume, storage, train  # noqa: E402


def _install(where: str, rank: str, step: int, until: str, held_dir: Path) -> None:
    me = distributed.launch_rank()
    if rank not in ("*", str(me)):
        return

    def hold(stop: resume.StopFlag | None) -> None:
        marker = held_dir / f"held_rank{me}_step{step}"
        marker.write_text(f"{os.getpid()}\n")
        while True:
            if until == "signal" and stop is not None and (stop.signum or stop.interrupted):
                return
            if until.startswith("file=") and (held_dir / until[5:]).exists():
                return
            time.sleep(0.01)

    if where == "boundary":
        at_boundary = resume.Checkpointer.at_boundary

        def held_boundary(self, parts, state, say):
            if state.step == step:
                hold(self.stop)
            return at_boundary(self, parts, state, say)

        resume.Checkpointer.at_boundary = held_boundary
    elif where == "checkpoint":
        save = resume.Checkpointer.save

        def held_save(self, parts, state):
            path = save(self, parts, state)
            if state.step == step:
                hold(self.stop)
            return path

        resume.Checkpointer.save = held_save
    elif where == "writing":
        save_torch = storage.save_torch

        def held_save_torch(obj, path):
            p = Path(path)
            if p.name == f"rank_{me}.pt" and p.parent.name == f".step_{step:09d}.tmp":
                hold(None)
            return save_torch(obj, p)

        storage.save_torch = held_save_torch
    else:
        raise SystemExit(f"held_train.py: unknown hold point {where!r}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hold", action="append", default=[], help="WHERE:RANK:STEP:UNTIL")
    ap.add_argument("--held-dir", type=Path, required=True)
    ap.add_argument("rest", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    args.held_dir.mkdir(parents=True, exist_ok=True)
    for spec in args.hold:
        where, rank, step, until = spec.split(":", 3)
        _install(where, rank, int(step), until, args.held_dir)
    rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
    return train.main(rest)


if __name__ == "__main__":
    distributed.exit_process(main())
