"""The one guarded road (bert/reader.py, bert/shards.py's decoder): rows by id are checked as
whole shards are, every sampling mode reads through the watchdog, the md5 list and the
model's bounds, and a wait for data ends on a stop."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from bert import integrity, loader, reader as reader_mod, watchdog
from bert.config import build_config
from bert.reader import ShardReader
from bert.trainer import train_plan
from bert.sampler import LengthIndex
from bert.shards import Bounds, DataError, Shard, read_rows, read_shard, write_shard
from input_preprocessing.checksum import checksum
from sampler_helpers import MODES, P, S, make_sample, read_ids, road_dirs, write_stratified


def _shard(tmp_path, layout="variable", n=12, change=None, name="a.hdf5"):
    rng = np.random.default_rng(1)
    samples = [make_sample(i, int(rng.integers(8, S + 1)), rng) for i in range(n)]
    if change is not None:
        samples = [change(i, s) for i, s in enumerate(samples)]
    path = tmp_path / name
    write_shard(path, Shard.from_samples(samples), layout, S, P)
    return path


def _token(at_row, value):
    def change(i, s):
        if i != at_row:
            return s
        ids = s.input_ids.copy()
        ids[2] = value
        return s._replace(input_ids=ids)
    return change


def _position(at_row, where):
    """The first prediction of row ``at_row`` moved onto the final [SEP], sentence A's, or past the sample."""
    def change(i, s):
        if i != at_row:
            return s
        pos = s.masked_positions.copy()
        n = len(s.input_ids)
        a = int(np.argmax(s.segment_ids != 0)) - 1
        pos[0] = {"last": n - 1, "a_sep": a, "past": n + 3}[where]
        order = np.argsort(pos)
        return s._replace(masked_positions=pos[order], masked_ids=s.masked_ids[order])
    return change


@pytest.mark.parametrize("layout", ["fixed", "variable"])
@pytest.mark.parametrize("fault, bounds, message", [
    (_token(7, 30001), Bounds(30001), r"sample 7: token id 30001 >= model\.vocab_size=30001"),
    # inside an embedding padded to a multiple of 8 (30008 rows), past the vocabulary
    (_token(7, 30005), Bounds(30001), r"sample 7: token id 30005 >= model\.vocab_size=30001"),
    (_position(7, "last"), Bounds(30522), r"sample 7: masked_lm_position \d+ is a \[SEP\]"),
    (_position(7, "a_sep"), Bounds(30522), r"sample 7: masked_lm_position \d+ is a \[SEP\]"),
    (_position(7, "past"), None, r"sample 7: masked_lm_position \d+ is outside its \d+ real tokens"),
])
def test_rows_are_checked_as_whole_shards_are(tmp_path, layout, fault, bounds, message):
    """The same check, the same message naming the file and the file's row, whether the
    shard is read whole (the closed road) or by rows (every other mode); rows not read are
    not checked (each sample is checked where it is read)."""
    path = _shard(tmp_path, layout, change=fault)
    with pytest.raises(DataError, match=message) as whole:
        read_shard(path, S, bounds)
    with pytest.raises(DataError, match=message) as rows:
        read_rows(path, [3, 7, 1], S, bounds)
    assert str(whole.value) == str(rows.value) and str(whole.value).startswith(f"{path}: ")
    assert len(read_rows(path, [3, 1, 3], S, bounds)) == 3  # other rows: fine; repeats allowed


def test_read_rows_past_the_end_names_the_file(tmp_path):
    path = _shard(tmp_path, n=5)
    with pytest.raises(DataError, match=rf"^{path}: holds 5 samples, but sample 9 was asked for"):
        read_rows(path, [1, 9])


def test_md5_list_is_checked_once_per_file_and_a_removed_file_is_named(tmp_path, monkeypatch):
    """Each file hashed the first time this process reads it (a row read then costs no
    re-hash); a changed file refused; a file removed mid-run is bad input naming it."""
    a, b = _shard(tmp_path, name="a.hdf5"), _shard(tmp_path, name="b.hdf5")
    checksum(tmp_path)
    hashed = []
    real = integrity.md5_file
    monkeypatch.setattr(integrity, "md5_file", lambda p, *k: hashed.append(p.name) or real(p, *k))
    r = ShardReader(tmp_path, max_seq_length=S, bounds=None, verify_md5=True, timeout_s=10)
    for rows in ([1], [2, 3], [4]):
        r.wait(a, lambda read: r.rows(read, a, np.array(rows)))
    r.wait(a, lambda read: r.whole(read, a))
    assert hashed == ["a.hdf5"]
    data = bytearray(b.read_bytes())
    data[-100] ^= 1
    b.write_bytes(bytes(data))
    with pytest.raises(DataError, match=rf"^{b}: md5 [0-9a-f]{{32}}, but {tmp_path / 'md5sums.txt'} says"):
        r.wait(b, lambda read: r.rows(read, b, np.array([0])))
    b.unlink()
    with pytest.raises(DataError, match=rf"^{b}: no such file"):
        r.wait(b, lambda read: r.rows(read, b, np.array([0])))
    off = ShardReader(tmp_path, max_seq_length=S, bounds=None, verify_md5=False, timeout_s=10)
    with pytest.raises(DataError, match=rf"^{b}: no such file"):
        off.wait(b, lambda read: off.whole(read, b))


