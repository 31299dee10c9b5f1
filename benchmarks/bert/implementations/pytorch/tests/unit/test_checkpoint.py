"""Checkpoint and stop rules that one in-process run shows (the faults that need separate
ranks, launchers and signals are in tests/integration/test_checkpoint.py): a NaN streak ends
the run as diverged, a resume under another vocabulary padding is refused, Ctrl-C during an
evaluation stops it, a config dump that cannot be written is named."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from bert.mlperf_log import read_events
from conftest import mllog_events
from checkpoint_helpers import (TINY, WRITE_FAILED, last_event, no_partial_files, tiny_data, train_args)  # noqa: F401 - fixtures: tiny_data


def test_persistent_nan_loss_ends_the_run_as_diverged(tiny_data, tmp_path, capsys):
    """NaN weights from the start: the loss is NaN every step; the poll (every step here) sees
    the streak reach run.max_nonfinite_steps on some rank and every rank ends the run, exit 6
    (diverged, not 1: "did not converge"), no final weights, run_stop aborted."""
    from bert import train
    from bert.config import build_config, parse_overrides
    from bert.model import BertForPreTraining

    args = [*TINY, f"data.train_dir={tiny_data / 'train'}", f"data.eval_dir={tiny_data / 'eval'}",
            f"log.output_dir={tmp_path}", "run.max_nonfinite_steps=3", "ckpt.poll_steps=1",
            f"run.save_checkpoint={tmp_path / 'final.pt'}"]
    model = BertForPreTraining(build_config(parse_overrides(args)).model, "cpu")
    state = model.state_dict()
    for k in ("cls.predictions.bias", "cls.predictions.decoder.bias"):  # one tied parameter
        state[k] = torch.full_like(state[k], float("nan"))
    torch.save(state, tmp_path / "nan.pt")
    assert train.main([*args, f"run.init_checkpoint={tmp_path / 'nan.pt'}"]) == 6
    events = mllog_events(tmp_path / "result_0.txt")
    by_key = {e["key"]: e for e in events}
    assert by_key["run_stop"]["metadata"]["status"] == "aborted"
    assert by_key["nonfinite_loss_steps"]["value"] == 3  # seen at the poll of step 3
    assert "eval_accuracy" not in by_key and not (tmp_path / "final.pt").exists()
    said = capsys.readouterr().out
    assert ("diverged: loss NaN/inf for the last 3 steps on some rank (run.max_nonfinite_steps=3): ending the run; "
            "no checkpoint and no final weights written from it; there is no checkpoint to resume") in said, said[-3000:]


def test_resume_with_another_vocabulary_padding_is_refused(tiny_data, tmp_path):
    """The state dict keeps vocab_size rows whatever model.vocab_pad_multiple is, but the
    optimizer's moments have the padded shape: a resume across a padding change is refused
    by name, before anything is loaded (torch's load_state_dict would take the moments)."""
    from bert import checkpoint
    from bert.config import build_config
    from bert.distributed import DistEnv
    from bert.state import TrainState
    from bert.trainer import Trainer

    single = DistEnv(rank=0, world_size=1, local_rank=0, master_addr="127.0.0.1", master_port=29500,
                     launcher="single")
    over = dict(a.split("=", 1) for a in TINY if not a.startswith(("dist.", "run.max_samples")))
    over.update({"data.train_dir": str(tiny_data / "train"), "data.eval_dir": str(tiny_data / "eval"),
                 "model.vocab_pad_multiple": "1", "ckpt.dir": str(tmp_path)})
    unpadded = Trainer(build_config(over), single, torch.device("cpu"))
    unpadded.open_data(timed=False)
    unpadded.step(unpadded.batches, 1)  # the optimizer's moments exist
    saved = unpadded.checkpointer.save(unpadded.learner, unpadded.state, unpadded.batches)
    padded = Trainer(build_config({**over, "model.vocab_pad_multiple": "256"}), single, torch.device("cpu")).learner
    before = {k: v.clone() for k, v in padded.model.state_dict().items()}
    with pytest.raises(checkpoint.CheckpointError, match=r"optimizer state 'exp_avg' of a \(256, 32\) parameter has "
                                                     r"shape \(128, 32\).*model.vocab_pad_multiple"):
        checkpoint.restore(saved, padded, TrainState(), 0, 1, unpadded.global_batch)
    assert all(torch.equal(v, before[k]) for k, v in padded.model.state_dict().items())  # nothing loaded
    checkpoint.restore(saved, unpadded.learner, TrainState(), 0, 1, unpadded.global_batch)  # the same padding resumes


def test_a_checkpoint_resumes_on_another_world_size_when_the_global_batch_is_kept(tiny_data, tmp_path):
    """A one-rank checkpoint restored as rank 0 of 2: refused for another global batch,
    naming the splits that keep it; with it kept, the model, the optimizer (moments, step
    counts), the schedule and the counters are the checkpoint's exactly, no rank file is read
    or verified (they are the old ranks' own), and what could not carry is named. A
    checkpoint from before the stream was gathered resumes on its own world size only."""
    from bert import checkpoint
    from bert.config import build_config
    from bert.distributed import DistEnv
    from bert.state import TrainState
    from bert.trainer import Trainer

    single = DistEnv(rank=0, world_size=1, local_rank=0, master_addr="127.0.0.1", master_port=29500,
                     launcher="single")
    over = dict(a.split("=", 1) for a in TINY if not a.startswith(("dist.", "run.max_samples")))
    over.update({"data.train_dir": str(tiny_data / "train"), "data.eval_dir": str(tiny_data / "eval"),
                 "ckpt.dir": str(tmp_path)})
    first = Trainer(build_config(over), single, torch.device("cpu"))
    first.open_data(timed=False)
    for _ in range(3):
        first.state.advance(*first.step(first.batches, 1), first.global_batch)
    saved = first.checkpointer.save(first.learner, first.state, first.batches)
    assert checkpoint.verify(saved, 0, 1) is None
    (saved / "rank_0.pt").unlink()  # not this world size's: neither verified nor read
    assert checkpoint.verify(saved, 1, 2) is None
    other = Trainer(build_config({**over, "run.local_batch_size": "4"}), single, torch.device("cpu")).learner
    with pytest.raises(checkpoint.CheckpointError, match=r"written with global batch 8 \(1 rank\), this run has 16 "
                                                     r"\(2 ranks\); a resume keeps the global batch .*: on 2 ranks: "
                                                     r"run.local_batch_size=4 with run.grad_accum_steps=1 or "
                                                     r"run.local_batch_size=2 with run.grad_accum_steps=2 or "
                                                     r"run.local_batch_size=1 with run.grad_accum_steps=4"):
        checkpoint.restore(saved, other, TrainState(), 0, 2, 16)
    assert "numbers of ranks that divide it: 1, 2, 4, 8" in checkpoint.batch_sizes(8, 5)
    state = TrainState()
    restored = checkpoint.restore(saved, other, state, 0, 2, 8)
    assert restored.world_size == 1 and len(restored.stream["ranks"]) == 1
    assert restored.reset == ["each rank's RNG streams (dropout, masking) reseeded from (seed, step, rank)"]
    assert (state.step, state.samples) == (3, 24)
    mine, theirs = first.learner, other
    assert all(torch.equal(a, b) for a, b in zip(mine.model.state_dict().values(), theirs.model.state_dict().values()))
    for group_a, group_b in zip(mine.optimizer.state.values(), theirs.optimizer.state.values()):
        assert group_a.keys() == group_b.keys() and all(torch.equal(torch.as_tensor(group_a[k]), torch.as_tensor(group_b[k]))
                                                        for k in group_a)
    assert theirs.scheduler.state_dict() == mine.scheduler.state_dict()
    assert theirs.scheduler.get_last_lr() == mine.scheduler.get_last_lr()
    (saved / "stream.json").unlink()  # as a checkpoint written before the stream was gathered
    with pytest.raises(checkpoint.CheckpointError, match=r"written by 1 rank before checkpoints gathered every rank's "
                                                     r"data stream \(no stream.json\): it resumes on 1 rank only"):
        checkpoint.restore(saved, other, TrainState(), 0, 2, 8)


def test_ctrl_c_during_an_evaluation_stops_it(tiny_data, tmp_path, monkeypatch, capsys):
    """Ctrl-C as an evaluation begins: it stops after the batch in hand (here before the
    first), not at its end; no eval_accuracy for it, run_stop aborted, exit 130."""
    from bert import train, trainer

    real = trainer.mlm_accuracy

    def ctrl_c_then_evaluate(*args):
        os.kill(os.getpid(), signal.SIGINT)  # the handler runs before the next bytecode
        return real(*args)

    monkeypatch.setattr(trainer, "mlm_accuracy", ctrl_c_then_evaluate)
    assert train.main(train_args(tiny_data, tmp_path)) == 130
    assert "interrupted (Ctrl-C): stopped at step 8; nothing saved" in capsys.readouterr().out  # 64 samples
    keys = [e["key"] for e in read_events(tmp_path / "result_0.txt")]
    assert keys[keys.index("eval_start"):] == ["eval_start", "nonfinite_loss_steps", "train_samples", "eval_samples",
                                               "run_stop"] and "eval_accuracy" not in keys
    assert last_event(tmp_path / "result_0.txt")["metadata"]["status"] == "aborted"


def test_config_dump_write_fails(tiny_data, tmp_path, capsys):
    """The resolved config cannot be written (its name is taken by a directory: EISDIR at the
    rename): exit 5 before run_start, one line, run_stop aborted, no part file."""
    from bert import train

    (tmp_path / "result_0_config.json" / "x").mkdir(parents=True)
    assert train.main(train_args(tiny_data, tmp_path)) == WRITE_FAILED
    err = capsys.readouterr().err
    assert err.strip() == (f"error: rank 0 of 1: the resolved config could not be written to "
                           f"{tmp_path / 'result_0_config.json'}: Is a directory (errno 21) (on rank 0); no complete "
                           "checkpoint to resume from; free space or point log.output_dir elsewhere, then rerun the "
                           "same command"), err
    events = read_events(tmp_path / "result_0.txt")
    assert events[-1]["key"] == "run_stop" and events[-1]["metadata"]["status"] == "aborted"
    assert "run_start" not in {e["key"] for e in events}
    assert not no_partial_files(tmp_path)


def _finished_run(directory, *steps: int, mark: dict | None = None, global_batch: int = 8):
    """A checkpoint directory as a run leaves it: complete checkpoints of ``steps`` (meta.json
    only: plan reads no more) and, with ``mark``, its finished mark."""
    import json

    for step in steps:
        (directory / f"step_{step:09d}").mkdir(parents=True)
        (directory / f"step_{step:09d}" / "meta.json").write_text(json.dumps({"step": step, "global_batch": global_batch}))
    if mark is not None:
        (directory / "finished.json").write_text(json.dumps(mark))
    return directory


def test_a_finished_run_is_continued_by_resume_only_to_limits_past_its_end(tmp_path):
    """Over a finished run (ended at its limit, step 6 of 8 samples): auto and off start fresh;
    --resume continues from its newest checkpoint when this run's limits end it later, and
    refuses, naming both ends, when they do not; one ended by its target also needs a target
    above the accuracy it reached (the benchmark mode; a pretraining phase has none). A mark
    written before marks held the sample count has it from the checkpoints' global batch."""
    from bert import checkpoint

    limit = {"status": "aborted", "step": 6, "samples": 48, "ended_by": "limit", "eval": {"mlm_accuracy": 0.01}}
    d = _finished_run(tmp_path / "limit", 4, 6, mark=limit)
    for mode in ("auto", "off"):
        assert checkpoint.plan(d, mode, end_samples=96, target=0.72) is None
    assert checkpoint.plan(d, "require", end_samples=56, target=0.72) == d / "step_000000006"
    for end, target, fix in ((48, 0.72, "run.max_steps or run.max_samples past it"),
                             (40, None, "run.max_steps past it (up to optim.total_steps, where a pretraining phase ends)")):
        at = "step 6 (48 samples)" if end == 48 else "step 5 (40 samples)"
        with pytest.raises(checkpoint.CheckpointError) as e:
            checkpoint.plan(d, "require", end_samples=end, target=target)
        assert str(e.value) == (f"--resume / ckpt.resume=require: {d} holds a finished run: it ended at step 6 (48 "
                                f"samples), and this run's limits end it at {at}, not past that: raise {fix} to continue "
                                "it, or drop --resume to start a fresh run there")

    target = {**limit, "status": "success", "step": 5, "samples": 40, "ended_by": "target", "eval": {"mlm_accuracy": 0.73}}
    d = _finished_run(tmp_path / "target", 2, 4, mark=target)
    for t in (0.72, 0.73):
        with pytest.raises(checkpoint.CheckpointError, match=r"it ended at step 5 by its target \(masked-LM accuracy "
                                                             rf"0\.73\), and this run's eval\.target_accuracy={t} is "
                                                             r"reached already: raise it above 0\.73 to continue it"):
            checkpoint.plan(d, "require", end_samples=96, target=t)
    assert checkpoint.plan(d, "require", end_samples=96, target=0.75) == d / "step_000000004"
    assert checkpoint.plan(d, "require", end_samples=96, target=None) == d / "step_000000004"

    d = _finished_run(tmp_path / "older", 4, 6, mark={"status": "aborted", "step": 6})
    assert checkpoint.ended(d)["samples"] == 48
    with pytest.raises(checkpoint.CheckpointError, match=r"ended at step 6 \(48 samples\)"):
        checkpoint.plan(d, "require", end_samples=48, target=0.72)
    assert checkpoint.plan(d, "require", end_samples=56, target=0.72) == d / "step_000000006"


def test_an_unfinished_run_is_resumed_and_a_continuation_is_unfinished_once_it_trains(tmp_path):
    """No mark: auto and --resume resume the newest checkpoint, off refuses to mix with it.
    A continuation takes the mark away as it begins to train (``reopen``): stopped after
    that, the same command resumes it instead of starting fresh over it."""
    from bert import checkpoint

    d = _finished_run(tmp_path, 4, 6, mark={"status": "aborted", "step": 6, "samples": 48, "ended_by": "limit"})
    checkpoint.reopen(d)
    assert checkpoint.ended(d) is None and not (d / "finished.json").exists()
    for mode in ("auto", "require"):
        assert checkpoint.plan(d, mode, end_samples=48, target=0.72) == d / "step_000000006"
    with pytest.raises(checkpoint.CheckpointError, match="holds checkpoints of an unfinished run"):
        checkpoint.plan(d, "off", end_samples=96, target=0.72)
    (d / "finished.json").write_text("{")
    with pytest.raises(checkpoint.CheckpointError, match=r"finished.json: cannot read the finished mark: .*remove it"):
        checkpoint.plan(d, "auto", end_samples=96, target=0.72)


def test_a_fresh_start_names_what_it_removes(tmp_path, caplog):
    """clear, rank 0's fresh start: a finished run's checkpoints, torn temp directories and its
    mark go, named in one line; damaged checkpoints moved aside stay; nothing to remove, no
    line."""
    import logging

    from bert import checkpoint

    d = _finished_run(tmp_path, 4, 6, mark={"status": "aborted", "step": 6, "samples": 48, "ended_by": "limit"})
    (d / ".step_000000008.tmp").mkdir()
    (d / "step_000000002.damaged").mkdir()
    with caplog.at_level(logging.INFO, logger="bert.checkpoint"):
        checkpoint.clear(d)
        assert caplog.messages == [
            f"starting fresh in {d}: removing .step_000000008.tmp, step_000000004, step_000000006, the checkpoints of "
            "a finished run (it ended at step 6, run_stop aborted); --resume continues a finished run instead, to "
            "limits past its end"]
        assert sorted(p.name for p in d.iterdir()) == ["step_000000002.damaged"]
        caplog.clear()
        (d / ".step_000000002.tmp").mkdir()
        checkpoint.clear(d)
        assert caplog.messages == [f"starting fresh in {d}: removing .step_000000002.tmp, unfinished writes of a run "
                                   "that stopped during them"]
        caplog.clear()
        checkpoint.clear(d)
        assert caplog.messages == []


def test_a_dry_run_over_a_finished_run_removes_nothing(tiny_data, tmp_path, capsys):
    """A dry run trains nothing and writes no checkpoint: over a finished run it starts fresh
    (auto) without removing that run's checkpoints or its mark."""
    from bert import train

    ckpts = _finished_run(tmp_path / "checkpoints", 4, 6,
                          mark={"status": "aborted", "step": 6, "samples": 48, "ended_by": "limit"})
    before = sorted(p.name for p in ckpts.iterdir())
    assert train.main(["--dry-run", *train_args(tiny_data, tmp_path), "run.max_steps=12"]) == 0
    assert sorted(p.name for p in ckpts.iterdir() if p.name != ".lock") == before
    assert "starting fresh" not in capsys.readouterr().out
