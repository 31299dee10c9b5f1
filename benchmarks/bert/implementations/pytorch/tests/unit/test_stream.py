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


def _stream(dirs, mode, world=2, rank=0, resume=None, **extra):
    kind, overrides = MODES[mode]
    if mode == "gather":
        world = 1  # one process: its group is itself, nothing to exchange
    cfg = build_config({"data.train_dir": str(dirs[kind]), "data.max_seq_length": 32, "model.max_position_embeddings": 32,
                        "data.max_predictions_per_seq": 5, "run.local_batch_size": 4, "run.seed": 3,
                        "model.vocab_size": 30000, **overrides, **extra})
    return loader.train_batches(data=cfg.data, sampler=cfg.sampler, model=cfg.model, plan=train_plan(cfg, world),
                                seed=cfg.run.seed, rank=rank, world_size=world, accum=cfg.run.grad_accum_steps,
                                resume=resume)


def _ranks(dirs, mode, world, batch, accum=1, resume=None):
    """Every rank's stream of a run of ``world`` ranks, ``batch`` samples a micro-step
    (continuing the stream ``resume``, as a resumed run opens it)."""
    return [_stream(dirs, mode, world=world, rank=r, resume=resume,
                    **{"run.local_batch_size": batch, "run.grad_accum_steps": accum}) for r in range(world)]


def _steps(streams, steps, accum=1):
    """``steps`` optimizer steps of every rank: per step, each rank's samples ([shard, row])."""
    out = []
    for _ in range(steps):
        per_rank = []
        for s in streams:
            got = []
            for _ in range(accum):
                next(s)
                got += s.last
            per_rank.append(got)
        out.append(per_rank)
    return out


def _gathered(streams):
    """The stream as a checkpoint keeps it (stream.json): every rank's state."""
    return {"world_size": len(streams), "ranks": [s.state_dict() for s in streams]}


def _global(step):
    return sorted(tuple(x) for rank in step for x in rank)


# Runs that continue one another, each (ranks, samples a micro-step, micro-steps a step, steps):
# one global batch of 8 samples, on the 32-sample data (4 steps a data epoch). A stratified run
# of 4 ranks x 2 samples cannot begin (a stratum rounds to 0 a draw); it continues one that did.
CHAINS = {"2->4": [(2, 4, 1, 3), (4, 2, 1, 6)], "2->4->2": [(2, 4, 1, 2), (4, 2, 1, 3), (2, 4, 1, 4)],
          "2->1": [(2, 4, 1, 3), (1, 4, 2, 6)], "2->1->4": [(2, 4, 1, 2), (1, 8, 1, 2), (4, 2, 1, 5)],
          "2->2": [(2, 4, 1, 3), (2, 4, 1, 6)]}
ID_ROADS = ["snake", "strata", "strata_closed", "packed"]


def _chain(dirs, mode, chain):
    """Every step's samples of the runs of ``chain``, each resuming the one before it, and the
    runs' streams (every one still open: the caller closes them)."""
    steps, runs, state = [], [], None
    for world, batch, accum, n in chain:
        run = _ranks(dirs, mode, world, batch, accum, resume=state)
        steps += _steps(run, n, accum)
        state = _gathered(run)
        runs.append(run)
    return steps, runs


@pytest.mark.parametrize("chain", sorted(CHAINS))
@pytest.mark.parametrize("mode", ID_ROADS)
def test_a_resume_on_another_world_size_takes_each_steps_samples_as_the_uninterrupted_run(dirs, mode, chain):
    """The id-based roads cut every step from a list of samples the world size does not
    change (sampler.Canon): resumed on other ranks (and another split of the global batch
    into micro-steps), step k takes the samples the uninterrupted run's step k took, through
    and past the stratum epochs' ends; on the same ranks, the same batches bit for bit."""
    got, runs = _chain(dirs, mode, CHAINS[chain])
    want, [alone] = _chain(dirs, mode, [(2, 4, 1, len(got))])
    assert [_global(step) for step in got] == [_global(step) for step in want]
    if chain == "2->2":
        assert got == want
    assert runs[-1][0].state_dict()["consumed"] == alone[0].state_dict()["consumed"] == 8 * len(got)
    for s in alone + [s for run in runs for s in run]:
        s.close()


