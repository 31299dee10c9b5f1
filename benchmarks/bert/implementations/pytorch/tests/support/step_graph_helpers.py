"""Helpers of test_step_graph.py's unit and integration tests: a tiny config on the demo
data, one process as the world, dynamo's eager backend and a CUDA-graph stand-in."""

from __future__ import annotations

import pytest
import torch

from bert.config import build_config, parse_overrides
from bert.distributed import DistEnv

SINGLE = DistEnv(rank=0, world_size=1, local_rank=0, master_addr="127.0.0.1", master_port=0, launcher="single")


TINY = ["model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "model.intermediate_size=64",
        "run.local_batch_size=4", "eval.batch_size=50", "data.eval_samples=50", "optim.warmup_steps=0",
        "optim.lr=1e-3", "run.seed=3", "model.hidden_dropout=0.1", "model.attention_dropout=0.1"]


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _cfg(demo_data, tmp_path, *extra):
    return build_config(parse_overrides([
        *demo_data.env["CONFIG_PARAMS"].split(), f"data.train_dir={demo_data.train}",
        f"data.eval_dir={demo_data.eval}", f"log.output_dir={tmp_path}", *TINY, *extra]))


class Replay:
    """CUDA graphs' stand-in: capture records the function, replay calls it again."""

    def __init__(self):
        self.captured = 0

    def capture(self, fn):
        self.captured += 1
        return fn


class EagerCompile:
    """torch.compile through dynamo's ``eager`` backend (tracing, guards and recompiles as
    with inductor; nothing code-generated: inductor's C++ build takes minutes here)."""

    def __init__(self, monkeypatch):
        saved = torch.compile
        monkeypatch.setattr(torch, "compile", lambda *a, **kw: saved(*a, **{**kw, "backend": "eager"}))


def data_eval_set(cfg):
    from bert.loader import EvalSet

    return EvalSet(cfg.data.eval_dir, 0, 1, cfg.data.eval_samples, cfg.data.max_seq_length)
