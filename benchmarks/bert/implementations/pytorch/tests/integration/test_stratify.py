"""stratify: exact partition by real length, manifest counts, length index, both layouts."""

from __future__ import annotations

import json

import numpy as np

from bert.shards import list_shards, read_shard
from input_preprocessing.stratify import load_manifest, stratify, strata_ranges
from stratify_helpers import shards  # noqa: F401 - fixtures: shards


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
