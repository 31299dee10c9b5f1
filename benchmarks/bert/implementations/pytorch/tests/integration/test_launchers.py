"""The launchers users run: `sbatch run.sub` on a real one-node SLURM cluster (munged,
slurmctld, slurmd started here in a temp dir: tests/support/slurm_cluster.py) and `mpirun -np 2` through mpi4py. Each run
starts from the `trained` demo model, so it reaches the target at its first evaluation; the
MLCommons compliance checker is the oracle for every log."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import PKG, children, demo_run_env, hold_env, mllog_events, run_and_time_signalled, run_checker
from docblocks import QUICK_START, section

# The README's "Quick start on a cluster" runs here as written, except for these changes
# (each README text must exist, so the two cannot drift apart unnoticed):
QUICK_START_CHANGES = {
    # a temporary directory instead of the user's scratch space
    "export WORK=/scratch/$USER/bert": 'export WORK="$TEST_WORK/work"',
    # the tiny corpus yields ~100 eval examples and a few hundred training ones
    "EVAL_SAMPLES=10000": "EVAL_SAMPLES=50",
    '"$WORK/prepared" 2048': '"$WORK/prepared" 4',
    # start from the session's trained demo model, so the first evaluation reaches the target
    "source config_CPU_1x2.sh\n": 'source config_CPU_1x2.sh && source "$TEST_WORK/fast.sh"\n',
    # logs in the temporary directory, not the checkout's results/
    'export LOGDIR="$(git rev-parse --show-toplevel)/results/$DGXSYSTEM/bert"': 'export LOGDIR="$WORK/results"',
    # 2 runs, not 10 (so the package step reports that a score needs 10)
    "NEXP=10 sbatch": "NEXP=2 sbatch",
}


def quick_start_script() -> str:
    """The bash blocks of the README's "Quick start on a cluster", with QUICK_START_CHANGES."""
    script = "\n".join(re.findall(r"^```bash\n(.*?)^```", section(PKG / "README.md", QUICK_START), re.M | re.S))
    for readme, test in QUICK_START_CHANGES.items():
        assert script.count(readme) == 1, f"the README's quick start no longer says {readme!r}"
        script = script.replace(readme, test)
    return script


def wait_held(cluster, job_id: str, marker: Path, out_file: Path, timeout_s: float = 240) -> None:
    """Until a rank of the job has reached its hold (hold_env); cancels the job if it never does."""
    deadline = time.monotonic() + timeout_s
    while not marker.exists():
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job_id], env=cluster.env)
            pytest.fail(f"never held ({marker.name}):\n" + (out_file.read_text() if out_file.exists() else "")[-3000:])
        time.sleep(0.1)


def submit_held(cluster, env: dict[str, str], tmp_path: Path, step: int, *flags: str) -> tuple[str, Path]:
    """sbatch run.sub (``flags`` before it), then wait until rank 0 holds after ``step``
    (hold_env); the job's id and its output file."""
    out_file = tmp_path / "job.out"
    sub = subprocess.run(["sbatch", "--parsable", *flags, "-N", env["DGXNNODES"], "-t", "10", "-o", str(out_file),
                          "run.sub"], cwd=PKG, env=env, capture_output=True, text=True, timeout=60)
    assert sub.returncode == 0, sub.stderr
    job_id = sub.stdout.strip().split(";")[0]
    wait_held(cluster, job_id, tmp_path / "held" / f"held_rank0_step{step}", out_file)
    return job_id, out_file


