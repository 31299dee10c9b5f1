"""Split shards by real sample length into strata, for the stratified sampler.

Output (format ``mlperf-bert-strata/1``)::

    OUT/stratum_<k>_<lo>-<hi>/part_<i>.hdf5   samples of input shard i with lo <= length <= hi,
                                              in their input order, in the input's layout
    OUT/manifest.json                         strata bounds, samples and tokens, shard lists
    OUT/length_index.npz                      {shard path relative to OUT: uint16 lengths}

A stratum file is written only when shard i has samples in that stratum. Each input shard
is one unit of work (its files plus a small record under ``.work/``), so an interrupted run
resumes at the first unfinished shard; the manifest and index are written last.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bert.shards import DataError, list_shards, read_shard

from .common import (PrepError, file_fingerprint, parallel_map, prepare_output, save_npz, shard_geometry,
                     write_json, write_shard_atomic)

FORMAT = "mlperf-bert-strata/1"
DEFAULT_BOUNDS = (128, 256, 384, 512)  # the paper's four strata: 1-128, 129-256, 257-384, 385-512
MANIFEST = "manifest.json"
LENGTH_INDEX = "length_index.npz"


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


def _work_record(out: Path, index: int) -> Path:
    return out / ".work" / f"part_{index:05d}.npz"


def _split_one(job: _Job) -> Path:
    rec = _work_record(job.out, job.index)
    if rec.is_file():  # done by an earlier, interrupted run
        return rec
    layout, s, p = shard_geometry(job.path)
    try:
        shard = read_shard(job.path, job.max_seq_length)
    except DataError as e:
        raise PrepError(str(e)) from None
    lengths = shard.lengths
    if len(lengths) and lengths.max() > job.ranges[-1][1]:
        raise PrepError(f"{job.path}: a sample has {int(lengths.max())} tokens, above the last stratum "
                        f"bound {job.ranges[-1][1]}")
    if layout == "variable":  # vlen files do not record P; any value >= the longest row fits
        p = int(np.diff(shard.mlm_offsets).max(initial=0))
    found: dict[str, np.ndarray] = {}
    for k, (lo, hi) in enumerate(job.ranges):
        rows = np.nonzero((lengths >= lo) & (lengths <= hi))[0]
        if len(rows) == 0:
            continue
        rel = f"{stratum_name(k, lo, hi)}/part_{job.index:05d}.hdf5"
        write_shard_atomic(job.out / rel, shard.subset(rows), layout, s or job.max_seq_length, p)
        found[rel] = lengths[rows].astype(np.uint16)
    return save_npz(rec, found)


def stratify(input_dir: str | Path, output_dir: str | Path, bounds: list[int] | tuple[int, ...] = DEFAULT_BOUNDS,
             max_seq_length: int = 512, workers: int = 1) -> dict:
    """Split every shard of ``input_dir`` into strata under ``output_dir``; returns the manifest."""
    try:
        paths = list_shards(input_dir)
    except DataError as e:
        raise PrepError(str(e)) from None
    ranges = strata_ranges(list(bounds))
    if ranges[-1][1] < max_seq_length:
        raise PrepError(f"the last stratum bound {ranges[-1][1]} is below max_seq_length {max_seq_length}: "
                        "longer samples would belong to no stratum")
    out = prepare_output(output_dir, "stratify", {
        "bounds": [hi for _, hi in ranges], "max_seq_length": max_seq_length,
        "inputs": file_fingerprint(paths, Path(input_dir), workers), "format": FORMAT})
    jobs = [_Job(i, p, out, tuple(ranges), max_seq_length) for i, p in enumerate(paths)]
    records = parallel_map(_split_one, jobs, workers, "stratify")

    index: dict[str, np.ndarray] = {}
    for rec in records:  # in input order: the index and shard lists do not depend on workers
        with np.load(rec) as z:
            index.update({k: z[k] for k in z.files})
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
