"""check: scan every sample of every shard for what breaks training or silently spoils it.

``bert.shards.read_shard`` stops at the first malformed sample it cannot use; this scan goes
on, counts every defect of every sample per shard, and names a known cause when the counts
carry its signature. Defects (a sample may have several):

empty_sample        no real tokens (fixed: an all-zero ``input_mask``; variable: an empty row)
too_long            more real tokens than ``--max-seq-length``
pad_inside          a padding id (0) among a sample's real tokens (masked positions aside: the
                    reference's random replacement may put any id there)
mask_not_prefix     fixed layout: ``input_mask`` is not a prefix of ones
mask_outside        a masked position outside the sample's real tokens
mask_on_special     a masked position on [CLS] or [SEP] (its label is one of them)
mask_duplicate      the same position predicted twice in one sample
no_predictions      a sample without one masked position (the reference always makes one)
id_out_of_vocab     an input or label id < 0 or >= the vocab size
bad_segments        segment ids not 0...0 1...1, rows of different length, or not
                    [CLS] A [SEP] B [SEP] (first token [CLS], exactly two [SEP], the last
                    token [SEP], the first [SEP] closing segment A)
bad_nsp_label       a next-sentence label other than 0 or 1
unreadable          the shard cannot be opened or lacks a dataset (counted once per shard)

Another vocabulary: the [CLS]/[SEP] ids (MLPerf's 101/102 unless ``--vocab`` or the id options
say otherwise) must begin and end every sample. When no sample begins with [CLS] and none
ends with [SEP], the shards were made with another vocabulary, not broken sample by sample:
the id-dependent counts (``bad_segments``, ``mask_on_special``) are then not reported, and
the check says to pass ``--vocab`` (exit 2: the scan's premise, not the data, is wrong).

Each readable shard also gets ``examples_md5``: the md5 of its examples, the same in either
layout (``examples_md5()`` says what it hashes), so that shards made elsewhere (NVIDIA's
scripts, the reference's output converted to hdf5) can be compared with ours part by part;
``--digests FILE`` writes them as ``<md5>  <shard>`` lines.

Known cause recognised: NVIDIA's ``convert_fixed2variable.py`` computes each length as
Python ``sum()`` over the int8 ``input_mask`` row; under NumPy >= 2 the sum stays int8 and
wraps modulo 256, so samples of real length 128-255 gain 256 padding tokens, 256-383 are
cut to L-256 and 512 are emptied. Its signature here: variable rows that end in exactly 256
padding ids after a [SEP] at a real length of 128-255.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

from bert.shards import SHARD_SUFFIXES

DEFECTS = ("empty_sample", "too_long", "pad_inside", "mask_not_prefix", "mask_outside", "mask_on_special",
           "mask_duplicate", "no_predictions", "id_out_of_vocab", "bad_segments", "bad_nsp_label", "unreadable")
WRAP_SIGNATURE = "wrap256_padded"  # counted beside the defects: samples carrying the int8-wrap signature
SPECIALS_IN_PLACE = "cls_or_sep_in_place"  # counted beside them: samples starting [CLS] or ending [SEP]
VOCAB_DEPENDENT = ("bad_segments", "mask_on_special")  # meaningless when the [CLS]/[SEP] ids are not the shards'
PAD_ID = 0


@dataclass(frozen=True)
class Vocabulary:
    """What the scan needs of the vocab: its size and the [CLS]/[SEP] ids."""

    size: int = 30522  # the MLPerf uncased WordPiece vocab
    cls: int = 101
    sep: int = 102

    @staticmethod
    def from_file(path: str | Path) -> Vocabulary:
        from .create import load_vocab

        v = load_vocab(path)
        return Vocabulary(v.size, v.cls, v.sep)


@dataclass
class Ragged:
    """A shard's samples as flat arrays plus row offsets (int64), exactly as stored: nothing
    dropped, so a defect cannot hide behind the reader's tolerance."""

    tokens: np.ndarray
    segments: np.ndarray
    offsets: np.ndarray  # [N+1]
    positions: np.ndarray
    labels: np.ndarray
    poffsets: np.ndarray  # [N+1]
    nsp: np.ndarray  # [N]
    seg_len_mismatch: np.ndarray  # bool [N]: segment row and token row differ in length
    mask_not_prefix: np.ndarray  # bool [N]: fixed layout only


def _offsets(lengths: np.ndarray) -> np.ndarray:
    out = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=out[1:])
    return out


