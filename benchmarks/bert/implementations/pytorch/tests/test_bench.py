"""The benchmark scripts: their FLOP arithmetic against torch's FLOP counter, and each
script end to end on a tiny model (every code path and the output file; no speed asserted)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from bench import common, flops, gpu_bert_large, vs_hf
from bert.config import ModelConfig
from bert.model import BertForPreTraining
from conftest import PKG

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
    assert hf_count == flops.padded_forward_flops(shape, 5, 64)
    # The useful count is below both and is what unpadding can reach.
    assert flops.useful_forward_flops(shape, lengths, masked) < hf_count
    assert flops.train_flops(10) == 30


def test_vs_hf_smoke_prints_the_interface_keys(capsys, tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "vs_hf.json"
    assert vs_hf.main(["--setup", "smoke", "--json", "--reps", "2", "--steps", "1", "--batches", "2",
                       "--mem-steps", "1", "--out", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(out.read_text())
    for key in ("ours_tokens_per_s", "hf_tokens_per_s", "ratio", "flop_limit_ratio",
                "ours_peak_rss_mb", "hf_peak_rss_mb", "mfu"):
        assert isinstance(printed[key], float) and printed[key] > 0, key
    assert printed["flop_limit_ratio"] > 1
    assert len(printed["per_rep"]["ratio"]) == 2
    assert printed["impl"]["ours"] == "adamw:torch-fused"


def test_gpu_script_cpu_smoke_runs_every_case(tmp_path):
    out = tmp_path / "gpu.json"
    assert gpu_bert_large.main(["--cpu-smoke", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    names = [c["name"] for c in r["cases"]]
    assert names == ["sweep_b2", "sweep_b4", "padded", "adamw_fused", "adamw_foreach",
                     "lamb_foreach", "compiled"]
    for c in r["cases"]:
        assert c["status"] == "ok", c
        assert c["seq_per_s"] > 0 and 0 < c["mfu"] and torch.isfinite(torch.tensor(c["final_loss"]))
    by = {c["name"]: c for c in r["cases"]}
    assert by["adamw_fused"]["optimizer_impl"] == "adamw:torch-fused"
    assert by["adamw_foreach"]["optimizer_impl"] == "adamw:torch-foreach"
    assert "compile(eager)" in by["compiled"]["optimizer_impl"]
    assert by["padded"]["unpad"] is False
    assert r["gemm_peak_bf16_tflops"] > 0 and r["cpu_smoke"] is True


def test_gpu_script_refuses_without_a_gpu_unless_smoke():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert gpu_bert_large.main(["--out", "/nonexistent/x.json"]) == 2


def test_grad_sync_bench_smoke_prints_the_interface_keys():
    """bench/grad_sync.py end to end (2 gloo ranks, tiny model, simulated link): every variant
    timed and the issue's interface keys present; no speed asserted."""
    r = subprocess.run([sys.executable, "bench/grad_sync.py", "--tiny", "--reps", "1", "--json", "--link-gbps", "10",
                        "--bucket-cap-mb", "0.1"], cwd=PKG, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout.strip().splitlines()[-1])
    for key in ("no_clip", "clip_then_allreduce", "bucketwise", "clip_after_allreduce", "bucketwise_bf16",
                "bucketwise_powersgd", "compute_only"):
        assert report[key] > 0, key
    assert "hidden_fraction" in report and report["link_gbps"] == 10 and report["n_buckets"] > 1
    # The step split at its last gradient: a tail per variant, and never longer than the step.
    assert "hidden_fraction_step" in report
    for key, steps in report["samples"].items():
        tails = report["tail_samples"][key]
        assert len(tails) == len(steps) == 1 and 0 < tails[0] < steps[0], key


def test_grad_sync_bench_refuses_a_variant_set_without_the_compared_five():
    r = subprocess.run([sys.executable, "bench/grad_sync.py", "--tiny", "--variants", "no_clip,bucketwise"],
                       cwd=PKG, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--variants" in r.stderr
