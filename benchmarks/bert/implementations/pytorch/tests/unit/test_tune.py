"""tools/tune.py and tools/tune.sub: the in-process tests; tests/integration/test_tune.py has
the rest and says what the file covers."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from optuna.trial import TrialState

from conftest import PKG


sys.path.insert(0, str(PKG / "tools"))
import tune  # noqa: E402  (tools/ holds scripts, not a package)
from tune_helpers import load, write_space


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
