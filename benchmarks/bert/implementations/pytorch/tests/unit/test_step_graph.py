"""The warm-up before run_start and the graphed step (bert/step_graph.py), on the CPU.

Oracles: the eager ``bert.trainer.train_step`` itself. A warm-up must leave no trace (the
trajectory after it equals the trajectory of a run without it, bit for bit), and the
graphed step must compute what the eager step computes. CUDA's recording cannot run here:
the graphed step is driven by a stand-in whose "replay" calls the captured function again,
which checks everything of ours around the capture (static input buffers, persistent
gradients accumulated in place, the optimizer graph's zeroing, the losses, shape keys and
the eager fallback for a shape that was not captured).
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest
import torch

from bert import batches, loader, rng, step_graph, train
from bert.config import ConfigError, check_cuda_graphs
from bert.optim import build_optimizer, build_scheduler
from bert.trainer import Trainer, eval_plan, train_layout, train_plan, train_step
from step_graph_helpers import SINGLE, TINY, Replay, _cfg, data_eval_set, one_thread  # noqa: F401 - one_thread: autouse


def _trainer(cfg):
    t = Trainer(cfg, SINGLE, torch.device("cpu"))
    t.open_data(timed=False)
    return t


def _weights(learner):
    return {k: v.detach().clone() for k, v in learner.model.state_dict().items()}


def _batches(cfg, counts, seed=5):
    d, m = cfg.data, cfg.model
    collate = loader.batch_collate(m.unpad, m.pack, d.max_seq_length)
    return batches.synthetic_batches(collate, counts, cfg.run.local_batch_size, d.max_seq_length,
                                     d.max_predictions_per_seq, m.vocab_size, seed=seed)


def test_synthetic_samples_have_the_asked_shape():
    rng = np.random.default_rng(0)
    s = batches.synthetic_samples(1001, 4, 512, 76, 100, rng)
    assert sum(len(x.input_ids) for x in s) == 1001 and len(s) == 4
    for x in s:
        assert 1 <= x.masked_positions.min() and x.masked_positions.max() < len(x.input_ids)
        assert len(x.masked_positions) == min(76, round(0.15 * (len(x.input_ids) - 1)))
        assert np.array_equal(x.masked_ids, x.input_ids[x.masked_positions])
        assert x.input_ids.min() >= 1 and x.input_ids.max() < 100
    # Capped at the grid and at two tokens a sample.
    assert [len(x.input_ids) for x in batches.synthetic_samples(10**6, 2, 64, 10, 50, rng)] == [64, 64]


def test_warm_up_leaves_no_trace(demo_data, tmp_path):
    """After a warm-up (steps on synthetic batches, restore) the state is
    the one before it -- weights, optimizer, schedule, RNG -- and training goes on exactly
    as it would have without the warm-up: same losses and weights, bit for bit."""
    cfg = _cfg(demo_data, tmp_path, "run.warmup_steps=2")
    cold, warm = _trainer(cfg).learner, _trainer(cfg).learner
    before = _weights(warm)
    ptrs = [p.data_ptr() for p in warm.model.parameters()]
    saved = (torch.get_rng_state(), np.random.get_state()[1].copy())
    eager = lambda batches, accum: train_step(warm, batches, accum)  # noqa: E731
    step, info = step_graph.warm_up(warm, _batches(cfg, [300, 500]), eager, 2, 1)
    assert step is eager and info["steps"] == 4 and info["shapes"] == 2 and info["graphs"] == 0
    after = _weights(warm)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert [p.data_ptr() for p in warm.model.parameters()] == ptrs  # restored in place
    assert warm.scheduler.last_epoch == cold.scheduler.last_epoch
    assert warm.optimizer.param_groups[0]["lr"] == cold.optimizer.param_groups[0]["lr"]
    assert all(p.grad is None for p in warm.model.parameters())
    assert torch.equal(torch.get_rng_state(), saved[0]) and np.array_equal(np.random.get_state()[1], saved[1])
    losses = {}
    for name, p in (("cold", cold), ("warm", warm)):
        rng.seed_everything(21)  # the same dropout draws for both
        batches = iter(_batches(cfg, [300, 400, 500], seed=6))
        losses[name] = torch.stack([train_step(p, batches, 1)[0] for _ in range(3)])
    assert torch.equal(losses["cold"], losses["warm"])
    w_cold, w_warm = _weights(cold), _weights(warm)
    assert all(torch.equal(w_cold[k], w_warm[k]) for k in w_cold)


def test_restore_zeroes_state_the_warm_up_created_in_place(demo_data, tmp_path):
    """A fresh optimizer has no state; the warm-up creates it. Restore zeroes it in place
    (a captured graph holds those tensors), which is the state a first update starts from."""
    cfg = _cfg(demo_data, tmp_path)
    parts = _trainer(cfg).learner
    snap = step_graph.snapshot(parts)
    train_step(parts, iter(_batches(cfg, [300, 300])), 1)
    p0 = next(parts.model.parameters())
    state = parts.optimizer.state[p0]
    tensors = {k: v for k, v in state.items() if torch.is_tensor(v)}
    assert tensors and any(v.abs().sum() > 0 for v in tensors.values())
    ptrs = {k: v.data_ptr() for k, v in tensors.items()}
    step_graph.restore(parts, snap)
    for k, v in parts.optimizer.state[p0].items():
        if torch.is_tensor(v):
            assert v.data_ptr() == ptrs[k] and not v.any(), k
        else:
            assert v == 0, k
    # The first step after restore is the first step of a fresh run.
    fresh = _trainer(cfg).learner
    rng.seed_everything(11)
    a = train_step(parts, iter(_batches(cfg, [300])), 1)[0]
    rng.seed_everything(11)
    b = train_step(fresh, iter(_batches(cfg, [300])), 1)[0]
    assert torch.equal(a, b)
    assert all(torch.equal(x, y) for x, y in zip(parts.model.parameters(), fresh.model.parameters()))


@pytest.mark.parametrize("accum", [1, 2])
def test_graphed_step_computes_the_eager_step(demo_data, tmp_path, accum, caplog):
    """The graphed step (replayed through the stand-in) against the eager train_step: same
    losses and weights over several steps, gradients kept in the same storage (what a graph
    reads), one capture per shape plus the optimizer's, and a shape that was not captured
    runs eagerly, with one note."""
    caplog.set_level(logging.INFO, logger="bert")
    cfg = _cfg(demo_data, tmp_path, f"run.grad_accum_steps={accum}", "run.warmup_steps=1")
    known = _batches(cfg, [300, 420], seed=7)
    # The same shapes with other tokens (the static buffers must take each batch's values),
    # and a shape never captured.
    same_shapes = _batches(cfg, [300, 420], seed=9)
    unknown = _batches(cfg, [350], seed=8)[0]
    stream = [same_shapes[0], same_shapes[1], unknown, known[0], same_shapes[1], unknown] * accum
    eager, graphed = _trainer(cfg), _trainer(cfg)
    replay = Replay()
    step, info = step_graph.warm_up(graphed.learner, known, graphed.step, 1, accum, graphs=replay)
    assert isinstance(step, step_graph.GraphedStep) and info["graphs"] == 3 and replay.captured == 3
    grads = [p.grad.data_ptr() for p in graphed.learner.model.parameters()]
    # The eager twin takes the same warm-up steps (no graphs), so both share the RNG draws.
    step_graph.warm_up(eager.learner, known, eager.step, 1, accum)
    eager_stream, graphed_stream = iter(stream), iter(stream)
    eager, graphed = eager.learner, graphed.learner
    n = len(stream) // accum
    rng.seed_everything(21)
    ref = torch.stack([train_step(eager, eager_stream, accum)[0] for _ in range(n)])
    rng.seed_everything(21)
    got = torch.stack([step(graphed_stream, accum)[0] for _ in range(n)])
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    for a, b in zip(eager.model.parameters(), graphed.model.parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    assert [p.grad.data_ptr() for p in graphed.model.parameters()] == grads
    assert all(not p.grad.any() for p in graphed.model.parameters())  # zeroed by the optimizer graph
    assert eager.scheduler.last_epoch == graphed.scheduler.last_epoch
    assert caplog.text.count("was not captured") == 1


def test_check_refuses_what_graphs_cannot_do(demo_data, tmp_path):
    cuda = "cuda"  # a device type: nothing runs on it
    ok = ["run.cuda_graphs=true", "run.warmup_steps=2", "data.token_budgets=auto", "precision.dtype=bf16"]
    check_cuda_graphs(_cfg(demo_data, tmp_path, *ok), "cuda", 1)
    cases = [
        ((), "cpu", 1, "CUDA device"),
        ((), cuda, 2, "2 ranks"),
        (("precision.dtype=fp16",), cuda, 1, "fp16"),
        (("optim.impl=apex",), cuda, 1, "apex"),
        (("data.token_budgets=",), cuda, 1, "data.token_budgets"),
        (("run.warmup_steps=0",), cuda, 1, "run.warmup_steps"),
    ]
    for extra, device, world, words in cases:
        with pytest.raises(ConfigError, match=r"run\.cuda_graphs:.*" + words.replace(".", r"\.")):
            check_cuda_graphs(_cfg(demo_data, tmp_path, *ok, *extra), device, world)
    check_cuda_graphs(_cfg(demo_data, tmp_path, "run.cuda_graphs=false"), "cpu", 4)
    with pytest.raises(ConfigError, match="run.warmup_steps"):
        _cfg(demo_data, tmp_path, "run.warmup_steps=-1")


def test_a_run_with_warm_up_ends_where_one_without_does(demo_data, tmp_path, capsys):
    """Through ``python -m bert.train``'s main: the warm-up runs before run_start (its line
    is printed before the log's run_start), the log stays checker-shaped, and the run's
    final weights equal those of the same run without a warm-up, bit for bit."""
    from conftest import mllog_events

    final = {}
    for n in (0, 2):
        out = tmp_path / f"w{n}"
        rc = train.main([*demo_data.env["CONFIG_PARAMS"].split(), f"data.train_dir={demo_data.train}",
                         f"data.eval_dir={demo_data.eval}", f"log.output_dir={out}", *TINY,
                         f"run.warmup_steps={n}", "run.max_samples=24", "eval.interval_samples=24",
                         "run.threads=1", f"run.save_checkpoint={out / 'final.pt'}"])
        assert rc == 1  # the sample limit, not the target
        final[n] = torch.load(out / "final.pt")
        printed = capsys.readouterr().out
        assert ("warm-up before run_start: 2 steps on synthetic batches" in printed) == (n == 2), printed[-1500:]
        keys = [e["key"] for e in mllog_events(out / "result_0.txt")]
        assert keys.index("init_stop") < keys.index("run_start") < keys.index("run_stop")
    assert final[0].keys() == final[2].keys()
    assert all(torch.equal(final[0][k], final[2][k]) for k in final[0])


def test_warm_up_captures_every_shape_the_loader_makes(demo_data, tmp_path, monkeypatch, caplog):
    """With data.token_budgets=auto the warm-up fills each rung exactly, so every batch the
    real loader then produces has a captured shape: no eager fallback in the run."""
    caplog.set_level(logging.INFO, logger="bert")
    cfg = _cfg(demo_data, tmp_path, "data.token_budgets=auto", "run.warmup_steps=1")
    t = _trainer(cfg)
    monkeypatch.setattr(step_graph, "CudaGraphs", Replay)
    t.cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, cuda_graphs=True))
    with pytest.raises(ConfigError, match="capturable=True"):  # the plain LAMB that build_learner made
        t.prepare_step()
    # What build_learner makes with run.cuda_graphs (on CUDA): the capturable LAMB.
    opt, impl = build_optimizer(t.learner.model, cfg.optim, "cpu", capturable=True)
    assert impl == "lamb:foreach-capturable" and step_graph.capturable(opt)
    t.learner.optimizer, t.learner.scheduler = opt, build_scheduler(opt, cfg.optim)
    t.prepare_step()
    step = t.step
    assert isinstance(step, step_graph.GraphedStep)
    layout = train_layout(cfg, 1)
    assert len(step.micro) == len(layout.rungs) > 1
    tokens = [next(shape for name, shape, *_ in key if name == "input_ids")[0] for key in step.micro]
    assert sorted(tokens) == list(layout.rungs)
    for _ in range(12):
        loss, skipped = step(t.batches, 1)
        assert torch.isfinite(loss) and skipped == 0
    out = caplog.text
    assert "warm-up before run_start: %d steps" % len(layout.rungs) in out
    assert "was not captured" not in out


def test_pinned_batches_for_training_and_eval(demo_data, tmp_path, monkeypatch):
    """pin=True (what open_data asks on CUDA): every tensor of a training batch (budget
    collate) and of an eval batch comes through Tensor.pin_memory (a stand-in here: a CPU
    build of torch cannot pin); pin=False leaves them as collate made them."""
    pinned = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t: pinned.append(t) or t.clone())
    cfg = _cfg(demo_data, tmp_path, "data.token_budgets=auto", "eval.batch_size=16", "data.eval_samples=50")
    training = loader.train_batches(data=cfg.data, sampler=cfg.sampler, model=cfg.model, plan=train_plan(cfg, 1, pin=True),
                                    seed=cfg.run.seed, rank=0, world_size=1)
    batch = next(training)
    training.close()
    assert len(pinned) == sum(torch.is_tensor(v) for v in batch.values()) > 0
    pinned.clear()
    evals = loader.eval_batches(data_eval_set(cfg), eval_plan(cfg, pin=True))
    assert len(pinned) == sum(torch.is_tensor(v) for b in evals for v in b.values())
    pinned.clear()
    loader.eval_batches(data_eval_set(cfg), eval_plan(cfg))
    assert not pinned
