#!/usr/bin/env python3
"""The claims of "Breaking MLPerf Training", measured on the CPU demo: an ablation of each
technique's effect on convergence, and steps to target against the global batch for LAMB
and Adam. Every run is a normal training run (run_and_time.sh: torchrun, 2 gloo ranks, the
trainer's own entry point); this tool only plans the runs, reads their MLPerf logs and
does the statistics.

    python tools/study.py                        # the default study (tools/study_CPU_1x2.yaml)
    python tools/study.py --quick                # 2 recipes x 2 seeds, tiny: checks the tool
    python tools/study.py --report-only          # tables and plots from the runs logged so far
    python tools/study.py --tune open            # tools/tune.py over the plan's tune.open space
    python tools/study.py --jobs 4               # 4 runs at a time (a machine with 8 cores)

The plan (YAML; tools/study_CPU_1x2.yaml is the default and documents every key):

- ``data``: the demo dataset (bert.demo_data.generate) every run trains and evaluates on;
  ``init`` (optional): one run first, whose final weights every other run starts from (a
  phase-1 checkpoint, as MLPerf's phase 2 starts from one); ``fixed``: settings of every
  run over ``base_config``. Settings are config_*.sh variables or dotted bert.config keys,
  layered as tools/tune.py layers them.
- ``ablation``: ordered ``steps``, each adding its ``set`` to the step before (one technique
  at a time), run for every seed in ``seeds``.
- ``scaling``: for each optimizer, the settings of an ablation step at its own global batch
  B0, moved to every batch B of ``batches`` by stated rules (k = B / B0): lr x k^lr_power x
  factor for each factor of ``lr_factors`` (the grid, first seed only; the factor with the
  fewest samples to target wins and gets the other seeds), each beta -> beta^(k^beta_power)
  (beta_power 1: the moments average over the same number of samples), warmup and decay
  steps / k (the same samples), eval every EVAL_ITER_SAMPLES rounded up to whole steps;
  local batch up to ``max_local_batch``, gradient accumulation beyond it.

Outputs in the work directory (default <repo>/results/study/<study>): study.json (every
run, every statistic), study.md (the tables), ablation.png, scaling.png; runs/<key>/ holds
each run's MLPerf log, stdout, resolved config and result.json (what was read from them,
its wall and CPU time). A run is identified by a hash of the variables it runs with and its
seed (two parts asking for the same run share it; a changed setting is another run).
Progress is printed as runs finish: runs done / planned, elapsed, expected end.

Stopping: SIGINT or SIGTERM stops the runs in flight (run_and_time.sh forwards it to the
ranks) and exits 130/143; the same command again continues with the runs not yet logged
(an interrupted run starts again). A work directory whose data or init differ from the
plan's is refused, never overwritten.

``--tune RECIPE`` runs tools/tune.py over the plan's ``tune.RECIPE`` search space on the
study's data and init model, the recipe's other settings fixed, its own values tried first
(copy the best into the plan by hand: the plan says where its values came from).

Statistics: samples to target is the MLPerf count (the first evaluation at or above the
target); runs that miss are counted and left out of the means. Ratios of means come with a
percentile bootstrap 95% interval (10,000 resamples of the seeds; paired by seed against
the previous step, whose data order is the same from the stratified step on). The token
imbalance (busiest rank's real tokens / the mean, per optimizer step) is measured by
replaying each run's own training batches (bert.loader.train_batches from its resolved
config, every rank), beside tools/balance.py's simulation at 1,024 ranks. The critical
batch is McCandlish et al. (2018)'s: steps S(B) = S_min (1 + B_crit / B), fitted by
weighted least squares on 1/B; below B_crit doubling the batch nearly halves the steps
(perfect scaling), above it the steps stop falling.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import copy
import datetime
import fcntl
import hashlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

PKG = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(PKG))

import study_report  # noqa: E402  (tools/ holds scripts, not a package; this file's folder is on the path)
import tune  # noqa: E402
from bert import demo_data, mlperf_log  # noqa: E402
from bert.config import LAUNCHER_VARIABLES  # noqa: E402

ROOT = PKG.parents[3]
DEFAULT_PLAN = PKG / "tools" / "study_CPU_1x2.yaml"
LOG = "run.log"
POLL_S = 0.5
# The config_*.sh variables the scaling rules set; a recipe that scales must not set their
# bert.config twins (the dotted key would win over the scaled variable).
SCALED = {var: LAUNCHER_VARIABLES[var] for var in ("BATCHSIZE", "GRADIENT_STEPS", "LR", "OPT_LAMB_BETA_1",
                                                  "OPT_LAMB_BETA_2", "WARMUP_STEPS", "MAX_STEPS", "EVAL_ITER_SAMPLES")}
PLAN_KEYS = {"study", "base_config", "data", "init", "fixed", "ablation", "balance", "scaling", "margin", "tune",
             "quick"}


class PlanError(ValueError):
    """The plan file is wrong; the message names the key."""


class StudyError(RuntimeError):
    """A run failed in a way the study cannot count (not a missed target)."""


class Stopped(Exception):
    """SIGINT/SIGTERM reached the study: the run in flight was stopped, nothing half-written."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


