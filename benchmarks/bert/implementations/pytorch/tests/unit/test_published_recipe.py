"""The open recipe exactly as published (Samsung's MLPerf v1.1/v2.0 open submission, config
128x8x16x1; docs/published_recipe.md): the in-process tests;
tests/integration/test_published_recipe.py has the rest and says what the file covers."""

from __future__ import annotations

import json

import pytest

from bert import grad_sync
from bert.config import GradSyncConfig, build_config
from bert.optim import lr_at
from conftest import PKG
from published_recipe_helpers import CONFIG


def test_mlcommons_schedule_stays_the_default_and_honours_lr_max_steps():
    assert build_config({}).optim.schedule == "mlcommons"
    o = build_config({"optim.lr": "1.0", "optim.total_steps": "100", "optim.lr_max_steps": "50"}).optim
    assert [lr_at(k, o) for k in (0, 25, 50, 99)] == pytest.approx([1.0, 0.5, 0.0, 0.0])
    with pytest.raises(Exception, match="optim.schedule"):
        build_config({"optim.schedule": "published", "optim.warmup_steps": "100", "optim.total_steps": "100"})


def test_config_refuses_the_recipe_keys_where_they_do_not_apply():
    from bert.config import ConfigError

    open_ = {"run.division": "open"}
    for bad, key in [({"optim.schedule": "published"}, "optim.schedule"),  # closed division
                     ({"grad_sync.reduce_scale": "0.001"}, "grad_sync.reduce_scale"),
                     ({**open_, "grad_sync.reduce_scale": "0.001", "grad_sync.compression": "powersgd"},
                      "grad_sync.reduce_scale"),
                     ({**open_, "optim.max_grad_norm": "0", "grad_sync.bucket_clip_norm": "1",
                       "grad_sync.bucket_clip_rule": "size", "grad_sync.bucket_clip_count": "22"},
                      "grad_sync.bucket_clip_count"),
                     ({"grad_sync.first_bucket_mb": "30"}, "grad_sync.first_bucket_mb"),
                     ({"run.max_steps": "-1"}, "run.max_steps")]:
        with pytest.raises(ConfigError, match=key):
            build_config(bad)


def test_first_bucket_falls_back_with_a_note_on_a_torch_without_per_bucket_caps(monkeypatch):
    class OldDDP:  # torch < 2.13's signature: no bucket_cap_mb_list
        def __init__(self, module, device_ids=None, bucket_cap_mb=None):
            pass

    cfg = GradSyncConfig(bucket_cap_mb=50, first_bucket_mb=2)
    assert grad_sync.ddp_bucket_args(cfg) == ({"bucket_cap_mb_list": [2, 50]}, "")
    assert grad_sync.ddp_bucket_args(GradSyncConfig(bucket_cap_mb=50)) == ({"bucket_cap_mb": 50}, "")
    monkeypatch.setattr(grad_sync, "DDP", OldDDP)
    kwargs, note = grad_sync.ddp_bucket_args(cfg)
    assert kwargs == {"bucket_cap_mb": 50} and "first_bucket_mb=2 ignored" in note


def test_system_description_is_the_published_system():
    desc = json.loads((PKG.parents[3] / "systems" / "DGXA100_128x8.json").read_text())
    assert desc["host_processor_model_name"] == "AMD EPYC 7543" and desc["host_processor_core_count"] == "32"
    assert desc["host_memory_capacity"] == "1 TB" and desc["accelerator_model_name"] == "NVIDIA A100-SXM4-80GB (400 W)"
    assert desc["host_networking"].startswith("Compute: 4 x ConnectX-6 InfiniBand HDR 200 Gb/s")
    header = CONFIG.read_text().split("\nexport", 1)[0]
    for fact in ("AMD EPYC 7543", "1 TB", "4 x 200 Gb/s HDR", "A100-SXM4-80GB (400 W)"):
        assert fact in header
    assert "7742" not in header and "8 x HDR" not in header
