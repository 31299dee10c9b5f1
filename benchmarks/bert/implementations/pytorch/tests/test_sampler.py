"""bert.sampler: strata counts, deals, packing, coverage / determinism / resume of every mode,
reading by id, the strata manifest, and the model's packed path against the padded one.

Stratified datasets are written here with ``bert.data.write_shard`` in the layout of issue
3's ``stratify`` step (one directory per stratum, manifest.json, length_index.npz).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from bert import sampler as smp
from bert.attention import build_attention, varlen_via_padded
from bert.config import ConfigError, ModelConfig, SamplerConfig, build_config
from bert.data import collate
from bert.model import BertForPreTraining
from bert.shards import Sample, Shard, read_shard, write_shard
from conftest import end_worker, free_port

PKG = Path(__file__).resolve().parent.parent
S, P = 32, 5
BOUNDS = [(1, 12), (13, 20), (21, 32)]


def make_sample(uid: int, length: int, rng: np.random.Generator) -> Sample:
    """A valid sample whose token 1 is 5 + uid, so it can be traced after reading."""
    ids = rng.integers(5, 30000, size=length)
    ids[0], ids[-1], ids[1] = 2, 3, 5 + uid
    a = max(2, length // 2)
    seg = (np.arange(length) > a).astype(np.int8)
    m = int(min(P, length - 2))
    pos = np.sort(rng.choice(np.arange(2, length), size=m, replace=False))
    return Sample(ids.astype(np.int16), seg, pos.astype(np.int16),
                  rng.integers(5, 100, size=m).astype(np.int16), int(rng.integers(0, 2)))


def write_stratified(root: Path, per_stratum: list[int], seed: int = 0, layout: str = "variable",
                     shards_per_stratum: int = 2) -> list[int]:
    """A strata dir; returns the length of every sample in global-id order."""
    rng = np.random.default_rng(seed)
    strata, index, all_lengths, uid = [], {}, [], 0
    for k, ((lo, hi), n) in enumerate(zip(BOUNDS, per_stratum)):
        name = f"stratum_{k}_{lo}-{hi}"
        (root / name).mkdir(parents=True)
        lengths = rng.integers(max(lo, 5), hi + 1, size=n)
        shards = []
        for j, part in enumerate(np.array_split(np.arange(n), shards_per_stratum)):
            rel = f"{name}/part_{j:05d}.hdf5"
            samples = [make_sample(uid + int(i), int(lengths[i]), rng) for i in part]
            write_shard(root / rel, Shard.from_samples(samples), layout, S, P)
            index[rel] = lengths[part].astype(np.uint16)
            shards.append(rel)
        uid += n
        all_lengths += lengths.tolist()
        strata.append({"name": name, "min_len": lo, "max_len": hi, "samples": n,
                       "tokens": int(lengths.sum()), "shards": shards})
    np.savez(root / "length_index.npz", **index)
    (root / "manifest.json").write_text(json.dumps({
        "format": "mlperf-bert-strata/1", "max_seq_length": S, "strata": strata,
        "total_samples": sum(per_stratum), "total_tokens": int(sum(all_lengths)),
        "length_index": "length_index.npz"}))
    return all_lengths


def uid_of(sample: Sample) -> int:
    return int(sample.input_ids[1]) - 5


# ---------------------------------------------------------------- arithmetic


def test_wikipedia_manifest_counts_are_6_3_2_5(tmp_path):
    """A manifest + length index with the shipped histogram's lengths (no shards needed)."""
    hist = np.loadtxt(PKG / "data" / "wikipedia_seqlen_histogram_512.txt", dtype=np.int64)
    lengths = np.repeat(hist[:, 0], hist[:, 1]).astype(np.uint16)
    bounds = smp.even_bounds(512, 128)
    strata = []
    for k, (lo, hi) in enumerate(bounds):
        sel = lengths[(lengths >= lo) & (lengths <= hi)]
        strata.append({"name": f"stratum_{k}_{lo}-{hi}", "min_len": lo, "max_len": hi, "samples": len(sel),
                       "tokens": int(sel.sum(dtype=np.int64)), "shards": [f"stratum_{k}_{lo}-{hi}/part_00000.hdf5"]})
    np.savez(tmp_path / "length_index.npz", **{s["shards"][0]: lengths[(lengths >= s["min_len"]) &
                                                                       (lengths <= s["max_len"])] for s in strata})
    (tmp_path / "manifest.json").write_text(json.dumps({
        "format": "mlperf-bert-strata/1", "max_seq_length": 512, "strata": strata,
        "total_samples": len(lengths), "total_tokens": int(lengths.sum(dtype=np.int64)),
        "length_index": "length_index.npz"}))
    index = smp.LengthIndex.from_manifest(tmp_path)
    assert index.bounds == ((1, 128), (129, 256), (257, 384), (385, 512))
    s = smp.build_sampler(SamplerConfig(mode="stratified"), index, 0, 1, 16, 0, 512, 1024)
    assert s.counts.tolist() == [6, 3, 2, 5]
    s = smp.build_sampler(SamplerConfig(mode="stratified", counts=[5, 4, 2, 5]), index, 0, 1, 16, 0, 512, 1024)
    assert s.counts.tolist() == [5, 4, 2, 5]
    with pytest.raises(ValueError, match="summing to 16"):
        smp.build_sampler(SamplerConfig(mode="stratified", counts=[5, 4, 2, 4]), index, 0, 1, 16, 0, 512, 1024)


