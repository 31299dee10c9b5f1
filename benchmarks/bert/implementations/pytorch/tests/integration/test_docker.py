"""The image path without the image: the base image's pins, the reaping of a killed session's
engine, and run_with_docker.sh's checks of its input (before any docker call). The tests that
need the built image are in tests/integration/test_image.py."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from docker_engine import reap_stale, run_with_docker


def test_a_killed_sessions_engine_is_reaped_and_a_live_ones_kept(tmp_path):
    """pytest killed by SIGTERM skips its teardown: the next session's engine start removes the
    dead one's directory and its tmpfs; a live session's (its pid running) and one still
    starting (no pid file yet) are left alone."""
    dead, live, starting = (tmp_path / f"bert-docker-{n}" for n in ("dead", "live", "starting"))
    for d in (dead, live, starting):
        (d / "data").mkdir(parents=True)
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid that ran and ended: no process has it now
    (dead / "dockerd.pid").write_text(f"{gone.pid}\n")
    (live / "dockerd.pid").write_text(f"{os.getpid()}\n")
    mounted = os.geteuid() == 0 and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "bert-docker-test", str(dead / "data")]).returncode == 0
    try:
        assert reap_stale(tmp_path) == [dead]
        assert not dead.exists() and (live / "data").is_dir() and (starting / "data").is_dir()
        if mounted:
            assert str(dead / "data") not in Path("/proc/self/mounts").read_text()
    finally:
        subprocess.run(["umount", "-l", str(dead / "data")], capture_output=True)


def test_run_with_docker_checks_its_input_before_running(demo_data, tmp_path):
    """Missing variables, then missing paths, then more than one node: exit 2, each named,
    nothing run or written (docker would create a missing mount source as root), as run.sub."""
    base = {"PATH": os.environ["PATH"]}
    r = run_with_docker(base)
    assert r.returncode == 2 and "missing variable(s): DGXSYSTEM DGXNGPU CONT DATADIR EVALDIR" in r.stderr, r.stderr
    env = dict(os.environ, **demo_data.env, CONT="no-such-image", DATADIR=str(tmp_path / "nope"),
               EVALDIR=str(demo_data.eval), INIT_CHECKPOINT=str(tmp_path / "model.pt"), LOGDIR=str(tmp_path / "logs"))
    r = run_with_docker(env)
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"DATADIR={tmp_path / 'nope'} (no such directory)" in r.stderr and "INIT_CHECKPOINT=" in r.stderr
    assert "EVALDIR" not in r.stderr and "nothing was run" in r.stderr
    assert not (tmp_path / "logs").exists() and not (tmp_path / "nope").exists()
    env.update(DATADIR="/usr/share", INIT_CHECKPOINT="")  # a mount there would hide the image's own files
    r = run_with_docker(env)
    assert r.returncode == 2 and "/usr/share: the image's own directory" in r.stderr, r.stderr
    env.update(DATADIR=str(demo_data.train), DGXNNODES="2")
    r = run_with_docker(env)
    assert r.returncode == 2 and "DGXNNODES=2" in r.stderr and "sbatch run.sub" in r.stderr, r.stderr