def _read(path: Path) -> Ragged:
    """Raises ``OSError``/``KeyError``/``ValueError`` on a file that is not a readable shard."""
    with h5py.File(path, "r") as f:
        ids = f["input_ids"]
        nsp = np.asarray(f["next_sentence_labels"][()]).reshape(-1).astype(np.int64)
        if ids.ndim == 2:  # fixed: real tokens are where input_mask is set
            tok = ids[()].astype(np.int64)
            mask = f["input_mask"][()] != 0
            seg = f["segment_ids"][()].astype(np.int64)
            pos = f["masked_lm_positions"][()].astype(np.int64)
            lab = f["masked_lm_ids"][()].astype(np.int64)
            n, s = tok.shape
            if mask.shape != (n, s) or seg.shape != (n, s) or pos.shape != lab.shape or len(pos) != n or len(nsp) != n:
                raise ValueError("datasets of different shapes")
            lengths = mask.sum(axis=1).astype(np.int64)  # int64: no wrap at 256
            prefix = np.arange(s)[None, :] < lengths[:, None]
            real = pos != 0  # position 0 ([CLS]) marks a padding prediction slot
            return Ragged(tok[prefix], seg[prefix], _offsets(lengths), pos[real], lab[real],
                          _offsets(real.sum(axis=1)), nsp, np.zeros(n, bool), (mask != prefix).any(axis=1))
        rows = {k: f[k][()] for k in ("input_ids", "segment_ids", "masked_lm_positions", "masked_lm_ids")}
    n = len(rows["input_ids"])
    if any(len(r) != n for r in rows.values()) or len(nsp) != n:
        raise ValueError("datasets with different numbers of rows")

    def lens(k: str) -> np.ndarray:
        return np.fromiter((len(r) for r in rows[k]), dtype=np.int64, count=n)

    def flat(k: str) -> np.ndarray:
        return np.concatenate(rows[k]).astype(np.int64) if n else np.zeros(0, np.int64)

    lengths, seg_lengths, plen = lens("input_ids"), lens("segment_ids"), lens("masked_lm_positions")
    pos, lab = flat("masked_lm_positions"), flat("masked_lm_ids")
    lab_lengths = lens("masked_lm_ids")
    if not np.array_equal(lab_lengths, plen):
        raise ValueError("masked_lm_ids and masked_lm_positions rows differ in length")
    seg = flat("segment_ids")
    mismatch = seg_lengths != lengths
    if mismatch.any():  # keep the token layout; give mismatched rows zeros (flagged anyway)
        fixed_seg = np.zeros(int(lengths.sum()), np.int64)
        so, to = _offsets(seg_lengths), _offsets(lengths)
        for i in np.nonzero(~mismatch)[0]:
            fixed_seg[to[i]:to[i + 1]] = seg[so[i]:so[i + 1]]
        seg = fixed_seg
    real = pos != 0
    row_of = np.repeat(np.arange(n), plen)
    return Ragged(flat("input_ids"), seg, _offsets(lengths), pos[real], lab[real],
                  _offsets(np.bincount(row_of[real], minlength=n)), nsp, mismatch, np.zeros(n, bool))


def examples_md5(r: Ragged) -> str:
    """md5 of a shard's examples, the same for both layouts: for each example in order, as
    little-endian int32: its length L, its L token ids, its L segment ids, its number P of
    predictions, their P positions (ascending, padding slots left out), their P label ids, its
    next-sentence label."""
    n = len(r.nsp)
    lengths, preds = np.diff(r.offsets), np.diff(r.poffsets)
    start = np.zeros(n + 1, np.int64)
    np.cumsum(3 + 2 * lengths + 2 * preds, out=start[1:])
    out = np.empty(int(start[-1]), "<i4")
    head = start[:-1]
    out[head] = lengths
    tok = np.repeat(head + 1, lengths) + (np.arange(len(r.tokens)) - np.repeat(r.offsets[:-1], lengths))
    out[tok] = r.tokens
    out[tok + np.repeat(lengths, lengths)] = r.segments
    mid = head + 1 + 2 * lengths
    out[mid] = preds
    pred = np.repeat(mid + 1, preds) + (np.arange(len(r.positions)) - np.repeat(r.poffsets[:-1], preds))
    out[pred] = r.positions
    out[pred + np.repeat(preds, preds)] = r.labels
    out[mid + 1 + 2 * preds] = r.nsp
    return hashlib.md5(out.tobytes()).hexdigest()


