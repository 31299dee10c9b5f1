"""tools/tune.py and tools/tune.sub: an Optuna study over the demo model's learning rate and
beta1 on the one-node SLURM cluster (2 trials at a time, hopeless trials pruned, a setting
that reaches the target picked), a requeued worker's trial retried once and counted once,
and the parts that need no training: the space file, a trial's environment, the objective,
and the reaper that fails and retries the trials of dead workers.

Every trial starts from the `trained` demo model (demo_run_env) with a raised target (0.77;
the model starts at 0.74): a good rate reaches it at its first evaluation, 320 samples in,
a far too small one stays at 0.74 until the pruner stops it. A trial trains on one rank
(DGXNGPU=1, still through run_and_time.sh and torchrun): what is tested is the study around
the runs, and a second rank would add a process (mostly torch's start-up) to each of its
runs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from optuna.trial import TrialState

from bert import mlperf_log
from conftest import PKG, demo_run_env, hold_env


sys.path.insert(0, str(PKG / "tools"))
import tune  # noqa: E402  (tools/ holds scripts, not a package)
from tune_helpers import FIXED, load, write_space


TINY_LR = 1e-6  # far too small: the trained model's accuracy does not move (0.742 -> 0.742)


def submit_array(cluster, env: dict[str, str], tasks: str, out: Path, *extra: str) -> str:
    sub = subprocess.run(["sbatch", "--parsable", f"--array={tasks}", "-N", "1", "-t", "10", "--open-mode=append",
                          "-o", str(out / "task_%a.out"), *extra, "tools/tune.sub"],
                         cwd=PKG, env=env, capture_output=True, text=True, timeout=60)
    assert sub.returncode == 0, sub.stderr
    return sub.stdout.strip().split(";")[0]


def outputs(out: Path) -> str:
    return "\n".join(f"== {p.name}\n{p.read_text()[-3000:]}" for p in sorted(out.glob("task_*.out")))


def test_space_file_is_checked_and_names_the_key(tmp_path):
    ok = tune.load_space(write_space(tmp_path / "ok.yaml"))
    assert ok.params["LR"].log and ok.params["OPT_LAMB_BETA_1"].low == 0.5 and ok.base_config.is_file()
    bad = {"params": {"LR": {"low": 1e-3}}, "fixed": {"LR": 1e-3},
           "base_config": "config_NONE.sh", "trails": 3, "sampler": {"name": "grid"}}
    expect = {"params": "params.LR: missing high", "fixed": "['LR'] both searched (params) and fixed",
              "base_config": "base_config: no such file", "trails": "unknown key(s) ['trails']"}
    for key, message in expect.items():
        with pytest.raises(tune.SpaceError, match=re.escape(message)):
            tune.load_space(write_space(tmp_path / f"{key}.yaml", **{key: bad[key]}))
    r = subprocess.run([sys.executable, "tools/tune.py", "worker", "--space", str(write_space(
        tmp_path / "s.yaml", sampler={"name": "grid"})), "--workdir", str(tmp_path)], cwd=PKG,
        capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "sampler.name: 'grid'" in r.stderr, r.stderr


def test_trial_env_layers_config_fixed_and_trial_values(tmp_path):
    """The base config < the worker's environment (what the user set) < fixed < the trial's
    values; dotted keys are appended to EXTRA_PARAMS, the config's own stay in CONFIG_PARAMS."""
    space = tune.load_space(write_space(tmp_path / "s.yaml", params={
        "LR": {"low": 1e-3, "high": 1e-1, "log": True}, "optim.beta2": {"low": 0.9, "high": 0.999}}))
    env = tune.run_env(space, {"LR": 0.0123, "optim.beta2": 0.95},
                       {"PATH": os.environ["PATH"], "LR": "9", "DATADIR": "/data", "EVAL_ITER_SAMPLES": "1",
                        "WARMUP_STEPS": "7", "OPT_LAMB_BETA_2": "0.98", "EXTRA_PARAMS": "log.progress_interval_steps=5"})
    assert env["LR"] == "0.0123" and env["DATADIR"] == "/data"
    assert env["EVAL_ITER_SAMPLES"] == "320" and env["DGXNGPU"] == "1"  # fixed
    assert env["OPT_LAMB_BETA_1"] == "0.9" and env["MAX_STEPS"] == "2000"  # the config's
    assert env["WARMUP_STEPS"] == "0"  # fixed over the worker's 7 over the config's 50
    assert env["OPT_LAMB_BETA_2"] == "0.98"  # the worker's over the config's 0.999
    assert env["EXTRA_PARAMS"].split() == ["log.progress_interval_steps=5", "data.eval_samples=500", "optim.beta2=0.95"]
    assert "model.hidden_size=128" in env["CONFIG_PARAMS"].split()