# -- the plan ------------------------------------------------------------------------------

def _merge(base: dict, over: dict) -> dict:
    """``over`` on ``base``, mappings merged key by key (``quick`` on the plan)."""
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def _need(tree: dict, key: str, where: str) -> Any:
    if key not in tree:
        raise PlanError(f"{where}: missing {key}")
    return tree[key]


def load_plan(path: Path, quick: bool = False) -> dict:
    """The plan as a dict, ``quick`` merged over it when asked, checked; names each problem."""
    try:
        tree = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise PlanError(f"{path}: cannot read: {e}") from None
    unknown = set(tree) - PLAN_KEYS
    if unknown:
        raise PlanError(f"{path}: unknown key(s) {sorted(unknown)}; known: {sorted(PLAN_KEYS)}")
    if quick:
        tree = _merge(tree, _need(tree, "quick", str(path)))
    tree.pop("quick", None)
    for key in ("study", "base_config", "data", "ablation"):
        _need(tree, key, str(path))
    base = Path(tree["base_config"])
    tree["base_config"] = base if base.is_absolute() else PKG / base
    if not tree["base_config"].is_file():
        raise PlanError(f"base_config: no such file {tree['base_config']}")
    tree.setdefault("fixed", {})
    tree.setdefault("init", None)
    tree.setdefault("margin", 0.10)
    tree.setdefault("balance", {"ranks": 1024, "local_batch": 16, "group": 8, "steps": 50})
    ab = tree["ablation"]
    steps = _need(ab, "steps", "ablation")
    names = [_need(s, "name", f"ablation.steps[{i}]") for i, s in enumerate(steps)]
    if len(set(names)) != len(names):
        raise PlanError(f"ablation.steps: names must be unique, got {names}")
    ab.setdefault("recipes", [])
    missing = [r for r in ab["recipes"] if r not in names]
    if missing:
        raise PlanError(f"ablation.recipes: {missing} are not steps ({names})")
    if not _need(ab, "seeds", "ablation"):
        raise PlanError("ablation.seeds: at least one seed")
    sc = tree.get("scaling")
    if sc:
        for key in ("optimizers", "batches", "lr_factors", "seeds"):
            _need(sc, key, "scaling")
        bad = {o: r for o, r in sc["optimizers"].items() if r not in names}
        if bad:
            raise PlanError(f"scaling.optimizers: {bad} name no ablation step ({names})")
        sc.setdefault("max_local_batch", 1 << 30)
        sc.setdefault("lr_power", 0.5)
        sc.setdefault("beta_power", 1.0)
        if len(sc["batches"]) < 2:
            raise PlanError("scaling.batches: at least two batch sizes")
    return tree


def recipes(plan: dict) -> dict[str, dict]:
    """Each ablation step's settings: ``fixed``, then every step's ``set`` up to it."""
    out, acc = {}, dict(plan["fixed"])
    for step in plan["ablation"]["steps"]:
        acc = {**acc, **(step.get("set") or {})}
        out[step["name"]] = dict(acc)
    return out


