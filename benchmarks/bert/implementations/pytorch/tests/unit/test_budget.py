"""Static token budgets (bert/budget.py): a budget batch is the exact unpadded batch plus pad
rows and pad prediction slots, and the model gives the same loss and gradients on both; pad
rows get attention output 0 and are never attended; the ladder is optimal and validated."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
import torch

from bert import budget, loader
from bert.attention import build_attention
from bert.config import ConfigError, ModelConfig, build_config, parse_budgets
from bert.trainer import train_layout, train_plan
from bert.batches import collate
from bert.model import IGNORE_INDEX
from bert.model import BertForPreTraining, pretraining_loss
from bert.shards import Sample


S, P, V = 32, 5, 64  # max_seq_length, max predictions per sample, vocab of the tiny model


TINY = ModelConfig(vocab_size=V, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64,
                   max_position_embeddings=S, hidden_dropout=0.0, attention_dropout=0.0, unpad=True)


def samples(n: int, seed: int, lengths: list[int] | None = None) -> list[Sample]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        length = lengths[i] if lengths else int(rng.integers(3, S + 1))
        ids = rng.integers(5, V, size=length)
        seg = (np.arange(length) >= rng.integers(1, length)).astype(np.int64)
        pos = np.sort(rng.choice(np.arange(1, length), size=min(P, length - 1, int(rng.integers(1, P + 1))),
                                 replace=False))
        out.append(Sample(ids, seg, pos, rng.integers(5, V, size=len(pos)), int(rng.integers(0, 2))))
    return out


def layout(rungs, batch: int) -> budget.Layout:
    return budget.Layout(tuple(rungs), batch * P, S)


def _loss_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    inputs = {k: v for k, v in batch.items() if k not in ("mlm_labels", "nsp_labels")}
    mlm, nsp = model(**inputs)
    loss = pretraining_loss(mlm, nsp, batch["mlm_labels"], batch["nsp_labels"])
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("backend", ["sdpa", "math"])  # CPU per-sequence SDPA; math via varlen_via_padded
def test_budget_batch_gives_the_exact_loss_and_gradients(backend):
    torch.manual_seed(0)
    model = BertForPreTraining(dataclasses.replace(TINY, attention_backend=backend)).train()
    batch = samples(6, seed=3)
    exact = collate(batch, True, S)
    total = exact["input_ids"].numel()
    padded = budget.pad_batch(exact, layout((total + 13, 6 * S), 6))
    assert padded["input_ids"].numel() == total + 13 and padded["max_seqlen"] == S
    loss_a, grads_a = _loss_and_grads(model, exact)
    loss_b, grads_b = _loss_and_grads(model, padded)
    torch.testing.assert_close(loss_b, loss_a)
    assert grads_a.keys() == grads_b.keys()
    for name, g in grads_a.items():
        torch.testing.assert_close(grads_b[name], g, msg=lambda m: f"{name}: {m}")
    assert grads_a["bert.encoder.layer.0.attention.self.query.weight"].abs().max() > 0


def _reference_varlen_with_garbage(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0):
    """A flash-style kernel on the CPU: attends within each sequence and leaves the rows
    past cu_seqlens[-1] unwritten (NaN here, as torch.empty_like may hold)."""
    out = torch.full_like(q, float("nan"))
    for a, b in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
        p = torch.softmax(q[a:b].transpose(0, 1) @ k[a:b].transpose(0, 1).transpose(1, 2) / q.size(-1) ** 0.5, -1)
        out[a:b] = (p @ v[a:b].transpose(0, 1)).transpose(0, 1)
    return out


@pytest.mark.parametrize("name, device", [("sdpa", "cpu"), ("math", "cpu"), ("sdpa", "cuda"),
                                          ("flash", "cuda"), ("torch_varlen", "cuda")])
def test_pad_rows_get_zero_output_and_are_never_attended(name, device):
    # device "cuda" only steers the choice (SDPA through the padded grid; the kernel wrappers
    # with a CPU stand-in kernel); the tensors stay on the CPU.
    fake = lambda: _reference_varlen_with_garbage  # noqa: E731
    backend = build_attention(name, device, 0.0, flash=fake, torch_varlen=fake)
    g = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, 5, 6, 14, 17], dtype=torch.int32)
    real, pad, heads, dim = 17, 11, 2, 8
    q, k, v = (torch.randn(real + pad, heads, dim, generator=g, requires_grad=True) for _ in range(3))
    exact = backend.varlen(q[:real], k[:real], v[:real], cu, 8)
    out = backend.varlen(q, k, v, cu, S)
    assert out.shape == q.shape
    torch.testing.assert_close(out[:real], exact, rtol=0, atol=1e-6)
    assert torch.equal(out[real:], torch.zeros(pad, heads, dim))  # exactly 0
    out.square().sum().backward()
    for t in (q, k, v):
        assert torch.equal(t.grad[real:], torch.zeros(pad, heads, dim))  # nothing attends to them
        assert t.grad[:real].abs().sum() > 0
    with torch.no_grad():  # huge pad values change nothing a real row sees
        q2, k2, v2 = (t.detach().clone() for t in (q, k, v))
        for t in (q2, k2, v2):
            t[real:] = 1e4
        torch.testing.assert_close(backend.varlen(q2, k2, v2, cu, S), out.detach(), rtol=0, atol=1e-6)


def test_budget_batch_is_the_exact_batch_plus_padding():
    rungs = (40, 64, 100, 130, 8 * S)
    lay = layout(rungs, 8)
    for seed in range(20):
        exact = collate(samples(8, seed), True, S)
        got = budget.BudgetCollate(lay)(samples(8, seed))
        t, m = exact["input_ids"].numel(), exact["masked_index"].numel()
        assert got.keys() == exact.keys()
        want_rung = min(r for r in rungs if r >= t)  # the smallest that fits
        assert got["input_ids"].numel() == want_rung
        for key in ("input_ids", "token_type_ids", "position_ids"):
            assert torch.equal(got[key][:t], exact[key]) and not got[key][t:].any(), key
            assert got[key].dtype == exact[key].dtype
        # never drops or adds a sample or a label
        assert torch.equal(got["cu_seqlens"], exact["cu_seqlens"])
        assert torch.equal(got["nsp_labels"], exact["nsp_labels"])
        assert got["masked_index"].numel() == got["mlm_labels"].numel() == 8 * P
        assert torch.equal(got["masked_index"][:m], exact["masked_index"])
        assert torch.equal(got["mlm_labels"][:m], exact["mlm_labels"])
        assert (got["mlm_labels"][m:] == IGNORE_INDEX).all()
        assert ((got["masked_index"] >= 0) & (got["masked_index"] < want_rung)).all()
        assert got["max_seqlen"] == S


def test_rung_choice_at_the_edges():
    lay = layout((64, 96, 4 * S), 4)
    exact = collate(samples(4, 0, lengths=[30, 20, 10, 4]), True, S)  # 64 tokens: a rung exactly
    assert budget.pad_batch(exact, lay)["input_ids"].numel() == 64
    above = collate(samples(4, 0, lengths=[32, 32, 30, 30]), True, S)  # 124 > every listed rung
    assert budget.pad_batch(above, lay)["input_ids"].numel() == 4 * S  # the full grid takes it
    # an explicit list that stops short of the full grid gets it appended
    assert parse_budgets([64, 96], 4, S) == (64, 96, 128)
    assert parse_budgets([64, 128], 4, S) == (64, 128)
    too_many = budget.Layout((4 * S,), 3, S)  # fewer prediction slots than the batch holds
    with pytest.raises(ValueError, match="max_predictions_per_seq"):
        budget.pad_batch(collate(samples(4, 1, lengths=[20] * 4), True, S), too_many)


@pytest.mark.parametrize("spec, why", [("abc", "a list of integers"), ("0,64", ">= 1"),
                                       ("96,64", "strictly increasing"), ("64,64", "strictly increasing"),
                                       ("99999", "full grid")])
def test_bad_budgets_name_the_key(spec, why):
    with pytest.raises(ConfigError, match=rf"data\.token_budgets.*{why}"):
        build_config({"data.token_budgets": spec, "run.local_batch_size": 4, "data.max_seq_length": 512})


def test_budgets_need_the_unpadded_layout():
    with pytest.raises(ConfigError, match=r"data\.token_budgets.*model\.unpad=true"):
        build_config({"data.token_budgets": "auto", "model.unpad": "false"})
    cfg = build_config({"data.token_budgets": "auto"})  # the default layout is unpadded
    assert build_config({}).data.token_budgets == []  # off by default: today's behaviour
    assert train_layout(build_config({}), 1) is None
    lay = train_layout(cfg, 1)
    assert lay.rungs[-1] == cfg.run.local_batch_size * 512 and lay.max_seq_length == 512
    assert lay.masked_slots == cfg.run.local_batch_size * cfg.data.max_predictions_per_seq


def test_optimal_ladder_equals_brute_force():
    rng = np.random.default_rng(0)
    top = 10 * budget.ALIGN
    pmf = rng.random(top + 1) ** 4
    pmf /= pmf.sum()
    grid = list(range(budget.ALIGN, top, budget.ALIGN))
    for k in (1, 2, 3, 4):
        best = min(budget.expected_padding(pmf, (*c, top)) for c in itertools.combinations(grid, k - 1))
        got = budget.optimal_ladder(pmf, top, k)
        assert len(got) == k and got[-1] == top
        assert budget.expected_padding(pmf, got) == pytest.approx(best, rel=1e-9), (k, got, best)


def test_auto_ladder_rule():
    rand = build_config({"data.token_budgets": "auto", "run.local_batch_size": 16})
    strat = build_config({"data.token_budgets": "auto", "run.local_batch_size": 16, "run.division": "open",
                          "optim.name": "adam", "sampler.mode": "stratified"})
    out = {}
    for name, cfg in (("random", rand), ("stratified", strat)):
        lay = train_layout(cfg, 8)
        rungs = lay.rungs
        assert 1 < len(rungs) <= budget.MAX_RUNGS and rungs[-1] == 16 * 512
        assert list(rungs) == sorted(set(rungs)) and all(r % budget.ALIGN == 0 for r in rungs)
        assert train_layout(cfg, 8) == lay  # a pure function of the config
        pmf = budget.token_pmf(cfg.sampler, 512, 16, 8, cfg.model.hidden_size)
        out[name] = budget.expected_padding(pmf, rungs)
        # one more rung would save less than MIN_GAIN (or the cap is reached)
        if len(rungs) < budget.MAX_RUNGS:
            more = budget.ladder(pmf, 16 * 512, len(rungs) + 1)
            assert out[name] - budget.expected_padding(pmf, more) < budget.MIN_GAIN
    # the stratified sampler keeps a rank's tokens near the mean: less padding, fewer rungs
    assert out["stratified"] < out["random"] < 0.08
    # the exact random pmf: the mean of T is 16 x the histogram's mean length
    pmf = budget.token_pmf(rand.sampler, 512, 16, 8, rand.model.hidden_size)
    lengths = budget.length_pmf(512)
    assert (pmf * np.arange(len(pmf))).sum() == pytest.approx(16 * (lengths * np.arange(513)).sum(), rel=1e-9)


def test_auto_ladder_assumes_as_many_strata_as_the_counts():
    """Before run_start the manifest is unread: sampler.counts says how many strata it has."""
    cfg = build_config({"data.token_budgets": "auto", "run.local_batch_size": 16, "run.division": "open",
                        "optim.name": "adam", "sampler.mode": "stratified", "sampler.counts": "8,4,4"})
    rungs = train_layout(cfg, 8).rungs
    assert rungs[-1] == 16 * 512 and len(rungs) <= budget.MAX_RUNGS


def test_ladder_tool_measures_what_the_run_builds():
    """tools/budget_ladder.py: the run's own ladder; held-out padding near the expected one."""
    from tools.budget_ladder import LARGE, config, measure

    from bert.flops import head_flops, train_flops, useful_forward_flops

    r = measure("random", 16, 8, 2048, 512, 76)
    assert tuple(r["rungs"]) == train_layout(config("random", 16, 512, 76), 8).rungs
    assert abs(r["pad_measured"] - r["pad_expected"]) < 0.01 and 0 < r["pad_expected"] < 0.08
    assert r["hit"] <= len(r["rungs"]) and r["masked_slots"] == 16 * 76
    # ~0.15 L predictions per sample (capped at 76): about half of the 76 slots are real
    assert 0.4 < r["masked_real_mean"] / r["masked_slots"] < 0.6
    # the FLOP shares against bert/flops.py's count of sampled batches (an independent sum)
    rng = np.random.default_rng(0)
    pmf = budget.length_pmf(512)
    useful = np.mean([train_flops(useful_forward_flops(LARGE, list(ls), int(sum(min(76, max(1, round(0.15 * n)))
                                                                                for n in ls))))
                      for ls in rng.choice(513, size=(400, 16), p=pmf)])
    extra = 3 * head_flops(LARGE, 0, r["masked_slots"] - r["masked_real_mean"])
    assert r["flops_masked"] == pytest.approx(extra / useful, rel=0.03)
    assert 0.005 < r["flops_masked"] < 0.03


