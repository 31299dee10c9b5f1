"""The benchmark scripts: their FLOP arithmetic against torch's FLOP counter, and each
script end to end on a tiny model (every code path and the output file; no speed asserted)."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from bench import cases, common, device_run, gpu_bert_large, kernel_profile, measure
from bert import flops, optim
from bert.config import ModelConfig, OptimConfig
from bert.model import BertForPreTraining, pretraining_loss

TINY = ModelConfig(vocab_size=200, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                   max_position_embeddings=64, hidden_dropout=0.0, attention_dropout=0.0,
                   attention_backend="math")


def _count(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def test_flop_model_matches_torch_flop_counter():
    (samples,) = common.make_batches(1, 5, 64, 8, TINY.vocab_size, seed=3)
    lengths, masked = common.batch_stats(samples)
    assert len(set(lengths)) > 1 and max(lengths) < 64  # real padding to skip
    unpadded, padded = common.collate_both([samples], 64)
    shape = common.shape_of(TINY)

    ours = BertForPreTraining(TINY).eval()
    inputs = {k: v for k, v in unpadded[0].items() if k not in ("mlm_labels", "nsp_labels")}
    # The math backend's varlen pads to the batch's longest sequence: charge attention there.
    assert _count(lambda: ours(**inputs)) == flops.forward_flops(shape, lengths, masked,
                                                                 [max(lengths)] * len(lengths))

    transformers = pytest.importorskip("transformers")
    hf = transformers.BertForPreTraining(common.hf_config(TINY, "eager")).eval()
    b = padded[0]
    hf_count = _count(lambda: hf(input_ids=b["input_ids"], token_type_ids=b["token_type_ids"],
                                 attention_mask=b["attention_mask"]))
    # HF's decoder has the real 200 rows; ours multiplies the 256 of model.vocab_pad_multiple.
    hf_shape = dataclasses.replace(shape, vocab=TINY.vocab_size)
    assert shape.vocab == 256 and hf_count == flops.padded_forward_flops(hf_shape, 5, 64)
    # The useful count is below both and is what unpadding can reach.
    assert flops.useful_forward_flops(hf_shape, lengths, masked) < hf_count
    assert flops.train_flops(10) == 30


def test_kernel_classes_of_known_kernel_names():
    """bench/kernel_profile.py's classes for CUDA kernel names of each kind (cuBLAS, our
    Triton attention, CUTLASS's memory-efficient SDPA, ATen's elementwise templates, whose
    names hold "lambda", the foreach optimizer kernels, NCCL) and for CPU aten ops."""
    want = {"sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64": "gemm", "nvjet_tst_128x256_64x4": "gemm",
            "triton_tem_fused_mm_1": "gemm", "_fwd_kernel": "attention", "_bwd_dkdv_kernel": "attention",
            "fmha_cutlassF_bf16_aligned_64x64_rf_sm80": "attention",
            "void at::native::vectorized_elementwise_kernel<4, {lambda(float)#1}>": "elementwise",
            "triton_per_fused_native_layer_norm_0": "elementwise",
            "void at::native::multi_tensor_apply_kernel<TensorListMetadata<4>>": "optimizer",
            "ncclDevKernel_AllReduce_Sum_f32_RING_LL": "communication", "aten::addmm": "gemm",
            "_mask_kernel": "attention", "triton_poi_fused_addmm_gelu_0": "elementwise",
            "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits>": "attention",
            "aten::_foreach_mul_": "optimizer", "aten::native_layer_norm": "elementwise"}
    assert {name: kernel_profile.classify(name) for name in want} == want


def test_kernel_breakdown_of_a_handmade_cuda_trace_and_a_recorded_cpu_one():
    """bench/kernel_profile.py's sums, on what the device's profiler returns (``events()``:
    the device kernels counted, the CPU-side ops of a CUDA run not, a kernel without time
    dropped; the kernels a CPU op inside the optimizer's range launched -- LAMB's per-tensor
    divisions, elementwise by name -- counted as the optimizer's) and on a profile recorded
    here on the CPU (aten ops' self time)."""
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    div = "void at::native::vectorized_elementwise_kernel<4, at::native::BinaryFunctor<float, DivFunctor>>"

    def event(name, device_type=cuda, us=0.0, parent=None, kernels=()):
        return SimpleNamespace(name=name, device_type=device_type, cpu_parent=parent, self_cpu_time_total=us,
                               time_range=SimpleNamespace(elapsed_us=lambda: us),
                               kernels=[SimpleNamespace(name=n, device=0, duration=d) for n, d in kernels])

    step = event("Optimizer.step#Lamb.step", cpu, 900.0)
    foreach = event("aten::_foreach_div", cpu, 50.0, parent=step, kernels=[(div, 1_000.0)] * 3)
    trace = [event("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", us=60_000 / 288)] * 288 + \
        [event("nvjet_tst_128x256_64x4", us=12_000 / 96)] * 96 + [event("_fwd_kernel", us=9_000 / 48)] * 48 + \
        [event("_bwd_dkdv_kernel", us=12_000 / 48)] * 48 + [event("_bwd_dq_kernel", us=9_000 / 48)] * 48 + \
        [event("triton_per_fused_add_native_layer_norm_0", us=18_000 / 194)] * 194 + \
        [event("void at::native::multi_tensor_apply_kernel<TensorListMetadata<4>>", us=12_000 / 30)] * 30 + \
        [event(div, us=1_000.0)] * 9 + [event("ncclDevKernel_AllReduce_Sum_f32_RING_LL")] + \
        [event("aten::mm", cpu, 99_000.0), event("cudaGraphLaunch", cpu, 500.0), step, foreach,
         event("aten::div", cpu, 10.0, kernels=[(div, 1_000.0)] * 6)]
    b = kernel_profile.summarise(kernel_profile.rows(trace, cuda=True), steps=3, cuda=True, top=1)
    assert b["ms_per_step"] == pytest.approx({"gemm": 24.0, "attention": 10.0, "elementwise": 8.0,
                                              "optimizer": 5.0, "communication": 0.0})
    assert b["total_ms_per_step"] == pytest.approx(47.0) and sum(b["share"].values()) == pytest.approx(1.0)
    assert b["kernels_per_step"] == pytest.approx((288 + 96 + 48 * 3 + 194 + 30 + 9) / 3)
    assert b["top"]["gemm"] == [("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", pytest.approx(20.0))]
    assert b["top"]["optimizer"] == [("void at::native::multi_tensor_apply_kernel<TensorListMetadata<4>>",
                                      pytest.approx(4.0))]
    assert "communication" not in b["top"] and b["source"] == "CUDA kernels (CUPTI)"
    assert kernel_profile.summarise([], 1, cuda=True)["note"] == "the profiler recorded no kernel time"

    a, w = torch.randn(64, 64), torch.randn(64, 64)
    recorded = kernel_profile.breakdown(lambda: [torch.relu(a @ w + 1) for _ in range(2)], 2, torch.device("cpu"))
    assert recorded["ms_per_step"]["gemm"] > 0 and recorded["ms_per_step"]["elementwise"] > 0
    assert recorded["ms_per_step"]["attention"] == recorded["ms_per_step"]["optimizer"] == 0
    assert recorded["source"] == "aten ops' CPU self time" and recorded["kernels_per_step"] >= 3


def test_kernel_breakdown_counts_what_lamb_runs_as_the_optimizer():
    """A recorded CPU profile of BERT steps with the capturable LAMB (the graphed step's):
    its bias corrections' aten::pow and aten::stack, elementwise by name, are the
    optimizer's class (aten::pow, which only LAMB runs here, is not elementwise's), as is
    everything inside its step."""
    model = BertForPreTraining(TINY)
    opt, _ = optim.build_optimizer(model, OptimConfig(), "cpu", capturable=True)
    (samples,) = common.make_batches(1, 3, 64, 8, TINY.vocab_size, seed=2)
    unpadded, _ = common.collate_both([samples], 64)
    batch = unpadded[0]
    inputs = {k: v for k, v in batch.items() if k not in ("mlm_labels", "nsp_labels")}

    def step():
        pretraining_loss(*model(**inputs), batch["mlm_labels"], batch["nsp_labels"]).backward()
        opt.step()
        opt.zero_grad()

    step()
    b = kernel_profile.breakdown(lambda: [step() for _ in range(2)], 2, torch.device("cpu"), top=100)
    mine = {name for name, _ in b["top"]["optimizer"]}
    assert {"aten::pow", "aten::stack", "aten::_foreach_div"} <= mine, sorted(mine)
    assert "aten::pow" not in {name for name, _ in b["top"]["elementwise"]}
    assert kernel_profile.classify("aten::pow") == "elementwise" and b["ms_per_step"]["gemm"] > 0


def test_gpu_script_foreach_adamw_is_not_the_fused_kernel():
    """The AdamW pair is built by bert.optim.build_optimizer: the foreach case's groups say
    foreach, and its step runs torch's multi-tensor path, not the fused kernel."""
    args = argparse.Namespace(seed=0, device_type="cpu", seq_len=64, max_pred=10, cpu_smoke=True,
                              fast_attention="triton")
    flags = {}
    for impl in ("fused", "foreach"):
        case = cases.Case(impl, {"run.local_batch_size": "2", "optim.name": "adamw", "optim.impl": impl})
        cfg, own = measure.case_config(case, args)
        trainer, _, _ = measure.build_case(cfg, own, torch.device("cpu"))
        flags[impl] = measure._flags(trainer.learner.optimizer)
    assert flags["fused"]["fused"] is True and not flags["fused"]["foreach"]
    assert flags["foreach"]["foreach"] is True and not flags["foreach"]["fused"]


def test_gpu_scripts_refuse_without_a_gpu_unless_smoke():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert gpu_bert_large.main(["--out", "/nonexistent/x.json"]) == 2
    assert device_run.main(["--out", "/nonexistent/x.json"]) == 2

def test_a_failed_task_is_recorded_without_losing_a_measured_throughput():
    """bench/measure.py's record_failure (both scripts' ``except``): an OOM or an error is the
    status of a task that measured nothing; a case whose throughput is in stays ``ok``."""
    recs = []
    for rec, exc in (({}, torch.OutOfMemoryError("CUDA out of memory")), ({}, ValueError("bad shape")),
                     ({"status": "ok", "seq_per_s": 5.0}, RuntimeError("late"))):
        try:
            raise exc
        except Exception as e:  # noqa: BLE001 - as the scripts catch it
            measure.record_failure(rec, e)
        recs.append(rec)
    assert [r["status"] for r in recs] == ["oom", "error: ValueError: bad shape", "ok"]
    assert recs[2]["seq_per_s"] == 5.0 and all("Traceback" in r["traceback"] for r in recs)


def test_device_run_skips_a_backend_that_failed_its_check_but_never_sdpa():
    """bench/device_run.py's rule after the attention check: a case on a backend whose test
    failed (or left no verdict) is skipped, saying why, but for sdpa, the last resort (the
    baseline's backend): its cases run and carry the verdict; a case with another case's
    overrides is skipped as a repeat."""
    args = argparse.Namespace(fast_attention="triton")
    baseline, fast_big, _ = cases.head_cases(16, 96)
    nested = cases._case("fast_nested", 96, f=cases.without(cases.FAST, model__attention_backend="nested"))
    result = {"checks": {"attention": {"backends": {"triton": {"outcome": "failed"}, "nested": {"outcome": "error"},
                                                    "sdpa": {"outcome": "error"}}}}, "cases": []}
    assert device_run.blocked(fast_big, args, result) == "skipped: the attention check of triton failed"
    assert device_run.blocked(nested, args, result) == "skipped: the attention check of nested error"
    assert device_run.blocked(baseline, args, result) == ""
    assert device_run.attention_verdict(baseline, args, result) == "error"
    args.fast_attention = "sdpa"  # the check's choice when neither triton nor nested passed
    assert device_run.blocked(fast_big, args, result) == ""
    done = cases.resolved_overrides(fast_big, args)
    result["cases"].append({"case": "fast_b96", "status": "ok", "overrides": done})
    sdpa = cases._case("fast_sdpa", 96, f=cases.without(cases.FAST, model__attention_backend="sdpa"))
    assert device_run.blocked(sdpa, args, result) == "skipped: the same overrides as fast_b96"
    assert device_run.attention_verdict(fast_big, args, {"checks": {}, "cases": []}) == ""


def test_fast_stack_changes_apply_where_a_case_has_the_fast_stacks_value():
    """An attempt's changes from the fast stack (``fast_stack_changes``, the backend resolved)
    and ``--fast-stack``'s parse; ``resolved_overrides`` applies them to a case only where it
    keeps the fast stack's value: a case that sets the key itself keeps its own, a case not
    built on the fast stack is untouched."""
    g = cases
    args = argparse.Namespace(fast_attention="triton", fast_stack={})
    attempts = {c.name: c for c in g.headline_attempts(96, "triton")}
    assert list(attempts) == ["fast_b96", "fast_no_graphs_b96", "fast_no_compile_layers_b96", "fast_eager_b96",
                              "fast_nested_b96", "fast_nested_eager_b96", "fast_sdpa_b96", "fast_sdpa_eager_b96"]
    assert all(c.profile for c in attempts.values())
    assert g.fast_stack_changes(attempts["fast_b96"], args) == {}
    assert g.fast_stack_changes(attempts["fast_nested_eager_b96"], args) == {
        "model.attention_backend": "nested", "run.cuda_graphs": "false", "model.compile_layers": "false"}
    assert [c.name for c in g.headline_attempts(96, "sdpa")][-1] == "fast_eager_b96"
    args.fast_stack = g.parse_stack("run.cuda_graphs=false")
    assert args.fast_stack == {"run.cuda_graphs": "false"}
    fast_small = g.head_cases(16, 96)[2]
    no_compile = {c.name: c for c in g.ablations(96)}["fast_no_compile_layers_b96"]
    assert g.resolved_overrides(fast_small, args)["run.cuda_graphs"] == "false"
    assert g.resolved_overrides(no_compile, args)["model.compile_layers"] == "false"
    assert "run.cuda_graphs" not in g.resolved_overrides(g.head_cases(16, 96)[0], args)  # the baseline
    for bad in ("model.hidden_size=8", "run.cuda_graphs"):
        with pytest.raises(argparse.ArgumentTypeError, match="--fast-stack"):
            g.parse_stack(bad)



def test_attention_check_inconclusive_blocks_nothing_and_triton_levers_follow_their_verdict(monkeypatch):
    """No attention test ran (every child failed before its tests), or none passed on a GPU in
    an Exclusive_Process compute mode (a child cannot open a context beside this process's):
    the check is inconclusive, the fast stack takes triton and no case is blocked by it; tests
    that ran and failed otherwise stand (sdpa). With verdicts: a Triton lever case follows the
    levers' verdict, and is skipped while the fast stack runs another backend."""
    def no_test_ran(groups, tmp, timeout_s):
        return {t: {"outcome": "error", "message": "the child ended with exit 1 and no verdict"} for g in groups for t in g}

    def every_test_failed(groups, tmp, timeout_s):
        return {f"{t}": {"outcome": "failed", "seconds": 1.0, "message": "CUDA error: busy or unavailable"}
                for g in groups for t in g}

    monkeypatch.setattr(device_run, "run_tests", every_test_failed)
    assert device_run.check_attention(Path("."), 90.0)["chosen"] == "sdpa"  # the tests ran: their verdict stands
    att = device_run.check_attention(Path("."), 90.0, exclusive=True)
    assert att["inconclusive"] is True and "exclusive compute mode" in att["why"]
    monkeypatch.setattr(device_run, "run_tests", no_test_ran)
    att = device_run.check_attention(Path("."), 90.0)
    assert att["inconclusive"] is True and att["chosen"] == "triton"
    result = {"checks": {"attention": att}, "cases": []}
    args = argparse.Namespace(fast_attention="triton", fast_stack={})
    fast_big = cases.head_cases(16, 96)[1]
    assert device_run.blocked(fast_big, args, result) == ""
    bits = {c.name: c for c in cases.levers(96)}["fast_mask_bits_b96"]
    result["checks"]["attention"] = {"backends": {b: {"outcome": "passed"} for b in cases.FAST_BACKENDS},
                                     "triton_levers": {"outcome": "failed"}}
    assert device_run.blocked(bits, args, result) == "skipped: the attention check of triton with its levers failed"
    assert device_run.blocked(fast_big, args, result) == ""
    args.fast_attention = "nested"
    assert device_run.blocked(bits, args, result) == ("skipped: model.triton_dropout_mask: a lever of the triton "
                                                      "backend, the fast stack runs nested")
