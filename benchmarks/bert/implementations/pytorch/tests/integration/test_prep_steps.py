"""shard, eval, checksum/verify, stats and the CLI around every step."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import h5py
import pytest

from bert.shards import list_shards, read_shard
from input_preprocessing.__main__ import main
from input_preprocessing.checksum import checksum, verify
from input_preprocessing.common import PrepError
from input_preprocessing.shard import shard
from input_preprocessing.toy_corpus import make_corpus
from prep_steps_helpers import _all, _same, parts  # noqa: F401 - fixtures: parts


PKG_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("layout,workers", [("variable", 3), ("fixed", 1)])
def test_shard_rechops_without_loss_or_reorder(parts, tmp_path, layout, workers):
    src, _ = parts
    out = tmp_path / "shards"
    summary = shard(src, out, 7, layout, 64, 10, workers=workers)
    files = list_shards(out)
    assert [f.name for f in files] == [f"part_{j:05d}_of_00007.hdf5" for j in range(7)]
    sizes = [len(read_shard(f)) for f in files]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == summary["samples"] == 61 + 4 * 140
    _same(_all(out), _all(src))
    with h5py.File(files[0]) as f:
        assert (f["input_ids"].ndim == 2) == (layout == "fixed") and ("input_mask" in f) == (layout == "fixed")
    (out / files[2].name).unlink()  # interrupted: rerun writes only what is missing
    assert shard(src, out, 7, layout, 64, 10, workers=workers)["written_now"] == 1
    _same(_all(out), _all(src))


def test_checksum_and_verify_catch_every_change(parts, tmp_path):
    src, _ = parts
    d = tmp_path / "d"
    shard(src, d, 3)
    (d / "sub").mkdir()
    (d / "sub" / "x.hdf5").write_bytes((d / "part_00000_of_00003.hdf5").read_bytes())
    sums = checksum(d, workers=2)
    assert set(sums) == {"part_00000_of_00003.hdf5", "part_00001_of_00003.hdf5", "part_00002_of_00003.hdf5",
                         "sub/x.hdf5"}
    assert sums["sub/x.hdf5"] == sums["part_00000_of_00003.hdf5"]
    r = subprocess.run(["md5sum", "-c", "--quiet", "md5sums.txt"], cwd=d, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr  # the manifest is md5sum's own format
    assert verify(d)["verified"] == 4
    with h5py.File(d / "part_00001_of_00003.hdf5", "a") as f:
        f["next_sentence_labels"][0] = 1 - f["next_sentence_labels"][0]
    (d / "sub" / "x.hdf5").unlink()
    (d / "extra.hdf5").write_bytes(b"")
    with pytest.raises(PrepError, match=r"1 changed \(e\.g\. \['part_00001_of_00003.hdf5'\]\); 1 missing .*sub/x.hdf5.*"
                                        r"1 not in the manifest .*extra.hdf5"):
        verify(d)
    with pytest.raises(PrepError, match="no checksum manifest"):
        verify(src)


def test_cli_every_step(parts, tmp_path, capsys):
    src, ev = parts
    assert main(["shard", "--input", str(src), "--output", str(tmp_path / "sh"), "--num-shards", "4",
                 "--workers", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["shards"] == 4
    assert main(["stratify", "--input", str(tmp_path / "sh"), "--output", str(tmp_path / "st"), "--bounds", "32,64",
                 "--max-seq-length", "64", "--workers", "1"]) == 0
    said = json.loads(capsys.readouterr().out)
    assert set(said) == {"stratum_0_1-32", "stratum_1_33-64", "inputs_verified_against"}
    assert said["inputs_verified_against"] == str(tmp_path / "sh" / "md5sums.txt")  # the list shard wrote
    assert main(["eval", "--input", str(ev), "--output", str(tmp_path / "ev"), "--num-samples", "50"]) == 0
    assert json.loads(capsys.readouterr().out)["picked"] == 50
    assert main(["checksum", "--input", str(tmp_path / "st"), "--workers", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["files"] == 8
    assert main(["verify", "--input", str(tmp_path / "st"), "--workers", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["verified"] == 8
    assert main(["stats", "--input", str(tmp_path / "st"), "--output", str(tmp_path / "stats"),
                 "--max-seq-length", "64"]) == 0
    assert json.loads(capsys.readouterr().out)["samples"] == 621
    (tmp_path / "st" / "md5sums.txt").write_text("0" * 32 + "  stratum_0_1-32/part_00000.hdf5\n")
    assert main(["verify", "--input", str(tmp_path / "st"), "--workers", "1"]) == 2
    assert "verification against" in capsys.readouterr().err
    for step in ("create", "shard", "stratify", "eval", "checksum", "verify", "stats"):
        with pytest.raises(SystemExit) as e:
            main([step, "--help"])
        assert e.value.code == 0 and "--input" in capsys.readouterr().out
    # one real process: the module runs as documented and exits 2 with the error on stderr
    r = subprocess.run([sys.executable, "-m", "input_preprocessing", "stratify", "--input", str(tmp_path / "none"),
                        "--output", str(tmp_path / "o2")], cwd=PKG_ROOT, capture_output=True, text=True)
    assert r.returncode == 2 and "none: no such directory" in r.stderr


def test_data_preparation_imports_no_torch(tmp_path):
    """Every step but ``checkpoint`` (which converts torch weights), and the demo data, run in
    one interpreter that never imports torch: bert/shards.py holds the shard format apart from
    the loader: importing torch costs seconds a process, and prepare_data.sh starts ten such
    steps."""
    text = tmp_path / "text"
    make_corpus(text, parts=2, docs_per_part=8, seed=1)
    d = {k: str(tmp_path / k) for k in ("vocab.txt", "created", "strata", "shards", "eval", "stats", "demo")}
    steps = [["vocab", "--input", str(text), "--output", d["vocab.txt"], "--size", "300"],
             ["create", "--input", str(text), "--vocab", d["vocab.txt"], "--output", d["created"],
              "--max-seq-length", "64", "--max-predictions-per-seq", "10", "--workers", "1"],
             ["stratify", "--input", d["created"], "--output", d["strata"], "--bounds", "32,64",
              "--max-seq-length", "64", "--workers", "1"],
             ["shard", "--input", d["created"], "--output", d["shards"], "--num-shards", "2", "--layout", "variable",
              "--max-seq-length", "64", "--max-predictions", "10", "--workers", "1"],
             ["eval", "--input", d["created"], "--output", d["eval"], "--num-samples", "20"],
             ["checksum", "--input", d["shards"], "--workers", "1"], ["verify", "--input", d["shards"], "--workers", "1"],
             ["check", "--input", d["shards"], "--vocab", d["vocab.txt"], "--max-seq-length", "64"],
             ["stats", "--input", d["shards"], "--output", d["stats"], "--max-seq-length", "64"]]
    script = ("import json, sys\nfrom input_preprocessing.__main__ import main\nfrom bert import demo_data\n"
              "rcs = [main(step) for step in json.loads(sys.argv[1])]\n"
              "demo_data.main(['--output', sys.argv[2], '--train-samples', '200', '--eval-samples', '50', "
              "'--shards', '2'])\n"
              "print('RESULT', json.dumps({'rcs': rcs, 'torch': sorted(m for m in sys.modules if m.split('.')[0] == 'torch')}))\n")
    r = subprocess.run([sys.executable, "-c", script, json.dumps(steps), d["demo"]], cwd=PKG_ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    result = json.loads(r.stdout.rsplit("RESULT ", 1)[1])
    assert result["rcs"] == [0] * len(steps), r.stdout[-3000:]
    assert result["torch"] == [], f"torch was imported: {result['torch'][:5]}"
    assert len(list_shards(tmp_path / "shards")) == 2 and len(read_shard(tmp_path / "eval" / "eval_20.hdf5")) == 20


@pytest.mark.parametrize("step, workers", [("stratify", "1"), ("check", "2")])
def test_a_step_on_a_shard_where_hdf5_spins_ends_at_its_bound_naming_it(tmp_path, step, workers):
    """A lost sector (zeros where HDF5's structures lie: h5py spins on it for good), no md5 list
    to catch it first: the step stops at --read-timeout-s naming the file, exit 2, its process
    ends (the read still spinning in a thread of its own, or in a worker), and no output is left."""
    from bert import demo_data

    demo_data.generate(tmp_path / "d", train_samples=160, eval_samples=20, seed=3, seq_len=64, max_pred=10,
                       vocab=128, layout="variable", shards=4)
    bad = tmp_path / "d" / "train" / "part_00001_of_00004.hdf5"
    with open(bad, "r+b") as f:
        f.seek(4096)
        f.write(b"\0" * 4096)
    out = tmp_path / "out"
    args = {"stratify": ["--output", str(out), "--max-seq-length", "64"],
            "check": ["--vocab-size", "128", "--cls-id", str(demo_data.CLS), "--sep-id", str(demo_data.SEP)]}[step]
    r = subprocess.run([sys.executable, "-m", "input_preprocessing", step, "--input", str(tmp_path / "d" / "train"),
                        *args, "--workers", workers, "--read-timeout-s", "2"], cwd=PKG_ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-3000:]
    assert f"error: {bad}: reading took longer than --read-timeout-s=2 s: a damaged file" in r.stderr, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and not out.exists()
