"""What `check` costs with its copy search: time and peak memory on real directories, and the
memory of the copy index alone at the full MLPerf set's size.

Datasets (each checked with ``python -m input_preprocessing check ... --eval``, a process of its
own, ``--reps`` times; wall seconds and the peak resident memory of that process, from
``getrusage(RUSAGE_CHILDREN)``, which with ``--workers 1`` is everything check holds):

- ``--demo``: the demo data of ``make demo`` (8 shards of 2,500 samples at seq 128, 2,000 eval);
- ``--shards N --per-shard M``: N shards of M samples at seq 512 (the demo's generator, MLPerf's
  length histogram), and a 10,000-sample eval set;
- ``--dir DIR --eval-dir EVAL``: a directory of your own;
- ``--synthetic N``: N synthetic samples (``--per-shard`` a shard, fixed layout at ``--seq``,
  lengths from 34 up, [CLS] A [SEP] B [SEP] with two predictions: clean, no repeat), checked
  without ``--eval``, and a set of ``--baseline`` samples alike: the peak's growth between the two
  is what check holds per sample; ``--against PKG`` runs another checkout's check on the same
  sets too (its package directory, e.g. one ``git archive`` wrote), each set once a checkout.

Real text (``--corpora``): the synthetic corpus, the standard library's docstrings (held-out
documents apart, as ``make pretrain-demo`` splits them) and, with ``--wikiextractor FILE ...``,
WikiExtractor output (the last file held out), each made into training shards with ``create``
(seq 512 and 128, dupe factor 10) and an eval set (the held-out text, dupe factor 10 and 1,
``eval --or-fewer`` up to 10,000), then ``check --eval``: the chance repeats and matches of
real text (none should fail the check), the [UNK] rate of a vocab trained on the training text
(and of the same text with ``--cased`` against that uncased vocab), and how many eval samples a
MB of held-out text gives.

The index alone (``--index-samples N``): ``copies.KeyTable`` filled with N random keys (a few
repeated) in 4,320 shards, searched and every repeat confirmed (each sample's record stands
for its key: made again from its shard's seed when asked for), its peak memory traced by
``tracemalloc`` (numpy reports its arrays there), against the 8 bytes a sample of the keys
themselves; ``--index-copies`` again with every shard a copy of the first (the most repeats to
count and confirm).

    flock /tmp/bench.lock python bench/check_copies.py --demo --shards 100 --per-shard 5000 \\
        --index-samples 80000000 --index-copies --out check_copies.json
    flock /tmp/bench.lock python bench/check_copies.py --corpora --wikiextractor sample_data/wiki_0? \\
        --out check_corpora.json
    flock /tmp/bench.lock python bench/check_copies.py --synthetic 50000000 --baseline 2000000 \\
        --per-shard 100000 --seq 40 --against OLD/benchmarks/bert/implementations/pytorch --out check_50m.json

Run from benchmarks/bert/implementations/pytorch with the venv active. Prints and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from bert import demo_data  # noqa: E402
from input_preprocessing import copies  # noqa: E402

PKG = Path(__file__).resolve().parent.parent
IDS = ["--vocab-size", "30522", "--cls-id", str(demo_data.CLS), "--sep-id", str(demo_data.SEP),
       "--unk-id", str(demo_data.UNK)]


# A parent of its own per measurement: its children's peak is that check's alone (getrusage
# keeps the largest child ever waited for).
_PEAK = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:]); "
         "print('peak_kib', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); "
         "sys.exit(r.returncode)")


def run_check(train: Path, eval_dir: Path | None, ids: list[str], workers: int, pkg: Path = PKG) -> dict:
    """One check (``pkg``'s) in a fresh process: wall seconds, its peak RSS, what it found."""
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", _PEAK, sys.executable, "-m", "input_preprocessing", "check",
                        "--input", str(train), *ids, *(["--eval", str(eval_dir)] if eval_dir else []),
                        "--workers", str(workers)],
                       cwd=pkg, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    peak = int(r.stderr.rsplit("peak_kib", 1)[1])  # KiB
    out = json.loads(r.stdout) if r.stdout else {}
    return {"exit_status": r.returncode, "wall_s": round(wall, 2), "peak_rss_mib": round(peak / 1024, 1),
            "samples": out.get("samples"), "shards": out.get("shards"),
            "repeated_samples": out.get("copies", {}).get("repeated_samples"),
            "eval_in_training": out.get("eval", {}).get("in_training")}


