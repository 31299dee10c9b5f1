"""The pure-Python parts of the TensorFlow oracle (tests/integration/test_tf_oracle.py runs
Google's BERT in the TensorFlow environment's own interpreter): run_pretraining's features
become our samples faithfully; a missing bert-tensorflow is named with how to get it; and
TensorFlow stays out of the main venv."""

from __future__ import annotations

import importlib.util
import shutil

import numpy as np
import pytest
import torch

from bench import google_bert
from bert.batches import collate
from pretraining_features import make_batches, samples


def test_googles_features_become_our_samples():
    """Each real token, segment, prediction and NSP label of the fixed-layout features reaches
    our padded and unpadded batches, and no padding token or padded prediction slot does."""
    f = make_batches(2, 61, 0, batch=5, seq=32, predictions=6)
    batch = {k: v[1] for k, v in f.items()}
    assert (batch["input_mask"].sum(1) < 32).any() and (batch["masked_lm_weights"] == 0).any()
    padded, unpadded = collate(samples(batch), False, 32), collate(samples(batch), True, 32)
    mask = torch.from_numpy(batch["input_mask"]).long()
    assert torch.equal(padded["attention_mask"].long(), mask)
    assert torch.equal(padded["input_ids"] * mask, torch.from_numpy(batch["input_ids"]).long())
    assert torch.equal(padded["token_type_ids"] * mask, torch.from_numpy(batch["segment_ids"]).long())
    want = torch.full((5, 32), -100)
    for b, p in zip(*np.nonzero(batch["masked_lm_weights"])):
        want[b, batch["masked_lm_positions"][b, p]] = int(batch["masked_lm_ids"][b, p])
    assert torch.equal(padded["mlm_labels"], want)
    real = batch["masked_lm_weights"].reshape(-1) > 0  # TF's row order of the MLM head's output
    assert torch.equal(unpadded["mlm_labels"], torch.from_numpy(batch["masked_lm_ids"].reshape(-1)[real]).long())
    assert torch.equal(unpadded["input_ids"], torch.from_numpy(batch["input_ids"][batch["input_mask"] > 0]).long())
    assert unpadded["nsp_labels"].tolist() == padded["nsp_labels"].tolist() == batch["next_sentence_labels"].tolist()


def test_a_missing_oracle_is_named_with_how_to_get_it(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"bert/run_pretraining.py\): make venv"):
        google_bert.installed(tmp_path, ("modeling", "run_pretraining"))
    shutil.copytree(google_bert.ORACLE_DIR / "bert", tmp_path / "bert")
    with pytest.raises(FileNotFoundError, match=f"not bert-tensorflow {google_bert.VERSION}: make venv"):
        google_bert.installed(tmp_path, ("modeling", "run_pretraining"))
    shutil.copytree(google_bert.ORACLE_DIR / f"bert_tensorflow-{google_bert.VERSION}.dist-info",
                    tmp_path / f"bert_tensorflow-{google_bert.VERSION}.dist-info")
    files = google_bert.installed(tmp_path, ("modeling", "optimization", "run_pretraining"))
    assert files["optimization"] == tmp_path / "bert" / "optimization.py"


def test_tensorflow_is_not_importable_from_the_main_venv():
    """The oracle's TensorFlow lives in an interpreter of its own (.venv/tf). Here it would
    let bert/weights.py fall back to it for what its own bundle reader refuses, and the
    import tests would stop testing that reader alone."""
    assert importlib.util.find_spec("tensorflow") is None
