"""Who am I in the job, and the process group: the only module that reads the environment.

Launchers describe the job in different variables; all reach the same ``DistEnv``:
- torchrun: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT
- Open MPI's mpirun (also srun --mpi=pmix with Open MPI): OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK
- other MPIs (MPICH, Intel MPI): PMI_RANK, PMI_SIZE (local rank from MPI_LOCALRANKID)
- SLURM srun: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID; the master is the first host
  of SLURM_JOB_NODELIST (SLURM_STEP_NODELIST when set)
An explicit MASTER_ADDR/MASTER_PORT always wins, so a batch script can pin them (run.sub
sets the first node's NodeAddr: SLURM's own view of how to reach it).
Under mpirun nothing names the master: ``job_env`` asks MPI (mpi4py) for rank 0's address
and a free port there, so `mpirun -np N` works across nodes like srun and torchrun do.

Which interface gloo (and NCCL's bootstrap) use: left alone, each rank advertises whatever
its hostname resolves to, which is loopback on many machines (Debian maps the hostname to
127.0.1.1), and other nodes cannot connect to it. Unless GLOO_SOCKET_IFNAME /
NCCL_SOCKET_IFNAME are set (they always win), each rank uses the interface that routes to
the rendezvous address, and says so.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import re
import socket
import struct
import sys
import time
from dataclasses import dataclass
from typing import Mapping, NoReturn

import torch
import torch.distributed as dist

from . import tether
from .config import CONFIG_PARAMS, CONFIG_SCRIPT, EXTRA_PARAMS, LAUNCHER_VARIABLES, ConfigError, DistConfig


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str  # torchrun | mpi | pmi | slurm | single (mpi+mpi4py: rendezvous from MPI)
    # torchrun's agent already serves the store at MASTER_ADDR:MASTER_PORT: every rank is a client.
    agent_store: bool = False

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def first_host(nodelist: str) -> str:
    """First host of a SLURM node list: 'gpu[003-005,9],cpu1' -> 'gpu003'."""
    nodelist = nodelist.strip()
    depth = 0
    for i, ch in enumerate(nodelist):  # the first comma outside brackets ends the first entry
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            nodelist = nodelist[:i]
            break
    m = re.fullmatch(r"([^\[\]]*)\[([^\]]+)\](.*)", nodelist)
    if not m:
        return nodelist
    prefix, ranges, suffix = m.groups()
    first = ranges.split(",")[0].split("-")[0]
    return f"{prefix}{first}{suffix}"


def _int(env: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        if env.get(name, "") != "":
            try:
                return int(env[name])
            except ValueError:
                raise ValueError(f"environment variable {name}={env[name]!r} is not an integer") from None
    return None


def detect(cfg: DistConfig, env: Mapping[str, str] | None = None) -> DistEnv:
    """Read rank, world size, local rank and the rendezvous address from the launcher's env."""
    env = os.environ if env is None else env
    if _int(env, "RANK") is not None and _int(env, "WORLD_SIZE") is not None:
        launcher = "torchrun"
        rank, world, local = _int(env, "RANK"), _int(env, "WORLD_SIZE"), _int(env, "LOCAL_RANK")
    elif _int(env, "OMPI_COMM_WORLD_RANK") is not None:
        launcher = "mpi"
        rank, world = _int(env, "OMPI_COMM_WORLD_RANK"), _int(env, "OMPI_COMM_WORLD_SIZE")
        local = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK")
    elif _int(env, "PMI_RANK") is not None:
        launcher = "pmi"
        rank, world, local = _int(env, "PMI_RANK"), _int(env, "PMI_SIZE"), _int(env, "MPI_LOCALRANKID")
    elif _int(env, "SLURM_PROCID") is not None:
        launcher = "slurm"
        rank, world, local = _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS"), _int(env, "SLURM_LOCALID")
    else:
        launcher, rank, world, local = "single", 0, 1, 0
    if world is None:
        raise ValueError(f"launcher {launcher}: rank is set but the world size is not")
    if local is None:
        local = 0 if world == 1 else rank  # single node is the only safe guess
    if not 0 <= rank < world:
        raise ValueError(f"launcher {launcher}: rank {rank} outside world size {world}")

    addr = env.get("MASTER_ADDR", "")
    if not addr:
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or ""
        addr = first_host(nodelist) if nodelist else "127.0.0.1"
    port = _int(env, "MASTER_PORT")
    return DistEnv(rank, world, local, addr, port if port is not None else cfg.master_port, launcher,
                   agent_store=launcher == "torchrun" and env.get("TORCHELASTIC_USE_AGENT_STORE") == "True")


