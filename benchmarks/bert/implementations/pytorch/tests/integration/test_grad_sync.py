"""bert/grad_sync.py: bucket-wise clipping before the allreduce, compression, accumulation,
closed-division clipping, loss scale and inf/nan.

One spawn of 2 gloo ranks runs every scenario on a tiny BERT (module fixture); the tests
compare what DDP left in the gradients with the same math done in this process from each
rank's local gradients, with plain DDP, and with torch's clip_grad_norm_.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

from bert import grad_sync
from bert.config import GradSyncConfig, PrecisionConfig
from bert.precision import build_precision, build_scaler
from bert.state import Learner
from bert.trainer import train_step
from conftest import end_worker, free_port
from grad_sync_helpers import (CAP_MB, CLIP, INF_PARAM, _hook_run, assert_grads_close, bucketwise_oracle,
                               fresh_model, global_batch, grads, loss_of, part, single_process_grads)


def _loop_run(rank, gcfg, max_grad_norm, accum):
    """One step of bert.trainer.train_step (the loop's own code) with ``accum`` micro-batches."""
    model = fresh_model()
    ddp = DDP(model, bucket_cap_mb=CAP_MB)
    sync = grad_sync.build(gcfg, ddp, model.parameters(), max_grad_norm)
    seen = {}

    def after_sync():
        sync.after_sync()
        seen.update(grads(model))

    observed = dataclasses.replace(sync, after_sync=after_sync)

    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _s: 1.0)
    mine = part(global_batch(0), rank, 2)
    batches = iter([part(mine, i, accum) for i in range(accum)])
    pcfg = PrecisionConfig(dtype="fp32")
    prec = build_precision(pcfg, "cpu")
    learner = Learner(model=model, train_model=ddp, optimizer=opt, scheduler=sched,
                      scaler=build_scaler(pcfg, prec, "cpu"), precision=prec, grad_sync=observed,
                      device=torch.device("cpu"))
    train_step(learner, batches, accum)
    return seen


def mlp():
    """Three bias-free matrices: with one sample per rank each weight's gradient has rank 1
    per rank, so the 2-rank mean has rank <= 2 and rank-2 PowerSGD reproduces it exactly."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 48, bias=False), torch.nn.Tanh(),
                               torch.nn.Linear(48, 40, bias=False), torch.nn.Tanh(),
                               torch.nn.Linear(40, 24, bias=False))


def mlp_input(seed, rank):
    return torch.randn(1, 32, generator=torch.Generator().manual_seed(100 * seed + rank))


def _powersgd_run(rank, gcfg, steps=3):
    """``steps`` backward passes of ``mlp`` through DDP with the hook, every matrix its own
    bucket; PowerSGD compresses from step ``powersgd_start_step`` on. Returns the reduced
    gradients of the last step, this rank's local ones, and the bucket layout."""
    model = mlp()
    ddp = DDP(model, bucket_cap_mb=0.001)  # ~1 KB: one matrix per bucket, buckets in flight together
    sync = grad_sync.build(gcfg, ddp, model.parameters(), 0.0)
    for step in range(steps):
        model.zero_grad(set_to_none=True)
        ddp(mlp_input(step, rank)).pow(2).sum().backward()
    local = mlp()
    local(mlp_input(steps - 1, rank)).pow(2).sum().backward()
    name_of = {p.data_ptr(): n for n, p in model.named_parameters()}
    members = [[name_of[p.data_ptr()] for p in b.parameters()] for b in ddp.reducer._get_zeros_like_grad_buckets()]
    out = dict(grads=grads(model), local=grads(local), members=members)
    if sync.clip is not None:
        out.update(thresholds=sync.clip.thresholds)
    return out


