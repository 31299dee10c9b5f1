"""prepare_data.sh end to end on a toy download (same file names as MLCommons' files)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import h5py

from bert.shards import list_shards, read_shard
from input_preprocessing.checksum import verify
from input_preprocessing.toy_corpus import make_corpus
from input_preprocessing.wordpiece import train_vocab

PKG = Path(__file__).resolve().parents[2]


def _download(root: Path, eval_text: Path | None = None) -> Path:
    """A toy download; ``eval_text``: a copy of this file as eval.txt (default: text of its own)."""
    dl = root / "download"
    r4 = dl / "results4"
    parts = make_corpus(root / "tmp", parts=3, docs_per_part=12, seed=2)
    r4.mkdir(parents=True)
    for p in parts:  # MLCommons' parts have no extension
        p.rename(r4 / p.name.replace(".txt", ""))
    if eval_text is None:
        make_corpus(root / "tmp_eval", parts=1, docs_per_part=12, seed=3)[0].rename(r4 / "eval.txt")
    else:
        (r4 / "eval.txt").write_bytes((r4 / eval_text).read_bytes())
    train_vocab(sorted(r4.iterdir()), dl / "vocab.txt", size=800)
    (dl / "bert_config.json").write_text(json.dumps({"vocab_size": 800}))
    (dl / "bert_reference_results_text_md5.txt").write_text(
        "".join(f"{hashlib.md5(p.read_bytes()).hexdigest()}  {p.name}\n" for p in sorted(r4.iterdir())))
    return dl


def _run(dl: Path, out: Path) -> subprocess.CompletedProcess:
    lines = len((dl / "vocab.txt").read_text().splitlines())
    env = dict(os.environ, PYTHON=sys.executable, SKIP_CHECKPOINT="1", EXPECT_VOCAB=str(lines), EVAL_SAMPLES="50")
    return subprocess.run(["input_preprocessing/prepare_data.sh", str(dl), str(out), "4", "2"], cwd=PKG, env=env,
                          capture_output=True, text=True, timeout=600)


def test_prepare_data_chain(tmp_path):
    dl = _download(tmp_path)
    out = tmp_path / "out"
    r = _run(dl, out)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"DATADIR={out}/hdf5/training_4" in r.stdout
    assert "== training examples: 3 parts" in r.stdout  # counted, not MLPerf's 500
    h = out / "hdf5"
    assert len(list_shards(h / "training")) == 3 and len(list_shards(h / "training_4")) == 4
    total = sum(len(read_shard(p)) for p in list_shards(h / "training"))
    assert sum(len(read_shard(p)) for p in list_shards(h / "training_4")) == total
    manifest = json.loads((h / "training_4_strata" / "manifest.json").read_text())
    assert manifest["total_samples"] == total and len(manifest["strata"]) == 4
    assert len(read_shard(h / "eval_varlength" / "eval_50.hdf5")) == 50
    assert json.loads((out / "stats" / "stats.json").read_text())["samples"] == total
    assert f"check: clean ({out}/check.json)" in r.stdout
    assert json.loads((out / "check.json").read_text())["eval"]["in_training"] == 0
    for d in ("training", "training_4", "training_4_strata", "eval_all", "eval_varlength"):
        # each written by the step that made the directory (no checksum step after): it verifies
        assert verify(h / d)["verified"] == len(list((h / d).rglob("*.hdf5"))), d
    # a shard changed after its step made it (one token, in place): the rerun, every step
    # resuming, stops at the first step that reads it, naming it and its list; nothing after
    # it lists the damage anew
    victim = list_shards(h / "training_4")[1]
    with h5py.File(victim, "r+") as f:
        row = f["input_ids"][0]
        row[1] += 1
        f["input_ids"][0] = row
    again = _run(dl, out)
    assert again.returncode == 2, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"error: {victim}: md5 " in again.stderr and f"{h / 'training_4' / 'md5sums.txt'} says" in again.stderr
    # (each step's resumption is tested with the step; a rerun here would double the cost)
    # a corrupted download stops the chain at the md5 check
    with (dl / "results4" / "eval.txt").open("a") as f:
        f.write("tampered\n")
    bad = _run(dl, tmp_path / "out2")
    assert bad.returncode != 0 and "eval.txt: FAILED" in bad.stdout + bad.stderr
    assert not (tmp_path / "out2").exists()


def test_prepare_data_stops_when_the_eval_text_is_a_training_part(tmp_path):
    """eval.txt the same text as a training part (the held-out text not held out): the check
    after the eval set is made names the training shards that hold it and stops the chain."""
    dl = _download(tmp_path, eval_text=Path("part-00001-of-00003"))
    out = tmp_path / "out"
    r = _run(dl, out)
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"error: {out}/hdf5/training_4: " in r.stderr and "eval samples in" in r.stderr
    assert "are in the training shards" in r.stderr and "held by part_0000" in r.stderr
    assert "check: clean" not in r.stdout and not (out / "hdf5" / "training_4_strata").exists()
