"""bert/curves.py: the TensorBoard curves of the loop, read back with TensorBoard's own reader
(``event_accumulator``). The counts of a batch in both layouts, the imbalance and FLOP
arithmetic against bert/flops.py's per-sequence count, a one-process run's curves, and a
resumed writer that continues the curves without duplicated points. The server and two ranks:
tests/integration/test_curves.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from bert import curves, flops, train
from bert.batches import collate
from bert.config import ModelConfig
from bert.shards import Sample
from train_helpers import _small_overrides


def scalars(directory) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series in ``directory``'s event files: tag -> [(step, value)], as
    TensorBoard loads them (its purge of orphaned points included)."""
    acc = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _samples(lengths, masked):
    rng = np.random.default_rng(0)
    return [Sample(input_ids=rng.integers(5, 50, n), segment_ids=np.zeros(n, np.int64),
                   masked_positions=np.arange(1, 1 + m), masked_ids=rng.integers(5, 50, m), nsp_label=1)
            for n, m in zip(lengths, masked)]


def test_counts_are_the_same_in_both_layouts():
    lengths, masked = [7, 3, 12, 5], [2, 1, 3, 2]
    want = (4, 27, 49 + 9 + 144 + 25, 8)
    for unpad in (False, True):
        assert curves.batch_counts(collate(_samples(lengths, masked), unpad, 16)) == want


def test_imbalance_is_the_busiest_rank_over_the_mean_per_step():
    per_rank = [[[2, 100, 0, 0], [2, 50, 0, 0]], [[2, 300, 0, 0], [2, 50, 0, 0]]]  # rank, step, counts
    assert curves.imbalance(per_rank) == [pytest.approx(1.5), 1.0]
    assert curves.step_totals([(1, 10, 100, 2), (1, 20, 400, 3), (1, 5, 25, 1), (1, 5, 25, 1)], accum=2) == [
        [2, 30, 500, 5], [2, 10, 50, 2]]


def test_useful_flops_of_the_totals_are_flops_per_sequence_summed():
    shape = flops.Shape(hidden=64, layers=2, intermediate=256, vocab=100)
    lengths, masked = [7, 3, 12, 5], 8
    want = flops.train_flops(flops.useful_forward_flops(shape, lengths, masked))
    assert curves.useful_train_flops(shape, len(lengths), sum(lengths), sum(n * n for n in lengths), masked) == want


def test_a_run_writes_the_curves_at_each_progress_line_and_evaluation(demo_data, tmp_path):
    tb = tmp_path / "tb"
    assert train.main(_small_overrides(demo_data, tmp_path, f"log.tensorboard_dir={tb}", "log.peak_flops_per_s=1e11",
                                       "log.progress_interval_steps=4", "run.max_steps=12", "eval.interval_samples=192",
                                       "optim.max_grad_norm=1.0", "run.warmup_steps=0")) == 1  # no target: exit 1
    got = scalars(tb)
    for tag in ("train/loss", "train/learning_rate", "train/grad_norm", "train/loss_scale", "train/skipped_steps",
                "speed/samples_per_s", "speed/tokens_per_s", "speed/model_flops_per_s", "speed/mfu"):
        assert [s for s, _ in got[tag]] == [4, 8, 12], tag
    assert all(v > 0 for _, v in got["train/grad_norm"]) and all(v == 0 for _, v in got["train/skipped_steps"])
    # one process: every step's imbalance is 1, one point per step
    assert got["balance/busiest_over_mean_tokens"] == [(s, 1.0) for s in range(1, 13)]
    mfu, fl = dict(got["speed/mfu"]), dict(got["speed/model_flops_per_s"])
    assert all(mfu[s] == pytest.approx(fl[s] / 1e11) for s in mfu)
    tokens, rate = dict(got["speed/tokens_per_s"]), dict(got["speed/samples_per_s"])
    assert all(32 < tokens[s] / rate[s] <= 128 for s in tokens)  # tokens a sample: the demo's lengths, seq 128
    assert [s for s, _ in got["eval/mlm_accuracy"]] == [6, 12]  # every 192 samples = 6 steps of 32
    assert [s for s, _ in scalars(tb / "samples")["eval/mlm_accuracy"]] == [192, 384]
    assert [v for _, v in got["eval/mlm_accuracy"]] == [v for _, v in scalars(tb / "samples")["eval/mlm_accuracy"]]


class _Stream:
    def __init__(self, batch):
        self.batch = batch

    def __next__(self):
        return self.batch

    def state_dict(self):
        return {"at": 7}


def test_a_resumed_run_continues_the_curves_without_duplicated_points(tmp_path):
    """The first writer gets to step 30; the run resumes from its checkpoint at step 20 and
    writes steps 21..40 again: TensorBoard shows each step once, the second run's past 20."""
    model = ModelConfig(vocab_size=64, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    batch = collate(_samples([5, 9], [1, 2]), False, 16)

    def run(start: int, stop: int, value: float) -> None:
        c = curves.Curves(tmp_path, model=model, rank=0, world_size=1, accum=1, peak_flops_per_s=0.0,
                          start_step=start, start_samples=start * 2)
        stream = c.count(_Stream(batch))
        assert stream.state_dict() == {"at": 7}  # the stream's own, for the checkpoints
        for step in range(start + 1, stop + 1):
            next(stream)
            if step % 5 == 0:
                c.progress(step, {"loss": value + step}, 10.0)
                c.evaluate(step, step * 2, {"mlm_accuracy": value})
        c.close()

    run(0, 30, 100.0)
    run(20, 40, 200.0)
    got = scalars(tmp_path)
    assert got["train/loss"] == [(s, (100.0 if s <= 20 else 200.0) + s) for s in range(5, 41, 5)]
    assert [s for s, _ in got["balance/busiest_over_mean_tokens"]] == list(range(1, 41))
    assert [(s, v) for s, v in scalars(tmp_path / "samples")["eval/mlm_accuracy"]] == [
        (s * 2, 100.0 if s <= 20 else 200.0) for s in range(5, 41, 5)]


def test_without_tensorboard_installed_the_key_is_named(tmp_path, monkeypatch):
    monkeypatch.setattr(curves.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(curves.ConfigError, match="log.tensorboard_dir"):
        curves.Curves(tmp_path, model=ModelConfig(), rank=0, world_size=1, accum=1, peak_flops_per_s=0.0,
                      start_step=0, start_samples=0)


@pytest.mark.parametrize("bucket", [False, True])
def test_the_kept_gradient_norm_is_the_norm_before_clipping(bucket):
    """grad_sync.build(keep_norm=True): the global clip's (or the one-process bucket clip's)
    norm before clipping, as torch.linalg computes it, while the gradients are clipped."""
    from bert import grad_sync
    from bert.config import GradSyncConfig

    params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2, 2))]
    for p, g in zip(params, (torch.tensor([3.0, 0.0, 4.0]), torch.full((2, 2), 6.0))):
        p.grad = g.clone()
    want = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in params]))  # 13
    cfg = GradSyncConfig(bucket_clip_norm=1.0 if bucket else 0.0)
    sync = grad_sync.build(cfg, None, params, 0.0 if bucket else 1.0, keep_norm=True)
    sync.after_sync()
    assert float(sync.norm) == pytest.approx(float(want))
    assert float(torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in params]))) == pytest.approx(1.0, rel=1e-5)
    assert grad_sync.build(GradSyncConfig(), None, params, 1.0).norm is None  # off unless asked
