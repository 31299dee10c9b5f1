"""Runs survive kills, signals, dead ranks, Ctrl-C and failed writes: 2 gloo ranks started as
separate processes (as srun starts them; run_and_time.sh's torchrun for Ctrl-C from a
terminal), a tiny model with dropout on (so the RNG state matters), and the uninterrupted
run's final weights and eval accuracies as the oracle.

Failed writes are real OSErrors from the kernel: a small tmpfs that fills (root only), and
RLIMIT_FSIZE on one rank (EFBIG for any file it writes past the limit; Python ignores
SIGXFSZ), each sized from the baseline's files so that exactly the writer under test fails."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from bert.mlperf_log import read_events
from conftest import PKG, catches, children, mllog_events, run_and_time_signalled
from checkpoint_helpers import (ENDLESS, STEPS, TINY, WORLD, WRITE_FAILED, _run_and_time_env, checkpoints, last_event,
                                launch, no_partial_files, rank_output, tiny_data, train_args, wait_all)  # noqa: F401 - fixtures: tiny_data


def wait_held(out: Path, procs: list[subprocess.Popen], step: int, ranks=range(WORLD), timeout: float = 120) -> None:
    """Until every rank in ``ranks`` has reached its hold at ``step`` (hold_env)."""
    markers = [out / "held" / f"held_rank{r}_step{step}" for r in ranks]
    wait_for(lambda: all(m.exists() for m in markers), procs, f"ranks {list(ranks)} held at step {step}",
             timeout=timeout)


def wait_for(cond, procs, what: str, timeout: float = 60) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if any(p.poll() is not None for p in procs) or time.monotonic() > end:
            for p in procs:
                p.kill()
            raise AssertionError(f"never saw {what}")
        time.sleep(0.005)


def accuracies(log: Path) -> dict[int, list[float]]:
    out: dict[int, list[float]] = {}
    for e in mllog_events(log):
        if e["key"] == "eval_accuracy":
            out.setdefault(e["metadata"]["epoch_num"], []).append(e["value"])
    return out


def assert_same_weights(a: Path, b: Path, context: str = "") -> None:
    wa, wb = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    assert wa.keys() == wb.keys(), context
    differ = [k for k in wa if not torch.equal(wa[k], wb[k])]
    assert not differ, f"weights differ from the uninterrupted run: {differ[:5]} {context}"


def resume_from_baseline(baseline: Path, step: int, out: Path) -> Path:
    """out/checkpoints holding the baseline's checkpoint of ``step`` alone, as if that run had
    been stopped there (so a launch into ``out`` resumes it: a few steps, not a whole run)."""
    dest = out / "checkpoints" / f"step_{step:09d}"
    shutil.copytree(baseline / "checkpoints" / dest.name, dest)
    return dest


def assert_rerun_matches_baseline(data: Path, baseline: Path, out: Path, *extra: str, rcs=(1, 1)) -> None:
    """The same command again, nothing in the way: it resumes and ends as the uninterrupted run."""
    got = wait_all(launch(data, out, *extra), out)
    assert got == list(rcs), rank_output(out)[-3000:]
    assert "resumed from" in rank_output(out)
    assert_same_weights(out / "final.pt", baseline / "final.pt")


@pytest.fixture(scope="module")
def baseline(tiny_data, tmp_path_factory) -> Path:
    """The uninterrupted run (it checkpoints too: writing one must not perturb anything); it
    keeps all its checkpoints, where later tests resume from (resume_from_baseline)."""
    out = tmp_path_factory.mktemp("baseline")
    rcs = wait_all(launch(tiny_data, out, "ckpt.interval_steps=2", f"ckpt.keep={STEPS // 2}"), out)
    assert rcs == [1, 1], (out / "rank0.out").read_text()[-3000:]  # aborted at the sample limit
    return out


def test_kill9_then_resume_matches_uninterrupted_run(tiny_data, baseline, tmp_path):
    """kill -9 of every rank at a random checkpointed step, held there (hold_env) so
    that the run cannot end first: either just after that checkpoint is complete, or while it
    is being written (rank 1 before its file, rank 0 waiting in the collective that ends the
    write, its files in the temp directory). The same command then resumes from the newest
    complete checkpoint and ends as the uninterrupted run, bit for bit."""
    # The seed is in every failure message; KILL_SEED=<seed> in the environment replays it.
    seed = int(os.environ.get("KILL_SEED", random.SystemRandom().randrange(2**32)))
    rng = random.Random(seed)
    k, writing = 2 * rng.randint(4, STEPS // 2 - 4), rng.random() < 0.5
    at = f"killed {'while writing' if writing else 'after'} checkpoint {k} (KILL_SEED={seed} replays it)"
    hold = f"writing:1:{k}:never" if writing else f"checkpoint:*:{k}:never"
    procs = launch(tiny_data, tmp_path, "ckpt.interval_steps=2", "ckpt.keep=3", hold=(hold,))
    wait_held(tmp_path, procs, k, ranks=[1] if writing else range(WORLD))
    torn = tmp_path / "checkpoints" / f".step_{k:09d}.tmp"
    if writing:  # rank 0's files are complete (renamed from .part): it waits in the collective
        wait_for(lambda: (torn / "train.pt").exists(), procs, f"rank 0's files of checkpoint {k} ({at})")
    for p in procs:
        p.send_signal(signal.SIGKILL)
    assert [p.wait() for p in procs] == [-signal.SIGKILL] * WORLD, at
    assert not (tmp_path / "final.pt").exists(), at
    newest = k - 2 if writing else k
    assert [p.name for p in checkpoints(tmp_path)] == [f"step_{s:09d}" for s in range(newest - 4, newest + 1, 2)], at
    assert torn.is_dir() == writing, at

    rcs = wait_all(launch(tiny_data, tmp_path, "ckpt.interval_steps=2", "ckpt.keep=3"), tmp_path)
    said = (tmp_path / "rank0.out").read_text()
    assert rcs == [1, 1], f"{at}\n{said[-3000:]}"
    # the killed run's locks went with it; their text says whose they were (bert/runlock.py)
    holder = f"(host {socket.gethostname()}, pid {procs[0].pid}, since "
    for what in (f"the MLPerf log {tmp_path / 'result_0.txt'}", f"the checkpoint directory {tmp_path / 'checkpoints'}"):
        assert f"note: {what}: taking over the lock of a run that ended without releasing it {holder}" in said, at
    assert f"resumed from {tmp_path / 'checkpoints' / f'step_{newest:09d}'} at step {newest}," in said, at
    assert_same_weights(tmp_path / "final.pt", baseline / "final.pt", at)
    want, got = accuracies(baseline / "result_0.txt"), accuracies(tmp_path / "result_0.txt")
    assert got.keys() == want.keys(), at
    # evals between the checkpoint and the kill ran twice; every run of them agrees
    assert all(set(got[s]) == set(want[s]) for s in want), (at, got, want)
    events = mllog_events(tmp_path / "result_0.txt")
    # the log keeps both parts and says so: two run_start, one resumed_from_checkpoint
    assert sum(e["key"] == "run_start" for e in events) == 2, at
    assert [e["key"] for e in events].count("resumed_from_checkpoint") == 1, at
    assert not no_partial_files(tmp_path), at


def test_sigterm_to_one_rank_checkpoints_all_and_resume_matches(tiny_data, baseline, tmp_path):
    """SIGTERM to rank 1 only, held after step 5 until it arrives: rank 0 learns of it at the
    next poll (step 6), both write that checkpoint and stop; the resume matches the
    uninterrupted run bit for bit."""
    procs = launch(tiny_data, tmp_path, "ckpt.poll_steps=2", hold=("boundary:1:5:signal",))
    wait_held(tmp_path, procs, 5, ranks=[1])
    procs[1].send_signal(signal.SIGTERM)
    rcs = wait_all(procs, tmp_path)
    said = (tmp_path / "rank0.out").read_text()
    assert rcs == [3, 3], said[-3000:]  # 3 = stopped by a signal after a checkpoint
    assert f"stopped by signal {int(signal.SIGTERM)} after step 6: resume from" in said and "Traceback" not in said
    (ckpt,) = checkpoints(tmp_path)
    assert ckpt.name == "step_000000006" and (ckpt / "meta.json").is_file() and not (tmp_path / "final.pt").exists()
    stops = [e for e in mllog_events(tmp_path / "result_0.txt") if e["key"] == "run_stop"]
    assert [s["metadata"]["status"] for s in stops] == ["aborted"]  # honest: no result

    rcs = wait_all(launch(tiny_data, tmp_path, "--resume"), tmp_path)
    assert rcs == [1, 1], (tmp_path / "rank0.out").read_text()[-3000:]
    assert_same_weights(tmp_path / "final.pt", baseline / "final.pt")
    assert accuracies(tmp_path / "result_0.txt") == accuracies(baseline / "result_0.txt")
    assert (tmp_path / "checkpoints" / "finished.json").is_file()


def test_a_second_run_in_a_live_runs_directories_is_refused(tiny_data, baseline, tmp_path):
    """Two runs, one directory: while the first is held after step 5, a second on the same log
    and one on the same ckpt.dir (its own log) are refused on both ranks, exit 2, naming the
    first's host and PID and writing nothing; released, the first ends as if alone (its log
    has one run, its weights are the uninterrupted run's bit for bit)."""
    first = launch(tiny_data, tmp_path, "dist.timeout_s=600", hold=("boundary:0:5:file=release",))
    wait_held(tmp_path, first, 5, ranks=[0])
    holder = f"(host {socket.gethostname()}, pid {first[0].pid}, since "
    cases = {"same_log": ((), f"the MLPerf log {tmp_path / 'result_0.txt'} is in use by another run {holder}",
                          "let it end, or give this run another log.output_dir or log.log_file (LOGDIR, LOGFILE)"),
             "same_ckpt": ((f"ckpt.dir={tmp_path / 'checkpoints'}",),
                           f"the checkpoint directory {tmp_path / 'checkpoints'} is in use by another run {holder}",
                           "let it end, or give this run another ckpt.dir (CKPT_DIR)")}
    for name, (extra, refusal, fix) in cases.items():
        out = tmp_path if name == "same_log" else tmp_path / name
        second = launch(tiny_data, out, *extra, said=tmp_path / name)
        assert wait_all(second, tmp_path / name) == [2, 2], rank_output(tmp_path / name)[-3000:]
        for r in range(WORLD):
            lines = [ln for ln in rank_output(tmp_path / name, r).splitlines() if ln.startswith("error:")]
            assert len(lines) == 1 and lines[0].startswith(f"error: rank {r}: {refusal}") and lines[0].endswith(fix), \
                rank_output(tmp_path / name, r)[-3000:]
    assert not (tmp_path / "same_ckpt" / "result_0.txt").exists()  # the refused run began no log
    (tmp_path / "held" / "release").touch()
    assert wait_all(first, tmp_path) == [1, 1], rank_output(tmp_path)[-3000:]
    keys = [e["key"] for e in mllog_events(tmp_path / "result_0.txt")]
    assert keys.count("run_start") == 1 and keys.count("run_stop") == 1
    assert_same_weights(tmp_path / "final.pt", baseline / "final.pt")
    # released at the end: the next run there starts without a note
    assert (tmp_path / ".result_0.txt.lock").read_text() == "" and (tmp_path / "checkpoints" / ".lock").read_text() == ""


