"""What the TensorBoard curves (log.tensorboard_dir, bert/curves.py) cost the loop: the demo
config (config_CPU_1x2.sh: 2 CPU ranks, torchrun, gloo) through run_and_time.sh, with and
without TENSORBOARD_DIR, interleaved, the same seed and steps each time.

    python bench/curves_overhead.py --data DIR [--reps 3] [--samples 12800] [--out curves.json]
    python bench/curves_overhead.py --data DIR --reps 1 --only on --extra "DIVISION=open sampler.deal=snake"
    python bench/curves_overhead.py --data DIR --counts     # the count and the poll alone

DIR: the demo data (``python -m bert.demo_data``, as demo.sh makes it in build/demo_data).
Per run: the training throughput of each eval block as the MLPerf log records it
(``tracked_stats``: samples over the block's training time, evaluations excluded) and the
CPU seconds of the whole run (the children's rusage: start-up, evaluations and the writer
included), and the load average at its start; with the curves on, the busiest-over-mean
token ratio of every step read back from the event files (its mean, 95th percentile, max).
``--extra``: VAR=value launcher variables and key=value overrides added to every run (e.g. a
sampler, to see its imbalance curve). Prints a line a run; writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(PKG))
from bert import config_script  # noqa: E402
from bert.mlperf_log import read_events  # noqa: E402


def count_cost(data: Path, batches: int = 50, reps: int = 20) -> list[float]:
    """CPU microseconds of ``curves.batch_counts`` per micro-batch of the demo's training
    stream (rank 0 of 2, its layout), one thread, three measurements."""
    import torch

    from bert import curves, loader
    from bert.config import build_config, launcher_overrides

    torch.set_num_threads(1)
    script = config_script.source(PKG / "config_CPU_1x2.sh", {"PATH": os.environ["PATH"]})
    cfg = build_config(launcher_overrides({**script, "DATADIR": str(data / "train"), "EVALDIR": str(data / "eval")}))
    plan = loader.BatchPlan.training(cfg.data, cfg.sampler, cfg.model, local_batch=cfg.run.local_batch_size, world_size=2)
    stream = loader.train_batches(data=cfg.data, sampler=cfg.sampler, model=cfg.model, plan=plan, seed=1, rank=0,
                                  world_size=2)
    sample = [next(stream) for _ in range(batches)]
    out = []
    for _ in range(3):
        t = time.process_time()
        for _ in range(reps):
            for b in sample:
                curves.batch_counts(b)
        out.append((time.process_time() - t) / (reps * batches) * 1e6)
    return out


def poll_cost(data: Path, polls: int = 200) -> list[float]:
    """CPU microseconds of one ``Curves.progress`` on rank 0 of one process (no gather to
    wait for): the interval's counts (the demo's 25 steps) summed and its ~35 scalars handed
    to TensorBoard's writer thread; three measurements."""
    from bert import curves
    from bert.config import ModelConfig

    model = ModelConfig(vocab_size=128, hidden_size=128, num_layers=2, num_heads=4, intermediate_size=512)
    counts = [(32, 2050, 160000, 300)] * 25
    out = []
    with tempfile.TemporaryDirectory() as tb:
        c = curves.Curves(tb, model=model, rank=0, world_size=1, accum=1, peak_flops_per_s=1e12, start_step=0,
                          start_samples=0)
        values = {"loss": 2.0, "learning_rate": 1e-3, "loss_scale": 1.0, "skipped_steps": 0.0, "grad_norm": 1.0}
        for _ in range(3):
            t = time.process_time()
            for i in range(polls):
                c.counted = curves.Counted(iter(()))
                c.counted.counts = list(counts)
                c.progress(25 * (i + 1), values, 400.0)
            out.append((time.process_time() - t) / polls * 1e6)
        c.close()
    return out


def balance(tb: Path) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb), size_guidance={"scalars": 0})
    acc.Reload()
    v = sorted(e.value for e in acc.Scalars("balance/busiest_over_mean_tokens"))
    return {"steps": len(v), "mean": statistics.mean(v), "p95": v[int(0.95 * (len(v) - 1))], "max": v[-1]}