def test_largest_remainder():
    assert smp.largest_remainder([1, 1, 1], 10).tolist() == [4, 3, 3]
    assert smp.largest_remainder([0.5, 0.25, 0.25], 4).tolist() == [2, 1, 1]
    assert smp.largest_remainder([3, 0, 1], 7).sum() == 7


@pytest.mark.parametrize("policy", ["snake", "greedy", "cost"])
def test_deal_gives_equal_counts(policy):
    lengths = np.random.default_rng(0).integers(1, 513, size=128)
    owner = smp.deal(lengths, 8, policy)
    assert np.bincount(owner, minlength=8).tolist() == [16] * 8


def test_snake_order_and_greedy_beats_it():
    assert smp.deal(np.array([10, 9, 8, 7, 6, 5]), 3, "snake").tolist() == [0, 1, 2, 2, 1, 0]
    rng = np.random.default_rng(1)
    worse = 0
    for _ in range(20):
        lengths = rng.integers(1, 513, size=128)
        loads = {p: np.bincount(smp.deal(lengths, 8, p), weights=lengths).max() for p in ("snake", "greedy")}
        worse += loads["greedy"] > loads["snake"]
    assert worse <= 2  # greedy is a heuristic too, but it should rarely lose


def test_pack_ffd_respects_capacity_and_count():
    lengths = np.random.default_rng(2).integers(1, 513, size=200)
    rows = smp.pack_ffd(lengths, 512, 3)
    assert sorted(i for r in rows for i in r) == list(range(200))
    assert all(len(r) <= 3 and lengths[r].sum() <= 512 for r in rows)
    assert len(rows) < 200


def test_balance_tool_json_interface():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "tools/balance.py", "--ranks", "64", "--local-batch", "16", "--group", "8",
                          "--mode", "stratified+snake", "--steps", "3", "--json"],
                         cwd=PKG, capture_output=True, text=True, check=True).stdout
    r = json.loads(out)
    assert {"tokens_max_over_mean", "attention_max_over_mean", "padding_fraction"} <= r.keys()
    assert r["counts_per_unit"] == [6, 3, 2, 5]
    assert 1.0 <= r["tokens_max_over_mean"] < 1.2


def test_balance_simulator_orders_modes():
    from tools.balance import load_histogram, simulate

    lengths, counts = load_histogram(PKG / "data" / "wikipedia_seqlen_histogram_512.txt")
    r = {m: simulate(m, 256, 16, 8, 4, 0, lengths, counts)["tokens_max_over_mean"]
         for m in ("random", "stratified", "stratified+snake", "stratified+best")}
    assert r["random"] > r["stratified"] > r["stratified+snake"] > r["stratified+best"] >= 1.0


# ---------------------------------------------------------------- the sampler


MODES = [  # (mode, deal, draw, group, counts or rounding)
    ("random", "none", "rank", 1, ""),
    ("stratified", "none", "rank", 1, "2,1,1"),
    ("stratified", "snake", "rank", 2, "2,1,1"),
    ("stratified", "greedy", "group", 2, "4,2,2"),
    ("stratified", "cost", "rank", 0, "2,1,1"),
    ("stratified", "greedy", "group", 4, "carry"),
]


def samplers(lengths, world, mode, deal, draw, group, counts, seed=3):
    strata = smp.Strata.from_lengths(lengths, BOUNDS) if mode == "stratified" else None
    rounding = "carry" if counts == "carry" else "fixed"
    counts = [] if counts in ("", "carry") else [int(c) for c in counts.split(",")]
    return [smp.IndexSampler(lengths, strata, r, world, 4, seed, group=group, draw=draw, deal_policy=deal,
                             counts=counts, rounding=rounding) for r in range(world)]