def test_readme_quick_start_on_a_cluster(slurm_cluster, trained, demo_data, tmp_path):
    """Every command of the README's quick start, top to bottom, on a one-node SLURM cluster:
    own corpus -> vocab -> prepare_data.sh; the CPU config's demo data; sbatch run.sub with
    NEXP=2 (both runs pass the checker, distinct seeds, one RESULT line each); the verdict
    lines; tools/package.py (the result_N.txt <- log mapping; a score needs 10 runs)."""
    from input_preprocessing.toy_corpus import make_corpus

    assert trained.returncode == 0, trained.stdout[-3000:]
    corpus = tmp_path / "corpus"
    make_corpus(corpus, parts=3, docs_per_part=12, seed=2)
    make_corpus(tmp_path / "held_out", parts=1, docs_per_part=12, seed=3)[0].rename(corpus / "eval.txt")
    work = tmp_path / "work"
    fast = demo_run_env(trained, demo_data, tmp_path)
    (tmp_path / "fast.sh").write_text("".join(
        f"export {k}={shlex.quote(fast[k])}\n" for k in ("INIT_CHECKPOINT", "LR", "EVAL_ITER_SAMPLES",
                                                          "MAX_SAMPLES_TERMINATION", "EXTRA_PARAMS"))
        + "export DEMO_TRAIN_SAMPLES=4000\n")
    env = dict(os.environ, PATH=fast["PATH"], SLURM_CONF=slurm_cluster.env["SLURM_CONF"], CORPUS=str(corpus),
               TEST_WORK=str(tmp_path))
    for var in ("LOGDIR", "DATADIR", "EVALDIR", "INIT_CHECKPOINT", "SEED", "DATESTAMP", "NEXP", "CONT"):
        env.pop(var, None)
    try:
        r = subprocess.run(["bash", "-euo", "pipefail", "-c", quick_start_script()], cwd=PKG.parents[3], env=env,
                           capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        subprocess.run(["scancel", "--user", str(os.geteuid())], env=slurm_cluster.env)
        raise
    out = r.stdout + r.stderr
    job_out = "".join(p.read_text() for p in sorted((work / "results").glob("slurm-*.out")))
    # prepare_data.sh on the own corpus: its banner counts the parts; it names DATADIR and EVALDIR
    assert "== training examples: 3 parts" in out and f"DATADIR={work}/prepared/hdf5/training_4" in out, out[-4000:]
    # the job: both runs passed the checker; one RESULT line per run (rank 0's), not per task
    assert out.count("compliance checker (5.0.0): PASS") == 2 and "run.sub: 2 run(s), 0 failed" in out, \
        out[-3000:] + job_out[-3000:] + slurm_cluster.logs()
    assert job_out.count("RESULT,bert,") == 2 and ":::MLLOG" not in job_out, job_out[-3000:]
    assert "Traceback" not in job_out and "failed to bind" not in job_out, job_out[-3000:]
    logs = sorted((work / "results").glob("*_[0-9].log"))
    seeds, cache = [], []
    for log in logs:
        ok, checker = run_checker(log)
        assert ok, checker
        events = {e["key"]: e for e in mllog_events(log)}
        seeds.append(events["seed"]["value"])
        cache.append(events["cache_clear"]["value"])
        assert events["run_stop"]["metadata"]["status"] == "success"
        resolved = json.loads(log.with_name(log.stem + "_config.json").read_text())["resolved"]
        assert resolved["launcher"] == "slurm" and resolved["world_size"] == 2
    assert len(logs) == 2 and seeds[1] == seeds[0] + 1  # distinct per run, as the closed division requires
    # cache_clear tells the truth: true only where run.sub said it dropped the cache.
    assert cache == [not ("could not drop the page cache" in job_out)] * 2
    # the package: which log became which result file; 2 runs pass, but a score needs 10
    assert r.returncode == 1 and "package: FAILED" in out, out[-3000:]
    for i, log in enumerate(logs):
        assert f"result_{i}.txt <- {log}" in out, out[-3000:]
    assert "compliance checker (5.0.0)  PASS     2/2 logs pass" in out, out[-3000:]
    assert "no score: BERT's score is the mean of 10 runs without the fastest and slowest; got 2" in out, out[-3000:]


def test_slurm_usr1_checkpoints_requeues_and_resumes(slurm_cluster, trained, demo_data, tmp_path):
    """What `sbatch --signal=B:USR1@<s> --requeue` does near the time limit, with the signal sent
    now (`scancel --batch --signal=USR1`, the same delivery) while run 2 of 2 trains: run.sub
    forwards it, the ranks checkpoint and exit 3, the job requeues itself, and the second
    start skips run 1, resumes run 2 from its checkpoint and finishes it."""
    assert trained.returncode == 0, trained.stdout[-3000:]
    logdir = tmp_path / "logs"
    # 25 steps of 64 samples before the first (target-reaching) eval; progress and polls every 5.
    # Run 2's rank 0 is held after step 5 until the signal reaches it (hold_env): it is seen at
    # that step's poll, however fast the machine.
    env = demo_run_env(trained, demo_data, logdir, NEXP="2", SEED="7", DATESTAMP="rq", EVAL_ITER_SAMPLES="1600", MAX_SAMPLES_TERMINATION="3200",
                   SLURM_CONF=slurm_cluster.env["SLURM_CONF"], TENSORBOARD="1",
                   **hold_env(tmp_path, "boundary:0:5:signal:if=LOGFILE=rq_2.log"))
    env["EXTRA_PARAMS"] += " log.progress_interval_steps=5 ckpt.poll_steps=5"
    job_id, out_file = submit_held(slurm_cluster, env, tmp_path, 5, "--requeue")
    subprocess.run(["scancel", "--batch", "--signal=USR1", job_id], env=slurm_cluster.env, check=True, timeout=30)
    # SLURM holds a requeued job back for about two minutes (its BeginTime): start it now.
    slurm_cluster.requeue_now(job_id)
    job = slurm_cluster.wait_job(job_id, timeout_s=300)
    output = out_file.read_text()
    assert job["Restarts"] == "1", output[-4000:] + slurm_cluster.logs()
    assert "SIGUSR1: requeueing job" in output and "checkpointed on a signal (training exit 3)" in output, output[-4000:]
    assert "run 1/2: done before the restart (training exit 0, checker exit 0)" in output, output[-4000:]
    assert re.search(r"resumed from .*rq_2_ckpt/step_000000005 at step 5,", output), output[-4000:]
    # The resumed run reached the target, but its log holds both parts: the checker rejects
    # it, so the job says 1 of 2 failed and exits non-zero. Run 1's log is a valid result.
    assert "run 2/2: resumed from a checkpoint: not a valid timed result" in output, output[-4000:]
    assert "run.sub: 2 run(s), 1 failed" in output and job["ExitCode"] == "1:0", output[-4000:]
    assert run_checker(logdir / "rq_1.log")[0]
    events = mllog_events(logdir / "rq_2.log")
    stops = [e["metadata"]["status"] for e in events if e["key"] == "run_stop"]
    assert stops == ["aborted", "success"]
    assert [e["value"] for e in events if e["key"] == "seed"] == [8, 8]  # the same seed after the restart
    assert any(e["key"] == "resumed_from_checkpoint" for e in events)
    assert (logdir / "rq_2_ckpt" / "finished.json").exists()
    assert not (logdir / f".run.sub_job_{job_id}").exists()  # the job's state is gone once it ends
    # TENSORBOARD=1: each run's curves beside its log; the requeued run 2 continued its own
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for i in (1, 2):
        acc = EventAccumulator(str(logdir / f"rq_{i}_tb"))
        acc.Reload()
        assert [e.step for e in acc.Scalars("train/loss")] == [5, 10, 15, 20, 25], i
        assert [e.step for e in acc.Scalars("balance/busiest_over_mean_tokens")] == list(range(1, 26)), i


def test_slurm_sigint_stops_the_job_after_a_checkpoint(slurm_cluster, trained, demo_data, tmp_path):
    """SIGINT to run.sub's batch shell (`scancel --batch --signal=INT`: what Ctrl-C is to a
    batch job) during run 1 of 2: forwarded to the step (srun --disable-status passes it on),
    the ranks checkpoint (run.sub gives every run a CKPT_DIR) and exit 130; so does the job,
    neither requeued nor starting run 2; no traceback."""
    assert trained.returncode == 0, trained.stdout[-3000:]
    logdir = tmp_path / "logs"
    env = demo_run_env(trained, demo_data, logdir, NEXP="2", SEED="7", DATESTAMP="int", EVAL_ITER_SAMPLES="3200",
                       MAX_SAMPLES_TERMINATION="6400", SLURM_CONF=slurm_cluster.env["SLURM_CONF"],
                       **hold_env(tmp_path, "boundary:0:5:signal:if=LOGFILE=int_1.log"))
    env["EXTRA_PARAMS"] += " log.progress_interval_steps=5 ckpt.poll_steps=5"
    job_id, out_file = submit_held(slurm_cluster, env, tmp_path, 5)  # held until SIGINT reaches it
    subprocess.run(["scancel", "--batch", "--signal=INT", job_id], env=slurm_cluster.env, check=True, timeout=30)
    job = slurm_cluster.wait_job(job_id, timeout_s=300)
    output = out_file.read_text()
    assert job["ExitCode"] == "130:0" and job["Restarts"] == "0", output[-4000:] + slurm_cluster.logs()
    assert re.search(r"^interrupted \(Ctrl-C\): stopped at step 5; checkpoint \S+/int_1_ckpt/step_000000005 written",
                     output, re.M), output[-4000:]
    assert "== run 1/2: interrupted (training exit 130)" in output and "== run 2/2" not in output, output[-4000:]
    assert "run.sub: interrupted (SIGINT) at run 1: stopped, not requeued" in output, output[-4000:]
    assert "Traceback" not in output, output[-4000:]
    assert mllog_events(logdir / "int_1.log")[-1]["metadata"]["status"] == "aborted"
    assert not (logdir / "int_2.log").exists()


def _job_processes(job_id: str, what: bytes) -> list[int]:
    """Live processes of SLURM job ``job_id`` whose command line holds ``what`` (from /proc)."""
    out = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            env = proc.joinpath("environ").read_bytes().split(b"\0")
            cmd = proc.joinpath("cmdline").read_bytes()
            state = proc.joinpath("stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if f"SLURM_JOB_ID={job_id}".encode() in env and what in cmd and state not in ("Z", "X"):
            out.append(int(proc.name))
    return out


def test_slurm_kill9_of_the_batch_script_leaves_nothing_running(slurm_cluster, trained, demo_data, tmp_path):
    """kill -9 of run.sub's batch shell mid-run (nothing can trap it): the step's tasks and the
    trainers end with it, and the job ends, instead of training on unwatched. Held after step 3
    (hold_env), so the run is mid-way whatever the speed."""
    assert trained.returncode == 0, trained.stdout[-3000:]
    env = demo_run_env(trained, demo_data, tmp_path / "logs", NEXP="1", SEED="7", DATESTAMP="k9",
                       EVAL_ITER_SAMPLES="64000", MAX_SAMPLES_TERMINATION="640000",
                       SLURM_CONF=slurm_cluster.env["SLURM_CONF"], **hold_env(tmp_path, "boundary:0:3:file=never"))
    env["EXTRA_PARAMS"] += " log.progress_interval_steps=1"
    job_id, _ = submit_held(slurm_cluster, env, tmp_path, 3)
    trainers = _job_processes(job_id, b"bert.train")
    (batch,) = _job_processes(job_id, b"slurm_script")
    assert len(trainers) == 2, trainers
    os.kill(batch, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while _job_processes(job_id, b"") and time.monotonic() < deadline:
        time.sleep(0.5)
    left = {pid: Path(f"/proc/{pid}/cmdline").read_bytes()[:80] for pid in _job_processes(job_id, b"")}
    assert not left, left
    job = slurm_cluster.wait_job(job_id, timeout_s=60)
    assert job["JobState"] != "RUNNING", job


def test_run_and_time_torchrun_forwards_usr1_to_workers_then_resumes(trained, demo_data, tmp_path):
    """SIGUSR1 to run_and_time.sh (torchrun) reaches the two workers, not torchrun (which would
    die of it and take them along): they checkpoint and stop; the same command then resumes.
    Sent as the script starts: the workers act on it at their first poll (step 5), 20 steps
    before the run's first evaluation would end it."""
    assert trained.returncode == 0, trained.stdout[-3000:]
    env = demo_run_env(trained, demo_data, tmp_path, SEED="3", EVAL_ITER_SAMPLES="1600", MAX_SAMPLES_TERMINATION="3200",
                   CKPT_DIR=str(tmp_path / "ckpt"))
    env["EXTRA_PARAMS"] += " log.progress_interval_steps=5 ckpt.poll_steps=5"
    rc, first = run_and_time_signalled(env)
    # exit 3 (checkpointed: run again), not torchrun's 1 and ChildFailedError; nothing to count
    assert rc == 3 and "stopped by signal 10 after step 5:" in first, first[-3000:]
    assert "Traceback" not in first and "RESULT," not in first, first[-3000:]
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step_*")), first[-3000:]
    r = subprocess.run(["./run_and_time.sh"], cwd=PKG, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "resumed from" in r.stdout, (r.stdout + r.stderr)[-3000:]
    stops = [e["metadata"]["status"] for e in mllog_events(tmp_path / "result_0.txt") if e["key"] == "run_stop"]
    assert stops == ["aborted", "success"]


def _run_and_time(env: dict[str, str], cwd=PKG) -> subprocess.CompletedProcess:
    return subprocess.run([str(PKG / "run_and_time.sh")], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


def test_run_and_time_status_is_the_trainers_under_torchrun(trained, demo_data, tmp_path):
    """torchrun reports any non-zero worker exit as 1 with a ChildFailedError traceback;
    run_and_time.sh returns the trainer's own status and prints RESULT only for a run that
    trained (target: 0, the `trained` fixture; preemption: 3, the USR1 test above)."""
    assert trained.returncode == 0, trained.stdout[-3000:]
    # No config sourced: say what to do, not "DGXNGPU must be set".
    r = _run_and_time({"PATH": os.environ["PATH"]})
    assert r.returncode == 2 and "source a config_*.sh" in r.stderr and "RESULT" not in r.stdout, r.stderr
    # A config typo: 2, said once (not once per rank), no traceback, no RESULT.
    env = demo_run_env(trained, demo_data, tmp_path / "typo")
    env["EXTRA_PARAMS"] += " optim.lrr=1"
    r = _run_and_time(env)
    out = r.stdout + r.stderr
    assert r.returncode == 2 and out.count("unknown config key 'optim.lrr'") == 1, out[-3000:]
    assert "Traceback" not in out and "RESULT," not in out, out[-3000:]
    # The sample limit: 1 and one RESULT line, no traceback. A relative LOGDIR is the
    # caller's; log.echo_mllog=true prints each MLLOG line once beside the log file's. SEED
    # unset: the RESULT line has the seed the run drew, as its log has it.
    env = demo_run_env(trained, demo_data, "rel/logs", TARGET_MLM_ACCURACY="0.999", MAX_SAMPLES_TERMINATION="128")
    env.pop("SEED", None)
    env["EXTRA_PARAMS"] += " log.echo_mllog=true"
    r = _run_and_time(env, cwd=tmp_path)
    out = r.stdout + r.stderr
    assert r.returncode == 1 and len(re.findall(r"^RESULT,bert,", r.stdout, re.M)) == 1, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    log = tmp_path / "rel" / "logs" / "result_0.txt"
    events = mllog_events(log)
    (seed,) = [e["value"] for e in events if e["key"] == "seed"]
    assert re.search(rf"^RESULT,bert,{seed},\d+,", r.stdout, re.M), r.stdout[-2000:]
    assert [e["metadata"]["status"] for e in events if e["key"] == "run_stop"] == ["aborted"]
    assert r.stdout.count(":::MLLOG") == len(events)


def test_run_and_time_exits_4_when_a_rank_dies_under_torchrun(trained, demo_data, tmp_path):
    """SIGKILL to rank 1 mid-run: rank 0's next collective fails, it says so and its status
    (4) is the script's, not torchrun's 1; nothing trained to the end, so no RESULT line."""
    assert trained.returncode == 0, trained.stdout[-3000:]
    env = demo_run_env(trained, demo_data, tmp_path, EVAL_ITER_SAMPLES="64000", MAX_SAMPLES_TERMINATION="128000")
    env["EXTRA_PARAMS"] += " log.progress_interval_steps=5"

    def kill_rank_1(proc):
        workers = [w for torchrun in children(proc.pid) for w in children(torchrun)]
        for worker in workers:
            if b"RANK=1" in Path(f"/proc/{worker}/environ").read_bytes().split(b"\0"):
                os.kill(worker, signal.SIGKILL)

    rc, out = run_and_time_signalled(env, at_step=5, act=kill_rank_1)
    assert rc == 4 and "error: rank 0 of 2: a collective failed" in out, out[-3000:]
    assert "RESULT," not in out


def test_run_sub_checks_paths_before_the_first_run(tmp_path):
    env = {"PATH": os.environ["PATH"], "DGXSYSTEM": "X", "DGXNNODES": "1", "DGXNGPU": "2", "SLURM_JOB_ID": "1",
           "SLURM_JOB_NUM_NODES": "1", "DATADIR": str(tmp_path / "nope"), "EVALDIR": str(tmp_path),
           "INIT_CHECKPOINT": str(tmp_path / "model.ckpt-28252"), "LOGDIR": str(tmp_path / "logs")}
    r = subprocess.run(["bash", "run.sub"], cwd=PKG, env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"DATADIR={tmp_path / 'nope'} (no such directory)" in r.stderr
    assert "INIT_CHECKPOINT=" in r.stderr and "EVALDIR=" not in r.stderr
    assert not (tmp_path / "logs").exists()  # nothing was run, no log begun
    (tmp_path / "model.ckpt-28252.index").write_bytes(b"")  # a TF checkpoint prefix is a path too
    env["DATADIR"] = str(tmp_path)
    r = subprocess.run(["bash", "run.sub"], cwd=PKG, env=env, capture_output=True, text=True, timeout=30)
    assert "no such" not in r.stderr, r.stderr


def test_run_sub_names_missing_variables(tmp_path):
    env = {"PATH": os.environ["PATH"], "DGXSYSTEM": "X", "DGXNNODES": "1"}
    r = subprocess.run(["bash", "run.sub"], cwd=PKG, env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 2
    assert "missing variable(s): DGXNGPU DATADIR EVALDIR SLURM_JOB_ID" in r.stderr


def test_run_sub_asks_for_the_gpus_a_cuda_config_names_and_takes_sbatch_options(demo_data, tmp_path):
    """A cluster whose node has 2 GPUs as SLURM sees them (stand-in device files): the CPU
    config made a GPU job by the user's EXTRA_PARAMS (run.device=cuda, DGXNGPU=2). On a shared
    node without a GPU request the job stops before any run, saying what to ask for; with
    --gpus-per-node=2 it passes that check and the trainer, on this CPU-only torch, refuses the
    CUDA run in one line. sbatch's own options give a partition, an account, memory and a
    shared node over run.sub's #SBATCH lines (--exclusive --mem=0). A timed run (the checker
    judges it) of a config written for 2 nodes, in a job of 1, with nothing to continue, stops
    before it starts: its log would pass as the 2-node system's."""
    from slurm_cluster import SlurmCluster, slurm_unavailable

    why = slurm_unavailable()
    if why:
        pytest.skip(why)
    cluster = SlurmCluster(tmp_path / "slurm", gpus=2)
    (tmp_path / "slurm").mkdir()
    env = dict(os.environ, **demo_data.env)
    env.update(PATH=demo_data.path, SLURM_CONF=str(cluster.conf), DATADIR=str(demo_data.train),
               EVALDIR=str(demo_data.eval), LOGDIR=str(tmp_path / "logs"), NEXP="1", CLEAR_CACHES="0",
               CHECK_COMPLIANCE="0", STEP_WAIT_S="5", EXTRA_PARAMS="run.device=cuda")
    try:
        cluster.start()

        def job(*flags: str, **variables: str) -> tuple[dict[str, str], str]:
            out = tmp_path / f"job{len(list(tmp_path.glob('job*.out')))}.out"
            sub = subprocess.run(["sbatch", "--parsable", "-N", "1", "-t", "5", "-o", str(out), "-p", "ci", "-A", "lab",
                                  "--mem=100M", "--oversubscribe", "--ntasks-per-node=2", *flags, "run.sub"], cwd=PKG,
                                 env={**env, **variables}, capture_output=True, text=True, timeout=60)
            assert sub.returncode == 0, sub.stderr
            job_id = sub.stdout.strip().split(";")[0]
            fields = cluster.job_fields(job_id)
            assert (fields["Partition"], fields["Account"], fields["MinMemoryNode"], fields["OverSubscribe"]) == \
                ("ci", "lab", "100M", "YES"), fields
            return cluster.wait_job(job_id, timeout_s=240), out.read_text()

        state, text = job()
        assert state["ExitCode"] == "2:0", text
        assert "run.sub: the config runs on GPUs (run.device=cuda), 2 per node, and the job has no GPU(s) per node: " \
               "submit with sbatch --gpus-per-node=2 (or --gres=gpu:2)" in text
        assert "== run 1/1" not in text
        state, text = job("--gpus-per-node=2")
        assert "== run 1/1" in text and "config error: run.device=cuda: this torch" in text, text[-3000:]
        assert "== run 1/1: training exit 2" in text and state["ExitCode"] == "1:0", text[-3000:]
        state, text = job("--gpus-per-node=2", DGXNNODES="2", CHECK_COMPLIANCE="1")
        assert state["ExitCode"] == "2:0" and "== run 1/1" not in text, text[-3000:]
        assert "run.sub: the job has 1 node(s), the config 2 (DGXNNODES): its global batch 128 kept as 32 per task x 2 " \
               "micro-step(s) x 2 tasks" in text, text[-3000:]
        assert "run.sub: run 1 would start fresh on 1 node(s), and a timed result runs on its config's 2 (DGXNNODES: " \
               "the system CPU_1x2 describes): submit with sbatch -N 2" in text, text[-3000:]
    finally:
        cluster.stop()


def test_mpirun_two_ranks_through_mpi4py(trained, demo_data, tmp_path):
    if shutil.which("mpirun") is None:
        pytest.skip("Open MPI not installed; .ci/run installs openmpi-bin")
    pytest.importorskip("mpi4py", reason="the mpi extra (mpi4py) is not installed")
    assert trained.returncode == 0, trained.stdout[-3000:]
    env = demo_run_env(trained, demo_data, tmp_path, LAUNCHER="task", SEED="5",
                   OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env.pop("MASTER_ADDR", None)
    env.pop("MASTER_PORT", None)
    r = subprocess.run(["mpirun", "-np", "2", "-x", "PATH", "./run_and_time.sh"], cwd=PKG, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    ok, checker = run_checker(tmp_path / "result_0.txt")
    assert ok, checker
    resolved = json.loads((tmp_path / "result_0_config.json").read_text())["resolved"]
    # Open MPI's variables gave rank/world; mpi4py gave the rendezvous (no MASTER_ADDR set).
    assert resolved["launcher"] == "mpi+mpi4py" and resolved["world_size"] == 2
