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
import yaml
from optuna.trial import TrialState

from bert import mlperf_log
from conftest import PKG, demo_run_env

sys.path.insert(0, str(PKG / "tools"))
import tune  # noqa: E402  (tools/ holds scripts, not a package)

TINY_LR = 1e-6  # far too small: the trained model's accuracy does not move (0.742 -> 0.742)
# Trials from the trained model; fixed for all: one rank, eval every 320 samples (10 steps of
# 32), cap 1600 (5 evals), no warmup, a 500-sample eval set.
FIXED = {"DGXNGPU": 1, "WARMUP_STEPS": 0, "EVAL_ITER_SAMPLES": 320, "MAX_SAMPLES_TERMINATION": 1600,
         "TARGET_MLM_ACCURACY": 0.77, "data.eval_samples": 500}


def write_space(path: Path, **over) -> Path:
    space = {"study": "lr_beta1", "base_config": "config_CPU_1x2.sh", "trials": 6,
             "params": {"LR": {"low": 1e-6, "high": 3e-2, "log": True}, "OPT_LAMB_BETA_1": {"low": 0.5, "high": 0.95}},
             "fixed": dict(FIXED), "sampler": {"name": "tpe", "seed": 0},
             "pruner": {"name": "median", "n_startup_trials": 1}, **over}
    path.write_text(yaml.safe_dump(space))
    return path


def submit_array(cluster, env: dict[str, str], tasks: str, out: Path, *extra: str) -> str:
    sub = subprocess.run(["sbatch", "--parsable", f"--array={tasks}", "-N", "1", "-t", "10", "--open-mode=append",
                          "-o", str(out / "task_%a.out"), *extra, "tools/tune.sub"],
                         cwd=PKG, env=env, capture_output=True, text=True, timeout=60)
    assert sub.returncode == 0, sub.stderr
    return sub.stdout.strip().split(";")[0]


def outputs(out: Path) -> str:
    return "\n".join(f"== {p.name}\n{p.read_text()[-3000:]}" for p in sorted(out.glob("task_*.out")))


def load(space_file: Path, workdir: Path):
    space = tune.load_space(space_file)
    return space, tune.open_study(space, tune.default_storage(space, workdir))


# -- no training ---------------------------------------------------------------------------

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
    """The worker's environment < the base config < fixed < the trial's values; dotted keys
    are appended to EXTRA_PARAMS (after the config's own, so they win)."""
    space = tune.load_space(write_space(tmp_path / "s.yaml", params={
        "LR": {"low": 1e-3, "high": 1e-1, "log": True}, "optim.beta2": {"low": 0.9, "high": 0.999}}))
    env = tune.run_env(space, {"LR": 0.0123, "optim.beta2": 0.95},
                       {"PATH": os.environ["PATH"], "LR": "9", "DATADIR": "/data", "EVAL_ITER_SAMPLES": "1"})
    assert env["LR"] == "0.0123" and env["DATADIR"] == "/data"
    assert env["EVAL_ITER_SAMPLES"] == "320" and env["DGXNGPU"] == "1"  # fixed
    assert env["OPT_LAMB_BETA_1"] == "0.9"  # the config's
    extra = env["EXTRA_PARAMS"].split()
    assert extra[-2:] == ["data.eval_samples=500", "optim.beta2=0.95"] and "model.hidden_size=128" in extra


def test_objective_failure_is_worse_than_every_success():
    def run(status, samples, cap=3264):
        return tune.RunResult(1, Path("x"), status, samples, cap, 1.0, 0)

    best_success = tune.objective([run("success", 3264)], 1)  # the latest a success can stop
    assert best_success == 3264
    assert tune.objective([run("success", 640), run("success", 1280)], 2) == 960
    one_failed = tune.objective([run("success", 640), run("aborted", 3200)], 2)
    all_failed = tune.objective([run("aborted", 3200), run("aborted", 1000)], 2)  # 1000: a NaN abort
    assert best_success < one_failed < all_failed