@pytest.mark.parametrize("mode, deal, draw, group, counts", MODES)
def test_every_sample_once_per_epoch_equal_counts(mode, deal, draw, group, counts):
    # 4 ranks x 4 samples, 3 steps per stratum epoch: per-stratum sizes = 4 ranks * count * 3.
    world, steps = 4, 3
    lengths = np.concatenate([np.full(4 * 2 * steps, 8), np.full(4 * steps, 16), np.full(4 * steps, 25)])
    lengths = np.random.default_rng(0).permutation(lengths)  # ids not sorted by stratum
    ss = samplers(lengths, world, mode, deal, draw, group, counts)
    for epoch in range(2):
        seen = []
        for t in range(epoch * steps, (epoch + 1) * steps):
            for s in ss:
                ids = s.ids(t)
                assert len(ids) == 4  # equal counts per rank
                if deal == "none" and mode == "stratified":
                    assert np.bincount(s.members_of(ids), minlength=3).tolist() == [2, 1, 1]
                seen += ids.tolist()
        assert sorted(seen) == list(range(len(lengths))), epoch  # none repeated, none lost


@pytest.mark.parametrize("mode, deal, draw, group, counts", MODES)
def test_deterministic_and_seeded(mode, deal, draw, group, counts):
    lengths = np.random.default_rng(1).integers(5, 33, size=200)
    a = [s.ids(7) for s in samplers(lengths, 4, mode, deal, draw, group, counts)]
    b = [s.ids(7) for s in samplers(lengths, 4, mode, deal, draw, group, counts)]
    c = [s.ids(7) for s in samplers(lengths, 4, mode, deal, draw, group, counts, seed=4)]
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))


def test_carry_rounding_keeps_shares_and_draws_evenly():
    shares = np.array([0.013, 0.2, 0.087, 0.3, 0.4])
    fixed = smp.CountSchedule(shares, 16, "fixed")
    assert fixed.counts(0)[0] == 0  # a fixed count starves the small stratum ...
    carry = smp.CountSchedule(shares, 16, "carry")
    for t in (1, 7, 50, 333):
        assert carry.counts(t).sum() == 16
        assert np.abs(carry.taken(t) - t * 16 * shares).max() < 1.0  # ... carrying does not
    # On ids: 3 ranks drawing uneven shares; every id of a stratum is drawn e or e+1 times.
    lengths = np.random.default_rng(4).integers(5, 33, size=97)
    ss = samplers(lengths, 3, "stratified", "greedy", "rank", 3, "carry")
    drawn = np.concatenate([s.ids(t) for t in range(40) for s in ss])
    times = np.bincount(drawn, minlength=len(lengths))
    for k in range(3):
        members = ss[0].members[k]
        assert times[members].max() - times[members].min() <= 1, k


def test_deal_only_reorders_within_the_group():
    lengths = np.random.default_rng(2).integers(5, 33, size=300)
    plain = samplers(lengths, 4, "stratified", "none", "rank", 2, "2,1,1")
    dealt = samplers(lengths, 4, "stratified", "greedy", "rank", 2, "2,1,1")
    for t in range(5):
        for g in (0, 1):
            want = np.concatenate([plain[r].ids(t) for r in (2 * g, 2 * g + 1)])
            got = np.concatenate([dealt[r].ids(t) for r in (2 * g, 2 * g + 1)])
            assert sorted(want.tolist()) == sorted(got.tolist())
            loads = [lengths[dealt[r].ids(t)].sum() for r in (2 * g, 2 * g + 1)]
            raw = [lengths[plain[r].ids(t)].sum() for r in (2 * g, 2 * g + 1)]
            assert max(loads) <= max(raw)


# ---------------------------------------------------------------- on disk


@pytest.fixture(scope="module")
def strata_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("strata")
    lengths = write_stratified(root, [48, 24, 24])
    return root, lengths


@pytest.mark.parametrize("layout", ["fixed", "variable"])
def test_read_rows_equals_read_shard(tmp_path, layout):
    rng = np.random.default_rng(5)
    samples = [make_sample(i, int(rng.integers(5, S + 1)), rng) for i in range(30)]
    write_shard(tmp_path / "a.hdf5", Shard.from_samples(samples), layout, S, P)
    whole = read_shard(tmp_path / "a.hdf5")
    rows = np.array([17, 3, 29, 4])
    part = smp.read_rows(tmp_path / "a.hdf5", rows)
    for j, i in enumerate(rows):
        for a, b in zip(part[j], whole[int(i)]):
            assert np.array_equal(np.asarray(a), np.asarray(b))


