"""Pretraining mode (run.mode=pretrain): no target, held-out MLM/NSP accuracy and loss at
intervals, ends at its step count with curves and a plot; phase 2 starts from phase 1's
weights; what submit_pretrain.sh gives its jobs and refuses before submitting (its phases on
a real SLURM cluster, preempted and resubmitted on another node count: test_two_nodes.py); the
small two-phase demo on real text, checked by HF transformers."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from bert.config import build_config
from bert.train import run
from conftest import PKG, mllog_events, source_config

TINY = {"model.vocab_size": "128", "model.hidden_size": "32", "model.num_layers": "1", "model.num_heads": "2",
        "model.intermediate_size": "64", "model.max_position_embeddings": "128", "model.hidden_dropout": "0",
        "model.attention_dropout": "0", "data.max_seq_length": "128", "data.max_predictions_per_seq": "20",
        "data.eval_samples": "200", "eval.batch_size": "100", "run.local_batch_size": "16", "run.device": "cpu",
        "run.division": "open", "optim.lr": "0.01", "optim.warmup_steps": "5", "log.progress_interval_steps": "10",
        "run.mode": "pretrain", "ckpt.resume": "off"}


def _run(demo_data, out, **extra):
    cfg = build_config({**TINY, "data.train_dir": str(demo_data.train), "data.eval_dir": str(demo_data.eval),
                        "log.output_dir": str(out), **extra})
    return run(cfg)


def test_pretrain_mode_ends_at_its_step_count_with_curves(demo_data, tmp_path):
    # a target of 0.01 would end an MLPerf run at its first eval; pretraining ignores it
    assert _run(demo_data, tmp_path, **{"optim.total_steps": "30", "eval.interval_samples": "160",
                                        "eval.target_accuracy": "0.01",
                                        "run.save_checkpoint": str(tmp_path / "p1.pt")}) == 0
    events = mllog_events(tmp_path / "result_0.txt")
    stop = [e for e in events if e["key"] == "run_stop"]
    assert stop[-1]["metadata"]["status"] == "success"
    rows = [json.loads(ln) for ln in (tmp_path / "result_0_curves.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [10, 20, 30]  # every 160 samples = 10 steps of 16, and the end
    for k in ("eval_mlm_loss", "eval_nsp_accuracy", "eval_nsp_loss"):
        assert [e["value"] for e in events if e["key"] == k] == pytest.approx([r[k[5:]] for r in rows])
    assert [e["value"] for e in events if e["key"] == "eval_accuracy"] == pytest.approx([r["mlm_accuracy"] for r in rows])
    assert rows[-1]["mlm_loss"] < rows[0]["mlm_loss"]  # it learns
    assert all(0 <= r["nsp_accuracy"] <= 1 and r["nsp_loss"] > 0 for r in rows)
    assert (tmp_path / "result_0_curves.png").stat().st_size > 1000
    # Phase 2 from phase 1's weights with a fresh optimizer and schedule: at lr ~0 its first
    # evaluation is phase 1's last (same eval set), so the weights crossed intact.
    p2 = tmp_path / "p2"
    assert _run(demo_data, p2, **{"optim.total_steps": "2", "eval.interval_samples": "1000", "optim.lr": "1e-12",
                                  "optim.warmup_steps": "0", "run.init_checkpoint": str(tmp_path / "p1.pt")}) == 0
    first = json.loads((p2 / "result_0_curves.jsonl").read_text().splitlines()[0])
    assert first["mlm_accuracy"] == pytest.approx(rows[-1]["mlm_accuracy"], abs=1e-6)
    assert first["mlm_loss"] == pytest.approx(rows[-1]["mlm_loss"], rel=1e-4)


def test_pretrain_demo_small_both_phases_and_transformers(tmp_path, no_procps_path):
    """pretrain_demo.sh at test size: real text (stdlib docstrings), both phases
    (config_CPU_1x2_pretrain_phase1.sh and phase2.sh through run_and_time.sh, as
    docs/pretraining.md's local recipe runs them), HF export from the run's own config, the
    downstream task (glue.py same-doc) fine-tuned from the pretrained model and its random twin."""
    env = dict(os.environ, PATH=no_procps_path, PD_OUT=str(tmp_path / "pd"),
               PD_MAX_DOCS="1500", PD_VOCAB="1000", PD_DUPE="2", PD_EVAL_SAMPLES="200", PD_HIDDEN="64",
               PD_LAYERS="2", PD_HEADS="2", PD_STEPS1="300", PD_BATCH1="32", PD_ACCUM1="1", PD_LR1="2e-2",
               PD_EVAL1="3200", PD_STEPS2="20", PD_BATCH2="8", PD_ACCUM2="2", PD_LR2="5e-3", PD_EVAL2="160",
               PD_SENTENCES="200", PD_DROPOUT="0",
               # the downstream step at its smallest; its margin is the full demo's (BENCHMARKS.md), here none
               PD_GLUE_PAIRS="1", PD_GLUE_EPOCHS="1", PD_GLUE_SEEDS="[1, 2]", PD_GLUE_LRS="[3.0e-4]",
               PD_GLUE_MARGIN="-1",
               # a smaller model's gain (0.050 measured once, 0.049 -> 0.099): learning, with room
               PD_GAIN="0.03")
    r = subprocess.run(["./pretrain_demo.sh"], cwd=PKG, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    out = tmp_path / "pd"
    s = json.loads((out / "summary.json").read_text())
    assert s["phase2_last_mlm_accuracy"] > s["phase1_first_mlm_accuracy"] + 0.03, s
    fm = json.loads((out / "fill_mask.json").read_text())
    assert fm["sentences"] >= 100 and fm["model_nll"] < fm["unigram_nll"], fm
    for p in (1, 2):
        assert json.loads((out / f"p{p}_check.json").read_text())["defects"] == {}
    assert (out / "curves.png").stat().st_size > 1000 and (out / "hf" / "config.json").exists()
    # the downstream task: both inits fine-tuned on every seed, the table written
    c = json.loads((out / "same_doc_compare.json").read_text())
    assert {i: len(c[i]["per_seed"]) for i in ("pretrained", "random")} == {"pretrained": 2, "random": 2}, c
    assert "| SAME-DOC | acc " in (out / "glue" / "same_doc" / "table.md").read_text()


# ---------------------------------------------------------------- SLURM: both phases, chained


# ---------------------------------------------------------------- how a run ends, as the docs launch it


def _launch(demo_data, out, extra_params: str, **env_extra) -> subprocess.CompletedProcess:
    """config_CPU_1x2.sh through run_and_time.sh, as docs/pretraining.md's local recipe runs a
    phase: the config sourced, your variables and EXTRA_PARAMS after it."""
    env = dict(os.environ, **demo_data.env)
    env.update(PATH=demo_data.path, DATADIR=str(demo_data.train), EVALDIR=str(demo_data.eval), LOGDIR=str(out),
               SEED="5", EXTRA_PARAMS=extra_params, **env_extra)
    return subprocess.run(["./run_and_time.sh"], cwd=PKG, env=env, capture_output=True, text=True, timeout=300)


def test_a_pretraining_phase_stops_at_its_step_count_whatever_the_sample_limit(demo_data, tmp_path):
    """run.mode=pretrain with config_CPU_1x2.sh: MAX_STEPS=12 ends the phase at step 12 although
    a sample limit of 1,600 (25 steps) would go on, at a rate that never reaches 0 (END_LR); the
    start says so. A benchmark run whose sample limit lies past the schedule's zero rate ends
    there (aborted), said too."""
    r = _launch(demo_data, tmp_path / "p", "run.mode=pretrain data.eval_samples=200 eval.interval_samples=640",
                MAX_STEPS="12", WARMUP_STEPS="2", DIVISION="open", END_LR="1e-4", MAX_SAMPLES_TERMINATION="1600")
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert "note: run.max_samples=1600 (MAX_SAMPLES_TERMINATION) is above the step count and does not end a " \
           "pretraining phase: it ends at optim.total_steps=12 (768 samples)" in r.stdout
    assert "run_stop success after 12 steps, 768 samples" in r.stdout
    stops = [e for e in mllog_events(tmp_path / "p" / "result_0.txt") if e["key"] == "run_stop"]
    assert [s["metadata"]["status"] for s in stops] == ["success"]
    # MLPerf mode, end_lr 0: past step 12 the rate is 0; a sample limit of 100,000 ends at step 12.
    r = _launch(demo_data, tmp_path / "m", "data.eval_samples=200 eval.interval_samples=640",
                MAX_STEPS="12", WARMUP_STEPS="2", MAX_SAMPLES_TERMINATION="100000", TARGET_MLM_ACCURACY="0.99")
    assert r.returncode == 1, (r.stdout + r.stderr)[-3000:]
    assert "note: the rate is 0 from step 12 (optim.end_lr=0 where the decay ends): the run ends there, after " \
           "768 samples, not at 100000" in r.stdout
    assert "run_stop aborted after 12 steps, 768 samples" in r.stdout


# ---------------------------------------------------------------- submit_pretrain.sh: what the jobs receive


def _submit(tmp_path, demo_data, configs, **env_extra) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """submit_pretrain.sh with tests/support/standin/sbatch first on the PATH: what each job
    would receive (options and environment), as recorded; nothing is run."""
    record = tmp_path / "sbatch"
    env = dict(os.environ, PATH=f"{PKG / 'tests' / 'support' / 'standin'}:{demo_data.path}", SBATCH_RECORD=str(record),
               DATADIR1=str(demo_data.train), EVALDIR1=str(demo_data.eval), DATADIR2=str(demo_data.train),
               EVALDIR2=str(demo_data.eval), OUTDIR=str(tmp_path / "out"))
    for var in ("EXTRA_PARAMS", "CONFIG_PARAMS", "CONFIG_SCRIPT", "LR", "SBATCH_EXTRA", "NODES"):
        env.pop(var, None)
    env.update(env_extra)
    r = subprocess.run(["./submit_pretrain.sh", *configs], cwd=PKG, env=env, capture_output=True, text=True, timeout=120)
    jobs = [json.loads(p.read_text()) for p in sorted(record.glob("job_*.json"))] if record.exists() else []
    return r, jobs


def _resolved(job: dict, *keys: str) -> list[str]:
    """The settings a job's run resolves to, read from the environment it received (the
    trainer's own reading: tools/config_env.py get)."""
    r = subprocess.run([sys.executable, "tools/config_env.py", "get", *keys], cwd=PKG, env=job["env"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout.split()


def test_submit_pretrain_passes_what_the_user_set_and_asks_for_the_gpus(tmp_path, demo_data):
    """A shell that sourced the CPU config earlier, then set LR and EXTRA_PARAMS: each job gets
    its phase's config with the user's LR and EXTRA_PARAMS over it (the config's own keys in
    CONFIG_PARAMS), none of the stale CPU config's values, the GPUs its config names
    (--gpus-per-node=DGXNGPU) and sbatch's own partition and account variables."""
    stale = source_config("config_CPU_1x2.sh")
    configs = ("config_A100PCIE_8x4_pretrain_large_phase1.sh", "config_A100PCIE_8x4_pretrain_large_phase2.sh")
    r, jobs = _submit(tmp_path, demo_data, configs, **{**stale, "LR": "1e-3", "EXTRA_PARAMS": "model.vocab_size=8000",
                                                      "SBATCH_PARTITION": "gpu", "SBATCH_ACCOUNT": "lab"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "model.vocab_size=8000 (EXTRA_PARAMS)" in r.stdout and "optim.lr=0.001 (LR in the environment)" in r.stdout
    assert len(jobs) == 2
    for phase, (job, config) in enumerate(zip(jobs, configs), 1):
        argv, env = job["argv"], job["env"]
        assert "--gpus-per-node=4" in argv and argv[argv.index("-N") + 1] == "8" and argv[-1] == "run.sub"
        assert "--requeue" in argv and "--signal=B:USR1@300" in argv  # checkpoint and requeue near the time limit
        assert env["SBATCH_PARTITION"] == "gpu" and env["SBATCH_ACCOUNT"] == "lab"
        assert env["EXTRA_PARAMS"] == "model.vocab_size=8000" and env["LR"] == "1e-3"
        assert env["CONFIG_SCRIPT"] == str(PKG / config) and "run.mode=pretrain" in env["CONFIG_PARAMS"]
        assert "CPU_THREADS_PER_RANK" not in env and env["BATCHSIZE"] == source_config(config)["BATCHSIZE"]
        assert env["DATADIR"] == str(demo_data.train) and env["LOGDIR"] == str(tmp_path / "out" / f"phase{phase}")
        assert _resolved(job, "model.vocab_size", "optim.lr", "run.device", "optim.total_steps") == \
            ["8000", "0.001", "cuda", source_config(config)["MAX_STEPS"]]
    assert jobs[1]["env"]["INIT_CHECKPOINT"] == str(tmp_path / "out" / "phase1" / "final.pt")
    assert f"--dependency=afterok:{1001}" in jobs[1]["argv"]


def test_submit_pretrain_refuses_before_submitting_what_would_fail_in_the_job(tmp_path, demo_data):
    """Checked before any sbatch: a phase 1 with 128 positions for a phase 2 at 512 (phase 2
    could not load its weights), and an eval set smaller than data.eval_samples (2,000 demo
    samples, 10,000 asked), a node count over which a phase's global batch cannot split (NODES=3
    for 8 x 4 GPUs' 65,536): exit 2 naming the setting, nothing submitted. A resubmission after
    phase 2 failed runs phase 2 again, on the nodes NODES asks for, and leaves a completed phase
    1 done."""
    phase1 = tmp_path / "config_mine_phase1.sh"
    phase1.write_text((PKG / "config_A100PCIE_8x4_pretrain_large_phase1.sh").read_text().replace(
        "data.max_seq_length=128", "data.max_seq_length=128 model.max_position_embeddings=128"))
    phase2 = PKG / "config_A100PCIE_8x4_pretrain_large_phase2.sh"
    r, jobs = _submit(tmp_path / "a", demo_data, (str(phase1), str(phase2)))
    assert r.returncode == 2 and not jobs, r.stdout + r.stderr
    assert "model.max_position_embeddings: phase 1 has 128, phase 2 needs 512 (data.max_seq_length=512)" in r.stderr
    r, jobs = _submit(tmp_path / "b", demo_data, (str(phase2.with_name("config_A100PCIE_8x4_pretrain_large_phase1.sh")),
                                                  str(phase2)), EXTRA_PARAMS="data.eval_samples=10000")
    assert r.returncode == 2 and not jobs, r.stdout + r.stderr
    assert f"data.eval_samples=10000 but data.eval_dir={demo_data.eval} holds 1000 samples" in r.stderr
    r, jobs = _submit(tmp_path / "n", demo_data, (str(phase2.with_name("config_A100PCIE_8x4_pretrain_large_phase1.sh")),
                                                  str(phase2)), NODES="3")
    assert r.returncode == 2 and not jobs, r.stdout + r.stderr
    assert "the config's global batch 65536 (run.local_batch_size 64 x run.grad_accum_steps 32 x 8 node(s) x 4) does " \
           "not split over 3 node(s) x 4 = 12 ranks; node counts that keep it: 1, 2, 4, 8, 16, 32" in r.stderr
    out = tmp_path / "c" / "out"
    for p, line in ((1, "done 1 0 0"), (2, "done 1 4 0")):
        (out / f"phase{p}").mkdir(parents=True)
        (out / f"phase{p}" / f"phase{p}_state.txt").write_text(line + "\n")
    r, jobs = _submit(tmp_path / "c", demo_data, ("config_A100PCIE_8x4_pretrain_large_phase1.sh", str(phase2)),
                      OUTDIR=str(out), NODES="4")
    assert r.returncode == 0 and len(jobs) == 2, r.stdout + r.stderr
    assert [job["argv"][job["argv"].index("-N") + 1] for job in jobs] == ["4", "4"]
    assert "phase 1: completed before" in r.stdout and "phase 2: failed before (training exit 4): run again, from the " \
                                                     "start" in r.stdout
    assert (out / "phase1" / "phase1_state.txt").read_text() == "done 1 0 0\n"
    assert (out / "phase2" / "phase2_state.txt").read_text() == ""
