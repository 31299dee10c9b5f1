"""Helpers of test_rules.py's unit and integration tests (and of other test files that import them)."""

from __future__ import annotations

import json
from pathlib import Path


def _scratch_args(demo_data, out, *extra):
    """The demo model from random weights, one rank, a few steps (never reaches the target)."""
    return [*demo_data.env["CONFIG_PARAMS"].split(), f"data.train_dir={demo_data.train}",
            f"data.eval_dir={demo_data.eval}", "data.eval_samples=100", "eval.batch_size=100",
            f"log.output_dir={out}", "run.local_batch_size=32", "run.threads=1", *extra]


def _rcps() -> dict:
    import mlperf_logging.rcp_checker as rc

    return json.loads((Path(rc.__file__).parent / "training_5.0.0" / "rcps_bert.json").read_text())
