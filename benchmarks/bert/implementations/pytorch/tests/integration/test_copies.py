"""Copies in the data, as a user meets them: the commands run as the docs write them, in a
process of their own, on the demo data `make demo` makes and on real text. Each planted copy
is named by one line and an exit status; the clean data passes. Then the data tools' other
endings: Ctrl-C as a terminal sends it, a reader that closes the pipe, an [UNK]-ridden text,
a part edited in place, --input given a file."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from copies_helpers import DEMO_IDS, PKG, Demo, real_text, shard_names
from input_preprocessing.create import SOURCES
from input_preprocessing.toy_corpus import make_corpus
from input_preprocessing.wordpiece import train_vocab

PREP = [sys.executable, "-m", "input_preprocessing"]


def prep(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([*PREP, *args], cwd=PKG, capture_output=True, text=True, timeout=300, **kw)


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Demo:
    """The demo data as demo.sh makes it (config_CPU_1x2.sh's DEMO_* sizes)."""
    root = tmp_path_factory.mktemp("demo")
    r = subprocess.run([sys.executable, "-m", "bert.demo_data", "--output", str(root), "--seed", "1", "--vocab", "128",
                        "--seq-len", "128", "--max-pred", "20", "--train-samples", "20000", "--eval-samples", "2000"],
                       cwd=PKG, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return Demo(root / "train", root / "eval")


def test_the_demo_data_passes_check_with_its_eval_set(demo):
    r = prep("check", "--input", str(demo.train), *DEMO_IDS, "--eval", str(demo.eval), "--workers", "2")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    out = json.loads(r.stdout)
    assert out["defects"] == {} and out["eval"]["in_training"] == 0 and out["per_shard"] == {}


def test_a_shard_replaced_by_a_copy_with_its_md5_list_made_after_is_named(demo, tmp_path):
    """part_00001 replaced by a copy of part_00000, md5sums.txt
    written after the copy (so the md5 list cannot tell)."""
    d = demo.copy(tmp_path / "d")
    shutil.copy(d.train / "part_00000_of_00008.hdf5", d.train / "part_00001_of_00008.hdf5")
    assert prep("checksum", "--input", str(d.train)).returncode == 0
    assert prep("verify", "--input", str(d.train)).returncode == 0  # the md5 list agrees with the copy
    r = prep("check", "--input", str(d.train), *DEMO_IDS)
    assert r.returncode == 1
    err = r.stderr.splitlines()
    assert err[0].startswith(f"error: {d.train}: part_00001_of_00008.hdf5 holds the same examples as "
                             "part_00000_of_00008.hdf5 (examples_md5 ")
    assert err[1].startswith("diagnosis: whole shards repeat") and "0.62-0.63" in err[1]
    assert len(err) == 2 and "Traceback" not in r.stderr


def test_the_eval_shard_copied_in_as_a_ninth_training_shard_is_named(demo, tmp_path):
    d = demo.copy(tmp_path / "d")
    shutil.copy(d.eval / "eval_00000.hdf5", d.train / "part_00008_of_00008.hdf5")
    r = prep("check", "--input", str(d.train), *DEMO_IDS, "--eval", str(d.eval), "--workers", "2")
    assert r.returncode == 1
    err = r.stderr.splitlines()
    assert err[0] == (f"error: {d.train}: part_00008_of_00008.hdf5 holds the same examples as the eval set's "
                      "eval_00000.hdf5: a copy of the eval set among the training shards")
    assert f"eval samples in {d.eval} are in the training shards" in err[1]
    assert "held by part_00008_of_00008.hdf5 (" in err[1]
    assert json.loads(r.stdout)["eval"]["training_shards"].keys() == {"part_00008_of_00008.hdf5"}


def test_the_same_text_under_two_names_is_refused_by_create(tmp_path):
    parts = make_corpus(tmp_path / "text", parts=2, docs_per_part=20, seed=4)
    vocab = train_vocab(parts, tmp_path / "vocab.txt", size=800)
    shutil.copy(parts[0], tmp_path / "text" / "renamed.txt")
    args = ["create", "--input", str(tmp_path / "text"), "--vocab", str(vocab), "--max-seq-length", "64",
            "--max-predictions-per-seq", "10", "--dupe-factor", "1", "--workers", "2"]
    r = prep(*args, "--output", str(tmp_path / "o"))
    assert r.returncode == 2
    assert r.stderr.startswith(f"error: {parts[0]} and {tmp_path / 'text' / 'renamed.txt'} hold the same text (md5 ")
    assert len(r.stderr.splitlines()) == 1
    r = prep(*args, "--output", str(tmp_path / "o2"), "--allow-same-text")
    assert r.returncode == 0 and json.loads(r.stdout)["parts_written_now"] == 3


def test_real_text_through_create_eval_and_check_raises_no_false_alarm(tmp_path):
    text = real_text(tmp_path / "corpus")
    small = ["--vocab", str(text.vocab), "--max-seq-length", "128", "--max-predictions-per-seq", "20",
             "--workers", "2"]
    assert prep("create", "--input", str(text.text), "--output", str(tmp_path / "train"), *small).returncode == 0
    assert prep("create", "--input", str(text.held_out), "--output", str(tmp_path / "held"), *small).returncode == 0
    r = prep("eval", "--input", str(tmp_path / "held"), "--output", str(tmp_path / "eval"), "--or-fewer")
    assert r.returncode == 0, r.stderr
    r = prep("check", "--input", str(tmp_path / "train"), "--vocab", str(text.vocab), "--eval", str(tmp_path / "eval"))
    assert r.returncode == 0 and "error" not in r.stderr, r.stderr
    out = json.loads(r.stdout)
    assert out["copies"]["repeated_samples"] == 0 and out["samples"] > 5000
    # docstrings that share a passage (asyncio's protocols) put its text in both sets: a note
    assert out["eval"]["in_training"] <= 0.01 * out["eval"]["eval_samples"]
    assert all(line.startswith(f"note: {tmp_path / 'train'}: ") and "not a leak" in line
               for line in r.stderr.splitlines())


# ---------------------------------------------------------------- how the tools end


def _as_a_terminal() -> None:
    """The child as a terminal's foreground job starts: SIGINT at its default action (a
    background job of a script inherits it ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Text that keeps create busy for several seconds on one core."""
    root = tmp_path_factory.mktemp("big")
    parts = make_corpus(root / "text", parts=4, docs_per_part=400, seed=6)
    return root / "text", train_vocab(parts, root / "vocab.txt", size=3000)


def test_ctrl_c_in_create_ends_with_one_line_and_130_and_the_rerun_resumes(corpus, tmp_path):
    text, vocab = corpus
    out = tmp_path / "out"
    args = [*PREP, "create", "--input", str(text), "--vocab", str(vocab), "--workers", "2", "--output", str(out)]
    p = subprocess.Popen(args, cwd=PKG, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         process_group=0, preexec_fn=_as_a_terminal)
    # A part is done once its record is written, after its shard's rename (create.py's
    # _made_from): a shard renamed but not yet recorded when Ctrl-C lands is made again.
    records = out / SOURCES
    deadline = time.monotonic() + 120
    while not list(records.glob("*.md5")) and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)  # until the first part is done: the workers are mid-part
    assert p.poll() is None, "create ended before it could be interrupted"
    os.killpg(p.pid, signal.SIGINT)  # what Ctrl-C does: the whole foreground process group
    stdout, stderr = p.communicate(timeout=60)
    assert p.returncode == 130, stderr
    assert stderr == ("interrupted (Ctrl-C): the files written so far are complete; the same command resumes\n")
    assert stdout == ""
    done = [name for name in shard_names(out) if (records / f"{name}.md5").is_file()]
    assert 1 <= len(done) < 4
    r = subprocess.run(args, cwd=PKG, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and json.loads(r.stdout)["parts_written_now"] == 4 - len(done)
    whole = subprocess.run([*args[:-1], str(tmp_path / "whole")], cwd=PKG, capture_output=True, text=True,
                           timeout=300)
    assert whole.returncode == 0
    from create_helpers import _digests

    assert _digests(out) == _digests(tmp_path / "whole")


def test_a_reader_that_closes_the_pipe_ends_check_quietly(demo):
    """`check ... | head`: the JSON's reader gone before it is written."""
    p = subprocess.Popen([*PREP, "check", "--input", str(demo.train), *DEMO_IDS, "--per-shard"], cwd=PKG,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()  # before check writes anything: its write meets a closed pipe
    stderr = p.stderr.read()
    assert p.wait(timeout=120) == 141 and stderr == b""


def test_an_uncased_vocab_with_cased_is_refused_before_anything_is_written(corpus, tmp_path):
    text, vocab = corpus
    r = prep("create", "--input", str(text), "--vocab", str(vocab), "--output", str(tmp_path / "o"), "--cased")
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1
    assert "% of its " in r.stderr and "tokens are [UNK]" in r.stderr and "drop --cased" in r.stderr
    assert not (tmp_path / "o").exists()


def test_a_part_edited_in_place_to_the_same_size_is_made_again(tmp_path):
    parts = make_corpus(tmp_path / "text", parts=2, docs_per_part=20, seed=8)
    vocab = train_vocab(parts, tmp_path / "vocab.txt", size=800)
    args = ["create", "--input", str(tmp_path / "text"), "--vocab", str(vocab), "--output", str(tmp_path / "o"),
            "--max-seq-length", "64", "--max-predictions-per-seq", "10", "--dupe-factor", "1", "--workers", "2"]
    assert json.loads(prep(*args).stdout)["parts_written_now"] == 2
    raw = parts[1].read_bytes()
    parts[1].write_bytes(raw.replace(b"ka", b"lo", 1))
    assert len(parts[1].read_bytes()) == len(raw)
    assert json.loads(prep(*args).stdout)["parts_written_now"] == 1


def test_input_given_a_file_says_so(tmp_path):
    f = tmp_path / "part.txt"
    f.write_text("One.\n")
    r = prep("create", "--input", str(f), "--vocab", str(f), "--output", str(tmp_path / "o"))
    assert r.returncode == 2 and "part.txt: is a file, not a directory" in r.stderr
    r = prep("check", "--input", str(f))
    assert r.returncode == 2 and r.stderr == (f"error: {f}: is a file, not a directory; --input takes the directory of "
                                              "the shards\n")
