"""The benchmark scripts: their FLOP arithmetic against torch's FLOP counter, and each
script end to end on a tiny model (every code path and the output file; no speed asserted)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from bench import gpu_bert_large, vs_hf
from bert.config import build_config
from conftest import PKG


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


# The cases of gpu_bert_large's plan whose keys every tree has (the others need parts A-E of
# issue 14 and are "skipped: ..." on a tree without them); --cpu-smoke's batches 2, 3, 4.
OLD_CASES = ["baseline_b2", "adamw_fused_b3", "adamw_foreach_b3", "default_b3", "padded_b3",
             "lamb_foreach_b3", "compiled_b3"]


# What the smoke test runs: one task of each kind (the plan's other cases repeat these
# paths with other overrides; the nested backend's compile alone would take a minute here).
SMOKE_RUN = ["check_attention", "check_attention_blocks", "baseline_b2", "fast_b2", "fast_b4",
             "check_fp16", "check_demo", "adamw_fused_b3", "adamw_foreach_b3",
             "default_b3", "padded_b3", "lamb_foreach_b3", "compiled_b3", "bogus_b2"]


def test_gpu_script_cpu_smoke_runs_every_case(tmp_path, capsys):
    out = tmp_path / "gpu.json"
    assert gpu_bert_large.main(["--cpu-smoke", "--out", str(out), "--commit", "abc123", "--only", ",".join(SMOKE_RUN),
                                "--case", "bogus_b2:run.local_batch_size=2,model.no_such_key=1"]) == 0
    r = json.loads(out.read_text())
    # The order: the attention check, the same-run baseline, the fast stack at the small and
    # the big batch, what decides the defaults, the fp16 and demo checks, then the rest.
    assert r["plan"] == ["check_attention", "baseline_b2", "fast_b2", "fast_b4", "check_attention_blocks",
                         "fast_no_graphs_b4", "fast_nested_b4", "fast_compiled_lamb_b4", "fast_no_compile_layers_b4",
                         "fast_no_fused_qkv_b4", "fast_vocab_unpadded_b4", "fast_fp8_tensorwise_b4",
                         "fast_fp8_rowwise_b4", "check_fp16", "check_demo", "fast_sdpa_b4", "fast_no_budget_no_graphs_b4",
                         "default_budget_b4", "default_compiled_lamb_b4", "adamw_fused_b3", "adamw_foreach_b3",
                         "fast_b3", "default_b3", "default_b4", "padded_b3", "lamb_foreach_b3", "compiled_b3",
                         "bogus_b2"]
    names = [c["case"] for c in r["cases"]]
    assert names == [n for n in r["plan"] if n in SMOKE_RUN and not n.startswith("check_")]
    # The plan's expected seconds were printed before anything ran, and are in the file.
    printed = capsys.readouterr().out
    assert printed.index("expected in all") < re.search(r"^check_attention +ok", printed, re.M).start()
    assert set(r["expected_s"]) == set(SMOKE_RUN) and r["compile_cache"] == "cold"
    assert r["commit"] == "abc123" and r["cpu_smoke"] is True and r["gemm_peak_tflops"] > 0
    assert r["device_name"].startswith("cpu") and r["versions"]["torch"] == torch.__version__
    by = {c["case"]: c for c in r["cases"]}
    # The fast stack runs on the CPU with stand-ins for its CUDA-only values (math attention,
    # eager steps): budgets, the warm-ups and the compiled layers. It compiles the layer in
    # its first case's warm-ups (training, then evaluation) and never after them; the case
    # at the big batch reuses that compile (no dynamo reset between cases).
    for name in ("fast_b2", "fast_b4"):
        c = by[name]
        assert c["status"] == "ok" and c["smoke_stand_ins"] == {"model.attention_backend": "math",
                                                                "run.cuda_graphs": "false"}, c
        assert c["compiles_after_prepare"] == 0 and c["eval_compiles"] == 0, c
        assert c["warmup_s"] > 0 and c["eval_warmup_s"] > 0 and "capture_s" in c and c["eval_ms_per_batch"] > 0
        assert len(c["token_budget_rungs"]) > 1 and c["eval_batch_shapes"] > 1
    assert by["fast_b2"]["compiles_in_prepare"] == 2 and by["fast_b2"]["compile_s"] > 0
    assert by["fast_b4"]["compiles_in_prepare"] == 0
    for c in r["cases"]:
        # A key or value this tree lacks, or a trainer refusal (CUDA graphs on a CPU), skips;
        # nothing errors.
        assert c["status"] == "ok" or c["status"].startswith("skipped: "), c
        assert c["local_batch"] == int(c["case"].rsplit("_b", 1)[1])
    for name in OLD_CASES:
        c = by[name]
        assert c["status"] == "ok", c
        assert c["seq_per_s"] > 0 and c["mfu"] > 0 and "peak_mem_gb" in c and c["optimizer_step_ms"] > 0
        assert torch.isfinite(torch.tensor(c["final_loss"])) and c["step_kind"] in ("eager", "prepare_step")
    assert by["bogus_b2"]["status"].startswith("skipped: unknown config key 'model.no_such_key'")
    # The 2026-11-29 run's AdamW pair both ran the fused kernel: the foreach optimizer was
    # built from the fused one's param_groups, whose fused=True overrode foreach=True.
    assert by["adamw_fused_b3"]["param_groups"]["fused"] is True
    assert by["adamw_foreach_b3"]["param_groups"]["fused"] in (None, False)
    assert by["adamw_foreach_b3"]["param_groups"]["foreach"] is True
    assert (by["adamw_fused_b3"]["optimizer_impl"], by["adamw_foreach_b3"]["optimizer_impl"]) == \
        ("adamw:torch-fused", "adamw:torch-foreach")
    assert "compile(eager)" in by["compiled_b3"]["optimizer_impl"]
    assert by["padded_b3"]["overrides"]["model.unpad"] == "false" and by["padded_b3"]["token_padding_frac"] > 0
    assert by["default_b3"]["token_padding_frac"] == 0  # unpadded: every token fed is real
    # The attention check: triton is refused on a CPU (skipped, named); nested runs the
    # reference comparison in float32 and passes, pad rows zero. The block sweep needs CUDA.
    att = r["checks"]["attention"]
    assert r["checks"]["attention_blocks"]["status"] == "skipped: the Triton kernels run on CUDA only"
    assert att["status"] == "ok" and att["triton"]["status"].startswith("skipped: attention backend 'triton'")
    assert att["tokens"] > sum(att["lengths"])
    assert att["nested"]["pass"] is True and att["nested"]["dropout_0"]["pad_rows_zero"] is True
    assert att["nested"]["dropout_0"]["max_abs_err"]["dq"] < 1e-4
    # The checks: fp16 steps through the trainer's step; the demo through run_and_time.sh and
    # the checker (3 steps: the log is compliant but for the accuracy it did not reach).
    fp16 = r["checks"]["fp16"]
    assert fp16["status"] == "ok" and fp16["precision"] == "fp16" and fp16["loss_scaling"] == "dynamic"
    # The smoke's first scale (1e30) overflows fp16: step 1 is skipped and leaves the weights
    # alone, the scale backs off to 1, and steps 2 and 3 update.
    assert [s["skipped"] for s in fp16["steps"]] == [1, 0, 0], fp16
    assert [s["weights_moved"] for s in fp16["steps"]] == [False, True, True]
    assert fp16["skips_left_weights_alone"] is True and fp16["skipped_total"] == 1
    assert fp16["final_scale"] == pytest.approx(1.0)
    assert fp16["finite_losses"] == 3 and fp16["attempts"] == [{"overrides": {}, "status": "ok"}]
    demo = r["checks"]["demo"]
    assert demo["status"] == "ok" and demo["steps"] == 3 and demo["run_stop"] == "aborted", demo
    assert demo["local_batch"] == 64 and demo["precision"] == "fp32"
    assert demo["checker"] == "FAIL" and demo["checker_failed_checks"] == ["eval_accuracy"], demo
    for name in ("demo_result_0.txt", "demo_train.log", "demo_compliance.txt"):
        assert (tmp_path / name).stat().st_size > 0, name
    capsys.readouterr()
    assert gpu_bert_large.main(["--table", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| adamw_foreach_b3 | 3 |" in printed and "checker FAIL" in printed


def test_gpu_script_skips_what_the_trainer_refuses_and_what_the_budget_leaves(tmp_path):
    out = tmp_path / "gpu.json"
    # (--cpu-smoke stands in for triton and CUDA graphs; flash-attn has no stand-in.)
    graphs = "graphs_b2:run.local_batch_size=2,model.attention_backend=flash"
    assert gpu_bert_large.main(["--cpu-smoke", "--out", str(out), "--only", "graphs_b2", "--case", graphs]) == 0
    (c,) = json.loads(out.read_text())["cases"]
    assert c["status"].startswith("skipped: refused at build"), c  # "needs a CUDA device"
    assert gpu_bert_large.main(["--cpu-smoke", "--out", str(out), "--only", "baseline_b2,check_fp16",
                                "--budget-s", "0"]) == 0
    r = json.loads(out.read_text())
    assert [c["status"] for c in r["cases"]] == ["skipped: budget"]
    assert r["checks"]["fp16"]["status"] == "skipped: budget"
    assert gpu_bert_large.main(["--cpu-smoke", "--out", str(out), "--only", "no_such_case"]) == 2
    # Nothing starts with less than --min-task-s (20) left before --limit-s.
    assert gpu_bert_large.main(["--cpu-smoke", "--out", str(out), "--only", "baseline_b2", "--limit-s", "25"]) == 0
    assert [c["status"] for c in json.loads(out.read_text())["cases"]] == ["skipped: budget"]
    # A task past its time limit is stopped (the demo's trainer process with it), recorded,
    # and the run goes on.
    assert gpu_bert_large.main(["--cpu-smoke", "--out", str(out), "--only", "check_demo,baseline_b2",
                                "--task-limit-s", "1", "--artifacts", str(tmp_path)]) == 0
    r = json.loads(out.read_text())
    assert r["checks"]["demo"]["status"] == "error: stopped at its time limit (1 s)", r["checks"]["demo"]
    assert [c["case"] for c in r["cases"]] == ["baseline_b2"]


def test_gpu_script_runs_the_fp8_case_and_labels_it(tmp_path, capsys):
    """The plan's FP8 case through the fast stack's CPU stand-ins (budgets, warm-up, the
    compiled layers; torchao's emulation): it runs, with no compile after the warm-up, and
    says in its JSON and its table row that it is FP8, its MFU against the bf16 GEMM peak."""
    pytest.importorskip("torchao.float8")
    out = tmp_path / "gpu.json"
    assert gpu_bert_large.main(["--cpu-smoke", "--out", str(out), "--only", "fast_fp8_tensorwise_b4"]) == 0
    result = json.loads(out.read_text())
    (c,) = result["cases"]
    assert c["status"] == "ok" and c["fp8"] == "tensorwise" and "MFU against the bf16 GEMM peak" in c["mfu_note"], c
    assert c["overrides"]["precision.fp8"] == "tensorwise" and c["compiles_after_prepare"] == 0
    assert gpu_bert_large.fp8_label(build_config({})) == {"fp8": "off"}
    capsys.readouterr()
    assert gpu_bert_large.main(["--table", str(out)]) == 0
    assert "| fast_fp8_tensorwise_b4 | 4 |" in capsys.readouterr().out
    result["cases"].append(dict(c, case="plain_b4", fp8="off"))
    rows = {line.split(" | ")[0]: line for line in gpu_bert_large.table(result).splitlines() if line.startswith("| ")}
    assert "(FP8 vs bf16 peak)" in rows["| fast_fp8_tensorwise_b4"] and "FP8" not in rows["| plain_b4"]


def test_gpu_script_demo_check_passes_the_checker(trained, demo_data, tmp_path):
    """The demo check end to end on the CPU from the trained demo weights: the first
    evaluation reaches 0.720, and the 5.0.0 checker passes the log."""
    assert trained.returncode == 0, trained.stdout[-2000:]
    extra = {"INIT_CHECKPOINT": str(trained.checkpoint), "LR": "1e-4", "EVAL_ITER_SAMPLES": "64",
             "MAX_SAMPLES_TERMINATION": "640", "EXTRA_PARAMS": demo_data.env["EXTRA_PARAMS"] + " data.eval_samples=500"}
    r = gpu_bert_large.check_demo(tmp_path / "work", tmp_path, smoke=False, data_dir=demo_data.root,
                                  extra_env=extra)
    assert r["status"] == "ok" and r["exit_code"] == 0 and r["run_stop"] == "success", r
    assert r["checker"] == "PASS" and r["checker_failed_checks"] == [], r
    assert r["steps"] == 1 and r["samples"] == 64 and r["eval_accuracy"][-1][1] >= 0.720
    assert 0 < r["time_to_target_s"] <= r["wall_s"]


def test_h200_wrapper_names_the_file_by_date_and_carried_commit(tmp_path):
    """bench/h200.sh as the device runs it (here with --cpu-smoke and one case): the commit
    comes from the carried .h200/commit (the device gets no .git), the JSON is named by
    date and commit, the log and the table land in $OUT."""
    carried = tmp_path / ".h200"
    carried.mkdir()
    (carried / "commit").write_text("0123456789abcdef0123456789abcdef01234567\n")
    env = dict(os.environ, OUT=str(tmp_path / "out"), H200_DIR=str(carried), PYTHON=sys.executable,
               H200_SITE=str(tmp_path / "site"))
    r = subprocess.run(["bash", "bench/h200.sh", "--cpu-smoke", "--only", "baseline_b2"], cwd=PKG, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    (json_file,) = (tmp_path / "out").glob("gpu_bert_large_*.json")
    assert re.fullmatch(r"gpu_bert_large_\d{4}-\d\d-\d\d_0123456789\.json", json_file.name)
    result = json.loads(json_file.read_text())
    assert result["commit"] == "0123456789abcdef0123456789abcdef01234567"
    assert [c["status"] for c in result["cases"]] == ["ok"]
    assert "| baseline_b2 | 2 |" in r.stdout and "no wheels" in r.stderr
    assert "| baseline_b2 | 2 |" in (tmp_path / "out" / "gpu_bert_large.log").read_text()
    assert result["compile_cache"] == "cold"


def test_h200_wrapper_returns_the_compile_cache_and_a_rerun_starts_warm(tmp_path):
    """The caches a run filled (here a stand-in file in $H200_CACHE) come back as
    compile_cache.tar.gz.partNN in $OUT; `prepare DIR`'s copy of them in the carried folder
    is unpacked by the next call into its (fresh) cache folder, which tells the script
    --compile-cache warm. (`prepare` downloads a wheel: its copying is done by hand here.)"""
    carried, out = tmp_path / ".h200", tmp_path / "out"
    carried.mkdir()
    (carried / "commit").write_text("0123456789abcdef0123456789abcdef01234567\n")
    first = tmp_path / "cache1"
    (first / "inductor" / "fxgraph").mkdir(parents=True)
    (first / "inductor" / "fxgraph" / "entry").write_bytes(os.urandom(4096))
    env = dict(os.environ, OUT=str(out), H200_DIR=str(carried), PYTHON=sys.executable,
               H200_SITE=str(tmp_path / "site"), H200_CACHE=str(first))
    cmd = ["bash", "bench/h200.sh", "--cpu-smoke", "--only", "check_attention_blocks"]
    r = subprocess.run(cmd, cwd=PKG, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    parts = sorted(out.glob("compile_cache.tar.gz.part*"))
    assert [q.name for q in parts] == ["compile_cache.tar.gz.part00"] and "compile cache 1 MiB in 1 part" in r.stdout
    for q in parts:  # what `bench/h200.sh prepare OUT` does
        shutil.copy(q, carried / q.name)
    second = tmp_path / "cache2"
    r = subprocess.run(cmd, cwd=PKG, env={**env, "H200_CACHE": str(second)}, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert (second / "inductor" / "fxgraph" / "entry").read_bytes() == (first / "inductor" / "fxgraph" / "entry").read_bytes()
    (json_file,) = out.glob("gpu_bert_large_*.json")
    assert json.loads(json_file.read_text())["compile_cache"] == "warm" and "plan (warm compile caches)" in r.stdout


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