def test_resume_require_without_checkpoint_fails(tiny_data, tmp_path):
    rcs = wait_all(launch(tiny_data, tmp_path, "--resume", world=1), tmp_path)
    assert rcs == [2]
    assert "holds no complete checkpoint" in (tmp_path / "rank0.out").read_text()


def test_a_finished_run_continued_to_a_later_step_limit(tiny_data, tmp_path):
    """The user's case on one rank through python -m bert.train, a checkpoint every 2 steps: a
    run ended by run.max_steps=6 writes a checkpoint of its last step and its finished mark;
    the same command with --resume is refused, naming both ends, and changes nothing (its lock
    released too); run.max_steps=12 with --resume continues from step 6, unfinished again as
    it trains (killed after step 8, a plain rerun resumes it rather than starting fresh) and
    ends at 12, where it checkpoints before its weights fail to be written; the same command
    resumes there and trains no step past it; a plain rerun then starts fresh, naming in one
    line what it removes, and ends with the same weights, bit for bit: the continuation lost
    and repeated nothing."""
    ckpts = tmp_path / "checkpoints"
    every = ("ckpt.interval_steps=2", "log.progress_interval_steps=100")

    def run(*extra: str, rc: int, hold: tuple[str, ...] = ()) -> str:
        (tmp_path / "rank0.out").unlink(missing_ok=True)
        procs = launch(tiny_data, tmp_path, *every, *extra, world=1, hold=hold)
        if hold:
            wait_held(tmp_path, procs, 8, ranks=[0])
            assert not (ckpts / "finished.json").exists(), rank_output(tmp_path)[-3000:]
            procs[0].send_signal(signal.SIGKILL)
        got = wait_all(procs, tmp_path)
        said = rank_output(tmp_path)
        assert got == [rc] and "Traceback" not in said, said[-3000:]
        return said

    said = run("run.max_steps=6", rc=1)  # aborted at its limit: exit 1
    assert f"checkpoint {ckpts / 'step_000000006'} (the run's last step)" in said.splitlines(), said[-3000:]
    assert [p.name for p in checkpoints(tmp_path)] == ["step_000000004", "step_000000006"]
    mark = json.loads((ckpts / "finished.json").read_text())
    assert (mark["status"], mark["step"], mark["samples"], mark["ended_by"]) == ("aborted", 6, 48, "limit")

    before = _tree_bytes(ckpts), (tmp_path / "result_0.txt").read_bytes()
    said = run("run.max_steps=6", "--resume", rc=2)
    assert said.strip() == (f"error: --resume / ckpt.resume=require: {ckpts} holds a finished run: it ended at step 6 "
                            "(48 samples), and this run's limits end it at step 6 (48 samples), not past that: raise "
                            "run.max_steps or run.max_samples past it to continue it, or drop --resume to start a "
                            "fresh run there"), said[-3000:]
    assert (_tree_bytes(ckpts), (tmp_path / "result_0.txt").read_bytes()) == before

    said = run("run.max_steps=12", "--resume", rc=-signal.SIGKILL, hold=("checkpoint:0:8:never",))
    assert ("continuing a finished run: it ended at step 6 (48 samples, run_stop aborted); this run ends at step 12 "
            "(96 samples)") in said.splitlines(), said[-3000:]
    assert f"resumed from {ckpts / 'step_000000006'} at step 6, 48 samples" in said
    weights = tmp_path / "blocked" / "final.pt"
    weights.parent.write_text("a file where the weights' directory goes")  # their write fails (exit 5)
    said = run("run.max_steps=12", f"run.save_checkpoint={weights}", rc=WRITE_FAILED)
    assert f"resumed from {ckpts / 'step_000000008'} at step 8, 64 samples" in said and "starting fresh" not in said
    assert said.splitlines()[-1].endswith("(on rank 0); the newest complete checkpoint is step_000000012; free space "
                                          "or point run.save_checkpoint elsewhere, then rerun the same command to "
                                          "resume"), said[-3000:]
    assert [p.name for p in checkpoints(tmp_path)] == ["step_000000010", "step_000000012"]
    assert not (ckpts / "finished.json").exists()
    weights.parent.unlink()
    said = run("run.max_steps=12", f"run.save_checkpoint={weights}", rc=1)  # the same command: nothing past 12
    assert "resumed at step 12, at or past this run's end (96 samples): no step trained" in said, said[-3000:]
    assert json.loads((ckpts / "finished.json").read_text())["step"] == 12

    said = run("run.max_steps=12", rc=1)
    assert (f"starting fresh in {ckpts}: removing step_000000010, step_000000012, the checkpoints of a finished run "
            "(it ended at step 12, run_stop aborted); --resume continues a finished run instead, to limits past its "
            "end") in said.splitlines() and "resumed from" not in said, said[-3000:]
    assert_same_weights(tmp_path / "final.pt", weights)


