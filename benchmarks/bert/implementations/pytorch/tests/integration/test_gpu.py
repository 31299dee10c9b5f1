"""Correctness on a CUDA device, what the CPU suite cannot show: the varlen attention kernels
in bf16 against a float32 reference, fp16 loss scaling on the real model, and the graphed
step against the eager one. Each skips without CUDA, but for the attention reference of the
backends that also run on a CPU (nested, sdpa: float32 there, small shapes).

The device run (bench/device_run.py) runs these in child processes, so a sticky CUDA error
(an illegal address, a device assert) ends that process only, and reads each test's outcome
and numbers from pytest's junit XML: the numbers are ``record_property`` entries, a JSON
object each. The attention verdicts choose the fast stack's backend there.
"""

from __future__ import annotations

import json
import math
import re
import warnings

import pytest
import torch

from bench import common
from bert import loader, step_graph
from bert.attention import build_attention
from bert.config import build_config
from bert.distributed import DistEnv
from bert.trainer import Trainer, train_layout, train_step

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda") if CUDA else torch.device("cpu")
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
SINGLE = DistEnv(rank=0, world_size=1, local_rank=0, master_addr="127.0.0.1", master_port=29500, launcher="single")

# Ragged lengths (1 and 512 included) and pad rows up to 1,024 tokens: a multiple of 64 like
# every budget rung, so Triton specialises n_tokens as the runs' shapes do. 16 heads of 64.
GPU_GEOMETRY = dict(lengths=[512, 1, 37, 300, 129], heads=16, dim=64, total=1024, max_len=512)
CPU_GEOMETRY = dict(lengths=[9, 1, 5], heads=2, dim=16, total=18, max_len=16)


def _record(record_property, name: str, value) -> None:
    record_property(name, json.dumps(value))