# -- runs ----------------------------------------------------------------------------------

@dataclass
class Run:
    """One training run: its settings over the base config, its seed, and its key: a hash
    of the variables it runs with (base config sourced, settings applied) and the seed, so
    two parts asking for the same run share it, and an edited base config makes new runs."""

    settings: dict[str, str]
    seed: int
    key: str
    labels: list[str] = field(default_factory=list)


def make_run(plan: dict, settings: dict[str, str], seed: int, label: str) -> Run:
    env = recipe_env(plan, settings)
    text = json.dumps({"env": env, "seed": seed}, sort_keys=True)
    return Run(settings, seed, hashlib.sha256(text.encode()).hexdigest()[:12], [label])


def _texts(settings: dict[str, Any]) -> dict[str, str]:
    return {k: tune._text(v) for k, v in settings.items()}


def recipe_env(plan: dict, settings: dict[str, Any]) -> dict[str, str]:
    """The variables a run of ``settings`` gets from the base config and the settings (no
    paths, nothing of this process's environment)."""
    env = tune.config_env(plan["base_config"], settings, {"PATH": os.environ.get("PATH", "")})
    return {k: v for k, v in env.items() if k not in ("PATH", "PWD", "SHLVL", "_", "OLDPWD")}


def with_scaled(plan: dict, settings: dict[str, Any]) -> dict[str, str]:
    """``settings`` with every SCALED variable written out (its value from the config if
    the settings leave it), so a run is named by the same text whichever part asks for it."""
    env = recipe_env(plan, settings)
    out = _texts(settings)
    for var in SCALED:
        if var not in env:
            raise PlanError(f"{var}: neither the base config nor the settings set it")
        out.setdefault(var, env[var])
    return out


def ranks_of(env: dict[str, str]) -> int:
    return int(env["DGXNNODES"]) * int(env["DGXNGPU"])


def global_batch(settings: dict[str, str]) -> int:
    return int(settings["BATCHSIZE"]) * int(settings["GRADIENT_STEPS"])


def scaled(plan: dict, settings: dict[str, str], batch: int, factor: float) -> dict[str, str]:
    """The settings moved from their own global batch to ``batch`` by the plan's rules."""
    sc = plan["scaling"]
    twins = [t for v, t in SCALED.items() if t in settings]
    if twins:
        raise PlanError(f"scaling: the recipe sets {twins}; set the config variables ({list(SCALED)}) instead")
    ranks = ranks_of(recipe_env(plan, settings))
    b0 = global_batch(settings) * ranks
    if batch == b0 and factor == 1:
        return dict(settings)  # exactly the recipe's run: shared with the ablation
    per_rank, rem = divmod(batch, ranks)
    local = min(per_rank, int(sc["max_local_batch"]))
    if rem or per_rank % local:
        raise PlanError(f"scaling.batches: {batch} does not split into {ranks} ranks x a local batch of at most "
                        f"{sc['max_local_batch']} x whole accumulation steps")
    k = batch / b0
    out = dict(settings)
    out.update(_texts({
        "BATCHSIZE": local, "GRADIENT_STEPS": per_rank // local,
        "LR": float(settings["LR"]) * factor * k ** float(sc["lr_power"]),
        "OPT_LAMB_BETA_1": float(settings["OPT_LAMB_BETA_1"]) ** (k ** float(sc["beta_power"])),
        "OPT_LAMB_BETA_2": float(settings["OPT_LAMB_BETA_2"]) ** (k ** float(sc["beta_power"])),
        "WARMUP_STEPS": round(int(settings["WARMUP_STEPS"]) / k),
        "MAX_STEPS": max(1, round(int(settings["MAX_STEPS"]) / k)),
        "EVAL_ITER_SAMPLES": batch * math.ceil(int(settings["EVAL_ITER_SAMPLES"]) / batch)}))
    return out


