"""A private Docker Engine for tests/integration/test_image.py, and the image built in it in the background.

dockerd runs as root with its data root, exec root, pid file and socket in a temporary
directory, so it shares nothing with a system engine or another session's. It starts with
``--iptables=false --bridge=none`` (its default iptables setup turns the FORWARD policy to DROP,
which silently breaks the two-node cluster of tests/support/slurm_cluster.py), so builds and runs use
the host's network; it is ended by its PID, and the host's firewall is left as it was.

The image takes minutes to make on a fresh machine (debootstrap, the stand-in's wheels, pip
inside ``docker build``), mostly waiting on the network and the disk. conftest.py starts it
when the session begins (``ImageBuild.start``), so that those minutes overlap the CPU-bound
tests, and orders the tests that use it last; they wait for it (``ImageBuild.wait``). Under
pytest-xdist the session's main process builds it and writes the outcome to ``result.json``
in the engine's directory; a worker's tests reach the same engine (``ImageBuild(env, root)``).
"""

from __future__ import annotations

import grp
import json
import os
import random
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

STANDIN = "ngc-standin:bookworm"
IMAGE = "mlperf-bert:test"
PKG = Path(__file__).resolve().parents[2]


def run_with_docker(env: dict[str, str], timeout: float = 600) -> subprocess.CompletedProcess:
    """./run_with_docker.sh with ``env``, its output captured."""
    return subprocess.run(["./run_with_docker.sh"], cwd=PKG, env=env, capture_output=True, text=True,
                          timeout=timeout)


def docker_unavailable() -> str | None:
    """Why a private engine cannot run here (None: it can)."""
    if os.geteuid() != 0:
        return f"dockerd and debootstrap need root (running as uid {os.geteuid()})"
    for tool, package in (("dockerd", "docker.io"), ("docker", "docker.io"), ("debootstrap", "debootstrap")):
        if shutil.which(tool) is None:
            return f"no {tool} on PATH: .ci/run installs {package}"
    return None


def _umount_below(root: Path) -> None:
    """Unmount everything mounted under ``root`` (deepest first): the data root's tmpfs, and
    what a killed dockerd leaves (overlay layers, netns files)."""
    mounts = [line.split()[1] for line in Path("/proc/self/mounts").read_text().splitlines()]
    for point in sorted((m for m in mounts if m.startswith(f"{root}/")), reverse=True):
        subprocess.run(["umount", "-l", point], capture_output=True)


def reap_stale(tmp: Path | None = None) -> list[Path]:
    """Remove the engines of sessions that ended without their teardown (pytest killed by
    SIGTERM or SIGKILL skips it): each ``bert-docker-*`` directory whose dockerd.pid names no
    running process loses its mounts (an 8 GiB tmpfs) and its files. A directory without a
    pid file is left alone: its session may be starting. Returns what was removed."""
    removed = []
    for root in sorted(Path(tmp or tempfile.gettempdir()).glob("bert-docker-*")):
        pidfile = root / "dockerd.pid"
        try:
            pid = int(pidfile.read_text().strip())
        except (OSError, ValueError):
            continue
        if Path(f"/proc/{pid}").exists():
            continue
        _umount_below(root)
        shutil.rmtree(root, ignore_errors=True)
        removed.append(root)
    return removed


def _group_exists(gid: int) -> bool:
    try:
        grp.getgrgid(gid)
    except KeyError:
        return False
    return True


@dataclass
class BuildResult:
    unavailable: str | None = None  # the engine could not start: the tests skip, saying why
    error: str | None = None  # a step failed: the tests fail with this
    seconds: dict[str, float] = field(default_factory=dict)  # step -> wall seconds
    standin_cached: bool = False


