"""Bad input ends the run with exit status 2 and one message naming the file or key, no
traceback, and nothing half-written (no weights file, no checkpoint, no temp file)."""

from __future__ import annotations

import pytest

from bad_input_helpers import _copy_data, _lost_sector
from bert.mlperf_log import read_events
from checkpoint_helpers import checkpoints, no_partial_files, tiny_data  # noqa: F401 - fixture: tiny_data


def test_run_and_time_exits_2_for_a_shard_that_hangs_on_one_rank(tiny_data, tmp_path, no_procps_path):  # noqa: F811
    """The same under run_and_time.sh (torchrun: its agent holds the store): the script's status
    is 2, bad input, not 4 for the rank whose peer went; no RESULT line, no traceback."""
    import subprocess

    from conftest import PKG
    from checkpoint_helpers import _run_and_time_env

    train_dir, eval_dir = _copy_data(tiny_data, tmp_path / "data")
    _lost_sector(train_dir / "part_00000_of_00004.hdf5")
    out = tmp_path / "out"
    env = _run_and_time_env(tiny_data, out, no_procps_path, f"data.train_dir={train_dir}",
                            f"data.eval_dir={eval_dir}", "data.read_timeout_s=2")
    r = subprocess.run(["./run_and_time.sh"], cwd=PKG, env=env, capture_output=True, text=True, timeout=300)
    said = r.stdout + r.stderr
    assert r.returncode == 2, said[-3000:]
    assert said.count(f"{train_dir / 'part_00000_of_00004.hdf5'}: reading took longer than data.read_timeout_s=2 s") == 2
    assert "RESULT," not in said and "Traceback" not in said and "another rank died" not in said, said[-3000:]
    assert read_events(out / "result_0.txt")[-1]["metadata"]["status"] == "aborted"


@pytest.mark.parametrize("where", ["eval", "train"])
def test_a_read_that_hangs_ends_every_rank_naming_the_file(tiny_data, tmp_path, where):  # noqa: F811
    """A shard that makes HDF5 spin (a lost sector): past data.read_timeout_s the rank that
    waits for it says which file (bert/watchdog.py), and so does the other rank, whether it
    learnt it at the same point (the eval set, which both read) or only through a collective
    that failed under it (a training shard one rank reads: bad input outranks the dead peer).
    Both exit 2; the MLPerf log ends with run_stop aborted; nothing is written."""
    from checkpoint_helpers import launch, rank_output, wait_all

    train_dir, eval_dir = _copy_data(tiny_data, tmp_path / "data")
    # the eval file both ranks read; the training shard rank 1 reads first (run.seed=12345)
    bad = eval_dir / "eval_00000.hdf5" if where == "eval" else train_dir / "part_00000_of_00004.hdf5"
    _lost_sector(bad)
    out = tmp_path / "out"
    procs = launch(tiny_data, out, f"data.train_dir={train_dir}", f"data.eval_dir={eval_dir}",
                   "data.read_timeout_s=2", "dist.timeout_s=60")
    assert wait_all(procs, out) == [2, 2], rank_output(out)[-3000:]
    for r in range(2):
        said = rank_output(out, r)
        lines = [ln for ln in said.splitlines() if ln.startswith("error:")]
        # rank 0 waits in the step's collective for rank 1 (the training shard): told through the store
        first = f"error: rank {r}: " if where == "eval" or r == 1 else "error: rank 0 of 2: rank 1 stopped on bad input: "
        assert len(lines) == 1 and lines[0].startswith(f"{first}{bad}: reading took longer than "
                                                       "data.read_timeout_s=2 s: a damaged file"), said[-3000:]
        assert "Traceback" not in said and "another rank died" not in said, said[-3000:]
    events = read_events(out / "result_0.txt")
    assert events[-1]["key"] == "run_stop" and events[-1]["metadata"]["status"] == "aborted"
    assert not (out / "final.pt").exists() and not checkpoints(out) and not no_partial_files(out)
