"""A run continued on another number of ranks, through ``python -m bert.train`` with real gloo
peers, on every sampling road: a 2-rank run of 9 steps (checkpoints at 3, 6, 9; the sample
trace on) is the uninterrupted run; its step-3 checkpoint is resumed on 4 ranks (local batch
halved) to step 6 and that one on 2 ranks to step 9 (2 -> 4 -> 2), and on 1 rank with two
micro-steps a step (2 -> 1). Each resumed run says so and what it reseeded; its learning rate
and sample count at every step are the uninterrupted run's, its evaluations at the same
sample counts; on the id-based roads each step takes the uninterrupted run's samples, on the
shard-order road every sample of the epochs begun is taken once; and ``python -m bert.trace``
says what every run's trace says, from its config and checkpoint alone. One run per hop and
road (13 runs); the unit tier (tests/unit/test_stream.py) covers the roads' arithmetic in
more hops.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from bert.config import build_config, load_file
from bert.mlperf_log import read_events
from bert.trace import read_trace, step_lines, streams
from checkpoint_helpers import launch, wait_all
from conftest import PKG
from data_road_helpers import ROADS, road_data, tiny_data  # noqa: F401 - fixtures

pytestmark = pytest.mark.integration

HOPS = {  # name: (ranks, local batch, accumulation, the run it resumes and its step, last step)
    "2": (2, 8, 1, None, 9),
    "2->4": (4, 4, 1, ("2", 3), 6),
    "2->4->2": (2, 8, 1, ("2->4", 6), 9),
    "2->1": (1, 8, 2, ("2", 3), 9),
}
STEP_LINE = re.compile(r"step +(\d+) \| samples +(\d+) \| loss +\S+ \| lr (\S+)")


def _run(data: Path, road: str, out: Path, hop: str) -> tuple[list[int], str]:
    world, batch, accum, resumed, last = HOPS[hop]
    if resumed is not None:
        name, step = resumed
        (out / "checkpoints").mkdir(parents=True)
        shutil.copytree(out.parent / name / "checkpoints" / f"step_{step:09d}", out / "checkpoints" / f"step_{step:09d}")
    procs = launch(data, out, *ROADS[road][1], f"data.train_dir={data / ROADS[road][0]}",
                   f"run.local_batch_size={batch}", f"run.grad_accum_steps={accum}", f"log.sample_trace={out / 'trace'}",
                   "ckpt.interval_steps=3", "ckpt.keep=5", f"run.max_steps={last}", world=world)
    codes = wait_all(procs, out, timeout=240)
    return codes, (out / "rank0.out").read_text()


@pytest.fixture(scope="module", params=sorted(ROADS))
def road(request, road_data, tmp_path_factory):  # noqa: F811
    """Every hop's run on one road: {hop: (exit codes, rank 0's output, its output directory)}."""
    root = tmp_path_factory.mktemp(f"elastic_{request.param}")
    runs = {}
    for hop in HOPS:  # in order: each resumes one before it
        runs[hop] = (*_run(road_data, request.param, root / hop, hop), root / hop)
    return request.param, runs


def _steps(output: str) -> dict[int, tuple[int, str]]:
    return {int(m[1]): (int(m[2]), m[3]) for m in STEP_LINE.finditer(output)}


def _evals(out: Path) -> list[int]:
    return [e["metadata"]["epoch_num"] for e in read_events(out / "result_0.txt") if e["key"] == "eval_accuracy"]


def test_every_hop_continues_the_schedule_and_says_what_it_reseeded(road):
    _, runs = road
    for hop, (codes, output, out) in runs.items():
        assert set(codes) == {1}, (hop, output[-3000:])  # ended by run.max_steps short of the target
        world, _, _, resumed, last = HOPS[hop]
        if resumed is not None:
            then = HOPS[resumed[0]][0]
            assert (f"resuming a run of {then} ranks on {world}: its global batch 16 kept, the data stream continued"
                    f" (docs/faults.md says what each sampling road keeps); each rank's RNG streams (dropout, masking) "
                    "reseeded from (seed, step, rank)") in output
    whole = _steps(runs["2"][1])
    assert sorted(whole) == list(range(1, 10))
    for hop in ("2->4", "2->4->2", "2->1"):
        got = _steps(runs[hop][1])
        first = HOPS[hop][3][1] + 1
        assert sorted(got) == list(range(first, HOPS[hop][4] + 1))
        assert got == {k: whole[k] for k in got}, hop  # samples and learning rate, step by step
    # evaluations every 64 samples (steps 4 and 8 of 16 samples), whichever run trained them, and at each run's end
    for hop, (_, _, out) in runs.items():
        first, last = 16 * (HOPS[hop][3][1] if HOPS[hop][3] else 0), 16 * HOPS[hop][4]
        assert _evals(out) == sorted({x for x in (64, 128) if first < x <= last} | {last}), hop


def test_the_traces_show_nothing_skipped_or_repeated(road):
    name, runs = road
    traces = {hop: read_trace(out / "trace") for hop, (_, _, out) in runs.items()}
    whole = traces["2"]
    assert sorted(whole) == list(range(1, 10)) and all(len(whole[k]) == 2 for k in whole)

    def together(trace, k):
        return sorted(tuple(x) for samples in trace[k].values() for x in samples)

    chain = {k: together(traces["2" if k <= 3 else "2->4" if k <= 6 else "2->4->2"], k) for k in range(1, 10)}
    short = {k: together(traces["2" if k <= 3 else "2->1"], k) for k in range(1, 10)}
    assert all(len(chain[k]) == len(short[k]) == 16 for k in chain)
    if name != "shards":  # the id-based roads: each step the uninterrupted run's samples
        assert chain == short == {k: together(whole, k) for k in whole}
    else:  # 160 samples, 9 steps of 16: an epoch not yet ended anywhere, so nothing twice, 144 taken
        for taken in (chain, short):
            counts = Counter(x for k in taken for x in taken[k])
            assert len(counts) == 144 and set(counts.values()) == {1}


def test_the_step_command_says_what_the_trace_says(road):
    """``bert.trace`` from the run's resolved config (its seed, its world size), continued
    from the checkpoint a resumed run began at: the trace's lines, every step; once through
    the command line."""
    _, runs = road
    for hop, (_, _, out) in runs.items():
        world, _, _, resumed, last = HOPS[hop]
        cfg = build_config(load_file(out / "result_0_config.json"))
        start = None if resumed is None else out / "checkpoints" / f"step_{resumed[1]:09d}"
        ranks, done = streams(cfg, world, start)
        trace = read_trace(out / "trace")
        for k in range(done + 1, last + 1):
            assert step_lines(ranks, done, cfg, k) == [{"step": k, "rank": r, "samples": trace[k][r]}
                                                       for r in range(world)], (hop, k)
        for s in ranks:
            s.close()
    _, _, out = runs["2->4"]
    said = subprocess.run([sys.executable, "-m", "bert.trace", "--config", str(out / "result_0_config.json"),
                           "--checkpoint", str(out / "checkpoints" / "step_000000003"), "--step", "5"],
                          cwd=PKG, capture_output=True, text=True, timeout=120)
    assert said.returncode == 0, said.stderr
    assert [json.loads(line) for line in said.stdout.splitlines()] == [
        {"step": 5, "rank": r, "samples": read_trace(out / "trace")[5][r]} for r in range(4)]
    vocab = out / "vocab.txt"  # the tiny data's 128 ids, each its own word
    vocab.write_text("".join(f"w{i}\n" for i in range(128)))
    said = subprocess.run([sys.executable, "-m", "bert.trace", "--config", str(runs["2"][2] / "result_0_config.json"),
                           "--step", "2", "--vocab", str(vocab)], cwd=PKG, capture_output=True, text=True, timeout=120)
    assert said.returncode == 0, said.stderr
    text = [line for line in said.stdout.splitlines() if not line.startswith("{")]
    assert len(text) == 16 and all(re.fullmatch(r"rank [01] \S+\.hdf5 row \d+: w\d+( w\d+)*", t) for t in text), text
