"""bert.shards, bert.loader and bert.demo_data: shard formats, collation, rank splits, demo data quality.

Shards for the format tests are written here with raw h5py, following NVIDIA's layout,
so the reader is checked against the format and not only against our own writer.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from bert import demo_data
from bert.batches import collate
from bert.loader import BatchPlan, EvalSet, TrainLoader, eval_batches
from bert.reader import ShardReader
from bert.sampler import ShardOrder
from bert.shards import DataError, Sample, Shard, list_shards, read_shard, shard_size, write_shard

S, P = 32, 6  # sequence length and prediction slots of the hand-made shards


def make_samples(n: int, rng: np.random.Generator, first_uid: int = 0) -> list[Sample]:
    """Random valid samples; token 1 of sample k is 5 + first_uid + k, so it can be traced."""
    out = []
    for k in range(n):
        length = int(rng.integers(5, S + 1))
        ids = rng.integers(5, 200, size=length)
        ids[0], ids[-1] = 2, 3
        ids[1] = 5 + first_uid + k
        a = int(rng.integers(2, length - 1))
        ids[a] = 3
        seg = (np.arange(length) > a).astype(np.int8)
        m = int(rng.integers(1, min(P, length - 2) + 1))
        pos = np.sort(rng.choice(np.arange(2, length), size=m, replace=False))
        out.append(Sample(ids.astype(np.int16), seg, pos.astype(np.int16),
                          rng.integers(5, 200, size=m).astype(np.int16), int(rng.integers(0, 2))))
    return out


def write_nvidia_fixed(path: Path, samples: list[Sample], **override) -> None:
    n = len(samples)
    arrays = {
        "input_ids": np.zeros((n, S), np.int16), "input_mask": np.zeros((n, S), np.int8),
        "segment_ids": np.zeros((n, S), np.int8), "masked_lm_positions": np.zeros((n, P), np.int16),
        "masked_lm_ids": np.zeros((n, P), np.int16),
        "next_sentence_labels": np.array([s.nsp_label for s in samples], np.int8),
    }
    for i, s in enumerate(samples):
        L, M = len(s.input_ids), len(s.masked_positions)
        arrays["input_ids"][i, :L] = s.input_ids
        arrays["input_mask"][i, :L] = 1
        arrays["segment_ids"][i, :L] = s.segment_ids
        arrays["masked_lm_positions"][i, :M] = s.masked_positions
        arrays["masked_lm_ids"][i, :M] = s.masked_ids
    arrays.update(override)
    with h5py.File(path, "w") as f:
        for k, v in arrays.items():
            if v is not None:
                f.create_dataset(k, data=v)


def write_nvidia_variable(path: Path, samples: list[Sample]) -> None:
    n = len(samples)
    with h5py.File(path, "w") as f:
        for name, field, dt in (("input_ids", "input_ids", np.int16), ("segment_ids", "segment_ids", np.int8),
                                ("masked_lm_positions", "masked_positions", np.int16),
                                ("masked_lm_ids", "masked_ids", np.int16)):
            ds = f.create_dataset(name, (n,), dtype=h5py.vlen_dtype(np.dtype(dt)))
            for i, s in enumerate(samples):
                ds[i] = getattr(s, field)
        f.create_dataset("next_sentence_labels", data=np.array([s.nsp_label for s in samples], np.int8))


def assert_same_samples(shard: Shard, samples: list[Sample]) -> None:
    assert len(shard) == len(samples)
    for i, want in enumerate(samples):
        got = shard[i]
        for field in ("input_ids", "segment_ids", "masked_positions", "masked_ids"):
            np.testing.assert_array_equal(getattr(got, field), getattr(want, field), err_msg=f"{i} {field}")
        assert got.nsp_label == want.nsp_label


# ---------------------------------------------------------------- formats


@pytest.mark.parametrize("writer", [write_nvidia_fixed, write_nvidia_variable])
def test_reader_reads_nvidia_layouts(tmp_path, writer):
    samples = make_samples(23, np.random.default_rng(0))
    path = tmp_path / "part_00000.hdf5"
    writer(path, samples)
    shard = read_shard(path, max_seq_length=S)
    assert_same_samples(shard, samples)
    np.testing.assert_array_equal(shard.lengths, [len(s.input_ids) for s in samples])
    assert shard_size(path) == 23


@pytest.mark.parametrize("layout", ["fixed", "variable"])
def test_writer_round_trip(tmp_path, layout):
    samples = make_samples(17, np.random.default_rng(1))
    path = tmp_path / "x.hdf5"
    write_shard(path, Shard.from_samples(samples), layout, S, P)
    with h5py.File(path) as f:
        assert ("input_mask" in f) == (layout == "fixed")
        assert f["input_ids"].ndim == (2 if layout == "fixed" else 1)
    assert_same_samples(read_shard(path), samples)


def test_subset_and_concat():
    samples = make_samples(10, np.random.default_rng(2))
    shard = Shard.from_samples(samples)
    rows = [7, 0, 3]
    assert_same_samples(shard.subset(rows), [samples[r] for r in rows])
    assert_same_samples(Shard.concat([shard.subset([1, 2]), shard.subset([9])]), [samples[1], samples[2], samples[9]])


def test_list_shards(tmp_path):
    for name in ("b.hdf5", "a.h5", "notes.txt"):
        (tmp_path / name).write_bytes(b"")
    assert [p.name for p in list_shards(tmp_path)] == ["a.h5", "b.hdf5"]
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="empty.*no shard files"):
        list_shards(tmp_path / "empty")
    with pytest.raises(DataError, match="missing_dir: no such directory"):
        list_shards(tmp_path / "missing_dir")


@pytest.mark.parametrize("override, message", [
    ({"masked_lm_ids": None}, r"missing dataset\(s\) \['masked_lm_ids'\]"),
    ({"input_ids": np.zeros((4, S), np.float32)}, r"'input_ids' has dtype float32"),
    ({"segment_ids": np.zeros((4, S - 1), np.int8)}, r"'segment_ids' has shape"),
    ({"next_sentence_labels": np.zeros(3, np.int8)}, r"'next_sentence_labels' has shape"),
    ({"input_mask": np.tile((np.arange(S) % 2).astype(np.int8), (4, 1))}, r"'input_mask' of sample 0 is not a prefix"),
    ({"masked_lm_positions": np.full((4, P), S - 1, np.int16)}, r"masked_lm_position 31 is outside"),
])
def test_fixed_validation_names_file_and_problem(tmp_path, override, message):
    path = tmp_path / "bad_shard.hdf5"
    samples = make_samples(4, np.random.default_rng(3))
    # sample 0 is short, so a prediction at position S-1 lies outside it
    s0 = samples[0]
    samples[0] = s0._replace(input_ids=s0.input_ids[:5], segment_ids=s0.segment_ids[:5],
                             masked_positions=s0.masked_positions[:0], masked_ids=s0.masked_ids[:0])
    write_nvidia_fixed(path, samples, **override)
    with pytest.raises(DataError, match=message) as err:
        read_shard(path)
    assert str(path) in str(err.value)


def test_variable_validation_names_file(tmp_path):
    path = tmp_path / "vlen_bad.hdf5"
    write_nvidia_variable(path, make_samples(3, np.random.default_rng(4)))
    with h5py.File(path, "a") as f:
        f["segment_ids"][1] = np.zeros(2, np.int8)
    with pytest.raises(DataError, match=r"sample 1: 'segment_ids' and 'input_ids' rows differ") as err:
        read_shard(path)
    assert str(path) in str(err.value)
    garbage = tmp_path / "garbage.hdf5"
    garbage.write_bytes(b"not hdf5")
    with pytest.raises(DataError, match="garbage.hdf5: cannot open as hdf5"):
        read_shard(garbage)
    good = tmp_path / "vlen_long.hdf5"
    write_nvidia_variable(good, make_samples(3, np.random.default_rng(4)))
    with pytest.raises(DataError, match=r"vlen_long.hdf5: sample \d+ has \d+ tokens > max_seq_length 4") as err:
        read_shard(good, max_seq_length=4)
    # It names what to change, with the length the data needs.
    longest = int(read_shard(good).lengths.max())
    assert f"set data.max_seq_length and model.max_position_embeddings to at least {longest}" in str(err.value)


def test_fixed_padding_slots_are_dropped(tmp_path):
    samples = make_samples(5, np.random.default_rng(5))
    path = tmp_path / "f.hdf5"
    write_nvidia_fixed(path, samples)
    shard = read_shard(path)
    assert len(shard.mlm_positions) == sum(len(s.masked_positions) for s in samples) < 5 * P
    assert (shard.mlm_positions > 0).all()


# ---------------------------------------------------------------- collate


def test_collate_padded_and_unpadded_agree():
    samples = make_samples(9, np.random.default_rng(6))
    pad = collate(samples, unpad=False, max_seq_length=S)
    unp = collate(samples, unpad=True, max_seq_length=S)
    mask = pad["attention_mask"].bool()
    lengths = [len(s.input_ids) for s in samples]

    assert pad["input_ids"].shape == (9, S) and pad["mlm_labels"].shape == (9, S)
    for k in ("input_ids", "token_type_ids", "attention_mask", "mlm_labels", "nsp_labels"):
        assert pad[k].dtype == torch.int64, k
    for k in ("input_ids", "token_type_ids", "position_ids", "masked_index", "mlm_labels", "nsp_labels"):
        assert unp[k].dtype == torch.int64, k
    assert unp["cu_seqlens"].dtype == torch.int32
    assert isinstance(unp["max_seqlen"], int) and unp["max_seqlen"] == max(lengths)
    assert unp["cu_seqlens"].tolist() == np.concatenate([[0], np.cumsum(lengths)]).tolist()

    torch.testing.assert_close(unp["input_ids"], pad["input_ids"][mask])
    torch.testing.assert_close(unp["token_type_ids"], pad["token_type_ids"][mask])
    torch.testing.assert_close(unp["position_ids"], mask.nonzero()[:, 1])
    # masked_index points at the packed token whose padded position carries a label, in order
    packed_labels = pad["mlm_labels"][mask]
    torch.testing.assert_close(unp["masked_index"], (packed_labels != -100).nonzero()[:, 0])
    torch.testing.assert_close(unp["mlm_labels"], packed_labels[packed_labels != -100])
    torch.testing.assert_close(unp["nsp_labels"], pad["nsp_labels"])
    # and the labels are the file's: sample 3's predictions at its own positions
    s3 = samples[3]
    at = torch.from_numpy(s3.masked_positions.astype(np.int64))
    assert pad["mlm_labels"][3, at].tolist() == s3.masked_ids.tolist()
    assert (pad["mlm_labels"] != -100).sum() == sum(len(s.masked_ids) for s in samples)
    assert (pad["input_ids"][~mask] == 0).all()


def test_collate_rejects_too_long():
    samples = make_samples(2, np.random.default_rng(7))
    with pytest.raises(ValueError, match="max_seq_length 4"):
        collate(samples, unpad=True, max_seq_length=4)


# ---------------------------------------------------------------- training loader


def uid_shards(tmp_path: Path, sizes: list[int], layout: str = "variable") -> Path:
    d = tmp_path / "train"
    d.mkdir()
    rng, uid = np.random.default_rng(8), 0
    for i, n in enumerate(sizes):
        write_shard(d / f"part_{i:05d}.hdf5", Shard.from_samples(make_samples(n, rng, uid)), layout, S, P)
        uid += n
    return d


def shard_loader(d: Path, rank: int, world: int, batch: int, seed: int, unpad: bool, seq: int,
                 prefetch: bool = True) -> TrainLoader:
    """The closed division's stream over ``d``: ShardOrder, whole shards, ``collate``."""
    paths = list_shards(d)
    return TrainLoader(policy=ShardOrder(len(paths), rank, world, seed), paths=paths, batch_size=batch,
                       reader=ShardReader(d, max_seq_length=seq, bounds=None, verify_md5=True, timeout_s=60),
                       collate=lambda b: collate(b, unpad, seq), world_size=world, data=lambda: {"shards": len(paths)},
                       prefetch=prefetch)