def launch_rank() -> int:
    """This process's rank as its launcher set it, before any config is read (0 when the
    environment names none or is inconsistent: ``detect`` reports that later)."""
    try:
        return detect(DistConfig()).rank
    except ValueError:
        return 0


def tether_to_launcher(env: Mapping[str, str] | None = None) -> None:
    """End with the launcher: when ``BERT_PARENT_PID`` names one (run_and_time.sh sets it:
    torchrun, or the script itself for LAUNCHER=task), this process gets SIGKILL when that
    parent dies (bert/tether.py), and ends at once, saying so, if it died already."""
    env = os.environ if env is None else env
    value = env.get(tether.PARENT_VAR, "")
    if not value:
        return
    try:
        parent = int(value)
    except ValueError:
        raise ValueError(f"environment variable {tether.PARENT_VAR}={value!r} is not a PID") from None
    if not tether.tether(parent):
        rank_line(f"bert: the launcher (PID {parent}) ended before this process could follow it: not training")
        exit_process(tether.EXIT_ORPHANED)


def launcher_variables(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The launcher's settings that are set and not empty: the variables of the table
    (``bert.config.LAUNCHER_VARIABLES``), CONFIG_PARAMS, EXTRA_PARAMS, CONFIG_SCRIPT (and PATH,
    with which that script is read again: bert/config_script.py)."""
    env = os.environ if env is None else env
    names = (*LAUNCHER_VARIABLES, CONFIG_PARAMS, EXTRA_PARAMS, CONFIG_SCRIPT, "PATH")
    return {k: env[k] for k in names if env.get(k)}


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def job_env(cfg: DistConfig, env: Mapping[str, str] | None = None) -> DistEnv:
    """``detect``, then, for an MPI launch with no MASTER_ADDR, the rendezvous from MPI.

    mpirun sets no master address: rank 0 names its host and a free port, and MPI
    broadcasts them (one collective at start-up; mpi4py initializes MPI). Without mpi4py
    a single-node job still works on 127.0.0.1; a multi-node one cannot, and says so.
    """
    env = os.environ if env is None else env
    denv = detect(cfg, env)
    if denv.launcher not in ("mpi", "pmi") or env.get("MASTER_ADDR") or denv.world_size == 1:
        return denv
    try:
        from mpi4py import MPI  # optional (extra "mpi"): only MPI launches need it
    except ImportError:
        local_size = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")
        if local_size is not None and local_size != denv.world_size:
            raise RuntimeError("multi-node mpirun without MASTER_ADDR needs mpi4py (pip install .[mpi]) "
                               "to find rank 0's host; or export MASTER_ADDR and MASTER_PORT") from None
        return denv
    comm = MPI.COMM_WORLD
    if comm.Get_size() != denv.world_size or comm.Get_rank() != denv.rank:
        raise RuntimeError(f"MPI says rank {comm.Get_rank()} of {comm.Get_size()}, "
                           f"the environment rank {denv.rank} of {denv.world_size}")
    port = _int(env, "MASTER_PORT")
    mine = (advertised_host(), port if port is not None else _free_port()) if denv.rank == 0 else None
    addr, port = comm.bcast(mine, root=0)
    return dataclasses.replace(denv, master_addr=addr, master_port=port, launcher=f"{denv.launcher}+mpi4py")


SOCKET_IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's (primary) IPv4 address


class ConnectError(RuntimeError):
    """The ranks could not form the process group; the message says what each side tried."""


def interface_addresses() -> dict[str, str]:
    """Each interface's IPv4 address (interfaces without one are left out), in index order."""
    import fcntl  # Linux/Unix only; imported here so that importing this module stays portable

    out = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            out[name] = socket.inet_ntoa(raw[20:24])
    return out


def route_to(host: str) -> tuple[str | None, str]:
    """(interface, local address) this machine uses to reach ``host``: connecting a UDP socket
    sends nothing, it only asks the kernel for the route and its source address. The
    interface is None where no interface holds that address as its primary one."""
    ip = socket.gethostbyname(host)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((ip, 9))
        src = s.getsockname()[0]
    return next((name for name, addr in interface_addresses().items() if addr == src), None), src


def advertised_host() -> str:
    """How other nodes should reach this one, for an mpirun rendezvous: the hostname, unless it
    resolves to loopback (Debian: 127.0.1.1) while the machine has another address; then the
    first non-loopback interface's address."""
    name = socket.gethostname()
    try:
        if not socket.gethostbyname(name).startswith("127."):
            return name
    except OSError:
        pass
    other = [a for a in interface_addresses().values() if not a.startswith("127.")]
    return other[0] if other else name


def socket_interfaces(master_addr: str, env: Mapping[str, str] | None = None) -> tuple[dict[str, str], str]:
    """The interface gloo and NCCL's bootstrap should use: the user's GLOO_SOCKET_IFNAME /
    NCCL_SOCKET_IFNAME, else the one that routes to the rendezvous address. Returns the
    variables to set (those the user did not) and a line saying what was chosen and why."""
    env = os.environ if env is None else env
    user = {var: env[var] for var in SOCKET_IFNAME_VARS if env.get(var)}
    said = [f"{var}={val} (set by the user)" for var, val in user.items()]
    if len(user) == len(SOCKET_IFNAME_VARS):
        return {}, ", ".join(said)
    try:
        name, src = route_to(master_addr)
    except OSError as e:
        raise ConnectError(f"cannot find a route to the rendezvous address {master_addr} ({e}): set MASTER_ADDR "
                           f"to an address of the first node that every node reaches") from None
    if name is None:
        return {}, ", ".join(said + [f"the route to {master_addr} leaves from {src}, which is no interface's "
                                     f"primary address: interfaces left to the backends' defaults"])
    chosen = {var: name for var in SOCKET_IFNAME_VARS if var not in user}
    said.append(f"{'/'.join(chosen)}={name} ({src}: the route to {master_addr})")
    return chosen, ", ".join(said)


def check_device(requested: str, env: Mapping[str, str] | None = None) -> None:
    """``run.device=cuda`` where torch sees no CUDA device: refused by name (ConfigError),
    before anything is read or built, rather than a GPU recipe crawling on the CPU."""
    if requested != "cuda" or torch.cuda.is_available():
        return
    env = os.environ if env is None else env
    if torch.version.cuda is None:
        why = f"this torch ({torch.__version__}) is a CPU-only build"
    else:
        why = (f"torch (CUDA {torch.version.cuda}) sees no GPU here (CUDA_VISIBLE_DEVICES="
               f"{env.get('CUDA_VISIBLE_DEVICES', 'unset')})")
    raise ConfigError(f"run.device=cuda: {why}. This config runs on GPUs: start it where they are (sbatch "
                      "--gpus-per-node=$DGXNGPU run.sub), or add run.device=cpu to try it on this machine")


def device_for(requested: str, local_rank: int) -> torch.device:
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("run.device=cuda but torch sees no CUDA device")
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class Peers:
    """What a rank that stops on bad input (or on a stop it got while it waited for data)
    tells the others, who would otherwise see only a dead peer (and exit 4, "another rank
    died"): its exit status and message, through the rendezvous store, which outlives the
    process group.

    The rank that saw it ``report``s (one small store write), then ``abort``s its side of the
    process group, so that the peers' collective with it fails at once instead of after
    dist.timeout_s; a peer whose collective failed looks for a report (``reported``) and, on
    finding one, says it and exits 2 too. The store lives in rank 0 (torchrun: in its agent):
    a reporting rank 0 ``linger``s until every peer has read its report or reported its own
    (bounded by dist.timeout_s), so that its exit does not take the report with it.
    """

    def __init__(self) -> None:
        self.store: dist.Store | None = None
        self.rank, self.world_size, self.hosts_store = 0, 1, False

    def bind(self, store: dist.Store, denv: DistEnv) -> None:
        self.store, self.rank, self.world_size = store, denv.rank, denv.world_size
        self.hosts_store = denv.rank == 0 and not denv.agent_store

    def report(self, text: str, status: int = 2) -> None:
        if self.store is None:
            return
        try:
            self.store.set(f"bert/bad_input/{self.rank}", f"{status} {text}")
        except Exception:  # noqa: BLE001 - the store's host is gone: nothing to tell
            self.store = None

    def abort(self) -> None:
        """Fail the peers' pending collective with this rank now (gloo closes its sockets)."""
        if self.store is None or not dist.is_initialized():
            return
        try:
            dist.distributed_c10d._abort_process_group()
        except Exception:  # noqa: BLE001 - a backend without abort: the peers time out instead
            pass

    def reported(self) -> tuple[int, int, str] | None:
        """(rank, exit status, message) of a peer that reported, acknowledged; None when none
        did (or the store is gone with rank 0)."""
        if self.store is None:
            return None
        try:
            self.store.set_timeout(datetime.timedelta(seconds=5))
            for r in range(self.world_size):
                key = f"bert/bad_input/{r}"
                if r != self.rank and self.store.check([key]):
                    self.store.set(f"bert/seen/{self.rank}", "1")
                    status, _, text = self.store.get(key).decode().partition(" ")
                    return r, int(status), text
        except Exception:  # noqa: BLE001 - the store's host is gone
            return None
        return None

    def linger(self, timeout_s: float) -> None:
        """Rank 0 hosting the store, after reporting: wait (bounded) until every peer has read
        the report or reported its own."""
        if self.store is None or not self.hosts_store:
            return
        deadline = time.monotonic() + timeout_s
        waiting = set(range(1, self.world_size))
        while waiting and time.monotonic() < deadline:
            try:
                waiting = {r for r in waiting if not self.store.check([f"bert/seen/{r}"])
                           and not self.store.check([f"bert/bad_input/{r}"])}
            except Exception:  # noqa: BLE001
                return
            time.sleep(0.1)


def init_process_group(denv: DistEnv, cfg: DistConfig, device: torch.device, peers: Peers | None = None) -> None:
    """Join the job's process group (no-op for a single process); ``peers`` gets the store."""
    if denv.world_size == 1:
        return
    backend = cfg.backend if cfg.backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
    chosen, how = socket_interfaces(denv.master_addr)
    os.environ.update(chosen)  # read by gloo and NCCL when the group is made
    where = f"rank {denv.rank} of {denv.world_size} on {socket.gethostname()}"
    if denv.local_rank == 0:  # one line per node
        rank_line(f"bert: {where}: rendezvous {denv.master_addr}:{denv.master_port}; {how}")
    # Our own store, so the rendezvous may wait cfg.startup_timeout_s for late ranks while
    # every collective fails after cfg.timeout_s (one timeout would have to be both).
    try:
        # Under torchrun rank 0 serving it too would log a bind error ("failed to bind ... ignoring").
        store = dist.TCPStore(denv.master_addr, denv.master_port, denv.world_size,
                              is_master=denv.rank == 0 and not denv.agent_store,
                              timeout=datetime.timedelta(seconds=cfg.startup_timeout_s))
    except Exception as e:  # torch raises DistNetworkError, DistStoreError or RuntimeError here
        waited = ("not every rank joined it" if denv.rank == 0 else "could not connect to it")
        raise ConnectError(
            f"{where}: rendezvous {denv.master_addr}:{denv.master_port}: {waited} within "
            f"dist.startup_timeout_s={cfg.startup_timeout_s:g} s ({how}; {str(e).splitlines()[0] if str(e) else e!r}). "
            f"A rank that died at start, or a MASTER_ADDR some node cannot reach: set MASTER_ADDR "
            f"(run.sub: the first node's NodeAddr)") from e
    # Every rank's choice, so that a failed connect below can say what each side tried.
    store.set(f"bert/socket/{denv.rank}", f"{socket.gethostname()}: {how}")
    if peers is not None:
        peers.bind(store, denv)
    try:
        dist.init_process_group(
            backend=backend,
            store=store,
            rank=denv.rank,
            world_size=denv.world_size,
            timeout=datetime.timedelta(seconds=cfg.timeout_s),
        )
    except Exception as e:
        raise ConnectError(_connect_failure(store, denv, backend, where, e)) from e


def _connect_failure(store: dist.Store, denv: DistEnv, backend: str, where: str, err: Exception) -> str:
    """The ranks met at the rendezvous but the backend could not connect them: say what each
    rank advertised (a few, from the store; 127.x is loopback, unreachable from other nodes)."""
    store.set_timeout(datetime.timedelta(seconds=5))
    sides = []
    for r in range(min(denv.world_size, 8)):
        try:
            sides.append(f"rank {r}: {store.get(f'bert/socket/{r}').decode()}")
        except Exception:  # rank 0, which holds the store, may be gone already
            sides.append(f"rank {r}: ?")
    var = "NCCL_SOCKET_IFNAME" if backend == "nccl" else "GLOO_SOCKET_IFNAME"
    first = str(err).splitlines()[0] if str(err) else repr(err)
    return (f"{where}: the {backend} process group could not connect its ranks ({first}). "
            f"Interfaces: {'; '.join(sides)}{'; ...' if denv.world_size > 8 else ''}. "
            f"Set {var} to the interface through which the nodes reach each other")


def rank_line(text: str, stream=None) -> None:
    """Write ``text`` and its newline to ``stream`` (stderr) in one ``write``, then flush.

    Every rank of a node shares one stderr pipe, and Python's stderr is unbuffered and
    write-through (since 3.9), so ``print`` writes the text and the newline as two
    ``write(2)`` calls: two ranks failing at once print ``error: rank 1: ...error: rank 0:
    ...`` on one line and an empty one after (seen in CI, inside the container). One write
    of under PIPE_BUF (4 KiB) bytes to a pipe is atomic, so each line stays whole."""
    stream = sys.stderr if stream is None else stream
    stream.write(text + "\n")
    stream.flush()


def shutdown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def exit_process(status: int) -> NoReturn:
    """End this process with ``status`` without tearing the interpreter down.

    The last call of a process that used a process group (``python -m bert.train``, the
    spawned ranks of the tests and benchmarks). Cause, in torch 2.13 (not our code): once
    DDP has been built on a gloo group, ``destroy_process_group()`` cannot free the group
    (DDP's C++ state keeps references to it after the module is gone), so the group's
    worker threads outlive ``main()``. Each finished collective's Work is freed by the
    worker thread that ran it, a moment after the caller's ``wait()`` returned; the Work
    holds the caller's captured ``at::ThreadLocalState``, whose Python object needs the GIL
    to be released. When that moment falls after interpreter finalization began, CPython
    ends the thread with ``pthread_exit`` inside a noexcept destructor and libstdc++ calls
    ``std::terminate`` (SIGABRT, exit 134, after a run that succeeded). ``os._exit`` after
    flushing skips finalization, so those threads have nothing to race.
    Cost: atexit handlers do not run; callers close their files first (the MLPerf log is
    closed in ``bert.train.run``), and MPI is finalized here."""
    sys.stdout.flush()
    sys.stderr.flush()
    # mpi4py finalizes MPI during interpreter teardown, which os._exit skips; mpirun counts a
    # rank that exits without MPI_Finalize as failed, and the whole job with it.
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()
    os._exit(status)


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """In-place sum across ranks (identity on one process)."""
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_reduce_max(t: torch.Tensor) -> torch.Tensor:
    """In-place max across ranks (identity on one process): "does any rank say yes"."""
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t


def barrier() -> None:
    """Wait for every rank (no-op on one process). A sync point; bounded by dist.timeout_s."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def is_comm_failure(err: BaseException) -> bool:
    """Did this exception come from a collective whose peer died or timed out?

    torch raises DistBackendError (NCCL, and gloo in recent versions) or a RuntimeError whose
    text comes from gloo's transport; anything else is a bug or bad input, reported as such.
    """
    if isinstance(err, getattr(dist, "DistBackendError", ())):
        return True
    text = str(err)
    return isinstance(err, RuntimeError) and any(
        s in text for s in ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
                            "Timed out", "timed out", "Timeout", "gloo", "NCCL"))


def broadcast_object(obj, src: int = 0):
    if dist.is_available() and dist.is_initialized():
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]
    return obj


def all_gather_object(obj) -> list:
    """Every rank's ``obj`` (pickled), in rank order; ``[obj]`` on one process."""
    if dist.is_available() and dist.is_initialized():
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out
    return [obj]
