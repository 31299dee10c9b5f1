"""Helpers of test_data_road.py (and of the unit tier's road tests): the tiny data as each road
reads it, faults planted in it, and run_and_time.sh runs that say what they left running."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Callable

import pytest

from bert.shards import read_shard, write_shard
from checkpoint_helpers import _run_and_time_env, tiny_data  # noqa: F401 - fixture: tiny_data
from conftest import PKG, hold_env

# The sampling modes by the loader and directory each takes, as overrides of checkpoint_helpers' TINY.
ROADS = {
    "shards": ("train", []),  # the closed division: random shard order over the plain directory
    "strata": ("strata", ["run.division=open", "sampler.mode=stratified", "sampler.deal=snake",
                          "sampler.group_size=2"]),  # the paper's recipe over the strata directory
    "index": ("train", ["run.division=open", "sampler.deal=snake", "sampler.group_size=2"]),  # a length index read at start
    "strata_closed": ("strata", []),  # the closed division given the strata directory
}
STRATA_BOUNDS = (32, 64)  # the tiny data (seq 64): 106 and 54 samples, counts 5 and 3 of a batch of 8


@pytest.fixture(scope="module")
def road_data(tiny_data, tmp_path_factory) -> Path:  # noqa: F811
    """tiny_data with its strata beside it: train/, strata/ (stratify's, from train/), eval/."""
    from input_preprocessing.stratify import stratify

    root = tmp_path_factory.mktemp("road_data")
    for name in ("train", "eval"):
        (root / name).symlink_to(tiny_data / name)
    stratify(tiny_data / "train", root / "strata", bounds=STRATA_BOUNDS, max_seq_length=64)
    return root


def copy_road(data: Path, road: str, dest: Path, change: Callable | None = None, md5: bool = False) -> Path:
    """The training directory ``road`` reads, copied to ``dest`` with its shards rewritten by
    ``change(shard)`` (same lengths: a strata directory's index stays true) and an md5 list
    made after that when ``md5``; without ``md5``, no md5 list (stratify writes one with its
    strata: the copy leaves it behind); returns the copy."""
    import shutil

    from input_preprocessing.checksum import checksum

    shutil.copytree(data / ROADS[road][0], dest,
                    ignore=shutil.ignore_patterns(".work", ".run.json", *(() if md5 else ("md5sums.txt",))))
    if change is not None:
        for f in sorted(dest.rglob("*.hdf5")):
            shard = read_shard(f)
            change(shard)
            write_shard(f, shard, "variable")
    if md5:
        checksum(dest)
    return dest


def road_env(data: Path, road: str, train_dir: Path, out: Path, path: str, *extra: str,
             hold: tuple[str, ...] = ()) -> dict[str, str]:
    """run_and_time.sh's environment for ``road`` over ``train_dir`` (checkpoint_helpers' tiny
    run: 2 ranks under torchrun, a checkpoint every 2 steps)."""
    env = _run_and_time_env(data, out, path, *ROADS[road][1], f"data.train_dir={train_dir}", *extra)
    env.update(hold_env(out, *hold))
    return env


def in_session(sid: int) -> list[int]:
    """Processes of session ``sid`` still alive (not zombies), from /proc."""
    left = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] not in ("Z", "X"):
            left.append(int(stat.parent.name))
    return left


def run_and_time(env: dict[str, str], timeout: float = 150, during: Callable | None = None) -> tuple[int, str, list[int]]:
    """./run_and_time.sh in a session of its own: (exit status, output, processes of that
    session still running a second after it ended). ``during(proc)``: called once it runs."""
    Path(env["LOGDIR"]).mkdir(parents=True, exist_ok=True)
    with open(Path(env["LOGDIR"]) / "run_and_time.out", "w+") as out:
        proc = subprocess.Popen(["./run_and_time.sh"], cwd=PKG, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            if during is not None:
                during(proc)
            rc = proc.wait(timeout=timeout)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
        time.sleep(1)
        left = in_session(proc.pid)
        for pid in left:  # leave nothing behind, whatever the test says of it
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        out.seek(0)
        return rc, out.read(), left