def test_dead_rank_others_exit_nonzero_within_timeout(tiny_data, tmp_path):
    victim = 0  # the harder case: rank 0 also hosts the rendezvous store (rank 1 dying works alike)
    timeout = 20
    procs = launch(tiny_data, tmp_path, f"dist.timeout_s={timeout}", "run.max_samples=1000000")
    wait_for(lambda: "step      3 |" in (tmp_path / "rank0.out").read_text(), procs, "step 3")
    procs[victim].send_signal(signal.SIGKILL)
    t0 = time.monotonic()
    survivor = procs[1 - victim]
    try:
        rc = survivor.wait(timeout=timeout + 30)
    except subprocess.TimeoutExpired:
        survivor.kill()
        raise AssertionError("the surviving rank hung") from None
    elapsed = time.monotonic() - t0
    said = (tmp_path / f"rank{1 - victim}.out").read_text()
    assert rc == 4, said[-3000:]
    assert f"rank {1 - victim} of 2: a collective failed" in said and f"dist.timeout_s={timeout}" in said
    assert elapsed < timeout + 30
    assert not (tmp_path / "final.pt").exists() and not no_partial_files(tmp_path)


def test_hung_rank_times_out(tiny_data, tmp_path):
    """A rank that stops answering (SIGSTOP) without closing its sockets: only the timeout helps."""
    timeout = 10
    procs = launch(tiny_data, tmp_path, f"dist.timeout_s={timeout}", "run.max_samples=1000000")
    wait_for(lambda: "step      3 |" in (tmp_path / "rank0.out").read_text(), procs, "step 3")
    procs[1].send_signal(signal.SIGSTOP)
    try:
        rc = procs[0].wait(timeout=timeout + 40)
    except subprocess.TimeoutExpired:
        procs[0].kill()
        raise AssertionError("rank 0 hung past the timeout") from None
    finally:
        procs[1].kill()
        procs[1].wait()
    said = (tmp_path / "rank0.out").read_text()
    assert rc == 4, said[-3000:]
    assert "rank 0 of 2: a collective failed" in said