def dataset(name: str, train: Path, eval_dir: Path, ids: list[str], reps: int, workers: int) -> dict:
    runs = [run_check(train, eval_dir, ids, workers) for _ in range(reps)]
    files = [p for p in train.rglob("*.hdf5")]
    res = {"dataset": name, "shards": len(files), "mb_on_disk": round(sum(p.stat().st_size for p in files) / 1e6, 1),
           "workers": workers, "runs": runs}
    print(json.dumps(res), flush=True)
    return res


def index_alone(samples: int, shards: int = 4320, every_shard_a_copy: bool = False) -> dict:
    """KeyTable's own memory at ``samples`` keys in ``shards`` shards, traced, its repeats
    confirmed; 100 samples repeated, or (``every_shard_a_copy``) every shard shard 0's keys:
    the most repeats."""
    sizes = np.full(shards, samples // shards)
    sizes[: samples % shards] += 1

    def keys_of(i: int) -> np.ndarray:  # shard i's keys, made again from its seed whenever asked
        keys = np.random.default_rng(0 if every_shard_a_copy else i).integers(
            0, 2**64 - 1, size=int(sizes[i]), dtype=np.uint64, endpoint=True) | np.uint64(1)
        if i == 1 and not every_shard_a_copy:
            keys[:100] = keys_of(0)[:100]  # 100 samples of shard 0 repeated: the search must find them
        return keys

    def records_of(i: int) -> tuple[np.ndarray, np.ndarray]:  # a sample's record: its key, two int32
        return keys_of(i).view("<i4"), np.arange(0, 2 * int(sizes[i]) + 1, 2)

    tracemalloc.start()
    t0 = time.perf_counter()
    table = copies.KeyTable(sizes.tolist())
    for i in range(shards):  # a shard at a time, as check fills it
        table.put(i, keys_of(i))
    filled_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    rep = table.repeats(records_of)
    search_s = time.perf_counter() - t1
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    bound = 8 * samples  # the keys themselves
    res = {"index_samples": samples, "index_shards": shards, "every_shard_a_copy": every_shard_a_copy,
           "repeats_found": rep.copies, "key_collisions": rep.collisions,
           "peak_mib": round(peak / 2**20, 1), "keys_mib": round(bound / 2**20, 1),
           "peak_bytes_per_sample": round(peak / samples, 2), "fill_s": round(filled_s, 2),
           "search_s": round(search_s, 2)}
    print(json.dumps(res), flush=True)
    return res


def synthetic(root: Path, samples: int, per_shard: int, seq: int) -> Path:
    """``samples`` clean synthetic samples in fixed-layout shards of ``per_shard`` at ``seq``
    (lengths 34..seq, [CLS] A [SEP] B [SEP], content ids 1000 and up, two predictions: the first
    token of A and the last of B), each shard from its own seed. What check holds per sample
    does not depend on the samples' content, only on their count."""
    import h5py

    root.mkdir(parents=True)
    for i, lo in enumerate(range(0, samples, per_shard)):
        n = min(per_shard, samples - lo)
        rng = np.random.default_rng(i)
        length = rng.integers(34, seq + 1, size=n)
        a = rng.integers(1, length - 3)  # sentence A's tokens: 1..L-4, so B holds one at least
        rows, col = np.arange(n), np.arange(seq)[None, :]
        real = col < length[:, None]
        ids = rng.integers(1000, 30522, size=(n, seq), dtype=np.int16)
        ids[:, 0], ids[rows, a + 1], ids[rows, length - 1] = 101, 102, 102
        pos = np.stack([np.ones(n, np.int64), length - 2], axis=1)
        labels = ids[rows[:, None], pos]
        ids[rows[:, None], pos] = 103
        ids[~real] = 0
        with h5py.File(root / f"part_{i:05d}.hdf5", "w") as f:
            f["input_ids"] = ids
            f["input_mask"] = real.astype(np.int8)
            f["segment_ids"] = ((col > (a + 1)[:, None]) & real).astype(np.int8)
            f["masked_lm_positions"] = pos.astype(np.int16)
            f["masked_lm_ids"] = labels
            f["next_sentence_labels"] = rng.integers(0, 2, size=n, dtype=np.int8)
    return root


def synthetic_sets(work: Path, samples: int, baseline: int, per_shard: int, seq: int, against: str) -> dict:
    """check's peak on ``samples`` and on ``baseline`` synthetic samples (this checkout's, and
    ``against``'s when given): the growth per sample between the two."""
    ids = ["--vocab-size", "30522", "--cls-id", "101", "--sep-id", "102", "--unk-id", "100",
           "--max-seq-length", str(seq)]
    out: dict = {"samples": samples, "baseline_samples": baseline, "per_shard": per_shard, "seq": seq}
    sets = {n: synthetic(work / f"syn_{n}", n, per_shard, seq) for n in (baseline, samples)}
    out["mb_on_disk"] = round(sum(p.stat().st_size for p in sets[samples].iterdir()) / 1e6)
    for name, pkg in (("this", PKG), *((("against", Path(against)),) if against else ())):
        runs = {n: run_check(d, None, ids, 1, pkg) for n, d in sets.items()}
        grow = (runs[samples]["peak_rss_mib"] - runs[baseline]["peak_rss_mib"]) * 2**20 / (samples - baseline)
        out[name] = {"checkout": str(pkg), "runs": runs, "bytes_per_sample": round(grow, 2)}
        print(json.dumps({name: out[name]}), flush=True)
    return out


def corpora(work: Path, wiki: list[str]) -> list[dict]:
    sys.path.insert(0, str(PKG / "tools"))
    import pretrain_demo

    from bench.preprocessing import from_wikiextractor
    from input_preprocessing.check import Vocabulary, check
    from input_preprocessing.create import CreateOptions, create
    from input_preprocessing.pick_eval import pick_eval
    from input_preprocessing.toy_corpus import make_corpus
    from input_preprocessing.wordpiece import train_vocab

    texts = {}
    toy = make_corpus(work / "toy", parts=5, docs_per_part=150, seed=0)
    texts["synthetic"] = (toy[:4], toy[4:], 8000)
    pretrain_demo.write_corpus(work / "doc", max_docs=100000, parts=4)
    texts["docstrings"] = (sorted((work / "doc" / "train").iterdir()), [work / "doc" / "eval" / "eval.txt"], 4000)
    if wiki:
        (work / "wiki").mkdir()
        parts = [from_wikiextractor(Path(f), work / "wiki" / f"part-{i:05d}") for i, f in enumerate(wiki)]
        texts["wikipedia"] = (parts[:-1], parts[-1:], 30522)
    out = []
    for name, (train, held, size) in texts.items():
        for d, files in (("train", train), ("held", held)):
            (work / name / d).mkdir(parents=True)
            for f in files:
                (work / name / d / f.name).write_bytes(f.read_bytes())
        vocab = train_vocab(train, work / name / "vocab.txt", size=size)
        mb = lambda fs: sum(f.stat().st_size for f in fs) / 1e6  # noqa: E731
        row = {"text": name, "train_mb": round(mb(train), 2), "held_out_mb": round(mb(held), 2),
               "vocab_tokens": len(vocab.read_text().splitlines())}
        for seq, pred in ((512, 76), (128, 20)):
            o = CreateOptions(seq, pred)
            s = create(work / name / "train", vocab, work / name / f"t{seq}", o)
            create(work / name / "held", vocab, work / name / f"h{seq}", o)
            ev = pick_eval(work / name / f"h{seq}", work / name / f"e{seq}", 10000, or_fewer=True)
            c = check(work / name / f"t{seq}", Vocabulary.from_file(vocab), seq, eval_dir=work / name / f"e{seq}")
            row[f"seq{seq}"] = {"samples": c["samples"], "repeated_samples": c["copies"]["repeated_samples"],
                                "short_repeats": c["copies"]["short_repeats"], "exit_status": c["exit_status"],
                                "eval_samples": ev["picked"], "eval_in_training": c["eval"]["in_training"],
                                "eval_short_matches": c["eval"]["short_matches"],
                                "unk_rate_text": s["unk_rate_now"], "unk_rate_shards": c["unk_rate"]}
            if seq == 512:
                one = create(work / name / "held", vocab, work / name / "h512_1", CreateOptions(seq, pred, dupe_factor=1))
                row["eval_examples_per_held_out_mb"] = {"dupe_factor_10": round(ev["eval_examples"] / mb(held)),
                                                        "dupe_factor_1": round(one["samples_written_now"] / mb(held))}
        cased = create(work / name / "train", vocab, work / name / "cased", CreateOptions(128, 20, dupe_factor=1,
                                                                                          lowercase=False),
                       max_unk_rate=1.0)
        row["unk_rate_text_with_cased"] = cased["unk_rate_now"]
        print(json.dumps(row), flush=True)
        out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--demo", action="store_true", help="check the demo data of make demo")
    ap.add_argument("--shards", type=int, default=0, help="check N generated shards at seq 512 (0: none)")
    ap.add_argument("--per-shard", type=int, default=5000, help="samples per generated shard")
    ap.add_argument("--dir", default="", help="check this directory of shards (with --eval-dir)")
    ap.add_argument("--eval-dir", default="")
    ap.add_argument("--ids", default="", help="check's vocab options for --dir (default: --vocab-size 30522 and the "
                    "demo's [CLS]/[SEP]/[UNK] ids)")
    ap.add_argument("--corpora", action="store_true", help="real text through create, eval and check --eval")
    ap.add_argument("--wikiextractor", nargs="*", default=[], help="with --corpora: WikiExtractor files, the last "
                    "held out")
    ap.add_argument("--index-samples", type=int, default=0, help="the copy index alone at N samples (0: not run)")
    ap.add_argument("--index-copies", action="store_true", help="also with every shard a copy of the first")
    ap.add_argument("--synthetic", type=int, default=0, help="check N synthetic samples, and --baseline of them")
    ap.add_argument("--baseline", type=int, default=2_000_000)
    ap.add_argument("--seq", type=int, default=40, help="the synthetic samples' padded length")
    ap.add_argument("--against", default="", help="with --synthetic: another checkout's package directory, whose "
                    "check runs on the same sets")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    result = {"benchmark": "check with its copy search", "cpu": os.uname().machine,
              "usable_cores": len(os.sched_getaffinity(0)), "load_average_before": os.getloadavg(), "datasets": []}
    with tempfile.TemporaryDirectory(prefix="check_bench_") as tmp:
        work = Path(tmp)
        if a.demo:
            demo_data.generate(work / "demo", train_samples=20000, eval_samples=2000, seed=1, seq_len=128, max_pred=20, vocab=128)
            result["datasets"].append(dataset("demo", work / "demo" / "train", work / "demo" / "eval",
                                              [*IDS[:1], "128", *IDS[2:]], a.reps, a.workers))
        if a.shards:
            demo_data.generate(work / "gen", train_samples=a.shards * a.per_shard, eval_samples=10000, seed=2, seq_len=512, max_pred=76,
                               vocab=30522, shards=a.shards)
            result["datasets"].append(dataset(f"{a.shards} shards of {a.per_shard} at seq 512", work / "gen" / "train",
                                              work / "gen" / "eval", IDS, a.reps, a.workers))
        if a.corpora:
            result["corpora"] = corpora(work / "corpora", a.wikiextractor)
        if a.synthetic:
            result["synthetic"] = synthetic_sets(work, a.synthetic, a.baseline, a.per_shard, a.seq, a.against)
        if a.dir:
            result["datasets"].append(dataset(a.dir, Path(a.dir), Path(a.eval_dir), a.ids.split() or IDS, a.reps,
                                              a.workers))
    if a.index_samples:
        result["index"] = [index_alone(a.index_samples)]
        if a.index_copies:
            result["index"].append(index_alone(a.index_samples, every_shard_a_copy=True))
    result["load_average_after"] = os.getloadavg()
    print(json.dumps(result, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
