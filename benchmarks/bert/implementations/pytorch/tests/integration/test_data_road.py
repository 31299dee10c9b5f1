"""Every fault of the data on every road, through run_and_time.sh (torchrun, 2 gloo ranks):
the closed division's shard order over a plain directory ("shards") and the paper's recipe,
stratified sampling with the snake deal over a strata directory ("strata"); where start-up
reads differently, a deal over a plain directory ("index": its length index read at start)
and the closed division given the strata directory ("strata_closed"). Each run: its exit
status, its one line per rank, no traceback, nothing left running, the MLPerf log ended; a run
that resumes ends as the uninterrupted run, bit for bit."""

from __future__ import annotations

import re
import shutil
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from bad_input_helpers import _lost_sector
from bert.mlperf_log import read_events
from bert.shards import read_shard, write_shard
from checkpoint_helpers import checkpoints, no_partial_files
from data_road_helpers import ROADS, copy_road, road_data, road_env, run_and_time, tiny_data  # noqa: F401 - fixtures

BOTH = ["shards", "strata"]


def _ended_cleanly(out, said: str, left: list[int], status: str = "aborted") -> None:
    assert "Traceback" not in said and "RESULT," not in said, said[-3000:]
    assert not left, f"still running after run_and_time.sh ended: {left}"
    assert read_events(out / "result_0.txt")[-1]["metadata"]["status"] == status
    assert not no_partial_files(out)


def _error_lines(said: str) -> dict[int, str]:
    """Each rank's one error line (``error: rank R...``), by rank; fails on a second one."""
    lines: dict[int, str] = {}
    for line in said.splitlines():
        m = re.match(r"error: rank (\d+)", line)
        if m:
            assert int(m[1]) not in lines, f"two error lines from rank {m[1]}:\n{said[-3000:]}"
            lines[int(m[1])] = line
    assert sorted(lines) == [0, 1], said[-3000:]
    return lines


# ---------------------------------------------------------------- reads that hang


@pytest.mark.parametrize("road", [*BOTH, "index"])
def test_a_read_that_hangs_ends_every_rank_naming_the_file(road_data, tmp_path, no_procps_path, road):
    """512 zero bytes where HDF5 then spins for good, in every training file: past
    data.read_timeout_s each rank names a file it waited for, exit 2 (within the watchdog's
    bound plus, for a rank told through the store, the collective's); "index" builds its
    length index from every shard at start-up, under the same bound."""
    train = copy_road(road_data, road, tmp_path / "train")
    for f in train.rglob("*.hdf5"):
        _lost_sector(f, at=3072, size=512)
    out = tmp_path / "out"
    rc, said, left = run_and_time(road_env(road_data, road, train, out, no_procps_path, "data.read_timeout_s=2",
                                           "dist.timeout_s=60"))
    assert rc == 2, said[-3000:]
    for r, line in _error_lines(said).items():
        assert re.match(rf"error: rank {r}(?: of 2: rank \d stopped on bad input)?: {train}/\S+\.hdf5: reading "
                        r"took longer than data\.read_timeout_s=2 s: a damaged file", line), line
    _ended_cleanly(out, said, left)


@pytest.mark.parametrize("road", BOTH)
def test_sigterm_while_a_read_hangs_stops_every_rank(road_data, tmp_path, no_procps_path, road):
    """SIGTERM while the ranks wait for reads that hang (a bound far away): the waits end at
    their next poll, every rank says why and exits 3, nothing left spinning; no checkpoint,
    as none can be agreed on."""
    train = copy_road(road_data, road, tmp_path / "train")
    for f in train.rglob("*.hdf5"):
        _lost_sector(f, at=3072, size=512)
    out = tmp_path / "out"

    def sigterm_once_timed(proc):
        while "STARTING TIMING RUN" not in (out / "run_and_time.out").read_text():
            assert proc.poll() is None
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)

    rc, said, left = run_and_time(road_env(road_data, road, train, out, no_procps_path, "data.read_timeout_s=200",
                                           "dist.timeout_s=250"), during=sigterm_once_timed)
    assert rc == 3, said[-3000:]
    for r in range(2):
        assert re.search(rf"^rank {r}(?: of 2: rank \d)?:? stopped by signal SIGTERM while waiting \d+ s for "
                         rf"{train}/\S+\.hdf5 \(a read not finished.*no checkpoint written", said, re.M), said[-3000:]
    assert "reading took longer" not in said and not checkpoints(out)
    _ended_cleanly(out, said, left)


