"""Synthetic BERT pretraining data that a tiny model can learn in a minute or two on a CPU.

Usage::

    python -m bert.demo_data --output DIR --train-samples 20000 --eval-samples 2000 \\
        --seed 1 --seq-len 128 --max-pred 20 --vocab 128 [--layout fixed|variable] [--shards 8]

writes ``DIR/train/part_0000k_of_0000n.hdf5`` (the training shards) and
``DIR/eval/eval_00000.hdf5`` (the eval set) in NVIDIA's MLPerf hdf5 layout, fixed-length
(padded, with ``input_mask``) or variable-length (vlen rows), plus ``DIR/demo_data.json``
with the parameters and the reference accuracies below. Point ``data.train_dir`` at
``DIR/train`` and ``data.eval_dir`` at ``DIR/eval``.

The language
------------
Token ids 0..4 are special, as in BERT's vocab: [PAD]=0, [UNK]=1, [CLS]=2, [SEP]=3,
[MASK]=4. The content tokens 5..V-1 are connected by one fixed random permutation ``f``
that is a single cycle through all of them (so no chain falls into a short loop). A
document is a chain t_{i+1} = f(t_i) that restarts at a uniformly random token with
probability 0.1 at each step. Knowing ``f``, a token is predictable from either neighbour
unless a restart happened between them; the unigram distribution is flat, so guessing the
most frequent token is right about 1/(V-5) of the time. Because ``f`` is one cycle, it acts
on the tokens as a rotation, which a small model can represent with a linear map of
well-chosen embeddings: the task is learnable, not just memorizable.

Samples
-------
Each sample is ``[CLS] A [SEP] B [SEP]`` with real length drawn from the MLPerf Wikipedia
length histogram (``data/wikipedia_seqlen_histogram_512.txt``) scaled to ``--seq-len``
(so about a quarter of samples fill the sequence, and about half the padded tokens are
padding, as in the real data). A takes a uniform 1..n-1 of the n content tokens. With
probability 0.5 B continues A's chain (next-sentence label 0 = IsNext, as in the
reference) and otherwise starts a fresh random chain (label 1).

Masking follows create_pretraining_data: min(P, max(1, round(0.15 n))) of the n content
positions per sample, chosen uniformly, stored in ascending order; of those 80% become
[MASK], 10% a random content token and 10% stay unchanged; labels are the original tokens.

Reference accuracies (printed, stored in ``demo_data.json``, returned by ``generate``)
-------------------------------------------------------------------------------------
``oracle``: a predictor that knows ``f`` and, for each masked position, walks to the
nearest token on each side within the same segment that is not itself a prediction, and
maps it through ``f`` (from the left) or ``f^-1`` (from the right) as many times as the
distance; if the two disagree it trusts the nearer side (left on ties). It ignores the
A/B link through [SEP], so it is a lower bound on the Bayes accuracy: about 0.85-0.9 with
the 0.1 restart rate. ``unigram``: always answer the most frequent training label;
about 1/(V-5). The MLPerf-like target 0.72 sits between the two.

Both are measured for the shipped demo sizes in BENCHMARKS.md ("The demo data"); generation
is vectorized with numpy.

How fast a model learns it
--------------------------
A tiny BERT first learns to copy the unchanged 10% (accuracy ~0.1), then, once attention
finds the neighbours, climbs steeply to the target; the vocabulary sets how long that takes
(BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bert.lengths import length_distribution
from bert.shards import SHARD_SUFFIXES, DataError, Shard, write_shard

PAD, UNK, CLS, SEP, MASK = 0, 1, 2, 3, 4
FIRST_CONTENT = 5
RESTART_PROB = 0.1
MASKED_LM_PROB = 0.15
@dataclass(frozen=True)
class Language:
    """The permutation ``f`` as one cycle: ``f(order[k]) = order[k+1 mod n]``."""

    vocab_size: int
    order: np.ndarray  # content token at each cycle position
    cycle_pos: np.ndarray  # [vocab_size] cycle position of each token (-1 for specials)

    @property
    def num_content(self) -> int:
        return self.vocab_size - FIRST_CONTENT

    def step(self, tokens: np.ndarray, k: np.ndarray | int) -> np.ndarray:
        """f^k(tokens); negative k walks f^-1."""
        return self.order[(self.cycle_pos[tokens] + k) % self.num_content]


def make_language(vocab_size: int, rng: np.random.Generator) -> Language:
    order = rng.permutation(np.arange(FIRST_CONTENT, vocab_size))
    cycle_pos = np.full(vocab_size, -1, dtype=np.int64)
    cycle_pos[order] = np.arange(len(order))
    return Language(vocab_size, order, cycle_pos)


def _segment_starts(lengths: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)


def make_samples(num: int, lang: Language, seq_len: int, max_pred: int,
                 length_dist: tuple[np.ndarray, np.ndarray], rng: np.random.Generator) -> Shard:
    """``num`` samples of the language above, in ragged form."""
    lengths = rng.choice(length_dist[0], size=num, p=length_dist[1])
    n = lengths - 3  # content tokens per sample
    a_len = rng.integers(1, n)  # in [1, n-1]
    nsp = (rng.random(num) < 0.5).astype(np.int8)  # 1 = B is a random chain

    # Content stream: A then B of every sample, back to back, one chain with restarts.
    total = int(n.sum())
    c_start = _segment_starts(n)
    restart = rng.random(total) < RESTART_PROB
    restart[c_start] = True  # every A starts a new document
    b_first = c_start + a_len
    restart[b_first[nsp == 1]] = True  # NotNext: B starts elsewhere
    run = np.cumsum(restart) - 1
    run_start = np.nonzero(restart)[0]
    first_token = rng.integers(FIRST_CONTENT, lang.vocab_size, size=len(run_start))
    content = lang.step(first_token[run], np.arange(total) - run_start[run])

    # Lay the content out as [CLS] A [SEP] B [SEP].
    full_start = _segment_starts(lengths)
    sample_of = np.repeat(np.arange(num), n)
    j = np.arange(total) - c_start[sample_of]  # index within the sample's content
    in_b = j >= a_len[sample_of]
    dest = full_start[sample_of] + 1 + j + in_b  # B shifts by the middle [SEP]
    tokens = np.empty(int(lengths.sum()), dtype=np.int64)
    tokens[dest] = content
    tokens[full_start] = CLS
    tokens[full_start + 1 + a_len] = SEP
    tokens[full_start + lengths - 1] = SEP
    segments = np.zeros_like(tokens)
    segments[dest[in_b]] = 1
    segments[full_start + lengths - 1] = 1

    # Choose the predictions: rank the content positions of each sample by a random key.
    n_pred = np.minimum(max_pred, np.maximum(1, np.round(MASKED_LM_PROB * n).astype(np.int64)))
    by_key = np.lexsort((rng.random(total), sample_of))
    rank_in_sample = np.empty(total, dtype=np.int64)
    rank_in_sample[by_key] = np.arange(total) - c_start[sample_of[by_key]]
    chosen = np.nonzero(rank_in_sample < n_pred[sample_of])[0]  # ascending = sample, position order
    where = dest[chosen]
    labels = tokens[where].copy()
    action = rng.random(len(where))
    tokens[where[action < 0.8]] = MASK
    swap = where[(action >= 0.8) & (action < 0.9)]
    tokens[swap] = rng.integers(FIRST_CONTENT, lang.vocab_size, size=len(swap))

    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    mlm_offsets = np.concatenate([[0], np.cumsum(n_pred)]).astype(np.int64)
    positions = where - full_start[sample_of[chosen]]
    return Shard("", tokens.astype(np.int16), segments.astype(np.int8), offsets,
                 positions.astype(np.int16), labels.astype(np.int16), mlm_offsets, nsp)


def oracle_predictions(shard: Shard, lang: Language, fallback: int) -> np.ndarray:
    """What a predictor that knows ``f`` answers at each masked position (see module doc)."""
    tokens = shard.tokens.astype(np.int64)
    t = len(tokens)
    row_of = np.repeat(np.arange(len(shard)), np.diff(shard.mlm_offsets))
    where = shard.offsets[row_of] + shard.mlm_positions.astype(np.int64)  # flat index of each prediction
    idx = np.arange(t)
    special = tokens < FIRST_CONTENT
    special[where] = True  # a prediction is never evidence (it may hold [MASK] or a random token)
    is_boundary = tokens < FIRST_CONTENT
    is_boundary[where] = False
    is_boundary[shard.offsets[:-1]] = True  # [CLS] of each sample; keeps walks inside a sample

    usable = ~special
    left = np.maximum.accumulate(np.where(usable, idx, -1))
    left_wall = np.maximum.accumulate(np.where(is_boundary, idx, -1))
    right = np.minimum.accumulate(np.where(usable, idx, t)[::-1])[::-1]
    right_wall = np.minimum.accumulate(np.where(is_boundary, idx, t)[::-1])[::-1]
    lft, rgt = left[where], right[where]
    has_l = lft > left_wall[where]
    has_r = rgt < right_wall[where]
    from_l = lang.step(tokens[np.where(has_l, lft, 0)].clip(FIRST_CONTENT), where - lft)
    from_r = lang.step(tokens[np.where(has_r, rgt, 0)].clip(FIRST_CONTENT), -(rgt - where))
    use_l = has_l & (~has_r | (where - lft <= rgt - where))
    pred = np.where(use_l, from_l, np.where(has_r, from_r, fallback))
    # With no usable neighbour, a content token in the input is the original 1 time in 2.
    seen = tokens[where]
    return np.where(~has_l & ~has_r & (seen >= FIRST_CONTENT), seen, pred)


def generate(output: str | Path, *, train_samples: int, eval_samples: int, seed: int, seq_len: int,
             max_pred: int, vocab: int, layout: str = "variable", shards: int = 8) -> dict:
    """Write the dataset; returns its parameters, paths and reference accuracies."""
    if not 8 <= seq_len <= 512:
        raise ValueError(f"seq_len must be in [8, 512], got {seq_len}")
    if not 1 <= max_pred <= seq_len:
        raise ValueError(f"max_pred must be in [1, seq_len], got {max_pred}")
    if not FIRST_CONTENT + 2 <= vocab <= 32767:  # int16 token ids on disk
        raise ValueError(f"vocab must be in [{FIRST_CONTENT + 2}, 32767], got {vocab}")
    if train_samples < 1 or eval_samples < 1 or shards < 1 or seed < 0:
        raise ValueError("train_samples, eval_samples and shards must be positive, seed >= 0")
    if layout not in ("fixed", "variable"):
        raise ValueError(f"layout must be 'fixed' or 'variable', got {layout!r}")
    out = Path(output)
    train_dir, eval_dir = out / "train", out / "eval"
    shards = min(shards, train_samples)
    names = [train_dir / f"part_{i:05d}_of_{shards:05d}.hdf5" for i in range(shards)]
    eval_path = eval_dir / "eval_00000.hdf5"
    for d, keep in ((train_dir, set(names)), (eval_dir, {eval_path})):
        stale = [p for p in d.glob("*") if p.suffix in SHARD_SUFFIXES and p not in keep] if d.is_dir() else []
        if stale:  # a reader would mix them in; deleting a user's files is not ours to do
            raise DataError(f"{d}: already holds other shards ({stale[0].name}, ...); use an empty --output")
    train_dir.mkdir(parents=True, exist_ok=True)
    eval_dir.mkdir(parents=True, exist_ok=True)

    lang = make_language(vocab, np.random.default_rng([seed, 0]))
    dist = length_distribution(seq_len)
    train = make_samples(train_samples, lang, seq_len, max_pred, dist, np.random.default_rng([seed, 1]))
    evals = make_samples(eval_samples, lang, seq_len, max_pred, dist, np.random.default_rng([seed, 2]))

    for path, rows in zip(names, np.array_split(np.arange(train_samples), shards)):
        write_shard(path, train.subset(rows), layout, seq_len, max_pred)
    write_shard(eval_path, evals, layout, seq_len, max_pred)

    most_frequent = int(np.bincount(train.mlm_ids.astype(np.int64)).argmax())
    labels = evals.mlm_ids.astype(np.int64)
    stats = {
        "train_dir": str(train_dir), "eval_dir": str(eval_dir), "layout": layout,
        "train_samples": train_samples, "eval_samples": eval_samples, "train_shards": shards,
        "seed": seed, "seq_len": seq_len, "max_pred": max_pred, "vocab": vocab,
        "restart_prob": RESTART_PROB, "mean_length": float(train.lengths.mean()),
        "oracle_accuracy": float((oracle_predictions(evals, lang, most_frequent) == labels).mean()),
        "unigram_accuracy": float((labels == most_frequent).mean()),
    }
    (out / "demo_data.json").write_text(json.dumps(stats, indent=2) + "\n")
    return stats


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bert.demo_data", description=__doc__.split("\n")[0])
    p.add_argument("--output", required=True, help="directory to write train/ and eval/ into")
    p.add_argument("--train-samples", type=int, default=20000)
    p.add_argument("--eval-samples", type=int, default=2000)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--max-pred", type=int, default=20)
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--layout", choices=("fixed", "variable"), default="variable")
    p.add_argument("--shards", type=int, default=8, help="number of training shard files")
    a = p.parse_args(argv)
    stats = generate(a.output, train_samples=a.train_samples, eval_samples=a.eval_samples, seed=a.seed,
                     seq_len=a.seq_len, max_pred=a.max_pred, vocab=a.vocab, layout=a.layout, shards=a.shards)
    print(f"wrote {stats['train_samples']} training samples in {stats['train_shards']} shards to "
          f"{stats['train_dir']} and {stats['eval_samples']} eval samples to {stats['eval_dir']} "
          f"({stats['layout']}-length, mean length {stats['mean_length']:.1f} of {stats['seq_len']})")
    print(f"masked-LM accuracy on the eval set: oracle {stats['oracle_accuracy']:.4f}, "
          f"unigram {stats['unigram_accuracy']:.4f}")
    return stats


if __name__ == "__main__":
    main()