def test_a_diverging_run_keeps_its_finite_checkpoints(tiny_data, baseline, tmp_path):
    """Rank 1's weights turn NaN after step 7 (what a diverging run does; injected): at step
    8's checkpoint the state is not finite on some rank, so no checkpoint is written, every
    rank ends the run (exit 6) and says which finite checkpoint is kept; pruning (keep=2) left
    step 4 and 6, both finite, and the same command without the fault continues from step 6
    as the uninterrupted run, bit for bit."""
    extra = ("ckpt.interval_steps=2", "ckpt.keep=2", "ckpt.poll_steps=2")
    procs = launch(tiny_data, tmp_path, *extra, hold=("poison:1:7:now",))
    assert wait_all(procs, tmp_path) == [6, 6], rank_output(tmp_path)[-3000:]
    said = rank_output(tmp_path)
    assert ("diverged: the weights or optimizer state hold NaN/inf at step 8: ending the run; no checkpoint and no "
            "final weights written from it; the newest finite checkpoint, step_000000006, is kept: the same command "
            "resumes from it") in said, said[-3000:]
    assert [p.name for p in checkpoints(tmp_path)] == ["step_000000004", "step_000000006"]
    for ckpt in checkpoints(tmp_path):
        weights = torch.load(ckpt / "train.pt", weights_only=True)["model"]
        assert all(torch.isfinite(v).all() for v in weights.values()), ckpt
    assert not (tmp_path / "final.pt").exists() and not (tmp_path / "checkpoints" / "finished.json").exists()
    assert last_event(tmp_path / "result_0.txt")["metadata"]["status"] == "aborted"
    assert_rerun_matches_baseline(tiny_data, baseline, tmp_path, *extra)


def test_a_run_that_really_diverges_writes_no_nan_checkpoint_and_its_rerun_repeats_it(tiny_data, tmp_path):
    """optim.lr=1e6 (no injection): a checkpoint every step, keep=2. Once the state holds
    NaN/inf no checkpoint is written: both ranks exit 6 naming the step and the newest
    checkpoint, every kept checkpoint is finite, no final weights. The same command resumes
    from that checkpoint and diverges again at the same step, as the message says."""
    extra = ("optim.lr=1e6", "ckpt.interval_steps=1", "ckpt.keep=2", "ckpt.poll_steps=1")
    said = re.compile(r"^diverged: the weights or optimizer state hold NaN/inf at step (\d+): ending the run; no "
                      r"checkpoint and no final weights written from it; the newest finite checkpoint, "
                      r"step_(\d{9}), is kept: the same command resumes from it", re.M)
    ends = []
    for attempt in ("first", "rerun"):
        assert wait_all(launch(tiny_data, tmp_path, *extra), tmp_path) == [6, 6], rank_output(tmp_path)[-3000:]
        (step, kept), = said.findall(rank_output(tmp_path).split("resumed from")[-1])
        ends.append((int(step), int(kept)))
        assert [p.name for p in checkpoints(tmp_path)][-1] == f"step_{kept}", attempt
        for ckpt in checkpoints(tmp_path):
            state = torch.load(ckpt / "train.pt", weights_only=True)
            tensors = [*state["model"].values(), *(v for st in state["optimizer"]["state"].values()
                                                   for v in st.values() if torch.is_tensor(v))]
            assert all(torch.isfinite(t).all() for t in tensors), (attempt, ckpt)
        assert not (tmp_path / "final.pt").exists() and last_event(tmp_path / "result_0.txt")["metadata"]["status"] \
            == "aborted", attempt
    assert ends[0] == ends[1] and ends[0][1] == ends[0][0] - 1, ends  # the checkpoint of the step before
    assert "resumed from" in rank_output(tmp_path)


def test_nan_weights_at_the_end_are_never_written(tiny_data, tmp_path):
    """NaN in the last steps (one rank: 48 steps; NaN from step 46 on), with no poll to see it
    (one poll in 1000 steps): the check before the final weights ends the run as diverged
    (exit 6, run_stop aborted) instead of writing them or marking the run finished."""
    (proc,) = launch(tiny_data, tmp_path, "ckpt.poll_steps=1000", world=1, hold=("poison:0:46:now",))
    assert wait_all([proc], tmp_path) == [6], rank_output(tmp_path)[-3000:]
    said = rank_output(tmp_path)
    assert ("diverged: the weights or optimizer state hold NaN/inf at the end, step 48: ending the run; no checkpoint "
            "and no final weights written from it; there is no checkpoint to resume") in said, said[-3000:]
    assert "NaN/inf loss 2 steps in a row" in said  # steps 47 and 48: under run.max_nonfinite_steps
    assert not (tmp_path / "final.pt").exists() and not (tmp_path / "checkpoints" / "finished.json").exists()
    assert last_event(tmp_path / "result_0.txt")["metadata"]["status"] == "aborted"


def test_resume_on_another_world_size_without_its_global_batch_is_refused(tiny_data, baseline, tmp_path, capsys):
    """A 2-rank checkpoint (global batch 16) on 1 rank of 8: refused for its global batch,
    naming the splits that keep it, not called damaged (its rank files are another world's,
    unread); another world size that keeps it resumes (tests/integration/test_elastic.py)."""
    import shutil

    from bert import train

    ckpt_dir = tmp_path / "ckpts"
    shutil.copytree(baseline / "checkpoints", ckpt_dir)
    (ckpt_dir / "finished.json").unlink()  # make it look preempted
    args = [*TINY, f"data.train_dir={tiny_data / 'train'}", f"data.eval_dir={tiny_data / 'eval'}",
            f"log.output_dir={tmp_path / 'out'}", f"ckpt.dir={ckpt_dir}"]
    assert train.main(args) == 2
    err = capsys.readouterr().err
    assert ("written with global batch 16 (2 ranks), this run has 8 (1 rank); a resume keeps the global batch (the "
            "schedule and the data stream count in it): on 1 rank: run.local_batch_size=16 with "
            "run.grad_accum_steps=1 or run.local_batch_size=8 with run.grad_accum_steps=2") in err, err
    assert not list(ckpt_dir.glob("*.damaged"))  # another world's checkpoint is not a damaged one
    assert train.main([*args, "ckpt.resume=off"]) == 2  # a fresh start would mix with them
    assert "holds checkpoints of an unfinished run" in capsys.readouterr().err