def ablation_runs(plan: dict) -> list[Run]:
    ab = plan["ablation"]
    rec = recipes(plan)
    names = ab["recipes"] or list(rec)
    return [make_run(plan, with_scaled(plan, rec[n]), int(s), f"ablation/{n}/seed_{s}") for n in names for s in ab["seeds"]]


@dataclass
class Point:
    """One (optimizer, global batch) of the scaling part: its lr grid, then its seeds."""

    optimizer: str
    batch: int
    grid: dict[float, Run]  # lr factor -> run with the first seed
    seeds: list[int]  # the other seeds, run at the winning factor


def scaling_points(plan: dict) -> list[Point]:
    sc = plan.get("scaling")
    if not sc:
        return []
    rec = recipes(plan)
    points = []
    for batch in sc["batches"]:
        for opt, recipe in sc["optimizers"].items():
            base = with_scaled(plan, rec[recipe])
            grid = {float(f): make_run(plan, scaled(plan, base, int(batch), float(f)), int(sc["seeds"][0]),
                                       f"scaling/{opt}/batch_{batch}/lr_x{f}/seed_{sc['seeds'][0]}")
                    for f in sc["lr_factors"]}
            points.append(Point(opt, int(batch), grid, [int(s) for s in sc["seeds"][1:]]))
    return points


def winner(point: Point, results: dict[str, dict]) -> float:
    """The lr factor whose first-seed run reached the target in the fewest samples (a miss
    ranks after every success; ties: the factor nearest 1)."""
    def rank(f: float) -> tuple:
        r = results[point.grid[f].key]
        return (r["status"] != "success", r["samples"], abs(math.log(f)))
    return min(point.grid, key=rank)


def seed_runs(plan: dict, point: Point, factor: float) -> list[Run]:
    first = point.grid[factor]
    return [make_run(plan, first.settings, s, f"scaling/{point.optimizer}/batch_{point.batch}/lr_x{factor}/seed_{s}")
            for s in point.seeds]


# -- running -------------------------------------------------------------------------------

class Workdir:
    """The study's directory: data, init model, runs; one study process at a time."""

    def __init__(self, path: Path):
        self.path = path
        self.runs = path / "runs"
        self.runs.mkdir(parents=True, exist_ok=True)
        self._lock = (path / ".lock").open("w")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise StudyError(f"{path}: another study is running in this directory") from None

    def unlock(self) -> None:
        """For tools/tune.py's workers, which share their own directory safely (its journal)."""
        fcntl.flock(self._lock, fcntl.LOCK_UN)

    def result(self, run: Run) -> dict | None:
        f = self.runs / run.key / "result.json"
        return json.loads(f.read_text()) if f.exists() else None


def _check_same(path: Path, want: dict, what: str) -> None:
    """Write ``want`` to ``path`` the first time; refuse a different one later."""
    if path.exists():
        have = json.loads(path.read_text())
        if have != want:
            raise StudyError(f"{path.parent} holds {what} made with {have}, this plan asks for {want}: "
                             "use another --workdir, or delete that one")
    else:
        _write_json(path, want)


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=True) + "\n")
    tmp.replace(path)


def prepare_data(plan: dict, wd: Workdir) -> dict[str, str]:
    d = wd.path / "data"
    params = dict(plan["data"])
    d.mkdir(exist_ok=True)
    _check_same(d / "plan.json", params, "data")
    if not (d / "demo_data.json").exists():
        print(f"study: generating the demo data in {d}", flush=True)
        demo_data.generate(d, **params)  # writes demo_data.json last: its presence marks it complete
    return {"DATADIR": str(d / "train"), "EVALDIR": str(d / "eval")}


