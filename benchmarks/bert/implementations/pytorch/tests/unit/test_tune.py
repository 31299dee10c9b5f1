"""tools/tune.py and tools/tune.sub: the in-process tests; tests/integration/test_tune.py has
the rest and says what the file covers."""

from __future__ import annotations

import os
import sys
import threading
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


def _held(monkeypatch, owner, name: str) -> tuple[threading.Event, threading.Event]:
    """``owner.name`` made to stop inside (``inside`` set) until ``release`` is set: the racy
    step of one worker, held while another worker runs."""
    inside, release = threading.Event(), threading.Event()
    real = getattr(owner, name)

    def held(*args, **kwargs):
        inside.set()
        assert release.wait(60)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, held)
    return inside, release


def _in_thread(fn, *args) -> tuple[threading.Thread, list]:
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn(*args)), daemon=True)
    t.start()
    return t, out


def test_a_requeued_worker_takes_the_retry_of_its_killed_trial(tmp_path, monkeypatch):
    """The race of a requeued array task: its old worker, stopped by SLURM, fails its trial and
    queues the retry (two storage operations) while the requeued worker starts and asks for a
    trial. Held between the two, the old worker keeps the study's lock: the new worker waits,
    then takes the retry; it never sees the failed trial without its retry (which would make it
    sample a setting of its own and leave the retry WAITING for a worker that never comes)."""
    space_file = write_space(tmp_path / "s.yaml", trials=2, max_retry=1, enqueue=[])
    space, study = load(space_file, tmp_path)
    killed = tune.next_trial(study, space, tmp_path, "job_0")
    _, other = load(space_file, tmp_path)  # the requeued worker: another process, the same worker id
    inside, release = _held(monkeypatch, tune, "_retry")  # the old worker, after the FAIL
    old, _ = _in_thread(tune.fail_and_retry_locked, study, killed._trial_id, space, tmp_path, "its worker got signal 15")
    assert inside.wait(60)
    new, got = _in_thread(tune.next_trial, other, space, tmp_path, "job_0")
    new.join(timeout=3)  # it waits for the lock (without it, it would have sampled a new trial by now)
    release.set()
    old.join(60)
    new.join(60)
    trials = {t.number: t for t in study.get_trials()}
    assert sorted(t.state.name for t in trials.values()) == ["FAIL", "RUNNING"], trials
    retry = trials[got[0].number]
    assert retry.system_attrs["failed_trial"] == killed.number and retry.params == trials[killed.number].params
    assert retry.user_attrs["worker"] == "job_0"


def test_no_worker_asks_before_the_queued_settings_are_queued(tmp_path, monkeypatch):
    """The race of two workers starting at once: the one that creates the study queues its
    `enqueue` settings in further storage operations; the other, opening the study between
    them, waits for the lock and takes the first queued setting, instead of sampling one of
    its own while the queue is still being filled."""
    import optuna

    enqueue = [{"LR": 5e-3, "OPT_LAMB_BETA_1": 0.9}, {"LR": 4e-3, "OPT_LAMB_BETA_1": 0.85}]
    space = tune.load_space(write_space(tmp_path / "s.yaml", trials=2, enqueue=enqueue))
    storage = tune.default_storage(space, tmp_path)
    inside, release = _held(monkeypatch, optuna.study.Study, "enqueue_trial")
    first, _ = _in_thread(tune.open_study, space, storage, tmp_path)
    assert inside.wait(60)

    def second_worker():
        return tune.next_trial(tune.open_study(space, storage, tmp_path), space, tmp_path, "job_1")

    second, got = _in_thread(second_worker)
    second.join(timeout=3)
    release.set()
    first.join(60)
    second.join(60)
    assert got[0].params == enqueue[0]


def test_a_trial_failed_without_its_retry_is_retried_once(tmp_path):
    """A worker killed between failing its trial and queueing the retry (SIGKILL) leaves a
    failed trial without one: the next worker to ask queues it (and takes it), once."""
    space, study = load(write_space(tmp_path / "s.yaml", trials=1, max_retry=1, enqueue=[]), tmp_path)
    lost = tune.next_trial(study, space, tmp_path, "job_0")
    study._storage.set_trial_user_attr(lost._trial_id, "failed_because", "its worker got signal 15")
    study._storage.set_trial_state_values(lost._trial_id, TrialState.FAIL)
    retry = tune.next_trial(study, space, tmp_path, "job_1")
    assert retry is not None and retry.params == lost.params
    study.tell(retry, 100.0)
    assert tune.next_trial(study, space, tmp_path, "job_2") is None  # retried once, counted once
    assert sorted(t.state.name for t in study.get_trials()) == ["COMPLETE", "FAIL"]
