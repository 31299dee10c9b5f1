"""The unit tier starts no process: a test here that tries fails at once, naming what it ran,
so the tier stays the fast, hermetic one `make test-fast` runs (tests that need a peer, a
launcher or a tool go in tests/integration/)."""

from __future__ import annotations

import _posixsubprocess
import os
import subprocess

import pytest

try:
    # matplotlib builds its font cache on its first import on a machine (it runs fc-list): a
    # process, started once per machine, not by the test that happens to plot first. Made here,
    # before the guard below, so a fresh machine's unit tier does not blame that test.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.font_manager  # noqa: F401
except ImportError:  # the [prep]/[tools] extras absent: the plotting tests skip
    pass


def _refuse(what: str):
    def refuse(*args, **kwargs):
        shown = next((a for a in args if isinstance(a, (list, tuple, bytes, str))), "")
        raise AssertionError(f"a unit test started a process ({what}: {shown!r}): "
                             "it belongs in tests/integration/")
    return refuse


@pytest.fixture(autouse=True)
def no_processes(monkeypatch):
    monkeypatch.setattr(subprocess, "_fork_exec", _refuse("subprocess"), raising=False)
    monkeypatch.setattr(_posixsubprocess, "fork_exec", _refuse("fork_exec"))
    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system", "execv", "execve"):
        if hasattr(os, name):
            monkeypatch.setattr(os, name, _refuse(f"os.{name}"))