class Runner:
    """Runs what is not logged yet, ``jobs`` at a time, and prints progress."""

    def __init__(self, plan: dict, wd: Workdir, paths: dict[str, str], planned: int, jobs: int = 1):
        self.plan, self.wd, self.paths, self.planned, self.jobs = plan, wd, paths, planned, jobs
        self.done: set[str] = set()
        self.walls: list[float] = []  # runs made by this process
        self.start = time.monotonic()
        self.lock = threading.Lock()  # done, walls and the progress lines, across the jobs
        self.stop = tune.Stop()
        self.stop.install()
        signal.signal(signal.SIGINT, self.stop._handle)

    def progress(self, what: str) -> None:
        elapsed = time.monotonic() - self.start
        left = self.planned - len(self.done)
        eta = ""
        if self.walls and left > 0:
            rest = left * sum(self.walls) / len(self.walls) / self.jobs
            end = datetime.datetime.now() + datetime.timedelta(seconds=rest)
            eta = f" | expected end {end:%H:%M} (~{rest / 60:.0f} min left)"
        print(f"[{len(self.done)}/{self.planned}] {what} | elapsed {elapsed / 60:.1f} min{eta}", flush=True)

    def run(self, run: Run, env_extra: dict[str, str]) -> dict:
        """The run's result, from its directory if logged, else by running it."""
        res = self.wd.result(run)
        fresh = res is None
        if fresh:
            res = self._execute(run, env_extra)
        with self.lock:
            if run.key not in self.done:
                self.done.add(run.key)
                self.progress(f"{run.labels[0]}: {_outcome(res)}" + (f" in {res['wall_s']:.0f} s" if fresh
                                                                      else " (logged before)"))
        return res

    def run_all(self, runs: list[Run], env_extra: dict[str, str]) -> dict[str, dict]:
        """Each run's result by key, ``jobs`` runs at a time. A signal stops every run in
        flight; after an error (or a stop) no further run starts, and the first error is
        raised once the runs in flight have ended."""
        if self.jobs == 1:
            return {r.key: self.run(r, env_extra) for r in runs}
        with concurrent.futures.ThreadPoolExecutor(self.jobs) as pool:
            futures = {r.key: pool.submit(self.run, r, env_extra) for r in runs}
            _, pending = concurrent.futures.wait(futures.values(), return_when=concurrent.futures.FIRST_EXCEPTION)
            for f in pending:
                f.cancel()  # those not started yet
        errors = [f.exception() for f in futures.values() if not f.cancelled() and f.exception()]
        if errors:
            raise errors[0]
        return {k: f.result() for k, f in futures.items()}

    def _execute(self, run: Run, env_extra: dict[str, str], attempt: int = 1) -> dict:
        rdir = self.wd.runs / run.key
        if rdir.exists():
            shutil.rmtree(rdir)  # an interrupted attempt: the run starts again
        rdir.mkdir(parents=True)
        _write_json(rdir / "spec.json", {"settings": run.settings, "seed": run.seed, "labels": run.labels})
        env = tune.config_env(self.plan["base_config"], run.settings, dict(os.environ))
        env.update(**self.paths, **env_extra, LOGDIR=str(rdir), LOGFILE=LOG, SEED=str(run.seed),
                   CKPT_DIR=str(rdir / "ckpt"), PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
        if self.stop.signum:
            raise Stopped(self.stop.signum)
        t0 = time.monotonic()
        with (rdir / "run.out").open("w") as out:
            # Its own session: a Ctrl-C reaches this process only, which stops the run in order.
            proc = subprocess.Popen(["./run_and_time.sh"], cwd=PKG, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            sent = False
            while True:
                # wait4, not poll: the run's CPU time (its ranks and torchrun included: each
                # waited for its children) comes with its exit status.
                pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
                if pid:
                    proc.returncode = os.waitstatus_to_exitcode(status)
                    break
                time.sleep(POLL_S)
                if self.stop.signum and not sent:
                    proc.send_signal(signal.SIGTERM)  # forwarded to the ranks: checkpoint, exit 3
                    sent = True
        wall = time.monotonic() - t0
        shutil.rmtree(rdir / "ckpt", ignore_errors=True)
        try:
            res = read_run(rdir)
        except (OSError, KeyError, IndexError, ValueError):
            res = None  # no log, or one without run_stop: the run did not end as a run ends
        # Exit 3: the ranks checkpointed on a signal. A run the signal caught before it could
        # end in order has no usable log; one that ended first (0 or 1, a log) is kept.
        if proc.returncode == 3 or (self.stop.signum and (res is None or proc.returncode not in (0, 1))):
            raise Stopped(self.stop.signum or signal.SIGTERM)
        if proc.returncode not in (0, 1) or res is None:
            if attempt == 1:
                print(f"study: {run.labels[0]} ended with exit {proc.returncode} ({rdir / 'run.out'}); "
                      "trying it once more", flush=True)
                return self._execute(run, env_extra, 2)
            raise StudyError(f"{run.labels[0]}: exit {proc.returncode}, "
                             f"{'no usable log' if res is None else 'log read'}; see {rdir / 'run.out'}")
        res["wall_s"] = round(wall, 1)
        res["cpu_s"] = round(usage.ru_utime + usage.ru_stime, 1)
        with self.lock:
            self.walls.append(wall)
        _write_json(rdir / "result.json", res)
        return res


def _outcome(res: dict) -> str:
    if res["status"] == "success":
        return f"target at {res['samples']} samples ({res['steps']} steps)"
    return f"missed ({res['status']} at {res['samples']} samples)"


def read_run(rdir: Path) -> dict:
    """What the study needs from a finished run: its MLPerf log and its resolved config."""
    events = mlperf_log.read_events(rdir / LOG)
    status, samples = mlperf_log.run_stops(events)[-1]
    values = {e["key"]: e["value"] for e in events if e["key"] not in ("eval_accuracy", "run_stop")}
    times = {e["key"]: e["time_ms"] for e in events if e["key"] in ("run_start", "run_stop")}
    cfg = json.loads((rdir / f"{Path(LOG).stem}_config.json").read_text())
    gbs = int(values["global_batch_size"])
    return {"status": status, "samples": int(samples), "steps": int(samples) // gbs, "global_batch": gbs,
            "accumulation": int(values["gradient_accumulation_steps"]), "lr": values["opt_base_learning_rate"],
            "beta1": values["opt_lamb_beta_1"], "beta2": values["opt_lamb_beta_2"], "optimizer": values["opt_name"],
            "target": cfg["eval"]["target_accuracy"], "eval_interval": cfg["resolved"]["eval_interval_samples"],
            "max_samples": cfg["resolved"]["max_samples"], "curve": mlperf_log.eval_curve(events),
            "buckets": len(values.get("grad_sync_bucket_thresholds") or []),
            "train_s": round((times["run_stop"] - times["run_start"]) / 1000, 1)}


def init_run(plan: dict) -> Run | None:
    init = plan["init"]
    return make_run(plan, _texts(init.get("set") or {}), int(init.get("seed", 1)), "init") if init else None


def prepare_init(plan: dict, runner: Runner) -> dict[str, str]:
    """The init run (once), whose saved weights every study run starts from."""
    run = init_run(plan)
    if run is None:
        return {}
    model = runner.wd.runs / run.key / "model.pt"
    res = runner.run(run, {"SAVE_CHECKPOINT": str(model)})
    if res["status"] != "success" or not model.exists():
        raise StudyError(f"init: the run that makes the starting model missed its target ({_outcome(res)}); "
                         f"see {runner.wd.runs / run.key}")
    return {"INIT_CHECKPOINT": str(model)}


def tune_recipe(plan: dict, wd: Workdir, name: str) -> int:
    """tools/tune.py's search over a recipe's hyperparameters (the plan's ``tune.<name>``), on
    the study's data and from its init model: the recipe's other settings fixed, its current
    values tried first, a seed no study run uses. Prints the best (then copy it into the plan)."""
    spec = (plan.get("tune") or {}).get(name)
    if spec is None:
        raise PlanError(f"tune.{name}: no search space for that recipe (the plan has {sorted(plan.get('tune') or {})})")
    settings = with_scaled(plan, recipes(plan)[name])
    params = _need(spec, "params", f"tune.{name}")
    typed = {k: (int if all(isinstance(spec["params"][k].get(b), int) for b in ("low", "high")) else float)(settings[k])
             for k in params if "choices" not in params[k] and k in settings}
    fixed = {k: v for k, v in settings.items() if k not in params}
    # The search's name carries its fixed settings: an edited plan starts a new search.
    tag = hashlib.sha256(json.dumps(fixed, sort_keys=True).encode()).hexdigest()[:8]
    space = {"study": f"{plan['study']}_{name}_{tag}", "base_config": str(plan["base_config"]),
             "trials": int(spec.get("trials", 12)), "repeats": 1, "seed": int(spec.get("seed", 100)),
             "params": params, "fixed": fixed,
             "enqueue": [typed], "sampler": spec.get("sampler", {"name": "tpe", "seed": 0, "n_startup_trials": 4}),
             "pruner": spec.get("pruner", {"name": "median", "n_startup_trials": 3, "n_warmup_steps": 2})}
    tdir = wd.path / "tune"
    tdir.mkdir(exist_ok=True)
    path = tdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(space, sort_keys=False))
    runner = Runner(plan, wd, prepare_data(plan, wd), 1 if plan["init"] else 0)
    os.environ.update(**runner.paths, **prepare_init(plan, runner),
                      PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
    wd.unlock()  # data and init are ready: searches over other recipes may run beside this one
    print(f"study: tools/tune.py on recipe {name}: space {path}", flush=True)
    rc = tune.main(["worker", "--space", str(path), "--workdir", str(tdir)])
    return rc or tune.main(["report", "--space", str(path), "--workdir", str(tdir)])


def execute(plan: dict, wd: Workdir, report_only: bool,
            jobs: int = 1) -> tuple[dict[str, dict], dict[str, Run], list[Point]]:
    """Every run of the plan (the ones already logged are read back): the init, then the
    ablation and the scaling grids, then the seeds of each grid's winner. Returns results
    by key, runs by key (with every label that asked for each) and the scaling points."""
    _check_same(wd.path / "init.json", {"init": plan["init"]}, "an init model")
    ab, points = ablation_runs(plan), scaling_points(plan)
    runs: dict[str, Run] = {}

    def register(batch: list[Run]) -> list[Run]:
        """The runs of ``batch`` not asked for before; the others' labels are merged."""
        new = []
        for run in batch:
            if run.key in runs:
                runs[run.key].labels += [x for x in run.labels if x not in runs[run.key].labels]
            else:
                runs[run.key] = run
                new.append(run)
        return new

    first = register(ab + [r for p in points for r in p.grid.values()])
    planned = len(first) + sum(len(p.seeds) for p in points) + (1 if plan["init"] else 0)
    runner = None if report_only else Runner(plan, wd, prepare_data(plan, wd), planned, jobs)
    extra = {} if runner is None else prepare_init(plan, runner)

    def results_of(batch: list[Run]) -> dict[str, dict]:
        if runner is None:
            return {r.key: res for r in batch if (res := wd.result(r)) is not None}
        return runner.run_all(batch, extra)

    results = results_of(first)
    seeds = [r for p in points if all(g.key in results for g in p.grid.values())
             for r in seed_runs(plan, p, winner(p, results))]
    second = register(seeds)
    if runner:
        runner.planned -= len(seeds) - len(second)  # seed runs another part had asked for already
    results.update(results_of(second))
    return results, runs, points


# -- the report ----------------------------------------------------------------------------

def collect(plan: dict, results: dict[str, dict], runs: dict[str, Run], points: list[Point], wd: Workdir) -> dict:
    """The runs as tools/study_report.py reads them (plain dicts: results and directories)."""
    by_label = {lab: k for k, r in runs.items() for lab in r.labels}
    ab = plan["ablation"]
    rec = recipes(plan)
    about = {s["name"]: s.get("about", "") for s in ab["steps"]}

    def seeds(name: str) -> dict[int, dict]:
        keys = {int(s): by_label.get(f"ablation/{name}/seed_{s}") for s in ab["seeds"]}
        return {s: {"result": results.get(k), "config": wd.runs / k / f"{Path(LOG).stem}_config.json" if k else None}
                for s, k in keys.items()}

    scaling: dict[str, list[dict]] = {}
    for p in points:
        grid = {f: results.get(r.key) for f, r in p.grid.items()}
        factor = winner(p, results) if all(grid.values()) else None
        chosen = [] if factor is None else [p.grid[factor]] + seed_runs(plan, p, factor)
        scaling.setdefault(p.optimizer, []).append(
            {"batch": p.batch, "grid": grid, "factor": factor, "results": [results.get(r.key) for r in chosen],
             "local_batch": int(p.grid[factor].settings["BATCHSIZE"]) if factor is not None else None})
    targets = [r["target"] for r in results.values()]
    return {"study": plan["study"], "margin": plan["margin"], "balance": plan["balance"],
            "target": targets[-1] if targets else None, "scaling": scaling,
            "ablation": [{"recipe": n, "about": about[n], "settings": rec[n], "seeds": seeds(n)}
                         for n in (ab["recipes"] or list(rec))]}


def report(plan: dict, results: dict[str, dict], runs: dict[str, Run], points: list[Point], wd: Workdir) -> dict:
    """study.json, study.md and the plots in the work directory; the tables on stdout."""
    a = study_report.analyse(collect(plan, results, runs, points, wd))
    a.update(commit=_commit(), data=plan["data"], init=plan["init"], fixed=plan["fixed"],
             scaling_rules={k: v for k, v in (plan.get("scaling") or {}).items() if k != "optimizers"},
             runs={k: {"labels": r.labels, "seed": r.seed, "settings": r.settings,
                       **{x: y for x, y in results[k].items() if x != "curve"}} for k, r in runs.items() if k in results})
    done = [results[k] for k in runs if k in results and "cpu_s" in results[k]]
    a["cost"] = {"runs": len(done), "cpu_s": round(sum(r["cpu_s"] for r in done)),
                 "wall_s": round(sum(r["wall_s"] for r in done))}
    _write_json(wd.path / "study.json", a)
    md = study_report.markdown(a)
    (wd.path / "study.md").write_text(md)
    pngs = study_report.plots(a, wd.path)
    print(md)
    print(f"study: wrote {wd.path / 'study.json'}, {wd.path / 'study.md'}, " + ", ".join(map(str, pngs)))
    return a


def _commit() -> str:
    r = subprocess.run(["git", "rev-parse", "--short=10", "HEAD"], cwd=PKG, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=PKG,
                           capture_output=True, text=True).stdout.strip()
    return (r.stdout.strip() or "unknown") + ("+dirty" if dirty else "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python tools/study.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plan", type=Path, default=DEFAULT_PLAN, help="the plan YAML (default: %(default)s)")
    ap.add_argument("--quick", action="store_true", help="the plan's quick section over it: a check of the tool")
    ap.add_argument("--workdir", type=Path, default=None,
                    help="data, runs and outputs (default <repo>/results/study/<study>[_quick])")
    ap.add_argument("--report-only", action="store_true", help="run nothing: report the runs logged so far")
    ap.add_argument("--tune", metavar="RECIPE", help="instead: tools/tune.py over the plan's tune.RECIPE space")
    ap.add_argument("--jobs", type=int, default=1,
                    help="runs at a time (default 1: each run's 2 ranks fill a 2-core machine)")
    args = ap.parse_args(argv)
    if args.jobs < 1:
        ap.error(f"--jobs {args.jobs}: at least 1")
    try:
        plan = load_plan(args.plan, args.quick)
        wd = Workdir((args.workdir or ROOT / "results" / "study" / (plan["study"] + ("_quick" if args.quick else "")))
                     .resolve())
        if args.tune:
            return tune_recipe(plan, wd, args.tune)
        results, runs, points = execute(plan, wd, args.report_only, args.jobs)
        report(plan, results, runs, points, wd)
    except PlanError as e:
        print(f"study: plan: {e}", file=sys.stderr)
        return 2
    except StudyError as e:
        print(f"study: {e}", file=sys.stderr)
        return 1
    except Stopped as e:
        print(f"study: stopped by signal {e.signum}; the runs logged so far are kept: run the same command "
              "again to continue", file=sys.stderr)
        return 128 + e.signum
    return 0


if __name__ == "__main__":
    sys.exit(main())
