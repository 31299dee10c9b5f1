"""One training stream for every sampling mode (bert/loader.py's TrainLoader behind the
TrainStream protocol; bert/sampler.py's policies): each mode's stream resumes exactly from
its state, refuses a state drawn otherwise naming what differs, and the batch plan gives the
warm-up one batch per shape the loader will make."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bert import loader
from bert.config import build_config
from bert.shards import DataError
from bert.trainer import train_plan
from sampler_helpers import MODES as ROADS, road_dirs

MODES = {**ROADS, "gather": ("strata", {**ROADS["strata"][1], "sampler.lengths": "gather"})}


def _stream(dirs, mode, world=2, rank=0, **extra):
    kind, overrides = MODES[mode]
    if mode == "gather":
        world = 1  # one process: its group is itself, nothing to exchange
    cfg = build_config({"data.train_dir": str(dirs[kind]), "data.max_seq_length": 32, "model.max_position_embeddings": 32,
                        "data.max_predictions_per_seq": 5, "run.local_batch_size": 4, "run.seed": 3,
                        "model.vocab_size": 30000, **overrides, **extra})
    return loader.train_batches(data=cfg.data, sampler=cfg.sampler, model=cfg.model, plan=train_plan(cfg, world),
                                seed=cfg.run.seed, rank=rank, world_size=world)


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(torch.as_tensor(a[k]), torch.as_tensor(b[k])) for k in a)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return road_dirs(tmp_path_factory.mktemp("stream"))


@pytest.mark.parametrize("mode", sorted(MODES))
def test_every_mode_is_one_stream_that_resumes_exactly(dirs, mode):
    """Every sampling mode hands the loop a TrainStream; from any state (mid-shard, past an
    epoch of the 32-sample data) a new stream continues with the same batches."""
    first = _stream(dirs, mode)
    assert isinstance(first, loader.TrainStream)
    history = []
    for _ in range(11):
        batch = next(first)
        history.append((batch, first.state_dict()))
    assert first.failure() is None
    for k in (3, 9):  # mid-shard (the closed road: 4 into epoch 1 and 8 into epoch 2) or mid-epoch
        again = _stream(dirs, mode)
        again.load_state_dict(history[k][1])
        for want, _ in history[k + 1:]:
            assert _same(next(again), want)
        again.close()
    first.close()


def test_a_state_drawn_otherwise_is_refused_naming_what_differs(dirs):
    closed = _stream(dirs, "closed")
    next(closed)
    state = closed.state_dict()
    with pytest.raises(DataError, match=r"drawn otherwise: policy shard_order there, ids here"):
        _stream(dirs, "snake").load_state_dict(state)
    with pytest.raises(DataError, match=r"drawn otherwise: world_size 2 there, 4 here"):
        _stream(dirs, "closed", world=4).load_state_dict(state)


def test_states_of_the_two_earlier_loaders_resume(dirs):
    """Checkpoints written when the closed road and the id road had loaders of their own
    (an epoch and offset; a step) resume on this one, each on its own road."""
    closed = _stream(dirs, "closed")
    for _ in range(3):
        next(closed)
    epoch, offset = closed.state_dict()["position"]
    older = _stream(dirs, "closed")
    older.load_state_dict({"epoch": epoch, "offset": offset, "rank": 0, "world_size": 2, "num_shards": 6})
    assert _same(next(older), next(closed))
    strata = _stream(dirs, "strata")
    for _ in range(3):
        next(strata)
    older = _stream(dirs, "strata")
    older.load_state_dict({"step": 3, "rank": 0, "world_size": 2, "samples": 32})
    assert _same(next(older), next(strata))
    with pytest.raises(DataError, match="policy ids there, shard_order here"):
        _stream(dirs, "closed").load_state_dict({"step": 3, "rank": 0, "world_size": 2, "samples": 32})


def test_the_batch_plan_warms_up_every_shape_the_loader_makes(dirs):
    """With token budgets the warm-up batches are one per rung, each filled to it exactly:
    the shapes the stream's batches take, so none is compiled or captured after run_start."""
    cfg = build_config({"data.train_dir": str(dirs["plain"]), "data.max_seq_length": 32,
                        "model.max_position_embeddings": 32, "data.max_predictions_per_seq": 5,
                        "run.local_batch_size": 4, "model.vocab_size": 30000, "data.token_budgets": "32,64,128"})
    plan = train_plan(cfg, 1)
    warm = plan.warmup_batches(seed=0)
    assert [b["input_ids"].numel() for b in warm] == list(plan.layout.rungs) == [32, 64, 128]
    stream = _stream(dirs, "closed", world=1, **{"data.token_budgets": "32,64,128"})
    shapes = {next(stream)["input_ids"].numel() for _ in range(6)}
    assert shapes <= set(plan.layout.rungs)
    assert np.all([b["masked_index"].numel() == 4 * 5 for b in warm])