def _powersgd_resume(rank, gcfg):
    """Steps 0-2 (2 compressed), PowerSGD state through torch.save/load(weights_only) into a
    fresh DDP + hook (a restarted process), then steps 3 and 4 there."""
    import io

    model = mlp()
    ddp = DDP(model, bucket_cap_mb=0.001)
    sync = grad_sync.build(gcfg, ddp, model.parameters(), 0.0)
    for step in range(3):
        model.zero_grad(set_to_none=True)
        ddp(mlp_input(step, rank)).pow(2).sum().backward()
    buf = io.BytesIO()
    torch.save(sync.state_dict(), buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    model2 = mlp()
    ddp2 = DDP(model2, bucket_cap_mb=0.001)
    sync2 = grad_sync.build(gcfg, ddp2, model2.parameters(), 0.0)
    sync2.load_state_dict(saved, torch.device("cpu"))
    again = sync2.state_dict()
    out = {"saved_iter": saved["iter"], "round_trip": again["iter"] == saved["iter"] and all(
        again[k].keys() == saved[k].keys() and all(torch.equal(again[k][i], saved[k][i]) for i in saved[k])
        for k in ("error", "p", "q")) and torch.equal(again["rng"]["keys"], saved["rng"]["keys"])}
    for step in (3, 4):
        model2.zero_grad(set_to_none=True)
        ddp2(mlp_input(step, rank)).pow(2).sum().backward()
        out[step] = grads(model2)
    local = mlp()
    local(mlp_input(3, rank)).pow(2).sum().backward()
    out["local3"] = grads(local)
    return out


def _local_grads(rank, seed, scale=1.0):
    model = fresh_model()
    loss_of(model, part(global_batch(seed), rank, 2), scale).backward()
    return grads(model)


def _worker(rank, port, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    G = GradSyncConfig
    scenarios = {
        "local": lambda: _local_grads(rank, 1),
        "plain": lambda: _hook_run(rank, G(compression="none")),  # DDP's own allreduce, no hook
        "count": lambda: _hook_run(rank, G(bucket_clip_norm=CLIP, bucket_clip_rule="count")),
        "size": lambda: _hook_run(rank, G(bucket_clip_norm=CLIP, bucket_clip_rule="size")),
        "count_big_buckets": lambda: _hook_run(rank, G(bucket_clip_norm=CLIP), cap=0.05),
        "huge": lambda: _hook_run(rank, G(bucket_clip_norm=1e6)),
        "bf16": lambda: _hook_run(rank, G(compression="bf16")),
        "fp16": lambda: _hook_run(rank, G(compression="fp16")),
        "count_bf16": lambda: _hook_run(rank, G(bucket_clip_norm=CLIP, compression="bf16")),
        "scaled": lambda: _hook_run(rank, G(bucket_clip_norm=CLIP), scale=torch.tensor(1024.0)),
        "inf": lambda: _hook_run(rank, G(bucket_clip_norm=CLIP), scale=torch.tensor(1024.0), inject_inf=True),
        "accum": lambda: _loop_run(rank, G(), 0.0, accum=2),
        "closed": lambda: _loop_run(rank, G(), CLIP, accum=1),
        "psgd_r2": lambda: _powersgd_run(rank, G(compression="powersgd", powersgd_rank=2, powersgd_start_step=2)),
        "psgd_r1": lambda: _powersgd_run(rank, G(compression="powersgd", powersgd_rank=1, powersgd_start_step=2)),
        "psgd_warmup": lambda: _powersgd_run(rank, G(compression="powersgd", powersgd_rank=1, powersgd_start_step=4)),
        "psgd_resume": lambda: _powersgd_resume(rank, G(compression="powersgd", powersgd_rank=1,
                                                        powersgd_start_step=2)),
        "psgd_clip": lambda: _powersgd_run(rank, G(compression="powersgd", powersgd_rank=2, powersgd_start_step=2,
                                                   bucket_clip_norm=0.5)),
    }
    res = {}
    for name, run in scenarios.items():
        res[name] = run()
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    end_worker()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("grad_sync")
    ctx = mp.spawn(_worker, args=(free_port(), str(out)), nprocs=2, join=False)
    deadline = time.monotonic() + 300  # a hang fails this module instead of blocking the suite
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for proc in ctx.processes:
                proc.kill()
            pytest.fail("the 2-rank grad_sync worker did not finish within 300 s")
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def oracle_thresholds(members, rule, max_norm=CLIP, model=fresh_model):
    """Each bucket's threshold from the buckets the test read from DDP's reducer (``members``,
    in bucket-index order) and the parameter sizes, by the paper's two rules: C / sqrt(B)
    for "count", C * sqrt(n_b / N) for "size". Not bucket_thresholds: this is its oracle."""
    sizes = {n: p.numel() for n, p in model().named_parameters()}
    numels = [sum(sizes[n] for n in names) for names in members]
    if rule == "count":
        return [max_norm / math.sqrt(len(numels))] * len(numels)
    return [max_norm * math.sqrt(n / sum(numels)) for n in numels]


@pytest.mark.parametrize("rule", ["count", "size"])
def test_bucketwise_clip_equals_the_math_on_local_gradients(ranks, rule):
    run = ranks[0][rule]
    assert len(run["members"]) > 3  # several buckets, or this tests nothing
    thresholds = oracle_thresholds(run["members"], rule)
    want, norms = bucketwise_oracle([r["local"] for r in ranks], run["members"], thresholds)
    assert_grads_close(run["grads"], want, atol=1e-7, rtol=1e-5)
    assert_grads_close(ranks[1][rule]["grads"], want, atol=1e-7, rtol=1e-5)
    assert all(n <= t * (1 + 1e-6) for n, t in norms)
    assert sum(n < t * 0.999 for n, t in norms) < len(norms)  # some bucket really was clipped
    assert math.isclose(sum(t * t for t in thresholds), CLIP ** 2, rel_tol=1e-9)
    if rule == "size":  # buckets of different sizes, so the two rules (and bucket orders) differ
        assert len(set(thresholds)) > 1
    # the reduced gradient's global norm obeys the bound
    total = torch.linalg.vector_norm(torch.stack([g.norm() for g in run["grads"].values()]))
    assert total <= CLIP * (1 + 1e-5)


def test_thresholds_follow_the_buckets_ddp_built(ranks):
    small, big = ranks[0]["count"], ranks[0]["count_big_buckets"]
    sizes = {n: p.numel() for n, p in fresh_model().named_parameters()}
    for run in (small, big):
        assert run["layout"] == [sum(sizes[n] for n in names) for names in run["members"]]
        assert run["thresholds"] == pytest.approx(oracle_thresholds(run["members"], "count"))
    assert len(big["members"]) < len(small["members"])
    size = ranks[0]["size"]
    assert size["layout"] == [sum(sizes[n] for n in names) for names in size["members"]]
    assert size["thresholds"] == pytest.approx(oracle_thresholds(size["members"], "size"))


def test_threshold_above_every_norm_equals_plain_ddp(ranks):
    for r in ranks:
        assert_grads_close(r["huge"]["grads"], r["plain"]["grads"], atol=0, rtol=0)
    assert_grads_close(ranks[0]["plain"]["grads"], single_process_grads(1), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("run, ref, u", [("bf16", "plain", 2.0 ** -8), ("fp16", "plain", 2.0 ** -11),
                                         ("count_bf16", "count", 2.0 ** -8)])
def test_compression_within_the_dtype_rounding(ranks, run, ref, u):
    got, want = ranks[0][run]["grads"], ranks[0][ref]["grads"]
    a, b = ranks[0]["local"], ranks[1]["local"]
    for n in want:
        # each half-precision rounding (cast of each mean share, their sum) costs u relative
        bound = 3 * u * (a[n].abs() + b[n].abs()) / 2 + 1e-7
        assert ((got[n] - want[n]).abs() <= bound).all(), n
    assert any(not torch.equal(got[n], want[n]) for n in want)  # the wire really was narrower


def test_loss_scale_clips_the_unscaled_gradient(ranks):
    scaled = {n: g / 1024.0 for n, g in ranks[0]["scaled"]["grads"].items()}
    assert_grads_close(scaled, ranks[0]["count"]["grads"], atol=1e-7, rtol=1e-5)


def test_inf_in_a_bucket_reaches_the_scaler_and_is_not_clipped_away(ranks):
    run, ref = ranks[0]["inf"], ranks[0]["scaled"]
    locals_ = [{n: g * 1024.0 for n, g in r["local"].items()} for r in ranks]
    hit = next(i for i, names in enumerate(run["members"]) if INF_PARAM in names)
    for r in ranks:
        assert torch.isinf(r["inf"]["grads"][INF_PARAM][0])
    for i, names in enumerate(run["members"]):
        if i == hit:
            # rank 0's bucket untouched (coefficient 1), rank 1's clipped as usual
            t = oracle_thresholds(run["members"], "count")[i] * 1024.0
            g1 = torch.cat([locals_[1][n].flatten() for n in names])
            c1 = min(1.0, t / (g1.norm().item() + grad_sync.EPS))
            for n in names:
                want = (locals_[0][n] + c1 * locals_[1][n]) / 2
                got = run["grads"][n]
                if n == INF_PARAM:
                    got, want = got[1:], want[1:]
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        else:
            for n in names:
                assert torch.equal(run["grads"][n], ref["grads"][n]), n


def test_accumulation_equals_one_step_on_the_larger_batch(ranks):
    assert_grads_close(ranks[0]["accum"], single_process_grads(0), atol=1e-6, rtol=1e-5)


def test_closed_mode_equals_clip_grad_norm_after_allreduce(ranks):
    want = single_process_grads(0, clip=CLIP)
    for r in ranks:
        assert_grads_close(r["closed"], want, atol=1e-7, rtol=1e-5)


def _mean(ranks, run):
    a, b = (r[run]["local"] for r in ranks)
    return {n: (a[n] + b[n]) / 2 for n in a}


def test_powersgd_of_sufficient_rank_equals_the_allreduce(ranks):
    """Rank-2 factors of a rank-2 mean gradient lose nothing: PowerSGD (compressed: 2(n+m)
    numbers per n x m matrix) returns the plain mean, on both ranks, with its buckets in
    flight together on gloo (torch's hook alone aborts on a collective mismatch there)."""
    assert len(ranks[0]["psgd_r2"]["members"]) == 3
    want = _mean(ranks, "psgd_r2")
    for r in ranks:
        assert_grads_close(r["psgd_r2"]["grads"], want, atol=1e-6, rtol=1e-4)


def test_powersgd_of_lower_rank_compresses_and_ranks_agree(ranks):
    want = _mean(ranks, "psgd_r1")
    got = ranks[0]["psgd_r1"]["grads"]
    assert_grads_close(ranks[1]["psgd_r1"]["grads"], got, atol=0, rtol=0)  # one result for all ranks
    for n, g in got.items():
        assert torch.linalg.matrix_rank(g) == 1 and torch.linalg.matrix_rank(want[n]) == 2, n
        # the rank-1 part of the mean it keeps is no larger than the mean itself
        assert g.norm() <= want[n].norm() * (1 + 1e-5) and not torch.allclose(g, want[n], rtol=1e-2), n


def test_powersgd_reduces_exactly_before_its_start_step(ranks):
    want = _mean(ranks, "psgd_warmup")
    assert_grads_close(ranks[0]["psgd_warmup"]["grads"], want, atol=1e-7, rtol=1e-5)


def test_powersgd_after_bucketwise_clip_equals_the_clip_math(ranks):
    run = ranks[0]["psgd_clip"]
    thresholds = oracle_thresholds(run["members"], "count", max_norm=0.5, model=mlp)
    want, norms = bucketwise_oracle([r["psgd_clip"]["local"] for r in ranks], run["members"], thresholds)
    assert sum(n < t * 0.999 for n, t in norms) < len(norms)  # some bucket really was clipped
    assert_grads_close(run["grads"], want, atol=1e-6, rtol=1e-4)


def test_powersgd_state_survives_a_checkpoint_and_compression_resumes(ranks):
    """The per-rank PowerSGD state round-trips through torch.save/load(weights_only=True); the
    restarted process's first step (DDP's initial bucket layout) is reduced exactly, the next
    is compressed again from the restored state, and the ranks agree throughout."""
    r0, r1 = (r["psgd_resume"] for r in ranks)
    assert r0["round_trip"] and r1["round_trip"] and r0["saved_iter"] >= 2
    exact = {n: (r0["local3"][n] + r1["local3"][n]) / 2 for n in r0["local3"]}
    assert_grads_close(r0[3], exact, atol=1e-7, rtol=1e-5)
    assert_grads_close(r1[4], r0[4], atol=0, rtol=0)
    assert all(torch.linalg.matrix_rank(g) == 1 for g in r0[4].values())  # rank-1 PowerSGD again