def test_ctrl_c_to_one_rank_stops_all_at_one_step_and_saves_where_asked(tiny_data, baseline, tmp_path):
    """SIGINT to rank 1 only: rank 0 learns it at the next poll, both stop at the same step;
    with a chosen ckpt.dir they write a checkpoint first, and the rerun continues exactly."""
    ckpt = tmp_path / "ckpts"
    procs = launch(tiny_data, tmp_path, "ckpt.poll_steps=2", f"ckpt.dir={ckpt}", hold=("boundary:1:5:signal",))
    wait_held(tmp_path, procs, 5, ranks=[1])  # held after step 5 until the signal is there
    procs[1].send_signal(signal.SIGINT)
    rcs = wait_all(procs, tmp_path)
    out = rank_output(tmp_path)
    assert rcs == [130, 130], out[-3000:]
    m = re.search(r"^interrupted \(Ctrl-C\): stopped at step (\d+); checkpoint (\S+) written: "
                  r"rerun the same command to resume$", out, re.M)
    assert m and m[1] == "6" and Path(m[2]) == ckpt / "step_000000006", out[-3000:]
    assert "Traceback" not in out + rank_output(tmp_path, 1)
    assert last_event(tmp_path / "result_0.txt")["metadata"]["status"] == "aborted"
    assert not no_partial_files(tmp_path)
    assert_rerun_matches_baseline(tiny_data, baseline, tmp_path, f"ckpt.dir={ckpt}")


def test_second_ctrl_c_ends_a_rank_at_once(tiny_data, tmp_path):
    """The first Ctrl-C waits for a poll or an evaluation (none in this run); a second one has
    SIGINT's default action: the process ends at once, killed by it. Each Ctrl-C is sent once
    the process is where it must be (its handler installed; then that handler run and SIGINT's
    default back), read from /proc, so no timing is assumed."""
    (proc,) = launch(tiny_data, tmp_path, f"ckpt.poll_steps={10**9}", f"eval.interval_samples={10**9}",
                     *ENDLESS, world=1)
    wait_for(lambda: catches(proc.pid, signal.SIGUSR1), [proc], "the trainer's handlers")  # SIGINT's with them
    proc.send_signal(signal.SIGINT)
    wait_for(lambda: not catches(proc.pid, signal.SIGINT), [proc], "the first SIGINT handled")
    proc.send_signal(signal.SIGINT)
    try:
        assert proc.wait(timeout=30) == -signal.SIGINT, rank_output(tmp_path)[-3000:]
    finally:
        proc.kill()
    assert "Traceback" not in rank_output(tmp_path)


