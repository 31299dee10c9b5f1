"""Shared fixtures: the demo data, a model trained to the demo target, the MLPerf checker.

The expensive fixture (``trained``: 2 CPU ranks through run_and_time.sh with
config_CPU_1x2.sh, to 0.720) runs once per session; tests that need a converged model
start from its weights and reach the target at their first evaluation.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent
VENV_BIN = str(Path(sys.executable).parent)


def source_config(name: str) -> dict[str, str]:
    """The variables a config_*.sh exports, as a dict (sourced by bash, as users do)."""
    out = subprocess.run(["bash", "-c", f"set -a; source ./{name} >/dev/null; env -0"], cwd=PKG,
                         check=True, capture_output=True, env={"PATH": os.environ["PATH"]}).stdout
    env = dict(item.split("=", 1) for item in out.decode().split("\0") if "=" in item)
    return {k: v for k, v in env.items() if k not in ("PWD", "SHLVL", "_", "OLDPWD", "PATH")}


def run_checker(log: Path, ruleset: str = "5.0.0") -> tuple[bool, str]:
    """The MLCommons compliance checker on one log: (passed, its output)."""
    r = subprocess.run([sys.executable, "-m", "mlperf_logging.compliance_checker", "--usage", "training",
                        "--ruleset", ruleset, str(log)], capture_output=True, text=True, cwd=log.parent)
    out = r.stdout + r.stderr
    return r.returncode == 0 and "SUCCESS" in out, out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def end_process_group() -> None:
    """End a spawned test worker's gloo group. Both ranks are done before either tears it
    down: a rank destroying its group while the other still worked aborted once
    ("terminate called without an active exception")."""
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


def run_and_time_signalled(env: dict[str, str], at_step: int = 5, sig: int = signal.SIGUSR1) -> tuple[int, str]:
    """./run_and_time.sh with ``env``; ``sig`` to the script when its progress line for step
    ``at_step`` appears. Returns (exit status, output)."""
    proc = subprocess.Popen(["./run_and_time.sh"], cwd=PKG, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if re.match(rf"step +{at_step} \|", line):
                proc.send_signal(sig)
        rc = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    return rc, "".join(lines)


def mllog_events(log: Path) -> list[dict]:
    return [json.loads(line.split(":::MLLOG", 1)[1]) for line in log.read_text().splitlines() if ":::MLLOG" in line]


@dataclass
class DemoData:
    root: Path
    train: Path
    eval: Path
    env: dict[str, str]  # config_CPU_1x2.sh's variables


@pytest.fixture(scope="session")
def demo_data(tmp_path_factory) -> DemoData:
    """The demo dataset of config_CPU_1x2.sh's geometry, smaller (the model sees it ~2x)."""
    from bert import demo_data as gen

    env = source_config("config_CPU_1x2.sh")
    root = tmp_path_factory.mktemp("demo_data")
    gen.generate(root, train_samples=16000, eval_samples=1000, seed=1, seq_len=int(env["DEMO_SEQ_LEN"]),
                 max_pred=int(env["DEMO_MAX_PRED"]), vocab=int(env["DEMO_VOCAB"]), layout="variable", shards=4)
    return DemoData(root, root / "train", root / "eval", env)


@dataclass
class TrainedRun:
    checkpoint: Path
    log: Path
    stdout: str
    returncode: int


def demo_run_env(trained: TrainedRun, demo_data, logdir: Path, **extra: str) -> dict[str, str]:
    """config_CPU_1x2.sh's variables for run_and_time.sh / run.sub, from the trained demo
    model: the first eval (64 samples) reaches the target; a short eval set keeps it quick."""
    env = dict(os.environ, **demo_data.env)
    env.update(PATH=f"{VENV_BIN}:{os.environ['PATH']}", DATADIR=str(demo_data.train), EVALDIR=str(demo_data.eval),
               LOGDIR=str(logdir), INIT_CHECKPOINT=str(trained.checkpoint), LR="1e-4",
               EVAL_ITER_SAMPLES="64", MAX_SAMPLES_TERMINATION="640",
               EXTRA_PARAMS=demo_data.env["EXTRA_PARAMS"] + " data.eval_samples=500")
    env.update(extra)
    return env


@pytest.fixture(scope="session")
def trained(demo_data, tmp_path_factory) -> TrainedRun:
    """config_CPU_1x2.sh through run_and_time.sh (torchrun, 2 gloo ranks) to the target."""
    out = tmp_path_factory.mktemp("trained")
    env = dict(os.environ, **demo_data.env)
    env.update(PATH=f"{VENV_BIN}:{os.environ['PATH']}", DATADIR=str(demo_data.train), EVALDIR=str(demo_data.eval),
               LOGDIR=str(out), LOGFILE="result_0.txt", SEED="7", SAVE_CHECKPOINT=str(out / "model.pt"),
               EXTRA_PARAMS=demo_data.env["EXTRA_PARAMS"] + " data.eval_samples=1000")
    r = subprocess.run(["./run_and_time.sh"], cwd=PKG, env=env, capture_output=True, text=True, timeout=900)
    return TrainedRun(out / "model.pt", out / "result_0.txt", r.stdout + r.stderr, r.returncode)


