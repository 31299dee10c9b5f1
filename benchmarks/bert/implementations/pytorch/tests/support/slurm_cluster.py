"""Private SLURM clusters for the launcher tests: munged, slurmctld and slurmd started here,
in a temp dir, on free ports, so several can coexist on one machine.

- ``SlurmCluster(root)``: one node, 'localhost', with this machine's CPUs.
- ``SlurmCluster(root, NetnsNet.create(2))``: two nodes, node1 and node2, each slurmd in a
  network namespace of its own with one veth interface (eth0) into a bridge on the host,
  where slurmctld runs. The nodes share the file system and the hostname (which may resolve
  to loopback, as on Debian): only SLURM's NodeAddr tells them apart, as on a real cluster.

Everything is torn down by what was created: daemons by their PID files, processes left
in a namespace by their PIDs (``ip netns pids``), namespaces and the bridge by name.
"""

from __future__ import annotations

import ipaddress
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import free_port

SLURM_BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol")


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _end_pid(pid: int, wait_s: float = 20.0) -> None:
    """SIGTERM, then SIGKILL if it is still there after wait_s."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if not _pid_alive(pid):
            return
        time.sleep(0.2)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@dataclass
class NetnsNet:
    """A bridge on the host and one network namespace per node, named after this process."""

    bridge: str
    host_addr: str  # the bridge's address: slurmctld's, as the nodes see it
    nodes: dict[str, tuple[str, str]]  # node name -> (namespace, address of its eth0)

    @staticmethod
    def unavailable() -> str | None:
        """Why this machine cannot build the network, or None."""
        if os.geteuid() != 0:
            return "network namespaces need root"
        if shutil.which("ip") is None or shutil.which("nsenter") is None:
            return "iproute2 (ip) and util-linux (nsenter) are needed for network namespaces"
        probe = f"bertprobe{os.getpid()}"
        r = _ip("netns", "add", probe)
        if r.returncode != 0:
            return f"cannot create a network namespace here: {r.stderr.strip()}"
        _ip("netns", "del", probe)
        r = _ip("link", "add", f"brp{os.getpid()}", "type", "bridge")
        if r.returncode != 0:
            return f"cannot create a bridge here: {r.stderr.strip()}"
        _ip("link", "del", f"brp{os.getpid()}")
        return None

    @staticmethod
    def _free_subnet() -> ipaddress.IPv4Network:
        """A /24 in 10.0.0.0/8 that no address or route of the host touches (private: the
        namespaces reach nothing but each other and the bridge)."""
        taken = []
        for line in _ip("-o", "-4", "addr").stdout.splitlines() + _ip("-4", "route").stdout.splitlines():
            for tok in re.findall(r"\b\d+\.\d+\.\d+\.\d+(?:/\d+)?", line):
                taken.append(ipaddress.ip_network(tok, strict=False))
        for i in range(4096):
            k = (os.getpid() * 7 + i) % 4096
            net = ipaddress.ip_network(f"10.{200 + k // 256 % 50}.{k % 256}.0/24")
            if not any(net.overlaps(t) for t in taken):
                return net
        raise RuntimeError("no free 10.x.y.0/24 subnet")

    @classmethod
    def create(cls, n_nodes: int) -> NetnsNet:
        tag = str(os.getpid())
        net = cls._free_subnet()
        hosts = list(net.hosts())
        self = cls(bridge=f"brt{tag}", host_addr=str(hosts[0]), nodes={})
        try:
            self._run("link", "add", self.bridge, "type", "bridge")
            self._run("addr", "add", f"{hosts[0]}/{net.prefixlen}", "dev", self.bridge)
            self._run("link", "set", self.bridge, "up")
            for i in range(1, n_nodes + 1):
                ns, veth, addr = f"bert{tag}n{i}", f"vt{tag}n{i}", str(hosts[i])
                self._run("netns", "add", ns)
                self.nodes[f"node{i}"] = (ns, addr)
                self._run("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
                self._run("link", "set", veth, "master", self.bridge)
                self._run("link", "set", veth, "up")
                self._run("-n", ns, "addr", "add", f"{addr}/{net.prefixlen}", "dev", "eth0")
                self._run("-n", ns, "link", "set", "eth0", "up")
                self._run("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.destroy()
            raise
        return self

    @staticmethod
    def _run(*args: str) -> None:
        r = _ip(*args)
        if r.returncode != 0:
            raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")

    def nsenter(self, node: str) -> list[str]:
        """The command prefix that runs a program in ``node``'s network namespace."""
        return ["nsenter", f"--net=/run/netns/{self.nodes[node][0]}"]

    def pids(self, node: str) -> list[int]:
        """Every process in ``node``'s namespace."""
        return [int(p) for p in _ip("netns", "pids", self.nodes[node][0]).stdout.split()]

    def destroy(self) -> None:
        for ns, _ in self.nodes.values():
            for pid in (int(p) for p in _ip("netns", "pids", ns).stdout.split()):
                _end_pid(pid, wait_s=5)
            _ip("netns", "del", ns)  # its veth end goes with it, and so the bridge's end
        _ip("link", "del", self.bridge)


