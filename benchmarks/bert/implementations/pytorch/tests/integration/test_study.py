"""tools/study.py and tools/study_report.py: the tests that start processes (peers, launchers,
tools); tests/unit/test_study.py has the rest and says what the file covers."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import PKG, VENV_BIN, mllog_events


sys.path.insert(0, str(PKG / "tools"))
import study  # noqa: E402  (tools/ holds scripts, not a package)
from study_helpers import PLAN


def write_plan(path: Path, **over) -> Path:
    tree = yaml.safe_load(PLAN.read_text())
    tree.update(over)
    path.write_text(yaml.safe_dump(tree))
    return path


def test_plan_errors_name_the_key(tmp_path):
    cases = {"typo": ({"ablaton": {}}, "unknown key(s) ['ablaton']"),
             "base": ({"base_config": "config_NONE.sh"}, "base_config: no such file"),
             "recipes": ({"ablation": {"seeds": [1], "steps": [{"name": "a"}], "recipes": ["b"]}},
                         "ablation.recipes: ['b'] are not steps"),
             "dupes": ({"ablation": {"seeds": [1], "steps": [{"name": "a"}, {"name": "a"}]}},
                       "ablation.steps: names must be unique"),
             "optimizer": ({"scaling": {"optimizers": {"sgd": "nope"}, "batches": [16, 32], "lr_factors": [1],
                                        "seeds": [1]}}, "scaling.optimizers: {'sgd': 'nope'} name no ablation step")}
    for name, (over, message) in cases.items():
        with pytest.raises(study.PlanError, match=re.escape(message)):
            study.load_plan(write_plan(tmp_path / f"{name}.yaml", **over))
    r = subprocess.run([sys.executable, "tools/study.py", "--plan", str(tmp_path / "typo.yaml"), "--workdir",
                        str(tmp_path / "wd")], cwd=PKG, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "study: plan:" in r.stderr and "ablaton" in r.stderr, r.stderr


def test_scaling_rules_and_one_run_shared_by_two_parts():
    """The stated rules at k = B / B0 = 4 and 1/4; at B0 with factor 1 the scaling point is the
    ablation's run itself (one key); a batch that does not split, and a recipe that sets a
    scaled variable's bert.config twin, are refused by name."""
    plan = study.load_plan(PLAN)
    rec = study.with_scaled(plan, study.recipes(plan)["open"])
    b0 = study.global_batch(rec) * 2
    lr, b1, b2 = float(rec["LR"]), float(rec["OPT_LAMB_BETA_1"]), float(rec["OPT_LAMB_BETA_2"])
    big = study.scaled(plan, rec, 4 * b0, 2.0)
    assert int(big["BATCHSIZE"]) * int(big["GRADIENT_STEPS"]) * 2 == 4 * b0
    assert int(big["BATCHSIZE"]) <= plan["scaling"]["max_local_batch"] and int(big["GRADIENT_STEPS"]) > 1
    assert float(big["LR"]) == pytest.approx(lr * 2.0 * 4 ** plan["scaling"]["lr_power"])
    assert float(big["OPT_LAMB_BETA_1"]) == pytest.approx(b1 ** 4 ** plan["scaling"]["beta_power"])
    assert float(big["OPT_LAMB_BETA_2"]) == pytest.approx(b2 ** 4 ** plan["scaling"]["beta_power"])
    assert int(big["WARMUP_STEPS"]) == round(int(rec["WARMUP_STEPS"]) / 4)
    assert int(big["MAX_STEPS"]) == round(int(rec["MAX_STEPS"]) / 4)
    assert int(big["EVAL_ITER_SAMPLES"]) % (4 * b0) == 0 and int(big["EVAL_ITER_SAMPLES"]) >= int(rec["EVAL_ITER_SAMPLES"])
    small = study.scaled(plan, rec, b0 // 4, 1.0)
    assert int(small["GRADIENT_STEPS"]) == 1 and int(small["WARMUP_STEPS"]) == 4 * int(rec["WARMUP_STEPS"])
    assert study.scaled(plan, rec, b0, 1.0) == rec
    ablation = {r.labels[0]: r.key for r in study.ablation_runs(plan)}
    points = {(p.optimizer, p.batch): p for p in study.scaling_points(plan)}
    assert points[("adam", b0)].grid[1.0].key == ablation["ablation/open/seed_1"]
    assert points[("adam", b0)].grid[2.0].key != ablation["ablation/open/seed_1"]
    with pytest.raises(study.PlanError, match="does not split into 2 ranks"):
        study.scaled(plan, rec, 3 * b0 // 2 + 2, 1.0)
    with pytest.raises(study.PlanError, match=re.escape("the recipe sets ['optim.lr']")):
        study.scaled(plan, {**rec, "optim.lr": "0.1"}, 2 * b0, 1.0)


def test_winner_is_the_fewest_samples_and_a_miss_ranks_last():
    plan = study.load_plan(PLAN)
    point = next(p for p in study.scaling_points(plan) if p.batch == 16)
    f = sorted(point.grid)
    results = {point.grid[f[0]].key: {"status": "aborted", "samples": 100},
               point.grid[f[1]].key: {"status": "success", "samples": 900},
               point.grid[f[2]].key: {"status": "success", "samples": 800}}
    assert study.winner(point, results) == f[2]
    results[point.grid[f[2]].key] = {"status": "success", "samples": 900}
    assert study.winner(point, results) == 1.0  # a tie goes to the factor nearest 1


def run_quick(workdir: Path, stop_after_first: bool = False, *extra: str) -> tuple[int, str]:
    env = dict(os.environ, PATH=f"{VENV_BIN}:{os.environ['PATH']}")
    proc = subprocess.Popen([sys.executable, "tools/study.py", "--quick", "--workdir", str(workdir), *extra],
                            cwd=PKG, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if stop_after_first and line.startswith("[1/"):
                proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    return rc, "".join(lines)


def test_quick_study_stops_continues_and_reports_what_the_logs_say(tmp_path):
    wd = tmp_path / "quick"
    rc, out = run_quick(wd, stop_after_first=True)
    assert rc == 128 + signal.SIGTERM and "stopped by signal 15" in out, out[-3000:]
    assert len(list((wd / "runs").glob("*/result.json"))) == 1
    rc, out = run_quick(wd, False, "--jobs", "2")
    assert rc == 0, out[-3000:]
    assert out.count("(logged before)") == 1 and re.search(r"^\[6/6\] ", out, re.M), out[-3000:]
    a = json.loads((wd / "study.json").read_text())
    plan = study.load_plan(PLAN, quick=True)
    assert [r["recipe"] for r in a["ablation"]] == ["closed", "open"] and len(a["runs"]) == 6

    # Every number the report took from a run is what that run's MLPerf log says.
    for key, run in a["runs"].items():
        events = mllog_events(wd / "runs" / key / "run.log")
        stop = next(e for e in events if e["key"] == "run_stop")
        gbs = next(e["value"] for e in events if e["key"] == "global_batch_size")
        assert (run["status"], run["samples"], run["global_batch"]) == (
            stop["metadata"]["status"], stop["metadata"]["samples_count"], gbs)
        assert run["steps"] == run["samples"] // gbs and run["seed"] == next(
            e["value"] for e in events if e["key"] == "seed")
    for row in a["ablation"]:
        runs = [r for r in a["runs"].values() if any(lab.startswith(f"ablation/{row['recipe']}/") for lab in r["labels"])]
        ok = [r["samples"] for r in runs if r["status"] == "success"]
        assert row["runs"] == len(plan["ablation"]["seeds"]) == len(runs)
        assert sorted(row["samples_to_target"]["each"]) == pytest.approx(sorted(ok))
        assert 1.0 <= row["imbalance"]["measured_mean"] <= row["imbalance"]["measured_worst"] < 2.0
    assert a["ablation"][1]["vs_previous"]["recipe"] == "closed"
    for opt in ("lamb", "adam"):
        pts = a["scaling"][opt]["points"]
        assert [p["batch"] for p in pts] == plan["scaling"]["batches"]
        assert [p["local_batch"] * p["accumulation"] * 2 for p in pts] == plan["scaling"]["batches"]
        assert a["scaling"][opt]["fit"] is not None
    assert a["scaling"]["lamb"]["points"][0]["steps"]["each"] == [
        r["steps"] for r in a["runs"].values() if "ablation/closed/seed_1" in r["labels"]]
    md = (wd / "study.md").read_text()
    assert "| closed |" in md and "| open |" in md and "Steps to target against global batch: adam" in md
    for png in ("ablation.png", "scaling.png"):
        assert 0 < (wd / png).stat().st_size < 200_000

    # --report-only runs nothing and reports the same.
    before = sorted(p.name for p in (wd / "runs").iterdir())
    rc, out = run_quick(wd, False, "--report-only")
    assert rc == 0 and "[" not in out.split("###")[0], out[-3000:]
    assert sorted(p.name for p in (wd / "runs").iterdir()) == before
    again = json.loads((wd / "study.json").read_text())
    assert again["ablation"][0]["samples_to_target"] == a["ablation"][0]["samples_to_target"]

    # --tune: tools/tune.py over the recipe's space, its other settings fixed, its own values first.
    rc, out = run_quick(wd, False, "--tune", "closed")
    assert rc == 0 and "best: trial" in out, out[-3000:]
    space = yaml.safe_load((wd / "tune" / "closed.yaml").read_text())
    recipe = study.with_scaled(plan, study.recipes(plan)["closed"])
    assert set(space["params"]) == set(plan["tune"]["closed"]["params"]) and space["trials"] == 1
    assert space["fixed"] == {k: v for k, v in recipe.items() if k not in space["params"]}
    assert {k: str(v) for k, v in space["enqueue"][0].items()} == {k: recipe[k] for k in space["params"]}
    trials = (wd / "tune" / space["study"] / "trials.csv").read_text().splitlines()
    assert len(trials) == 2 and ",target," in trials[1], trials
