"""Split shards by real sample length into strata, for the stratified sampler.

Output (format ``mlperf-bert-strata/1``)::

    OUT/stratum_<k>_<lo>-<hi>/part_<i>.hdf5   samples of input shard i with lo <= length <= hi,
                                              in their input order, in the input's layout
    OUT/manifest.json                         strata bounds, samples and tokens, shard lists
    OUT/length_index.npz                      {shard path relative to OUT: uint16 lengths}
    OUT/md5sums.txt                           the md5 of every stratum file (``checksum``'s format)

A stratum file is written only when shard i has samples in that stratum. Each input shard
is one unit of work (its files plus a small record under ``.work/`` with their lengths and
md5s), so an interrupted run resumes at the first unfinished shard; the index and the md5 list
are written last, then the manifest, whose presence means the directory is complete and
verifies. The inputs are checked against their directory's md5 list (inputs.py) before
anything is written, and read through the run's reader.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bert.config import PREP_READ_TIMEOUT_S
from bert.integrity import md5_file
from bert.reader import ShardReader
from bert.shards import DataError, list_shards

from .common import (PrepError, parallel_map, save_npz, shard_geometry, step_output, write_json, write_md5_list,
                     write_shard_atomic)
from .inputs import open_inputs, read_whole

FORMAT = "mlperf-bert-strata/1"
DEFAULT_BOUNDS = (128, 256, 384, 512)  # the paper's four strata: 1-128, 129-256, 257-384, 385-512
MANIFEST = "manifest.json"
LENGTH_INDEX = "length_index.npz"
MD5S = ".md5"  # the key of a work record's {stratum file: md5} (JSON); the others are stratum files


def strata_ranges(bounds: list[int] | tuple[int, ...]) -> list[tuple[int, int]]:
    """[(lo, hi)] inclusive, from increasing upper bounds: (128, 512) -> [(1, 128), (129, 512)]."""
    if not bounds or any(b <= 0 for b in bounds) or list(bounds) != sorted(set(bounds)):
        raise PrepError(f"strata bounds must be strictly increasing positive upper bounds, got {list(bounds)}")
    los = [1] + [b + 1 for b in bounds[:-1]]
    return list(zip(los, bounds))


def stratum_name(k: int, lo: int, hi: int) -> str:
    return f"stratum_{k}_{lo}-{hi}"


@dataclass(frozen=True)
class _Job:
    index: int
    path: Path
    out: Path
    ranges: tuple[tuple[int, int], ...]
    max_seq_length: int
    reader: ShardReader  # for this input alone


def _work_record(out: Path, index: int) -> Path:
    return out / ".work" / f"part_{index:05d}.npz"


def _split_one(job: _Job) -> Path:
    rec = _work_record(job.out, job.index)
    if rec.is_file():  # done by an earlier, interrupted run
        return rec
    layout, s, p = shard_geometry(job.path)
    shard = read_whole(job.reader, job.path)
    lengths = shard.lengths
    if len(lengths) and lengths.max() > job.ranges[-1][1]:
        raise PrepError(f"{job.path}: a sample has {int(lengths.max())} tokens, above the last stratum "
                        f"bound {job.ranges[-1][1]}")
    if layout == "variable":  # vlen files do not record P; any value >= the longest row fits
        p = int(np.diff(shard.mlm_offsets).max(initial=0))
    found: dict[str, np.ndarray] = {}
    md5s: dict[str, str] = {}
    for k, (lo, hi) in enumerate(job.ranges):
        rows = np.nonzero((lengths >= lo) & (lengths <= hi))[0]
        if len(rows) == 0:
            continue
        rel = f"{stratum_name(k, lo, hi)}/part_{job.index:05d}.hdf5"
        md5s[rel] = write_shard_atomic(job.out / rel, shard.subset(rows), layout, s or job.max_seq_length, p)
        found[rel] = lengths[rows].astype(np.uint16)
    return save_npz(rec, {**found, MD5S: np.array(json.dumps(md5s))})


def stratify(input_dir: str | Path, output_dir: str | Path, bounds: list[int] | tuple[int, ...] = DEFAULT_BOUNDS,
             max_seq_length: int = 512, workers: int = 1, *, read_timeout_s: float = PREP_READ_TIMEOUT_S) -> dict:
    """Split every shard of ``input_dir`` into strata under ``output_dir``; returns the manifest."""
    try:
        paths = list_shards(input_dir)
    except DataError as e:
        raise PrepError(str(e)) from None
    ranges = strata_ranges(list(bounds))
    if ranges[-1][1] < max_seq_length:
        raise PrepError(f"the last stratum bound {ranges[-1][1]} is below max_seq_length {max_seq_length}: "
                        "longer samples would belong to no stratum")
    inputs = open_inputs(Path(input_dir), paths, every_listed=True, max_seq_length=max_seq_length,
                         timeout_s=read_timeout_s, fingerprint=True, workers=workers)
    params = {"bounds": [hi for _, hi in ranges], "max_seq_length": max_seq_length, "inputs": inputs.fingerprint,
              "format": FORMAT}
    with step_output(output_dir, "stratify", params) as out:
        jobs = [_Job(i, p, out, tuple(ranges), max_seq_length, inputs.reader.only([p])) for i, p in enumerate(paths)]
        records = parallel_map(_split_one, jobs, workers, "stratify")
        manifest = _finish(out, records, ranges, max_seq_length)
    return manifest


def _finish(out: Path, records: list[Path], ranges: list[tuple[int, int]], max_seq_length: int) -> dict:
    """The length index, the md5 list and, last, the manifest, from the work records."""
    index: dict[str, np.ndarray] = {}
    md5s: dict[str, str] = {}
    for rec in records:  # in input order: the index and shard lists do not depend on workers
        with np.load(rec) as z:
            index.update({k: z[k] for k in z.files if k != MD5S})
            # a record of a stratify that kept no md5s: its files hashed now
            md5s.update(json.loads(str(z[MD5S])) if MD5S in z.files else
                        {k: md5_file(out / k) for k in z.files})
    strata = []
    for k, (lo, hi) in enumerate(ranges):
        name = stratum_name(k, lo, hi)
        shards = [rel for rel in index if rel.startswith(name + "/")]
        strata.append({"name": name, "min_len": lo, "max_len": hi,
                       "samples": int(sum(len(index[r]) for r in shards)),
                       "tokens": int(sum(int(index[r].sum(dtype=np.int64)) for r in shards)),
                       "shards": shards})
    manifest = {"format": FORMAT, "max_seq_length": max_seq_length, "strata": strata,
                "total_samples": sum(s["samples"] for s in strata),
                "total_tokens": sum(s["tokens"] for s in strata), "length_index": LENGTH_INDEX}
    save_npz(out / LENGTH_INDEX, index)
    write_md5_list(out, md5s)
    write_json(out / MANIFEST, manifest)  # last: its presence means the directory is complete
    return manifest


def load_manifest(directory: str | Path) -> tuple[dict, dict[str, np.ndarray]]:
    """(manifest, length index) of a stratified directory, checked against each other."""
    d = Path(directory)
    path = d / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise PrepError(f"{path}: no manifest; is {d} the output of a finished 'stratify'?") from None
    except ValueError as e:
        raise PrepError(f"{path}: not valid JSON: {e}") from None
    if manifest.get("format") != FORMAT:
        raise PrepError(f"{path}: format {manifest.get('format')!r}, expected {FORMAT!r}")
    with np.load(d / manifest["length_index"]) as z:
        index = {k: z[k] for k in z.files}
    for s in manifest["strata"]:
        missing = [r for r in s["shards"] if r not in index]
        if missing:
            raise PrepError(f"{path}: stratum {s['name']} lists {missing[0]}, absent from the length index")
    return manifest, index
