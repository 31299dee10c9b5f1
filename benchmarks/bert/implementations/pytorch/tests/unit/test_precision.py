"""Mixed precision (bert.precision) through the real training step: bf16 and fp16 autocast,
fp16 dynamic loss scaling (skip + backoff on inf/nan, growth on schedule), fp32 master
weights and optimizer state, evaluation precision, the resolved settings in the log, a
bf16 run of the demo model from scratch to the demo target, and the torch.compile option.

Oracles: torch.amp.GradScaler's documented rules (backoff on a non-finite step, growth
after growth_interval finite ones), fp32 arithmetic for the bf16 loss, and the MLCommons
compliance checker for the log.
"""

from __future__ import annotations

import copy
import json
import re
import warnings

import pytest
import torch

from bert import precision as prec
from bert import train
from bert.config import ConfigError, PrecisionConfig, build_config
from bert.trainer import Trainer
from conftest import mllog_events
from precision_helpers import TINY, _demo, _parts, one_thread  # noqa: F401 - one_thread: an autouse fixture


def _snapshot(p: Trainer):
    return ({n: t.detach().clone() for n, t in p.learner.model.named_parameters()},
            copy.deepcopy(p.learner.optimizer.state_dict()))


def _assert_same(a, b):
    for n in a:
        assert torch.equal(a[n], b[n]), n


def _assert_state_equal(a: dict, b: dict):
    assert a["state"].keys() == b["state"].keys()
    for k in a["state"]:
        for name, v in a["state"][k].items():
            w = b["state"][k][name]
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(w)), (k, name)


def test_auto_is_bf16_on_gpu_fp32_on_cpu_and_eval_follows_training():
    assert prec.resolve("auto", "cuda") == "bf16" and prec.resolve("auto", "cpu") == "fp32"
    p = prec.build_precision(PrecisionConfig(), "cuda")
    assert (p.train, p.eval) == ("bf16", "bf16")
    p = prec.build_precision(PrecisionConfig(dtype="fp16", eval_dtype="fp32"), "cpu")
    assert (p.train, p.eval) == ("fp16", "fp32")
    assert prec.build_scaler(PrecisionConfig(), prec.build_precision(PrecisionConfig(), "cpu"), "cpu").is_enabled() is False
    hp = p.hyperparameters(PrecisionConfig(dtype="fp16", loss_scale_init=1024.0))
    assert hp["loss_scaling"] == "dynamic" and hp["loss_scale_init"] == 1024.0


@pytest.mark.parametrize("key, value", [("precision.dtype", "fp8"), ("precision.loss_scale_backoff", "1.0"),
                                        ("precision.loss_scale_growth", "1"), ("precision.loss_scale_init", "0"),
                                        ("precision.loss_scale_growth_interval", "0")])
def test_bad_precision_settings_name_the_key(key, value):
    with pytest.raises(ConfigError, match=re.escape(key)):
        build_config({key: value})


def test_fused_lamb_is_a_config_error():
    with pytest.raises(ConfigError, match="optim.impl"):
        build_config({"optim.name": "lamb", "optim.impl": "fused"})


def test_fp32_and_bf16_losses_agree_within_bf16_tolerance(demo_data, tmp_path):
    losses = {}
    for dtype in ("fp32", "bf16"):
        p = _parts(demo_data, tmp_path / dtype, f"precision.dtype={dtype}", "optim.lr=1e-3", seed=3)
        losses[dtype] = torch.stack([p.step(p.batches, 1)[0] for _ in range(5)])
    # Same init, same batches: the bf16 run follows the fp32 one within bf16's 8-bit
    # mantissa (relative rounding 2**-8 per op) ...
    torch.testing.assert_close(losses["bf16"], losses["fp32"], rtol=2e-2, atol=0.0)
    # ... and it really ran in bf16 (identical losses would mean autocast did nothing).
    assert not torch.equal(losses["bf16"], losses["fp32"])


@pytest.mark.parametrize("optimizer, impl, expect", [("lamb", "auto", "lamb:foreach"),
                                                     ("adamw", "fused", "adamw:torch-fused"),
                                                     ("adamw", "foreach", "adamw:torch-foreach")])
