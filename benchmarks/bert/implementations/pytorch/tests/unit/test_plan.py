"""tools/plan.py: the gradient it sends is the model's, its ring arithmetic is the textbook
one, overlap and the knobs move time the way they must, and its communication model
reproduces the grad-sync benchmark's measured simulated-link table (docs/grad_sync.md) within 20%."""

from __future__ import annotations

import json
import sys

import pytest

from bert.config import ModelConfig
from bert.model import BertForPreTraining
from conftest import PKG


sys.path.insert(0, str(PKG / "tools"))
import plan  # noqa: E402


@pytest.mark.parametrize("shape,cfg", [
    (plan.BASE, ModelConfig(hidden_size=768, num_layers=12, num_heads=12, intermediate_size=3072)),
    (plan.Shape(64, 2, 4, 128, 512, 64, 64), ModelConfig(vocab_size=512, hidden_size=64, num_layers=2, num_heads=4,
                                                         intermediate_size=128, max_position_embeddings=64)),
])
def test_gradient_size_is_the_models(shape, cfg):
    assert plan.grad_elements(shape) == sum(p.numel() for p in BertForPreTraining(cfg).parameters())
    bs = plan.buckets(shape, 0.1)
    assert sum(n for n, _ in bs) == plan.grad_elements(shape) and bs[-1][1]  # embedding bucket last


def test_ring_arithmetic_and_overlap():
    s = plan.BASE
    hw = plan.Hardware(nodes=4, gpus_per_node=1, link_gbps=10.0)
    total, exposed = plan.exposed_comm(s, 25.0, plan.links_of(hw), window=0.0)
    want = 2 * 3 / 4 * plan.grad_elements(s) * 4 * 8 / 10e9  # 2(n-1)/n x bytes / bandwidth
    assert total == pytest.approx(want) and exposed == pytest.approx(want)
    # a long backward hides everything but the embedding bucket, ready only at its end
    _, hidden_most = plan.exposed_comm(s, 25.0, plan.links_of(hw), window=100.0)
    emb = plan.buckets(s, 25.0)[-1][0]
    assert hidden_most == pytest.approx(2 * 3 / 4 * emb * 4 * 8 / 10e9)
    half = plan.exposed_comm(s, 25.0, plan.links_of(plan.Hardware(4, 1, 10.0, wire="bf16")), 0.0)[0]
    assert half == pytest.approx(want / 2)


def test_plan_knobs_move_time_the_right_way():
    shape, phases = plan.RECIPES["nvidia-large"]
    hw = plan.Hardware(nodes=4, gpus_per_node=4, link_gbps=10.0, intra_gbps=200.0)
    out = plan.plan(shape, phases, hw, [800.0, 180.0])
    base = out["total_days"]
    assert all(r["seconds"]["exposed_comm"] > 0 for r in out["phases"])
    k = out["knobs_days"]
    assert k["2x link bandwidth"] < base and k["bf16 gradients on the wire"] < base and k["2x nodes"] < base
    assert k["half the accumulation (2x micro-batch, if memory allows)"] <= base  # a wider overlap window
    assert out["best_knob"] == min(k, key=k.get)
    # compute alone: steps x global batch / (GPUs x throughput)
    p1 = out["phases"][0]
    assert p1["seconds"]["compute"] == pytest.approx(7038 * 65536 / 16 / 800.0)


def test_communication_model_against_the_measured_grad_sync_table():
    """docs/grad_sync.md's table was measured by bench/grad_sync.py (2 gloo ranks, simulated links): the
    model, calibrated only on the no-link row, predicts the other rows' exposed time."""
    out = plan.check_bench(plan.runs_from_doc(PKG / "docs" / "grad_sync.md"))
    linked = [r for r in out["rows"] if r["link_gbps"]]
    assert len(linked) == 4 and {"clip_then_allreduce", "bucketwise"} <= set(linked[0])
    assert out["max_abs_error"] < 0.2, out


def test_throughput_from_a_bench_json(tmp_path):
    """bench/gpu_bert_large.py's best useful FLOP/s, divided by bench/flops.py's count of one
    training sample of each phase."""
    from bench import flops

    path = tmp_path / "gpu.json"
    path.write_text(json.dumps({"cases": [{"status": "ok", "useful_tflops_per_s": 100.0},
                                          {"status": "ok", "useful_tflops_per_s": 150.0}, {"status": "oom"}]}))
    shape, phases = plan.RECIPES["nvidia-large"]
    thr = plan.throughputs_from_bench(str(path), shape, phases)
    s = flops.Shape(1024, 24, 4096, 30522)
    assert thr[0] == pytest.approx(150e12 / (3 * flops.useful_forward_flops(s, [128], 20)))
    assert thr[1] == pytest.approx(150e12 / (3 * flops.useful_forward_flops(s, [512], 80)))
    assert thr[0] > 4 * thr[1]  # a 128-token sample is over 4x cheaper than a 512 one (attention)
