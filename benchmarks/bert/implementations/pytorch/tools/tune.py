"""Hyperparameter search for the optimizer, as "Breaking MLPerf Training" re-tuned Adam for
its batch: every trial is a normal training run, judged by the samples it needs to reach the
target, and hopeless trials are stopped at an evaluation. The search itself is Optuna's.

    python tools/tune.py worker --space tools/tune_space_CPU_1x2.yaml      # run trials
    sbatch --array=0-15%4 tools/tune.sub                                   # the same on SLURM
    python tools/tune.py report --space tools/tune_space_CPU_1x2.yaml      # table, best, plots

The search-space keys, the objective, pruning and requeue safety: docs/tuning.md.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import fcntl
import math
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import warnings
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import yaml

from bert import config_script, mlperf_log

PKG = Path(__file__).resolve().parent.parent
POLL_S = 1.0  # how often a worker reads the growing log and touches the heartbeat
ERRORS_IN_A_ROW = 2  # a worker stops after this many trials that ended without run_stop
RDB_SCHEMES = ("sqlite", "postgresql", "mysql", "oracle", "mssql")


class SpaceError(ValueError):
    """The search-space file is wrong; the message names the key."""


@dataclass
class Space:
    study: str
    base_config: Path
    params: dict[str, Any]  # name -> optuna distribution
    fixed: dict[str, Any]
    trials: int
    repeats: int = 1
    seed: int = 1
    enqueue: list[dict[str, Any]] = field(default_factory=list)
    sampler: dict[str, Any] = field(default_factory=dict)
    pruner: dict[str, Any] = field(default_factory=dict)
    max_retry: int = 1
    stale_after_s: float = 900.0
    storage: str = ""


def _distribution(name: str, spec: Any):
    import optuna.distributions as D

    if not isinstance(spec, dict):
        raise SpaceError(f"params.{name}: expected {{low, high[, log, step]}} or {{choices}}, got {spec!r}")
    if "choices" in spec:
        return D.CategoricalDistribution(list(spec["choices"]))
    try:
        low, high = spec["low"], spec["high"]
    except KeyError as e:
        raise SpaceError(f"params.{name}: missing {e.args[0]}") from None
    log, step = bool(spec.get("log", False)), spec.get("step")
    unknown = set(spec) - {"low", "high", "log", "step"}
    if unknown:
        raise SpaceError(f"params.{name}: unknown key(s) {sorted(unknown)}")
    try:
        if all(isinstance(v, int) and not isinstance(v, bool) for v in (low, high, step or 1)):
            return D.IntDistribution(low, high, log=log, step=step or 1)
        return D.FloatDistribution(float(low), float(high), log=log, step=None if step is None else float(step))
    except ValueError as e:
        raise SpaceError(f"params.{name}: {e}") from None


def load_space(path: Path) -> Space:
    tree = yaml.safe_load(Path(path).read_text()) or {}
    known = set(Space.__dataclass_fields__)
    unknown = set(tree) - known
    if unknown:
        raise SpaceError(f"{path}: unknown key(s) {sorted(unknown)}; known: {sorted(known)}")
    for key in ("study", "base_config", "params", "trials"):
        if key not in tree:
            raise SpaceError(f"{path}: missing {key}")
    base = Path(tree.pop("base_config"))
    base = base if base.is_absolute() else PKG / base
    if not base.is_file():
        raise SpaceError(f"base_config: no such file {base}")
    params = {name: _distribution(name, spec) for name, spec in (tree.pop("params") or {}).items()}
    if not params:
        raise SpaceError("params: nothing to search")
    fixed = tree.pop("fixed", None) or {}
    both = set(params) & set(fixed)
    if both:
        raise SpaceError(f"{sorted(both)} both searched (params) and fixed")
    space = Space(base_config=base, params=params, fixed=fixed, **tree)
    if space.trials < 1 or space.repeats < 1:
        raise SpaceError("trials and repeats must be positive")
    return space


# -- the study -----------------------------------------------------------------------------

def default_storage(space: Space, workdir: Path) -> str:
    return space.storage or str(workdir / f"{space.study}.journal")


def open_storage(url: str):
    """An RDB URL (sqlite:///..., postgresql://...) as Optuna's RDBStorage; anything else is
    a path for the journal file, which many processes on a shared filesystem can append to
    (it locks with a symlink; a lock left by a killed process is broken after 30 s)."""
    import optuna

    if url.split(":", 1)[0].split("+", 1)[0] in RDB_SCHEMES:
        return optuna.storages.RDBStorage(url)
    Path(url).parent.mkdir(parents=True, exist_ok=True)
    return optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(url))


def _sampler(spec: dict[str, Any], salt: int = 0):
    import optuna

    spec = dict(spec)
    name = spec.pop("name", "tpe")
    if spec.get("seed") is not None:
        spec["seed"] = (spec["seed"] + salt) % 2**32
    if name == "tpe":
        return optuna.samplers.TPESampler(**spec)
    if name == "random":
        return optuna.samplers.RandomSampler(**spec)
    raise SpaceError(f"sampler.name: {name!r} (tpe | random)")


def _pruner(spec: dict[str, Any]):
    import optuna

    spec = dict(spec)
    name = spec.pop("name", "median")
    if name == "median":
        return optuna.pruners.MedianPruner(**spec)
    if name == "percentile":
        return optuna.pruners.PercentilePruner(**spec)
    if name == "none":
        return optuna.pruners.NopPruner()
    raise SpaceError(f"pruner.name: {name!r} (median | percentile | none)")


@contextlib.contextmanager
def study_lock(workdir: Path, space: Space) -> Iterator[None]:
    """One worker at a time changes what the study will run next: creates it and queues its
    ``enqueue`` settings, picks its next trial, or fails a trial and queues the retry. Each of
    these is several storage operations, and a worker that looked in between would see a
    study without its queued settings (and sample a trial of its own instead) or a failed
    trial without its retry (and leave the retry waiting for a worker that never comes). An
    exclusive flock on a file beside the trials (the workdir every worker shares; over NFS the
    kernel takes a POSIX lock), which the kernel releases when its holder dies; a new open file
    each time, so two threads exclude each other as two processes do."""
    path = workdir / f"{space.study}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def open_study(space: Space, storage_url: str, workdir: Path):
    """Created on first use (load_if_exists: every worker may be first); the ``enqueue``
    settings are queued by the worker that created it, once, before any worker can ask."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = open_storage(storage_url)
    with study_lock(workdir, space):
        try:
            study = optuna.create_study(study_name=space.study, storage=storage, direction="minimize",
                                        sampler=_sampler(space.sampler), pruner=_pruner(space.pruner))
            for values in space.enqueue:
                study.enqueue_trial(values)
            return study
        except optuna.exceptions.DuplicatedStudyError:
            return optuna.load_study(study_name=space.study, storage=storage, sampler=_sampler(space.sampler),
                                     pruner=_pruner(space.pruner))


# -- one run -------------------------------------------------------------------------------

def _text(value: Any) -> str:
    return repr(value) if isinstance(value, float) else str(value)


def run_env(space: Space, values: dict[str, Any], base: dict[str, str]) -> dict[str, str]:
    """The environment of a trial's runs: the base config, ``base`` (the worker's: what the
    user set), ``fixed``, the trial's values."""
    return config_env(space.base_config, {**space.fixed, **values}, base)


def config_env(base_config: Path, settings: dict[str, Any], base: dict[str, str]) -> dict[str, str]:
    """A job of ``base_config`` for a caller with environment ``base`` (the one precedence:
    bert.config_script.job_environment), then ``settings`` (tools/study.py's runs too). Names
    with a dot are bert.config keys, appended to EXTRA_PARAMS (a later key=value wins in
    bert.config's override parsing); the others are config_*.sh variables."""
    env, _ = config_script.job_environment(base_config, base)
    dotted = []
    for name, value in settings.items():
        if "." in name:
            dotted.append(f"{name}={_text(value)}")
        else:
            env[name] = _text(value)
    if dotted:
        env["EXTRA_PARAMS"] = " ".join([env.get("EXTRA_PARAMS", ""), *dotted]).strip()
    return env


class LogFollower:
    """The events a growing MLPerf log gained since the last call (complete lines only)."""

    def __init__(self, path: Path):
        self.path, self.pos, self.partial = path, 0, b""

    def new_events(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        with self.path.open("rb") as f:
            f.seek(self.pos)
            chunk = f.read()
            self.pos = f.tell()
        lines = (self.partial + chunk).split(b"\n")
        self.partial = lines.pop()
        return [e for e in (mlperf_log.parse_line(ln.decode(errors="replace")) for ln in lines) if e is not None]


@dataclass
class RunResult:
    seed: int
    log: Path
    status: str  # success | aborted (sample cap, NaN) | pruned | stopped (worker signalled) | error
    samples: int  # at run_stop (samples to target for a success)
    cap: int  # max_samples + global batch: beyond any success
    wall_s: float
    returncode: int
    evals: int = 0  # evaluations the run made
    evals_max: int = 0  # evaluations a run makes before its sample cap


class Stop:
    """SIGTERM/SIGUSR1 to the worker: remembered, acted on at the next poll. (The trainer's
    bert.checkpoint.StopFlag does the same; not imported here, as it would load torch into every
    worker for one integer.)"""

    def __init__(self) -> None:
        self.signum = 0

    def install(self) -> None:
        for s in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(s, self._handle)

    def _handle(self, signum: int, _frame: Any) -> None:
        self.signum = signum


def launch_command(launcher: str, env: dict[str, str]) -> list[str]:
    """local: run_and_time.sh starts torchrun on this node. srun: one task per rank over the
    job's nodes (LAUNCHER=task), as run.sub does; srun forwards SIGTERM to every task."""
    if launcher == "local":
        return ["./run_and_time.sh"]
    nodes, per_node = int(env["DGXNNODES"]), int(env["DGXNGPU"])
    return ["srun", "--kill-on-bad-exit=0", "--wait=180", f"--nodes={nodes}", f"--ntasks={nodes * per_node}",
            f"--ntasks-per-node={per_node}", "env", "LAUNCHER=task", "./run_and_time.sh"]


def run_once(env: dict[str, str], logdir: Path, seed: int, launcher: str, report, stop: Stop, on_stop,
             heartbeat: Path) -> RunResult:
    """One training run. ``report(eval_index, accuracy)`` returns True to prune it;
    ``on_stop()`` is called at once when the worker is signalled (before the run has ended)."""
    logdir.mkdir(parents=True, exist_ok=True)
    log = logdir / f"seed_{seed}.log"
    ckpt = logdir / f"seed_{seed}_ckpt"
    env = dict(env, LOGDIR=str(logdir), LOGFILE=log.name, SEED=str(seed), CKPT_DIR=str(ckpt))
    with (logdir / f"seed_{seed}.out").open("w") as out:
        start = time.monotonic()
        # Same process group as the worker: a SLURM kill of the job reaches the run too.
        proc = subprocess.Popen(launch_command(launcher, env), cwd=PKG, env=env, stdout=out, stderr=subprocess.STDOUT)
        follower, evals, why = LogFollower(log), 0, ""

        def read_log() -> None:
            nonlocal evals, why
            for e in follower.new_events():
                if e["key"] == "eval_accuracy" and not why:
                    evals += 1
                    # An eval that reached the target ends the run by itself: never prune it.
                    reached = e["value"] >= _config(log)["eval"]["target_accuracy"]
                    if report(evals, e["value"]) and not reached and proc.poll() is None:
                        why = "pruned"

        while proc.poll() is None:
            time.sleep(POLL_S)
            heartbeat.touch()
            read_log()
            if not why and stop.signum:
                why = "stopped"
                on_stop()
            if why and proc.poll() is None and not getattr(proc, "signalled", False):
                # run_and_time.sh forwards it to the ranks: checkpoint, run_stop aborted, exit 3.
                proc.send_signal(signal.SIGTERM)
                proc.signalled = True
        wall = time.monotonic() - start
    read_log()  # the evaluations logged between the last poll and the exit
    shutil.rmtree(ckpt, ignore_errors=True)  # train-state checkpoints: a trial is never resumed
    events = mlperf_log.read_events(log) if log.exists() else []
    stops = mlperf_log.run_stops(events)
    resolved = _config(log).get("resolved", {})
    cap = int(resolved.get("max_samples", 0)) + int(resolved.get("global_batch_size", 0))
    evals_max = math.ceil(resolved.get("max_samples", 0) / max(1, resolved.get("eval_interval_samples", 1)))
    if why == "stopped" or (why == "pruned" and not (stops and stops[-1][0] == "success")):
        status = why  # (a pruned run that reached the target before it stopped counts as a success)
    elif stops and stops[-1][0] in ("success", "aborted"):
        status = stops[-1][0]
    else:
        status = "error"
    return RunResult(seed, log, status, stops[-1][1] if stops else 0, cap, wall, proc.returncode, evals, evals_max)


def _config(log: Path) -> dict[str, Any]:
    """The run's resolved config, which bert.train writes beside the log before training."""
    import json

    cfg = log.with_name(log.stem + "_config.json")
    return json.loads(cfg.read_text()) if cfg.exists() else {}


def objective(results: list[RunResult], repeats: int) -> float:
    """Mean samples to target when every repeat succeeded; else the failure value, above
    every success: (max_samples + global batch) x (1 + failed fraction)."""
    failed = [r for r in results if r.status != "success"]
    if not failed:
        return sum(r.samples for r in results) / len(results)
    cap = max(r.cap for r in results)
    return cap * (1 + len(failed) / repeats)


# -- the worker ----------------------------------------------------------------------------

def trial_dir(workdir: Path, space: Space, number: int) -> Path:
    return workdir / space.study / f"trial_{number:04d}"


def fail_and_retry(study, trial_id: int, space: Space, why: str) -> bool:
    """Fail a RUNNING trial and queue its setting again (at most max_retry times); the caller
    holds ``study_lock``. True when this call made the change: the storage refuses a second
    one, so of two workers (or a worker and its requeued self) that both try, exactly one
    queues the retry."""
    import optuna
    from optuna.trial import TrialState

    storage = study._storage  # Optuna has no public call that fails another process's trial
    try:
        storage.set_trial_user_attr(trial_id, "failed_because", why)
        if not storage.set_trial_state_values(trial_id, TrialState.FAIL):
            return False
    except optuna.exceptions.UpdateFinishedTrialError:
        return False
    _retry(study, storage.get_trial(trial_id), space)
    return True


def _retry(study, failed, space: Space) -> None:
    """A WAITING copy of ``failed``'s setting, unless it was retried max_retry times."""
    import optuna
    from optuna.storages import RetryHeartbeatStaleTrialCallback

    with warnings.catch_warnings():  # "experimental" since Optuna 2.8; the name is 4.9's
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        retry = RetryHeartbeatStaleTrialCallback(max_retry=space.max_retry)
    retry(study, failed)


def fail_and_retry_locked(study, trial_id: int, space: Space, workdir: Path, why: str) -> bool:
    with study_lock(workdir, space):
        return fail_and_retry(study, trial_id, space, why)


def reap(study, space: Space, workdir: Path, worker_id: str) -> list[int]:
    """Fail (and retry) the RUNNING trials whose worker is gone: this worker id's own (a
    requeued task starting again) and those whose heartbeat went stale; queue the retry of a
    trial that was failed by a worker that died before it could (a failed trial without its
    retry). The caller holds ``study_lock``. Returns the numbers of the trials failed here."""
    from optuna.trial import TrialState

    trials = study.get_trials(deepcopy=False)
    retried = {t.system_attrs["retry_history"][-1] for t in trials if t.system_attrs.get("retry_history")}
    for t in trials:
        budget = space.max_retry > len(t.system_attrs.get("retry_history", []))
        if t.state == TrialState.FAIL and "failed_because" in t.user_attrs and t.number not in retried and budget:
            print(f"tune: trial {t.number} was failed without its retry; queued now", flush=True)
            _retry(study, t, space)
    reaped = []
    for t in (t for t in trials if t.state == TrialState.RUNNING):
        owner = t.user_attrs.get("worker")
        hb = trial_dir(workdir, space, t.number) / "heartbeat"
        last = hb.stat().st_mtime if hb.exists() else t.datetime_start.timestamp()
        if owner == worker_id:
            why = f"its worker {worker_id} started again (requeued)"
        elif time.time() - last > space.stale_after_s:
            why = f"no heartbeat from worker {owner} for {time.time() - last:.0f} s"
        else:
            continue
        if fail_and_retry(study, t._trial_id, space, why):
            print(f"tune: trial {t.number} failed and queued again: {why}", flush=True)
            reaped.append(t.number)
    return reaped


def _counts(study) -> tuple[int, int]:
    """(trials finished or running, trials waiting); FAIL ones do not count (retried, or broken)."""
    from optuna.trial import TrialState

    trials = study.get_trials(deepcopy=False)
    done = sum(t.state in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING) for t in trials)
    return done, sum(t.state == TrialState.WAITING for t in trials)


def run_trial(study, trial, space: Space, workdir: Path, base_env: dict[str, str], launcher: str,
              stop: Stop) -> tuple[str, RunResult]:
    """Run the trial's repeats and tell the study; returns (outcome, the last run)."""
    from optuna.trial import TrialState

    tdir = trial_dir(workdir, space, trial.number)
    tdir.mkdir(parents=True, exist_ok=True)
    heartbeat = tdir / "heartbeat"
    heartbeat.touch()
    env = run_env(space, trial.params, base_env)
    print(f"tune: trial {trial.number}: {trial.params} -> {tdir}", flush=True)
    results: list[RunResult] = []
    curve: list[float] = []  # the first repeat's reported values, eval by eval

    def report(index: int, accuracy: float) -> bool:
        if results:  # only the first repeat's curve is reported: one curve per trial
            return False
        curve.append(1.0 - accuracy)
        trial.report(curve[-1], index)
        return trial.should_prune()

    def on_stop() -> None:
        fail_and_retry_locked(study, trial._trial_id, space, workdir, f"its worker got signal {stop.signum}")

    for r in range(space.repeats):
        res = run_once(env, tdir, space.seed + r, launcher, report, stop, on_stop, heartbeat)
        if r == 0 and res.status == "success" and curve:
            # Reached the target at eval k: its curve holds there. Reported for the evals it
            # did not need, so the pruner can compare a later trial with it at every eval
            # (Optuna's pruners compare values at the same step only).
            for step in range(len(curve) + 1, res.evals_max + 1):
                trial.report(curve[-1], step)
        results.append(res)
        if res.status in ("stopped", "pruned", "error"):
            break
    last = results[-1]
    if last.status == "stopped":
        return "stopped", last
    trial.set_user_attr("runs", [
        {"seed": r.seed, "status": r.status, "samples": r.samples, "wall_s": round(r.wall_s, 1),
         "log": str(r.log), "exit": r.returncode} for r in results])
    if last.status == "pruned":
        study.tell(trial, state=TrialState.PRUNED)
        return "pruned", last
    if last.status == "error":
        fail_and_retry_locked(study, trial._trial_id, space, workdir,
                              f"a run ended without run_stop (exit {last.returncode}); see {last.log.with_suffix('.out')}")
        return "error", last
    study.tell(trial, objective(results, space.repeats))
    return ("complete" if all(r.status == "success" for r in results) else "failed (aborted)"), last


def next_trial(study, space: Space, workdir: Path, worker_id: str):
    """The trial this worker runs next (a queued one first: enqueued settings, retries), owned
    by ``worker_id``; None when the study has its trials. Under ``study_lock``: the reaper's
    view, the count and the choice are one step, and no other worker sees the trial before
    it has its owner (a retry's copied owner is the dead worker's)."""
    with study_lock(workdir, space):
        reap(study, space, workdir, worker_id)
        done, waiting = _counts(study)
        if not waiting and done >= space.trials:
            return None
        trial = study.ask(space.params)  # a queued (enqueue, retry) trial keeps its values
        trial.set_user_attr("worker", worker_id)
        return trial


def worker(args: argparse.Namespace) -> int:
    space = load_space(args.space)
    workdir = args.workdir.resolve()
    study = open_study(space, args.storage or default_storage(space, workdir), workdir)
    worker_id = args.worker_id or f"{socket.gethostname()}:{os.getpid()}"
    # The same seed in every worker would make each suggest the same values: salt it with the
    # worker id and the study's size (a requeued worker does not repeat its draws either).
    study.sampler = _sampler(space.sampler, zlib.crc32(worker_id.encode()) + len(study.get_trials(deepcopy=False)))
    stop = Stop()
    stop.install()
    base_env = dict(os.environ)
    ran, errors = 0, 0
    while args.trials == 0 or ran < args.trials:
        if stop.signum:
            break
        trial = next_trial(study, space, workdir, worker_id)
        if trial is None:
            print(f"tune: study {space.study} has its {space.trials} trials", flush=True)
            break
        state, last = run_trial(study, trial, space, workdir, base_env, args.launcher, stop)
        print(f"tune: trial {trial.number}: {state}" + (f" at {last.samples} samples" if last.samples else ""),
              flush=True)
        if state == "stopped":
            return 3
        errors = errors + 1 if state == "error" else 0
        if errors >= ERRORS_IN_A_ROW:
            print(f"tune: {errors} trials in a row ended without run_stop; stopping this worker", file=sys.stderr)
            return 1
        ran += 1
    return 3 if stop.signum else 0


# -- results -------------------------------------------------------------------------------

def _runs(t) -> list[dict[str, Any]]:
    return t.user_attrs.get("runs", [])


def succeeded(t) -> bool:
    """Every repeat of a COMPLETE trial reached the target (else its value is the penalty)."""
    return t.state.name == "COMPLETE" and bool(_runs(t)) and all(r["status"] == "success" for r in _runs(t))


def table(study, space: Space) -> list[dict[str, Any]]:
    rows = []
    for t in study.get_trials(deepcopy=False):
        runs = _runs(t)
        outcome = t.state.name.lower()
        if t.state.name == "COMPLETE":
            outcome = "target" if succeeded(t) else "failed (aborted)"
        elif t.state.name == "PRUNED":
            outcome = f"pruned at eval {t.last_step}"
        rows.append({"trial": t.number, "outcome": outcome, **{p: t.params.get(p, "") for p in space.params},
                     "samples_to_target": round(t.value) if succeeded(t) else "",
                     "objective": round(t.value) if t.state.name == "COMPLETE" else "",
                     "per_seed": " ".join(f"{r['seed']}:{r['samples'] if r['status'] == 'success' else r['status']}"
                                          for r in runs),
                     "wall_s": round(sum(r["wall_s"] for r in runs), 1) if runs else "",
                     "retry_of": t.system_attrs.get("failed_trial", ""),
                     "note": t.user_attrs.get("failed_because", "") if t.state.name == "FAIL" else ""})
    return rows


def best(study):
    """The successful trial with the fewest samples to target (ties: the earlier trial)."""
    ok = [t for t in study.get_trials(deepcopy=False) if succeeded(t)]
    return min(ok, key=lambda t: (t.value, t.number)) if ok else None


def fragment(t, space: Space) -> str:
    """The best setting as shell lines to source after the base config."""
    lines = [f"# tools/tune.py: study {space.study}, trial {t.number}: {t.value:.0f} samples to target "
             f"(mean of {space.repeats} seed(s)).",
             f"# Source after {space.base_config.name}; values fixed during the search: "
             + (", ".join(f"{k}={_text(v)}" for k, v in space.fixed.items()) or "none") + "."]
    dotted = []
    for name, value in t.params.items():
        if "." in name:
            dotted.append(f"{name}={_text(value)}")
        else:
            lines.append(f"export {name}={shlex.quote(_text(value))}")
    if dotted:
        lines.append(f'export EXTRA_PARAMS="${{EXTRA_PARAMS:-}} {" ".join(dotted)}"')
    return "\n".join(lines) + "\n"


def plot(study, space: Space, out: Path) -> list[Path]:
    """objective.png: the objective against each parameter (failures at their penalty,
    pruned trials on the top edge); importance.png: each parameter's importance (PED-ANOVA,
    Optuna's evaluator that needs no scikit-learn), when enough trials completed."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    import optuna
    from optuna.distributions import CategoricalDistribution

    trials = [t for t in study.get_trials(deepcopy=False) if t.state.name in ("COMPLETE", "PRUNED")]
    values = [t.value for t in trials if t.state.name == "COMPLETE"]  # a pruned trial's value is an error rate
    top = max(values) * 1.05 if values else 1.0
    names = list(space.params)
    fig, axes = plt.subplots(1, len(names), figsize=(4.5 * len(names), 3.8), squeeze=False)
    for ax, name in zip(axes[0], names):
        dist = space.params[name]
        groups = {"reached the target": ([], [], "o", "tab:blue"), "failed (penalty)": ([], [], "v", "tab:red"),
                  "pruned (no value; drawn on top)": ([], [], "x", "tab:gray")}
        for t in trials:
            pruned = t.state.name == "PRUNED"
            key = "pruned (no value; drawn on top)" if pruned else "reached the target" if succeeded(t) \
                else "failed (penalty)"
            groups[key][0].append(t.params[name])
            groups[key][1].append(top if pruned else t.value)
        for label, (xs, ys, marker, color) in groups.items():
            if xs:
                ax.scatter([str(x) for x in xs] if isinstance(dist, CategoricalDistribution) else xs, ys,
                           marker=marker, color=color, label=label)
        if getattr(dist, "log", False):
            ax.set_xscale("log")
        ax.set_xlabel(name)
        ax.set_ylabel("objective: samples to target")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"study {space.study}")
    fig.tight_layout()
    paths = [out / "objective.png"]
    fig.savefig(paths[0], dpi=100)
    plt.close(fig)

    complete = [t for t in trials if t.state.name == "COMPLETE"]
    if len(complete) >= 2 and len(names) >= 2:
        imp = optuna.importance.get_param_importances(
            study, evaluator=optuna.importance.PedAnovaImportanceEvaluator())
        fig, ax = plt.subplots(figsize=(6, 0.5 + 0.5 * len(imp)))
        ax.barh(list(imp)[::-1], list(imp.values())[::-1], color="tab:blue")
        ax.set_xlabel("importance (PED-ANOVA)")
        ax.set_title(f"study {space.study}: {len(complete)} completed trials")
        fig.tight_layout()
        paths.append(out / "importance.png")
        fig.savefig(paths[-1], dpi=100)
        plt.close(fig)
    return paths


def report(args: argparse.Namespace) -> int:
    space = load_space(args.space)
    workdir = args.workdir.resolve()
    study = open_study(space, args.storage or default_storage(space, workdir), workdir)
    out = (args.out or workdir / space.study).resolve()
    out.mkdir(parents=True, exist_ok=True)
    rows = table(study, space)
    if rows:
        with (out / "trials.csv").open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
        cols = [c for c in rows[0] if c != "note"]
        widths = {c: max(len(c), *(len(_cell(r[c])) for r in rows)) for c in cols}
        print("  ".join(f"{c:<{widths[c]}}" for c in cols))
        for r in rows:
            print("  ".join(f"{_cell(r[c]):<{widths[c]}}" for c in cols))
    b = best(study)
    if b is None:
        print(f"tune: no trial of {space.study} reached the target ({len(rows)} trials)")
        return 1
    (out / "best.sh").write_text(fragment(b, space))
    paths = plot(study, space, out)
    print(f"best: trial {b.number}, {b.value:.0f} samples to target: {b.params}")
    print(f"wrote {out / 'trials.csv'}, {out / 'best.sh'}, " + ", ".join(map(str, paths)))
    return 0


def _cell(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python tools/tune.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    for name, helptext in (("worker", "ask for trials and run them until the study has its trials"),
                           ("report", "the trials table, the best setting as best.sh, plots")):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("--space", type=Path, required=True, help="the search-space YAML file")
        p.add_argument("--workdir", type=Path, default=PKG / "results" / "tune",
                       help="the trials' directories (and the journal by default): a shared filesystem")
        p.add_argument("--storage", default="", help="journal file path or RDB URL (default: the space's storage, "
                                                    "else <workdir>/<study>.journal)")
        if name == "worker":
            p.add_argument("--trials", type=int, default=0, help="run at most this many trials (0: until done)")
            p.add_argument("--worker-id", default="",
                           help="who owns the trials this worker runs; the same id after a requeue (tune.sub: "
                                "<array job>_<task>); default host:pid")
            p.add_argument("--launcher", choices=("local", "srun"), default="local",
                           help="local: run_and_time.sh (torchrun on this node); srun: one task per rank")
        else:
            p.add_argument("--out", type=Path, default=None, help="where to write (default <workdir>/<study>)")
    args = ap.parse_args(argv)
    try:
        return worker(args) if args.command == "worker" else report(args)
    except SpaceError as e:
        print(f"tune: search space: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
