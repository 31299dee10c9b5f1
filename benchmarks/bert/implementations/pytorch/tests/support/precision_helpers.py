"""Helpers of test_precision.py's unit and integration tests (and of other test files that import them)."""

from __future__ import annotations

import pytest
import torch

from bert.config import build_config, parse_overrides
from bert.distributed import DistEnv
from bert.trainer import Trainer


SINGLE = DistEnv(rank=0, world_size=1, local_rank=0, master_addr="127.0.0.1", master_port=0, launcher="single")


TINY = ["model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "model.intermediate_size=64",
        "run.local_batch_size=8", "eval.batch_size=50", "data.eval_samples=50", "optim.warmup_steps=0"]


def _demo(demo_data, out, *extra):
    return [*demo_data.env["CONFIG_PARAMS"].split(), f"data.train_dir={demo_data.train}",
            f"data.eval_dir={demo_data.eval}", f"log.output_dir={out}", *extra]


def _parts(demo_data, tmp_path, *extra, seed=0) -> Trainer:
    cfg = build_config(parse_overrides(_demo(demo_data, tmp_path, *TINY, *extra, f"run.seed={seed}")))
    t = Trainer(cfg, SINGLE, torch.device("cpu"))
    t.open_data(timed=False)
    return t


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread, restored after: these tiny models gain little from a second
    thread, and on a shared machine spinning threads cost more than they give."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
