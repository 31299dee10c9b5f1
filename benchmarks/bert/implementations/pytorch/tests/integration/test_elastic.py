"""A run continued on another number of ranks, through ``python -m bert.train`` with real gloo
peers, on every sampling road: a 2-rank run of 9 steps (checkpoints at 3, 6, 9; the sample
trace on) is the uninterrupted run; its step-3 checkpoint is resumed on 4 ranks (local batch
halved) to step 6 and that one on 2 ranks to step 9 (2 -> 4 -> 2), and on 1 rank with two
micro-steps a step (2 -> 1). Each resumed run says so and what it reseeded; its learning rate
and sample count at every step are the uninterrupted run's, its evaluations at the same
sample counts; on the id-based roads each step takes the uninterrupted run's samples, on the
shard-order road every sample of the epochs begun is taken once; and ``python -m bert.trace``
says what every run's trace says, from its config and MLPerf log alone. One run per hop and
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
from bert.trace import parts_of_log, read_trace, step_lines
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
            assert (f"resuming a run of {then} rank{'s' * (then > 1)} on {world}: its global batch 16 kept, the data stream continued"
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


CHAINS = [("2",), ("2", "2->4"), ("2", "2->4", "2->4->2"), ("2", "2->1")]


def _run_log(runs, chain, where: Path) -> Path:
    """The MLPerf log the chain's run would have, one run appending to the log it resumes (the
    hops ran in directories of their own), with the last hop's resolved config beside it."""
    where.mkdir(parents=True)
    (where / "result_0.txt").write_text("".join((runs[hop][2] / "result_0.txt").read_text() for hop in chain))
    shutil.copy(runs[chain[-1]][2] / "result_0_config.json", where / "result_0_config.json")
    return where / "result_0_config.json"


def test_the_step_command_says_what_the_trace_says(road, tmp_path):
    """``bert.trace`` from a run's resolved config (its seed) and its MLPerf log (each
    stretch's world size and batch split, the steps it resumed at): the trace's lines, every
    step of every chain of resumes; through the command line too, from a checkpoint's saved
    stream, and with each sample's text."""
    _, runs = road
    for chain in CHAINS:
        config = _run_log(runs, chain, tmp_path / "+".join(chain).replace(">", ""))
        cfg = build_config(load_file(config))
        parts = parts_of_log(config.with_name("result_0.txt"))
        assert [(p.first, p.ranks, p.local_batch, p.accum) for p in parts] == [
            (HOPS[h][3][1] if HOPS[h][3] else 0, *HOPS[h][:3]) for h in chain]
        for k in range(1, HOPS[chain[-1]][4] + 1):
            hop = [h for h in chain if (HOPS[h][3][1] if HOPS[h][3] else 0) < k][-1]  # the stretch that trained k
            trace = read_trace(runs[hop][2] / "trace")
            assert step_lines(cfg, parts, k) == [{"step": k, "rank": r, "samples": trace[k][r]}
                                                 for r in range(HOPS[hop][0])], (chain, k)

    def command(*args):
        said = subprocess.run([sys.executable, "-m", "bert.trace", *map(str, args)], cwd=PKG, capture_output=True,
                              text=True, timeout=120)
        assert said.returncode == 0, said.stderr
        return said.stdout.splitlines()

    config = tmp_path / "2+2-4+2-4-2" / "result_0_config.json"
    step5 = [{"step": 5, "rank": r, "samples": read_trace(runs["2->4"][2] / "trace")[5][r]} for r in range(4)]
    assert [json.loads(line) for line in command("--config", config, "--step", 5)] == step5  # the log beside it
    out = runs["2->4"][2]
    assert [json.loads(line) for line in command("--config", out / "result_0_config.json", "--world-size", 4,
                                                 "--checkpoint", out / "checkpoints" / "step_000000003",
                                                 "--step", 5)] == step5
    vocab = tmp_path / "vocab.txt"  # the tiny data's 128 ids, each its own word
    vocab.write_text("".join(f"w{i}\n" for i in range(128)))
    text = [line for line in command("--config", runs["2"][2] / "result_0_config.json", "--step", 2, "--vocab", vocab)
            if not line.startswith("{")]
    assert len(text) == 16 and all(re.fullmatch(r"rank [01] \S+\.hdf5 row \d+: w\d+( w\d+)*", t) for t in text), text
