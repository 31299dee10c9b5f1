"""Pretraining mode (run.mode=pretrain): no target, held-out MLM/NSP accuracy and loss at
intervals, ends at its step count with curves and a plot; phase 2 starts from phase 1's
weights; submit_pretrain.sh chains both phases on a real SLURM cluster (phase 1 preempted
once, requeued and resumed); the small two-phase demo on real text, checked by HF transformers."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time

import pytest

from bert.config import build_config
from bert.train import run
from conftest import PKG, hold_env, mllog_events, source_config

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
    """pretrain_demo.sh at test size: real text (stdlib docstrings), both phases, HF export, the
    downstream fine-tuning of the pretrained model and its random twin."""
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
    assert "| STDLIB-SAME-DOC | acc " in (out / "glue" / "same_doc" / "table.md").read_text()


# ---------------------------------------------------------------- SLURM: both phases, chained


def test_submit_pretrain_chains_phases_and_survives_a_preemption(demo_data, tmp_path):
    """submit_pretrain.sh on a private one-node SLURM cluster with tiny phase configs: phase 2
    waits for phase 1 (afterok); phase 1 gets SIGUSR1 mid-run (what --signal=B:USR1@<s> sends
    before the time limit), checkpoints, requeues itself and resumes; phase 2 then starts from
    phase 1's final weights and completes."""
    from slurm_cluster import SlurmCluster, slurm_unavailable

    why = slurm_unavailable()
    if why:
        pytest.skip(why)
    cluster = SlurmCluster(tmp_path / "slurm")
    (tmp_path / "slurm").mkdir()
    demo = source_config("config_CPU_1x2.sh")
    for p, steps in ((1, 40), (2, 10)):  # phase 1: held after step 10 until signalled (hold_env)
        (tmp_path / f"phase{p}.sh").write_text(
            f"export DGXSYSTEM=CPU_1x2 DGXNNODES=1 DGXNGPU=2 WALLTIME=10 CPU_THREADS_PER_RANK=1 DIVISION=open\n"
            f"export BATCHSIZE=16 GRADIENT_STEPS=2 LR=0.005 MAX_STEPS={steps} WARMUP_STEPS=2 EVAL_ITER_SAMPLES=640\n"
            f"export EXTRA_PARAMS=\"run.mode=pretrain {demo['EXTRA_PARAMS']} data.eval_samples=200 "
            f"log.progress_interval_steps=5 ckpt.poll_steps=5\"\n")
    try:
        cluster.start()
        env = dict(os.environ, PATH=demo_data.path, SLURM_CONF=cluster.env["SLURM_CONF"],
                   DATADIR1=str(demo_data.train), EVALDIR1=str(demo_data.eval), DATADIR2=str(demo_data.train),
                   EVALDIR2=str(demo_data.eval), OUTDIR=str(tmp_path / "out"),
                   **hold_env(tmp_path, "boundary:0:10:signal:if=LOGFILE=phase1_1.log"))
        sub = subprocess.run(["./submit_pretrain.sh", str(tmp_path / "phase1.sh"), str(tmp_path / "phase2.sh")],
                             cwd=PKG, env=env, capture_output=True, text=True, timeout=60)
        assert sub.returncode == 0, sub.stderr
        job1, job2 = re.findall(r"job (\d+)", sub.stdout)[:2]
        assert (cluster.job_fields(job2).get("Dependency") or "").startswith(f"afterok:{job1}")
        out1 = tmp_path / "out" / "phase1"
        deadline = time.monotonic() + 240
        while not (tmp_path / "held" / "held_rank0_step10").exists():
            assert time.monotonic() < deadline, cluster.logs()
            time.sleep(0.1)
        subprocess.run(["scancel", "--batch", "--signal=USR1", job1], env=cluster.env, check=True, timeout=30)
        cluster.requeue_now(job1)  # not after SLURM's ~2-minute hold
        j1 = cluster.wait_job(job1, timeout_s=300)
        j2 = cluster.wait_job(job2, timeout_s=300)
        text1 = "".join(f.read_text() for f in out1.glob("slurm-*.out"))
        text2 = "".join(f.read_text() for f in (tmp_path / "out" / "phase2").glob("slurm-*.out"))
        assert j1["JobState"] == "COMPLETED" and j1["Restarts"] == "1", text1[-3000:]
        assert "SIGUSR1: requeueing job" in text1 and re.search(r"resumed from .*phase1_1_ckpt", text1), text1[-3000:]
        assert j2["JobState"] == "COMPLETED", text2[-3000:]
        assert (out1 / "final.pt").exists() and (tmp_path / "out" / "phase2" / "final.pt").exists()
        cfg2 = json.loads((tmp_path / "out" / "phase2" / "phase2_1_config.json").read_text())
        assert cfg2["run"]["init_checkpoint"] == str(out1 / "final.pt") and cfg2["run"]["mode"] == "pretrain"
        stops = [e["metadata"]["status"] for e in mllog_events(out1 / "phase1_1.log") if e["key"] == "run_stop"]
        assert stops == ["aborted", "success"]
        assert (out1 / "phase1_1_curves.png").exists()
    finally:
        cluster.stop()
