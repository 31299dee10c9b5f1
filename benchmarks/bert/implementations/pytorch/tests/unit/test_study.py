"""tools/study.py and tools/study_report.py: the plan and its scaling rules, the statistics
against cases with known answers, the token imbalance against the sampler's own ids, a work
directory that refuses other data, and ``--quick`` end to end (2 recipes x 2 seeds and 2
scaling points through run_and_time.sh), stopped by SIGTERM after its first run and
continued by the same command; what it reports is checked against the runs' MLPerf logs.
None of it asserts on the science."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import PKG


sys.path.insert(0, str(PKG / "tools"))
import study  # noqa: E402  (tools/ holds scripts, not a package)
import study_report  # noqa: E402

from bert import config as bert_config  # noqa: E402
from bert import sampler  # noqa: E402
from bert.reader import ShardReader  # noqa: E402
from study_helpers import PLAN


def test_bootstrap_ratio_and_verdicts():
    a = [100.0, 110.0, 90.0, 105.0]
    assert study_report.bootstrap_ratio(a, a, paired=True) == pytest.approx([1.0, 1.0])
    assert study_report.bootstrap_ratio([2 * x for x in a], a, paired=True) == pytest.approx([2.0, 2.0])
    unpaired = study_report.bootstrap_ratio([2 * x for x in a], a, paired=False)
    assert unpaired[0] < 2.0 < unpaired[1]  # the seeds' spread, no longer cancelled
    assert study_report.bootstrap_ratio([1.0], a, paired=False) is None
    assert study_report.non_inferior([0.95, 1.08], 0.10).startswith("supported")
    assert study_report.non_inferior([1.02, 1.30], 0.10).startswith("not supported")
    assert study_report.non_inferior([0.97, 1.20], 0.10).startswith("not decidable")
    assert study_report.non_inferior(None, 0.10).startswith("not decidable")


def test_critical_batch_recovers_a_known_one():
    batches = [16, 32, 64, 128, 256]
    fit = study_report.critical_batch(batches, [500 * (1 + 64 / b) for b in batches])
    assert fit["s_min"] == pytest.approx(500) and fit["b_crit"] == pytest.approx(64)
    assert study_report.critical_batch(batches, [64000 / b for b in batches])["b_crit"] == float("inf")
    points = [{"batch": b, "steps": {"each": [500 * (1 + 64 / b) * f for f in (0.95, 1.05)]}} for b in batches]
    late = [{"batch": b, "steps": {"each": [500 * (1 + 512 / b) * f for f in (0.95, 1.05)]}} for b in batches]
    c = study_report.compare_critical(points, late)
    assert c["p_larger"] > 0.975 and c["verdict"] == "supported"
    assert study_report.compare_critical(late, points)["verdict"].startswith("not supported")


def test_token_imbalance_replays_the_runs_loaders(demo_data, tmp_path):
    """Stratified sampling with the snake deal over 2 ranks and 2 accumulation steps: the
    imbalance measured through the collated batches equals the one computed from the
    sampler's ids and the length index; uniform sampling (each rank its shards) measures
    worse than the dealt one."""
    common = {"data.train_dir": str(demo_data.train), "data.eval_dir": str(demo_data.eval), "run.seed": 5,
              "model.max_position_embeddings": 128, "data.max_seq_length": 128, "data.max_predictions_per_seq": 20,
              "run.local_batch_size": 16}
    dealt = bert_config.build_config({**common, "run.division": "open", "sampler.mode": "stratified",
                                      "sampler.strata_width": 32, "sampler.deal": "snake", "sampler.group_size": 2,
                                      "run.grad_accum_steps": 2})
    uniform = bert_config.build_config(common)
    for name, cfg in (("dealt", dealt), ("uniform", uniform)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "run_config.json").write_text(bert_config.dumps(cfg, {"world_size": 2}))
    got = study_report.token_imbalance(tmp_path / "dealt" / "run_config.json", 12)
    index = sampler.LengthIndex.from_dir(demo_data.train, ShardReader(demo_data.train, max_seq_length=128, bounds=None,
                                                                      verify_md5=True, timeout_s=60))
    ranks = [sampler.build_sampler(dealt.sampler, index, rank=r, world_size=2, local_batch=16, seed=5,
                                   max_seq_length=128, hidden=dealt.model.hidden_size) for r in (0, 1)]
    want = []
    for step in range(12):
        tok = np.array([sum(int(index.lengths[s.ids(2 * step + m)].sum()) for m in (0, 1)) for s in ranks])
        want.append(tok.max() / tok.mean())
    assert got["mode"] == "stratified+snake" and got["ranks"] == 2 and got["group"] == 2
    assert got["mean"] == pytest.approx(np.mean(want)) and got["worst"] == pytest.approx(np.max(want))
    uniform_got = study_report.token_imbalance(tmp_path / "uniform" / "run_config.json", 12)
    assert uniform_got["mode"] == "random" and uniform_got["mean"] > got["mean"] >= 1.0


def test_workdir_refuses_other_data_and_a_second_study(tmp_path):
    plan = study.load_plan(PLAN)
    plan["data"] = dict(plan["data"], train_samples=64, eval_samples=16, shards=2)
    wd = study.Workdir(tmp_path)
    paths = study.prepare_data(plan, wd)
    assert sorted(p.name for p in Path(paths["DATADIR"]).iterdir()) == ["part_00000_of_00002.hdf5",
                                                                       "part_00001_of_00002.hdf5"]
    with pytest.raises(study.StudyError, match="another study is running"):
        study.Workdir(tmp_path)
    other = dict(plan, data=dict(plan["data"], seed=2))
    with pytest.raises(study.StudyError, match="holds data made with"):
        study.prepare_data(other, wd)


def test_parallel_runs_start_nothing_after_an_error(tmp_path):
    """--jobs 2: one run fails; the runs not started yet are dropped, the error raised."""
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    try:
        runner = study.Runner(study.load_plan(PLAN), study.Workdir(tmp_path), {}, 6, jobs=2)
        started = []

        def run(r: study.Run, _extra: dict) -> dict:
            started.append(r.key)
            if r.key == "b":
                raise study.StudyError("run b broke")
            time.sleep(0.5)
            return {"key": r.key}

        runner.run = run
        ok = runner.run_all([study.Run({}, 1, k) for k in "xy"], {})
        assert ok == {"x": {"key": "x"}, "y": {"key": "y"}}
        started.clear()
        with pytest.raises(study.StudyError, match="run b broke"):
            runner.run_all([study.Run({}, 1, k) for k in "abcdefgh"], {})
        assert "b" in started and len(started) <= 4, started
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