def _demo_cfg(demo_data, **extra):
    over = {"data.train_dir": str(demo_data.train), "data.max_seq_length": 128, "model.max_position_embeddings": 128,
            "data.max_predictions_per_seq": 20, "run.seed": 1, "run.local_batch_size": 8, **extra}
    return build_config(over)


def _loader(cfg, rank, world):
    return loader.train_batches(data=cfg.data, sampler=cfg.sampler, model=cfg.model, plan=train_plan(cfg, world),
                                seed=cfg.run.seed, rank=rank, world_size=world)


@pytest.mark.parametrize("extra", [{}, {"run.division": "open", "optim.name": "adam", "sampler.mode": "stratified",
                                        "sampler.strata_width": 32}])
def test_both_loaders_yield_budget_batches(demo_data, extra):
    """The closed shard order and the stratified ids: the same samples as without budgets,
    padded to the auto ladder's rungs."""
    plain = _loader(_demo_cfg(demo_data, **extra), 0, 2)
    cfg = _demo_cfg(demo_data, **{"data.token_budgets": "auto", **extra})
    lay = train_layout(cfg, 2)
    padded = _loader(cfg, 0, 2)
    try:
        for _ in range(4):
            a, b = next(plain), next(padded)
            t = a["input_ids"].numel()
            assert b["input_ids"].numel() == lay.rung(t) and b["masked_index"].numel() == 8 * 20
            assert torch.equal(b["input_ids"][:t], a["input_ids"]) and torch.equal(b["cu_seqlens"], a["cu_seqlens"])
            assert torch.equal(b["nsp_labels"], a["nsp_labels"])
    finally:
        plain.close()
        padded.close()
