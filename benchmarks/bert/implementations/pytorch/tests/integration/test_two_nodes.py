"""`sbatch -N 2 run.sub` on a real two-node SLURM cluster: each slurmd in a network namespace
of its own, one veth (eth0) per node into a bridge on the host (tests/support/slurm_cluster.py). The
nodes share the hostname, which resolves to loopback here: only SLURM's NodeAddr and the
route to it tell the ranks how to reach each other, as on a cluster whose /etc/hosts maps
the hostname to 127.0.1.1. config_CPU_1x2.sh at one rank per node, from the `trained` demo
model, so a run reaches the target at its first evaluation; the MLCommons compliance
checker is the oracle for every log."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from conftest import PKG, demo_run_env, hold_env, mllog_events, run_checker
from slurm_cluster import NetnsNet, SlurmCluster, slurm_unavailable

# Everything a dead or unreachable peer may take, from the event to the job's end on both nodes.
PROMISE_S = 120


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    why = slurm_unavailable() or NetnsNet.unavailable()
    if why:
        pytest.skip(why)
    net = NetnsNet.create(2)
    try:
        cluster = SlurmCluster(tmp_path_factory.mktemp("slurm2"), net)
        try:
            cluster.start()
            yield cluster
        finally:
            cluster.stop()
    finally:
        net.destroy()


def two_node_env(cluster: SlurmCluster, trained, demo_data, logdir: Path, **extra: str) -> dict[str, str]:
    """config_CPU_1x2.sh's run, two nodes of one rank each; nothing set by hand for the
    rendezvous or the interfaces (run.sub and bert/distributed.py find them)."""
    env = demo_run_env(trained, demo_data, logdir, DGXSYSTEM="CPU_2x1", DGXNNODES="2", DGXNGPU="1",
                       SLURM_CONF=cluster.env["SLURM_CONF"], **extra)
    for var in ("MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        if var not in extra:
            env.pop(var, None)
    return env


def sbatch(cluster: SlurmCluster, env: dict[str, str], out_file: Path, *args: str) -> str:
    sub = subprocess.run(["sbatch", "--parsable", "-N", "2", "-t", "10", "-o", str(out_file), *args, "run.sub"],
                         cwd=PKG, env=env, capture_output=True, text=True, timeout=60)
    assert sub.returncode == 0, sub.stderr
    return sub.stdout.strip().split(";")[0]


def wait_for_output(cluster: SlurmCluster, job_id: str, out_file: Path, pattern: str, timeout_s: float = 240) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        text = out_file.read_text() if out_file.exists() else ""
        if re.search(pattern, text):
            return text
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job_id], env=cluster.env)
            pytest.fail(f"never saw {pattern!r} in the job's output:\n{text[-3000:]}\n{cluster.logs()}")
        time.sleep(0.3)


def trainers(cluster: SlurmCluster, node: str) -> list[int]:
    """The training processes (python -m bert.train) running in ``node``'s namespace."""
    out = []
    for pid in cluster.net.pids(node):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"bert.train" in cmd:
            out.append(pid)
    return out


def rank_lines(output: str) -> dict[int, str]:
    """bert/distributed.py's line per node: rendezvous and interfaces chosen."""
    return {int(m.group(1)): m.group(0) for m in re.finditer(r"bert: rank (\d+) of 2 on .*", output)}


def test_two_nodes_sbatch_run_sub_reaches_target_and_passes_checker(two_nodes, trained, demo_data, tmp_path):
    assert trained.returncode == 0, trained.stdout[-3000:]
    logdir = tmp_path / "logs"
    out_file = tmp_path / "job.out"
    job = two_nodes.wait_job(sbatch(two_nodes, two_node_env(two_nodes, trained, demo_data, logdir, SEED="11",
                                                            DATESTAMP="n2"), out_file), timeout_s=300)
    output = out_file.read_text()
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0", output[-4000:] + two_nodes.logs()
    assert "compliance checker (5.0.0): PASS" in output, output[-4000:]
    ok, checker = run_checker(logdir / "n2_1.log")
    assert ok, checker
    events = {e["key"]: e for e in mllog_events(logdir / "n2_1.log")}
    assert events["run_stop"]["metadata"]["status"] == "success"
    assert events["eval_accuracy"]["value"] >= 0.72
    resolved = json.loads((logdir / "n2_1_config.json").read_text())["resolved"]
    assert resolved["launcher"] == "slurm" and resolved["world_size"] == 2
    # The rendezvous is node1's NodeAddr (its name resolves nowhere); each rank chose the
    # interface that routes there: its own node's eth0, one rank per node.
    (_, addr1), (_, addr2) = two_nodes.net.nodes["node1"], two_nodes.net.nodes["node2"]
    assert re.search(rf"master {re.escape(addr1)}:\d+ \(NodeAddr of node1\)", output), output[-4000:]
    lines = rank_lines(output)
    assert f"GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME=eth0 ({addr1}: the route to {addr1})" in lines[0], lines
    assert f"GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME=eth0 ({addr2}: the route to {addr1})" in lines[1], lines