def attention_reference(q, k, v, cu: list[int], keep: torch.Tensor | None, p: float) -> torch.Tensor:
    """Per-sequence softmax(Q K^T / sqrt(d)) V in float32, rows past the last sequence 0;
    ``keep`` [B, H, S, S] applies a dropout mask (kept values scaled by 1/(1-p))."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for b, (a, e) in enumerate(zip(cu[:-1], cu[1:])):
        qs, ks, vs = (t[a:e].float().transpose(0, 1) for t in (q, k, v))  # [H, L, D]
        probs = torch.softmax(qs @ ks.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1)
        if keep is not None:
            probs = probs * keep[b, :, : e - a, : e - a] / (1.0 - p)
        out[a:e] = (probs @ vs).transpose(0, 1)
    return out


# The Triton kernel's speed levers (model.triton_fwd_tile, model.triton_dropout_mask), checked
# together as the "triton_levers" backend of the attention test.
TRITON_LEVERS = {"fwd_tile": "128x64", "mask_bits": True}


@pytest.mark.parametrize("backend", ["triton", "triton_levers", "nested", "sdpa"])
def test_attention_matches_fp32_reference(backend, record_property):
    """The varlen kernel against the float32 reference on ragged lengths with pad rows: bf16 on
    CUDA (float32 on a CPU), the forward at dropout 0 (evaluation) and its q/k/v gradients
    (but for triton, whose backward is checked with dropout), and triton at dropout 0.1
    against the reference applying the kernel's own mask (``dropout_mask``), output and
    gradients; ``triton_levers`` is triton with its speed levers on (the 128x64 forward tile,
    the mask stored as bits and read by the backward). Within 0.03 of the reference's scale
    in bf16 (10x that for gradients); pad rows exactly 0. Records the max abs errors and, for
    triton, every compiled kernel's registers and spills as the driver reported them."""
    levers = TRITON_LEVERS if backend == "triton_levers" else {}
    if levers:
        backend = "triton"
    if backend == "triton" and not CUDA:
        pytest.skip("triton runs on CUDA only here (tests/unit/test_triton_attention.py runs it in the interpreter)")
    geo = GPU_GEOMETRY if CUDA else CPU_GEOMETRY
    lengths, heads, dim, total, max_len = (geo[k] for k in ("lengths", "heads", "dim", "total", "max_len"))
    dtype = torch.bfloat16 if CUDA else torch.float32
    tol = 3e-2 if CUDA else 1e-4
    attn = build_attention(backend, DEVICE.type, 0.1, triton_options=levers or None)
    gen = torch.Generator().manual_seed(0)
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    cu = torch.tensor(bounds, dtype=torch.int32, device=DEVICE)
    base = [torch.randn(total, heads, dim, generator=gen).to(DEVICE, dtype) for _ in range(4)]
    # (label, dropout, the kernel's own mask or None, whether the backward is checked)
    runs: list[tuple[str, float, object, bool]] = [("dropout_0", 0.0, None, backend != "triton")]
    if backend == "triton":
        from bert import triton_attention

        seed = torch.tensor([1234], dtype=torch.int64, device=DEVICE)
        keep = triton_attention.dropout_mask(seed, len(lengths), heads, max_len, 0.1)
        runs.append(("dropout_0.1_same_mask", 0.1, (seed, keep), True))
    rec: dict[str, object] = {"lengths": lengths, "tokens": total, "heads": heads, "head_dim": dim, "dtype": str(dtype)}
    if levers:
        rec["levers"] = levers
    for label, p, fixed, grads in runs:
        q, k, v = (t.clone().requires_grad_(grads) for t in base[:3])
        rq, rk, rv = (t.detach().float().requires_grad_(grads) for t in base[:3])
        if fixed is None:
            got = attn.varlen(q, k, v, cu, max_len, p)
            applied, mask = p, None
        else:
            got = triton_attention.varlen(q, k, v, cu, max_len, p, seed=fixed[0], **levers)
            applied, mask = triton_attention.applied_dropout(p), fixed[1]
        want = attention_reference(rq, rk, rv, bounds, mask, applied)
        scale = max(float(want.detach().abs().max()), 1.0)
        errs = {"out": float((got.detach().float() - want.detach()).abs().max())}
        if grads:
            got.backward(base[3])
            want.backward(base[3].float())
            for name, a, b in (("dq", q, rq), ("dk", k, rk), ("dv", v, rv)):
                errs[name] = float((a.grad.float() - b.grad).abs().max())
        pad_zero = bool((got[bounds[-1]:] == 0).all())
        rec[label] = {"max_abs_err": errs, "ref_scale": scale, "pad_rows_zero": pad_zero,
                      "pass": pad_zero and all(e <= tol * scale * (10 if n != "out" else 1) for n, e in errs.items())}
    _record(record_property, "attention", rec)
    if backend == "triton":
        try:  # the driver's counts are a reading, not the verdict
            _record(record_property, "kernels", triton_attention.kernel_stats())
        except Exception as e:  # noqa: BLE001
            _record(record_property, "kernels_error", f"{type(e).__name__}: {e}")
    assert all(r["pass"] for r in rec.values() if isinstance(r, dict)), rec


def _config(**over: str):
    base = {"run.device": DEVICE.type, "run.seed": "0", "data.max_seq_length": "512",
            "data.max_predictions_per_seq": "76"}
    return build_config({**base, **over})


def _batches(cfg, n: int) -> list[dict]:
    """``n`` Wikipedia-length batches of the local batch, collated as the loader collates for
    ``cfg`` (the budget's collate when ``data.token_budgets`` is set), on the device."""
    m, d = cfg.model, cfg.data
    collate = loader.batch_collate(m.unpad, m.pack, d.max_seq_length, train_layout(cfg, 1))
    samples = common.make_batches(n, cfg.run.local_batch_size, d.max_seq_length, d.max_predictions_per_seq,
                                  m.vocab_size, seed=1)
    return [{k: (v.to(DEVICE) if torch.is_tensor(v) else v) for k, v in collate(b).items()} for b in samples]


