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
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Sequence

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


@dataclass(frozen=True)
class Bounds:
    """What the model can take (from model.*): every id and label of a shard is checked
    against it as the shard is read, one vectorised max per array."""

    vocab_size: int
    type_vocab_size: int = 2


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


def _read_fixed(path: Any, ds: dict[str, h5py.Dataset], sel: np.ndarray | None) -> Shard:
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
    # A mask with holes would make "real tokens" ambiguous; costs one [N,S] compare.
    if not np.array_equal(keep, np.arange(s)[None, :] < lengths[:, None]):
        bad = int(np.nonzero((keep != (np.arange(s)[None, :] < lengths[:, None])).any(axis=1))[0][0])
        raise DataError(f"{path}: 'input_mask' of sample {_row(sel, bad)} is not a prefix of ones")
    real = pos != 0
    return Shard(str(path), arr["input_ids"][keep], arr["segment_ids"][keep], row_offsets(lengths),
                 pos[real], ids[real], row_offsets(real.sum(axis=1)), _nsp(arr["next_sentence_labels"]))


def _read_variable(path: Any, ds: dict[str, h5py.Dataset], sel: np.ndarray | None) -> Shard:
    # one object array of 1-D arrays per dataset; one Python object per row
    rows = {k: _take(ds[k], sel) for k in VARIABLE_DATASETS[:-1]}
    nsp = _nsp(_take(ds["next_sentence_labels"], sel))
    n = len(nsp)

    def lens(k: str) -> np.ndarray:
        return np.fromiter((len(r) for r in rows[k]), dtype=np.int64, count=n)

    def flat(k: str, dtype: Any) -> np.ndarray:
        return np.concatenate(rows[k]) if n else np.zeros(0, dtype)

    lengths, plen = lens("input_ids"), lens("masked_lm_positions")
    for k, ref, what in (("segment_ids", lengths, "input_ids"), ("masked_lm_ids", plen, "masked_lm_positions")):
        mism = np.nonzero(lens(k) != ref)[0]
        if len(mism):
            raise DataError(f"{path}: sample {_row(sel, int(mism[0]))}: '{k}' and '{what}' rows differ in length")
    pos, ids = flat("masked_lm_positions", np.int16), flat("masked_lm_ids", np.int16)
    # Tolerate padded prediction rows (position 0) here too, so both layouts mean the same.
    real = pos != 0
    row_of = np.repeat(np.arange(n), plen)
    return Shard(str(path), flat("input_ids", np.int16), flat("segment_ids", np.int8), row_offsets(lengths),
                 pos[real], ids[real], row_offsets(np.bincount(row_of[real], minlength=n)), nsp)


def _nsp(raw: np.ndarray) -> np.ndarray:
    return raw.reshape(-1) if raw.ndim == 2 else raw  # some tools write [N, 1]


def _row(sel: np.ndarray | None, i: int) -> int:
    """The file row of the ``i``-th sample read (messages name rows of the file)."""
    return int(sel[i]) if sel is not None else int(i)


def _check_values(shard: Shard, max_seq_length: int | None, sel: np.ndarray | None) -> None:
    path, lengths = shard.path, shard.lengths
    if len(lengths) and lengths.min() < 1:
        raise DataError(f"{path}: sample {_row(sel, int(np.argmin(lengths)))} has no tokens")
    if max_seq_length is not None and len(lengths) and lengths.max() > max_seq_length:
        i = int(np.argmax(lengths))
        raise DataError(f"{path}: sample {_row(sel, i)} has {int(lengths[i])} tokens > max_seq_length "
                        f"{max_seq_length}: data made for longer sequences; set data.max_seq_length and "
                        f"model.max_position_embeddings to at least {int(lengths.max())} "
                        f"(EXTRA_PARAMS), or point DATADIR/EVALDIR at data of this length")
    if len(shard.tokens) and shard.tokens.min() < 0:
        raise DataError(f"{path}: negative token id {int(shard.tokens.min())} (int16 overflow?)")
    row_of = np.repeat(np.arange(len(shard)), np.diff(shard.mlm_offsets))
    out_of_range = (shard.mlm_positions < 0) | (shard.mlm_positions >= lengths[row_of])
    if out_of_range.any():
        j = int(np.argmax(out_of_range))
        raise DataError(f"{path}: sample {_row(sel, int(row_of[j]))}: masked_lm_position "
                        f"{int(shard.mlm_positions[j])} is outside its {int(lengths[row_of[j]])} real tokens")