# ---------------------------------------------------------------- bad samples


def _token(value):
    def change(shard):
        shard.tokens[shard.offsets[3] + 1] = value
    return change


def _position(where):
    def change(shard):
        i = shard.mlm_offsets[3]
        length = int(shard.offsets[4] - shard.offsets[3])
        shard.mlm_positions[i] = length + 2 if where == "past" else length - 1
        order = np.argsort(shard.mlm_positions[i:shard.mlm_offsets[4]], kind="stable")
        shard.mlm_positions[i:shard.mlm_offsets[4]] = shard.mlm_positions[i:shard.mlm_offsets[4]][order]
        shard.mlm_ids[i:shard.mlm_offsets[4]] = shard.mlm_ids[i:shard.mlm_offsets[4]][order]
    return change


def _clip_ids(shard):  # an eval set inside a vocabulary of 120
    shard.tokens[shard.tokens >= 120] -= 100
    shard.mlm_ids[shard.mlm_ids >= 120] -= 100


FAULTS = {  # change of every training shard, extra settings, the message (after "<file>: ")
    "id_past_vocab": (_token(200), [], r"sample 3: token id 200 >= model\.vocab_size=128: data made with another"),
    # ids 120..127 of the tiny data: rows of the embedding padded to 128, not of the vocabulary
    "id_in_padded_rows": (None, ["model.vocab_size=120"], r"sample \d+: (token id|masked_lm_id \(label\)) 12\d >= "
                                                          r"model\.vocab_size=120"),
    "masked_past_sample": (_position("past"), [], r"sample 3: masked_lm_position \d+ is outside its \d+ real tokens"),
    "masked_past_sample_padded": (_position("past"), ["model.unpad=false"],
                                  r"sample 3: masked_lm_position \d+ is outside its \d+ real tokens"),
    "masked_on_sep": (_position("sep"), [], r"sample 3: masked_lm_position \d+ is a \[SEP\]"),
    "md5": (None, [], r"md5 [0-9a-f]{32}, but \S+/md5sums\.txt says [0-9a-f]{32}: the file changed"),
}


@pytest.mark.parametrize("road", BOTH)
@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_bad_sample_ends_the_run_naming_its_file(road_data, tmp_path, no_procps_path, road, fault):
    change, extra, message = FAULTS[fault]
    train = copy_road(road_data, road, tmp_path / "train", change, md5=True)
    if fault == "md5":
        for f in train.rglob("*.hdf5"):
            data = bytearray(f.read_bytes())
            data[-100] ^= 1
            f.write_bytes(bytes(data))
    if fault == "id_in_padded_rows":  # the eval set, read first, inside the smaller vocabulary
        eval_dir = tmp_path / "eval"
        eval_dir.mkdir()
        for src in (road_data / "eval").glob("*.hdf5"):
            shard = read_shard(src)
            _clip_ids(shard)
            write_shard(eval_dir / src.name, shard, "variable")
        extra = [*extra, f"data.eval_dir={eval_dir}"]
    out = tmp_path / "out"
    rc, said, left = run_and_time(road_env(road_data, road, train, out, no_procps_path, *extra))
    assert rc == 2, said[-3000:]
    for r, line in _error_lines(said).items():
        assert re.match(rf"error: rank {r}(?: of 2: rank \d stopped on bad input)?: {train}/\S+\.hdf5: {message}",
                        line), line
    _ended_cleanly(out, said, left)
    assert not (out / "final.pt").exists()