def test_an_os_error_in_a_read_is_bad_input_naming_the_file():
    def fail(read):
        read.at("/d/part_1.hdf5")
        raise PermissionError(13, "Permission denied")

    r = watchdog.Read("/d", fail, timeout_s=5)
    with pytest.raises(DataError, match=r"^/d/part_1\.hdf5: cannot read: \[Errno 13\] Permission denied"):
        r.result()
    assert r.failure().startswith("/d/part_1.hdf5: cannot read")


def test_a_stop_ends_a_wait_for_a_stuck_read():
    """SIGTERM / Ctrl-C while a read hangs: the wait ends at its next poll with ``Stopped``
    naming the file, not after data.read_timeout_s, and not never."""
    release = threading.Event()
    asked = []

    def stuck(read):
        read.at("/d/part_2.hdf5")
        release.wait()

    def stopped():
        asked.append(1)
        return "stopped by signal SIGTERM" if len(asked) > 1 else None

    try:
        with pytest.raises(watchdog.Stopped, match=r"^stopped by signal SIGTERM while waiting \d+ s for "
                                                   r"/d/part_2\.hdf5 \(a read not finished"):
            watchdog.read("/d", stuck, timeout_s=30, stopped=stopped)
        assert len(asked) == 2  # one poll each: about a second, not the 30 s bound
    finally:
        release.set()


def test_the_length_index_is_read_under_the_bound(tmp_path, monkeypatch):
    """A plain directory's length index (a deal without a strata directory) reads every shard
    at start-up: under the watchdog, so a file that hangs ends the run naming it."""
    _shard(tmp_path, name="a.hdf5")
    _shard(tmp_path, name="b.hdf5")
    release = threading.Event()
    real = reader_mod.read_shard

    def hang_on_b(path, *args):
        if path.name == "b.hdf5":
            release.wait()
        return real(path, *args)

    monkeypatch.setattr(reader_mod, "read_shard", hang_on_b)
    r = ShardReader(tmp_path, max_seq_length=S, bounds=None, verify_md5=True, timeout_s=0.3)
    try:
        with pytest.raises(DataError, match=rf"^{tmp_path / 'b.hdf5'}: reading took longer than "
                                            r"data\.read_timeout_s=0\.3 s"):
            LengthIndex.from_dir(tmp_path, r)
    finally:
        release.set()


def test_an_index_made_for_other_data_is_named(tmp_path):
    root = tmp_path / "strata"
    write_stratified(root, [8, 4, 4])
    index = LengthIndex.from_manifest(root)
    index.lengths[2] += 1  # as if the shard changed after stratify
    with pytest.raises(DataError, match=r"stratum_0_1-12/part_00000\.hdf5: sample 2 has \d+ tokens, but the length "
                                        r"index of .* says \d+: the index was made for other data"):
        read_ids(index, root, [5, 2])


def _batches(train_dir, overrides, world=2, rank=0):
    cfg = build_config({"data.train_dir": str(train_dir), "data.max_seq_length": S, "model.max_position_embeddings": S,
                        "data.max_predictions_per_seq": P, "run.local_batch_size": 4, "run.seed": 3,
                        "model.vocab_size": 30000, **overrides})
    return loader.train_batches(data=cfg.data, sampler=cfg.sampler, model=cfg.model, plan=train_plan(cfg, world),
                                seed=cfg.run.seed, rank=rank, world_size=world, read_timeout_s=10)


@pytest.mark.parametrize("road", sorted(MODES))
def test_every_road_reads_through_the_guards(tmp_path, road):
    """Every sampling mode trains on the same checks: an id past model.vocab_size in every
    shard, a changed file under an md5 list, each named with its file, whatever the loader."""
    kind, overrides = MODES[road]

    def bad_id(shard):
        shard.tokens[shard.offsets[1] + 2] = 30001

    dirs = road_dirs(tmp_path / "ids", bad_id)
    with pytest.raises(DataError, match=r"\.hdf5: sample 1: token id 30001 >= model\.vocab_size=30000"):
        stream = _batches(dirs[kind], overrides)
        for _ in range(8):
            next(stream)
    dirs = road_dirs(tmp_path / "md5")
    checksum(dirs[kind])
    for f in dirs[kind].rglob("*.hdf5"):
        data = bytearray(f.read_bytes())
        data[-100] ^= 1
        f.write_bytes(bytes(data))
    with pytest.raises(DataError, match=r"\.hdf5: md5 [0-9a-f]{32}, but .*md5sums\.txt says"):
        stream = _batches(dirs[kind], overrides)
        for _ in range(8):
            next(stream)


