
import ast
import io

import pytest

from bert.config import DistConfig
from bert.distributed import detect, first_host, rank_line
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


class _Pipe(io.RawIOBase):
    """The write(2) calls a process makes on its stderr pipe."""

    def __init__(self):
        self.calls: list[bytes] = []

    def writable(self):
        return True

    def write(self, b):
        self.calls.append(bytes(b))
        return len(b)


def _stderr_like() -> tuple[io.TextIOWrapper, _Pipe]:
    """A stream built the way CPython builds sys.stderr: unbuffered raw file, write-through,
    line buffering (so the test holds whatever the test runner did to sys.stderr)."""
    pipe = _Pipe()
    return io.TextIOWrapper(pipe, encoding="utf-8", line_buffering=True, write_through=True), pipe


def test_rank_line_is_one_write_where_print_is_two():
    """Ranks share one stderr pipe; a line written in two calls interleaves with another
    rank's (CI saw 'error: rank 1: ...error: rank 0: ...'); one call under PIPE_BUF does not."""
    line = "error: rank 1: /data/empty: holds no shard files (*.hdf5, *.h5, *.hdf)"
    stream, pipe = _stderr_like()
    print(line, file=stream)
    assert pipe.calls == [line.encode(), b"\n"]  # the premise: print splits the line
    stream, pipe = _stderr_like()
    rank_line(line, stream)
    assert pipe.calls == [(line + "\n").encode()]


def test_every_rank_writes_its_lines_with_rank_line():
    """The code every rank runs (bert.train.run, the trainer, the process group's rendezvous
    line) writes to stderr only through rank_line: a print(..., file=sys.stderr) there can
    tear a line. (What a person reads goes through logging: bert/console.py.)"""
    for module, functions in (("bert/train.py", {"run"}), ("bert/trainer.py", None),
                              ("bert/distributed.py", {"init_process_group"})):
        tree = ast.parse((PKG / module).read_text())
        for fn in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)
                   and (functions is None or n.name in functions)):
            for call in (n for n in ast.walk(fn) if isinstance(n, ast.Call)):
                if isinstance(call.func, ast.Name) and call.func.id == "print":
                    assert not any(k.arg == "file" for k in call.keywords), (
                        f"{module}:{call.lineno}: print(..., file=...) in {fn.name}; use distributed.rank_line")