def test_study_on_slurm_prunes_tiny_rate_and_picks_a_setting_that_reaches_target(
        slurm_cluster, trained, demo_data, tmp_path):
    assert trained.returncode == 0, trained.stdout[-3000:]
    # Two good settings first (the pruner needs a finished trial to compare with), then a far
    # too small rate; the other three are TPE's (random until its startup trials are done).
    space_file = write_space(tmp_path / "space.yaml", enqueue=[{"LR": 5e-3, "OPT_LAMB_BETA_1": 0.9},
                                                               {"LR": 3e-3, "OPT_LAMB_BETA_1": 0.8},
                                                               {"LR": TINY_LR, "OPT_LAMB_BETA_1": 0.9}])
    workdir = tmp_path / "tune"
    env = demo_run_env(trained, demo_data, tmp_path / "unused", SPACE=str(space_file), TUNE_WORKDIR=str(workdir),
                       SLURM_CONF=slurm_cluster.env["SLURM_CONF"])
    job = submit_array(slurm_cluster, env, "0-5%2", tmp_path)
    for task in range(6):
        state = slurm_cluster.wait_job(f"{job}_{task}", timeout_s=400)
        assert state["JobState"] == "COMPLETED", outputs(tmp_path) + slurm_cluster.logs()

    space, study = load(space_file, workdir)
    trials = study.get_trials()
    assert len(trials) == 6 and all(t.state in (TrialState.COMPLETE, TrialState.PRUNED) for t in trials), \
        [(t.number, t.state, t.user_attrs) for t in trials]
    # Two at a time: some trial started before another had finished.
    spans = sorted((t.datetime_start, t.datetime_complete) for t in trials)
    assert any(b[0] < a[1] for a, b in zip(spans, spans[1:])), spans
    # TPE's trials (one per worker process; a worker may ask before the queue is filled)
    sampled = [tuple(t.params.values()) for t in trials if t.params not in space.enqueue]
    assert len(sampled) == 3 and len(set(sampled)) == 3, sampled
    tiny = next(t for t in trials if t.params["LR"] == TINY_LR)
    assert tiny.state == TrialState.PRUNED, (tiny.state, tiny.intermediate_values)
    # Stopped cleanly: the run's own log ends with run_stop aborted, before its sample cap.
    run = tiny.user_attrs["runs"][0]
    assert run["status"] == "pruned"
    stops = mlperf_log.run_stops(mlperf_log.read_events(Path(run["log"])))
    assert len(stops) == 1 and stops[0][0] == "aborted" and stops[0][1] < 1600, stops
    assert not list(Path(run["log"]).parent.glob("*_ckpt"))  # its stop checkpoint is gone

    r = subprocess.run([sys.executable, "tools/tune.py", "report", "--space", str(space_file), "--workdir",
                        str(workdir)], cwd=PKG, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    out = workdir / "lr_beta1"
    best = min((t for t in trials if tune.succeeded(t)), key=lambda t: (t.value, t.number))
    assert f"best: trial {best.number}, {best.value:.0f} samples to target" in r.stdout
    # It reached the target, in the samples the log says.
    log = Path(best.user_attrs["runs"][0]["log"])
    assert mlperf_log.run_stops(mlperf_log.read_events(log)) == [("success", round(best.value))]
    assert best.value <= 1600 and best.params["LR"] > 1e-4
    rows = (out / "trials.csv").read_text().splitlines()
    assert len(rows) == 7 and rows[0].startswith("trial,outcome,LR,OPT_LAMB_BETA_1,samples_to_target")
    assert any(",pruned at eval" in row for row in rows)
    sourced = subprocess.run(["bash", "-c", f"source config_CPU_1x2.sh; source {out / 'best.sh'}; "
                              "echo $LR $OPT_LAMB_BETA_1"], cwd=PKG, capture_output=True, text=True, check=True)
    assert [float(v) for v in sourced.stdout.split()] == [best.params["LR"], best.params["OPT_LAMB_BETA_1"]]
    for png in ("objective.png", "importance.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_requeued_worker_trial_is_retried_once_and_counted_once(slurm_cluster, trained, demo_data, tmp_path):
    """`scontrol requeue` of an array task while its trial trains (what preemption or a node
    failure does): the trial ends FAIL, its setting runs again exactly once (here in the
    requeued task), and the study counts each setting once. Two seeds per setting: a
    trial's value is the mean of its runs' samples to target."""
    assert trained.returncode == 0, trained.stdout[-3000:]
    # 25 steps (of 32: one rank) before the first evaluation. Progress every 5 steps. Task 0's
    # first run is held after step 5 until the requeue's SIGTERM reaches it (hold_env).
    fixed = dict(FIXED, EVAL_ITER_SAMPLES=800, MAX_SAMPLES_TERMINATION=800)
    fixed["log.progress_interval_steps"] = 5
    space_file = write_space(tmp_path / "space.yaml", study="requeue", trials=2, repeats=2, seed=11, fixed=fixed,
                             enqueue=[{"LR": 5e-3, "OPT_LAMB_BETA_1": 0.9}, {"LR": 4e-3, "OPT_LAMB_BETA_1": 0.85}])
    workdir = tmp_path / "tune"
    env = demo_run_env(trained, demo_data, tmp_path / "unused", SPACE=str(space_file), TUNE_WORKDIR=str(workdir),
                       SLURM_CONF=slurm_cluster.env["SLURM_CONF"],
                       **hold_env(tmp_path, "boundary:0:5:signal:if=SLURM_ARRAY_TASK_ID=0"))
    job = submit_array(slurm_cluster, env, "0-1%2", tmp_path, "--requeue")
    task0 = tmp_path / "task_0.out"
    deadline = time.monotonic() + 240
    while True:
        m = re.search(r"tune: trial (\d+): .* -> (\S+)", task0.read_text() if task0.exists() else "")
        first_run = Path(m.group(2)) / "seed_11.out" if m else tmp_path / "none"
        if first_run.exists() and (tmp_path / "held" / "held_rank0_step5").exists():
            break
        assert time.monotonic() < deadline, outputs(tmp_path)
        time.sleep(0.3)
    killed = int(m.group(1))
    subprocess.run(["scontrol", "requeue", f"{job}_0"], env=slurm_cluster.env, check=True, timeout=30)
    # SLURM holds a requeued job back (BeginTime); start it now, 2 s after it is PENDING
    # again (tests/integration/test_launchers.py: slurmd refuses a credential from the requeue's second).
    deadline = time.monotonic() + 120
    while slurm_cluster.job_fields(f"{job}_0").get("Restarts") != "1" or \
            slurm_cluster.job_fields(f"{job}_0").get("JobState") != "PENDING":
        assert time.monotonic() < deadline, outputs(tmp_path) + slurm_cluster.logs()
        time.sleep(0.5)
    time.sleep(2)
    subprocess.run(["scontrol", "update", f"JobId={job}_0", "StartTime=now"], env=slurm_cluster.env, timeout=30)
    for task in (0, 1):
        state = slurm_cluster.wait_job(f"{job}_{task}", timeout_s=300)
        assert state["JobState"] == "COMPLETED", outputs(tmp_path) + slurm_cluster.logs()

    _, study = load(space_file, workdir)
    trials = study.get_trials()
    dead = trials[killed]
    assert dead.state == TrialState.FAIL and dead.user_attrs["worker"] == f"{job}_0", outputs(tmp_path)
    retries = [t for t in trials if t.system_attrs.get("failed_trial") == killed]
    assert len(retries) == 1 and retries[0].params == dead.params and retries[0].state == TrialState.COMPLETE
    assert sorted(t.state.name for t in trials) == ["COMPLETE", "COMPLETE", "FAIL"], \
        [(t.number, t.state, t.params) for t in trials]
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    assert len({tuple(sorted(t.params.items())) for t in complete}) == 2  # each setting counted once
    for t in complete:
        runs = t.user_attrs["runs"]
        assert tune.succeeded(t) and [r["seed"] for r in runs] == [11, 12], runs
        assert t.value == sum(r["samples"] for r in runs) / 2
    # The killed run did not count: its log never says success.
    stops = mlperf_log.run_stops(mlperf_log.read_events(tune.trial_dir(workdir, tune.load_space(space_file), killed)
                                                        / "seed_11.log"))
    assert ("success" not in [s for s, _ in stops]), stops
