"""Helpers of test_tune.py's unit and integration tests (and of other test files that import them)."""

from __future__ import annotations

from pathlib import Path

import yaml

import tune  # noqa: E402  (tools/ holds scripts, not a package)


# Trials from the trained model; fixed for all: one rank, eval every 320 samples (10 steps of
# 32), cap 1600 (5 evals), no warmup, a 500-sample eval set.
FIXED = {"DGXNGPU": 1, "WARMUP_STEPS": 0, "EVAL_ITER_SAMPLES": 320, "MAX_SAMPLES_TERMINATION": 1600,
         "TARGET_MLM_ACCURACY": 0.77, "data.eval_samples": 500}


def write_space(path: Path, **over) -> Path:
    space = {"study": "lr_beta1", "base_config": "config_CPU_1x2.sh", "trials": 6,
             "params": {"LR": {"low": 1e-6, "high": 3e-2, "log": True}, "OPT_LAMB_BETA_1": {"low": 0.5, "high": 0.95}},
             "fixed": dict(FIXED), "sampler": {"name": "tpe", "seed": 0},
             "pruner": {"name": "median", "n_startup_trials": 1}, **over}
    path.write_text(yaml.safe_dump(space))
    return path


def load(space_file: Path, workdir: Path):
    space = tune.load_space(space_file)
    return space, tune.open_study(space, tune.default_storage(space, workdir), workdir)
