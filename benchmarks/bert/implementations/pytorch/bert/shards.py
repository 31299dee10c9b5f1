"""The MLPerf BERT shard format: NVIDIA-layout hdf5 files <-> ragged in-memory shards.

Torch-free, so that the data-preparation steps (``python -m input_preprocessing``) and the
tools that only read or write shards start without importing torch (seconds per process;
bert/loader.py turns these shards into batches of tensors).

Two on-disk layouts are read, detected per file from the shape of ``input_ids``:

fixed-length (2-D ``input_ids``)
    ``input_ids`` [N,S], ``input_mask`` [N,S] (a prefix of ones), ``segment_ids`` [N,S],
    ``masked_lm_positions`` [N,P], ``masked_lm_ids`` [N,P], ``next_sentence_labels`` [N].
variable-length (1-D vlen ``input_ids``)
    the same names without ``input_mask``; every per-token and per-prediction dataset holds
    one vlen row per sample, already cut to its real length (as NVIDIA's
    ``convert_fixed2variable`` / ``chop_hdf5_files`` write them).

Prediction slots whose ``masked_lm_positions`` is 0 are padding (position 0 is always
[CLS], which is never a prediction); they are dropped in both layouts, so everything past
the reader sees real predictions only.

In memory a shard is ragged (CSR): one flat array of real tokens plus row offsets. That
keeps variable-length data free of padding until ``bert.batches.collate`` decides the batch
layout.

One decoder, two modes, one set of rules (``_rules``): ``read_shard``/``read_rows`` raise at
the first rule a sample breaks (what a run refuses: what breaks training or what the model
cannot take), ``scan_shard`` counts every defect of every sample and keeps the first offender
of each in the same words (what ``python -m input_preprocessing check`` reports), adding the
rules of the reference's example structure that a run does not refuse. The defects
(``DEFECTS``; a sample may have several):

empty_sample        no real tokens (fixed: an all-zero ``input_mask``; variable: an empty row)
too_long            more real tokens than ``max_seq_length``
mask_not_prefix     fixed layout: ``input_mask`` is not a prefix of ones
mask_outside        a masked position outside the sample's real tokens
id_out_of_vocab     an input or label id < 0 or >= the vocab size (``Bounds``)
bad_segments        segment ids outside the model's segment types, a segment row of another
                    length than its token row; collected only: segment ids that go back from
                    1 to 0, or (``Specials``) a sample that is not [CLS] A [SEP] B [SEP]
bad_nsp_label       a next-sentence label other than 0 or 1
mask_on_sep         a masked position on the [SEP] that ends sentence A or the sample (told by
                    the segment ids)
no_predictions      collected only: a sample without a masked position (the reference always
                    makes one)
mask_duplicate      collected only: the same position predicted twice in one sample
pad_inside          collected only, ``Specials``: the padding id among a sample's real tokens
                    (masked positions aside: the reference's random replacement may put any id
                    there)
mask_on_special     collected only, ``Specials``: a prediction whose label is [CLS] or [SEP]
unreadable          the file cannot be read as a shard (its structure, or HDF5 itself)
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import h5py
import numpy as np

# Matching the glob MLPerf users keep their shards under; ``.hdf`` is what NVIDIA's
# re-chopping script names its output.
SHARD_SUFFIXES = (".hdf5", ".h5", ".hdf")

FIXED_DATASETS = ("input_ids", "input_mask", "segment_ids", "masked_lm_positions",
                  "masked_lm_ids", "next_sentence_labels")
VARIABLE_DATASETS = ("input_ids", "segment_ids", "masked_lm_positions", "masked_lm_ids",
                     "next_sentence_labels")


class DataError(ValueError):
    """A shard, or the directory that should hold shards, is malformed; names the path."""


DEFECTS = ("empty_sample", "too_long", "pad_inside", "mask_not_prefix", "mask_outside", "mask_on_sep",
           "mask_on_special", "mask_duplicate", "no_predictions", "id_out_of_vocab", "bad_segments", "bad_nsp_label",
           "unreadable")


@dataclass(frozen=True)
class Bounds:
    """What the model can take (from model.*): every id and label of a shard is checked
    against it as the shard is read, one vectorised compare per array. The keys name the
    limits in messages (a run's config keys; ``check``'s vocab)."""

    vocab_size: int
    type_vocab_size: int = 2
    vocab_key: str = "model.vocab_size"
    type_vocab_key: str = "model.type_vocab_size"


@dataclass(frozen=True)
class Specials:
    """The vocab's [CLS], [SEP] and [PAD] ids: what the rules of the reference's example
    structure need. ``check`` knows them from its vocab; a run does not, and trains on a sample
    that breaks only those rules."""

    cls: int
    sep: int
    pad: int = 0


class Sample(NamedTuple):
    """One sample, real tokens only (views into its shard's arrays)."""

    input_ids: np.ndarray  # [L] token ids
    segment_ids: np.ndarray  # [L] 0 for sentence A (and [CLS]), 1 for sentence B
    masked_positions: np.ndarray  # [M] positions in 1..L-1 of the real predictions
    masked_ids: np.ndarray  # [M] original token ids there
    nsp_label: int  # 0 = B follows A (IsNext), 1 = random B


# ---------------------------------------------------------------- ragged in-memory shard


def row_offsets(lengths: np.ndarray) -> np.ndarray:
    out = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=out[1:])
    return out


