"""What the one guarded data road costs: the loader alone and the demo's steps, against the
code before it (a checkout given by --old), interleaved; and what refusing a directory that
holds a shard twice costs at start-up.

    python bench/data_road.py --data DIR --old TREE [--reps 5] [--batches 400] [--samples 9600]
    python bench/data_road.py --copies --data DIR [--shards 4320]

DIR: the demo data (``python -m bert.demo_data``) with ``DIR/strata`` made from its train/
(``python -m input_preprocessing stratify``) and an md5 list in both (``checksum``): what the
guards read. TREE: another checkout's implementation directory (this one's, at the commit
to compare with), run by the same interpreter.

``--data`` alone (with ``--old``): per repetition, old then new then new then old (the
order alternating), each in a fresh process:

- the loader alone: rank 0 of 2's training stream, ``--batches`` batches of the demo's 32
  samples (the first ones included: they hash every file they touch the first time), wall
  seconds and the process's CPU seconds, for the paper's road (stratified, snake deal, the
  strata directory) and the closed one (the shard order over the plain directory);
- the demo's steps: config_CPU_1x2.sh through the checkout's run_and_time.sh (2 ranks) on the
  paper's road, ``--samples`` samples in one eval block, the block's samples/s from the
  MLPerf log and the run's CPU seconds.

Every ratio new/old is printed and written (JSON, ``--out``). ``--copies``: the check's
seconds on DIR's directories and on ``--shards`` listed shards (a synthetic md5 list and
length index of the full set's size: 36,000 samples a shard, four strata files each).
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
ROADS = {"strata": ("strata", {"run.division": "open", "sampler.mode": "stratified", "sampler.deal": "snake",
                               "sampler.group_size": 2}),
         "closed": ("train", {})}


def loader_worker(tree: Path, data: Path, road: str, batches: int) -> dict:
    """In this process, from ``tree``'s bert: rank 0 of 2's stream over ``road``."""
    sys.path.insert(0, str(tree))
    import inspect

    import torch

    from bert import config_script, loader
    from bert.config import build_config, launcher_overrides

    torch.set_num_threads(1)
    script = config_script.source(tree / "config_CPU_1x2.sh", {"PATH": os.environ["PATH"]})
    kind, extra = ROADS[road]
    cfg = build_config({**launcher_overrides({**script, "DATADIR": str(data / kind), "EVALDIR": str(data / "eval")}),
                        **extra})
    if "plan" in inspect.signature(loader.train_batches).parameters:  # the one loader
        from bert.trainer import train_plan

        stream = loader.train_batches(data=cfg.data, sampler=cfg.sampler, model=cfg.model, plan=train_plan(cfg, 2),
                                      seed=1, rank=0, world_size=2)
    else:  # the two loaders before it
        stream = loader.train_batches(cfg.data, cfg.sampler, cfg.model, cfg.run.local_batch_size, 1, 0, 2)
    wall, cpu = time.perf_counter(), time.process_time()
    n = sum(len(next(stream)["nsp_labels"]) for _ in range(batches))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    stream.close()
    return {"samples": n, "wall_s": wall, "cpu_s": cpu, "samples_per_s": n / wall, "cpu_us_per_sample": cpu / n * 1e6}


def steps_run(tree: Path, data: Path, samples: int, work: Path) -> dict:
    """config_CPU_1x2.sh on the paper's road through ``tree``'s run_and_time.sh."""
    sys.path.insert(0, str(PKG))
    from bert import config_script
    from bert.mlperf_log import read_events

    script = config_script.source(tree / "config_CPU_1x2.sh", {"PATH": os.environ["PATH"]})
    env = dict(os.environ, **{k: v for k, v in script.items() if k != "PATH"})
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"  # torchrun: this interpreter's
    logdir = Path(tempfile.mkdtemp(dir=work))
    kind, extra = ROADS["strata"]
    env.update(DATADIR=str(data / kind), EVALDIR=str(data / "eval"), LOGDIR=str(logdir), SEED="7", DIVISION="open",
               MAX_SAMPLES_TERMINATION=str(samples), EVAL_ITER_SAMPLES=str(samples), TARGET_MLM_ACCURACY="1.0")
    # Appended to the user's overrides (a config before the one precedence put its own here).
    env["EXTRA_PARAMS"] = " ".join([env.get("EXTRA_PARAMS", ""), "data.eval_samples=0",
                                    *(f"{k}={v}" for k, v in extra.items() if k != "run.division")]).strip()
    before, load = resource.getrusage(resource.RUSAGE_CHILDREN), os.getloadavg()[0]
    r = subprocess.run(["./run_and_time.sh"], cwd=tree, env=env, capture_output=True, text=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if r.returncode not in (0, 1):
        raise SystemExit(f"{tree}: run failed ({r.returncode}): {(r.stdout + r.stderr)[-2000:]}")
    blocks = [e["value"]["throughput"] for e in read_events(logdir / "result_0.txt") if e["key"] == "tracked_stats"]
    return {"samples_per_s": blocks[-1], "cpu_s": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
            "load_average": load}


def _in_child(args: list[str]) -> dict:
    r = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"worker {args} failed: {r.stderr[-2000:]}")
    return json.loads(next(line for line in reversed(r.stdout.splitlines()) if line.startswith("{")))


def compare(data: Path, old: Path, reps: int, batches: int, samples: int) -> dict:
    trees = {"old": old.resolve(), "new": PKG}
    runs: dict[str, list[dict]] = {f"{what}_{v}": [] for what in ("loader_strata", "loader_closed", "steps")
                                   for v in trees}
    with tempfile.TemporaryDirectory() as work:
        for rep in range(reps):
            order = ["old", "new"] if rep % 2 == 0 else ["new", "old"]
            for v in order:
                for road in ROADS:
                    got = _in_child(["--worker", str(trees[v]), "--data", str(data), "--road", road,
                                     "--batches", str(batches)])
                    runs[f"loader_{road}_{v}"].append(got)
                    print(f"rep {rep} {v:3s} loader {road:6s}: {got['samples_per_s']:8.1f} samples/s, "
                          f"{got['cpu_us_per_sample']:6.1f} CPU-us/sample", flush=True)
            for v in order:
                got = steps_run(trees[v], data, samples, Path(work))
                runs[f"steps_{v}"].append(got)
                print(f"rep {rep} {v:3s} demo steps (stratified, snake): {got['samples_per_s']:7.1f} samples/s, "
                      f"{got['cpu_s']:6.1f} CPU-s, load {got['load_average']:.1f}", flush=True)
    ratios = {}
    for what, key in (("loader_strata", "samples_per_s"), ("loader_closed", "samples_per_s"),
                      ("steps", "samples_per_s"), ("loader_strata", "cpu_us_per_sample"),
                      ("loader_closed", "cpu_us_per_sample"), ("steps", "cpu_s")):
        pairs = [n[key] / o[key] for o, n in zip(runs[f"{what}_old"], runs[f"{what}_new"])]
        ratios[f"{what}.{key}"] = {"new_over_old": pairs, "median": statistics.median(pairs)}
        print(f"{what:14s} {key:18s} new/old: {', '.join(f'{x:.3f}' for x in pairs)} (median "
              f"{statistics.median(pairs):.3f})")
    return {"runs": runs, "ratios": ratios}


def copies(data: Path, shards: int) -> dict:
    """Seconds of ``check_copies`` on the demo's directories and on ``shards`` listed shards."""
    sys.path.insert(0, str(PKG))
    import numpy as np

    from bert.integrity import Manifest
    from bert.loader import check_copies
    from bert.reader import ShardReader
    from bert.sampler import LengthIndex
    from bert.shards import row_offsets

    def timed(fn, reps=5) -> float:
        best = float("inf")
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t)
        return best

    out = {}
    for kind in ("train", "strata"):
        root = data / kind
        reader = ShardReader(root, max_seq_length=None, bounds=None, verify_md5=True, timeout_s=60)
        index = LengthIndex.from_manifest(root) if kind == "strata" else None
        out[f"demo_{kind}"] = {"listed": len(reader.manifest.sums), "index_shards": len(index.paths) if index else 0,
                               "check_s": timed(lambda: check_copies(root, reader, index)),
                               "md5_list_read_s": timed(lambda: Manifest.find(root))}
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        lines = [f"{rng.bytes(16).hex()}  part_{i:05d}.hdf5" for i in range(shards)]
        (root / "md5sums.txt").write_text("\n".join(lines) + "\n")
        reader = ShardReader(root, max_seq_length=None, bounds=None, verify_md5=True, timeout_s=60)
        per = 36_000  # 156 M samples of the full set over its shards
        for name, n_files, size in (("plain", shards, per), ("strata", 4 * shards, per // 4)):
            sizes = rng.integers(size - size // 10, size + size // 10, n_files)
            index = LengthIndex([root / f"s{i}.hdf5" for i in range(n_files)],
                                rng.integers(20, 513, int(sizes.sum())).astype(np.uint16), row_offsets(sizes))
            out[f"listed_{shards}_{name}_index"] = {
                "listed": shards, "index_shards": n_files, "samples": int(sizes.sum()),
                "check_s": timed(lambda: check_copies(root, reader, index)),
                "md5_list_read_s": timed(lambda: Manifest.find(root)),
                "md5_list_check_s": timed(lambda: check_copies(root, reader, None))}
    for k, v in out.items():
        print(f"{k}: {v}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, type=Path)
    ap.add_argument("--old", type=Path, help="the implementation directory of the checkout to compare with")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--batches", type=int, default=400)
    ap.add_argument("--samples", type=int, default=9600, help="samples of each demo run (global batch 64)")
    ap.add_argument("--copies", action="store_true")
    ap.add_argument("--shards", type=int, default=4320)
    ap.add_argument("--out", type=Path, default=Path("data_road.json"))
    ap.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--road", choices=sorted(ROADS), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        print(json.dumps(loader_worker(a.worker, a.data, a.road, a.batches)), flush=True)
        # No interpreter teardown: either checkout's read ahead may still be in h5py, whose
        # teardown then prints or waits (what the stream does at a run's end is the trainer's).
        os._exit(0)
    if not all((a.data / k / "md5sums.txt").is_file() for k in ("train", "strata")) or not (a.data / "eval").is_dir():
        print(f"data_road: --data {a.data} needs train/ and strata/ with md5sums.txt, and eval/ (see --help)",
              file=sys.stderr)
        return 2
    if a.copies:
        result = {"copies": copies(a.data, a.shards)}
    elif a.old is None:
        print("data_road: --old TREE (the checkout to compare with) or --copies", file=sys.stderr)
        return 2
    else:
        result = compare(a.data, a.old, a.reps, a.batches, a.samples)
    result.update(argv=sys.argv[1:], load_average=os.getloadavg())
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
