"""MLPerf rules the compliance checker cannot read: the clock starts before the
data is touched, seeds, the eval set, the log keys reviewers read, closed recipes."""

from __future__ import annotations

import json

import pytest

from bert import train
from bert.config import build_config, parse_overrides, timed_run_problems
from bert.trainer import open_data
from conftest import mllog_events
from rules_helpers import _rcps, _scratch_args


def test_unset_seed_is_fresh_per_run_logged_and_dumped(demo_data, tmp_path):
    """Unset, every run draws its own seed from the OS (MLPerf's package checker compares
    them); the log and the dumped config both carry it, so the run can be repeated."""
    seeds = []
    for i in range(3):
        out = tmp_path / str(i)
        assert train.main(_scratch_args(demo_data, out, "--dry-run")) == 0
        logged = {e["key"]: e["value"] for e in mllog_events(out / "result_0.txt")}["seed"]
        dumped = json.loads((out / "result_0_config.json").read_text())["run"]["seed"]
        assert logged == dumped and 0 <= logged < 2**31
        seeds.append(logged)
    assert len(set(seeds)) == 3


def test_explicit_seed_reproduces_the_run(demo_data, tmp_path):
    """run.seed=5 twice: the same seed logged and bit-identical weights after 4 steps (random
    init, data order and dropout all follow it)."""
    import torch

    weights = []
    for i in range(2):
        out = tmp_path / str(i)
        rc = train.main(_scratch_args(demo_data, out, "run.seed=5", "eval.interval_samples=64",
                                      "run.max_samples=128", f"run.save_checkpoint={out / 'w.pt'}"))
        assert rc == 1  # the sample limit, not the target: 4 steps from random weights
        assert {e["key"]: e["value"] for e in mllog_events(out / "result_0.txt")}["seed"] == 5
        weights.append(torch.load(out / "w.pt", weights_only=True))
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def _linked(src_dir, dst):
    """``dst`` holding symlinks to the shards of ``src_dir`` (a copy that shares the files)."""
    dst.mkdir(parents=True)
    for p in sorted(src_dir.iterdir()):
        (dst / p.name).symlink_to(p)
    return dst


@pytest.mark.parametrize("where", ["same", "inside", "shares_a_file"])
def test_eval_set_overlapping_the_training_data_is_refused(demo_data, tmp_path, capsys, where):
    """An eval dir that is the train dir, lies inside it, or holds one of its files: exit 2,
    a message naming data.eval_dir / EVALDIR, before any training step."""
    train_dir = _linked(demo_data.train, tmp_path / "train")
    eval_dir = {"same": train_dir, "inside": tmp_path / "train" / "eval",
                "shares_a_file": tmp_path / "eval"}[where]
    if where == "inside":
        _linked(demo_data.eval, eval_dir)
    elif where == "shares_a_file":
        eval_dir.mkdir()
        (eval_dir / "eval.hdf5").symlink_to(sorted(demo_data.train.iterdir())[0])
    args = _scratch_args(demo_data, tmp_path / "out", "run.max_samples=64")
    args = [a for a in args if not a.startswith(("data.train_dir=", "data.eval_dir="))]
    assert train.main([*args, f"data.train_dir={train_dir}", f"data.eval_dir={eval_dir}"]) == 2
    err = capsys.readouterr().err
    assert "data.eval_dir" in err and "EVALDIR" in err and "Traceback" not in err
    assert "eval_accuracy" not in {e["key"] for e in mllog_events(tmp_path / "out" / "result_0.txt")}


def test_more_eval_samples_than_the_set_holds_is_refused(demo_data, tmp_path, capsys):
    args = [a for a in _scratch_args(demo_data, tmp_path, "run.max_samples=64") if not a.startswith("data.eval_samples")]
    assert train.main([*args, "data.eval_samples=5000"]) == 2
    err = capsys.readouterr().err
    assert "data.eval_samples=5000 but" in err and "holds 1000 samples: set data.eval_samples=1000" in err


def test_closed_bert_large_needs_the_phase1_checkpoint_and_the_full_eval_set(tmp_path, capsys):
    """Refused before anything is built (exit 2, the keys named); a dry run only warns."""
    base = [f"data.train_dir={tmp_path}", f"data.eval_dir={tmp_path}", f"log.output_dir={tmp_path}"]
    assert train.main(base) == 2
    err = capsys.readouterr().err
    assert "run.init_checkpoint" in err and "INIT_CHECKPOINT" in err
    assert train.main([*base, "run.init_checkpoint=x", "data.eval_samples=500"]) == 2
    assert "data.eval_samples=500" in capsys.readouterr().err
    # The open division and other models are free to choose.
    cfg = build_config(parse_overrides([*base, "run.division=open", "optim.name=adam", "data.eval_samples=500"]))
    assert timed_run_problems(cfg) == []


def test_closed_bert_large_eval_set_must_hold_10000_samples(demo_data):
    """The set itself is counted once open (after run_start): 1,000 samples are refused."""
    from bert.shards import DataError

    cfg = build_config(parse_overrides([f"data.train_dir={demo_data.train}", f"data.eval_dir={demo_data.eval}",
                                        "data.eval_samples=0", "run.init_checkpoint=x", "run.seed=1"]))
    assert timed_run_problems(cfg) == []  # what the config says is fine; the set is short
    with pytest.raises(DataError, match="holds 1000 samples; a closed BERT-Large run evaluates on the full 10,000"):
        open_data(cfg, 0, 1)


def test_defaults_are_the_rcp_of_batch_448():
    cfg = build_config()
    hp = _rcps()["bert_ref_448"]["Hyperparams"]
    assert (cfg.optim.lr, cfg.optim.total_steps, cfg.optim.warmup_steps) == \
        (hp["opt_base_learning_rate"], hp["opt_learning_rate_training_steps"], hp["num_warmup_steps"])
    assert cfg.run.local_batch_size * 8 == 448
