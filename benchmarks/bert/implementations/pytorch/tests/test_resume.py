"""Runs survive kills, signals and dead ranks: 2 gloo ranks started as separate processes
(as srun starts them), a tiny model with dropout on (so the RNG state matters), and the
uninterrupted run's final weights and eval accuracies as the oracle."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import PKG, free_port, mllog_events

WORLD = 2
STEPS = 24  # global batch 16; the 4 x 40-sample shards give each rank 80 per epoch: 5 steps each
TINY = ["model.vocab_size=128", "model.hidden_size=32", "model.num_layers=1", "model.num_heads=2",
        "model.intermediate_size=64", "model.max_position_embeddings=64", "model.hidden_dropout=0.1",
        "model.attention_dropout=0.1", "data.max_seq_length=64", "data.max_predictions_per_seq=10",
        "data.eval_samples=100", "eval.batch_size=100", "eval.interval_samples=64", "run.local_batch_size=8",
        "optim.lr=2e-3", "optim.warmup_steps=5", "optim.total_steps=100", "log.progress_interval_steps=1",
        "run.threads=1", "run.device=cpu", f"run.max_samples={16 * STEPS}", "dist.backend=gloo",
        "run.seed=12345"]  # explicit: a resumed run is compared with an uninterrupted one


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory) -> Path:
    from bert import demo_data

    root = tmp_path_factory.mktemp("resume_data")
    demo_data.generate(root, train_samples=160, eval_samples=100, seed=3, seq_len=64, max_pred=10, vocab=128,
                       layout="variable", shards=4)
    return root


def launch(data: Path, out: Path, *extra: str, world: int = WORLD) -> list[subprocess.Popen]:
    """``world`` ranks of ``python -m bert.train``, each its own process (rank r's output in
    out/rank<r>.out), rendezvous through the env as torchrun would set it."""
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    args = [*TINY, f"data.train_dir={data / 'train'}", f"data.eval_dir={data / 'eval'}", f"log.output_dir={out}",
            f"run.save_checkpoint={out / 'final.pt'}", *extra]
    procs = []
    for r in range(world):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        with open(out / f"rank{r}.out", "a") as f:
            procs.append(subprocess.Popen([sys.executable, "-m", "bert.train", *args], cwd=PKG, env=env,
                                          stdout=f, stderr=subprocess.STDOUT))
    return procs


def wait_all(procs: list[subprocess.Popen], out: Path, timeout: float = 120) -> list[int]:
    try:
        return [p.wait(timeout=timeout) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise AssertionError(f"ranks hung; rank 0 said:\n{(out / 'rank0.out').read_text()[-3000:]}") from None


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


def checkpoints(out: Path) -> list[Path]:
    d = out / "checkpoints"
    return sorted(d.glob("step_*")) if d.is_dir() else []


def no_partial_files(out: Path) -> list[Path]:
    return [p for p in out.rglob("*") if p.name.endswith((".part", ".tmp"))]


@pytest.fixture(scope="module")
def baseline(tiny_data, tmp_path_factory) -> Path:
    """The uninterrupted run (it checkpoints too: writing one must not perturb anything)."""
    out = tmp_path_factory.mktemp("baseline")
    rcs = wait_all(launch(tiny_data, out, "ckpt.interval_steps=2"), out)
    assert rcs == [1, 1], (out / "rank0.out").read_text()[-3000:]  # aborted at the sample limit
    return out


def test_kill9_then_resume_matches_uninterrupted_run(tiny_data, baseline, tmp_path):
    # A random checkpointed step, early enough; the seed is in every failure message, and
    # KILL_SEED=<seed> in the environment replays that kill point.
    seed = int(os.environ.get("KILL_SEED", random.SystemRandom().randrange(2**32)))
    k = 2 * random.Random(seed).randint(1, STEPS // 2 - 4)
    at = f"killed after checkpoint {k} (KILL_SEED={seed} replays it)"
    procs = launch(tiny_data, tmp_path, "ckpt.interval_steps=2", "ckpt.keep=3")
    wait_for(lambda: (tmp_path / "checkpoints" / f"step_{k:09d}").is_dir(), procs, f"checkpoint {k} ({at})")
    for p in procs:
        p.send_signal(signal.SIGKILL)
    assert [p.wait() for p in procs] == [-signal.SIGKILL] * WORLD, at
    assert not (tmp_path / "final.pt").exists(), at
    assert 1 <= len(checkpoints(tmp_path)) <= 4, at  # the last K kept (K+1 if killed before pruning)

    rcs = wait_all(launch(tiny_data, tmp_path, "ckpt.interval_steps=2", "ckpt.keep=3"), tmp_path)
    said = (tmp_path / "rank0.out").read_text()
    assert rcs == [1, 1], f"{at}\n{said[-3000:]}"
    assert "resumed from" in said, at
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
    procs = launch(tiny_data, tmp_path, "ckpt.poll_steps=2")
    # rank 1 only: rank 0 must learn of it through the poll and stop at the same step
    wait_for(lambda: "step      5 |" in (tmp_path / "rank0.out").read_text(), procs, "step 5")
    procs[1].send_signal(signal.SIGTERM)
    rcs = wait_all(procs, tmp_path)
    said = (tmp_path / "rank0.out").read_text()
    assert rcs == [3, 3], said[-3000:]  # 3 = stopped by a signal after a checkpoint
    assert "stopped by signal" in said and "Traceback" not in said
    (ckpt,) = checkpoints(tmp_path)
    assert (ckpt / "meta.json").is_file() and not (tmp_path / "final.pt").exists()
    stops = [e for e in mllog_events(tmp_path / "result_0.txt") if e["key"] == "run_stop"]
    assert [s["metadata"]["status"] for s in stops] == ["aborted"]  # honest: no result

    rcs = wait_all(launch(tiny_data, tmp_path, "--resume"), tmp_path)
    assert rcs == [1, 1], (tmp_path / "rank0.out").read_text()[-3000:]
    assert_same_weights(tmp_path / "final.pt", baseline / "final.pt")
    assert accuracies(tmp_path / "result_0.txt") == accuracies(baseline / "result_0.txt")
    assert (tmp_path / "checkpoints" / "finished.json").is_file()


def test_resume_require_without_checkpoint_fails(tiny_data, tmp_path):
    rcs = wait_all(launch(tiny_data, tmp_path, "--resume", world=1), tmp_path)
    assert rcs == [2]
    assert "holds no complete checkpoint" in (tmp_path / "rank0.out").read_text()


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


def test_persistent_nan_loss_aborts(tiny_data, tmp_path):
    from bert import train
    from bert.config import build_config, parse_overrides
    from bert.model import BertForPreTraining

    args = [*TINY, f"data.train_dir={tiny_data / 'train'}", f"data.eval_dir={tiny_data / 'eval'}",
            f"log.output_dir={tmp_path}", "run.max_nonfinite_steps=3"]
    model = BertForPreTraining(build_config(parse_overrides(args)).model, "cpu")
    state = model.state_dict()
    for k in ("cls.predictions.bias", "cls.predictions.decoder.bias"):  # one tied parameter
        state[k] = torch.full_like(state[k], float("nan"))
    torch.save(state, tmp_path / "nan.pt")
    assert train.main([*args, f"run.init_checkpoint={tmp_path / 'nan.pt'}"]) == 1
    events = mllog_events(tmp_path / "result_0.txt")
    by_key = {e["key"]: e for e in events}
    assert by_key["run_stop"]["metadata"]["status"] == "aborted"
    assert by_key["nonfinite_loss_steps"]["value"] == 3  # noticed at the first progress line past 3
    assert "eval_accuracy" not in by_key


def test_resume_with_another_world_size_is_refused(tiny_data, baseline, tmp_path, capsys):
    import shutil

    from bert import train

    ckpt_dir = tmp_path / "ckpts"
    shutil.copytree(baseline / "checkpoints", ckpt_dir)
    (ckpt_dir / "finished.json").unlink()  # make it look preempted
    args = [*TINY, f"data.train_dir={tiny_data / 'train'}", f"data.eval_dir={tiny_data / 'eval'}",
            f"log.output_dir={tmp_path / 'out'}", f"ckpt.dir={ckpt_dir}"]
    assert train.main(args) == 2
    assert "written with world_size=2, this run has 1" in capsys.readouterr().err
    assert train.main([*args, "ckpt.resume=off"]) == 2  # a fresh start would mix with them
    assert "holds checkpoints of an unfinished run" in capsys.readouterr().err


def test_resume_with_another_vocabulary_padding_is_refused(tiny_data, tmp_path):
    """The state dict keeps vocab_size rows whatever model.vocab_pad_multiple is, but the
    optimizer's moments have the padded shape: a resume across a padding change is refused
    by name, before anything is loaded (torch's load_state_dict would take the moments)."""
    from bert import resume, train
    from bert.config import build_config
    from bert.distributed import DistEnv

    single = DistEnv(rank=0, world_size=1, local_rank=0, master_addr="127.0.0.1", master_port=29500,
                     launcher="single")
    over = dict(a.split("=", 1) for a in TINY if not a.startswith(("dist.", "run.max_samples")))
    over.update({"data.train_dir": str(tiny_data / "train"), "data.eval_dir": str(tiny_data / "eval"),
                 "model.vocab_pad_multiple": "1"})
    parts, _ = train.build(build_config(over), single, torch.device("cpu"))
    state = train.TrainState()
    train.train_step(parts, 1)  # the optimizer's moments exist
    cfg = build_config(over)
    ckpt = resume.Checkpointer(cfg.ckpt, tmp_path, 0, 1, torch.device("cpu"), resume.StopFlag())
    saved = ckpt.save(parts, state)
    padded, _ = train.build(build_config({**over, "model.vocab_pad_multiple": "256"}), single, torch.device("cpu"))
    before = {k: v.clone() for k, v in padded.model.state_dict().items()}
    with pytest.raises(resume.CheckpointError, match=r"optimizer state 'exp_avg' of a \(256, 32\) parameter has "
                                                     r"shape \(128, 32\).*model.vocab_pad_multiple"):
        resume.restore(saved, padded, train.TrainState(), 0, 1)
    assert all(torch.equal(v, before[k]) for k, v in padded.model.state_dict().items())  # nothing loaded
    resume.restore(saved, parts, train.TrainState(), 0, 1)  # the same padding resumes