@needs_cuda
def test_fp16_loss_scaling_on_bert_large(record_property):
    """Eight steps of the trainer's own ``train_step`` on BERT-Large at local batch 16 in fp16
    (autocast, dynamic loss scaling) from a first scale of 2^40, which overflows: a skipped
    step leaves the weights alone, an applied one moves them, the scale backs off until the
    steps go through, and every loss is finite. Records each step's loss, scale and skip."""
    cfg = _config(**{"precision.dtype": "fp16", "run.local_batch_size": "16", "precision.loss_scale_init": str(2.0 ** 40),
                     "precision.loss_scale_backoff": str(2.0 ** -8)})
    learner = Trainer(cfg, SINGLE, DEVICE).learner
    batches = iter(_batches(cfg, 8))
    watched = [p for p in learner.model.parameters() if p.requires_grad][-4:]  # the MLM head's, among others
    rows = []
    for i in range(8):
        before = [p.detach().clone() for p in watched]
        with warnings.catch_warnings():
            # The schedule advances on a skipped step too; torch warns when the first step was one.
            warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()`"))
            loss, skipped = train_step(learner, batches, 1)
        moved = any(not torch.equal(a, p.detach()) for a, p in zip(before, watched))
        rows.append({"step": i + 1, "loss": float(loss), "skipped": int(skipped), "scale": learner.scaler.get_scale(),
                     "weights_moved": moved})
    _record(record_property, "fp16_steps", rows)
    assert rows[0]["skipped"] == 1 and rows[-1]["skipped"] == 0, rows
    assert all(r["weights_moved"] != bool(r["skipped"]) for r in rows), rows
    assert all(math.isfinite(r["loss"]) for r in rows), rows


@needs_cuda
@pytest.mark.parametrize("backend", ["triton", "nested", "sdpa"])
def test_graphed_steps_equal_eager_steps(backend, record_property):
    """The fast stack's CUDA graphs against the eager step (bert/step_graph.py, captured for
    real: the CPU suite's stand-in re-runs the Python, so a stale address is invisible there):
    BERT-Large's width with 2 layers, dropout 0, static token budgets, capturable LAMB, three
    steps on three different batches from one restored state, graphed then eager. Losses and
    every parameter within bf16 tolerance; every batch replayed a captured graph."""
    if backend == "triton":
        pytest.importorskip("triton")
    cfg = _config(**{"model.num_layers": "2", "model.hidden_dropout": "0", "model.attention_dropout": "0",
                     "model.attention_backend": backend, "data.token_budgets": "auto", "run.cuda_graphs": "true",
                     "run.warmup_steps": "1", "run.local_batch_size": "4"})
    trainer = Trainer(cfg, SINGLE, DEVICE)
    learner = trainer.learner
    trainer.prepare_step()
    graphed_step = trainer.step
    assert type(graphed_step).__name__ == "GraphedStep"
    start = step_graph.snapshot(learner)
    initial = [p.detach().clone() for p in learner.model.parameters()]
    batches = _batches(cfg, 3)

    def three(step) -> tuple[list[float], list[torch.Tensor]]:
        feed = iter(batches)
        losses = [float(step(feed, 1)[0]) for _ in range(3)]
        return losses, [p.detach().clone() for p in learner.model.parameters()]

    graphed, after_graphed = three(graphed_step)
    assert not graphed_step.eager_shapes, graphed_step.eager_shapes  # every batch replayed a capture
    step_graph.restore(learner, start)
    eager, after_eager = three(lambda feed, accum: train_step(learner, feed, accum))
    diffs = [float((a - b).abs().max()) for a, b in zip(after_graphed, after_eager)]
    _record(record_property, "graphed_vs_eager", {"graphed_losses": graphed, "eager_losses": eager,
                                                  "max_param_diff": max(diffs)})
    assert all(math.isfinite(x) for x in graphed + eager)
    torch.testing.assert_close(torch.tensor(graphed), torch.tensor(eager), rtol=1e-2, atol=0.0)
    moved = max(float((a - b).abs().max()) for a, b in zip(after_eager, initial))
    assert moved > 0
    for a, b in zip(after_graphed, after_eager):
        torch.testing.assert_close(a, b, rtol=1.6e-2, atol=1e-2 * moved)
