"""Helpers of test_prep_steps.py's unit and integration tests (and of other test files that import them)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bert import demo_data
from bert.shards import Shard, list_shards, read_shard, write_shard


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    """5 fixed-layout parts of uneven sizes (as create writes them)."""
    root = tmp_path_factory.mktemp("parts")
    demo_data.generate(root, train_samples=700, eval_samples=333, seed=5, seq_len=64, max_pred=10, vocab=200,
                       layout="fixed", shards=5)
    d = root / "train"
    first = list_shards(d)[0]  # make sizes uneven: cut the first part short
    write_shard(first, read_shard(first).subset(np.arange(61)), "fixed", 64, 10)
    return d, root / "eval"


def _all(d: Path) -> Shard:
    return Shard.concat([read_shard(p) for p in list_shards(d)])


def _same(a: Shard, b: Shard) -> None:
    for name in ("tokens", "segments", "offsets", "mlm_positions", "mlm_ids", "mlm_offsets", "nsp"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
