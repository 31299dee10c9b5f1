"""stratify: exact partition by real length, manifest counts, length index, both layouts."""

from __future__ import annotations

import numpy as np
import pytest

from bert.shards import read_shard
from input_preprocessing.common import PrepError
from input_preprocessing.stratify import stratify
from stratify_helpers import shards  # noqa: F401 - fixtures: shards


def test_rerun_resumes_and_a_different_run_is_refused(shards, tmp_path):
    src, _ = shards
    out = tmp_path / "s"
    first = stratify(src, out, [32, 64], max_seq_length=64, workers=1)
    (out / "manifest.json").unlink()  # as if interrupted before the end
    assert stratify(src, out, [32, 64], max_seq_length=64, workers=1) == first
    with pytest.raises(PrepError, match=r"s: already holds a different run \(different bounds\)"):
        stratify(src, out, [16, 64], max_seq_length=64)


def test_bad_bounds_and_inputs_are_named(shards, tmp_path):
    src, _ = shards
    with pytest.raises(PrepError, match="strictly increasing"):
        stratify(src, tmp_path / "a", [64, 32], max_seq_length=64)
    with pytest.raises(PrepError, match="last stratum bound 32 is below max_seq_length 64"):
        stratify(src, tmp_path / "b", [16, 32], max_seq_length=64)
    with pytest.raises(PrepError, match="no such directory"):
        stratify(tmp_path / "nothing", tmp_path / "c")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "mine.txt").write_text("x")
    with pytest.raises(PrepError, match=r"full: is not empty and has no \.run\.json"):
        stratify(src, tmp_path / "full", [64], max_seq_length=64)


def test_the_sampler_reads_what_stratify_writes(shards, tmp_path):
    from bert.sampler import LengthIndex

    src, _ = shards
    out = tmp_path / "s"
    manifest = stratify(src, out, [16, 40, 64], max_seq_length=64, workers=1)
    idx = LengthIndex.from_manifest(out)
    assert idx.bounds == ((1, 16), (17, 40), (41, 64))
    assert len(idx.lengths) == manifest["total_samples"]
    on_disk = np.concatenate([read_shard(p).lengths for p in idx.paths])
    np.testing.assert_array_equal(idx.lengths, on_disk)
