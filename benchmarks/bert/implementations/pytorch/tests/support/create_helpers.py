"""Helpers of test_create.py's unit and integration tests (and of other test files that import them)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from bert.shards import list_shards
from input_preprocessing.create import CreateOptions, create
from input_preprocessing.toy_corpus import make_corpus
from input_preprocessing.wordpiece import train_vocab


OPTS = CreateOptions(max_seq_length=128, max_predictions_per_seq=20, dupe_factor=2, seed=12345)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    parts = make_corpus(root / "text", parts=3, docs_per_part=40, seed=1)
    vocab = train_vocab(parts, root / "vocab.txt", size=1500)
    return root, parts, vocab


@pytest.fixture(scope="module")
def created(corpus, tmp_path_factory):
    root, _, vocab = corpus
    out = tmp_path_factory.mktemp("created") / "fixed"
    summary = create(root / "text", vocab, out, OPTS, workers=1)
    return out, summary


def _digests(d: Path) -> dict[str, str]:
    return {p.name: hashlib.md5(p.read_bytes()).hexdigest() for p in list_shards(d)}