def test_reaper_fails_dead_workers_trials_once_and_retries_each_once(tmp_path):
    """A trial whose worker id starts again (a requeue) or whose heartbeat went stale is
    failed and queued again with the same values; a second reaper, or a second try, changes
    nothing; a retry that dies again is not queued past max_retry."""
    space_file = write_space(tmp_path / "s.yaml", stale_after_s=60, max_retry=1)
    space, study = load(space_file, tmp_path)
    trials = {}
    for worker in ("requeued", "alive", "silent"):
        t = study.ask(space.params)
        t.set_user_attr("worker", worker)
        hb = tune.trial_dir(tmp_path, space, t.number) / "heartbeat"
        hb.parent.mkdir(parents=True)
        hb.touch()
        trials[worker] = t
    old = time.time() - 120
    os.utime(tune.trial_dir(tmp_path, space, trials["silent"].number) / "heartbeat", (old, old))

    # Another process, as a worker on another node would be.
    _, other = load(space_file, tmp_path)
    assert sorted(tune.reap(other, space, tmp_path, "requeued")) == [trials["requeued"].number, trials["silent"].number]
    assert tune.reap(study, space, tmp_path, "requeued") == [] and tune.reap(other, space, tmp_path, "x") == []
    assert not tune.fail_and_retry(study, trials["requeued"]._trial_id, space, "again")

    by_number = {t.number: t for t in study.get_trials()}
    assert by_number[trials["alive"].number].state == TrialState.RUNNING
    waiting = [t for t in by_number.values() if t.state == TrialState.WAITING]
    assert sorted(t.system_attrs["failed_trial"] for t in waiting) == sorted(
        [trials["requeued"].number, trials["silent"].number])
    for w in waiting:
        dead = by_number[w.system_attrs["failed_trial"]]
        assert dead.state == TrialState.FAIL and w.params == dead.params
    assert "requeued" in by_number[trials["requeued"].number].user_attrs["failed_because"]
    assert "no heartbeat" in by_number[trials["silent"].number].user_attrs["failed_because"]

    # The retries are taken (queued trials come first) and die too: max_retry=1, no third run.
    for _ in waiting:
        retry = study.ask(space.params)
        assert "failed_trial" in next(t for t in study.get_trials() if t.number == retry.number).system_attrs
        retry.set_user_attr("worker", "requeued")
    assert len(tune.reap(study, space, tmp_path, "requeued")) == 2
    assert not [t for t in study.get_trials() if t.state == TrialState.WAITING]


# -- on the SLURM cluster ------------------------------------------------------------------

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
    # 25 steps (of 32: one rank) before the first evaluation: time to requeue mid-run. Progress
    # every 5 steps.
    fixed = dict(FIXED, EVAL_ITER_SAMPLES=800, MAX_SAMPLES_TERMINATION=800)
    fixed["log.progress_interval_steps"] = 5
    space_file = write_space(tmp_path / "space.yaml", study="requeue", trials=2, repeats=2, seed=11, fixed=fixed,
                             enqueue=[{"LR": 5e-3, "OPT_LAMB_BETA_1": 0.9}, {"LR": 4e-3, "OPT_LAMB_BETA_1": 0.85}])
    workdir = tmp_path / "tune"
    env = demo_run_env(trained, demo_data, tmp_path / "unused", SPACE=str(space_file), TUNE_WORKDIR=str(workdir),
                       SLURM_CONF=slurm_cluster.env["SLURM_CONF"])
    job = submit_array(slurm_cluster, env, "0-1%2", tmp_path, "--requeue")
    task0 = tmp_path / "task_0.out"
    deadline = time.monotonic() + 240
    while True:
        m = re.search(r"tune: trial (\d+): .* -> (\S+)", task0.read_text() if task0.exists() else "")
        first_run = Path(m.group(2)) / "seed_11.out" if m else tmp_path / "none"
        if first_run.exists() and re.search(r"step +5 \|", first_run.read_text()):
            break
        assert time.monotonic() < deadline, outputs(tmp_path)
        time.sleep(0.3)
    killed = int(m.group(1))
    subprocess.run(["scontrol", "requeue", f"{job}_0"], env=slurm_cluster.env, check=True, timeout=30)
    # SLURM holds a requeued job back (BeginTime); start it now, 2 s after it is PENDING
    # again (tests/test_launchers.py: slurmd refuses a credential from the requeue's second).
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
