"""Helpers of test_stratify.py's unit and integration tests (and of other test files that import them)."""

from __future__ import annotations

import pytest

from bert import demo_data


@pytest.fixture(scope="module", params=["variable", "fixed"])
def shards(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"strat_{request.param}")
    demo_data.generate(root, train_samples=600, eval_samples=10, seed=3, seq_len=64, max_pred=10, vocab=200,
                       layout=request.param, shards=3)
    return root / "train", request.param
