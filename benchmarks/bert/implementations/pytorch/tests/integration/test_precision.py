"""Mixed precision (bert.precision) through the real training step: the integration tier's
(processes started, or long); tests/unit/test_precision.py has the rest and says what the
file covers."""

from __future__ import annotations

import pytest
import torch

from bert import train
from bert.evaluate import mlm_accuracy
from bert.trainer import Trainer
from conftest import mllog_events, run_checker
from precision_helpers import _parts, one_thread  # noqa: F401 - one_thread: an autouse fixture


def _linear_dtypes(p: Trainer, run) -> set[torch.dtype]:
    seen: set[torch.dtype] = set()
    hook = p.learner.model.bert.encoder.layer[0].intermediate.dense.register_forward_hook(
        lambda _m, _i, out: seen.add(out.dtype))
    try:
        run()
    finally:
        hook.remove()
    return seen


@pytest.mark.parametrize("dtype, eval_dtype, train_out, eval_out", [
    ("bf16", "train", torch.bfloat16, torch.bfloat16),
    ("fp16", "fp32", torch.float16, torch.float32),
    ("fp32", "bf16", torch.float32, torch.bfloat16),
])
def test_autocast_in_training_and_eval_weights_and_state_stay_fp32(demo_data, tmp_path, dtype, eval_dtype,
                                                                   train_out, eval_out):
    p = _parts(demo_data, tmp_path, f"precision.dtype={dtype}", f"precision.eval_dtype={eval_dtype}",
               "optim.name=adamw", "precision.loss_scale_init=256")
    assert _linear_dtypes(p, lambda: p.step(p.batches, 1)) == {train_out}
    assert _linear_dtypes(p, lambda: mlm_accuracy(p.learner.model, p.eval_batches, p.learner.device,
                                                  p.learner.precision.eval_autocast)) == {eval_out}
    # Master weights and optimizer state: float32 whatever the arithmetic.
    assert {t.dtype for t in p.learner.model.parameters()} == {torch.float32}
    state = [v for s in p.learner.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.numel() > 1]
    assert state and {t.dtype for t in state} == {torch.float32}


@pytest.fixture(scope="module")
def small_demo(tmp_path_factory):
    """The demo language (bert/demo_data.py) at vocab 32 and sequences up to 64, the
    demo's being 128 and 128: it reaches 0.72 in about half the demo's samples, each step at
    about half the cost (the bf16 test's budget; its numbers: BENCHMARKS.md)."""
    from bert import demo_data as gen

    root = tmp_path_factory.mktemp("small_demo")
    gen.generate(root, train_samples=8000, eval_samples=500, seed=1, seq_len=64, max_pred=10, vocab=32,
                 layout="variable", shards=2)
    return root


@pytest.mark.parametrize("residual", ["false", "true"], ids=["fp32_residual", "autocast_residual"])
def test_bf16_trains_demo_model_to_target_from_scratch(demo_data, small_demo, tmp_path, capsys, residual):
    """The demo's recipe (config_CPU_1x2.sh: LAMB lr 0.02, warmup 50) on a smaller model
    (hidden 64, 1 layer, 2 heads, intermediate 256) from random init, in bf16 autocast, on one
    process, on the smaller demo data above. Must reach 0.720 (the run stops there, exit 0)
    and its log pass the checker. Smaller because CPUs without native bf16 (AVX2 only)
    emulate its matrix work: the demo's width took 295 s there (11,200 samples at ~0.84 s a
    step), hidden 64 with 2 layers 129 s (17,600 samples), this one 85 s (19,200 samples;
    hidden 32 took 30,400, too near the cap). Also with model.autocast_residual: the residual
    stream in bf16 too."""
    geometry = ["model.vocab_size=32", "model.max_position_embeddings=64", "data.max_seq_length=64",
                "data.max_predictions_per_seq=10", "model.hidden_size=64", "model.num_layers=1", "model.num_heads=2",
                "model.intermediate_size=256"]
    rc = train.main([*demo_data.env["CONFIG_PARAMS"].split(), *geometry, f"data.train_dir={small_demo / 'train'}",
                     f"data.eval_dir={small_demo / 'eval'}", "data.eval_samples=500", f"log.output_dir={tmp_path}",
                     "precision.dtype=bf16", f"model.autocast_residual={residual}", "run.local_batch_size=32",
                     "optim.lr=0.02", "optim.warmup_steps=50", "optim.total_steps=2000", "eval.interval_samples=1600", "run.max_samples=32000",
                     "run.threads=1"])
    out = capsys.readouterr().out
    assert rc == 0, out[-3000:]
    assert "precision bf16 (eval bf16, loss scaling none)" in out
    ok, check = run_checker(tmp_path / "result_0.txt")
    assert ok, check
    events = mllog_events(tmp_path / "result_0.txt")
    assert {e["key"]: e["value"] for e in events}["precision"] == "bf16"
    assert [e["value"] for e in events if e["key"] == "skipped_steps"][-1] == 0
    accs = [e["value"] for e in events if e["key"] == "eval_accuracy"]
    assert accs[0] < 0.3 and accs[-1] >= 0.72  # learned here, not already known


def test_compiled_layers_match_eager(demo_data, tmp_path, monkeypatch):
    """model.compile_layers: same parameter names, and the same losses as eager over a few
    steps. Dynamo captures each layer (forward and, through AOT autograd, backward); the
    code generator is swapped for aot_eager here because inductor's C++ build of even this
    tiny layer takes minutes on a shared 2-core machine (what it generates is torch's to
    test; that our layer traces and trains the same is ours)."""
    real_compile = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile",
                        lambda self, **kw: real_compile(self, **{**kw, "backend": "aot_eager"}))
    losses = {}
    for flag in ("false", "true"):
        p = _parts(demo_data, tmp_path / flag, f"model.compile_layers={flag}", "optim.lr=1e-3", seed=4)
        losses[flag] = torch.stack([p.step(p.batches, 1)[0] for _ in range(3)])
        names = [n for n, _ in p.learner.model.named_parameters()]
    assert all(not n.startswith("_orig_mod") for n in names)
    assert p.learner.model.bert.encoder.layer[0]._compiled_call_impl is not None
    torch.testing.assert_close(losses["true"], losses["false"], rtol=1e-4, atol=1e-5)
