"""Throughput of `create` (text -> pretraining examples), the expensive preprocessing step.

Builds a synthetic corpus of about ``--mb`` MB in the MLPerf text format (parts of
``--part-mb`` each), trains a WordPiece vocab of ``--vocab-size`` on it, then runs
`create` with the benchmark's flags (seq 512, 76 predictions, dupe factor 10, seed 12345)
for each worker count given. Prints and writes JSON: samples, seconds, samples/s overall
and per core (samples over the summed per-part compute time), text MB/s per core.

    flock /tmp/bench.lock python bench/preprocessing.py --mb 4 --workers 1 2 --out /tmp/prep_bench.json

Run from benchmarks/bert/implementations/pytorch with the venv active.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from input_preprocessing.create import CreateOptions, create  # noqa: E402
from input_preprocessing.toy_corpus import make_corpus, train_vocab  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=4.0, help="corpus size in MB (about)")
    ap.add_argument("--part-mb", type=float, default=0.5, help="size of one text part in MB (about)")
    ap.add_argument("--vocab-size", type=int, default=8000)
    ap.add_argument("--dupe-factor", type=int, default=10)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--out", default="", help="write the JSON here too")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="prep_bench_"))
    try:
        parts = max(1, round(args.mb / args.part_mb))
        # ~ 2.3 kB of text per synthetic document (15 sentences of ~22 words on average)
        files = make_corpus(work / "text", parts=parts, docs_per_part=max(1, int(args.part_mb * 1e6 / 2300)), seed=0)
        mb = sum(f.stat().st_size for f in files) / 1e6
        vocab = train_vocab(files, work / "vocab.txt", size=args.vocab_size)
        opts = CreateOptions(dupe_factor=args.dupe_factor)
        runs = []
        for w in args.workers:
            out = work / f"out_w{w}"
            s = create(work / "text", vocab, out, opts, workers=w)
            busy_s = s["samples_written_now"] / s["samples_per_s_per_core"]
            runs.append({"workers": w, "samples": s["samples_written_now"], "tokens": s["tokens_written_now"],
                         "wall_s": s["wall_s"], "samples_per_s": s["samples_per_s"],
                         "samples_per_s_per_core": s["samples_per_s_per_core"],
                         "text_mb_per_s_per_core": round(mb / busy_s, 3)})
            print(json.dumps(runs[-1]), flush=True)
        result = {"benchmark": "create (text -> hdf5 pretraining examples)", "corpus_mb": round(mb, 2),
                  "parts": parts, "vocab_size": args.vocab_size, "options": opts.__dict__,
                  "cpu": platform.processor() or platform.machine(), "usable_cores": len(os.sched_getaffinity(0)),
                  "note": "shared machine: other jobs may run at the same time", "runs": runs}
        print(json.dumps(result, indent=1))
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
