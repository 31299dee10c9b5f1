"""The entry point in one process: a dry run builds everything and trains nothing; a bad
config exits 2 naming the key. The runs to the target are in tests/integration/test_train.py."""

from __future__ import annotations

from bert import train
from conftest import mllog_events
from train_helpers import _small_overrides


def test_dry_run_builds_everything_and_trains_nothing(demo_data, tmp_path):
    assert train.main(_small_overrides(demo_data, tmp_path, "--dry-run")) == 0
    events = mllog_events(tmp_path / "result_0.txt")
    assert "run_start" not in {e["key"] for e in events}
    assert (tmp_path / "result_0_config.json").exists()


def test_bad_config_exits_2_naming_the_key(capsys):
    assert train.main(["optim.lr=fast"]) == 2
    assert "optim.lr" in capsys.readouterr().err
