"""shard, eval, checksum/verify, stats and the CLI around every step."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from bert import demo_data
from bert.shards import Shard, list_shards, read_shard, write_shard
from input_preprocessing.__main__ import main
from input_preprocessing.checksum import checksum, verify
from input_preprocessing.common import PrepError
from input_preprocessing.pick_eval import pick_eval, pick_indices
from input_preprocessing.shard import shard
from input_preprocessing.stats import stats
from input_preprocessing.toy_corpus import make_corpus

PKG_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    """5 fixed-layout parts of uneven sizes (as create writes them)."""
    root = tmp_path_factory.mktemp("parts")
    demo_data.generate(root, train_samples=700, eval_samples=333, seed=5, seq_len=64, max_pred=10, vocab=200,
                       layout="fixed", shards=5)
    d = root / "train"
    first = list_shards(d)[0]  # make sizes uneven: cut the first part short
    write_shard(first, read_shard(first).subset(np.arange(61)), "fixed", 64, 10)
    return d, root / "eval"


def _all(d: Path) -> Shard:
    return Shard.concat([read_shard(p) for p in list_shards(d)])


def _same(a: Shard, b: Shard) -> None:
    for name in ("tokens", "segments", "offsets", "mlm_positions", "mlm_ids", "mlm_offsets", "nsp"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)


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


def test_shard_errors(parts, tmp_path):
    src, _ = parts
    with pytest.raises(PrepError, match="cannot cut 621 samples into 622 non-empty shards"):
        shard(src, tmp_path / "a", 622)
    with pytest.raises(PrepError, match="padded to 64 tokens / 10 predictions, more than the fixed output's 32 / 10"):
        shard(src, tmp_path / "b", 2, "fixed", 32, 10)
    shard(src, tmp_path / "c", 2)
    with pytest.raises(PrepError, match="different run"):
        shard(src, tmp_path / "c", 3)


def test_eval_pick_count_spacing_and_determinism(parts, tmp_path):
    _, ev = parts
    np.testing.assert_array_equal(pick_indices(10, 4), [0, 2, 5, 7])
    r1 = pick_eval(ev, tmp_path / "e1", num_samples=100)
    r2 = pick_eval(ev, tmp_path / "e2", num_samples=100, layout="variable")
    assert r1["picked"] == 100 and r1["eval_examples"] == 333
    a, b = read_shard(r1["file"]), read_shard(r2["file"])
    assert len(a) == 100
    _same(a, b)
    _same(a, _all(ev).subset(np.arange(100) * 333 // 100))
    assert Path(r1["file"]).read_bytes() == Path(pick_eval(ev, tmp_path / "e3", 100)["file"]).read_bytes()
    with pytest.raises(PrepError, match="cannot pick 334 samples out of 333"):
        pick_eval(ev, tmp_path / "e4", num_samples=334)


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


def test_stats_numbers_and_plot(parts, tmp_path):
    src, _ = parts
    summary = stats(src, tmp_path / "st", max_seq_length=64)
    data = _all(src)
    lens = data.lengths
    saved = json.loads((tmp_path / "st" / "stats.json").read_text())
    assert saved["samples"] == len(lens) == summary["samples"]
    assert saved["tokens"] == int(lens.sum())
    assert saved["mean_length"] == round(lens.mean(), 2)
    assert saved["padding_fraction"] == round(1 - lens.sum() / (len(lens) * 64), 4)
    assert saved["fraction_at_max_length"] == round(float((lens == 64).mean()), 4)
    assert np.array_equal(saved["length_histogram"], np.bincount(lens, minlength=65))
    assert saved["median_length"] == int(np.sort(lens)[(len(lens) + 1) // 2 - 1])
    png = (tmp_path / "st" / "length_histogram.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 2000


def test_cli_every_step(parts, tmp_path, capsys):
    src, ev = parts
    assert main(["shard", "--input", str(src), "--output", str(tmp_path / "sh"), "--num-shards", "4",
                 "--workers", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["shards"] == 4
    assert main(["stratify", "--input", str(tmp_path / "sh"), "--output", str(tmp_path / "st"), "--bounds", "32,64",
                 "--max-seq-length", "64", "--workers", "1"]) == 0
    assert set(json.loads(capsys.readouterr().out)) == {"stratum_0_1-32", "stratum_1_33-64"}
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