def test_ctrl_c_to_run_and_time_process_group_then_rerun_resumes(tiny_data, baseline, tmp_path, no_procps_path):
    """What a terminal does on Ctrl-C: SIGINT to the foreground process group (the script;
    torchrun and its workers have groups of their own), on a PATH without procps, as soon as
    torchrun has its group (before it has workers: the script keeps it for them, so the run
    stops at its first poll, long before its end). One line, exit 130, no traceback from
    any rank or torchrun, run_stop aborted; the same command then resumes from the checkpoint
    it names, bit for bit, and its RESULT line has the seed the log has (SEED unset)."""
    assert shutil.which("pgrep", path=no_procps_path) is None
    env = _run_and_time_env(tiny_data, tmp_path, no_procps_path)

    def ctrl_c_once_torchrun_has_its_group(proc):  # not in the instant torchrun is forked, still in the script's
        deadline = time.monotonic() + 60
        while not any(os.getpgid(t) == t for t in children(proc.pid) if not _gone(t)):
            assert time.monotonic() < deadline, "torchrun never started"
            time.sleep(0.001)
        os.killpg(proc.pid, signal.SIGINT)

    rc, first = run_and_time_signalled(env, act=ctrl_c_once_torchrun_has_its_group)
    assert rc == 130, first[-3000:]
    m = re.search(r"^interrupted \(Ctrl-C\): stopped at step (\d+); nothing saved; a rerun resumes from "
                  r"(step_\d{9})$", first, re.M)
    assert m, first[-3000:]
    assert "Traceback" not in first and "RESULT," not in first and "WARNING" not in first, first[-3000:]
    assert last_event(tmp_path / "result_0.txt")["metadata"]["status"] == "aborted"
    assert not no_partial_files(tmp_path)
    r = subprocess.run(["./run_and_time.sh"], cwd=PKG, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, (r.stdout + r.stderr)[-3000:]  # the sample limit, as the baseline
    assert f"resumed from {tmp_path / 'checkpoints' / m[2]}" in r.stdout
    assert re.search(r"^RESULT,bert,12345,\d+,", r.stdout, re.M), r.stdout[-2000:]
    assert_same_weights(tmp_path / "final.pt", baseline / "final.pt")


def test_sigterm_to_run_and_time_before_its_workers_exist_is_honoured(tiny_data, baseline, tmp_path,
                                                                      no_procps_path):
    """SIGTERM to run_and_time.sh as it starts, before torchrun has started (let alone its
    workers, or their handlers): the script notes it, each rank acts on it once it can, so
    the run checkpoints at its first poll and exits 3; no warning, no traceback. The same
    command resumes from that checkpoint and ends as the uninterrupted run, bit for bit."""
    env = _run_and_time_env(tiny_data, tmp_path, no_procps_path, "ckpt.poll_steps=2")
    rc, first = run_and_time_signalled(env, sig=signal.SIGTERM)
    assert rc == 3, first[-3000:]
    assert f"stopped by signal {int(signal.SIGTERM)} after step 2: resume from {tmp_path / 'checkpoints'}" in first
    assert "Traceback" not in first and "WARNING" not in first and "RESULT," not in first, first[-3000:]
    assert [p.name for p in checkpoints(tmp_path)] == ["step_000000002"]
    r = subprocess.run(["./run_and_time.sh"], cwd=PKG, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "resumed from" in r.stdout, (r.stdout + r.stderr)[-3000:]
    assert_same_weights(tmp_path / "final.pt", baseline / "final.pt")


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def test_kill9_of_run_and_time_leaves_nothing_running(tiny_data, tmp_path, no_procps_path):
    """kill -9 of run_and_time.sh (nothing can trap it) mid-run: torchrun dies with it and the
    workers with torchrun (their parent-death signal, bert/tether.py), instead of training
    on as orphans beside the requeued run; nothing more is written to the run's directory."""
    env = _run_and_time_env(tiny_data, tmp_path, no_procps_path, *ENDLESS)
    proc = subprocess.Popen(["./run_and_time.sh"], cwd=PKG, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        torchrun, workers = [], []
        wait_for(lambda: bool(checkpoints(tmp_path)), [proc], "a checkpoint")  # it trains
        torchrun = children(proc.pid)
        workers = [w for t in torchrun for w in children(t)]
        assert len(torchrun) == 1 and len(workers) == WORLD, (torchrun, workers)
        proc.kill()
        assert proc.wait() == -signal.SIGKILL
        deadline = time.monotonic() + 30
        while not all(map(_gone, torchrun + workers)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(map(_gone, torchrun + workers)), [p for p in torchrun + workers if not _gone(p)]
        seen = sorted(p.name for p in checkpoints(tmp_path))
        time.sleep(1)  # nothing left to write more
        assert sorted(p.name for p in checkpoints(tmp_path)) == seen
    finally:
        for pid in torchrun + workers:
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)


def test_tether_refuses_to_start_after_its_launcher_died(tiny_data, tmp_path):
    """The parent-death signal is armed after the process started: a launcher that died
    before that would never send it, so each side checks its parent once armed and ends at
    once, saying so (exit 129). A tethered command keeps the wrapper's PID, which its own
    children get in BERT_PARENT_PID."""
    r = subprocess.run([sys.executable, "-m", "bert.tether", "--parent", "1", "--", "true"], cwd=PKG,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 129 and "bert.tether: parent 1 ended before true started: not starting it" in r.stderr
    r = subprocess.run([sys.executable, "-m", "bert.tether", "--parent", str(os.getpid()), "--", "sh", "-c",
                        'echo "$BERT_PARENT_PID $$"'], cwd=PKG, capture_output=True, text=True, timeout=60)
    pid, own = r.stdout.split()
    assert r.returncode == 0 and pid == own, r.stdout + r.stderr
    env = dict(os.environ, BERT_PARENT_PID="1")
    r = subprocess.run([sys.executable, "-m", "bert.train", "--dry-run", *train_args(tiny_data, tmp_path)], cwd=PKG,
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 129, r.stdout + r.stderr
    assert "bert: the launcher (PID 1) ended before this process could follow it: not training" in r.stderr
    assert not (tmp_path / "result_0.txt").exists()


def test_second_ctrl_c_ends_run_and_time_at_once(tiny_data, tmp_path, no_procps_path):
    """Two Ctrl-C in a row, the first not acted on (no poll, no evaluation, no end in this
    run): the script ends torchrun and every worker at once, says so, exits 130; no
    traceback. The second is sent once both workers have handled the first (/proc)."""
    env = _run_and_time_env(tiny_data, tmp_path, no_procps_path, f"ckpt.poll_steps={10**9}",
                            f"eval.interval_samples={10**9}", *ENDLESS)
    workers = []

    def ctrl_c_twice(proc):
        deadline = time.monotonic() + 120
        while not (len(workers) == WORLD and all(catches(w, signal.SIGUSR1) for w in workers)):
            assert time.monotonic() < deadline, "the workers never installed their handlers"  # SIGINT's with them
            workers[:] = [w for torchrun in children(proc.pid) for w in children(torchrun)]
            time.sleep(0.01)
        os.killpg(proc.pid, signal.SIGINT)
        while any(catches(w, signal.SIGINT) for w in workers):  # each ran its handler: SIGINT's default back
            assert time.monotonic() < deadline, "the first Ctrl-C never reached the workers"
            time.sleep(0.01)
        os.killpg(proc.pid, signal.SIGINT)

    rc, out = run_and_time_signalled(env, act=ctrl_c_twice, at_step=None)
    assert rc == 130 and "interrupted (Ctrl-C twice): the training processes were ended at once" in out, out[-3000:]
    assert len(workers) == WORLD and "Traceback" not in out and "Killed" not in out, out[-3000:]
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{w}").exists() for w in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(Path(f"/proc/{w}").exists() for w in workers)


def _write_failed_line(out: Path, rank: int, what: str, where: Path, why: str, by: str, then: str) -> None:
    """Every rank said the same one line, and nothing else went wrong."""
    text = rank_output(out, rank)
    lines = [ln for ln in text.splitlines() if ln.startswith("error:")]
    want = f"error: rank {rank} of {WORLD}: {what} could not be written to {where}: {why} (on {by}); {then}"
    assert lines == [want], text[-3000:]
    assert "Traceback" not in text and "Logging error" not in text, text[-3000:]


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 400 KiB tmpfs: room for one checkpoint of the tiny model (268 KiB), not two."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=400k", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True)


def test_checkpoint_fills_a_small_tmpfs_then_resumes_from_the_named_one(tiny_data, baseline, tmp_path, small_tmpfs):
    """The issue's case: ckpt.dir on a filesystem that holds one checkpoint. The second one
    fails with ENOSPC inside torch.save: every rank says so in one line naming the complete
    one, the temp directory is gone, run_stop aborted, exit 5 (not 4); that checkpoint,
    copied to a roomy ckpt.dir, continues the run exactly."""
    procs = launch(tiny_data, tmp_path, "ckpt.interval_steps=4", f"ckpt.dir={small_tmpfs}")
    assert wait_all(procs, tmp_path) == [WRITE_FAILED] * WORLD, rank_output(tmp_path)[-3000:]
    by = re.search(r"\(on (ranks? [\d, ]+)\)", rank_output(tmp_path))[1]  # who ran out first: a race
    for r in range(WORLD):
        _write_failed_line(tmp_path, r, "checkpoint step_000000008", small_tmpfs, "No space left on device (errno 28)",
                           by, "the newest complete checkpoint is step_000000004; free space or point ckpt.dir "
                           "elsewhere (with that checkpoint copied there), then rerun the same command to resume")
    assert sorted(p.name for p in small_tmpfs.iterdir()) == [".lock", "step_000000004"]  # the lock: runlock.py
    assert last_event(tmp_path / "result_0.txt")["metadata"]["status"] == "aborted"
    roomy = tmp_path / "roomy"
    shutil.copytree(small_tmpfs / "step_000000004", roomy / "step_000000004")
    assert_rerun_matches_baseline(tiny_data, baseline, tmp_path, "ckpt.interval_steps=4", f"ckpt.dir={roomy}")
    assert not no_partial_files(tmp_path)


def test_checkpoint_write_fails_on_rank_1(tiny_data, baseline, tmp_path):
    """Rank 1's own file of a checkpoint fails (EFBIG): rank 0 learns it from the collective
    that ends every checkpoint write, and both stop with rank 1's reason."""
    resume_from_baseline(baseline, 10, tmp_path)
    small = (baseline / "checkpoints" / "step_000000010" / "rank_1.pt").stat().st_size // 2
    procs = launch(tiny_data, tmp_path, "ckpt.interval_steps=2", file_limit={1: small})
    assert wait_all(procs, tmp_path) == [WRITE_FAILED] * WORLD, rank_output(tmp_path)[-3000:]
    for r in range(WORLD):
        _write_failed_line(tmp_path, r, "checkpoint step_000000012", tmp_path / "checkpoints",
                           "File too large (errno 27)", "rank 1", "the newest complete checkpoint is step_000000010; "
                           "free space or point ckpt.dir elsewhere (with that checkpoint copied there), then rerun "
                           "the same command to resume")
    assert last_event(tmp_path / "result_0.txt")["metadata"]["status"] == "aborted"
    assert not no_partial_files(tmp_path)
    assert_rerun_matches_baseline(tiny_data, baseline, tmp_path, "ckpt.interval_steps=2")


def test_final_weights_write_fails_after_the_target(tiny_data, baseline, tmp_path):
    """The run reaches its target, then run.save_checkpoint fails on rank 0 (EFBIG): every
    rank learns it at the end, run_stop is aborted (the run did not finish), nothing marks
    the checkpoints finished, and the rerun resumes and writes the same weights."""
    resume_from_baseline(baseline, 20, tmp_path)
    limit = (baseline / "final.pt").stat().st_size // 2
    assert (baseline / "result_0.txt").stat().st_size < limit  # only the weights are too large
    target = "eval.target_accuracy=0.005"  # reached at step 24 (0.0098), where the baseline ends too
    procs = launch(tiny_data, tmp_path, target, file_limit={0: limit})
    assert wait_all(procs, tmp_path) == [WRITE_FAILED] * WORLD, rank_output(tmp_path)[-3000:]
    for r in range(WORLD):
        _write_failed_line(tmp_path, r, "the final weights", tmp_path / "final.pt", "File too large (errno 27)",
                           "rank 0", "the newest complete checkpoint is step_000000020; free space or point "
                           "run.save_checkpoint elsewhere, then rerun the same command to resume")
    stops = [e["metadata"]["status"] for e in read_events(tmp_path / "result_0.txt") if e["key"] == "run_stop"]
    assert stops == ["aborted"] and last_event(tmp_path / "result_0.txt")["key"] == "run_stop"
    assert not (tmp_path / "final.pt").exists() and not (tmp_path / "checkpoints" / "finished.json").exists()
    assert not no_partial_files(tmp_path)
    assert_rerun_matches_baseline(tiny_data, baseline, tmp_path, target, rcs=(0, 0))


def test_mlperf_log_write_fails(tiny_data, baseline, tmp_path):
    """Rank 0's MLPerf log cannot grow (EFBIG): no traceback per line; every rank stops at the
    next poll with one line; the log ends where the write failed (a torn line the reader
    skips), so run_stop cannot be in it; the rerun appends after the torn line and resumes."""
    resume_from_baseline(baseline, 10, tmp_path)
    limit = 10_000  # the log's first lines (~8 kB), not the evaluations after them
    procs = launch(tiny_data, tmp_path, "ckpt.poll_steps=2", file_limit={0: limit})
    assert wait_all(procs, tmp_path) == [WRITE_FAILED] * WORLD, rank_output(tmp_path)[-3000:]
    log = tmp_path / "result_0.txt"
    for r in range(WORLD):
        _write_failed_line(tmp_path, r, "the MLPerf log", log, "File too large (errno 27)", "rank 0",
                           "the newest complete checkpoint is step_000000010; free space or point log.output_dir "
                           "elsewhere, then rerun the same command to resume")
    assert log.stat().st_size == limit and "run_stop" not in {e["key"] for e in read_events(log)}
    assert_rerun_matches_baseline(tiny_data, baseline, tmp_path)
    keys = [e["key"] for e in read_events(log)]
    # the rerun's first line (cache_clear) starts a line of its own after the torn one
    assert keys.count("cache_clear") == keys.count("run_start") == 2 and keys[-1] == "run_stop"


def _flip_bit(path: Path, at: float = 0.5) -> None:
    """One bit flipped in the middle of the file (a tensor's mantissa: torch.load reads it back
    without a word)."""
    data = bytearray(path.read_bytes())
    data[int(len(data) * at)] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damaged", ["train.pt", "rank_1.pt"])
def test_a_damaged_checkpoint_is_named_and_auto_resumes_the_newest_that_verifies(tiny_data, baseline, tmp_path,
                                                                                damaged):
    """One flipped bit in the newest checkpoint (rank 0's train.pt, or rank 1's own file): it
    does not verify against meta.json's CRC-32s; ckpt.resume=auto says so, moves it aside
    and resumes from the one before, bit-exactly; --resume refuses, naming the file and the
    checkpoint that verifies, and moves nothing."""
    resume_from_baseline(baseline, 10, tmp_path)
    newest = resume_from_baseline(baseline, 12, tmp_path)
    _flip_bit(newest / damaged)
    rank = 1 if damaged == "rank_1.pt" else 0
    why = (rf"{re.escape(str(newest / damaged))}: crc32 [0-9a-f]{{8}} \(\d+ bytes\), but meta.json says [0-9a-f]{{8}} "
           rf"\(\d+ bytes\): damaged since it was written \(on rank {rank}\)")
    assert wait_all(launch(tiny_data, tmp_path, "--resume"), tmp_path) == [2, 2]
    for r in range(WORLD):
        assert re.search(rf"^error: rank {r}: {why}; the newest checkpoint that verifies is step_000000010: "
                         r"ckpt.resume=auto \(the default\) resumes from it", rank_output(tmp_path, r), re.M), \
            rank_output(tmp_path, r)[-3000:]
    assert newest.is_dir()  # require moves nothing
    assert_rerun_matches_baseline(tiny_data, baseline, tmp_path)
    said = rank_output(tmp_path)
    assert re.search(rf"^warning: checkpoint step_000000012 does not verify: {why}; resuming from step_000000010, "
                     r"the newest checkpoint that verifies \(step_000000012 moved aside to \*\.damaged\)$", said, re.M), \
        said[-3000:]
    assert f"resumed from {tmp_path / 'checkpoints' / 'step_000000010'} at step 10," in said
    assert (tmp_path / "checkpoints" / "step_000000012.damaged" / damaged).is_file()


def test_no_checkpoint_that_verifies_is_refused(tiny_data, baseline, tmp_path):
    """The only checkpoint damaged (4 KiB of zeros in the optimizer moments): auto refuses
    too, rather than start fresh over it: exit 2 on both ranks."""
    ckpt = resume_from_baseline(baseline, 12, tmp_path)
    with open(ckpt / "train.pt", "r+b") as f:
        f.seek((ckpt / "train.pt").stat().st_size * 3 // 4)
        f.write(b"\0" * 4096)
    assert wait_all(launch(tiny_data, tmp_path), tmp_path) == [2, 2]
    assert f"no checkpoint in {tmp_path / 'checkpoints'} verifies: move the damaged ones aside" in rank_output(tmp_path, 1)
    assert not (tmp_path / "final.pt").exists() and ckpt.is_dir()


def test_a_checkpoint_whose_bookkeeping_contradicts_itself_is_refused(tiny_data, baseline, tmp_path):
    """meta.json holds no sum of its own: its step changed (12 -> 11, what a flipped bit in
    it does) is caught by the cross-check with train.pt's train state and each rank's file,
    instead of resuming with wrong bookkeeping."""
    ckpt = resume_from_baseline(baseline, 12, tmp_path)
    meta = json.loads((ckpt / "meta.json").read_text())
    (ckpt / "meta.json").write_text(json.dumps({**meta, "step": 11}))
    assert wait_all(launch(tiny_data, tmp_path), tmp_path) == [2, 2]
    assert (f"error: rank 0: {ckpt}: meta.json says step 11, train.pt says 12: the checkpoint contradicts itself"
            in rank_output(tmp_path))


def _tree_bytes(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_resume_with_changed_settings_is_refused_naming_them(tiny_data, baseline, tmp_path):
    """The checkpoint's state would override a changed optim.lr (and the log would record the
    new value): a resume under changed settings is refused on both ranks, exit 2, naming each
    key with both values, under auto and --resume alike, with nothing written (the checkpoint
    and the log of the run it would continue byte for byte as they were, no config dump, no
    weights). Settings that may differ
    (RESUME_MAY_DIFFER: here ckpt.poll_steps, log.progress_interval_steps, dist.timeout_s) are
    not named, and the same command with only those resumes and ends as the uninterrupted run,
    bit for bit."""
    ckpt = resume_from_baseline(baseline, 12, tmp_path)
    shutil.copy(baseline / "result_0.txt", tmp_path / "result_0.txt")  # the log a resume appends to
    before = _tree_bytes(ckpt), (tmp_path / "result_0.txt").read_bytes()
    may = ("ckpt.poll_steps=3", "log.progress_interval_steps=2", "dist.timeout_s=120")
    changed = (rf"model\.hidden_dropout=0\.2 \(the checkpointed run's: 0\.1\); optim\.lr=1000000\.0 "
               rf"\(the checkpointed run's: 0\.002\)\. Set them back \(that run's are in {re.escape(str(ckpt))}/config\.json\), "
               r"or start a fresh run with another ckpt\.dir and log\.output_dir; only paths, ckpt\.\*, log\.\*, dist\.\*, "
               r"the run's guards and its end \(target, sample and step limits\) may differ \(bert/config\.py "
               r"RESUME_MAY_DIFFER\)$")
    for flags in ((), ("--resume",)):
        said = tmp_path / ("require" if flags else "auto")
        got = wait_all(launch(tiny_data, tmp_path, *may, "optim.lr=1e6", "model.hidden_dropout=0.2", *flags,
                              said=said), said)
        assert got == [2, 2], rank_output(said)[-3000:]
        for r in range(WORLD):
            assert re.search(rf"^error: rank {r}: {re.escape(str(ckpt))}: a resume continues the checkpointed run, but "
                             rf"this run's settings differ from it: {changed}", rank_output(said, r), re.M), \
                rank_output(said, r)[-3000:]
            errors = [ln for ln in rank_output(said, r).splitlines() if ln.startswith("error:")]
            assert not any("poll_steps" in ln for ln in errors) and "Traceback" not in rank_output(said, r)
    assert (_tree_bytes(ckpt), (tmp_path / "result_0.txt").read_bytes()) == before
    assert [p.name for p in checkpoints(tmp_path)] == [ckpt.name]
    assert not (tmp_path / "final.pt").exists() and not (tmp_path / "result_0_config.json").exists()
    assert_rerun_matches_baseline(tiny_data, baseline, tmp_path, *may)
    dumped = json.loads((tmp_path / "result_0_config.json").read_text())
    assert dumped["ckpt"]["poll_steps"] == 3 and dumped["dist"]["timeout_s"] == 120  # applied and logged
