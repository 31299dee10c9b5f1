"""shard, eval, checksum/verify, stats and the CLI around every step."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from bert.shards import read_shard
from input_preprocessing.common import PrepError
from input_preprocessing.pick_eval import pick_eval, pick_indices
from input_preprocessing.shard import shard
from input_preprocessing.stats import stats
from prep_steps_helpers import _all, _same, parts  # noqa: F401 - fixtures: parts


def test_shard_errors(parts, tmp_path):
    src, _ = parts
    with pytest.raises(PrepError, match="cannot cut 621 samples into 622 non-empty shards"):
        shard(src, tmp_path / "a", 622)
    with pytest.raises(PrepError, match="padded to 64 tokens / 10 predictions, more than the fixed output's 32 / 10"):
        shard(src, tmp_path / "b", 2, "fixed", 32, 10)
    shard(src, tmp_path / "c", 2)
    with pytest.raises(PrepError, match="different run"):
        shard(src, tmp_path / "c", 3)


def test_a_rerun_over_inputs_changed_in_place_at_the_same_size_is_refused(parts, tmp_path):
    """shard, stratify and eval recognise their inputs by content: an input part remade with
    the same samples in another order (the same size to the byte, other bytes) is another run,
    refused naming the inputs, not a resume that keeps the old output."""
    import shutil

    from bert.shards import list_shards, write_shard
    from input_preprocessing.stratify import stratify

    src, ev = parts
    mine = tmp_path / "src"
    shutil.copytree(src, mine)
    shard(mine, tmp_path / "sh", 2)
    stratify(mine, tmp_path / "st", [32, 64], max_seq_length=64)
    pick_eval(mine, tmp_path / "ev", num_samples=50)
    part = list_shards(mine)[1]
    size, data = part.stat().st_size, read_shard(part)
    write_shard(part, data.subset(np.arange(len(data))[::-1]), "fixed", 64, 10)
    assert part.stat().st_size == size
    shard(mine, tmp_path / "sh2", 2)  # the same inputs again: a new directory is made as before
    for step in (lambda: shard(mine, tmp_path / "sh", 2),
                 lambda: stratify(mine, tmp_path / "st", [32, 64], max_seq_length=64),
                 lambda: pick_eval(mine, tmp_path / "ev", num_samples=50)):
        with pytest.raises(PrepError, match=r"already holds a different run \(different inputs\)"):
            step()


def test_eval_pick_count_spacing_and_determinism(parts, tmp_path):
    _, ev = parts
    np.testing.assert_array_equal(pick_indices(10, 4), [0, 2, 5, 7])
    r1 = pick_eval(ev, tmp_path / "e1", num_samples=100)
    r2 = pick_eval(ev, tmp_path / "e2", num_samples=100, layout="variable")
    assert r1["picked"] == 100 and r1["eval_examples"] == 333
    a, b = read_shard(r1["file"]), read_shard(r2["file"])
    assert len(a) == 100
    _same(a, b)
    _same(a, _all(ev).subset(np.arange(100) * 333 // 100))
    assert Path(r1["file"]).read_bytes() == Path(pick_eval(ev, tmp_path / "e3", 100)["file"]).read_bytes()
    with pytest.raises(PrepError, match="cannot pick 334 samples out of 333"):
        pick_eval(ev, tmp_path / "e4", num_samples=334)


def test_stats_numbers_and_plot(parts, tmp_path):
    src, _ = parts
    summary = stats(src, tmp_path / "st", max_seq_length=64)
    data = _all(src)
    lens = data.lengths
    saved = json.loads((tmp_path / "st" / "stats.json").read_text())
    assert saved["samples"] == len(lens) == summary["samples"]
    assert saved["tokens"] == int(lens.sum())
    assert saved["mean_length"] == round(lens.mean(), 2)
    assert saved["padding_fraction"] == round(1 - lens.sum() / (len(lens) * 64), 4)
    assert saved["fraction_at_max_length"] == round(float((lens == 64).mean()), 4)
    assert np.array_equal(saved["length_histogram"], np.bincount(lens, minlength=65))
    assert saved["median_length"] == int(np.sort(lens)[(len(lens) + 1) // 2 - 1])
    png = (tmp_path / "st" / "length_histogram.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 2000