def test_two_nodes_usr1_checkpoints_requeues_and_resumes(two_nodes, trained, demo_data, tmp_path):
    """The preemption path of test_launchers.py's one-node test, across two nodes: the ranks on
    both nodes checkpoint to the shared directory and exit 3, the job requeues itself, and
    the second start resumes the run on both nodes and finishes it."""
    assert trained.returncode == 0, trained.stdout[-3000:]
    logdir = tmp_path / "logs"
    out_file = tmp_path / "job.out"
    # 25 steps of 64 samples before the first (target-reaching) eval; progress and polls every 5.
    # Rank 1 (node2) is held after step 5 until the signal reaches it (hold_env): seen at that
    # step's poll, however fast the machine.
    env = two_node_env(two_nodes, trained, demo_data, logdir, SEED="9", DATESTAMP="rq2", EVAL_ITER_SAMPLES="1600",
                       MAX_SAMPLES_TERMINATION="3200", **hold_env(tmp_path, "boundary:1:5:signal"))
    env["EXTRA_PARAMS"] += " log.progress_interval_steps=5 ckpt.poll_steps=5"
    job_id = sbatch(two_nodes, env, out_file, "--requeue")
    deadline = time.monotonic() + 240
    while not (tmp_path / "held" / "held_rank1_step5").exists():
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job_id], env=two_nodes.env)
            pytest.fail("rank 1 never held at step 5:\n" + (out_file.read_text() if out_file.exists() else "")[-3000:])
        time.sleep(0.1)
    subprocess.run(["scancel", "--batch", "--signal=USR1", job_id], env=two_nodes.env, check=True, timeout=30)
    two_nodes.requeue_now(job_id)
    job = two_nodes.wait_job(job_id, timeout_s=300)
    output = out_file.read_text()
    assert job["Restarts"] == "1", output[-4000:] + two_nodes.logs()
    assert "SIGUSR1: requeueing job" in output and "checkpointed on a signal (training exit 3)" in output, output[-4000:]
    assert re.search(r"resumed from .*rq2_1_ckpt/step_000000005 at step 5,", output), output[-4000:]
    # Resumed: the run reached the target, but the checker rejects a log of two parts.
    assert "run 1/1: resumed from a checkpoint: not a valid timed result" in output, output[-4000:]
    assert "run.sub: 1 run(s), 1 failed" in output and job["ExitCode"] == "1:0", output[-4000:]
    events = mllog_events(logdir / "rq2_1.log")
    assert [e["metadata"]["status"] for e in events if e["key"] == "run_stop"] == ["aborted", "success"]
    assert [e["value"] for e in events if e["key"] == "seed"] == [9, 9]
    assert (logdir / "rq2_1_ckpt" / "finished.json").exists()
    assert len(rank_lines(output)) == 2  # both starts found each other without help


def test_two_nodes_rank_killed_on_one_node_ends_the_job_on_both(two_nodes, trained, demo_data, tmp_path):
    assert trained.returncode == 0, trained.stdout[-3000:]
    logdir = tmp_path / "logs"
    out_file = tmp_path / "job.out"
    # No eval for 1,000 steps: the run would go on far longer than the test waits.
    env = two_node_env(two_nodes, trained, demo_data, logdir, SEED="5", DATESTAMP="kill",
                       EVAL_ITER_SAMPLES="64000", MAX_SAMPLES_TERMINATION="640000")
    env["EXTRA_PARAMS"] += " log.progress_interval_steps=5"
    job_id = sbatch(two_nodes, env, out_file)
    wait_for_output(two_nodes, job_id, out_file, r"step +5 \|")
    victims = trainers(two_nodes, "node2")
    assert len(victims) == 1 and len(trainers(two_nodes, "node1")) == 1, (victims, out_file.read_text()[-3000:])
    killed = time.monotonic()
    subprocess.run(["kill", "-KILL", str(victims[0])], check=True)
    while trainers(two_nodes, "node1") and time.monotonic() - killed < PROMISE_S:
        time.sleep(0.5)
    ranks_gone = time.monotonic() - killed
    job = two_nodes.wait_job(job_id, timeout_s=PROMISE_S + 60)
    took = time.monotonic() - killed
    output = out_file.read_text()
    print(f"rank killed on node2: node1's rank gone after {ranks_gone:.1f} s, the job ended after {took:.1f} s")
    assert took < PROMISE_S, f"the job took {took:.0f} s to end (ranks {ranks_gone:.0f} s)\n{output[-4000:]}"
    assert trainers(two_nodes, "node1") == [] and trainers(two_nodes, "node2") == []
    assert job["JobState"] == "FAILED" and job["ExitCode"] != "0:0", output[-4000:]
    # Rank 0 (node1) saw its peer go and said so; the step's exit is non-zero.
    assert "error: rank 0 of 2: a collective failed" in output, output[-4000:]
    assert re.search(r"== run 1/1: training exit [1-9]", output), output[-4000:]