@pytest.mark.parametrize("road", BOTH)
@pytest.mark.parametrize("md5", [True, False])
def test_shards_removed_mid_run_are_named(road_data, tmp_path, no_procps_path, road, md5):
    """Every training file removed while the ranks are held after step 2: the next read of
    one (the next epoch's, or the next step's rows) names it, exit 2, with or without an md5
    list (the hash's own open failing is named alike)."""
    train = copy_road(road_data, road, tmp_path / "train", md5=md5)
    out = tmp_path / "out"

    def remove_when_held(proc):
        held = [out / "held" / f"held_rank{r}_step2" for r in range(2)]
        while not all(h.exists() for h in held):
            assert proc.poll() is None, (out / "run_and_time.out").read_text()[-3000:]
            time.sleep(0.05)
        for f in train.rglob("*.hdf5"):
            f.unlink()
        (out / "held" / "go").touch()

    rc, said, left = run_and_time(road_env(road_data, road, train, out, no_procps_path,
                                           hold=("boundary:*:2:file=go",)), during=remove_when_held)
    assert rc == 2, said[-3000:]
    for r, line in _error_lines(said).items():
        assert re.match(rf"error: rank {r}(?: of 2: rank \d stopped on bad input)?: {train}/\S+\.hdf5: no such "
                        r"file \(removed or moved since the directory was listed\?\)", line), line
    _ended_cleanly(out, said, left)


# ---------------------------------------------------------------- the wrong kind of directory


def test_the_closed_division_given_strata_trains_under_every_guard(road_data, tmp_path, no_procps_path):
    """A closed run pointed at the strata directory (prepare_data.sh writes both) reads it by id
    with every guard: clean, it trains to its sample limit; a changed byte stops it by name."""
    train = copy_road(road_data, "strata_closed", tmp_path / "train", md5=True)
    out = tmp_path / "out"
    rc, said, left = run_and_time(road_env(road_data, "strata_closed", train, out, no_procps_path))
    assert rc == 1, said[-3000:]  # the sample limit
    assert not left and "Traceback" not in said
    bad = copy_road(road_data, "strata_closed", tmp_path / "bad", md5=True)
    for f in bad.rglob("*.hdf5"):
        data = bytearray(f.read_bytes())
        data[-100] ^= 1
        f.write_bytes(bytes(data))
    out = tmp_path / "out_bad"
    rc, said, left = run_and_time(road_env(road_data, "strata_closed", bad, out, no_procps_path))
    assert rc == 2 and re.search(rf"^error: rank 0.*: {bad}/stratum_\S+\.hdf5: md5 ", said, re.M), said[-3000:]
    _ended_cleanly(out, said, left)


@pytest.mark.parametrize("case", ["one_stratum", "plain_to_stratified"])
def test_the_wrong_kind_of_directory_is_refused_naming_the_right_one(road_data, tmp_path, no_procps_path, case):
    if case == "one_stratum":
        train, road = next((road_data / "strata").glob("stratum_0_*")), "shards"
        message = (rf"data\.train_dir={train} is one stratum of the strata directory {road_data / 'strata'}: .* "
                   rf"point data\.train_dir \(DATADIR\) at {road_data / 'strata'}$")
    else:
        train, road = road_data / "train", "strata"
        message = (rf"sampler\.mode=stratified needs length strata, but data\.train_dir={train} is a plain "
                   r"directory of shards \(no manifest\.json\): point data\.train_dir \(DATADIR\) at the strata")
    out = tmp_path / "out"
    rc, said, left = run_and_time(road_env(road_data, road, train, out, no_procps_path))
    assert rc == 2, said[-3000:]
    for r, line in _error_lines(said).items():
        assert re.match(rf"error: rank {r}: {message}", line), line
    _ended_cleanly(out, said, left)


# ---------------------------------------------------------------- what must keep working


