"""Helpers of test_checkpoint.py's unit and integration tests (and of other test files that import them)."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from bert.mlperf_log import read_events
from conftest import PKG, free_port, hold_env


WORLD = 2


STEPS = 24  # global batch 16; the 4 x 40-sample shards give each rank 80 per epoch: 5 steps each


TINY = ["model.vocab_size=128", "model.hidden_size=32", "model.num_layers=1", "model.num_heads=2",
        "model.intermediate_size=64", "model.max_position_embeddings=64", "model.hidden_dropout=0.1",
        "model.attention_dropout=0.1", "data.max_seq_length=64", "data.max_predictions_per_seq=10",
        "data.eval_samples=100", "eval.batch_size=100", "eval.interval_samples=64", "run.local_batch_size=8",
        "optim.lr=2e-3", "optim.warmup_steps=5", "optim.total_steps=100", "log.progress_interval_steps=1",
        "run.threads=1", "run.device=cpu", f"run.max_samples={16 * STEPS}", "dist.backend=gloo",
        "run.seed=12345"]  # explicit: a resumed run is compared with an uninterrupted one
# A run with no end before the test stops it: no sample limit, and a schedule whose rate does
# not reach zero (a run also ends where its rate stays 0: bert.config.run_end).
ENDLESS = (f"run.max_samples={10**12}", f"optim.total_steps={10**9}")


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory) -> Path:
    from bert import demo_data

    root = tmp_path_factory.mktemp("resume_data")
    demo_data.generate(root, train_samples=160, eval_samples=100, seed=3, seq_len=64, max_pred=10, vocab=128,
                       layout="variable", shards=4)
    return root


def train_args(data: Path, out: Path, *extra: str) -> list[str]:
    return [*TINY, f"data.train_dir={data / 'train'}", f"data.eval_dir={data / 'eval'}", f"log.output_dir={out}",
            f"run.save_checkpoint={out / 'final.pt'}", *extra]


def _file_size_limit(nbytes: int):
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))


def launch(data: Path, out: Path, *extra: str, world: int = WORLD, file_limit: dict[int, int] | None = None,
           hold: tuple[str, ...] = (), said: Path | None = None) -> list[subprocess.Popen]:
    """``world`` ranks of ``python -m bert.train``, each its own process (rank r's output in
    out/rank<r>.out), rendezvous through the env as torchrun would set it. ``file_limit``:
    rank -> the largest file it may write (RLIMIT_FSIZE). ``hold``: points where a rank waits
    for the test's fault (hold_env). ``said``: where the rank outputs go instead of ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    said = said or out
    said.mkdir(parents=True, exist_ok=True)
    port = free_port()
    args = train_args(data, out, *extra)
    procs = []
    for r in range(world):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1", **hold_env(out, *hold))
        limit = (file_limit or {}).get(r)
        with open(said / f"rank{r}.out", "a") as f:
            procs.append(subprocess.Popen([sys.executable, "-m", "bert.train", *args], cwd=PKG, env=env,
                                          stdout=f, stderr=subprocess.STDOUT,
                                          preexec_fn=_file_size_limit(limit) if limit else None))
    return procs


def wait_all(procs: list[subprocess.Popen], out: Path, timeout: float = 120) -> list[int]:
    try:
        return [p.wait(timeout=timeout) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise AssertionError(f"ranks hung; rank 0 said:\n{(out / 'rank0.out').read_text()[-3000:]}") from None


def checkpoints(out: Path) -> list[Path]:
    d = out / "checkpoints"
    return sorted(d.glob("step_*")) if d.is_dir() else []


def no_partial_files(out: Path) -> list[Path]:
    return [p for p in out.rglob("*") if p.name.endswith((".part", ".tmp"))]


def rank_output(out: Path, rank: int = 0) -> str:
    return (out / f"rank{rank}.out").read_text()


def last_event(log: Path) -> dict:
    return read_events(log)[-1]


def _run_and_time_env(data: Path, out: Path, path: str, *extra: str) -> dict[str, str]:
    """run_and_time.sh under torchrun with the arguments ``launch`` gives its ranks."""
    env = {k: v for k, v in os.environ.items() if k not in ("SEED", "RANK", "WORLD_SIZE", "MASTER_PORT")}
    env.update(PATH=path, DGXSYSTEM="CPU_1x2", DGXNGPU=str(WORLD), LOGDIR=str(out),
               EXTRA_PARAMS=" ".join(train_args(data, out, "ckpt.interval_steps=2", *extra)))
    return env


WRITE_FAILED = 5
