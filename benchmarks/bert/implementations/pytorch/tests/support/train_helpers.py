"""Helpers of test_train.py's unit and integration tests (and of other test files that import them)."""

from __future__ import annotations


def _small_overrides(demo_data, out, *extra):
    """The demo model (config_CPU_1x2.sh's CONFIG_PARAMS) on one process."""
    return [*demo_data.env["CONFIG_PARAMS"].split(), f"data.train_dir={demo_data.train}",
            f"data.eval_dir={demo_data.eval}", "data.eval_samples=1000", f"log.output_dir={out}",
            "run.local_batch_size=32", *extra]
