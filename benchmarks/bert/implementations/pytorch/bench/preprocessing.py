"""Throughput of `create` (text -> pretraining examples), the expensive preprocessing step:
against the reference's own code on the same part, and over worker counts.

Side by side (``--reference-reps R``, default 3): one text part, with the benchmark's flags
(seq 512, 76 predictions, dupe factor ``--dupe-factor``, seed 12345) and one vocab, made R
times by each side in turn, CPU seconds of this process (``time.process_time``; interpreter
start-up and imports left out, as a run of 500 parts pays them once a worker):

- reference: Google's ``create_pretraining_data.py`` and ``tokenization.py`` (bert-tensorflow
  1.0.4, the algorithm of MLCommons' copies, run by ``bench/google_bert.py``), as its
  ``main`` runs them: ``FullTokenizer``, ``create_training_instances``,
  ``write_instance_to_example_files``, the last with a writer that keeps each example instead
  of TensorFlow's protobuf serialization and TFRecord file (not measured: there is no
  TensorFlow here), so the reference's real cost is higher than this;
- ours: ``create`` on a directory holding that part, its hdf5 file written.

Both outputs are compared example for example (``identical``). The part: the first of a
synthetic corpus (``--part-mb``), or ``--text`` (a part in the MLPerf format), or
``--wikiextractor`` (WikiExtractor output, such as the sample mlcommons/training ships in
``retired_benchmarks/bert/cleanup_scripts/sample_data/``: each ``<doc>`` a document, a line
per sentence cut at ". ", "! ", "? " before a capital, not the NLTK segmentation of MLPerf's
pipeline). The vocab: ``--vocab``, or one of ``--vocab-size`` trained on the text.

Over worker counts (``--workers``): ``create`` on the synthetic corpus of about ``--mb`` MB
(parts of ``--part-mb`` each); samples, seconds, samples/s overall and per core (samples over
the summed per-part compute time), text MB/s per core.

The guards (``guards``): what ``create`` does beside the reference's algorithm, each piece timed
alone on every part of that corpus (CPU seconds, fastest of 5): reading and hashing a part
(md5), looking up the md5 its shard was made from, registering the text's md5 (the same-text
refusal), recording it beside the shard, and once the [UNK] pre-flight over the first 64 KiB;
their sum against the CPU of the one-worker run, which includes them.

    flock /tmp/bench.lock python bench/preprocessing.py --mb 4 --workers 1 2 --out /tmp/prep_bench.json

Run from benchmarks/bert/implementations/pytorch with the venv active. Prints and writes JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import h5py  # noqa: E402
import numpy as np  # noqa: E402

from bench import google_bert  # noqa: E402
from input_preprocessing.create import CreateOptions, create, load_vocab  # noqa: E402
from input_preprocessing.toy_corpus import make_corpus  # noqa: E402
from input_preprocessing.wordpiece import train_vocab  # noqa: E402

FEATURES = ("input_ids", "input_mask", "segment_ids", "masked_lm_positions", "masked_lm_ids", "next_sentence_labels")


def from_wikiextractor(src: Path, dst: Path) -> Path:
    """WikiExtractor output -> the MLPerf text format (see the module's docstring)."""
    docs = []
    for body in re.findall(r"<doc[^>]*>\n(.*?)</doc>", src.read_text(encoding="utf-8"), re.S):
        sents = [s for para in body.split("\n") if para.strip()
                 for s in re.split(r"(?<=[.!?])\s+(?=[A-Z\"'(])", para.strip()) if s.strip()]
        if sents:
            docs.append("\n".join(sents))
    dst.write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    return dst


def reference_run(part: Path, vocab: Path, o: CreateOptions) -> tuple[float, dict[str, np.ndarray]]:
    """(CPU seconds, the examples) of the reference's main() on one part."""
    g = google_bert.load()
    cpd = g.create_pretraining_data
    gc.collect()  # the other side's garbage is not this side's cost
    t0 = time.process_time()
    tok = g.tokenization.FullTokenizer(str(vocab), do_lower_case=o.lowercase)
    inst = cpd.create_training_instances([str(part)], tok, o.max_seq_length, o.dupe_factor, o.short_seq_prob,
                                         o.masked_lm_prob, o.max_predictions_per_seq, random.Random(o.seed))
    cpd.write_instance_to_example_files(inst, tok, o.max_seq_length, o.max_predictions_per_seq, ["part"])
    seconds = time.process_time() - t0
    rows = [e.values() for e in g.written["part"]]
    return seconds, {k: np.array([r[k] for r in rows]).reshape(len(rows), -1) for k in FEATURES}


def our_run(part: Path, vocab: Path, o: CreateOptions, out: Path) -> tuple[float, dict[str, np.ndarray]]:
    shutil.rmtree(out, ignore_errors=True)
    gc.collect()
    t0 = time.process_time()
    create(part.parent, vocab, out, o, workers=1, pattern=part.name)
    seconds = time.process_time() - t0
    stem = part.name[:-4] if part.suffix == ".txt" else part.name
    with h5py.File(out / f"{stem}.hdf5") as f:
        return seconds, {k: f[k][()].reshape(len(f[k]), -1) for k in FEATURES}


def side_by_side(part: Path, vocab: Path, o: CreateOptions, reps: int, work: Path) -> dict:
    ours_s, ref_s, identical = [], [], True
    for _ in range(reps):  # in turn, so that a change in the machine's load falls on both
        s, ref = reference_run(part, vocab, o)
        ref_s.append(round(s, 3))
        s, got = our_run(part, vocab, o, work / "side_by_side")
        ours_s.append(round(s, 3))
        identical &= all(ref[k].shape == got[k].shape and bool((ref[k] == got[k]).all()) for k in FEATURES)
    return {"part": part.name, "part_mb": round(part.stat().st_size / 1e6, 3),
            "vocab_tokens": load_vocab(vocab).size, "examples": len(got["input_ids"]),
            "identical": identical, "reference_cpu_s": ref_s, "ours_cpu_s": ours_s,
            "speedup": round(min(ref_s) / min(ours_s), 2)}


def guards(files: list[Path], vocab: Path, work: Path, create_cpu_s: float) -> dict:
    """CPU seconds of each guard create adds, over every part of the corpus (see the docstring)."""
    from input_preprocessing import create as c
    from input_preprocessing.common import write_text

    v = load_vocab(vocab)
    claims = work / "claims"
    claims.mkdir()

    def best(f, reps: int = 5) -> float:
        out = []
        for _ in range(reps):
            t = time.process_time()
            f()
            out.append(time.process_time() - t)
        return min(out)

    per = {"read_and_md5": 0.0, "made_from": 0.0, "claim": 0.0, "record": 0.0}
    read_only = 0.0
    for i, f in enumerate(files):
        read_only += best(lambda: f.read_bytes())
        per["read_and_md5"] += best(lambda: c.read_part(f))
        per["made_from"] += best(lambda: c._made_from(work / "none.hdf5"))
        per["claim"] += best(lambda: c._claim(claims, f"{i:032x}", f), reps=1)
        per["record"] += best(lambda: write_text(work / ".sources" / f"{i}.md5", "0" * 32 + "\n"))
    per["md5_only"] = per.pop("read_and_md5") - read_only  # the read itself the reference does too
    preflight = best(lambda: c._preflight(files, v, CreateOptions(), 1.0))
    total = sum(per.values()) + preflight
    return {"parts": len(files), "cpu_s": {k: round(x, 5) for k, x in per.items()}, "preflight_cpu_s": round(preflight, 5),
            "guards_cpu_s": round(total, 4), "create_cpu_s_one_worker": round(create_cpu_s, 3),
            "share": round(total / create_cpu_s, 4)}


def commit() -> str:
    r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                       cwd=Path(__file__).resolve().parent)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
                           cwd=Path(__file__).resolve().parent).stdout.strip()
    return (r.stdout.strip() or "unknown") + ("+changes" if dirty else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=4.0, help="synthetic corpus size in MB (about)")
    ap.add_argument("--part-mb", type=float, default=0.5, help="size of one synthetic text part in MB (about)")
    ap.add_argument("--text", default="", help="the part to make side by side (MLPerf text format)")
    ap.add_argument("--wikiextractor", default="", help="the part to make side by side, from WikiExtractor output")
    ap.add_argument("--vocab", default="", help="vocab.txt (default: one trained on the text)")
    ap.add_argument("--vocab-size", type=int, default=8000)
    ap.add_argument("--dupe-factor", type=int, default=10)
    ap.add_argument("--reference-reps", type=int, default=3, help="runs of each side on one part (0: none)")
    ap.add_argument("--workers", type=int, nargs="*", default=[1, 2], help="worker counts for the corpus runs")
    ap.add_argument("--out", default="", help="write the JSON here too")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="prep_bench_"))
    try:
        parts = max(1, round(args.mb / args.part_mb))
        # ~ 2.3 kB of text per synthetic document (15 sentences of ~22 words on average)
        files = make_corpus(work / "text", parts=parts, docs_per_part=max(1, int(args.part_mb * 1e6 / 2300)), seed=0)
        mb = sum(f.stat().st_size for f in files) / 1e6
        opts = CreateOptions(dupe_factor=args.dupe_factor)
        result = {"benchmark": "create (text -> hdf5 pretraining examples)", "commit": commit(),
                  "options": opts.__dict__, "cpu": platform.processor() or platform.machine(),
                  "usable_cores": len(os.sched_getaffinity(0)), "load_average_before": os.getloadavg(),
                  "note": "shared machine: other jobs may run at the same time"}
        if args.reference_reps > 0:
            if args.wikiextractor:
                (work / "real").mkdir()
                part = from_wikiextractor(Path(args.wikiextractor), work / "real" / "part.txt")
            elif args.text:
                (work / "real").mkdir()
                part = Path(shutil.copy(args.text, work / "real" / "part.txt"))
            else:
                part = files[0]
            vocab = Path(args.vocab) if args.vocab else train_vocab([part], work / "side_vocab.txt", size=args.vocab_size)
            result["vs_reference"] = side_by_side(part, vocab, opts, args.reference_reps, work)
            print(json.dumps(result["vs_reference"]), flush=True)
        vocab = train_vocab(files, work / "vocab.txt", size=args.vocab_size)
        runs = []
        for w in args.workers:
            out = work / f"out_w{w}"
            cpu0 = time.process_time()
            s = create(work / "text", vocab, out, opts, workers=w)
            cpu = time.process_time() - cpu0  # all of it with one worker (in this process)
            busy_s = s["samples_written_now"] / s["samples_per_s_per_core"]
            runs.append({"workers": w, "samples": s["samples_written_now"], "tokens": s["tokens_written_now"],
                         "wall_s": s["wall_s"], "samples_per_s": s["samples_per_s"],
                         "samples_per_s_per_core": s["samples_per_s_per_core"],
                         "text_mb_per_s_per_core": round(mb / busy_s, 3),
                         **({"cpu_s": round(cpu, 3)} if w == 1 else {})})
            print(json.dumps(runs[-1]), flush=True)
        one = [r for r in runs if r["workers"] == 1]
        if one:
            result["guards"] = guards(files, vocab, work, one[0]["cpu_s"])
            print(json.dumps(result["guards"]), flush=True)
        result.update({"corpus_mb": round(mb, 2), "parts": parts, "vocab_size": args.vocab_size, "runs": runs,
                       "load_average_after": os.getloadavg()})
        print(json.dumps(result, indent=1))
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
