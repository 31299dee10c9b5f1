"""bert/grad_sync.py in one process: the clip's arithmetic against torch's clip_grad_norm_,
the single-process bucket clip, and the config rules (which clippings and compressions go
together, what a checkpoint's sync state must match). The scenarios on 2 gloo ranks are in
tests/integration/test_grad_sync.py."""

from __future__ import annotations

import pytest
import torch

from bert import grad_sync
from bert.config import ConfigError, GradSyncConfig, build_config
from grad_sync_helpers import (CLIP, assert_grads_close, fresh_model, global_batch, grads, loss_of,
                               single_process_grads)


def test_clip_leaves_nonfinite_tensors_unchanged():
    for bad in (float("nan"), float("inf")):
        t = torch.arange(6.0) + 10
        t[2] = bad
        before = t.clone()
        norm = grad_sync.clip_([t], 1.0)
        assert not torch.isfinite(norm)
        torch.testing.assert_close(t, before, equal_nan=True)


def test_clip_of_a_list_equals_torch_clip_grad_norm():
    torch.manual_seed(0)
    ts = [torch.randn(5, 3), torch.randn(7), torch.randn(2, 2, 2)]
    want = [t.clone() for t in ts]
    for t in want:
        t.grad = t.clone()
    norm_want = torch.nn.utils.clip_grad_norm_(want, 0.5)
    norm = grad_sync.clip_(ts, 0.5)
    torch.testing.assert_close(norm, norm_want)
    for t, w in zip(ts, want):
        torch.testing.assert_close(t, w.grad)


def test_single_process_bucket_clip_is_the_global_clip():
    model = fresh_model()
    loss_of(model, global_batch(0)).backward()
    want = single_process_grads(0, clip=CLIP)
    sync = grad_sync.build(GradSyncConfig(bucket_clip_norm=CLIP), None, model.parameters(), 0.0)
    sync.after_sync()
    assert_grads_close(grads(model), want, atol=1e-7, rtol=1e-5)


def test_config_makes_the_two_clippings_exclusive():
    with pytest.raises(ConfigError, match="grad_sync.bucket_clip_norm"):
        build_config({"run.division": "open", "grad_sync.bucket_clip_norm": "1.0"})  # optim default 1.0
    with pytest.raises(ConfigError, match="closed division"):
        build_config({"grad_sync.bucket_clip_norm": "1.0", "optim.max_grad_norm": "0"})
    cfg = build_config({"run.division": "open", "grad_sync.bucket_clip_norm": "1.0", "optim.max_grad_norm": "0"})
    assert cfg.grad_sync.bucket_clip_norm == 1.0 and cfg.optim.max_grad_norm == 0
    with pytest.raises(ConfigError, match="grad_sync.compression"):
        build_config({"grad_sync.compression": "int8"})


def test_config_keeps_powersgd_in_the_open_division_and_off_fp16():
    with pytest.raises(ConfigError, match="open division only"):
        build_config({"grad_sync.compression": "powersgd"})
    with pytest.raises(ConfigError, match="error-feedback residual"):
        build_config({"run.division": "open", "grad_sync.compression": "powersgd", "precision.dtype": "fp16"})
    with pytest.raises(ConfigError, match="grad_sync.powersgd_start_step"):
        build_config({"run.division": "open", "grad_sync.compression": "powersgd", "grad_sync.powersgd_start_step": "1"})
    cfg = build_config({"run.division": "open", "grad_sync.compression": "powersgd", "precision.dtype": "bf16"})
    assert cfg.grad_sync.powersgd_rank == 4


def test_checkpoint_state_must_match_the_compression():
    plain = grad_sync.GradSync(lambda: None, None, "no clipping + none")
    with pytest.raises(ValueError, match="not powersgd"):
        plain.load_state_dict({"iter": 3}, torch.device("cpu"))
    plain.load_state_dict({}, torch.device("cpu"))  # nothing to restore: fine