@pytest.fixture(scope="module")
def uninterrupted(road_data, tmp_path_factory, no_procps_path) -> dict[str, Path]:
    """Each road's run without a stop: its output directory (final.pt, its checkpoints)."""
    outs = {}
    for road in BOTH:
        outs[road] = tmp_path_factory.mktemp(f"uninterrupted_{road}")
        rc, said, _ = run_and_time(road_env(road_data, road, road_data / ROADS[road][0], outs[road], no_procps_path))
        assert rc == 1, said[-3000:]
    return outs


@pytest.mark.parametrize("road", BOTH)
def test_sigterm_then_resume_ends_as_the_uninterrupted_run(road_data, uninterrupted, tmp_path, no_procps_path, road):
    out = tmp_path / "out"
    env = road_env(road_data, road, road_data / ROADS[road][0], out, no_procps_path)

    def sigterm_at_step_3(proc):
        while not re.search(r"^step +3 \|", (out / "run_and_time.out").read_text(), re.M):
            assert proc.poll() is None, (out / "run_and_time.out").read_text()[-3000:]
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)

    rc, said, left = run_and_time(env, during=sigterm_at_step_3)
    assert rc == 3 and "stopped by signal" in said and not left, said[-3000:]
    rc, said, left = run_and_time(env)
    assert rc == 1 and "resumed from" in said and not left, said[-3000:]
    got = torch.load(out / "final.pt", weights_only=True)
    want = torch.load(uninterrupted[road] / "final.pt", weights_only=True)
    assert all(torch.equal(got[k], v) for k, v in want.items()), f"{road}: weights differ"


def _resumable(done: Path, out: Path) -> Path:
    """``done``'s checkpoints copied to ``out``, as if that run had been stopped after them."""
    shutil.copytree(done / "checkpoints", out / "checkpoints")
    (out / "checkpoints" / "finished.json").unlink()
    return out / "checkpoints"


@pytest.mark.parametrize("case", ["restratified", "strata_for_shards", "four_ranks"])
def test_a_resume_on_other_data_or_ranks_is_refused_naming_it(road_data, uninterrupted, tmp_path, no_procps_path,
                                                               case):
    """A checkpoint records the identity of its data and road: the same samples restratified
    (other bounds), the strata directory given to a checkpoint of the shard order, or twice
    the ranks with the local batch kept (twice the global batch), are refused on every rank,
    exit 2, naming what differs (and the splits that would keep the global batch); the
    checkpoints stay."""
    out = tmp_path / "out"
    if case == "restratified":
        from input_preprocessing.stratify import stratify

        other = tmp_path / "strata_16"
        stratify(road_data / "train", other, bounds=(16, 64), max_seq_length=64)
        ckpts = _resumable(uninterrupted["strata"], out)
        env = road_env(road_data, "strata", other, out, no_procps_path)
        message = (r"a resume continues the checkpointed run, but its training stream was drawn otherwise: .*strata "
                   r"bounds \[\[1, 32\], \[33, 64\]\] there, \[\[1, 16\], \[17, 64\]\] here")
    elif case == "strata_for_shards":
        ckpts = _resumable(uninterrupted["shards"], out)
        env = road_env(road_data, "shards", road_data / "strata", out, no_procps_path)
        message = r"drawn otherwise: policy shard_order there, ids here; directory plain there, strata here"
    else:
        ckpts = _resumable(uninterrupted["shards"], out)
        env = road_env(road_data, "shards", road_data / "train", out, no_procps_path)
        env["DGXNGPU"] = "4"
        message = (r"written with global batch 16 \(2 ranks\), this run has 32 \(4 ranks\); a resume keeps the global "
                   r"batch .*on 4 ranks: run.local_batch_size=4 with run.grad_accum_steps=1")
    before = sorted(p.name for p in ckpts.iterdir())
    rc, said, left = run_and_time(env)
    assert rc == 2, said[-3000:]
    lines = [ln for ln in said.splitlines() if ln.startswith("error: rank")]
    assert len(lines) == (4 if case == "four_ranks" else 2) and all(re.search(message, ln) for ln in lines), said[-3000:]
    assert "damaged" not in said and "Traceback" not in said and not left, said[-3000:]
    assert sorted(p.name for p in ckpts.iterdir()) == before