def scan(r: Ragged, vocab: Vocabulary, max_seq_length: int) -> dict[str, int]:
    """Number of samples with each defect (vectorised over the whole shard)."""
    n = len(r.nsp)
    lengths = np.diff(r.offsets)
    row = np.repeat(np.arange(n), lengths)  # sample of every token
    start = r.offsets[:-1]
    prow = np.repeat(np.arange(n), np.diff(r.poffsets))  # sample of every prediction

    def per_sample(flags: np.ndarray, rows: np.ndarray) -> np.ndarray:
        out = np.zeros(n, bool)
        out[rows[flags]] = True
        return out

    t, s = r.tokens, r.segments
    outside = (r.positions < 0) | (r.positions >= lengths[prow])
    # A masked position's input may be any id, [PAD]/[CLS]/[SEP] included: the reference
    # replaces 10% of them by a uniformly random vocabulary id. Structure checks skip them.
    masked = np.zeros(len(t), bool)
    masked[start[prow[~outside]] + r.positions[~outside]] = True
    out = {
        "empty_sample": lengths == 0,
        "too_long": lengths > max_seq_length,
        "pad_inside": per_sample((t == PAD_ID) & ~masked, row),
        "mask_not_prefix": r.mask_not_prefix,
        "no_predictions": np.diff(r.poffsets) == 0,
        "bad_nsp_label": (r.nsp != 0) & (r.nsp != 1),
    }
    bad_id = per_sample((t < 0) | (t >= vocab.size), row) | per_sample((r.labels < 0) | (r.labels >= vocab.size), prow)
    out["id_out_of_vocab"] = bad_id
    out["mask_outside"] = per_sample(outside, prow)
    # on [CLS]/[SEP]: the label says what the position held before masking
    out["mask_on_special"] = per_sample((r.labels == vocab.cls) | (r.labels == vocab.sep), prow)
    key = prow * (max(max_seq_length, int(r.positions.max(initial=0))) + 1) + r.positions
    order = np.argsort(key, kind="stable")
    dup = np.zeros(len(key), bool)
    dup[order[1:]] = key[order[1:]] == key[order[:-1]]
    out["mask_duplicate"] = per_sample(dup, prow)
    # segments: 0/1 only, never back from 1 to 0, [CLS] first, [SEP] last, two [SEP]s,
    # the first [SEP] the last token of segment A
    local = np.arange(len(t)) - np.repeat(start, lengths)
    bad = per_sample((s != 0) & (s != 1), row)
    back = np.zeros(len(s), bool)
    back[1:] = (s[1:] < s[:-1]) & (row[1:] == row[:-1])
    bad |= per_sample(back, row)
    nonempty = lengths > 0
    first = np.where(nonempty, start, 0)
    last = np.where(nonempty, r.offsets[1:] - 1, 0)
    in_place = np.zeros(n, bool)
    if len(t):
        in_place = nonempty & ((t[first] == vocab.cls) | (t[last] == vocab.sep))
        bad |= nonempty & ((t[first] != vocab.cls) | (t[last] != vocab.sep))
    is_sep = (t == vocab.sep) & ~masked
    bad |= nonempty & (np.bincount(row[is_sep], minlength=n) != 2)
    seg_a_len = np.bincount(row[s == 0], minlength=n)  # [CLS] A [SEP] are segment 0
    first_sep = np.full(n, -1)
    sep_rows, sep_local = row[is_sep], local[is_sep]
    first_sep[sep_rows[::-1]] = sep_local[::-1]  # the earliest [SEP] of each row wins
    bad |= nonempty & (first_sep != seg_a_len - 1)
    bad |= r.seg_len_mismatch
    out["bad_segments"] = bad
    counts = {k: int(out[k].sum()) if k in out else 0 for k in DEFECTS}
    counts[WRAP_SIGNATURE] = int(_wrap_signature(t, r.offsets, vocab).sum())
    counts[SPECIALS_IN_PLACE] = int(in_place.sum())
    counts["nonempty"] = int(nonempty.sum())
    return counts


def _wrap_signature(t: np.ndarray, offsets: np.ndarray, vocab: Vocabulary) -> np.ndarray:
    """Rows of 384-511 tokens whose last 256 are padding after a [SEP]: a real length of
    128-255 that gained 256 padding tokens (the int8 wrap of sum() over input_mask)."""
    lengths = np.diff(offsets)
    cand = np.nonzero((lengths >= 384) & (lengths <= 511))[0]
    hit = np.zeros(len(lengths), bool)
    if not len(cand):
        return hit
    tail = offsets[cand + 1][:, None] - 256 + np.arange(256)[None, :]
    real_end = offsets[cand + 1] - 257
    hit[cand] = (t[tail] == PAD_ID).all(axis=1) & (t[real_end] == vocab.sep)
    return hit


