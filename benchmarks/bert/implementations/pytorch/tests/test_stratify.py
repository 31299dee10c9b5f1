"""stratify: exact partition by real length, manifest counts, length index, both layouts."""

from __future__ import annotations

import json

import numpy as np
import pytest

from bert import demo_data
from bert.shards import list_shards, read_shard
from input_preprocessing.common import PrepError
from input_preprocessing.stratify import load_manifest, stratify, strata_ranges


@pytest.fixture(scope="module", params=["variable", "fixed"])
def shards(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"strat_{request.param}")
    demo_data.generate(root, train_samples=600, eval_samples=10, seed=3, seq_len=64, max_pred=10, vocab=200,
                       layout=request.param, shards=3)
    return root / "train", request.param


def _ids(shard, i):  # a sample's identity: its tokens (demo samples are distinct with overwhelming odds)
    return tuple(shard[i].input_ids.tolist()) + (shard[i].nsp_label,)


def test_strata_partition_the_data_exactly(shards, tmp_path):
    src, layout = shards
    bounds = [16, 40, 64]
    out = tmp_path / "strata"
    manifest = stratify(src, out, bounds, max_seq_length=64, workers=2)

    originals = [read_shard(p) for p in list_shards(src)]
    want = sorted(_ids(s, i) for s in originals for i in range(len(s)))
    got, total_tokens = [], 0
    manifest2, index = load_manifest(out)
    assert manifest2 == manifest == json.loads((out / "manifest.json").read_text())
    assert [s["name"] for s in manifest["strata"]] == ["stratum_0_1-16", "stratum_1_17-40", "stratum_2_41-64"]
    for s, (lo, hi) in zip(manifest["strata"], strata_ranges(bounds)):
        assert (s["min_len"], s["max_len"]) == (lo, hi)
        files = sorted(p.relative_to(out).as_posix() for p in (out / s["name"]).glob("*.hdf5"))
        assert files == sorted(s["shards"])
        n = toks = 0
        for rel in s["shards"]:
            sh = read_shard(out / rel)
            assert sh.path.endswith(rel)
            assert ((sh.lengths >= lo) & (sh.lengths <= hi)).all()
            np.testing.assert_array_equal(index[rel], sh.lengths)
            assert index[rel].dtype == np.uint16
            with __import__("h5py").File(out / rel) as f:  # same layout as the input
                assert (f["input_ids"].ndim == 2) == (layout == "fixed")
            got += [_ids(sh, i) for i in range(len(sh))]
            n, toks = n + len(sh), toks + int(sh.lengths.sum())
        assert (s["samples"], s["tokens"]) == (n, toks)
        total_tokens += toks
    assert sorted(got) == want  # every sample in exactly one stratum
    assert manifest["total_samples"] == len(want)
    assert manifest["total_tokens"] == total_tokens == sum(int(s.lengths.sum()) for s in originals)
    assert manifest["format"] == "mlperf-bert-strata/1" and manifest["length_index"] == "length_index.npz"
    assert all(s["samples"] > 0 for s in manifest["strata"])  # the bounds really split this data


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