# -- a one-node SLURM cluster (tests/test_launchers.py, tests/test_tune.py) --------------------

SLURM_BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol")


class SlurmCluster:
    """munged + slurmctld + slurmd for one node, 'localhost', with this machine's CPUs."""

    def __init__(self, root: Path):
        self.root = root
        self.pidfiles = {name: root / f"{name}.pid" for name in ("munged", "slurmctld", "slurmd")}
        self.conf = root / "slurm.conf"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))

    def start(self) -> None:
        r = self.root
        (r / "state").mkdir()
        (r / "spool").mkdir()
        key = r / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        sock = r / "munge.socket"
        subprocess.run(["munged", "--force", f"--key-file={key}", f"--socket={sock}", f"--seed-file={r / 'seed'}",
                        f"--pid-file={self.pidfiles['munged']}", f"--log-file={r / 'munged.log'}"],
                       check=True, timeout=30)
        cpus = os.cpu_count() or 1
        self.conf.write_text(f"""\
ClusterName=bertci
SlurmctldHost=localhost
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={sock}
CredType=cred/munge
StateSaveLocation={r / 'state'}
SlurmdSpoolDir={r / 'spool'}
SlurmctldPidFile={self.pidfiles['slurmctld']}
SlurmdPidFile={self.pidfiles['slurmd']}
SlurmctldLogFile={r / 'slurmctld.log'}
SlurmdLogFile={r / 'slurmd.log'}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/builtin
NodeName=localhost CPUs={cpus} RealMemory=1000 State=UNKNOWN
PartitionName=ci Nodes=localhost Default=YES MaxTime=INFINITE State=UP
""")
        subprocess.run(["slurmctld", "-i", "-f", str(self.conf)], check=True, env=self.env, timeout=30)
        subprocess.run(["slurmd", "-N", "localhost", "-f", str(self.conf)], check=True, env=self.env, timeout=30)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.node_state() == "idle":
                return
            time.sleep(1)
        raise RuntimeError(f"the SLURM node never became idle:\n{self.logs()}")

    def node_state(self) -> str:
        return subprocess.run(["sinfo", "-h", "-o", "%t"], env=self.env, capture_output=True, text=True).stdout.strip()

    def logs(self) -> str:
        return "\n".join(f"== {p.name}\n{p.read_text()[-2000:]}" for p in sorted(self.root.glob("*.log")))

    def stop(self) -> None:
        """SIGTERM each daemon this cluster started, by its PID file; wait for it to go."""
        for name in ("slurmd", "slurmctld", "munged"):
            pidfile = self.pidfiles[name]
            if not pidfile.exists():
                continue
            pid = int(pidfile.read_text().split()[0])
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.2)
            else:
                os.kill(pid, signal.SIGKILL)

    def wait_job(self, job_id: str, timeout_s: float) -> dict[str, str]:
        """Poll `scontrol show job` until the job leaves PENDING/RUNNING; cancel it on timeout."""
        deadline = time.monotonic() + timeout_s
        while True:
            out = subprocess.run(["scontrol", "show", "job", job_id], env=self.env, capture_output=True,
                                 text=True).stdout
            fields = dict(m.groups() for m in re.finditer(r"(\w+)=(\S*)", out))
            # Requeue passes through REQUEUED (and COMPLETING) on its way back to PENDING.
            if fields.get("JobState") not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED",
                                              "REQUEUE_FED", None):
                return fields
            if time.monotonic() > deadline:
                subprocess.run(["scancel", job_id], env=self.env)
                pytest.fail(f"job {job_id} still {fields.get('JobState')} after {timeout_s} s "
                            f"(reason {fields.get('Reason')})\n{self.logs()}")
            time.sleep(1)


def job_field(cluster: SlurmCluster, job_id: str, name: str) -> str | None:
    out = subprocess.run(["scontrol", "show", "job", job_id], env=cluster.env, capture_output=True, text=True).stdout
    m = re.search(rf"\b{name}=(\S*)", out)
    return m.group(1) if m else None


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory):
    """A private one-node cluster per test module (free ports, its own temp dir)."""
    missing = [b for b in SLURM_BINARIES if shutil.which(b) is None]
    if missing:
        pytest.skip(f"SLURM/munge not installed ({', '.join(missing)}); .ci/run installs slurm-wlm and munge")
    if os.geteuid() != 0:
        pytest.skip("a private SLURM cluster needs root (slurmd launches the job's tasks)")
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