def shard_paths(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.suffix in SHARD_SUFFIXES and p.is_file())


def check(input_dir: str | Path, vocab: Vocabulary = Vocabulary(), max_seq_length: int = 512,
          digests: str | Path = "") -> dict:
    """Scan every shard under ``input_dir`` (recursively); return per-shard counts and
    ``examples_md5``, the totals, the diagnosis, and ``exit_status`` 1 when anything was found
    (0 when clean). ``digests``: also write the examples' md5 of each shard there."""
    from .common import PrepError, write_text

    d = Path(input_dir)
    if not d.is_dir():
        raise PrepError(f"{d}: no such input directory")
    paths = shard_paths(d)
    if not paths:
        raise PrepError(f"{d}: holds no shard files ({', '.join('*' + s for s in SHARD_SUFFIXES)})")
    per_shard: dict[str, dict] = {}  # a shard's counts, filtered below once the totals are known
    counters = (*DEFECTS, WRAP_SIGNATURE, SPECIALS_IN_PLACE, "nonempty")
    totals = dict.fromkeys(counters, 0)
    samples = 0
    for p in paths:
        name = str(p.relative_to(d))
        try:
            r = _read(p)
        except (OSError, KeyError, ValueError) as e:
            counts = {**dict.fromkeys(counters, 0), "unreadable": 1}
            per_shard[name] = {"unreadable": 1, "error": f"{type(e).__name__}: {e}"}
        else:
            counts = scan(r, vocab, max_seq_length)
            samples += len(r.nsp)
            per_shard[name] = {"samples": len(r.nsp), "examples_md5": examples_md5(r), **counts}
        for k, v in counts.items():
            totals[k] += v
    # No sample where [CLS]/[SEP] must stand holds them: another vocabulary, not broken data.
    other_vocab = totals["nonempty"] > 0 and totals[SPECIALS_IN_PLACE] == 0
    hidden = (*VOCAB_DEPENDENT, SPECIALS_IN_PLACE, "nonempty") if other_vocab else (SPECIALS_IN_PLACE, "nonempty")
    per_shard = {name: {k: v for k, v in c.items() if (v or k == "samples") and k not in hidden}
                 for name, c in per_shard.items()}
    if digests:
        write_text(Path(digests), "".join(f"{c['examples_md5']}  {name}\n" for name, c in per_shard.items()
                                          if "examples_md5" in c))
    found = {k: v for k, v in totals.items() if v and k != WRAP_SIGNATURE and k not in hidden}
    out = {"shards": len(paths), "samples": samples, "defects": found, "per_shard": per_shard,
           "diagnosis": diagnose(totals), "exit_status": 1 if found else 0}
    if other_vocab:
        out["other_vocabulary"] = (
            f"no sample begins with [CLS] (id {vocab.cls}) or ends with [SEP] (id {vocab.sep}): the shards seem to "
            "be made with another vocabulary; pass it with --vocab vocab.txt (or --cls-id/--sep-id/--vocab-size) "
            f"to check segments and special tokens ({', '.join(VOCAB_DEPENDENT)} not counted)")
        out["exit_status"] = 2
    return out


def diagnose(totals: dict[str, int]) -> list[str]:
    """Known causes the counts point to, each with what to do."""
    out = []
    if totals.get(WRAP_SIGNATURE, 0):
        out.append(
            f"{totals[WRAP_SIGNATURE]} samples end in exactly 256 padding tokens after their last [SEP]: the "
            "signature of NVIDIA's convert_fixed2variable.py run under NumPy >= 2. It sums the int8 input_mask "
            "with Python's sum(), which wraps modulo 256: samples of real length 128-255 gain 256 padding "
            "tokens, 256-383 are cut to L-256 (empty_sample/bad_segments/mask_outside), 512 are emptied. "
            "Rebuild the variable layout with this project's tools from the fixed-layout shards (or create's "
            "output): python -m input_preprocessing shard --input FIXED_DIR --output NEW_DIR "
            "--num-shards N --layout variable, then check NEW_DIR again.")
    if totals.get("id_out_of_vocab", 0):
        out.append("ids outside the vocab: the shards were made with another vocab (pass it with --vocab) "
                   "or ids above 32767 overflowed int16")
    return out
