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

from bench import demo_check, device_run, gpu_bert_large, gpu_report, vs_hf
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


# --cpu-smoke's batches are 2, 3 and 4. The fast stack in each variant (the default
# backend, triton, runs as the math stand-in; CUDA graphs as eager steps), the old cases whose
# keys every tree has, the whole-model compile (bench.compile), a trainer refusal, an
# unknown key.
FAST_VARIANTS = ["fast_b4", "fast_b2", "fast_no_graphs_b4", "fast_nested_b4", "fast_sdpa_b4"]
OLD_CASES = ["baseline_b2", "adamw_fused_b3", "adamw_foreach_b3", "default_b3", "padded_b3", "lamb_foreach_b3",
             "compiled_b3"]
SMOKE_CASES = [*FAST_VARIANTS, *OLD_CASES, "flash_b2", "bogus_b2"]


def test_throughput_script_cpu_smoke_every_fast_variant_compiles_only_in_its_warm_up(tmp_path, capsys, monkeypatch):
    out = tmp_path / "gpu.json"
    # The first case's evaluation extra fails after reading the file: its throughput was
    # written before any extra ran, and the case stays ok.
    real_eval, seen = gpu_bert_large.time_eval, []

    def first_eval_fails(*a, **kw):
        if not seen:
            seen.append(json.loads(out.read_text())["cases"][-1])
            raise RuntimeError("eval broke")
        return real_eval(*a, **kw)

    monkeypatch.setattr(gpu_bert_large, "time_eval", first_eval_fails)
    assert gpu_bert_large.main(["--cpu-smoke", "--out", str(out), "--commit", "abc123", "--only", ",".join(SMOKE_CASES),
                                "--case", "flash_b2:run.local_batch_size=2,model.attention_backend=flash",
                                "--case", "bogus_b2:run.local_batch_size=2,model.no_such_key=1"]) == 0
    r = json.loads(out.read_text())
    names = [c["case"] for c in r["cases"]]
    assert names == ["baseline_b2", "fast_b4", "fast_b2", "fast_no_graphs_b4", "fast_nested_b4", "fast_sdpa_b4",
                     "adamw_fused_b3", "adamw_foreach_b3", "default_b3", "padded_b3", "lamb_foreach_b3", "compiled_b3",
                     "flash_b2", "bogus_b2"]
    assert r["commit"] == "abc123" and r["cpu_smoke"] is True and r["gemm_peak_tflops"] > 0
    assert r["device_name"].startswith("cpu") and r["versions"]["torch"] == torch.__version__
    by = {c["case"]: c for c in r["cases"]}
    assert seen[0]["case"] == "baseline_b2" and seen[0]["seq_per_s"] > 0 and "optimizer_step_ms" not in seen[0]
    assert by["baseline_b2"]["status"] == "ok" and by["baseline_b2"]["extra_errors"] == {"eval": "RuntimeError: eval broke"}
    assert by["baseline_b2"]["optimizer_step_ms"] > 0  # the next extra still ran
    # Every fast variant compiles in its warm-ups (training, then evaluation) and never after
    # them; the default backend's case at the big batch comes first and compiles the layer,
    # the later cases of that backend reuse it (no dynamo reset between cases), another
    # backend compiles its own in its warm-up.
    for name in FAST_VARIANTS:
        c = by[name]
        assert c["status"] == "ok" and c["step_kind"] == "eager", c  # graphs' CPU stand-in: eager steps
        assert c["compiles_after_prepare"] == 0 and c["eval_compiles"] == 0, c
        assert c["warmup_s"] > 0 and c["eval_warmup_s"] > 0 and "capture_s" in c and c["eval_ms_per_batch"] > 0
        assert len(c["token_budget_rungs"]) > 1 and c["eval_batch_shapes"] > 1
    assert by["fast_b4"]["overrides"]["model.attention_backend"] == "triton" and by["fast_b4"]["attention"] == "math"
    assert by["fast_b4"]["compiles_in_prepare"] == 1 and by["fast_b4"]["eval_compiles_in_prepare"] == 1
    assert by["fast_b2"]["compiles_in_prepare"] == 0 and by["fast_b2"]["eval_compiles_in_prepare"] == 0
    for name in ("fast_nested_b4", "fast_sdpa_b4"):
        assert by[name]["compiles_in_prepare"] > 0 and by[name]["attention"] == name.split("_")[1], by[name]
    # The headline's kernel classes (on a CPU: aten ops' self time).
    kb = by["fast_b4"]["kernel_breakdown"]
    assert kb["ms_per_step"]["gemm"] > 0 and kb["ms_per_step"]["elementwise"] > 0 and kb["steps"] == 3
    assert "kernel_breakdown" not in by["fast_b2"]
    # The whole-model compile of the old stack compiles in its untimed steps, by design, and
    # says so; no case compiles inside its timed steps.
    assert by["compiled_b3"]["compiles_untimed"] > 0 and "bench.compile" in by["compiled_b3"]["recompiles_by_design"]
    assert [c["case"] for c in r["cases"] if "recompiles_by_design" in c] == ["compiled_b3"]
    for name in OLD_CASES:
        c = by[name]
        assert c["status"] == "ok" and c["compiles_timed"] == 0, c
        assert c["seq_per_s"] > 0 and c["mfu"] > 0 and "peak_mem_gb" in c and c["optimizer_step_ms"] > 0
        assert torch.isfinite(torch.tensor(c["final_loss"])) and c["step_kind"] == "eager"
    assert by["flash_b2"]["status"].startswith("skipped: refused at build"), by["flash_b2"]  # needs CUDA
    assert by["bogus_b2"]["status"].startswith("skipped: unknown config key 'model.no_such_key'")
    # Each AdamW case builds its own optimizer: a foreach one built from a fused one's
    # param_groups would inherit fused=True, which overrides foreach=True.
    assert by["adamw_fused_b3"]["param_groups"]["fused"] is True
    assert by["adamw_foreach_b3"]["param_groups"]["fused"] in (None, False)
    assert by["adamw_foreach_b3"]["param_groups"]["foreach"] is True
    assert (by["adamw_fused_b3"]["optimizer_impl"], by["adamw_foreach_b3"]["optimizer_impl"]) == \
        ("adamw:torch-fused", "adamw:torch-foreach")
    assert "compile(eager)" in by["compiled_b3"]["optimizer_impl"]
    assert by["padded_b3"]["overrides"]["model.unpad"] == "false" and by["padded_b3"]["token_padding_frac"] > 0
    assert by["default_b3"]["token_padding_frac"] == 0  # unpadded: every token fed is real
    capsys.readouterr()
    assert gpu_report.main([str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| adamw_foreach_b3 | 3 |" in printed and "fast_b4 by kernel class" in printed
    assert "| baseline_b2 | 2 |" in printed and "extras failed: eval" in printed
    assert gpu_bert_large.main(["--cpu-smoke", "--out", str(out), "--only", "no_such_case"]) == 2


def test_throughput_script_runs_the_fp8_case_and_labels_it(tmp_path, capsys):
    """The FP8 case through the fast stack's CPU stand-ins (budgets, warm-up, the compiled
    layers; torchao's emulation): it runs, with no compile after the warm-up, and says in its
    JSON and its table row that it is FP8, its MFU against the bf16 GEMM peak."""
    pytest.importorskip("torchao.float8")
    out = tmp_path / "gpu.json"
    assert gpu_bert_large.main(["--cpu-smoke", "--out", str(out), "--only", "fast_fp8_tensorwise_b4"]) == 0
    result = json.loads(out.read_text())
    (c,) = result["cases"]
    assert c["status"] == "ok" and c["fp8"] == "tensorwise" and "MFU against the bf16 GEMM peak" in c["mfu_note"], c
    assert c["overrides"]["precision.fp8"] == "tensorwise" and c["compiles_after_prepare"] == 0
    assert gpu_bert_large.fp8_label(build_config({})) == {"fp8": "off"}
    capsys.readouterr()
    assert gpu_report.main([str(out)]) == 0
    assert "| fast_fp8_tensorwise_b4 | 4 |" in capsys.readouterr().out
    result["cases"].append(dict(c, case="plain_b4", fp8="off"))
    rows = {line.split(" | ")[0]: line for line in gpu_report.table(result).splitlines() if line.startswith("| ")}
    assert "(FP8 vs bf16 peak)" in rows["| fast_fp8_tensorwise_b4"] and "FP8" not in rows["| plain_b4"]


def test_gpu_script_demo_check_passes_the_checker(trained, demo_data, tmp_path):
    """The demo check end to end on the CPU from the trained demo weights: the first
    evaluation reaches 0.720, and the 5.0.0 checker passes the log."""
    assert trained.returncode == 0, trained.stdout[-2000:]
    extra = {"INIT_CHECKPOINT": str(trained.checkpoint), "LR": "1e-4", "EVAL_ITER_SAMPLES": "64",
             "MAX_SAMPLES_TERMINATION": "640", "EXTRA_PARAMS": "data.eval_samples=500"}
    r = demo_check.check_demo(tmp_path / "work", tmp_path, smoke=False, data_dir=demo_data.root, extra_env=extra)
    assert r["status"] == "ok" and r["exit_code"] == 0 and r["run_stop"] == "success", r
    assert r["checker"] == "PASS" and r["checker_failed_checks"] == [], r
    assert r["steps"] == 1 and r["samples"] == 64 and r["eval_accuracy"][-1][1] >= 0.720
    assert 0 < r["time_to_target_s"] <= r["wall_s"]


# What the dry run of the device's call runs: the attention check (its children), the
# baseline, the headline (skipped here by its expected time: the window's rule), the GPU
# tests' child. The whole plan, in its order, is in the file.
PLAN_B4 = ["check_attention", "baseline_b2", "fast_b4", "fast_b2", "check_gpu", "fast_fp8_tensorwise_b4",
           "check_attention_blocks", "fast_no_graphs_b4", "fast_triton_b4", "fast_nested_b4", "fast_sdpa_b4",
           "fast_compiled_lamb_b4", "fast_no_compile_layers_b4", "fast_no_fused_qkv_b4", "fast_vocab_unpadded_b4",
           "fast_autocast_residual_b4", "fast_fp8_rowwise_b4", "check_demo", "fast_no_budget_no_graphs_b4",
           "default_budget_b4", "default_compiled_lamb_b4", "adamw_fused_b3", "adamw_foreach_b3", "fast_b3", "default_b3",
           "default_b4", "padded_b3", "lamb_foreach_b3", "compiled_b3"]


def test_device_run_dry_run_through_h200_sh_and_a_warm_rerun(tmp_path):
    """bench/h200.sh as the device runs it, on the CPU (--cpu-smoke): the commit from the
    carried .h200/commit (the device gets no .git), the JSON named by date and commit, the
    expected seconds printed before any task, the attention check's children (triton
    skipped without CUDA, nested and sdpa passed in float32, their numbers read back from the
    junit XML) choosing the fast stack's backend, the headline skipped by the window (its
    expected 150 s do not fit the 150 s limit), the GPU tests' child (skipped without CUDA),
    the table in the log. The caches the run filled (a stand-in file in $H200_CACHE) come
    back as compile_cache.tar.gz.partNN in $OUT; `prepare DIR`'s copy of them in the carried
    folder is unpacked by the next call into its (fresh) cache folder, which tells the run
    --compile-cache warm. (`prepare` downloads wheels: its copying is done by hand here.)"""
    carried, out = tmp_path / ".h200", tmp_path / "out"
    carried.mkdir()
    (carried / "commit").write_text("0123456789abcdef0123456789abcdef01234567\n")
    first = tmp_path / "cache1"
    (first / "inductor" / "fxgraph").mkdir(parents=True)
    (first / "inductor" / "fxgraph" / "entry").write_bytes(os.urandom(4096))
    env = dict(os.environ, OUT=str(out), H200_DIR=str(carried), PYTHON=sys.executable,
               H200_SITE=str(tmp_path / "site"), H200_CACHE=str(first), H200_LIMIT_S="150")
    r = subprocess.run(["bash", "bench/h200.sh", "--cpu-smoke", "--only", "check_attention,baseline_b2,fast_b4,check_gpu"],
                       cwd=PKG, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (json_file,) = out.glob("gpu_bert_large_*.json")
    assert re.fullmatch(r"gpu_bert_large_\d{4}-\d\d-\d\d_0123456789\.json", json_file.name)
    result = json.loads(json_file.read_text())
    assert result["commit"] == "0123456789abcdef0123456789abcdef01234567" and result["compile_cache"] == "cold"
    assert result["plan"] == PLAN_B4 and 0 < result["limit_s"] <= 150
    assert r.stdout.index("expected in all") < re.search(r"^check_attention +ok", r.stdout, re.M).start()
    att = result["checks"]["attention"]
    assert att["backends"]["triton"]["outcome"] == "skipped", att
    for b in ("nested", "sdpa"):
        v = att["backends"][b]
        assert v["outcome"] == "passed" and v["attention"]["dropout_0"]["max_abs_err"]["dq"] < 1e-4, v
    assert att["chosen"] == result["fast_attention"] == "nested"
    by = {c["case"]: c for c in result["cases"]}
    assert by["baseline_b2"]["status"] == "ok"
    assert re.fullmatch(r"skipped: expected 150 s, \d+ s left before --limit-s", by["fast_b4"]["status"])
    assert by["fast_b4"]["overrides"]["model.attention_backend"] == "nested"
    gpu = result["checks"]["gpu"]
    assert gpu["skipped"] == 4 and gpu["passed"] == gpu["failed"] == gpu["error"] == 0, gpu
    assert all(v["message"].endswith("needs a CUDA device") for v in gpu["tests"].values())
    assert "| baseline_b2 | 2 |" in r.stdout and "no wheels" in r.stderr
    assert "attention check: triton skipped; nested passed; sdpa passed; the fast stack ran nested" in \
        (out / "gpu_bert_large.log").read_text()
    parts = sorted(out.glob("compile_cache.tar.gz.part*"))
    assert [q.name for q in parts] == ["compile_cache.tar.gz.part00"] and "compile cache 1 MiB in 1 part" in r.stdout
    for q in parts:  # what `bench/h200.sh prepare OUT` does
        shutil.copy(q, carried / q.name)
    second = tmp_path / "cache2"
    r = subprocess.run(["bash", "bench/h200.sh", "--cpu-smoke", "--only", "check_attention_blocks"], cwd=PKG,
                       env={**env, "H200_CACHE": str(second)}, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert (second / "inductor" / "fxgraph" / "entry").read_bytes() == (first / "inductor" / "fxgraph" / "entry").read_bytes()
    (json_file,) = out.glob("gpu_bert_large_*.json")
    assert json.loads(json_file.read_text())["compile_cache"] == "warm" and "plan (warm compile caches)" in r.stdout


def test_device_run_window_stops_a_long_task_and_resumes_after_a_broken_context(tmp_path, monkeypatch):
    """The window's rules on the CPU, the process's age stood in for: a task expected to
    take longer than what is left is skipped with that reason; a task past --task-limit-s is
    stopped (the demo's trainer process with it) and the run goes on; after a task that
    leaves the CUDA context broken the JSON is written and the run execs itself with
    --resume, which runs only what the file does not hold."""
    out = tmp_path / "dry.json"
    base = ["--cpu-smoke", "--out", str(out), "--artifacts", str(tmp_path)]
    assert device_run.main([*base, "--only", "baseline_b2", "--limit-s", "24"], age=lambda: 0.0) == 0
    (c,) = json.loads(out.read_text())["cases"]
    assert c["status"] == "skipped: expected 15 s, 14 s left before --limit-s"
    assert device_run.main([*base, "--only", "check_demo,baseline_b2", "--task-limit-s", "1"]) == 0
    r = json.loads(out.read_text())
    assert r["checks"]["demo"]["status"] == "error: stopped at its time limit (1 s)", r["checks"]["demo"]
    assert [c["case"] for c in r["cases"]] == ["baseline_b2"] and r["cases"][0]["status"] == "ok"

    class Exec(Exception):
        pass

    def exec_(path, argv):
        raise Exec(argv)

    monkeypatch.setattr(device_run, "cuda_alive", lambda device: False)
    monkeypatch.setattr(device_run.os, "execv", exec_)
    argv = [*base, "--only", "baseline_b2,lamb_foreach_b3"]
    with pytest.raises(Exec) as raised:
        device_run.main(argv)
    assert raised.value.args[0][-1] == "--resume" and raised.value.args[0][2:-1] == argv
    r = json.loads(out.read_text())
    assert [c["case"] for c in r["cases"]] == ["baseline_b2"] and r["cuda_context_lost_after"] == ["baseline_b2"]
    monkeypatch.setattr(device_run, "cuda_alive", lambda device: True)
    assert device_run.main([*argv, "--resume"]) == 0
    r = json.loads(out.read_text())
    assert [(c["case"], c["status"]) for c in r["cases"]] == [("baseline_b2", "ok"), ("lamb_foreach_b3", "ok")]
    assert r["restarts"] == 1


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