def _gather_rows(flat: np.ndarray, offsets: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows ``rows`` of a CSR array, as a new (flat, offsets); one vectorized gather."""
    lengths = offsets[rows + 1] - offsets[rows]
    new_offsets = row_offsets(lengths)
    # index of every output element in ``flat``: its row's source start + its rank in the row
    src = np.repeat(offsets[rows] - new_offsets[:-1], lengths) + np.arange(new_offsets[-1])
    return flat[src], new_offsets


@dataclass
class Shard:
    """The samples of one file (or a subset/concatenation), in ragged form.

    ``tokens``/``segments`` hold every sample's real tokens back to back, sample i at
    ``offsets[i]:offsets[i+1]``; ``mlm_positions``/``mlm_ids`` likewise with ``mlm_offsets``.
    """

    path: str
    tokens: np.ndarray
    segments: np.ndarray
    offsets: np.ndarray  # int64 [N+1]
    mlm_positions: np.ndarray
    mlm_ids: np.ndarray
    mlm_offsets: np.ndarray  # int64 [N+1]
    nsp: np.ndarray  # [N]

    def __len__(self) -> int:
        return len(self.nsp)

    @property
    def lengths(self) -> np.ndarray:
        """Real length (tokens incl. [CLS]/[SEP]) of every sample, int64 [N]."""
        return np.diff(self.offsets)

    def __getitem__(self, i: int) -> Sample:
        a, b = self.offsets[i], self.offsets[i + 1]
        p, q = self.mlm_offsets[i], self.mlm_offsets[i + 1]
        return Sample(self.tokens[a:b], self.segments[a:b], self.mlm_positions[p:q],
                      self.mlm_ids[p:q], int(self.nsp[i]))

    def subset(self, rows: np.ndarray | Sequence[int]) -> Shard:
        rows = np.asarray(rows, dtype=np.int64)
        tokens, offsets = _gather_rows(self.tokens, self.offsets, rows)
        segments, _ = _gather_rows(self.segments, self.offsets, rows)
        mlm_positions, mlm_offsets = _gather_rows(self.mlm_positions, self.mlm_offsets, rows)
        mlm_ids, _ = _gather_rows(self.mlm_ids, self.mlm_offsets, rows)
        return Shard(self.path, tokens, segments, offsets, mlm_positions, mlm_ids, mlm_offsets,
                     self.nsp[rows])

    @staticmethod
    def concat(shards: Sequence[Shard], path: str = "") -> Shard:
        if not shards:
            raise ValueError("Shard.concat: no shards")

        def offs(name: str) -> np.ndarray:
            parts = [np.diff(getattr(s, name)) for s in shards]
            return row_offsets(np.concatenate(parts))

        cat = lambda name: np.concatenate([getattr(s, name) for s in shards])  # noqa: E731
        return Shard(path or shards[0].path, cat("tokens"), cat("segments"), offs("offsets"),
                     cat("mlm_positions"), cat("mlm_ids"), offs("mlm_offsets"), cat("nsp"))

    @staticmethod
    def from_samples(samples: Sequence[Sample], path: str = "") -> Shard:
        """Build from per-sample arrays (tests, small tools); dtypes follow the file layout."""
        lens = np.array([len(s.input_ids) for s in samples], dtype=np.int64)
        mlens = np.array([len(s.masked_positions) for s in samples], dtype=np.int64)

        def cat(field: str, dtype: Any) -> np.ndarray:
            parts = [np.asarray(getattr(s, field), dtype=dtype) for s in samples]
            return np.concatenate(parts) if parts else np.zeros(0, dtype)

        return Shard(path, cat("input_ids", np.int16), cat("segment_ids", np.int8), row_offsets(lens),
                     cat("masked_positions", np.int16), cat("masked_ids", np.int16), row_offsets(mlens),
                     np.array([s.nsp_label for s in samples], dtype=np.int8))


@dataclass
class Findings:
    """What ``scan_shard`` found in one shard."""

    path: str
    shard: Shard | None  # the samples as stored, defects and all (None: unreadable)
    counts: dict[str, int]  # defect -> samples with it, for the defects found
    first: dict[str, str]  # defect -> its first offender, in the words a strict read raises (path included)


def example_records(tokens: np.ndarray, segments: np.ndarray, offsets: np.ndarray, positions: np.ndarray,
                    labels: np.ndarray, poffsets: np.ndarray, nsp: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every example as one record of little-endian int32, back to back: its length L, its L
    token ids, its L segment ids, its number P of predictions, their P positions (padding slots
    left out), their P label ids, its next-sentence label. Returns (the records, the int64
    offset of each record and of the end): the same bytes for the fixed and the variable layout."""
    n = len(nsp)
    lengths, preds = np.diff(offsets), np.diff(poffsets)
    start = np.zeros(n + 1, np.int64)
    np.cumsum(3 + 2 * lengths + 2 * preds, out=start[1:])
    out = np.empty(int(start[-1]), "<i4")
    head = start[:-1]
    out[head] = lengths
    tok = np.repeat(head + 1, lengths) + (np.arange(len(tokens)) - np.repeat(offsets[:-1], lengths))
    out[tok] = tokens
    out[tok + np.repeat(lengths, lengths)] = segments
    mid = head + 1 + 2 * lengths
    out[mid] = preds
    pred = np.repeat(mid + 1, preds) + (np.arange(len(positions)) - np.repeat(poffsets[:-1], preds))
    out[pred] = positions
    out[pred + np.repeat(preds, preds)] = labels
    out[mid + 1 + 2 * preds] = nsp
    return out, start


def examples_md5(shard: Shard) -> str:
    """md5 of ``shard``'s examples (``example_records``): the same for either file layout, so
    that what a shard holds is named by content, not by its file's bytes (``check``'s
    examples_md5, and the samples a checkpoint proves on resume)."""
    records, _ = example_records(shard.tokens, shard.segments, shard.offsets, shard.mlm_positions, shard.mlm_ids,
                                 shard.mlm_offsets, shard.nsp)
    return records_md5(records)


def records_md5(records: np.ndarray) -> str:
    """md5 of ``example_records``' records (``examples_md5`` when they are a whole shard's)."""
    return hashlib.md5(memoryview(records).cast("B")).hexdigest()


# ---------------------------------------------------------------- reading and writing files


def list_shards(directory: str | Path) -> list[Path]:
    """Sorted shard files (*.hdf5, *.h5, *.hdf) directly inside ``directory``."""
    d = Path(directory)
    if not str(directory):
        raise DataError("no data directory given (empty path)")
    if not d.exists():
        raise DataError(f"{d}: no such directory")
    if not d.is_dir():
        raise DataError(f"{d}: is not a directory")
    paths = sorted(p for p in d.iterdir() if p.suffix in SHARD_SUFFIXES and p.is_file())
    if not paths:
        raise DataError(f"{d}: holds no shard files ({', '.join('*' + s for s in SHARD_SUFFIXES)})")
    return paths


def _open(path: str | Path) -> h5py.File:
    try:
        return h5py.File(path, "r")
    except FileNotFoundError:
        raise DataError(f"{path}: no such file (removed or moved since the directory was listed?)") from None
    except (OSError, RuntimeError, ValueError) as e:
        raise DataError(f"{path}: cannot open as hdf5: {e}") from None


def _detect_layout(path: Any, ds: Any, present: set[str]) -> str:
    """'fixed' or 'variable' from ``ds``, the file's 'input_ids' (None: ``present``, the
    file's names, has none)."""
    if ds is None:
        raise DataError(f"{path}: missing dataset 'input_ids' (has: {sorted(present)})")
    if not isinstance(ds, h5py.Dataset):
        raise DataError(f"{path}: 'input_ids' is a group, not a dataset")
    if ds.ndim == 2:
        return "fixed"
    if ds.ndim == 1 and h5py.check_vlen_dtype(ds.dtype) is not None:
        return "variable"
    raise DataError(f"{path}: 'input_ids' has shape {ds.shape} and dtype {ds.dtype}; expected "
                    "[N, S] integers (fixed-length) or [N] vlen integer rows (variable-length)")


def shard_size(path: str | Path) -> int:
    """Number of samples in a shard, from metadata only (no data read)."""
    with _open(path) as f:
        try:
            if "next_sentence_labels" not in f:
                raise DataError(f"{path}: missing dataset 'next_sentence_labels'")
            return int(f["next_sentence_labels"].shape[0])
        except (OSError, RuntimeError, KeyError) as e:
            raise DataError(f"{path}: cannot read (truncated or corrupt?): {e}") from None


def _check_int(path: Any, name: str, dtype: np.dtype) -> None:
    if dtype.kind not in "iu":
        raise DataError(f"{path}: dataset '{name}' has dtype {dtype}; expected an integer type")


def _take(ds: h5py.Dataset, rows: np.ndarray | None) -> np.ndarray:
    """``ds``'s rows ``rows`` (increasing, unique; None: all). h5py's point selection costs
    one hyperslab per row: rows that lie close together are read as the slab that spans
    them and picked in memory instead."""
    if rows is None:
        return ds[()]
    lo, hi = int(rows[0]), int(rows[-1]) + 1
    if hi - lo <= 4 * len(rows):
        return ds[lo:hi][rows - lo]
    return ds[rows]


@dataclass
class _Raw:
    """A shard's samples as stored, before any rule judges them, with what its layout itself can
    get wrong per sample; decoding goes on past those, so that a scan can count every defect."""

    shard: Shard
    holes: np.ndarray | None  # bool [N], fixed layout: 'input_mask' not a prefix (read: the prefix of its count)
    seg_rows: np.ndarray | None  # bool [N], variable layout: a segment row of another length (read: zeros)


def _read_fixed(path: Any, ds: dict[str, h5py.Dataset], sel: np.ndarray | None) -> _Raw:
    arr = {k: _take(d, sel) for k, d in ds.items()}
    n, s = arr["input_ids"].shape
    for k in ("input_mask", "segment_ids"):
        if arr[k].shape != (n, s):
            raise DataError(f"{path}: dataset '{k}' has shape {ds[k].shape}; "
                            f"expected {ds['input_ids'].shape} like 'input_ids'")
    pos, ids = arr["masked_lm_positions"], arr["masked_lm_ids"]
    if pos.ndim != 2 or ids.shape != pos.shape:
        raise DataError(f"{path}: 'masked_lm_positions' {ds['masked_lm_positions'].shape} and 'masked_lm_ids' "
                        f"{ds['masked_lm_ids'].shape} must both be [N, P]")
    keep = arr["input_mask"] != 0
    lengths = keep.sum(axis=1)
    prefix = np.arange(s)[None, :] < lengths[:, None]
    # A mask with holes makes "real tokens" ambiguous (a defect, judged by the rules); costs one [N,S] compare.
    holes = (keep != prefix).any(axis=1)
    real = pos != 0
    return _Raw(Shard(str(path), arr["input_ids"][prefix], arr["segment_ids"][prefix], row_offsets(lengths),
                      pos[real], ids[real], row_offsets(real.sum(axis=1)), _nsp(arr["next_sentence_labels"])),
                holes, None)


def _read_variable(path: Any, ds: dict[str, h5py.Dataset], sel: np.ndarray | None) -> _Raw:
    # one object array of 1-D arrays per dataset; one Python object per row
    rows = {k: _take(ds[k], sel) for k in VARIABLE_DATASETS[:-1]}
    nsp = _nsp(_take(ds["next_sentence_labels"], sel))
    n = len(nsp)

    def lens(k: str) -> np.ndarray:
        return np.fromiter((len(r) for r in rows[k]), dtype=np.int64, count=n)

    def flat(k: str, dtype: Any) -> np.ndarray:
        return np.concatenate(rows[k]) if n else np.zeros(0, dtype)

    lengths, plen = lens("input_ids"), lens("masked_lm_positions")
    mism = np.flatnonzero(lens("masked_lm_ids") != plen)
    if len(mism):  # no position can be paired with its label: the shard cannot be read on
        raise DataError(f"{path}: sample {_row(sel, int(mism[0]))}: 'masked_lm_ids' and 'masked_lm_positions' "
                        "rows differ in length")
    seg_lengths = lens("segment_ids")
    seg_rows = seg_lengths != lengths
    segments = flat("segment_ids", np.int8)
    if seg_rows.any():  # keep the token layout: such a row's segments read as zeros (a Python loop, defects only)
        kept = np.zeros(int(lengths.sum()), segments.dtype)
        so, to = row_offsets(seg_lengths), row_offsets(lengths)
        for i in np.flatnonzero(~seg_rows):
            kept[to[i]:to[i + 1]] = segments[so[i]:so[i + 1]]
        segments = kept
    pos, ids = flat("masked_lm_positions", np.int16), flat("masked_lm_ids", np.int16)
    # Tolerate padded prediction rows (position 0) here too, so both layouts mean the same.
    real = pos != 0
    row_of = np.repeat(np.arange(n), plen)
    return _Raw(Shard(str(path), flat("input_ids", np.int16), segments, row_offsets(lengths), pos[real], ids[real],
                      row_offsets(np.bincount(row_of[real], minlength=n)), nsp), None, seg_rows)


def _nsp(raw: np.ndarray) -> np.ndarray:
    return raw.reshape(-1) if raw.ndim == 2 else raw  # some tools write [N, 1]


def _row(sel: np.ndarray | None, i: int) -> int:
    """The file row of the ``i``-th sample read (messages name rows of the file)."""
    return int(sel[i]) if sel is not None else int(i)


# ---------------------------------------------------------------- the rules, strict or collected

SAMPLE, TOKEN, PREDICTION = "sample", "token", "prediction"  # what a rule's flags are per


class _Judge:
    """One decoded shard under the rules: the per-token and per-prediction indices a rule needs,
    each made once and only when a rule asks (a strict read that passes makes few)."""

    def __init__(self, raw: _Raw, sel: np.ndarray | None, max_seq_length: int | None, bounds: Bounds | None,
                 specials: Specials | None):
        self.raw, self.shard, self.sel = raw, raw.shard, sel
        self.max_seq_length, self.bounds, self.specials = max_seq_length, bounds, specials
        self.n = len(raw.shard)

    @cached_property
    def lengths(self) -> np.ndarray:
        return self.shard.lengths

    @cached_property
    def token_row(self) -> np.ndarray:
        """The sample of every token (int64: 8 bytes a token)."""
        return np.repeat(np.arange(self.n), self.lengths)

    @cached_property
    def pred_row(self) -> np.ndarray:
        """The sample of every prediction."""
        return np.repeat(np.arange(self.n), np.diff(self.shard.mlm_offsets))

    @cached_property
    def inside(self) -> np.ndarray:
        """Predictions whose position lies inside their sample's real tokens."""
        pos = self.shard.mlm_positions
        return (pos >= 0) & (pos < self.lengths[self.pred_row])

    @cached_property
    def at(self) -> np.ndarray:
        """The flat token index of every prediction (0 for one outside its sample)."""
        return np.where(self.inside, self.shard.offsets[self.pred_row] + self.shard.mlm_positions, 0)

    @cached_property
    def masked(self) -> np.ndarray:
        """Tokens at a masked position: the reference's random replacement may put any id there."""
        out = np.zeros(len(self.shard.tokens), bool)
        out[self.at[self.inside]] = True
        return out

    def sample(self, level: str, j: int) -> int:
        """The sample (index in this read) of element ``j`` of a rule's flags."""
        if level == SAMPLE:
            return j
        offsets = self.shard.offsets if level == TOKEN else self.shard.mlm_offsets
        return int(np.searchsorted(offsets, j, side="right") - 1)

    def samples(self, level: str, bad: np.ndarray) -> np.ndarray:
        """The samples (indices in this read) that ``bad``'s elements belong to."""
        if level == SAMPLE:
            return np.flatnonzero(bad)
        return (self.token_row if level == TOKEN else self.pred_row)[bad]

    def row(self, level: str, j: int) -> int:
        return _row(self.sel, self.sample(level, j))


Rule = tuple[str, str, np.ndarray, Callable[[int, int], str]]  # (defect, level, flags, message of element j at row r)


def _rules(jd: _Judge, strict: bool) -> Iterator[Rule]:
    """Every rule a shard's samples must meet, in the order a strict read applies them (the
    first that fails is the one it raises). ``strict``: the rules a run refuses (what breaks
    training, or the model cannot take); else those too, then the reference's example
    structure, which ``check`` counts and a run trains on. Each rule's flags are computed only
    when the one before has passed (strict) or been counted."""
    s, L = jd.shard, jd.lengths
    if jd.raw.holes is not None:
        yield ("mask_not_prefix", SAMPLE, jd.raw.holes,
               lambda j, r: f"'input_mask' of sample {r} is not a prefix of ones")
    if jd.raw.seg_rows is not None:
        yield ("bad_segments", SAMPLE, jd.raw.seg_rows,
               lambda j, r: f"sample {r}: 'segment_ids' and 'input_ids' rows differ in length")
    yield "empty_sample", SAMPLE, L < 1, lambda j, r: f"sample {r} has no tokens"
    m = jd.max_seq_length
    if m is not None:
        yield "too_long", SAMPLE, L > m, lambda j, r: (
            f"sample {r} has {int(L[j])} tokens > max_seq_length {m}: data made for longer sequences; set "
            f"data.max_seq_length and model.max_position_embeddings to at least {int(L.max())} (EXTRA_PARAMS), or "
            "point DATADIR/EVALDIR at data of this length")
    yield ("id_out_of_vocab", TOKEN, s.tokens < 0,
           lambda j, r: f"sample {r}: negative token id {int(s.tokens[j])} (int16 overflow?)")
    pos = s.mlm_positions
    yield "mask_outside", PREDICTION, ~jd.inside, lambda j, r: (
        f"sample {r}: masked_lm_position {int(pos[j])} is outside its {int(L[jd.pred_row[j]])} real tokens")
    b = jd.bounds
    if b is not None:
        # Ids and labels inside what the model has rows for: out of range, an embedding lookup or
        # the loss would index past its table (a traceback naming no file), or, below the padded
        # vocabulary, silently train the padding rows.
        fix = f"data made with another vocabulary? ({b.vocab_key}, the vocab of input_preprocessing)"
        for defect, name, values, level, limit, key in (
                ("id_out_of_vocab", "token id", s.tokens, TOKEN, b.vocab_size, b.vocab_key),
                ("id_out_of_vocab", "masked_lm_id (label)", s.mlm_ids, PREDICTION, b.vocab_size, b.vocab_key),
                ("bad_segments", "segment id", s.segments, TOKEN, b.type_vocab_size, b.type_vocab_key)):
            yield defect, level, values >= limit, (
                lambda j, r, name=name, values=values, limit=limit, key=key:
                f"sample {r}: {name} {int(values[j])} >= {key}={limit}: {fix}")
            if name != "token id":  # negative token ids: the rule above
                yield defect, level, values < 0, (
                    lambda j, r, name=name, values=values:
                    f"sample {r}: negative {name} {int(values[j])} (int16 overflow?)")
        nsp = s.nsp
        yield ("bad_nsp_label", SAMPLE, (nsp < 0) | (nsp > 1),
               lambda j, r: f"sample {r}: next_sentence_label {int(nsp[j])} is neither 0 nor 1")
        # Predictions only where create_pretraining_data puts them: never on the [SEP] that ends
        # sentence A or the sample (position 0, [CLS], is a padding slot the decoder drops),
        # whose label the loss would otherwise teach. Told by the segment ids, not the vocab.
        at, last, seg = jd.at, s.offsets[jd.pred_row + 1] - 1, s.segments
        on_sep = (jd.inside & ((at == last) | ((seg[at] == 0) & (seg[np.minimum(at + 1, last)] != 0))) if len(seg)
                  else np.zeros(len(pos), bool))
        yield "mask_on_sep", PREDICTION, on_sep, lambda j, r: (
            f"sample {r}: masked_lm_position {int(pos[j])} is a [SEP] (the end of sentence A or of the sample), where "
            "create_pretraining_data never predicts: not the reference's examples (python -m input_preprocessing "
            "check --input DIR)")
    if strict:
        return
    yield ("no_predictions", SAMPLE, np.diff(s.mlm_offsets) == 0,
           lambda j, r: f"sample {r} has no masked position (the reference makes at least one)")
    key = jd.pred_row * (max(int(L.max(initial=0)), int(pos.max(initial=0))) + 1) + pos.astype(np.int64)
    order = np.argsort(key, kind="stable")
    dup = np.zeros(len(key), bool)
    dup[order[1:]] = key[order[1:]] == key[order[:-1]]
    yield ("mask_duplicate", PREDICTION, dup,
           lambda j, r: f"sample {r}: masked_lm_position {int(pos[j])} is predicted twice")
    row, seg = jd.token_row, s.segments
    back = np.zeros(len(seg), bool)
    back[1:] = (seg[1:] < seg[:-1]) & (row[1:] == row[:-1])
    yield "bad_segments", TOKEN, back, lambda j, r: (
        f"sample {r}: segment ids go back from {int(seg[j - 1])} to {int(seg[j])} at position "
        f"{j - int(s.offsets[row[j]])}")
    sp = jd.specials
    if sp is None:
        return
    t = s.tokens
    yield "pad_inside", TOKEN, (t == sp.pad) & ~jd.masked, lambda j, r: (
        f"sample {r}: the padding id {sp.pad} at position {j - int(s.offsets[row[j]])}, among its real tokens")
    lab = s.mlm_ids
    yield "mask_on_special", PREDICTION, (lab == sp.cls) | (lab == sp.sep), lambda j, r: (
        f"sample {r}: masked_lm_position {int(pos[j])} has the label {int(lab[j])}, the id of [CLS] or [SEP]")
    yield "bad_segments", SAMPLE, _not_two_sentences(jd, sp), lambda j, r: (
        f"sample {r} is not [CLS] A [SEP] B [SEP] with segment ids 0 for [CLS] A [SEP] and 1 for B [SEP] "
        f"([CLS] id {sp.cls}, [SEP] id {sp.sep})")


def _not_two_sentences(jd: _Judge, sp: Specials) -> np.ndarray:
    """Samples that are not [CLS] A [SEP] B [SEP]: [CLS] first, [SEP] last, exactly two [SEP]s
    (masked positions aside), the first [SEP] the last token of segment A."""
    s, n, row = jd.shard, jd.n, jd.token_row
    t, seg, start, lengths = s.tokens, s.segments, s.offsets[:-1], jd.lengths
    nonempty = lengths > 0
    bad = np.zeros(n, bool)
    if len(t):
        first, last = np.where(nonempty, start, 0), np.where(nonempty, s.offsets[1:] - 1, 0)
        bad |= nonempty & ((t[first] != sp.cls) | (t[last] != sp.sep))
    is_sep = (t == sp.sep) & ~jd.masked
    bad |= nonempty & (np.bincount(row[is_sep], minlength=n) != 2)
    seg_a_len = np.bincount(row[seg == 0], minlength=n)  # [CLS] A [SEP] are segment 0
    first_sep = np.full(n, -1)
    local = np.arange(len(t)) - np.repeat(start, lengths)
    sep_rows, sep_local = row[is_sep], local[is_sep]
    first_sep[sep_rows[::-1]] = sep_local[::-1]  # the earliest [SEP] of each row wins
    return bad | (nonempty & (first_sep != seg_a_len - 1))


def _strict(jd: _Judge) -> Shard:
    for _, level, bad, what in _rules(jd, strict=True):
        if bad.any():
            j = int(np.argmax(bad))
            raise DataError(f"{jd.shard.path}: {what(j, jd.row(level, j))}")
    return jd.shard


def _collect(jd: _Judge) -> Findings:
    flags: dict[str, np.ndarray] = {}
    first: dict[str, str] = {}
    for defect, level, bad, what in _rules(jd, strict=False):
        if not bad.any():
            continue
        flags.setdefault(defect, np.zeros(jd.n, bool))[jd.samples(level, bad)] = True
        if defect not in first:
            j = int(np.argmax(bad))
            first[defect] = f"{jd.shard.path}: {what(j, jd.row(level, j))}"
    return Findings(jd.shard.path, jd.shard, {d: int(f.sum()) for d, f in flags.items()}, first)


def _structure_and_rows(path: str | Path, f: h5py.File, rows: np.ndarray | None) -> _Raw:
    # The file's names listed once and each dataset looked up once: h5py's lookups and
    # properties cost ~10 us each, the bulk of a read of a few rows (BENCHMARKS.md section 15).
    present = set(f.keys())
    ids = f["input_ids"] if "input_ids" in present else None
    layout = _detect_layout(path, ids, present)
    names = FIXED_DATASETS if layout == "fixed" else VARIABLE_DATASETS
    missing = [k for k in names if k not in present]
    if missing:
        raise DataError(f"{path}: missing dataset(s) {missing} for a {layout}-length shard "
                        f"(has: {sorted(present)})")
    ds = {k: ids if k == "input_ids" else f[k] for k in names}
    n = ids.shape[0]  # _detect_layout: [N, S] or [N]
    for k, d in ds.items():
        if not isinstance(d, h5py.Dataset):
            raise DataError(f"{path}: '{k}' is a group, not a dataset")
        shape, dtype = d.shape, d.dtype
        base = h5py.check_vlen_dtype(dtype) if layout == "variable" else None
        if layout == "variable" and k != "next_sentence_labels" and (len(shape) != 1 or base is None):
            raise DataError(f"{path}: dataset '{k}' has shape {shape} and dtype {dtype}; "
                            "expected [N] vlen rows in a variable-length shard")
        _check_int(path, k, np.dtype(base) if base is not None else dtype)
        if not shape or shape[0] != n:
            raise DataError(f"{path}: dataset '{k}' has shape {shape}; 'input_ids' has {n} rows")
        if k == "next_sentence_labels" and len(shape) != 1 and shape[1:] != (1,):
            raise DataError(f"{path}: 'next_sentence_labels' has shape {shape}; expected ({n},)")
    if rows is not None and len(rows) and int(rows[-1]) >= n:
        raise DataError(f"{path}: holds {n} samples, but sample {int(rows[-1])} was asked for: the length "
                        "index does not describe these shards (a directory changed after it was made?)")
    if rows is not None and len(rows) == n:  # every row, in order (unique, increasing): the whole shard
        rows = None
    return _read_fixed(path, ds, rows) if layout == "fixed" else _read_variable(path, ds, rows)


def _decode(path: str | Path, rows: np.ndarray | None) -> _Raw:
    """The samples of rows ``rows`` (increasing, unique; None: every row) of one shard, after
    the file's structure is checked (every dataset, integer dtypes, one row per sample in each)."""
    with _open(path) as f:
        try:
            return _structure_and_rows(path, f, rows)
        except DataError:
            raise
        # A damaged file opens and fails wherever HDF5 trips: OSError mid-read, RuntimeError
        # or KeyError from a broken object header (ValueError: DataError's own base, above).
        except (OSError, RuntimeError, KeyError, ValueError) as e:
            raise DataError(f"{path}: cannot read (truncated or corrupt?): {e}") from None


def read_shard(path: str | Path, max_seq_length: int | None = None, bounds: Bounds | None = None) -> Shard:
    """Read and validate one shard (either layout); with ``bounds``, what the model can take
    too. Raises ``DataError`` naming the file (and the sample) at the first rule it breaks."""
    return _strict(_Judge(_decode(path, None), None, max_seq_length, bounds, None))


def read_rows(path: str | Path, rows: np.ndarray | Sequence[int], max_seq_length: int | None = None,
              bounds: Bounds | None = None) -> Shard:
    """Rows ``rows`` of one shard (any order, repeats allowed), as a Shard in that order,
    checked as ``read_shard`` checks a whole one; reads only the rows it needs (their
    span where they lie close). Messages name rows of the file."""
    rows = np.asarray(rows, dtype=np.int64)
    if not len(rows):
        return Shard(str(path), np.zeros(0, np.int16), np.zeros(0, np.int8), np.zeros(1, np.int64),
                     np.zeros(0, np.int16), np.zeros(0, np.int16), np.zeros(1, np.int64), np.zeros(0, np.int8))
    if int(rows.min()) < 0:
        raise DataError(f"{path}: row {int(rows.min())} asked for")
    unique, back = np.unique(rows, return_inverse=True)
    shard = _strict(_Judge(_decode(path, unique), unique, max_seq_length, bounds, None))
    return shard if len(unique) == len(rows) and np.array_equal(unique, rows) else shard.subset(back)


def read_stored(path: str | Path) -> Shard:
    """Every sample of one shard as stored: its structure checked, no rule judged (the samples
    ``scan_shard`` judges, for a second look at them)."""
    return _decode(path, None).shard


def scan_shard(path: str | Path, max_seq_length: int | None = None, bounds: Bounds | None = None,
               specials: Specials | None = None) -> Findings:
    """Every defect of every sample of one shard, where ``read_shard`` stops at the first: the
    samples with each (``DEFECTS``) and the first offender of each in the words a strict read
    raises; the rules of the reference's example structure too, and with ``specials`` those
    that need the vocab's ids. A file that cannot be read as a shard is ``unreadable``, with
    the strict read's message."""
    try:
        raw = _decode(path, None)
    except DataError as e:
        return Findings(str(path), None, {"unreadable": 1}, {"unreadable": str(e)})
    return _collect(_Judge(raw, None, max_seq_length, bounds, specials))


def write_shard(path: str | Path, shard: Shard, layout: str, max_seq_length: int = 0,
                max_predictions: int = 0) -> None:
    """Write ``shard`` in NVIDIA's fixed (padded to S, P) or variable (vlen rows) layout.

    Fixed-length needs ``max_seq_length`` and ``max_predictions``; prediction padding slots
    are position 0, id 0, as create_pretraining_data writes them.
    """
    n, lengths, plens = len(shard), shard.lengths, np.diff(shard.mlm_offsets)
    with h5py.File(path, "w") as f:
        if layout == "fixed":
            if n and (lengths.max() > max_seq_length or plens.max() > max_predictions):
                raise ValueError(f"{path}: samples exceed max_seq_length={max_seq_length} "
                                 f"or max_predictions={max_predictions}")
            mask = np.arange(max_seq_length)[None, :] < lengths[:, None]
            pmask = np.arange(max_predictions)[None, :] < plens[:, None]

            def pad(flat: np.ndarray, m: np.ndarray, dtype: Any) -> np.ndarray:
                out = np.zeros(m.shape, dtype=dtype)
                out[m] = flat
                return out

            f.create_dataset("input_ids", data=pad(shard.tokens, mask, np.int16))
            f.create_dataset("input_mask", data=mask.astype(np.int8))
            f.create_dataset("segment_ids", data=pad(shard.segments, mask, np.int8))
            f.create_dataset("masked_lm_positions", data=pad(shard.mlm_positions, pmask, np.int16))
            f.create_dataset("masked_lm_ids", data=pad(shard.mlm_ids, pmask, np.int16))
        elif layout == "variable":

            def vlen(name: str, flat: np.ndarray, offsets: np.ndarray, dtype: Any) -> None:
                rows = np.empty(n, dtype=object)
                rows[:] = np.split(flat.astype(dtype), offsets[1:-1]) if n else []
                f.create_dataset(name, shape=(n,), dtype=h5py.vlen_dtype(np.dtype(dtype)), data=rows)

            vlen("input_ids", shard.tokens, shard.offsets, np.int16)
            vlen("segment_ids", shard.segments, shard.offsets, np.int8)
            vlen("masked_lm_positions", shard.mlm_positions, shard.mlm_offsets, np.int16)
            vlen("masked_lm_ids", shard.mlm_ids, shard.mlm_offsets, np.int16)
        else:
            raise ValueError(f"layout must be 'fixed' or 'variable', got {layout!r}")
        f.create_dataset("next_sentence_labels", data=shard.nsp.astype(np.int8))