class ImageBuild:
    """dockerd, then tools/ngc_standin.sh, then ``docker build`` of the Dockerfile on the
    stand-in, in a background thread; every step's output in ``log``."""

    def __init__(self, env: dict[str, str], root: Path | None = None):
        """A new engine (``root`` None: this process owns it, builds it and stops it), or the one
        another process (the session's main one) builds in ``root``: then ``wait`` reads its
        ``result.json`` and ``stop`` leaves it to its owner."""
        self.owner = root is None
        # A short path: unix sockets (dockerd's, containerd's under the exec root) take 108 bytes.
        self.root = Path(tempfile.mkdtemp(prefix="bert-docker-")) if root is None else root
        self.log = self.root / "build.log"
        self.socket = self.root / "docker.sock"
        # What a docker client needs to reach this engine (DOCKER_CONFIG: not the user's ~/.docker).
        self.client_env = {"DOCKER_HOST": f"unix://{self.socket}", "DOCKER_CONFIG": str(self.root / "client")}
        self.env = dict(env, **self.client_env)
        self.socket_gid = -1  # the group that may use the socket (for a test user without root)
        self.result = BuildResult()
        self._dockerd: subprocess.Popen | None = None
        self._step: subprocess.Popen | None = None
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self.build, name="docker-image-build", daemon=True)

    @property
    def _published(self) -> Path:
        return self.root / "result.json"

    def start(self) -> None:
        self._thread.start()

    @property
    def started(self) -> bool:
        return self._thread.ident is not None

    def wait(self, timeout: float) -> BuildResult:
        if not self.owner:  # the owner writes result.json when its build ends
            deadline = time.monotonic() + timeout
            while not self._published.exists() and time.monotonic() < deadline:
                time.sleep(1)
            if not self._published.exists():
                self.result.error = f"the image build took over {timeout:.0f} s"
                return self.result
            state = json.loads(self._published.read_text())
            self.socket_gid = state.pop("socket_gid")
            self.result = BuildResult(**state)
            return self.result
        self._thread.join(timeout)
        if self._thread.is_alive():
            self.result.error = f"the image build took over {timeout:.0f} s"
        return self.result

    def log_tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def docker(self, *args: str, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(["docker", *args], env=self.env, capture_output=True, text=True, timeout=timeout, **kw)

    # -- the background thread -----------------------------------------------------------

    def build(self) -> None:
        """The background thread: dockerd, then the stand-in, then ``docker build`` on it; the
        outcome published for other processes (``ImageBuild(env, root)``), written whole (rename)."""
        try:
            self._build()
        finally:
            part = self._published.with_suffix(".part")
            part.write_text(json.dumps(dict(asdict(self.result), socket_gid=self.socket_gid)))
            part.rename(self._published)

    def _build(self) -> None:
        with self.log.open("a") as log:
            why = self._start_engine(log)
            if why:
                self.result.unavailable = why
                return
            for name, cmd in (("stand-in", [str(PKG / "tools" / "ngc_standin.sh"), STANDIN]),
                              ("docker build", ["docker", "build", "--network", "host", "--build-arg",
                                                f"FROM_IMAGE_NAME={STANDIN}", "-t", IMAGE, "."])):
                rc = self._run_step(name, cmd, log)
                if rc != 0:
                    self.result.error = f"{name} failed (exit {rc}); its log, {self.log}:\n{self.log_tail()}"
                    return
        cached = re.search(r"^ngc_standin: \[ *\d+ s\] cached: ", self.log.read_text(), re.M)
        self.result.standin_cached = cached is not None

    def _start_engine(self, log) -> str | None:
        for stale in reap_stale(self.root.parent):
            log.write(f"(removed {stale}: an engine whose session was killed before its teardown)\n")
        (self.root / "data").mkdir()
        (self.root / "exec").mkdir()
        # The data root in memory (about 1.5 GB: the stand-in and the image's layers): the
        # import writes no disk, and the end is one umount instead of minutes of deleting
        # the tens of thousands of files of torch's two copies under load.
        if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8g,mode=0711", "bert-docker", str(self.root / "data")],
                          stdout=log, stderr=subprocess.STDOUT).returncode != 0:
            log.write("(the data root stays on disk)\n")
        log.write("== dockerd\n")
        log.flush()
        self._dockerd = subprocess.Popen(
            ["dockerd", "--data-root", str(self.root / "data"), "--exec-root", str(self.root / "exec"),
             "--pidfile", str(self.root / "dockerd.pid"), "--host", f"unix://{self.socket}",
             "--iptables=false", "--ip6tables=false", "--bridge=none", "--storage-driver=overlay2"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 90:
            if self._dockerd.poll() is not None:
                return f"dockerd exited with status {self._dockerd.returncode}: {self.log_tail(600)}"
            if self._stopping.is_set():
                return "the session ended first"
            if self.socket.exists() and self.docker("version", timeout=30).returncode == 0:
                self.result.seconds["dockerd"] = time.monotonic() - t0
                self._share_socket()
                return None
            time.sleep(0.5)
        return f"dockerd did not answer within 90 s: {self.log_tail(600)}"

    def _share_socket(self) -> None:
        # The socket is as good as root: it goes to a group no account has, so only the
        # processes a test starts with that group (setpriv --groups) reach it.
        gid = random.Random().choice([g for g in range(40000, 60000) if not _group_exists(g)])
        os.chown(self.socket, 0, gid)
        os.chmod(self.socket, 0o660)
        os.chmod(self.root, 0o711)
        self.socket_gid = gid

    def _run_step(self, name: str, cmd: list[str], log) -> int:
        if self._stopping.is_set():
            return -1
        log.write(f"== {name}: {' '.join(cmd)}\n")
        log.flush()
        t0 = time.monotonic()
        # Its own session, so that stop() ends the step with everything it started (debootstrap's
        # chroots, docker's client) by the step's PID.
        self._step = subprocess.Popen(cmd, cwd=PKG, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True)
        rc = self._step.wait()
        self.result.seconds[name] = time.monotonic() - t0
        return rc

    # -- the end of the session ---------------------------------------------------------

    def stop(self) -> None:
        """End the build step (if any) and dockerd by their PIDs; remove the temporary directory
        (another process's engine is its owner's to stop)."""
        if not self.owner:
            return
        if not self.started:  # made for the workers, never needed
            shutil.rmtree(self.root, ignore_errors=True)
            return
        self._stopping.set()
        step = self._step
        if step is not None and step.poll() is None:
            os.killpg(step.pid, signal.SIGTERM)
            try:
                step.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(step.pid, signal.SIGKILL)
                step.wait()
        self._thread.join(timeout=60)
        if self._dockerd is not None and self._dockerd.poll() is None:
            self._dockerd.terminate()  # dockerd stops its containers and unmounts its layers
            try:
                self._dockerd.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self._dockerd.kill()
                self._dockerd.wait()
        _umount_below(self.root)
        shutil.rmtree(self.root, ignore_errors=True)
