"""The entry point in one process: a dry run builds everything and trains nothing; a bad
config exits 2 naming the key. The runs to the target are in tests/integration/test_train.py."""

from __future__ import annotations

import json

import pytest

from bert import train
from conftest import mllog_events
from train_helpers import _small_overrides


@pytest.mark.parametrize("activation", ["", "gelu_erf"])
def test_dry_run_builds_everything_and_trains_nothing(demo_data, tmp_path, capsys, activation):
    """... and says which GELU the model runs (model.activation; default the reference's
    tanh form) in its first lines and the dumped config."""
    extra = [f"model.activation={activation}"] if activation else []
    assert train.main(_small_overrides(demo_data, tmp_path, "--dry-run", *extra)) == 0
    events = mllog_events(tmp_path / "result_0.txt")
    assert "run_start" not in {e["key"] for e in events}
    dumped = json.loads((tmp_path / "result_0_config.json").read_text())
    assert dumped["model"]["activation"] == (activation or "gelu_tanh")
    assert f"; activation {activation or 'gelu_tanh'}; " in capsys.readouterr().out


def test_bad_config_exits_2_naming_the_key(capsys):
    assert train.main(["optim.lr=fast"]) == 2
    assert "optim.lr" in capsys.readouterr().err
    assert train.main(["model.activation=gelu"]) == 2  # ambiguous: which GELU is meant
    assert "model.activation: 'gelu' is not one of ['gelu_tanh', 'gelu_erf']" in capsys.readouterr().err