def test_fp16_inf_gradient_skips_step_backs_off_and_keeps_weights(demo_data, tmp_path, optimizer, impl, expect):
    p = _parts(demo_data, tmp_path, "precision.dtype=fp16", f"optim.name={optimizer}", f"optim.impl={impl}",
               "precision.loss_scale_init=1024", "precision.loss_scale_backoff=0.25")
    assert type(p.learner.optimizer).__name__ == {"lamb": "Lamb", "adamw": "AdamW"}[optimizer]
    _, skipped = p.step(p.batches, 1)  # a finite step first: optimizer state exists
    assert int(skipped) == 0 and p.learner.scaler.get_scale() == 1024.0
    before = _snapshot(p)

    weight = p.learner.model.bert.encoder.layer[0].output.dense.weight
    for poison in (float("inf"), float("nan")):
        handle = weight.register_hook(lambda g, v=poison: g.index_fill(0, torch.tensor([0]), v))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "lr_scheduler.step() before optimizer.step()"
            _, skipped = p.step(p.batches, 1)
        handle.remove()
        assert int(skipped) == 1
        after = _snapshot(p)
        _assert_same(before[0], after[0])  # no weight moved, clipping did not leak the nan
        _assert_state_equal(before[1], after[1])  # moments and step counts untouched
    assert p.learner.scaler.get_scale() == 1024.0 * 0.25 * 0.25

    _, skipped = p.step(p.batches, 1)  # finite again: the update goes through
    assert int(skipped) == 0
    assert not torch.equal(weight, before[0]["bert.encoder.layer.0.output.dense.weight"])
    assert all(torch.isfinite(t).all() for t in p.learner.model.parameters())


def test_fp16_scale_grows_on_schedule(demo_data, tmp_path):
    p = _parts(demo_data, tmp_path, "precision.dtype=fp16", "precision.loss_scale_init=8",
               "precision.loss_scale_growth_interval=3", "precision.loss_scale_growth=4")
    scales = []
    for _ in range(7):
        _, skipped = p.step(p.batches, 1)
        assert int(skipped) == 0
        scales.append(p.learner.scaler.get_scale())
    assert scales == [8, 8, 32, 32, 32, 128, 128]
    # The hook interface: the scale the gradients carry, on device, no sync.
    s = prec.loss_scale(p.learner.scaler)
    assert torch.is_tensor(s) and s.dtype == torch.float32 and float(s) == 128.0
    assert prec.loss_scale(_parts(demo_data, tmp_path / "bf16", "precision.dtype=bf16").learner.scaler) is None


def test_fp16_gradients_are_unscaled_before_clipping(demo_data, tmp_path, monkeypatch):
    """The norm the clip sees is the true one: equal (within fp16 rounding) across two very
    different loss scales, and close to the fp32 run's norm."""
    norms = {}
    real_clip = torch.nn.utils.clip_grad_norm_

    def spy(params, max_norm, **kw):
        n = real_clip(params, max_norm, **kw)
        norms.setdefault(key, []).append(float(n))
        return n

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", spy)
    for key, extra in (("fp32", ["precision.dtype=fp32"]),
                       ("fp16_s2", ["precision.dtype=fp16", "precision.loss_scale_init=2"]),
                       ("fp16_s4096", ["precision.dtype=fp16", "precision.loss_scale_init=4096"])):
        p = _parts(demo_data, tmp_path / key, *extra, seed=5)
        p.step(p.batches, 1)
    assert norms["fp16_s2"][0] == pytest.approx(norms["fp16_s4096"][0], rel=1e-2)
    assert norms["fp16_s2"][0] == pytest.approx(norms["fp32"][0], rel=5e-2)


def test_fp16_run_counts_and_logs_skipped_steps(demo_data, tmp_path, capsys):
    """A loss scale far too large for fp16 makes the first steps overflow: each is skipped
    and halves the scale. The count in the log and progress lines must equal the number of
    halvings the final scale shows (growth is off here: interval > steps)."""
    init = 2.0**30
    rc = train.main(_demo(demo_data, tmp_path, *TINY, "precision.dtype=fp16", f"precision.loss_scale_init={init}",
                          "precision.loss_scale_growth_interval=1000", "eval.interval_samples=80", "run.threads=1",
                          "run.max_samples=160", "log.progress_interval_steps=5"))
    assert rc == 1  # the sample limit, not the target
    out = capsys.readouterr().out
    last = re.findall(r"^step +20 \|.*\| skipped (\d+) \| scale (\d+) \|.*samples/s$", out, re.M)
    assert last, out[-2000:]
    skipped, scale = int(last[0][0]), float(last[0][1])
    assert skipped >= 1 and scale == init / 2**skipped
    assert re.search(rf"run_stop aborted after 20 steps, 160 samples, {skipped} skipped", out)
    events = mllog_events(tmp_path / "result_0.txt")
    counts = [(e["value"], e["metadata"]["samples_count"]) for e in events if e["key"] == "skipped_steps"]
    assert counts[-1] == (skipped, 160) and len(counts) == 2 and counts[0][0] <= skipped
    hp = {e["key"]: e["value"] for e in events}
    assert hp["precision"] == "fp16" and hp["eval_precision"] == "fp16" and hp["loss_scaling"] == "dynamic"
    assert hp["loss_scale_init"] == init and hp["loss_scale_growth_interval"] == 1000
    assert hp["opt_implementation"] == "lamb:foreach"
    resolved = json.loads((tmp_path / "result_0_config.json").read_text())["resolved"]
    assert resolved["precision"] == "fp16" and resolved["optimizer_impl"] == "lamb:foreach"
