"""TensorBoard curves of a real run (bert/curves.py): two torchrun ranks through
run_and_time.sh with TENSORBOARD_DIR, stopped by SIGUSR1 at the first poll and resumed, then
a ``tensorboard`` server started on 127.0.0.1 whose HTTP scalars endpoint returns the
series (and drops the points an interrupted run wrote past its checkpoint). The event-file
checks in one process: tests/unit/test_curves.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from bert import curves
from bert.config import ModelConfig
from conftest import PKG, free_port, run_and_time_signalled


def _two_rank_env(demo_data, logdir: Path, tb: Path) -> dict[str, str]:
    env = dict(os.environ, **demo_data.env)
    env.update(PATH=demo_data.path, DATADIR=str(demo_data.train), EVALDIR=str(demo_data.eval), LOGDIR=str(logdir),
               TENSORBOARD_DIR=str(tb), SEED="5", EVAL_ITER_SAMPLES="320", MAX_SAMPLES_TERMINATION="640",
               EXTRA_PARAMS="data.eval_samples=500 log.progress_interval_steps=5"
               " ckpt.poll_steps=5 optim.max_grad_norm=1.0")
    return env


def _serve(logdir: Path, load_fast: str = "auto"):
    """``tensorboard`` on a free port of 127.0.0.1; ``load_fast``: its Rust data server
    ("auto", the default where its wheel has one) or the Python loader ("false")."""
    port = free_port()
    tb = Path(sys.executable).parent / "tensorboard"
    proc = subprocess.Popen([str(tb), "--logdir", str(logdir), "--host", "127.0.0.1", "--port", str(port),
                             "--reload_interval", "1", f"--load_fast={load_fast}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    return proc, f"http://127.0.0.1:{port}"


def _scalars(base: str, run: str, tag: str, proc, timeout_s: float = 90) -> list[tuple[int, float]]:
    """[(step, value)] of ``run``'s ``tag`` from the server's scalars endpoint, once it has loaded."""
    url = f"{base}/data/plugin/scalars/scalars?" + urllib.parse.urlencode({"run": run, "tag": tag})
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                rows = json.loads(r.read())
            if rows:
                return [(step, value) for _, step, value in rows]
        except (urllib.error.URLError, ConnectionError):
            pass
        assert time.monotonic() < deadline, f"no {tag} from {url} in {timeout_s} s"
        time.sleep(0.5)


def _stop(proc) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def test_two_ranks_resumed_and_the_server_returns_the_curves(demo_data, tmp_path):
    tb = tmp_path / "tb"
    env = _two_rank_env(demo_data, tmp_path, tb)
    rc, first = run_and_time_signalled(env)  # SIGUSR1 before the ranks start: checkpoint and stop at step 5
    assert rc == 3 and "stopped by signal 10 after step 5" in first, first[-3000:]
    r = subprocess.run(["./run_and_time.sh"], cwd=PKG, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "resumed from" in r.stdout, (r.stdout + r.stderr)[-3000:]  # no target: 1
    proc, base = _serve(tb)
    try:
        assert [s for s, _ in _scalars(base, ".", "train/loss", proc)] == [5, 10]
        balance = _scalars(base, ".", "balance/busiest_over_mean_tokens", proc)
        assert [s for s, _ in balance] == list(range(1, 11))  # every step, both runs, once
        # two ranks drawing variable-length samples at random: never below 1, not always 1
        assert all(1.0 <= v < 2.0 for _, v in balance) and any(v > 1.0 for _, v in balance), balance
        assert [s for s, _ in _scalars(base, ".", "eval/mlm_accuracy", proc)] == [5, 10]
        assert [s for s, _ in _scalars(base, "samples", "eval/mlm_accuracy", proc)] == [320, 640]
        assert all(v > 0 for _, v in _scalars(base, ".", "train/grad_norm", proc))
    finally:
        _stop(proc)


@pytest.mark.parametrize("load_fast", ["auto", "false"])
def test_the_server_drops_what_an_interrupted_run_wrote_past_its_checkpoint(tmp_path, load_fast):
    """Both loaders: the Python one keys on the resumed writer's purge_step; the Rust one also
    drops points when a step goes back."""
    model = ModelConfig(vocab_size=64, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    for start, stop, value in ((0, 30, 100.0), (20, 40, 200.0)):  # killed at 30, resumed from step 20
        c = curves.Curves(tmp_path, model=model, rank=0, world_size=1, accum=1, peak_flops_per_s=0.0,
                          start_step=start, start_samples=start * 2)
        for step in range(start + 5, stop + 1, 5):
            c.progress(step, {"loss": value + step}, 10.0)
        c.close()
    proc, base = _serve(tmp_path, load_fast)
    try:
        assert _scalars(base, ".", "train/loss", proc) == [(s, (100.0 if s <= 20 else 200.0) + s)
                                                          for s in range(5, 41, 5)]
    finally:
        _stop(proc)