def test_two_nodes_unreachable_interface_fails_fast_and_says_why(two_nodes, trained, demo_data, tmp_path):
    """The user's GLOO_SOCKET_IFNAME wins, even when it is wrong: with `lo` each rank
    advertises 127.0.0.1, which the other node cannot reach (what an unset one did when the
    hostname resolved to loopback). Both ranks end within 2 minutes, non-zero, naming what
    each side tried and the variable to set."""
    assert trained.returncode == 0, trained.stdout[-3000:]
    logdir = tmp_path / "logs"
    out_file = tmp_path / "job.out"
    # STEP_WAIT_S: srun's 60 s wait for the rank still in its rendezvous is a timer, not what is tested.
    env = two_node_env(two_nodes, trained, demo_data, logdir, SEED="3", DATESTAMP="lo", GLOO_SOCKET_IFNAME="lo",
                       STEP_WAIT_S="10")
    job_id = sbatch(two_nodes, env, out_file)
    text = wait_for_output(two_nodes, job_id, out_file, r"bert: rank \d+ of 2 on")
    started = time.monotonic()
    job = two_nodes.wait_job(job_id, timeout_s=PROMISE_S + 60)
    took = time.monotonic() - started
    output = out_file.read_text()
    print(f"unreachable interface: the job ended {took:.1f} s after the first rank's line")
    assert took < PROMISE_S, f"the job took {took:.0f} s to end after the ranks started\n{output[-4000:]}"
    assert job["JobState"] == "FAILED", output[-4000:] + text
    assert "GLOO_SOCKET_IFNAME=lo (set by the user)" in output, output[-4000:]
    m = re.search(r"error: rank \d of 2 on .*: the gloo process group could not connect its ranks .*", output)
    assert m, output[-4000:]
    assert "Interfaces: rank 0: " in m.group(0) and "Set GLOO_SOCKET_IFNAME to the interface" in m.group(0), m.group(0)
    assert re.search(r"== run 1/1: training exit [1-9]", output), output[-4000:]
    assert trainers(two_nodes, "node1") == [] and trainers(two_nodes, "node2") == []


def test_two_nodes_mpirun_inside_the_allocation(two_nodes, trained, demo_data, tmp_path):
    """Open MPI's mpirun across the two nodes: inside `sbatch -N 2` it reads the node list
    from SLURM and starts its daemons with srun (no ssh); mpi4py gives the rendezvous, rank
    0's address, not its hostname (which resolves to loopback here)."""
    if shutil.which("mpirun") is None:
        pytest.skip("Open MPI not installed; .ci/run installs openmpi-bin")
    pytest.importorskip("mpi4py", reason="the mpi extra (mpi4py) is not installed")
    assert trained.returncode == 0, trained.stdout[-3000:]
    logdir = tmp_path / "logs"
    out_file = tmp_path / "job.out"
    env = two_node_env(two_nodes, trained, demo_data, logdir, SEED="13", LAUNCHER="task", LOGFILE="mpi.log",
                       OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    sub = subprocess.run(["sbatch", "--parsable", "-N", "2", "-t", "10", "-o", str(out_file), "--wrap",
                          "mpirun -np 2 --map-by ppr:1:node ./run_and_time.sh"],
                         cwd=PKG, env=env, capture_output=True, text=True, timeout=60)
    assert sub.returncode == 0, sub.stderr
    job = two_nodes.wait_job(sub.stdout.strip().split(";")[0], timeout_s=300)
    output = out_file.read_text()
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0", output[-4000:] + two_nodes.logs()
    ok, checker = run_checker(logdir / "mpi.log")
    assert ok, checker
    resolved = json.loads((logdir / "mpi_config.json").read_text())["resolved"]
    assert resolved["launcher"] == "mpi+mpi4py" and resolved["world_size"] == 2
    (_, addr1), (_, addr2) = two_nodes.net.nodes["node1"], two_nodes.net.nodes["node2"]
    lines = rank_lines(output)
    assert f"rendezvous {addr1}:" in lines[0] and f"=eth0 ({addr2}: the route to {addr1})" in lines[1], lines
