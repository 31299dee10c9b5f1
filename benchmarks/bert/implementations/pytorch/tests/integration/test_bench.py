"""The benchmark scripts: their FLOP arithmetic against torch's FLOP counter, and each
script end to end on a tiny model (every code path and the output file; no speed asserted)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from typing import Callable

import pytest
import torch

from bench import cases, demo_check, device_run, gpu_bert_large, gpu_report, measure, vs_hf
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


def test_activation_bench_smoke_writes_every_variant(capsys, tmp_path):
    """bench/activation.py on a tiny model, eager and FP8 (emulated) paths (the compiled
    path's inductor build takes minutes here; docs/model.md's numbers ran it)."""
    from bench import activation

    out = tmp_path / "activation.json"
    assert activation.main(["--hidden", "32", "--layers", "1", "--heads", "2", "--vocab", "200", "--seq", "64",
                            "--max-pred", "10", "--batch", "2", "--steps", "2", "--warmup", "1", "--op-reps", "2",
                            "--paths", "eager,fp8", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert set(doc["steps"]["paths"]) == {"eager", "fp8"} and set(doc["ops"]) == {"gelu", "intermediate", "tokens"}
    for path in ("eager", "fp8"):
        r = doc["steps"]["paths"][path]
        for act in ("gelu_tanh", "gelu_erf"):
            assert len(r[act]["step_cpu"]["all_ms"]) == 2 and len(r["losses"][act]) == 3
        assert r["tanh_over_erf"] > 0
    assert len(doc["ops"]["gelu"]["eager"]["gelu_erf"]["all_ms"]) == 2 and set(doc["ops"]["intermediate"]) == {"eager"}
    assert "tanh/erf" in capsys.readouterr().out


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
    real_eval, seen = measure.time_eval, []

    def first_eval_fails(*a, **kw):
        if not seen:
            seen.append(json.loads(out.read_text())["cases"][-1])
            raise RuntimeError("eval broke")
        return real_eval(*a, **kw)

    monkeypatch.setattr(measure, "time_eval", first_eval_fails)
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
    assert measure.fp8_label(build_config({})) == {"fp8": "off"}
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
# baseline, the headline (its first stack skipped here by its expected time: the window's
# rule; the next, cheaper one measures), the GPU tests' child. The whole plan, in its
# order, is in the file.
PLAN_B4 = ["check_attention", "baseline_b2", "headline", "fast_b2", "check_gpu", "fast_fp8_tensorwise_b4",
           "fast_mask_bits_b4", "fast_fwd_tile_128x64_b4", "fast_lamb_group_correction_b4", "fast_autocast_residual_b4",
           "headline_extras", "check_attention_blocks", "fast_no_graphs_b4", "fast_triton_b4", "fast_nested_b4",
           "fast_sdpa_b4", "fast_compiled_lamb_b4", "fast_no_compile_layers_b4", "fast_no_fused_qkv_b4",
           "fast_vocab_unpadded_b4", "fast_fp8_rowwise_b4", "check_demo", "fast_no_budget_no_graphs_b4",
           "default_budget_b4", "default_compiled_lamb_b4", "adamw_fused_b3", "adamw_foreach_b3", "fast_b3", "default_b3",
           "default_b4", "padded_b3", "lamb_foreach_b3", "compiled_b3"]


def test_device_run_dry_run_through_h200_sh_and_a_warm_rerun(tmp_path):
    """bench/h200.sh as the device runs it, on the CPU (--cpu-smoke): the commit from the
    carried .h200/commit (the device gets no .git), the JSON named by date and commit, the
    expected seconds printed before any task, the attention check's children (triton
    skipped without CUDA, nested and sdpa passed in float32, their numbers read back from the
    junit XML) choosing the fast stack's backend, the headline skipped by the window (its
    expected 110 s do not fit the 130 s limit: a cheaper stack after it is the headline), the
    GPU tests' child (skipped without CUDA),
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
               H200_SITE=str(tmp_path / "site"), H200_CACHE=str(first), H200_LIMIT_S="130")
    r = subprocess.run(["bash", "bench/h200.sh", "--cpu-smoke", "--only", "check_attention,baseline_b2,headline,check_gpu"],
                       cwd=PKG, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (json_file,) = out.glob("gpu_bert_large_*.json")
    assert re.fullmatch(r"gpu_bert_large_\d{4}-\d\d-\d\d_0123456789\.json", json_file.name)
    result = json.loads(json_file.read_text())
    assert result["commit"] == "0123456789abcdef0123456789abcdef01234567" and result["compile_cache"] == "cold"
    assert result["plan"] == PLAN_B4 and 0 < result["limit_s"] <= 130
    assert r.stdout.index("expected in all") < re.search(r"^check_attention +ok", r.stdout, re.M).start()
    att = result["checks"]["attention"]
    assert att["backends"]["triton"]["outcome"] == "skipped" and att["triton_levers"]["outcome"] == "skipped", att
    assert "inconclusive" not in att
    for b in ("nested", "sdpa"):
        v = att["backends"][b]
        assert v["outcome"] == "passed" and v["attention"]["dropout_0"]["max_abs_err"]["dq"] < 1e-4, v
    assert att["chosen"] == result["fast_attention"] == "nested"
    by = {c["case"]: c for c in result["cases"]}
    assert by["baseline_b2"]["status"] == "ok"
    assert re.fullmatch(r"skipped: expected 110 s, \d+ s left before --limit-s", by["fast_b4"]["status"])
    assert by["fast_b4"]["overrides"]["model.attention_backend"] == "nested"
    head = result["headline"]
    assert head["case"] in by and by[head["case"]]["status"] == "ok" and head["changes_from_fast"], head
    assert result["gpu_state"]["error"].startswith("nvidia-smi")
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


def _h200(tmp_path, *args, **env):
    """bench/h200.sh with the device run's folders in ``tmp_path`` and ``env`` added."""
    full = {**os.environ, "OUT": str(tmp_path / "out"), "H200_DIR": str(tmp_path / ".h200"), "PYTHON": sys.executable,
            "H200_SITE": str(tmp_path / "site"), "H200_CACHE": str(tmp_path / "cache"), **env}
    return subprocess.run(["bash", "bench/h200.sh", *args], cwd=PKG, env=full, capture_output=True, text=True,
                          timeout=300)


def test_h200_sh_fails_fast_when_the_run_cannot_import_and_runs_without_mlperf_logging(tmp_path):
    """What the device call does when a module is missing: torch (the run's own modules do
    not import) -> one line, exit 3, and a JSON that says it, before any task; mlperf_logging
    (a wheel not carried) -> one line saying what will fail, and the run goes on to its JSON
    (bert.mlperf_log imports it only for a logger that logs)."""
    fake = tmp_path / "fake"
    (fake / "mlperf_logging").mkdir(parents=True)
    (fake / "mlperf_logging" / "__init__.py").write_text("raise ImportError('no mlperf_logging here')\n")
    r = _h200(tmp_path, "--cpu-smoke", "--only", "baseline_b2", PYTHONPATH=str(fake))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "h200.sh: mlperf_logging does not import: the demo check (its MLPerf log and checker) will fail" in r.stdout
    (json_file,) = (tmp_path / "out").glob("gpu_bert_large_*.json")
    assert json.loads(json_file.read_text())["cases"][0]["status"] == "ok"
    (fake / "torch.py").write_text("raise ImportError('no torch here')\n")
    json_file.unlink()
    r = _h200(tmp_path, "--cpu-smoke", "--only", "baseline_b2", PYTHONPATH=str(fake))
    assert r.returncode == 3
    assert r.stdout.strip().splitlines()[-1] == "h200.sh: the run's modules do not import: ImportError: no torch here"
    (json_file,) = (tmp_path / "out").glob("gpu_bert_large_*.json")
    assert json.loads(json_file.read_text())["status"] == "error: the run's modules do not import: ImportError: no torch here"


def test_the_gpu_state_is_logged_first_and_kept_in_the_json(tmp_path):
    """h200.sh's first lines are nvidia-smi's reading of the GPU (driver, compute mode, clocks)
    and the run keeps the same reading in ``gpu_state`` (a stand-in nvidia-smi on PATH that
    answers the queries as the driver's does, here an Exclusive_Process GPU)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/usr/bin/env bash\n"
                   'if [[ "$*" != *noheader* ]]; then echo "name, driver_version, compute_mode, clocks.sm [MHz]"; fi\n'
                   'echo "NVIDIA H200, 580.159.04, Exclusive_Process, 345 MHz, 1980 MHz, 3201 MHz, 3201 MHz, 75.1 W, '
                   '700.00 W, 31, Enabled"\n')
    smi.chmod(0o755)
    r = _h200(tmp_path, "--cpu-smoke", "--only", "baseline_b2", PATH=f"{bin_dir}:{os.environ['PATH']}")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    log = (tmp_path / "out" / "gpu_bert_large.log").read_text().splitlines()
    assert log[0] == "name, driver_version, compute_mode, clocks.sm [MHz]" and "Exclusive_Process" in log[1]
    (json_file,) = (tmp_path / "out").glob("gpu_bert_large_*.json")
    state = json.loads(json_file.read_text())["gpu_state"]
    assert state["driver_version"] == "580.159.04" and state["compute_mode"] == "Exclusive_Process"
    assert state["clocks.max.sm"] == "1980 MHz" and state["persistence_mode"] == "Enabled"


def test_h200_sh_prepare_refuses_to_finish_without_both_wheels(tmp_path):
    """``prepare`` with a pip that fetches mlperf-logging's wheel but not torchao's (a stand-in
    python: no registry reached) fails, naming the wheel missing; with both, it writes the
    commit and succeeds."""
    stand_in = tmp_path / "python"
    stand_in.write_text("#!/usr/bin/env bash\n# -m pip download ... -d DIR PIN\n"
                        'dir="${@: -2:1}"; pin="${@: -1}"; name="${pin%%==*}"; name="${name//-/_}"\n'
                        '[[ "${name}" == torchao && -n "${NO_TORCHAO:-}" ]] || touch "${dir}/${name}-1-py3-none-any.whl"\n')
    stand_in.chmod(0o755)
    r = _h200(tmp_path, "prepare", PYTHON=str(stand_in), NO_TORCHAO="1")
    assert r.returncode == 1 and r.stderr.strip() == \
        f"h200.sh prepare: 0 torchao wheel(s) in {tmp_path / '.h200'}, not 1: not prepared", r.stderr
    assert not (tmp_path / ".h200" / "commit").exists()
    r = _h200(tmp_path, "prepare", PYTHON=str(stand_in))
    assert r.returncode == 0 and (tmp_path / ".h200" / "commit").read_text().strip(), r.stderr


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


def _failing(monkeypatch, fails: Callable[[dict], str], hangs: str = "") -> list[str]:
    """bench/measure.py's measure_case with failures injected: a case whose resolved overrides
    ``fails`` names a reason for raises it before measuring; the case named ``hangs``
    sleeps (its cap stops it). Returns the cases measured, in order."""
    real, order = measure.measure_case, []

    def failing(case, args, *a, **kw):
        order.append(case.name)
        if case.name == hangs:
            time.sleep(60)
        why = fails(cases.resolved_overrides(case, args))
        if why:
            raise RuntimeError(why)
        return real(case, args, *a, **kw)

    monkeypatch.setattr(measure, "measure_case", failing)
    return order


def test_device_run_headline_falls_back_at_once_and_later_cases_take_its_stack(tmp_path, monkeypatch):
    """The fallback chain on the CPU with injected failures. The fast stack stuck (stopped at
    twice its expected seconds, set to 2 s here) and without graphs broken: the stack
    without the per-layer compile is the headline, tried before anything else; the JSON says
    which stack and why the others did not; the later fast-stack case (b2) runs without the
    per-layer compile too, the ablations the chain ran are not run again, and the headline's
    evaluation and kernel profile come after the core numbers (headline_extras)."""
    out = tmp_path / "chain.json"
    base = ["--cpu-smoke", "--out", str(out), "--artifacts", str(tmp_path)]
    only = "baseline_b2,headline,fast_b2,fast_lamb_group_correction_b4,headline_extras,fast_no_graphs_b4"
    monkeypatch.setattr(cases, "EST_FAST_FIRST", (2.0, 2.0))
    order = _failing(monkeypatch, lambda o: "capture broke" if o.get("run.cuda_graphs") == "false"
                     and o.get("model.compile_layers") == "true" else "", hangs="fast_b4")
    t0 = time.monotonic()
    assert device_run.main([*base, "--only", only, "--fast-attention", "nested"]) == 0
    assert time.monotonic() - t0 < 55  # the stuck attempt cost its cap, not its 60 s
    r = json.loads(out.read_text())
    head = r["headline"]
    assert head["case"] == "fast_no_compile_layers_b4" and head["changes_from_fast"] == {"model.compile_layers": "false"}
    assert [(a["case"], a["status"]) for a in head["attempts"]] == [
        ("fast_b4", "error: stopped at its time limit (4 s)"), ("fast_no_graphs_b4", "error: RuntimeError: capture broke"),
        ("fast_no_compile_layers_b4", "ok")]
    assert order[:4] == ["baseline_b2", "fast_b4", "fast_no_graphs_b4", "fast_no_compile_layers_b4"]
    by = {c["case"]: c for c in r["cases"]}
    assert [c["case"] for c in r["cases"]] == ["baseline_b2", "fast_b4", "fast_no_graphs_b4", "fast_no_compile_layers_b4",
                                               "fast_b2", "fast_lamb_group_correction_b4"]  # no second fast_no_graphs
    assert r["fast_stack_changes"] == {"model.compile_layers": "false"} and r["fast_attention"] == "nested"
    for name in ("fast_b2", "fast_lamb_group_correction_b4"):
        assert by[name]["status"] == "ok" and by[name]["overrides"]["model.compile_layers"] == "false", by[name]
        assert by[name]["extras_not_run"] == ["eval"] and by[name]["optimizer_step_ms"] > 0
    assert by["fast_lamb_group_correction_b4"]["overrides"]["optim.lamb_bias_correction"] == "group"
    headline = by["fast_no_compile_layers_b4"]
    assert r["checks"]["headline_extras"]["status"] == "ok" and "extras_not_run" not in headline
    assert headline["eval_ms_per_batch"] > 0 and headline["kernel_breakdown"]["ms_per_step"]["gemm"] > 0
    assert "eager steps" in headline["kernel_breakdown"]["profiled"]
    assert "headline: fast_no_compile_layers_b4" in gpu_report.table(r)
    assert "not the headline: fast_no_graphs_b4: error: RuntimeError: capture broke" in gpu_report.table(r)


def test_device_run_headline_takes_the_next_backend_or_says_none_measured(tmp_path, monkeypatch):
    """When every stack of the chosen backend fails, the next backend's fast stack is the
    headline and becomes the fast stack's backend; when every attempt fails, the JSON says
    no headline, the extras are skipped and their reserved time is free again."""
    out = tmp_path / "chain.json"
    base = ["--cpu-smoke", "--out", str(out), "--artifacts", str(tmp_path)]
    _failing(monkeypatch, lambda o: "nested broke" if o.get("model.attention_backend") == "nested" else "")
    assert device_run.main([*base, "--only", "headline,fast_b2", "--fast-attention", "nested"]) == 0
    r = json.loads(out.read_text())
    assert r["headline"]["case"] == "fast_sdpa_b4" and r["fast_attention"] == "sdpa"
    assert r["headline"]["changes_from_fast"] == {"model.attention_backend": "sdpa"}
    assert [a["case"] for a in r["headline"]["attempts"]] == [
        "fast_b4", "fast_no_graphs_b4", "fast_no_compile_layers_b4", "fast_eager_b4", "fast_sdpa_b4"]
    assert [c["overrides"]["model.attention_backend"] for c in r["cases"]][-1] == "sdpa"  # fast_b2
    _failing(monkeypatch, lambda o: "all broke")
    assert device_run.main([*base, "--only", "headline,fast_fp8_tensorwise_b4,headline_extras", "--limit-s", "110",
                            "--fast-attention", "sdpa"], age=lambda: 0.0) == 0
    r = json.loads(out.read_text())
    reserved = "s left before --limit-s and the reserved tasks"
    assert r["headline"]["case"] is None and [a["status"] for a in r["headline"]["attempts"]] == [
        f"skipped: expected 110 s, 40 {reserved}", f"skipped: expected 90 s, 40 {reserved}"] + \
        ["error: RuntimeError: all broke"] * 2
    # No headline: the extras' 60 s are free again, and the FP8 case's 90 s fit (it ran, and broke).
    assert r["cases"][-1]["case"] == "fast_fp8_tensorwise_b4"
    assert r["cases"][-1]["status"] == "error: RuntimeError: all broke"
    assert r["checks"]["headline_extras"]["status"] == "skipped: no headline was measured"


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