@pytest.mark.parametrize("road", BOTH)
def test_a_shard_copied_over_another_is_refused_naming_both(road_data, tmp_path, no_procps_path, road):
    """part_00001 replaced by a copy of part_00000, the md5 list made after the copy (the
    strata made from that): every rank refuses before its first step, exit 2, naming both."""
    from input_preprocessing.checksum import checksum
    from input_preprocessing.stratify import stratify

    plain = tmp_path / "train"
    shutil.copytree(road_data / "train", plain)
    shutil.copy(plain / "part_00000_of_00004.hdf5", plain / "part_00001_of_00004.hdf5")
    train = plain
    if road == "strata":
        train = tmp_path / "strata"
        stratify(plain, train, bounds=(32, 64), max_seq_length=64)
    checksum(train)
    out = tmp_path / "out"
    rc, said, left = run_and_time(road_env(road_data, road, train, out, no_procps_path))
    assert rc == 2, said[-3000:]
    for r, line in _error_lines(said).items():
        assert re.match(rf"error: rank {r}: data\.train_dir={train}: (stratum_0_1-32/)?part_0000?0\S* and "
                        rf"(stratum_0_1-32/)?part_0000?1\S* are the same file \(md5 [0-9a-f]{{32}} in {train}/md5sums"
                        r"\.txt\): one shard copied over another", line), line
    _ended_cleanly(out, said, left)
    assert not re.search(r"^step +\d+ \|", said, re.M)  # refused before any step


def test_the_data_road_benchmark_runs_and_writes_its_ratios(tmp_path):
    """bench/data_road.py end to end, tiny: one repetition against this same checkout (the
    loader alone on both roads, two demo runs through run_and_time.sh), every ratio printed
    and in its JSON; --copies times the check on the directories and a listed set."""
    import json
    import subprocess
    import sys

    from bert import demo_data
    from conftest import PKG
    from input_preprocessing.checksum import checksum
    from input_preprocessing.stratify import stratify

    demo_data.generate(tmp_path / "d", train_samples=600, eval_samples=50, seed=1, seq_len=128, max_pred=20,
                       vocab=128, shards=4)
    stratify(tmp_path / "d" / "train", tmp_path / "d" / "strata", bounds=(32, 64, 96, 128), max_seq_length=128)
    for kind in ("train", "strata"):
        checksum(tmp_path / "d" / kind)
    out = tmp_path / "road.json"
    r = subprocess.run([sys.executable, "bench/data_road.py", "--data", str(tmp_path / "d"), "--old", str(PKG),
                        "--reps", "1", "--batches", "5", "--samples", "128", "--out", str(out)],
                       cwd=PKG, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    ratios = json.loads(out.read_text())["ratios"]
    assert set(ratios) == {"loader_strata.samples_per_s", "loader_closed.samples_per_s", "steps.samples_per_s",
                           "loader_strata.cpu_us_per_sample", "loader_closed.cpu_us_per_sample", "steps.cpu_s"}
    assert all(len(v["new_over_old"]) == 1 and v["median"] > 0 for v in ratios.values())
    assert r.stdout.count("new/old:") == 6
    r = subprocess.run([sys.executable, "bench/data_road.py", "--copies", "--data", str(tmp_path / "d"), "--shards",
                        "40", "--out", str(out)], cwd=PKG, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    got = json.loads(out.read_text())["copies"]
    assert got["listed_40_strata_index"]["index_shards"] == 160 and got["demo_strata"]["listed"] == \
        len(list((tmp_path / "d" / "strata").rglob("*.hdf5")))
