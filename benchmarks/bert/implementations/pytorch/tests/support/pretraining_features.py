"""run_pretraining.py's features (Google's BERT: fixed [B, S] rows, [B, P] prediction slots
with weights, the padding slots' weight 0) made at random, and as our samples: the batches
the TensorFlow oracle (tf_oracle.py) and our model (bert.batches.collate) are both given.
numpy only: imported by the TF interpreter's program and by the tests alike."""

from __future__ import annotations

import numpy as np

FEATURES = ("input_ids", "input_mask", "segment_ids", "masked_lm_positions", "masked_lm_ids", "masked_lm_weights",
            "next_sentence_labels")


def make_batches(n: int, vocab: int, seed: int, batch: int, seq: int, predictions: int) -> dict[str, np.ndarray]:
    """``n`` batches, each feature [n, batch, ...]: real lengths 8..seq (padding in most rows),
    [CLS]-free predictions at distinct sorted positions, about 15% of a row and at most
    ``predictions`` (fewer in short rows: padded slots of weight 0), a second segment over
    the second half, NSP labels of both kinds."""
    rng = np.random.default_rng(seed)
    out = {k: np.zeros((n, batch, predictions if k.startswith("masked") else seq), np.int32) for k in FEATURES[:6]}
    out["masked_lm_weights"] = out["masked_lm_weights"].astype(np.float32)
    out["next_sentence_labels"] = rng.integers(0, 2, (n, batch)).astype(np.int32)
    for i in range(n):
        for b in range(batch):
            length = int(rng.integers(8, seq + 1))
            out["input_ids"][i, b, :length] = rng.integers(5, vocab, length)
            out["input_mask"][i, b, :length] = 1
            out["segment_ids"][i, b, length // 2:length] = 1
            m = min(predictions, max(1, round(0.15 * length)))
            out["masked_lm_positions"][i, b, :m] = np.sort(rng.choice(np.arange(1, length), m, replace=False))
            out["masked_lm_ids"][i, b, :m] = rng.integers(5, vocab, m)
            out["masked_lm_weights"][i, b, :m] = 1.0
    return out


def samples(batch: dict[str, np.ndarray]):
    """One batch of the features ([B, ...]) as our samples (bert.shards.Sample: real tokens
    and real predictions only)."""
    from bert.shards import Sample  # main venv only

    out = []
    for b in range(batch["input_ids"].shape[0]):
        length, m = int(batch["input_mask"][b].sum()), int(batch["masked_lm_weights"][b].sum())
        out.append(Sample(batch["input_ids"][b, :length], batch["segment_ids"][b, :length],
                          batch["masked_lm_positions"][b, :m], batch["masked_lm_ids"][b, :m],
                          int(batch["next_sentence_labels"][b])))
    return out
