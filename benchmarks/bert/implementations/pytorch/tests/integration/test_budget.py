"""Static token budgets (bert/budget.py): a budget batch is the exact unpadded batch plus pad
rows and pad prediction slots, and the model gives the same loss and gradients on both; pad
rows get attention output 0 and are never attended; the ladder is optimal and validated."""

from __future__ import annotations

from bert.config import build_config


def test_training_with_auto_budgets_reaches_the_target(trained, demo_data, tmp_path):
    """bert.train end to end with data.token_budgets=auto (closed division, the TrainLoader),
    from the trained demo weights: its first evaluation reaches the target and the log
    passes the checker."""
    from conftest import run_checker
    from train_helpers import _small_overrides

    from bert import train

    assert trained.returncode == 0, trained.stdout[-3000:]
    rc = train.main(_small_overrides(demo_data, tmp_path, "data.token_budgets=auto",
                                     f"run.init_checkpoint={trained.checkpoint}", "optim.lr=1e-4",
                                     "eval.interval_samples=64", "run.max_samples=640"))
    assert rc == 0
    ok, out = run_checker(tmp_path / "result_0.txt")
    assert ok, out
    assert build_config(config_file=str(tmp_path / "result_0_config.json")).data.token_budgets == "auto"