def _sample_at(offsets: np.ndarray, flat_index: int) -> int:
    return int(np.searchsorted(offsets, flat_index, side="right") - 1)


def _check_bounds(shard: Shard, b: Bounds, sel: np.ndarray | None) -> None:
    """Ids and labels inside what the model has rows for: out of range, an embedding lookup or
    the loss would index past its table (a traceback naming no file), or, below the padded
    vocabulary, silently train the padding rows. Predictions only where create_pretraining_data
    puts them: never on the [SEP] that ends sentence A or the sample (position 0, [CLS], is
    a padding slot and dropped by the reader), whose label the loss would otherwise teach.
    One max per array, one gather per prediction; the offender found only when there is one."""
    path, fix = shard.path, "data made with another vocabulary? (model.vocab_size, the vocab of input_preprocessing)"
    for name, values, offsets, limit, key in (
            ("token id", shard.tokens, shard.offsets, b.vocab_size, "model.vocab_size"),
            ("masked_lm_id (label)", shard.mlm_ids, shard.mlm_offsets, b.vocab_size, "model.vocab_size"),
            ("segment id", shard.segments, shard.offsets, b.type_vocab_size, "model.type_vocab_size")):
        if len(values) and int(values.max()) >= limit:
            j = int(np.argmax(values >= limit))
            raise DataError(f"{path}: sample {_row(sel, _sample_at(offsets, j))}: {name} {int(values[j])} >= "
                            f"{key}={limit}: {fix}")
        if len(values) and int(values.min()) < 0:
            j = int(np.argmax(values < 0))
            raise DataError(f"{path}: sample {_row(sel, _sample_at(offsets, j))}: negative {name} {int(values[j])} "
                            "(int16 overflow?)")
    if len(shard.nsp) and (shard.nsp.min() < 0 or shard.nsp.max() > 1):
        i = int(np.argmax((shard.nsp < 0) | (shard.nsp > 1)))
        raise DataError(f"{path}: sample {_row(sel, i)}: next_sentence_label {int(shard.nsp[i])} is neither 0 nor 1")
    if not len(shard.mlm_positions):
        return
    row_of = np.repeat(np.arange(len(shard)), np.diff(shard.mlm_offsets))
    at = shard.offsets[row_of] + shard.mlm_positions  # flat index of each prediction (inside its sample)
    last = shard.offsets[row_of + 1] - 1
    # sentence A's [SEP]: the last segment-0 token before a segment-1 one
    on_sep = (at == last) | ((shard.segments[at] == 0) & (shard.segments[np.minimum(at + 1, last)] != 0))
    if on_sep.any():
        j = int(np.argmax(on_sep))
        raise DataError(f"{path}: sample {_row(sel, int(row_of[j]))}: masked_lm_position {int(shard.mlm_positions[j])} "
                        "is a [SEP] (the end of sentence A or of the sample), where create_pretraining_data never "
                        "predicts: not the reference's examples (python -m input_preprocessing check --input DIR)")


def _decode(path: str | Path, rows: np.ndarray | None, max_seq_length: int | None, bounds: Bounds | None) -> Shard:
    """The samples of rows ``rows`` (increasing, unique; None: every row) of one shard,
    checked: the file's structure (every dataset, integer dtypes, one row per sample in each),
    then the rows' values, and with ``bounds`` what the model can take."""
    with _open(path) as f:
        try:
            shard = _structure_and_rows(path, f, rows)
        except DataError:
            raise
        # A damaged file opens and fails wherever HDF5 trips: OSError mid-read, RuntimeError
        # or KeyError from a broken object header (ValueError: DataError's own base, above).
        except (OSError, RuntimeError, KeyError, ValueError) as e:
            raise DataError(f"{path}: cannot read (truncated or corrupt?): {e}") from None
    _check_values(shard, max_seq_length, rows)
    if bounds is not None:
        _check_bounds(shard, bounds, rows)
    return shard


def _structure_and_rows(path: str | Path, f: h5py.File, rows: np.ndarray | None) -> Shard:
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


def read_shard(path: str | Path, max_seq_length: int | None = None, bounds: Bounds | None = None) -> Shard:
    """Read and validate one shard (either layout); with ``bounds``, what the model can take
    too. Raises ``DataError`` naming the file (and the sample)."""
    return _decode(path, None, max_seq_length, bounds)


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
    shard = _decode(path, unique, max_seq_length, bounds)
    return shard if len(unique) == len(rows) and np.array_equal(unique, rows) else shard.subset(back)


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
