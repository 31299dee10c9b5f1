import subprocess
import sys

import pytest

from bert.config import DistConfig
from bert.distributed import detect, first_host
from conftest import PKG


@pytest.mark.parametrize("nodelist, host", [
    ("node1", "node1"),
    ("node1,node2", "node1"),
    ("gpu[003-005,9]", "gpu003"),
    ("gpu[7,3],cpu1", "gpu7"),
    ("rack1-[12-14]-ib", "rack1-12-ib"),
])
def test_first_host(nodelist, host):
    assert first_host(nodelist) == host


@pytest.mark.parametrize("env, want", [
    ({}, (0, 1, 0, "127.0.0.1", 29500, "single")),
    ({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "123"},
     (3, 8, 1, "h", 123, "torchrun")),
    ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1"},
     (1, 2, 1, "127.0.0.1", 29500, "mpi")),
    ({"PMI_RANK": "5", "PMI_SIZE": "6", "MPI_LOCALRANKID": "1", "SLURM_JOB_NODELIST": "n[4-5]"},
     (5, 6, 1, "n4", 29500, "pmi")),
    ({"SLURM_PROCID": "9", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1", "SLURM_JOB_NODELIST": "dgx[01-02]"},
     (9, 16, 1, "dgx01", 29500, "slurm")),
    # srun launching an Open MPI program: the MPI variables win, SLURM gives the master host
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2", "SLURM_PROCID": "0", "SLURM_NTASKS": "2",
      "SLURM_STEP_NODELIST": "a1,a2", "SLURM_JOB_NODELIST": "z9"}, (0, 2, 0, "a1", 29500, "mpi")),
])
def test_detect(env, want):
    d = detect(DistConfig(), env)
    assert (d.rank, d.world_size, d.local_rank, d.master_addr, d.master_port, d.launcher) == want


def test_detect_rejects_nonsense():
    with pytest.raises(ValueError, match="RANK"):
        detect(DistConfig(), {"RANK": "x", "WORLD_SIZE": "2"})
    with pytest.raises(ValueError, match="outside"):
        detect(DistConfig(), {"SLURM_PROCID": "4", "SLURM_NTASKS": "2"})


def test_exit_process_flushes_and_keeps_the_status():
    # Block-buffered stdout (a pipe) would lose the text if exit_process skipped the flush.
    code = "import sys; from bert import distributed; print('done', end=''); sys.stderr.write('err'); distributed.exit_process(3)"
    r = subprocess.run([sys.executable, "-c", code], cwd=PKG, capture_output=True, text=True, timeout=120)
    assert (r.returncode, r.stdout, r.stderr) == (3, "done", "err")


def test_socket_interfaces_route_to_the_rendezvous_unless_the_user_set_them():
    from bert.distributed import SOCKET_IFNAME_VARS, interface_addresses, route_to, socket_interfaces

    assert interface_addresses().get("lo") == "127.0.0.1"
    assert route_to("127.0.0.1") == ("lo", "127.0.0.1")
    chosen, how = socket_interfaces("127.0.0.1", {})
    assert chosen == dict.fromkeys(SOCKET_IFNAME_VARS, "lo")
    assert "GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME=lo (127.0.0.1: the route to 127.0.0.1)" in how
    # The user's choice always wins; only the variable left unset is chosen.
    chosen, how = socket_interfaces("127.0.0.1", {"GLOO_SOCKET_IFNAME": "eth7"})
    assert chosen == {"NCCL_SOCKET_IFNAME": "lo"} and "GLOO_SOCKET_IFNAME=eth7 (set by the user)" in how
    chosen, how = socket_interfaces("127.0.0.1", {"GLOO_SOCKET_IFNAME": "a", "NCCL_SOCKET_IFNAME": "b"})
    assert chosen == {} and how == "GLOO_SOCKET_IFNAME=a (set by the user), NCCL_SOCKET_IFNAME=b (set by the user)"


def test_detect_torchrun_agent_store():
    """torchrun's agent serves the store itself: rank 0 must not try to serve it too (that
    logs a bind error at every start)."""
    env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}
    assert not detect(DistConfig(), env).agent_store
    assert detect(DistConfig(), dict(env, TORCHELASTIC_USE_AGENT_STORE="True")).agent_store
