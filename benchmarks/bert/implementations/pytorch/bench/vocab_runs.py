"""The vocab step run after run: ``python -m input_preprocessing vocab`` on one corpus, its wall
time and the bytes it wrote, for this tree and another checkout (``--old``), interleaved.

    python bench/vocab_runs.py --input TEXT_DIR --old TREE [--size 8000] [--reps 5] [--out X.json]

TREE: another checkout's implementation directory (this one's, at the commit to compare with),
run by the same interpreter. Per repetition, each side once in a fresh process, the order
alternating (new then old, then old then new). Printed and written (JSON, ``--out``): each
run's wall seconds and md5, the ratio new/old of each repetition and their median, and how many
different files each side wrote.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common, provenance  # noqa: E402

PKG = Path(__file__).resolve().parent.parent


def run_vocab(tree: Path, text: Path, out: Path, size: int) -> tuple[float, str]:
    """Wall seconds of the step in a fresh process from ``tree`` (start-up included: what a user
    waits), and the md5 of the vocab.txt it wrote."""
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "input_preprocessing", "vocab", "--input", str(text), "--output",
                        str(out), "--size", str(size)], cwd=tree, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if r.returncode:
        raise SystemExit(f"{tree}: the vocab step failed:\n{r.stderr[-2000:]}")
    return wall, hashlib.md5(out.read_bytes()).hexdigest()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", required=True, help="the corpus: a directory of text parts")
    ap.add_argument("--old", required=True, help="the other checkout's implementation directory")
    ap.add_argument("--size", type=int, default=8000)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    sides = {"new": PKG, "old": Path(a.old).resolve()}
    runs: dict[str, list[dict]] = {"new": [], "old": []}
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="vocab_runs_") as tmp:
        for rep in range(a.reps):
            for side in (("new", "old") if rep % 2 == 0 else ("old", "new")):
                wall, md5 = run_vocab(sides[side], Path(a.input), Path(tmp) / f"{side}{rep}.txt", a.size)
                runs[side].append({"wall_s": wall, "md5": md5})
                print(f"rep {rep} {side}: {wall:6.2f} s  {md5}", flush=True)
    ratios = [n["wall_s"] / o["wall_s"] for n, o in zip(runs["new"], runs["old"])]
    result = {"benchmark": "vocab step, run after run", "commit": provenance.git_commit()[0], "old": str(sides["old"]),
              "input": a.input, "input_bytes": sum(f.stat().st_size for f in Path(a.input).iterdir() if f.is_file()),
              "size": a.size, "reps": a.reps, "machine": common.machine(), "load_average_before": load_before,
              "load_average_after": os.getloadavg(), "runs": runs, "ratio_new_over_old": ratios,
              "median_ratio": statistics.median(ratios),
              "median_wall_s": {s: statistics.median(r["wall_s"] for r in runs[s]) for s in runs},
              "different_files": {s: len({r["md5"] for r in runs[s]}) for s in runs}}
    print(f"median wall: new {result['median_wall_s']['new']:.2f} s, old {result['median_wall_s']['old']:.2f} s; "
          f"new/old per repetition {', '.join(f'{r:.2f}' for r in ratios)}, median {result['median_ratio']:.2f}; "
          f"different files in {a.reps} runs: new {result['different_files']['new']}, "
          f"old {result['different_files']['old']}")
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
