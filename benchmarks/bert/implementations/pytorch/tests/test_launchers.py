"""The launchers users run: `sbatch run.sub` on a real one-node SLURM cluster (munged,
slurmctld, slurmd started here in a temp dir: tests/slurm_cluster.py) and `mpirun -np 2` through mpi4py. Each run
starts from the `trained` demo model, so it reaches the target at its first evaluation; the
MLCommons compliance checker is the oracle for every log."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time

import pytest

from conftest import PKG, demo_run_env, mllog_events, run_and_time_signalled, run_checker

def test_slurm_sbatch_run_sub_two_experiments_pass_checker(slurm_cluster, trained, demo_data, tmp_path):
    assert trained.returncode == 0, trained.stdout[-3000:]
    logdir = tmp_path / "logs"
    env = demo_run_env(trained, demo_data, logdir, NEXP="2", SEED="100", DATESTAMP="ci",
                   SLURM_CONF=slurm_cluster.env["SLURM_CONF"])
    out_file = tmp_path / "job.out"
    sub = subprocess.run(["sbatch", "--parsable", "-N", env["DGXNNODES"], "-t", "10", "-o", str(out_file), "run.sub"],
                         cwd=PKG, env=env, capture_output=True, text=True, timeout=60)
    assert sub.returncode == 0, sub.stderr
    job = slurm_cluster.wait_job(sub.stdout.strip().split(";")[0], timeout_s=300)
    output = out_file.read_text()
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0", output[-4000:] + slurm_cluster.logs()
    assert output.count("compliance checker (5.0.0): PASS") == 2, output[-4000:]
    assert "run.sub: 2 run(s), 0 failed" in output
    seeds, cache = [], []
    for i in (1, 2):
        log = logdir / f"ci_{i}.log"
        ok, checker = run_checker(log)
        assert ok, checker
        events = {e["key"]: e for e in mllog_events(log)}
        seeds.append(events["seed"]["value"])
        cache.append(events["cache_clear"]["value"])
        assert events["run_stop"]["metadata"]["status"] == "success"
        resolved = json.loads((logdir / f"ci_{i}_config.json").read_text())["resolved"]
        assert resolved["launcher"] == "slurm" and resolved["world_size"] == 2
    assert seeds == [100, 101]  # distinct per run, as the closed division requires
    # cache_clear tells the truth: true only where run.sub said it dropped the cache.
    could_not = "could not drop the page cache" in output
    assert cache == [not could_not] * 2


def test_slurm_usr1_checkpoints_requeues_and_resumes(slurm_cluster, trained, demo_data, tmp_path):
    """What `sbatch --signal=B:USR1@<s> --requeue` does near the time limit, with the signal sent
    now (`scancel --batch --signal=USR1`, the same delivery) while run 2 of 2 trains: run.sub
    forwards it, the ranks checkpoint and exit 3, the job requeues itself, and the second
    start skips run 1, resumes run 2 from its checkpoint and finishes it."""
    assert trained.returncode == 0, trained.stdout[-3000:]
    logdir = tmp_path / "logs"
    # 50 steps of 64 samples before the first (target-reaching) eval; progress and polls every 5.
    env = demo_run_env(trained, demo_data, logdir, NEXP="2", SEED="7", DATESTAMP="rq", EVAL_ITER_SAMPLES="3200", MAX_SAMPLES_TERMINATION="6400",
                   SLURM_CONF=slurm_cluster.env["SLURM_CONF"])
    env["EXTRA_PARAMS"] += " log.progress_interval_steps=5 ckpt.poll_steps=5"
    out_file = tmp_path / "job.out"
    sub = subprocess.run(["sbatch", "--parsable", "--requeue", "-N", env["DGXNNODES"], "-t", "10", "-o", str(out_file),
                          "run.sub"], cwd=PKG, env=env, capture_output=True, text=True, timeout=60)
    assert sub.returncode == 0, sub.stderr
    job_id = sub.stdout.strip().split(";")[0]
    deadline = time.monotonic() + 240
    while not re.search(r"== run 2/2: seed.*\n(.*\n)*step +5 \|", out_file.read_text() if out_file.exists() else ""):
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job_id], env=slurm_cluster.env)
            pytest.fail("run 2 never reached step 5:\n" + (out_file.read_text() if out_file.exists() else "")[-3000:])
        time.sleep(0.3)
    subprocess.run(["scancel", "--batch", "--signal=USR1", job_id], env=slurm_cluster.env, check=True, timeout=30)
    # SLURM holds a requeued job back for about two minutes (its BeginTime): start it now.
    slurm_cluster.requeue_now(job_id)
    job = slurm_cluster.wait_job(job_id, timeout_s=300)
    output = out_file.read_text()
    assert job["Restarts"] == "1", output[-4000:] + slurm_cluster.logs()
    assert "SIGUSR1: requeueing job" in output and "checkpointed on a signal (training exit 3)" in output, output[-4000:]
    assert "run 1/2: done before the restart (training exit 0, checker exit 0)" in output, output[-4000:]
    assert re.search(r"resumed from .*rq_2_ckpt/step_0+\d+ at step \d+", output), output[-4000:]
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


def test_run_and_time_torchrun_forwards_usr1_to_workers_then_resumes(trained, demo_data, tmp_path):
    """SIGUSR1 to run_and_time.sh (torchrun) reaches the two workers, not torchrun (which would
    die of it and take them along): they checkpoint and stop; the same command then resumes."""
    assert trained.returncode == 0, trained.stdout[-3000:]
    env = demo_run_env(trained, demo_data, tmp_path, SEED="3", EVAL_ITER_SAMPLES="3200", MAX_SAMPLES_TERMINATION="6400",
                   CKPT_DIR=str(tmp_path / "ckpt"))
    env["EXTRA_PARAMS"] += " log.progress_interval_steps=5 ckpt.poll_steps=5"
    rc, first = run_and_time_signalled(env)
    assert rc != 0 and "stopped by signal 10 after step" in first, first[-3000:]
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("step_*")), first[-3000:]
    r = subprocess.run(["./run_and_time.sh"], cwd=PKG, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "resumed from" in r.stdout, (r.stdout + r.stderr)[-3000:]
    stops = [e["metadata"]["status"] for e in mllog_events(tmp_path / "result_0.txt") if e["key"] == "run_stop"]
    assert stops == ["aborted", "success"]


def test_run_sub_names_missing_variables(tmp_path):
    env = {"PATH": os.environ["PATH"], "DGXSYSTEM": "X", "DGXNNODES": "1"}
    r = subprocess.run(["bash", "run.sub"], cwd=PKG, env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 2
    assert "missing variable(s): DGXNGPU DATADIR EVALDIR SLURM_JOB_ID" in r.stderr


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
