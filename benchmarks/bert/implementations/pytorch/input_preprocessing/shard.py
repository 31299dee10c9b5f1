"""shard: re-chop hdf5 parts into N shards (2048, 4320, any), fixed or variable layout.

The samples of all input files, in sorted file order, are cut into N runs of consecutive
samples whose sizes differ by at most one (shard j holds samples [j*T//N, (j+1)*T//N)),
as NVIDIA's re-chopping does; no sample is dropped, duplicated or reordered. Output shard
j is ``part_<j>_of_<N>.hdf5``. Workers take contiguous runs of output shards, so each
reads its input files in order, holding one input file in memory at a time. The inputs are
checked against their directory's md5 list (inputs.py) before anything is written, and read
through the run's reader; ``md5sums.txt`` of the output is written with it (each output's md5
recorded under ``.work/`` after its rename, so a resumed run lists it without reading it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bert.config import PREP_READ_TIMEOUT_S
from bert.reader import ShardReader
from bert.shards import DataError, Shard, list_shards, shard_size

from .common import (PrepError, parallel_map, shard_geometry, step_output, write_md5_list, write_shard_atomic,
                     write_text)
from .inputs import open_inputs, read_whole


def shard_name(j: int, n: int) -> str:
    return f"part_{j:05d}_of_{n:05d}.hdf5"


@dataclass(frozen=True)
class _Job:
    outputs: tuple[int, ...]  # output shard indices, consecutive
    inputs: tuple[Path, ...]
    starts: tuple[int, ...]  # global index of each input's first sample (+ total at the end)
    out: Path
    num_shards: int
    layout: str
    max_seq_length: int
    max_predictions: int
    reader: ShardReader


def _recorded(out: Path, name: str) -> Path:
    """Where the md5 of output ``name`` is recorded, after its rename (a file without one, made
    by a run killed in between, is made again)."""
    return out / ".work" / f"{name}.md5"


def _samples(job: _Job, lo: int, hi: int, cache: dict) -> Shard:
    """Global samples [lo, hi) across the input files."""
    pieces = []
    starts = np.asarray(job.starts)
    i = int(np.searchsorted(starts, lo, side="right")) - 1
    while lo < hi:
        if cache.get("index") != i:  # read each input once per job (outputs are consecutive)
            cache.update(index=i, shard=read_whole(job.reader, job.inputs[i]))
        first, stop = job.starts[i], min(hi, job.starts[i + 1])
        pieces.append(cache["shard"].subset(np.arange(lo - first, stop - first)))
        lo, i = stop, i + 1
    return Shard.concat(pieces)


def _write_run(job: _Job) -> tuple[int, dict[str, str]]:
    """(outputs written now, {output name: md5} of every output of the run)."""
    total, written, cache, sums = job.starts[-1], 0, {}, {}
    for j in job.outputs:
        name = shard_name(j, job.num_shards)
        target, record = job.out / name, _recorded(job.out, name)
        if target.is_file() and record.is_file():
            sums[name] = record.read_text(encoding="utf-8").strip()
            continue
        data = _samples(job, j * total // job.num_shards, (j + 1) * total // job.num_shards, cache)
        try:
            sums[name] = write_shard_atomic(target, data, job.layout, job.max_seq_length, job.max_predictions)
        except ValueError as e:
            raise PrepError(f"{target}: {e}; pass larger --max-seq-length/--max-predictions") from None
        write_text(record, sums[name] + "\n")
        written += 1
    return written, sums


def shard(input_dir: str | Path, output_dir: str | Path, num_shards: int, layout: str = "variable",
          max_seq_length: int = 512, max_predictions: int = 76, workers: int = 1, *,
          read_timeout_s: float = PREP_READ_TIMEOUT_S) -> dict:
    """Re-chop every shard of ``input_dir`` into ``num_shards`` shards under ``output_dir``."""
    try:
        paths = list_shards(input_dir)
    except DataError as e:
        raise PrepError(str(e)) from None
    # The output's lengths are checked as it is written (a fixed row holds max_seq_length): the
    # inputs are read with their structure and values checked, no length bound of their own.
    inputs = open_inputs(Path(input_dir), paths, every_listed=True, max_seq_length=None, timeout_s=read_timeout_s,
                         fingerprint=True, workers=workers)
    try:
        sizes = [shard_size(p) for p in paths]
    except DataError as e:
        raise PrepError(str(e)) from None
    if layout not in ("fixed", "variable"):
        raise PrepError(f"layout must be 'fixed' or 'variable', got {layout!r}")
    total = sum(sizes)
    if not 1 <= num_shards <= total:
        raise PrepError(f"{input_dir}: cannot cut {total} samples into {num_shards} non-empty shards")
    if layout == "fixed":
        for p in paths[:1]:
            lay, s, pp = shard_geometry(p)
            if lay == "fixed" and (s > max_seq_length or pp > max_predictions):
                raise PrepError(f"{p}: padded to {s} tokens / {pp} predictions, more than the fixed output's "
                                f"{max_seq_length} / {max_predictions}")
    params = {"num_shards": num_shards, "layout": layout, "max_seq_length": max_seq_length,
              "max_predictions": max_predictions, "inputs": inputs.fingerprint}
    with step_output(output_dir, "shard", params) as out:
        starts = tuple(int(x) for x in np.concatenate([[0], np.cumsum(sizes)]))
        runs = [r for r in np.array_split(np.arange(num_shards), max(1, min(workers, num_shards))) if len(r)]
        jobs = [_Job(tuple(int(j) for j in r), tuple(paths), starts, out, num_shards, layout, max_seq_length,
                     max_predictions, inputs.reader) for r in runs]
        done = parallel_map(_write_run, jobs, workers, "shard")
        write_md5_list(out, {name: h for _, sums in done for name, h in sums.items()})
    return {"inputs": len(paths), "samples": total, "shards": num_shards, "written_now": sum(n for n, _ in done),
            "samples_per_shard": [total // num_shards, -(-total // num_shards)],
            "inputs_verified_against": inputs.verified_by()}