def test_manifest_index_matches_files(strata_dir):
    root, lengths = strata_dir
    index = smp.LengthIndex.from_manifest(root)
    assert index.lengths.tolist() == lengths
    reader = smp.IdReader(index)
    ids = np.array([0, 95, 50, 3])
    got = reader.read(ids)
    assert [uid_of(s) for s in got] == ids.tolist()
    assert [len(s.input_ids) for s in got] == [lengths[i] for i in ids]


def _cfg(root, **sampler):
    return build_config({"data.train_dir": str(root), "data.max_seq_length": S, "model.max_position_embeddings": S,
                         "data.max_predictions_per_seq": P, "run.local_batch_size": 4, "run.division": "open",
                         "run.seed": 1, **{f"sampler.{k}": v for k, v in sampler.items()}})


def _loader(cfg, rank, world):
    return smp.train_batches(cfg.data, cfg.sampler, cfg.model, cfg.run.local_batch_size, cfg.run.seed, rank, world)


def test_loader_resumes_mid_epoch(strata_dir):
    root, _ = strata_dir
    cfg = _cfg(root, mode="stratified", deal="greedy", group_size=2)
    first = _loader(cfg, 1, 4)
    batches = [next(first) for _ in range(7)]
    state = first.state_dict()
    first.close()
    again = _loader(cfg, 1, 4)
    again.load_state_dict(state)
    for _ in range(3):
        want, got = next(first), next(again)
        for k in want:
            assert torch.equal(torch.as_tensor(want[k]), torch.as_tensor(got[k])), k
    assert len(batches[0]["cu_seqlens"]) == 5  # unpadded by default: 4 samples
    again.close()


def test_train_batches_picks_the_closed_loader(demo_data):
    from bert.data import TrainLoader

    cfg = build_config({"data.train_dir": str(demo_data.train), "data.max_seq_length": 128,
                        "model.max_position_embeddings": 128, "data.max_predictions_per_seq": 20, "run.seed": 1})
    assert isinstance(_loader(cfg, 0, 2), TrainLoader)
    with pytest.raises(ConfigError, match="closed division"):
        build_config({"sampler.mode": "stratified"})


# ---------------------------------------------------------------- 2 gloo ranks


def _gloo_worker(rank, port, root, out):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    res = {}
    for deal in ("snake", "greedy"):
        base = dict(mode="stratified", group_size=2, counts=[2, 1, 1])
        plain = _loader(_cfg(root, **base), rank, 2)
        local = _loader(_cfg(root, **base, deal=deal), rank, 2)
        gathered = _loader(_cfg(root, **base, deal=deal, lengths="gather"), rank, 2)
        for step in range(6):
            res[(deal, step)] = {name: [uid_of(s) for s in loader.samples(step)]
                                 for name, loader in (("plain", plain), ("local", local), ("gather", gathered))}
            batch = next(gathered)  # the collated batch holds the dealt samples, in order
            res[(deal, step)]["batch"] = (batch["input_ids"][batch["cu_seqlens"][:-1].long() + 1] - 5).tolist()
        for loader in (plain, local, gathered):
            loader.close()
    torch.save(res, f"{out}/rank{rank}.pt")
    end_worker()


