"""The fast stack's warm-ups on the CPU under torch.compile (dynamo's eager backend): no
compile after them; the rest of bert/step_graph.py's tests are in tests/unit/test_step_graph.py."""

from __future__ import annotations

import dataclasses
import logging

import torch

from bert import evaluate, loader, step_graph
from bert.optim import build_optimizer, build_scheduler
from bert.trainer import Trainer, eval_layout, train_layout
from step_graph_helpers import SINGLE, EagerCompile, Replay, _cfg, data_eval_set, one_thread  # noqa: F401 - one_thread: autouse


def test_no_compile_after_the_warm_ups_for_budgets_graphs_and_eval(demo_data, tmp_path, monkeypatch, caplog):
    """The fast stack on the CPU (compiled layers, token budgets for training and eval, bf16
    autocast, graphs through the stand-in): the training warm-up compiles once for every
    rung and its capture adds no compile (same autocast cache setting), the eval warm-up
    compiles once for every eval rung, and then training on the real loader and a whole
    evaluation (its short last batch filled) run with dynamo set to raise on a recompile.
    The graphed evaluation's accuracy equals the eager, exact (unbudgeted) evaluation's."""
    from bert.precision import build_precision

    caplog.set_level(logging.INFO, logger="bert")
    EagerCompile(monkeypatch)
    torch._dynamo.reset()  # counters and caches of earlier tests in this process
    over = ["data.token_budgets=auto", "run.warmup_steps=1", "model.compile_layers=true",
            "model.attention_backend=math", "model.intermediate_size=96", "precision.dtype=bf16",
            "eval.batch_size=16", "data.eval_samples=50", "optim.impl=torch"]
    cfg = _cfg(demo_data, tmp_path, *over)
    t = Trainer(cfg, SINGLE, torch.device("cpu"))
    monkeypatch.setattr(step_graph, "CudaGraphs", Replay)
    t.cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, cuda_graphs=True))
    # What build_learner makes with run.cuda_graphs on CUDA: the capturable LAMB, uncached autocast.
    opt, _ = build_optimizer(t.learner.model, cfg.optim, "cpu", capturable=True)
    t.learner.optimizer, t.learner.scheduler = opt, build_scheduler(opt, cfg.optim)
    t.learner.precision = build_precision(cfg.precision, "cpu", autocast_cache=False)
    frames = step_graph.compiled_frames
    f0 = frames()
    t.prepare_step()
    step = t.step
    assert isinstance(step, step_graph.GraphedStep) and len(step.micro) == len(train_layout(cfg, 1).rungs) > 1
    assert frames() - f0 == 1, "training: one compile for every rung, none at capture"
    f1 = frames()
    t.prepare_eval()
    assert isinstance(t.eval_counts, evaluate.GraphedEval)
    assert len(t.eval_counts.captured) == len(eval_layout(cfg).rungs) > 1
    assert frames() - f1 == 1, "evaluation: one no-grad compile for every eval rung"
    assert "eval warm-up before run_start" in caplog.text and "compile" in caplog.text
    caplog.clear()
    t.open_data(timed=False)
    real = t.learner
    assert len(t.eval_batches) == 4 and all(b["cu_seqlens"].numel() == 17 for b in t.eval_batches)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(6):
            loss, _ = step(t.batches, 1)
            assert torch.isfinite(loss)
        acc = evaluate.mlm_accuracy(real.model, t.eval_batches, real.device, real.precision.eval_autocast,
                                    t.eval_counts)
    assert frames() == f1 + 1
    assert "was not captured" not in caplog.text
    exact = loader.eval_batches(data_eval_set(cfg), loader.BatchPlan(True, False, None, 16, cfg.data.max_seq_length,
                                                                     cfg.data.max_predictions_per_seq,
                                                                     cfg.model.vocab_size))
    assert evaluate.mlm_accuracy(real.model, exact, real.device, real.precision.eval_autocast) == acc
