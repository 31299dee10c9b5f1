"""The image path: the Dockerfile built on a stand-in for NGC's PyTorch image
(tools/ngc_standin.sh: Debian, Python, the torch CPU wheel and NGC's pip constraint file) in a
private Docker Engine (tests/support/docker_engine.py; built in the background while the other tests
run, these last), and run_with_docker.sh running config_CPU_1x2.sh in it from the `trained`
demo model. The MLCommons compliance checker on the host judges the logs.

Every test here uses the ``docker_image`` fixture, and no test elsewhere does: the session's
main process starts the build when a test of this file is selected (conftest.py)."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from conftest import PKG, demo_run_env, mllog_events, run_checker
from docker_engine import IMAGE, run_with_docker

NOBODY = 65534  # a user that is not root, as docker's users usually are


def _launch_and_inspect(build, env: dict[str, str], user: int | None, container: str) -> tuple[int, str, dict]:
    """run_with_docker.sh (by ``user``: setpriv, reaching the engine through the socket's group)
    and ``docker inspect`` of its first run's container while that runs: (status, output, inspect)."""
    prefix = [] if user is None else ["setpriv", f"--reuid={user}", f"--regid={user}", f"--groups={build.socket_gid}"]
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen([*prefix, "./run_with_docker.sh"], cwd=PKG, env=env, stdout=out,
                                stderr=subprocess.STDOUT, text=True)
        inspect: dict = {}
        try:
            while proc.poll() is None and not inspect:
                r = build.docker("inspect", container, timeout=30)
                inspect = json.loads(r.stdout)[0] if r.returncode == 0 else {}
                time.sleep(0.5)
            rc = proc.wait(timeout=600)
        finally:
            if proc.poll() is None:
                proc.kill()
        out.seek(0)
        return rc, out.read(), inspect


def _readable_by_others(path: Path) -> bool:
    return all(p.stat().st_mode & stat.S_IXOTH for p in [path, *path.parents])


@pytest.fixture
def user_home():
    """A directory that a user without root can reach (pytest's temporary ones are 0700)."""
    home = Path(tempfile.mkdtemp(prefix="bert-docker-user-"))
    os.chmod(home, 0o755)
    try:
        yield home
    finally:
        shutil.rmtree(home)


def test_image_trains_the_demo_with_run_with_docker(docker_image, trained, demo_data, user_home):
    """The image keeps the base's torch and numpy pins; run_with_docker.sh, NEXP=2, by a user
    that is not root: both runs reach the target in the container, their logs pass the 5.0.0
    checker on the host and are the user's, seeds differ, cache_clear tells the truth."""
    assert trained.returncode == 0, trained.stdout[-3000:]
    # The base's pins (its constraint file, inherited) are what the image has; pip sees no conflict.
    r = docker_image.docker("run", "--rm", IMAGE, "sh", "-c", "python -c 'import torch, numpy; "
                            "print(f\"torch=={torch.__version__} numpy=={numpy.__version__}\")' && pip check && "
                            "cat \"$PIP_CONSTRAINT\"")
    assert r.returncode == 0 and "No broken requirements" in r.stdout, r.stdout + r.stderr
    versions, _, base_pins = r.stdout.partition("\n")
    assert set(versions.split()) <= set(base_pins.split()), r.stdout
    assert "numpy==1.26.4" in versions  # the stand-in's numpy, not constraints.txt's

    # The user's own data and model, as they would be (where the checkout is out of that
    # user's reach, as root: then the logs are root's and the page cache is dropped).
    user = NOBODY if _readable_by_others(PKG / "run_with_docker.sh") else None
    home = user_home
    data = home / "data"
    shutil.copytree(demo_data.root, data)
    ckpt = Path(shutil.copy2(trained.checkpoint, home / "model.pt"))
    if user is not None:
        for p in [home, *home.rglob("*")]:
            os.chown(p, user, user)
    env = demo_run_env(trained, demo_data, home / "logs", CONT=IMAGE, DATADIR=str(data / "train"),
                       EVALDIR=str(data / "eval"), INIT_CHECKPOINT=str(ckpt), NEXP="2", SEED="11",
                       DATESTAMP="dk", SUBMISSION_PLATFORM="docker-test", HOME=str(home),
                       # the user's own PATH: demo_data.path's links live under root's 0700 pytest dir
                       PATH=os.environ["PATH"], **docker_image.client_env)
    rc, out, inspect = _launch_and_inspect(docker_image, env, user, "mlperf-bert-dk-1")
    assert rc == 0 and "2 run(s), 0 failed; exit status 0" in out, out[-4000:]
    assert "1 node x 2 rank(s), 2 run(s)" in out and "GPUs: none" in out, out[-4000:]
    assert out.count("compliance checker (5.0.0): PASS") == 2 and out.count("RESULT,bert,") == 2, out[-4000:]
    not_dropped = "could not drop the page cache" in out
    assert not_dropped == (user is not None), out[-4000:]  # only root may drop it here
    # Before the checker runs here (as root: it writes compliance_checker.log beside the logs).
    owners = {p.name: (p.stat().st_uid, p.stat().st_gid) for p in (home / "logs").rglob("*")}
    assert set(owners.values()) == {(user or 0, user or 0)}, owners
    seeds = []
    for i in (1, 2):
        log = home / "logs" / f"dk_{i}.log"
        ok, checker = run_checker(log)
        assert ok, checker
        events = mllog_events(log)
        keys = {e["key"]: e for e in events}
        seeds.append(keys["seed"]["value"])
        assert keys["cache_clear"]["value"] is not not_dropped
        assert keys["submission_platform"]["value"] == "docker-test"  # run_and_time.sh's inputs reach it
        assert keys["run_stop"]["metadata"]["status"] == "success"
        assert max(e["value"] for e in events if e["key"] == "eval_accuracy") >= 0.72
        dumped = json.loads(log.with_name(log.stem + "_config.json").read_text())
        assert dumped["resolved"]["world_size"] == 2 and dumped["data"]["train_dir"] == str(data / "train")
        assert (home / "logs" / f"dk_{i}_compliance.txt").exists()
    assert seeds == [11, 12]
    # The container as the launcher set it up: the caller's uid:gid, host network and IPC, no
    # GPU, each path at its own path, only the logs writable.
    assert inspect, "the first run's container was never seen running"
    host = inspect["HostConfig"]
    assert inspect["Config"]["User"] == f"{user or 0}:{user or 0}"
    assert host["NetworkMode"] == "host" and host["IpcMode"] == "host" and not host.get("DeviceRequests")
    mounts = {m["Source"]: m["RW"] for m in inspect["Mounts"] if m["Source"] == m["Destination"]}
    assert mounts == {str(home / "logs"): True, str(data / "train"): False, str(data / "eval"): False,
                      str(home): False}, inspect["Mounts"]


def test_run_with_docker_bad_data_is_the_same_error_as_outside(docker_image, trained, demo_data, tmp_path):
    """A DATADIR with no shards: the trainer's own message from inside the container, word
    for word the one it gives outside (the container sees the same path), and exit 2."""
    empty = tmp_path / "empty"
    empty.mkdir()
    env = demo_run_env(trained, demo_data, tmp_path / "logs", DATADIR=str(empty))
    outside = subprocess.run(["./run_and_time.sh"], cwd=PKG, env=env, capture_output=True, text=True, timeout=300)
    # Every rank says it; the order the two ranks' lines arrive in is not fixed.
    errors = sorted(line for line in outside.stderr.splitlines() if line.startswith("error:"))
    assert outside.returncode == 2 and errors and str(empty) in errors[0], outside.stderr
    env.update(CONT=IMAGE, CLEAR_CACHES="0", CHECK_COMPLIANCE="0", DATESTAMP="bad", **docker_image.client_env)
    r = run_with_docker(env)
    out = r.stdout + r.stderr
    assert r.returncode == 2 and "1 failed; exit status 2" in out, out[-4000:]
    assert sorted(line for line in r.stderr.splitlines() if line.startswith("error:")) == errors, out[-4000:]
    assert "Traceback" not in out and "RESULT," not in out
