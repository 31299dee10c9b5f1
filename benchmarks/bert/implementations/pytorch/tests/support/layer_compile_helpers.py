"""One compile for every encoder layer, with the Triton attention op (in Triton's CPU
interpreter): the fast stack's claim that ``model.compile_layers`` compiles the layer once for
all 24 of BERT-Large's layers and every token-budget rung, and never again after the
warm-ups, checked on a model of more than one layer (the device run raises dynamo's
recompile limit to 64, which would hide a recompile per layer).

Used by tests/integration/test_triton_attention.py (dynamo's ``aot_eager`` backend: AOT
autograd traces forward and backward through the op's fake implementation, nothing is
generated; and inductor, C++ on the CPU); bench/preflight.sh runs it on the device's torch
and Triton.
"""

from __future__ import annotations

import torch

from bert import step_graph
from bert import triton_attention as ta
from bert.attention import TritonVarlenAttention
from bert.batches import warmup_token_counts
from bert.config import build_config
from bert.distributed import DistEnv
from bert.evaluate import mlm_accuracy
from bert.trainer import Trainer, train_plan

SINGLE = DistEnv(rank=0, world_size=1, local_rank=0, master_addr="127.0.0.1", master_port=29500, launcher="single")
LAYERS = 4


def compiles_per_phase(monkeypatch, backend: str, levers: dict) -> dict[str, int]:
    """A ``LAYERS``-layer model with ``compile_layers``, token budgets and attention dropout
    0.1 through the Triton op (``levers``: its speed levers), built and warmed up by the
    trainer itself (``Trainer.prepare_step``, ``prepare_eval``) with ``torch.compile`` on
    ``backend``; then two more training steps on fresh batches of every rung and an
    evaluation, with dynamo set to raise on a recompile. Returns the frames compiled in each
    phase, the rungs and the layers that ran compiled."""
    saved = torch.compile
    monkeypatch.setattr(torch, "compile", lambda *a, **kw: saved(*a, **{**kw, "backend": backend}))
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=64):  # the device run's (bench/measure.py's setup_device)
        return _compiles_per_phase(levers)


def _compiles_per_phase(levers: dict) -> dict[str, int]:
    cfg = build_config({
        "model.vocab_size": "100", "model.hidden_size": "32", "model.num_layers": str(LAYERS), "model.num_heads": "2",
        "model.intermediate_size": "64", "model.max_position_embeddings": "32", "model.compile_layers": "true",
        "model.attention_backend": "math", "model.attention_dropout": "0.1", "data.token_budgets": "auto",
        "data.max_seq_length": "32", "data.max_predictions_per_seq": "5", "run.local_batch_size": "3",
        "run.warmup_steps": "1", "run.device": "cpu", "run.seed": "0", "eval.batch_size": "4", "optim.impl": "torch"})
    trainer = Trainer(cfg, SINGLE, torch.device("cpu"))
    model = trainer.learner.model
    model.attn_backend = TritonVarlenAttention(ta.varlen, levers)  # build_attention refuses triton on a CPU
    frames = step_graph.compiled_frames
    f0 = frames()
    trainer.prepare_step()
    f1 = frames()
    trainer.prepare_eval()
    f2 = frames()
    plan = train_plan(cfg, 1)  # the batches the loader would make: one fresh batch per rung
    rungs = warmup_token_counts(plan.layout, plan.batch_size, plan.max_seq_length)
    fresh = plan.warmup_batches(seed=7)
    learner = trainer.learner
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(2):
            loss, _ = trainer.step(iter(fresh), len(fresh))
            assert torch.isfinite(loss)
        mlm_accuracy(model, trainer.eval_warmup_batches(), learner.device, learner.precision.eval_autocast,
                     trainer.eval_counts)
    compiled_layers = sum(getattr(layer, "_compiled_call_impl", None) is not None for layer in model.bert.encoder.layer)
    return {"train_warmup": f1 - f0, "eval_warmup": f2 - f1, "after": frames() - f2, "rungs": len(rungs),
            "compiled_layers": compiled_layers}