class SlurmCluster:
    """munged + slurmctld on the host, and one slurmd per node (see the module docstring)."""

    def __init__(self, root: Path, net: NetnsNet | None = None, gpus: int = 0):
        """``gpus``: that many GPUs per node as SLURM sees them (gres gpu, GresTypes=gpu), for
        what a job asks for and gets (SLURM_GPUS_ON_NODE); their device files are stand-ins
        (/dev/null, /dev/zero, ...: task/none constrains no device), no GPU is behind them."""
        self.root = root
        self.net = net
        self.gpus = gpus
        self.node_names = list(net.nodes) if net else ["localhost"]
        self.pidfiles = {name: root / f"{name}.pid" for name in ("munged", "slurmctld")}
        for node in self.node_names:
            self.pidfiles[f"slurmd_{node}"] = root / f"slurmd_{node}.pid"
        self.conf = root / "slurm.conf"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        self.sockets: Path | None = None

    def start(self) -> None:
        r = self.root
        (r / "state").mkdir()
        # The Unix sockets (munged's; slurmstepd's in each spool dir, e.g. localhost_1.4294967291)
        # take 108 bytes at most: a short directory of their own, not under a test's temp dir
        # (an xdist worker's is 10 characters longer; slurmstepd then cannot start the job).
        self.sockets = Path(tempfile.mkdtemp(prefix="bert-slurm-"))
        for node in self.node_names:
            (self.sockets / f"spool_{node}").mkdir()
        key = r / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        # A Unix socket: reachable from every network namespace (same file system).
        sock = self.sockets / "munge.socket"
        subprocess.run(["munged", "--force", f"--key-file={key}", f"--socket={sock}", f"--seed-file={r / 'seed'}",
                        f"--pid-file={self.pidfiles['munged']}", f"--log-file={r / 'munged.log'}"],
                       check=True, timeout=30)
        cpus = os.cpu_count() or 1
        if self.net:
            # slurmctld listens on every host address; the nodes reach it on the bridge's.
            ctl = f"localhost({self.net.host_addr})"
            nodes = "\n".join(f"NodeName={n} NodeAddr={a} CPUs={cpus} RealMemory=1000 State=UNKNOWN"
                              for n, (_, a) in self.net.nodes.items())
            node_list = ",".join(self.node_names)
        else:
            ctl, node_list = "localhost", "localhost"
            nodes = f"NodeName=localhost CPUs={cpus} RealMemory=1000 State=UNKNOWN"
        gres = ""
        if self.gpus:
            devices = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")[:self.gpus]
            assert len(devices) == self.gpus, f"at most 5 stand-in GPUs, not {self.gpus}"
            (r / "gres.conf").write_text("AutoDetect=off\n" + "".join(f"Name=gpu File={d}\n" for d in devices))
            gres = "GresTypes=gpu\n"
            nodes = nodes.replace(" CPUs=", f" Gres=gpu:{self.gpus} CPUs=")
        # %n: each slurmd's own PID file, spool and log (several slurmds on one file system).
        self.conf.write_text(f"""\
ClusterName=bertci
SlurmctldHost={ctl}
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={sock}
CredType=cred/munge
StateSaveLocation={r / 'state'}
SlurmdSpoolDir={self.sockets / 'spool_%n'}
SlurmctldPidFile={self.pidfiles['slurmctld']}
SlurmdPidFile={r / 'slurmd_%n.pid'}
SlurmctldLogFile={r / 'slurmctld.log'}
SlurmdLogFile={r / 'slurmd_%n.log'}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/builtin
{gres}{nodes}
PartitionName=ci Nodes={node_list} Default=YES MaxTime=INFINITE State=UP
""")
        subprocess.run(["slurmctld", "-i", "-f", str(self.conf)], check=True, env=self.env, timeout=30)
        for node in self.node_names:
            prefix = self.net.nsenter(node) if self.net else []
            subprocess.run([*prefix, "slurmd", "-N", node, "-f", str(self.conf)], check=True, env=self.env,
                           timeout=30)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.node_state() == "idle":
                return
            time.sleep(1)
        raise RuntimeError(f"the SLURM nodes never became idle:\n{self.logs()}")

    def node_state(self) -> str:
        """'idle' when every node is; else the states sinfo lists ('drain': drained and idle)."""
        out = subprocess.run(["sinfo", "-h", "-o", "%t"], env=self.env, capture_output=True, text=True).stdout
        return " ".join(sorted(set(out.split())))

    def drain(self, node: str) -> None:
        """Take ``node`` out of scheduling, as an administrator drains a failing node: jobs
        running there go on, no new one starts there (`undrain` puts it back)."""
        subprocess.run(["scontrol", "update", f"NodeName={node}", "State=DRAIN", "Reason=test"], env=self.env,
                       check=True, timeout=30)

    def undrain(self, node: str) -> None:
        subprocess.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"], env=self.env, check=True,
                       timeout=30)

    def logs(self) -> str:
        return "\n".join(f"== {p.name}\n{p.read_text()[-2000:]}" for p in sorted(self.root.glob("*.log")))

    def stop(self) -> None:
        """SIGTERM each daemon this cluster started, by its PID file; wait for it to go."""
        for name in [*(f"slurmd_{n}" for n in self.node_names), "slurmctld", "munged"]:
            pidfile = self.pidfiles[name]
            if pidfile.exists():
                _end_pid(int(pidfile.read_text().split()[0]))
        if self.sockets is not None:
            shutil.rmtree(self.sockets, ignore_errors=True)

    def job_fields(self, job_id: str) -> dict[str, str]:
        out = subprocess.run(["scontrol", "show", "job", job_id], env=self.env, capture_output=True,
                             text=True).stdout
        return dict(m.groups() for m in re.finditer(r"(\w+)=(\S*)", out))

    def wait_job(self, job_id: str, timeout_s: float) -> dict[str, str]:
        """Poll `scontrol show job` until the job leaves PENDING/RUNNING; cancel it on timeout."""
        deadline = time.monotonic() + timeout_s
        while True:
            fields = self.job_fields(job_id)
            # Requeue passes through REQUEUED (and COMPLETING) on its way back to PENDING.
            if fields.get("JobState") not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED",
                                              "REQUEUE_FED", None):
                return fields
            if time.monotonic() > deadline:
                subprocess.run(["scancel", job_id], env=self.env)
                pytest.fail(f"job {job_id} still {fields.get('JobState')} after {timeout_s} s "
                            f"(reason {fields.get('Reason')})\n{self.logs()}")
            time.sleep(1)

    def requeue_now(self, job_id: str, timeout_s: float = 120) -> None:
        """Start a job that requeued itself now, not after SLURM's ~2-minute hold (its BeginTime),
        once every node is idle (or drained) and 2 s later: slurmd marks the old instance's credential revoked
        at a time in whole seconds and refuses every credential of the job created in that second
        or before (cred->ctime <= revoked), so a start within the requeue's second fails the job
        ("Job credential revoked"; seen in CI with a start 0.8 s after the requeue)."""
        deadline = time.monotonic() + timeout_s
        while True:
            job = self.job_fields(job_id)
            if job.get("Restarts") == "1" and job.get("JobState") == "PENDING" and \
                    set(self.node_state().split()) <= {"idle", "drain"}:
                break
            if time.monotonic() > deadline:
                pytest.fail(f"job {job_id} did not come back PENDING on idle nodes: {job.get('JobState')}\n"
                            + self.logs())
            time.sleep(0.5)
        time.sleep(2)
        subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], env=self.env, timeout=30)


def slurm_unavailable() -> str | None:
    missing = [b for b in SLURM_BINARIES if shutil.which(b) is None]
    if missing:
        return f"SLURM/munge not installed ({', '.join(missing)}); .ci/run installs slurm-wlm and munge"
    if os.geteuid() != 0:
        return "a private SLURM cluster needs root (slurmd launches the job's tasks)"
    return None
