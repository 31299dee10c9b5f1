"""create: schema, the masking and NSP rules checked against the source text, determinism
across worker counts, resumption, and the errors on bad input."""

from __future__ import annotations

import json

import pytest

from bert.shards import read_shard
from input_preprocessing.common import PrepError
from input_preprocessing.create import CreateOptions, create
from create_helpers import OPTS, _digests, corpus, created  # noqa: F401 - fixtures: corpus, created


def test_same_seed_same_bytes_any_worker_count_and_resume(corpus, created, tmp_path):
    root, _, vocab = corpus
    out, _ = created
    two = tmp_path / "two"
    s2 = create(root / "text", vocab, two, OPTS, workers=2)
    assert s2["parts_written_now"] == 3
    assert _digests(two) == _digests(out)
    victim = sorted(two.glob("*.hdf5"))[1]
    victim.unlink()
    (two / (victim.name + ".123.tmp")).write_bytes(b"torn")  # left by a killed run
    again = create(root / "text", vocab, two, OPTS, workers=2)
    assert again["parts_written_now"] == 1
    assert _digests(two) == _digests(out)
    other = tmp_path / "seed"
    create(root / "text", vocab, other, CreateOptions(**{**OPTS.__dict__, "seed": 1}), workers=1)
    assert all(_digests(other)[k] != h for k, h in _digests(out).items())
    with pytest.raises(PrepError, match=r"two: already holds a different run \(different seed\)"):
        create(root / "text", vocab, two, CreateOptions(**{**OPTS.__dict__, "seed": 1}))


def test_cli_create(corpus, tmp_path, capsys):
    from input_preprocessing.__main__ import main

    root, _, vocab = corpus
    assert main(["create", "--input", str(root / "text"), "--vocab", str(vocab), "--output", str(tmp_path / "o"),
                 "--max-seq-length", "64", "--max-predictions-per-seq", "10", "--dupe-factor", "1",
                 "--workers", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["parts"] == 3
    assert read_shard(next((tmp_path / "o").glob("*.hdf5")), 64).lengths.max() <= 64
    assert main(["create", "--input", str(root / "text"), "--vocab", str(tmp_path / "no_vocab.txt"),
                 "--output", str(tmp_path / "o2")]) == 2
    assert "no_vocab.txt: vocab file does not exist" in capsys.readouterr().err