def one_run(data: Path, samples: int, tb: bool, work: Path, seed: int, extra: list[str]) -> dict:
    script = config_script.source(PKG / "config_CPU_1x2.sh", {"PATH": os.environ["PATH"]})
    env = dict(os.environ, **{k: v for k, v in script.items() if k != "PATH"})
    logdir = Path(tempfile.mkdtemp(dir=work))
    env.update(DATADIR=str(data / "train"), EVALDIR=str(data / "eval"), LOGDIR=str(logdir), SEED=str(seed),
               MAX_SAMPLES_TERMINATION=str(samples), EVAL_ITER_SAMPLES=str(samples // 2), TARGET_MLM_ACCURACY="1.0")
    for word in extra:
        key, _, value = word.partition("=")
        if key.isupper():
            env[key] = value
        else:
            env["EXTRA_PARAMS"] = f"{env.get('EXTRA_PARAMS', '')} {word}"
    if tb:
        env["TENSORBOARD_DIR"] = str(logdir / "tb")
    load = os.getloadavg()[0]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    r = subprocess.run(["./run_and_time.sh"], cwd=PKG, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode not in (0, 1):  # 1: the (unreachable) target not reached, as asked
        raise SystemExit(f"run failed ({r.returncode}): {(r.stdout + r.stderr)[-2000:]}")
    events = read_events(logdir / env.get("LOGFILE", "result_0.txt"))
    blocks = [e["value"]["throughput"] for e in events if e["key"] == "tracked_stats"]
    global_batch = int(env["BATCHSIZE"]) * int(env["DGXNGPU"]) * int(env.get("GRADIENT_STEPS") or 1)
    return {"tensorboard": tb, "samples_per_s_blocks": blocks, "global_batch": global_batch,
            "cpu_s": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), "wall_s": wall,
            "load_average": load, "balance": balance(logdir / "tb") if tb else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, type=Path)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--samples", type=int, default=12800, help="samples per run (the demo's global batch: 64)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--out", type=Path, default=Path("curves_overhead.json"))
    ap.add_argument("--only", choices=["on", "off"], help="only runs with the curves on (or off)")
    ap.add_argument("--extra", default="", help="VAR=value and key=value words added to every run")
    ap.add_argument("--counts", action="store_true", help="only the cost of a count and of a poll")
    a = ap.parse_args(argv)
    if not (a.data / "train").is_dir() or not (a.data / "eval").is_dir():
        print(f"curves_overhead: --data {a.data} has no train/ and eval/ (python -m bert.demo_data makes them)",
              file=sys.stderr)
        return 2
    if a.counts:
        us, poll = count_cost(a.data), poll_cost(a.data)
        print(f"curves.batch_counts: {', '.join(f'{x:.1f}' for x in us)} CPU-us per micro-batch; "
              f"Curves.progress: {', '.join(f'{x:.0f}' for x in poll)} CPU-us per poll (one process)")
        a.out.write_text(json.dumps({"batch_counts_cpu_us": us, "progress_cpu_us": poll}, indent=1))
        return 0
    runs = []
    with tempfile.TemporaryDirectory() as work:
        for i in range(a.reps):
            for tb in ((False, True) if i % 2 == 0 else (True, False)):  # order alternates
                if a.only and tb != (a.only == "on"):
                    continue
                runs.append(one_run(a.data, a.samples, tb, Path(work), a.seed, a.extra.split()))
                r = runs[-1]
                b = r["balance"]
                print(f"rep {i} tensorboard={'on ' if tb else 'off'}: "
                      f"{', '.join(f'{x:.1f}' for x in r['samples_per_s_blocks'])} samples/s per block, "
                      f"{r['cpu_s']:.1f} CPU-s, {r['wall_s']:.1f} s, load {r['load_average']:.1f}"
                      + (f"; busiest/mean tokens over {b['steps']} steps: mean {b['mean']:.3f}, p95 {b['p95']:.3f}, "
                         f"max {b['max']:.3f}" if b else ""), flush=True)
    summary = {}
    for tb in (False, True):
        mine = [r for r in runs if r["tensorboard"] == tb]
        if not mine:
            continue
        rates = [statistics.mean(r["samples_per_s_blocks"]) for r in mine]
        steps = [statistics.mean(r["samples_per_s_blocks"]) / r["global_batch"] for r in mine]
        summary["on" if tb else "off"] = {"median_samples_per_s": statistics.median(rates),
                                          "median_steps_per_s": statistics.median(steps),
                                          "median_cpu_s": statistics.median(r["cpu_s"] for r in mine)}
    if len(summary) == 2:
        on, off = summary["on"], summary["off"]
        print(f"steps/s median: off {off['median_steps_per_s']:.3f}, on {on['median_steps_per_s']:.3f} "
              f"({on['median_steps_per_s'] / off['median_steps_per_s'] - 1:+.1%}); CPU-s median: off "
              f"{off['median_cpu_s']:.1f}, on {on['median_cpu_s']:.1f}")
    a.out.write_text(json.dumps({"runs": runs, "summary": summary, "samples": a.samples, "reps": a.reps,
                                 "extra": a.extra}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
