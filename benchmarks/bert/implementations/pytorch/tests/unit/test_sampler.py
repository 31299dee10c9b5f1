"""bert.sampler: strata counts, deals, packing, coverage / determinism / resume of every mode,
reading by id, the strata manifest, and the model's packed path against the padded one.

Stratified datasets are written here with ``bert.shards.write_shard`` in the layout of issue
3's ``stratify`` step (one directory per stratum, manifest.json, length_index.npz).
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from bert import sampler as smp
from bert.attention import build_attention, varlen_via_padded
from bert.config import ConfigError, ModelConfig, SamplerConfig, build_config
from bert import batches
from bert.batches import collate
from bert.model import BertForPreTraining
from bert.shards import Shard, read_rows, read_shard, write_shard
from sampler_helpers import (BOUNDS, P, PKG, S, _cfg, _loader, make_sample, read_ids, strata_dir, uid_of)  # noqa: F401 - fixtures: strata_dir

ONE_RANK = dict(rank=0, world_size=1, local_batch=16, seed=0, max_seq_length=512, hidden=1024)


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
    s = smp.build_sampler(SamplerConfig(mode="stratified"), index, **ONE_RANK)
    assert s.counts.tolist() == [6, 3, 2, 5]
    s = smp.build_sampler(SamplerConfig(mode="stratified", counts=[5, 4, 2, 5]), index, **ONE_RANK)
    assert s.counts.tolist() == [5, 4, 2, 5]
    with pytest.raises(ValueError, match="summing to 16"):
        smp.build_sampler(SamplerConfig(mode="stratified", counts=[5, 4, 2, 4]), index, **ONE_RANK)


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
    rows = batches.pack_ffd(lengths, 512, 3)
    assert sorted(i for r in rows for i in r) == list(range(200))
    assert all(len(r) <= 3 and lengths[r].sum() <= 512 for r in rows)
    assert len(rows) < 200


def test_balance_simulator_orders_modes():
    from tools.balance import load_histogram, simulate

    lengths, counts = load_histogram(PKG / "data" / "wikipedia_seqlen_histogram_512.txt")
    r = {m: simulate(m, 256, 16, 8, 4, 0, lengths, counts)["tokens_max_over_mean"]
         for m in ("random", "stratified", "stratified+snake", "stratified+best")}
    assert r["random"] > r["stratified"] > r["stratified+snake"] > r["stratified+best"] >= 1.0


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
    return [smp.IndexSampler(lengths, strata, rank=r, world_size=world, local_batch=4, seed=seed, group=group,
                             draw=draw, deal_policy=deal,
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


@pytest.mark.parametrize("layout", ["fixed", "variable"])
def test_read_rows_equals_read_shard(tmp_path, layout):
    rng = np.random.default_rng(5)
    samples = [make_sample(i, int(rng.integers(5, S + 1)), rng) for i in range(30)]
    write_shard(tmp_path / "a.hdf5", Shard.from_samples(samples), layout, S, P)
    whole = read_shard(tmp_path / "a.hdf5")
    rows = np.array([17, 3, 29, 4, 3])
    part = read_rows(tmp_path / "a.hdf5", rows)
    for j, i in enumerate(rows):
        for a, b in zip(part[j], whole[int(i)]):
            assert np.array_equal(np.asarray(a), np.asarray(b))


def test_manifest_index_matches_files(strata_dir):
    root, lengths = strata_dir
    index = smp.LengthIndex.from_manifest(root)
    assert index.lengths.tolist() == lengths
    ids = np.array([0, 95, 50, 3, 50])
    got = read_ids(index, root, ids)
    assert [uid_of(s) for s in got] == ids.tolist()
    assert [len(s.input_ids) for s in got] == [lengths[i] for i in ids]


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
    from bert.loader import TrainLoader

    cfg = build_config({"data.train_dir": str(demo_data.train), "data.max_seq_length": 128,
                        "model.max_position_embeddings": 128, "data.max_predictions_per_seq": 20, "run.seed": 1})
    assert isinstance(_loader(cfg, 0, 2), TrainLoader)
    with pytest.raises(ConfigError, match="closed division"):
        build_config({"sampler.mode": "stratified"})


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
    packed = batches.collate_packed(samples, S)
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
    batch = batches.collate_packed([make_sample(i, 10, rng) for i in range(3)], S)
    mlm, nsp = model(**{k: v for k, v in batch.items() if k not in ("mlm_labels", "nsp_labels")})
    assert nsp.shape == (3, 2) and mlm.shape[0] == len(batch["mlm_labels"])
    with pytest.raises(ConfigError, match="model.pack"):
        build_config({"model.pack": "true"})  # unpad is on by default


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


@pytest.mark.parametrize("world, batch, accum", [(1, 8, 1), (4, 2, 1), (1, 4, 2), (8, 1, 1), (3, 4, 1)])
def test_a_stream_cut_for_other_ranks_keeps_each_steps_samples_and_the_strata_counts(world, batch, accum):
    """The stream of 2 ranks x 4 samples (counts 2/1/1 a rank) cut for other ranks (Canon):
    each optimizer step the same 8 samples; where a rank takes whole units its strata counts
    are exact (2, 4, 6 ... as the units it takes), otherwise within one of its share; 3 ranks
    of 4 samples are another global batch, refused."""
    lengths = np.random.default_rng(5).permutation(np.concatenate([np.full(48, 8), np.full(24, 16), np.full(24, 25)]))
    strata = smp.Strata.from_lengths(lengths, BOUNDS)
    canon = smp.Canon(4, 2, 1)

    def ranks(w, b, a, c=None):
        return [smp.IndexSampler(lengths, strata, rank=r, world_size=w, local_batch=b, seed=3, counts=[2, 1, 1],
                                 accum=a, canon=c) for r in range(w)]

    if world * batch * accum != 8:
        with pytest.raises(ValueError, match="the stream's global batch 8 is not this run's 12"):
            ranks(world, batch, accum, canon)
        return
    first, other = ranks(2, 4, 1), ranks(world, batch, accum, canon)
    for k in range(14):  # past the strata's epochs (24, 12, 12 steps of a stratum's samples)
        want = np.sort(np.concatenate([s.ids(k) for s in first]))
        got = [s.ids(k * accum + j) for j in range(accum) for s in other]
        assert np.array_equal(np.sort(np.concatenate(got)), want), k
        step = np.bincount(first[0].members_of(want), minlength=3)
        for ids in got:
            per = np.bincount(first[0].members_of(ids), minlength=3)
            assert np.all(np.abs(per - step * len(ids) / 8) < 1), (k, per)
            if len(ids) % 4 == 0:
                assert per.tolist() == [2 * len(ids) // 4, len(ids) // 4, len(ids) // 4]