def test_two_gloo_ranks_presort_only_reorders(strata_dir, tmp_path):
    import torch.multiprocessing as mp

    root, lengths = strata_dir
    mp.spawn(_gloo_worker, args=(free_port(), str(root), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    for key in r0:
        a, b = r0[key], r1[key]
        assert sorted(a["plain"] + b["plain"]) == sorted(a["local"] + b["local"])  # same multiset
        assert a["local"] == a["gather"] and b["local"] == b["gather"]  # same deal either way
        assert len(a["local"]) == len(b["local"]) == 4
        assert abs(sum(lengths[i] for i in a["local"]) - sum(lengths[i] for i in b["local"])) <= \
            abs(sum(lengths[i] for i in a["plain"]) - sum(lengths[i] for i in b["plain"]))
        assert a["batch"] == a["gather"] and b["batch"] == b["gather"]


# ---------------------------------------------------------------- model: packed == unpadded == padded


TINY = ModelConfig(vocab_size=30522, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64,
                   max_position_embeddings=S, hidden_dropout=0.0, attention_dropout=0.0)


@pytest.mark.parametrize("backend", ["sdpa", "math"])
def test_packed_and_unpadded_equal_padded(backend):
    rng = np.random.default_rng(7)
    samples = [make_sample(i, int(n), rng) for i, n in enumerate([32, 5, 20, 11, 9, 30, 6, 12])]
    samples = [s._replace(input_ids=(s.input_ids % 1000).astype(np.int16)) for s in samples]
    torch.manual_seed(0)
    model = BertForPreTraining(dataclasses.replace(TINY, attention_backend=backend)).eval()
    padded = collate(samples, False, S)
    packed = smp.collate_packed(samples, S)
    assert packed["input_ids"].shape[0] < len(samples)  # several sequences share rows
    unpadded = collate(samples, True, S)
    with torch.no_grad():
        mlm_p, nsp_p = model.forward_padded(padded["input_ids"], padded["token_type_ids"], padded["attention_mask"])
        want_mlm = mlm_p[padded["mlm_labels"] != -100]
        for batch, fwd in ((packed, model.forward_packed), (unpadded, model.forward_unpadded)):
            inputs = {k: v for k, v in batch.items() if k not in ("mlm_labels", "nsp_labels")}
            mlm, nsp = fwd(**inputs)
            torch.testing.assert_close(mlm, want_mlm, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(nsp, nsp_p, atol=1e-5, rtol=1e-5)
            assert torch.equal(batch["mlm_labels"], padded["mlm_labels"][padded["mlm_labels"] != -100])


def test_packed_model_dispatch_and_config():
    cfg = dataclasses.replace(TINY, unpad=False, pack=True)
    model = BertForPreTraining(cfg).eval()
    rng = np.random.default_rng(8)
    batch = smp.collate_packed([make_sample(i, 10, rng) for i in range(3)], S)
    mlm, nsp = model(**{k: v for k, v in batch.items() if k not in ("mlm_labels", "nsp_labels")})
    assert nsp.shape == (3, 2) and mlm.shape[0] == len(batch["mlm_labels"])
    with pytest.raises(ConfigError, match="model.pack"):
        build_config({"model.pack": "true"})  # unpad is on by default


# ---------------------------------------------------------------- attention resolution


def _reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0):
    assert cu_q is cu_k and max_q == max_k
    return varlen_via_padded(build_attention("math", "cpu").padded, q, k, v, cu_q, max_q, dropout_p)


def test_attention_resolution_on_a_gpu_machine():
    have, none = (lambda: _reference_varlen), (lambda: None)
    pick = lambda name, dev, p, f, t: build_attention(name, dev, p, flash=f, torch_varlen=t).name  # noqa: E731
    assert pick("auto", "cuda", 0.1, have, have) == "flash"
    assert pick("auto", "cuda", 0.1, none, have) == "sdpa"  # torch's varlen has no dropout
    assert pick("auto", "cuda", 0.0, none, have) == "torch_varlen"
    assert pick("auto", "cpu", 0.0, have, have) == "sdpa"
    with pytest.raises(ValueError, match="CUDA"):
        pick("flash", "cpu", 0.0, have, have)
    with pytest.raises(ValueError, match="flash_attn"):
        pick("flash", "cuda", 0.0, none, have)
    with pytest.raises(ValueError, match="no dropout"):
        pick("torch_varlen", "cuda", 0.1, none, have)


@pytest.mark.parametrize("name", ["flash", "torch_varlen"])
def test_varlen_wrappers_pass_the_kernel_arguments(name):
    backend = build_attention(name, "cuda", 0.0, flash=lambda: _reference_varlen, torch_varlen=lambda: _reference_varlen)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(12, 2, 8, generator=g) for _ in range(3))
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    got = backend.varlen(q, k, v, cu, 7)
    for a, b in ((0, 5), (5, 12)):
        ref = torch.softmax(q[a:b].transpose(0, 1) @ k[a:b].transpose(0, 1).transpose(1, 2) / 8 ** 0.5, -1)
        torch.testing.assert_close(got[a:b], (ref @ v[a:b].transpose(0, 1)).transpose(0, 1))


# ---------------------------------------------------------------- through the training loop


@pytest.mark.parametrize("extra", [["sampler.deal=greedy", "model.unpad=false", "model.pack=true"],
                                   ["sampler.deal=snake", "sampler.lengths=gather"]])
def test_open_division_run_with_presorting(trained, demo_data, tmp_path, extra):
    """The id-based loader (random + a deal; packed rows for train and eval) in the real loop,
    from the trained demo weights: reaches the target and the log passes the checker."""
    from bert import train
    from conftest import run_checker
    from test_train import _small_overrides

    assert trained.returncode == 0, trained.stdout[-3000:]
    rc = train.main(_small_overrides(demo_data, tmp_path, "run.division=open", "optim.name=adam",
                                     f"run.init_checkpoint={trained.checkpoint}", "optim.lr=1e-4",
                                     "eval.interval_samples=64", "run.max_samples=128", *extra))
    assert rc == 0
    ok, out = run_checker(tmp_path / "result_0.txt")
    assert ok, out