def uids(batch: dict) -> list[int]:
    """Sample ids of an unpadded batch (token 1 of each sample)."""
    return (batch["input_ids"][batch["cu_seqlens"][:-1].long() + 1] - 5).tolist()


def test_train_loader_is_deterministic_and_seeded(tmp_path):
    d = uid_shards(tmp_path, [7, 11, 5, 9])
    def first(seed, prefetch=True, n=6):
        loader = shard_loader(d, 0, 1, 4, seed, True, S, prefetch=prefetch)
        out = [uids(next(loader)) for _ in range(n)]
        loader.close()
        return out
    assert first(3) == first(3) == first(3, prefetch=False)
    assert first(3) != first(4)
    orders = {tuple(ShardOrder(6, 0, 1, seed).shards(0)) for seed in range(5)}
    assert len(orders) > 1  # the shard order, not only the order inside shards, follows the seed
    assert ShardOrder(6, 0, 1, 0).shards(0) != ShardOrder(6, 0, 1, 0).shards(1)


def test_one_epoch_over_two_ranks_covers_every_sample_once(tmp_path):
    sizes = [7, 11, 5, 9, 6]  # 38 samples, uneven shards, odd shard count
    d = uid_shards(tmp_path, sizes)
    batch, seen, counts = 4, [], []
    for rank in range(2):
        policy = ShardOrder(len(sizes), rank, 2, seed=9)
        n_rank = sum(len(policy.select(0, s, sizes[s])) for s in policy.shards(0))
        counts.append(n_rank)
        loader = shard_loader(d, rank, 2, batch, 9, True, S)
        got = []
        for _ in range(-(-n_rank // batch)):  # enough batches to finish epoch 0 on this rank
            b = next(loader)
            assert len(b["nsp_labels"]) == batch  # every rank, every step: the same batch size
            got += uids(b)
        assert loader.state_dict()["position"][0] == 1 or n_rank % batch == 0
        seen += got[:n_rank]
        loader.close()
    assert sum(counts) == 38
    assert sorted(seen) == list(range(38))
    assert counts[0] != 0 and counts[1] != 0


def test_fewer_shards_than_ranks_split_samples(tmp_path):
    d = uid_shards(tmp_path, [10])
    seen = []
    for rank in range(3):  # 10 samples, 3 ranks: every rank reads the one shard
        loader = shard_loader(d, rank, 3, 2, 5, False, S)
        n_rank = len(ShardOrder(1, rank, 3, 5).select(0, 0, 10))
        got = []
        for _ in range(-(-n_rank // 2)):
            b = next(loader)
            assert b["input_ids"].shape == (2, S)
            got += (b["input_ids"][:, 1] - 5).tolist()
        seen += got[:n_rank]
        loader.close()
    assert sorted(seen) == list(range(10))


def test_rank_without_samples_fails_instead_of_hanging(tmp_path):
    d = uid_shards(tmp_path, [2])  # one shard of 2 samples shared by 3 ranks: rank 2 gets none
    loader = shard_loader(d, 2, 3, 1, 0, True, S, prefetch=False)
    with pytest.raises(DataError, match="no samples from"):
        next(loader)


def test_train_loader_resume(tmp_path):
    sizes = [7, 11, 5, 9]
    d = uid_shards(tmp_path, sizes, layout="fixed")
    policy = ShardOrder(4, 1, 2, 11)
    per_epoch = [sum(len(policy.select(e, s, sizes[s])) for s in policy.shards(e)) for e in range(8)]

    def where(consumed):  # (epoch, offset) of the next sample after ``consumed`` samples
        epoch = 0
        while consumed >= per_epoch[epoch]:
            consumed -= per_epoch[epoch]
            epoch += 1
        return epoch, consumed

    a = shard_loader(d, 1, 2, 3, 11, True, S)
    history = [(uids(next(a)), a.state_dict()) for _ in range(12)]  # several epochs
    for k, (_, state) in enumerate(history):
        assert tuple(state["position"]) == where(3 * (k + 1))
    for k in (2, 6):  # resume mid-epoch 0 and mid-epoch 1
        b = shard_loader(d, 1, 2, 3, 11, True, S, prefetch=k == 2)
        b.load_state_dict(history[k][1])
        assert [(uids(next(b)), b.state_dict()) for _ in range(12 - k - 1)] == history[k + 1:]
        b.close()
    with pytest.raises(DataError, match="world_size 2 there, 4 here"):
        shard_loader(d, 0, 4, 3, 11, True, S).load_state_dict(history[0][1])
    a.close()


# ---------------------------------------------------------------- eval set


@pytest.mark.parametrize("limit", [0, 13])
def test_eval_set_split_covers_all_once(tmp_path, limit):
    d = uid_shards(tmp_path, [8, 9])  # two files: the limit may cut inside the second
    total = limit or 17
    seen = []
    for rank in range(2):
        ev = EvalSet(d, rank, 2, limit)
        assert ev.total_samples == total
        assert len(ev) == len(range(rank, total, 2))
        batches = eval_batches(ev, BatchPlan(True, False, None, 4, S, P, 30522, fill=True))
        assert [len(b["nsp_labels"]) for b in batches][:-1] == [4] * (len(batches) - 1)
        seen += [u for b in batches for u in uids(b)]
    assert sorted(seen) == list(range(total))
    single = EvalSet(d / "part_00001.hdf5", 0, 1)
    assert single.total_samples == 9


# ---------------------------------------------------------------- demo data


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    stats = demo_data.generate(out, train_samples=1500, eval_samples=600, seed=3, seq_len=64,
                               max_pred=10, vocab=256, layout="variable", shards=4)
    return out, stats


def test_demo_data_is_learnable_not_guessable(demo):
    out, stats = demo
    assert stats["unigram_accuracy"] < 0.30
    assert stats["oracle_accuracy"] > 0.80
    # the oracle needs the true f: with another language it is as bad as guessing
    evals = read_shard(out / "eval" / "eval_00000.hdf5")
    wrong = demo_data.make_language(256, np.random.default_rng([4, 0]))
    acc = (demo_data.oracle_predictions(evals, wrong, 5) == evals.mlm_ids).mean()
    assert acc < 0.1


def test_demo_data_structure(demo):
    out, stats = demo
    shards = list_shards(out / "train")
    assert len(shards) == 4 and sum(shard_size(p) for p in shards) == 1500
    ev = read_shard(out / "eval" / "eval_00000.hdf5", max_seq_length=64)
    lens = ev.lengths
    assert lens.max() == 64 and (lens == 64).mean() > 0.1 and lens.mean() < 48  # Wikipedia-shaped
    lang = demo_data.make_language(256, np.random.default_rng([3, 0]))
    is_next = cont = not_next_cont = 0
    for i in range(len(ev)):
        s = ev[i]
        assert s.input_ids[0] == demo_data.CLS and s.input_ids[-1] == demo_data.SEP
        assert 1 <= len(s.masked_positions) <= 10 and np.all(np.diff(s.masked_positions) > 0)
        sep = int(np.nonzero(s.input_ids == demo_data.SEP)[0][0])
        assert (s.segment_ids[: sep + 1] == 0).all() and (s.segment_ids[sep + 1:] == 1).all()
        # rebuild the original tokens and check B's link to A
        orig = s.input_ids.astype(np.int64).copy()
        orig[s.masked_positions] = s.masked_ids
        if s.nsp_label == 0:
            is_next += 1
            cont += int(orig[sep + 1] == lang.step(orig[sep - 1:sep], 1)[0])
        else:
            not_next_cont += int(orig[sep + 1] == lang.step(orig[sep - 1:sep], 1)[0])
    assert is_next > 0.4 * len(ev)
    assert cont > 0.8 * is_next  # IsNext B continues A's chain except after a restart
    assert not_next_cont < 0.05 * (len(ev) - is_next)  # NotNext B starts anywhere
    masked = ev.tokens[ev.offsets[np.repeat(np.arange(len(ev)), np.diff(ev.mlm_offsets))] + ev.mlm_positions]
    assert 0.7 < (masked == demo_data.MASK).mean() < 0.9


def test_demo_layouts_agree_and_load(tmp_path):
    kw = dict(train_samples=200, eval_samples=50, seed=5, seq_len=32, max_pred=5, vocab=64, shards=3)
    fixed = demo_data.generate(tmp_path / "f", layout="fixed", **kw)
    var = demo_data.generate(tmp_path / "v", layout="variable", **kw)
    assert fixed["oracle_accuracy"] == var["oracle_accuracy"]
    a = read_shard(tmp_path / "f" / "eval" / "eval_00000.hdf5")
    b = read_shard(tmp_path / "v" / "eval" / "eval_00000.hdf5")
    assert_same_samples(a, [b[i] for i in range(len(b))])
    loader = shard_loader(tmp_path / "f" / "train", 0, 2, 8, 0, False, 32)
    assert next(loader)["input_ids"].shape == (8, 32)
    loader.close()
    with pytest.raises(DataError, match="already holds other shards"):
        demo_data.generate(tmp_path / "f", layout="fixed", **{**kw, "shards": 2})


def test_demo_cli(tmp_path, capsys):
    stats = demo_data.main(["--output", str(tmp_path), "--train-samples", "100", "--eval-samples", "40",
                            "--seed", "1", "--seq-len", "32", "--max-pred", "5", "--vocab", "64"])
    assert "oracle" in capsys.readouterr().out
    assert Counter(p.suffix for p in (tmp_path / "train").iterdir()) == Counter({".hdf5": 8})
    assert (tmp_path / "demo_data.json").exists() and stats["layout"] == "variable"


def test_watchdog_bounds_a_read_and_says_so_without_waiting(tmp_path):
    """bert/watchdog.py: a read past its bound is a DataError naming the file being read, for
    whoever waits (result) and for the poll that only looks (failure); a read that failed on
    bad data says why; one within its bound says nothing."""
    import threading
    import time

    from bert import watchdog

    release = threading.Event()

    def stuck(read):
        read.at(tmp_path / "b.hdf5")
        release.wait()
        return "late"

    r = watchdog.Read(tmp_path / "a.hdf5", stuck, timeout_s=0.2)
    assert r.failure() is None  # within its bound
    time.sleep(0.3)
    assert r.failure().startswith(f"{tmp_path / 'b.hdf5'}: reading took longer than data.read_timeout_s=0.2 s")
    with pytest.raises(DataError, match=r"b\.hdf5: reading took longer than data\.read_timeout_s=0\.2 s"):
        r.result()
    release.set()
    assert watchdog.read("c", lambda _r: 7, timeout_s=5) == 7

    def bad(_read):
        raise DataError("c.hdf5: missing dataset")

    r = watchdog.Read("c", bad, timeout_s=5)
    with pytest.raises(DataError, match="missing dataset"):
        r.result()
    assert r.failure() == "c.hdf5: missing dataset"


def test_a_failed_read_ahead_of_the_loop_stops_every_rank_at_the_poll(tmp_path):
    """The checkpoint poll carries a flag for a shard read that failed or overran ahead of the
    loop (TrainLoader.failure): every rank raises the same DataError there, naming the rank."""
    from bert import checkpoint
    from bert.config import CheckpointConfig

    class State:
        step = 10
        nonfinite = torch.zeros(2, dtype=torch.int64)  # no NaN streak

    class Stream:
        def failure(self):
            return "/d/part_3.hdf5: reading took longer"

    ckpt = checkpoint.Checkpointer(cfg=CheckpointConfig(poll_steps=10), directory=tmp_path, rank=0, world_size=1,
                                   device=torch.device("cpu"), global_batch=16, stop=checkpoint.StopFlag())
    with pytest.raises(DataError, match=r"^/d/part_3\.hdf5: reading took longer \(on rank 0\)$"):
        ckpt.at_boundary(None, State(), Stream())
    State.step = 9  # no poll: nothing asked
    assert ckpt.at_boundary(None, State(), Stream()) is None