@pytest.mark.parametrize("chain", sorted(set(CHAINS) - {"2->2"}))  # the same ranks: each its own position
def test_the_shard_order_resumed_on_another_world_size_takes_every_sample_once_an_epoch(dirs, chain):
    """The closed road's order is per rank: on other ranks, what the earlier ranks had left of
    the epochs they had begun is dealt to the new ones (their plan) before the next epoch, so
    every sample is taken once an epoch, whatever the hops (ranks' shards are of unequal
    sizes: they stop in different epochs)."""
    from collections import Counter

    from bert.sampler import PLAN

    *earlier, (world, batch, accum, n) = CHAINS[chain]
    before, runs = _chain(dirs, "closed", earlier)
    last = _ranks(dirs, "closed", world, batch, accum, resume=_gathered(runs[-1]))
    end = last[0].policy.plan_end
    planned = []
    for s in last:  # each new rank's plan, as its draws give it
        for d in s.policy.draws(tuple(s.state_dict()["position"]), s):
            if d.at[0] != PLAN:
                break
            planned += [(s.names[i], r) for i, r in zip(d.shard.tolist(), d.row.tolist())]
    counts = Counter(tuple(x) for step in before for rank in step for x in rank) + Counter(planned)
    assert end >= 1 and len(counts) == 32 and set(counts.values()) == {end}
    for s in last + [s for run in runs for s in run]:
        s.close()


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
    with pytest.raises(DataError, match=r"one rank's own position \(world_size 2 there, 4 here\): it resumes on 2 "
                                        r"ranks only; every rank's, gathered \(a checkpoint's stream.json\), resumes"):
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


def test_a_resume_on_other_data_is_refused_naming_what_differs(tmp_path, dirs):
    """The state names the data it was drawn from: the same samples under another path
    resume; other files, another md5 list, other strata bounds are refused, each by name."""
    import shutil

    from input_preprocessing.checksum import checksum
    from input_preprocessing.stratify import stratify
    from sampler_helpers import road_dirs

    here = road_dirs(tmp_path / "here")
    for d in here.values():
        checksum(d)
    strata = _stream(here, "strata")
    next(strata)
    state = strata.state_dict()
    assert state["data"]["strata bounds"] == [[1, 12], [13, 20], [21, 32]]
    moved = {k: tmp_path / "moved" / k for k in here}
    for k in here:
        shutil.copytree(here[k], moved[k])
    again = _stream(moved, "strata")
    again.load_state_dict(state)
    assert _same(next(again), next(strata))

    restratified = tmp_path / "restratified"
    stratify(here["plain"], restratified, bounds=(16, 32), max_seq_length=32)
    with pytest.raises(DataError, match=r"strata bounds \[\[1, 12\], \[13, 20\], \[21, 32\]\] there, "
                                        r"\[\[1, 16\], \[17, 32\]\] here"):
        _stream({"strata": restratified}, "strata").load_state_dict(state)

    changed = tmp_path / "changed"
    shutil.copytree(here["strata"], changed)
    (changed / "md5sums.txt").write_text((changed / "md5sums.txt").read_text().replace("a", "b", 1))
    with pytest.raises(DataError, match=r"drawn otherwise: md5sums\.txt [0-9a-f]{16} there, [0-9a-f]{16} here$"):
        _stream({"strata": changed}, "strata").load_state_dict(state)

    closed = _stream(here, "closed")
    next(closed)
    state = closed.state_dict()
    (moved["plain"] / "part_3.hdf5").unlink()
    with pytest.raises(DataError, match=r"shards 6 there, 5 here; files [0-9a-f]{16} there, [0-9a-f]{16} here"):
        _stream(moved, "closed").load_state_dict(state)


@pytest.mark.parametrize("mode", ["closed", "strata"])
def test_data_made_again_under_the_same_names_and_sizes_is_refused(tmp_path, mode):
    """Without an md5 list the names and sizes were all a stream knew of its data: the samples
    it trained on last (its probe) are read again on resume, so shards made again (other
    samples, the same lengths, names and byte sizes) are refused naming them, on the road that
    reads whole shards and on the one that reads rows by id; the same data resumes."""
    import re

    here = road_dirs(tmp_path / "here")
    first = _stream(here, mode)
    for _ in range(3):
        next(first)
    state = first.state_dict()
    assert len(state["probe"]["samples"]) == 4 and re.fullmatch(r"[0-9a-f]{32}", state["probe"]["examples_md5"])
    again = _stream(here, mode, resume=state)
    assert _same(next(again), next(first))

    def other(shard):  # other tokens, the same lengths: every file keeps its size
        shard.tokens[:] = np.where(shard.tokens > 200, shard.tokens - 1, shard.tokens)

    made_again = road_dirs(tmp_path / "again", change=other)
    kind = MODES[mode][0]
    assert [f.stat().st_size for f in sorted(made_again[kind].rglob("*.hdf5"))] == \
           [f.stat().st_size for f in sorted(here[kind].rglob("*.hdf5"))]
    with pytest.raises(loader.ResumeRefused, match=r"the samples rank 0 trained on last \(rows of .*\.hdf5.*\) are "
                                                    r"other samples here \(examples md5 [0-9a-f]{32}, [0-9a-f]{32} "
                                                    r"there\): .* holds other data under the same names and sizes"):
        _stream(made_again, mode, resume=state)
    for s in (first, again):
        s.close()

