"""`sbatch -N 2 run.sub` on a real two-node SLURM cluster: each slurmd in a network namespace
of its own, one veth (eth0) per node into a bridge on the host (tests/support/slurm_cluster.py). The
nodes share the hostname, which resolves to loopback here: only SLURM's NodeAddr and the
route to it tell the ranks how to reach each other, as on a cluster whose /etc/hosts maps
the hostname to 127.0.1.1. config_CPU_1x2.sh at one rank per node, from the `trained` demo
model, so a run reaches the target at its first evaluation; the MLCommons compliance
checker is the oracle for every log. A run continues on another node count: requeued from 2
nodes onto the 1 left (run.sub), submitted again from 1 onto 2 (submit_pretrain.sh)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from conftest import PKG, demo_run_env, hold_env, mllog_events, run_checker, source_config
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


def sbatch(cluster: SlurmCluster, env: dict[str, str], out_file: Path, *args: str, nodes: str = "2") -> str:
    sub = subprocess.run(["sbatch", "--parsable", "-N", nodes, "-t", "10", "-o", str(out_file), *args, "run.sub"],
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


def test_two_nodes_usr1_checkpoints_requeues_and_resumes_on_the_node_left(two_nodes, trained, demo_data, tmp_path):
    """The preemption path of test_launchers.py's one-node test, across two nodes, and the
    requeue lands on fewer: the job asks for 1-2 nodes (`sbatch -N 1-2`), starts on both (one
    rank each, the config's DGXNNODES=2); the ranks on both nodes checkpoint to the shared
    directory and exit 3, the job requeues itself, and node2, drained meanwhile (a failing node
    taken out), is not there when it starts again. run.sub keeps the config's global batch of 64
    on the one rank left (32 x 2 micro-steps), the resume continues the run of 2 ranks on 1, and
    it ends where the uninterrupted run does: the target at 1,600 samples, step 25."""
    assert trained.returncode == 0, trained.stdout[-3000:]
    logdir = tmp_path / "logs"
    out_file = tmp_path / "job.out"
    # 25 steps of 64 samples before the first (target-reaching) eval; progress and polls every 5.
    # Rank 1 (node2) is held after step 5 until the signal reaches it (hold_env): seen at that
    # step's poll, however fast the machine.
    env = two_node_env(two_nodes, trained, demo_data, logdir, SEED="9", DATESTAMP="rq2", EVAL_ITER_SAMPLES="1600",
                       MAX_SAMPLES_TERMINATION="3200", **hold_env(tmp_path, "boundary:1:5:signal"))
    env["EXTRA_PARAMS"] += " log.progress_interval_steps=5 ckpt.poll_steps=5"
    job_id = sbatch(two_nodes, env, out_file, "--requeue", nodes="1-2")
    deadline = time.monotonic() + 240
    while not (tmp_path / "held" / "held_rank1_step5").exists():
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job_id], env=two_nodes.env)
            pytest.fail("rank 1 never held at step 5:\n" + (out_file.read_text() if out_file.exists() else "")[-3000:])
        time.sleep(0.1)
    two_nodes.drain("node2")
    try:
        subprocess.run(["scancel", "--batch", "--signal=USR1", job_id], env=two_nodes.env, check=True, timeout=30)
        two_nodes.requeue_now(job_id)
        job = two_nodes.wait_job(job_id, timeout_s=300)
    finally:
        two_nodes.undrain("node2")
    output = out_file.read_text()
    first, _, second = output.partition("SIGUSR1: requeueing job")
    assert job["Restarts"] == "1" and second, output[-4000:] + two_nodes.logs()
    assert "checkpointed on a signal (training exit 3)" in first and len(rank_lines(first)) == 2, output[-4000:]
    assert "run.sub: the job has 1 node(s), the config 2 (DGXNNODES): its global batch 64 kept as 32 per task x 2 " \
           "micro-step(s) x 1 tasks" in second, second[-4000:]
    assert re.search(r"resumed from .*rq2_1_ckpt/step_000000005 at step 5,", second), second[-4000:]
    assert "resuming a run of 2 ranks on 1: its global batch 64 kept" in second, second[-4000:]
    # Resumed: the run reached the target, but the checker rejects a log of two parts.
    assert "run 1/1: resumed from a checkpoint: not a valid timed result" in output, output[-4000:]
    assert "run.sub: 1 run(s), 1 failed" in output and job["ExitCode"] == "1:0", output[-4000:]
    events = mllog_events(logdir / "rq2_1.log")
    assert [e["metadata"]["status"] for e in events if e["key"] == "run_stop"] == ["aborted", "success"]
    assert [e["value"] for e in events if e["key"] == "seed"] == [9, 9]
    assert [e["value"] for e in events if e["key"] == "global_batch_size"] == [64, 64]
    assert [e["metadata"]["epoch_num"] for e in events if e["key"] == "eval_accuracy"] == [1600]
    resolved = json.loads((logdir / "rq2_1_config.json").read_text())
    assert resolved["resolved"]["world_size"] == 1 and resolved["run"]["grad_accum_steps"] == 2, resolved["resolved"]
    assert (logdir / "rq2_1_ckpt" / "finished.json").exists()


def test_two_nodes_submit_pretrain_resubmitted_on_more_nodes_continues(two_nodes, demo_data, tmp_path):
    """submit_pretrain.sh with tiny phase configs of one node, one rank (global batch 32):
    phase 2 waits for phase 1 (afterok); phase 1 is cancelled mid-run (scancel: SIGTERM, as a
    preemption sends), checkpoints and stops, and phase 2 is dropped with it. Submitted again
    with DGXNNODES=2 (the config's batch per rank on twice the ranks: 64), the resume is
    refused (exit 2), nothing recorded, the checkpoint kept; submitted again as
    docs/cluster.md says, NODES=2, phase 1 continues on two nodes (16 per rank: the global
    batch kept) to its end, and phase 2 starts from its final weights there."""
    demo = source_config("config_CPU_1x2.sh")
    for p, steps in ((1, 10), (2, 4)):  # phase 1: held after step 5 until signalled (hold_env)
        (tmp_path / f"phase{p}.sh").write_text(
            f"export DGXSYSTEM=CPU_1x1 DGXNNODES=1 DGXNGPU=1 WALLTIME=10 CPU_THREADS_PER_RANK=1 DIVISION=open\n"
            f"export BATCHSIZE=32 GRADIENT_STEPS=1 LR=0.005 MAX_STEPS={steps} WARMUP_STEPS=2 "
            f"EVAL_ITER_SAMPLES={32 * steps}\n"
            f"export CONFIG_PARAMS=\"run.mode=pretrain {demo['CONFIG_PARAMS']} data.eval_samples=200 "
            f"log.progress_interval_steps=5 ckpt.poll_steps=5\"\n")
    out = tmp_path / "out"
    env = dict(os.environ, PATH=demo_data.path, SLURM_CONF=two_nodes.env["SLURM_CONF"],
               DATADIR1=str(demo_data.train), EVALDIR1=str(demo_data.eval), DATADIR2=str(demo_data.train),
               EVALDIR2=str(demo_data.eval), OUTDIR=str(out),
               **hold_env(tmp_path, "boundary:0:5:signal:if=LOGFILE=phase1_1.log"))
    for var in ("MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "NODES", "CONFIG_SCRIPT"):
        env.pop(var, None)

    def submit(**extra: str) -> tuple[str, str, str]:
        sub = subprocess.run(["./submit_pretrain.sh", str(tmp_path / "phase1.sh"), str(tmp_path / "phase2.sh")],
                             cwd=PKG, env={**env, **extra}, capture_output=True, text=True, timeout=120)
        assert sub.returncode == 0, sub.stdout + sub.stderr
        job1, job2 = re.findall(r"job (\d+)", sub.stdout)[:2]
        assert (two_nodes.job_fields(job2).get("Dependency") or "").startswith(f"afterok:{job1}")
        return job1, job2, sub.stdout

    def job_output(phase: int, job: str) -> str:
        path = out / f"phase{phase}" / f"slurm-{job}.out"
        return path.read_text() if path.exists() else f"(job {job} wrote no output: it never started)"

    job1, job2, _ = submit()
    deadline = time.monotonic() + 240
    while not (tmp_path / "held" / "held_rank0_step5").exists():
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job1, job2], env=two_nodes.env)
            pytest.fail("phase 1 never held at step 5:\n" + two_nodes.logs())
        time.sleep(0.1)
    subprocess.run(["scancel", job1], env=two_nodes.env, check=True, timeout=30)
    two_nodes.wait_job(job1, timeout_s=120)
    assert two_nodes.wait_job(job2, timeout_s=60)["JobState"] == "CANCELLED"  # its dependency can never be met
    text = job_output(1, job1)
    assert "checkpointed on a signal (training exit 3)" in text, text[-3000:]
    ckpt = out / "phase1" / "phase1_1_ckpt"
    assert sorted(p.name for p in ckpt.glob("step_*")) == ["step_000000005"], text[-3000:]

    # DGXNNODES is the config's, part of its global batch: 32 per rank on 2 ranks is another run.
    job1, job2, said = submit(DGXNNODES="2")
    assert f"phase 1: stopped before its end: its job continues it from its newest checkpoint in {ckpt}" in said, said
    j1 = two_nodes.wait_job(job1, timeout_s=240)
    two_nodes.wait_job(job2, timeout_s=60)
    text = job_output(1, job1)
    assert j1["ExitCode"] == "2:0", text[-3000:]
    assert "written with global batch 32 (1 rank), this run has 64 (2 ranks); a resume keeps the global batch" \
        in text, text[-3000:]
    assert f"run.sub: run 1 could not continue from its checkpoint in {ckpt} (training exit 2" in text, text[-3000:]
    state = out / "phase1" / "phase1_state.txt"
    assert not state.exists() or "done 1 " not in state.read_text()  # no record: the next submission runs it
    assert sorted(p.name for p in ckpt.glob("step_*")) == ["step_000000005"] and not (ckpt / "finished.json").exists()

    job1, job2, said = submit(NODES="2")
    assert "phase 1: stopped before its end: its job continues it" in said, said
    j1, j2 = two_nodes.wait_job(job1, timeout_s=300), two_nodes.wait_job(job2, timeout_s=300)
    text1, text2 = job_output(1, job1), job_output(2, job2)
    assert j1["JobState"] == "COMPLETED" and j1["NumNodes"] == "2", text1[-3000:]
    assert "run.sub: the job has 2 node(s), the config 1 (DGXNNODES): its global batch 32 kept as 16 per task x 1 " \
           "micro-step(s) x 2 tasks" in text1, text1[-3000:]
    assert re.search(r"resumed from .*phase1_1_ckpt/step_000000005 at step 5,", text1), text1[-3000:]
    assert "resuming a run of 1 rank on 2: its global batch 32 kept" in text1, text1[-3000:]
    assert j2["JobState"] == "COMPLETED", text2[-3000:]
    assert (out / "phase1" / "final.pt").exists() and (out / "phase2" / "final.pt").exists()
    cfg2 = json.loads((out / "phase2" / "phase2_1_config.json").read_text())
    assert cfg2["run"]["init_checkpoint"] == str(out / "phase1" / "final.pt") and cfg2["run"]["mode"] == "pretrain"
    assert cfg2["resolved"]["world_size"] == 2 and cfg2["run"]["local_batch_size"] == 16
    events = mllog_events(out / "phase1" / "phase1_1.log")
    assert [e["metadata"]["status"] for e in events if e["key"] == "run_stop"] == ["aborted", "success"]
    assert [e["metadata"]["samples_count"] for e in events if e["key"] == "run_stop"] == [160, 320]
    assert (out / "phase1" / "phase1_1_curves.png").exists()


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
