"""Helpers of test_bad_input.py's unit and integration tests (and of other test files that import them)."""

from __future__ import annotations

import shutil
from pathlib import Path

from bert.shards import read_shard, write_shard
from checkpoint_helpers import tiny_data  # noqa: F401 - fixture


def _copy_data(tiny_data: Path, root: Path, change=None) -> tuple[Path, Path]:
    """The tiny train and eval shards copied under ``root`` (``change(shard)`` applied to each
    one's in-memory form first, when given): (train_dir, eval_dir)."""
    dirs = []
    for name in ("train", "eval"):
        d = root / name
        d.mkdir(parents=True)
        for src in sorted((tiny_data / name).glob("*.hdf5")):
            if change is None or (name, change[0]) not in (("train", "train"), ("eval", "eval")):
                shutil.copy(src, d / src.name)
            else:
                shard = read_shard(src)
                change[1](shard)
                write_shard(d / src.name, shard, "variable")
        dirs.append(d)
    return dirs[0], dirs[1]


def _lost_sector(path: Path, at: int = 4096, size: int = 4096) -> None:
    """Zeros where HDF5's structures lie: h5py's read then spins for good. The default, 4 KiB
    at 4096, does it to the tiny shards; 512 bytes at 3072 to those and to their strata."""
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(b"\0" * size)
