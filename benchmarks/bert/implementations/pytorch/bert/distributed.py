"""Who am I in the job, and the process group: the only module that reads the environment.

Launchers describe the job in different variables; all reach the same ``DistEnv``:
- torchrun: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT
- Open MPI's mpirun (also srun --mpi=pmix with Open MPI): OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK
- other MPIs (MPICH, Intel MPI): PMI_RANK, PMI_SIZE (local rank from MPI_LOCALRANKID)
- SLURM srun: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID; the master is the first host
  of SLURM_JOB_NODELIST (SLURM_STEP_NODELIST when set)
An explicit MASTER_ADDR/MASTER_PORT always wins, so a batch script can pin them.
Under mpirun nothing names the master: ``job_env`` asks MPI (mpi4py) for rank 0's host and
a free port there, so `mpirun -np N` works across nodes like srun and torchrun do.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import re
import socket
from dataclasses import dataclass
from typing import Mapping

import torch
import torch.distributed as dist

from .config import DistConfig


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
    mine = (socket.gethostname(), port if port is not None else _free_port()) if denv.rank == 0 else None
    addr, port = comm.bcast(mine, root=0)
    return dataclasses.replace(denv, master_addr=addr, master_port=port, launcher=f"{denv.launcher}+mpi4py")


def device_for(requested: str, local_rank: int) -> torch.device:
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("run.device=cuda but torch sees no CUDA device")
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_process_group(denv: DistEnv, cfg: DistConfig, device: torch.device) -> None:
    """Join the job's process group (no-op for a single process)."""
    if denv.world_size == 1:
        return
    backend = cfg.backend if cfg.backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
    # Our own store, so the rendezvous may wait cfg.startup_timeout_s for late ranks while
    # every collective fails after cfg.timeout_s (one timeout would have to be both).
    # Under torchrun rank 0 serving it too would log a bind error ("failed to bind ... ignoring").
    store = dist.TCPStore(denv.master_addr, denv.master_port, denv.world_size,
                          is_master=denv.rank == 0 and not denv.agent_store,
                          timeout=datetime.timedelta(seconds=cfg.startup_timeout_s))
    dist.init_process_group(
        backend=backend,
        store=store,
        rank=denv.rank,
        world_size=denv.world_size,
        timeout=datetime.timedelta(seconds=cfg.timeout_s),
    )


def shutdown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


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