def test_the_wrong_kind_of_directory_is_refused_naming_the_right_one(tmp_path):
    dirs = road_dirs(tmp_path)
    stratum = dirs["strata"] / "stratum_0_1-12"
    with pytest.raises(DataError, match=rf"data\.train_dir={stratum} is one stratum of the strata directory "
                                        rf"{dirs['strata']}: .*point data\.train_dir \(DATADIR\) at {dirs['strata']}$"):
        _batches(stratum, {})
    with pytest.raises(DataError, match=rf"sampler\.mode=stratified needs length strata, but data\.train_dir="
                                        rf"{dirs['plain']} is a plain directory .* input_preprocessing stratify"):
        _batches(dirs["plain"], MODES["strata"][1])
    assert len(next(_batches(dirs["plain"], {**MODES["strata"][1], "sampler.strata_width": 16}))["nsp_labels"]) == 4



@pytest.mark.parametrize("error", [RuntimeError("Unable to synchronously check link existence (free block size is "
                                                "zero?)"), KeyError("bad object header version number"),
                                   OSError("Can't synchronously read data")])
def test_a_damaged_file_is_named_whatever_h5py_raises(tmp_path, monkeypatch, error):
    """h5py reports a damaged header or heap as RuntimeError, KeyError or OSError, depending on
    where HDF5 trips (bytes zeroed at 1536 or 2048 of a demo strata file: each of them): every
    one is bad input naming the file, on both roads, never a traceback."""
    from bert import shards

    path = _shard(tmp_path)

    def damaged(*_args):
        raise error

    monkeypatch.setattr(shards, "_structure_and_rows", damaged)
    for read in (lambda: read_shard(path), lambda: read_rows(path, [2])):
        with pytest.raises(DataError, match=rf"^{path}: cannot read \(truncated or corrupt\?\): "):
            read()


@pytest.mark.parametrize("road", ["closed", "snake", "strata"])
@pytest.mark.parametrize("md5", [True, False])
def test_a_directory_holding_a_shard_twice_is_refused_naming_both(tmp_path, road, md5):
    """One shard copied over another (its md5 list made after the copy): refused before any
    step, naming both, from the md5 list or, where the mode has one, the length index (the
    closed road without an md5 list reads nothing at start-up, so it cannot tell)."""
    import shutil

    from input_preprocessing.stratify import stratify

    dirs = road_dirs(tmp_path / "clean")
    plain = tmp_path / "plain"
    shutil.copytree(dirs["plain"], plain)
    shutil.copy(plain / "part_0.hdf5", plain / "part_1.hdf5")
    train = {"plain": plain}
    if road == "strata":
        stratify(plain, tmp_path / "strata", bounds=(12, 20, 32), max_seq_length=S)
        train["strata"] = tmp_path / "strata"
    kind, overrides = MODES[road]
    if md5:
        checksum(train[kind])
    if road == "closed" and not md5:
        next(_batches(train[kind], overrides))  # nothing read to tell by
        return
    first, second = ("part_0.hdf5", "part_1.hdf5") if kind == "plain" else ("part_00000", "part_00001")
    with pytest.raises(DataError, match=rf"^data\.train_dir={train[kind]}: (stratum_\d_\d+-\d+/)?{first}\S* and "
                                        rf"(stratum_\d_\d+-\d+/)?{second}\S* (are the same file \(md5 [0-9a-f]{{32}} in "
                                        r"\S+md5sums\.txt\)|hold the same samples): one shard copied over another"):
        _batches(train[kind], overrides)


def test_shards_alike_in_lengths_only_are_no_copies(tmp_path):
    """Two shards with the same lengths row for row but other tokens: read, compared, trained on."""
    from bert.shards import Shard as S_

    dirs = road_dirs(tmp_path)
    a = read_shard(dirs["plain"] / "part_0.hdf5")
    b = S_(a.path, a.tokens.copy(), a.segments, a.offsets, a.mlm_positions, a.mlm_ids, a.mlm_offsets, a.nsp)
    b.tokens[a.offsets[0] + 2] += 1
    write_shard(dirs["plain"] / "part_1.hdf5", b, "variable")
    assert len(next(_batches(dirs["plain"], MODES["snake"][1]))["nsp_labels"]) == 4

