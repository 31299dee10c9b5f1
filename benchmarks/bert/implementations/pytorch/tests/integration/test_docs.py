"""The documentation holds: the integration tier's (the links of every tracked page, the
blocks that run tools); tests/unit/test_docs.py has the rest and says what the file covers."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

from docblocks import PKG, ROOT, anchors, strip_code
from docs_helpers import LINK, markdown_files, the_block
import sys
import pytest


def run_block(block, subs: dict[str, str], cwd=PKG) -> subprocess.CompletedProcess:
    """A bash block with ``subs`` applied (each must occur), run in ``cwd`` (PKG)."""
    text = block.text
    for old, new in subs.items():
        assert old in text, f"{block.page}:{block.line} no longer says {old!r}"
        text = text.replace(old, new)
    return subprocess.run(["bash", "-euo", "pipefail", "-c", text], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


def test_preprocessing_bench_block_runs(tmp_path):
    block = the_block("docs/data.md", "TOKENIZERS_PARALLELISM=false")
    r = run_block(block, {"flock /tmp/bench.lock ": "", "--mb 4 --workers 1 2": "--mb 0.05 --part-mb 0.05 "
                          "--vocab-size 300 --dupe-factor 1 --workers 1", "prep_bench.json": str(tmp_path / "p.json")})
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads((tmp_path / "p.json").read_text())
    assert out  # the JSON the block writes


def test_digests_block_runs_and_says_two_layouts_hold_the_same_examples(tmp_path):
    """The block as written, on a small corpus; "theirs" is the same text made in the other
    layout: another file, the same examples."""
    from input_preprocessing.create import CreateOptions, create
    from input_preprocessing.toy_corpus import make_corpus
    from input_preprocessing.wordpiece import train_vocab

    parts = make_corpus(tmp_path / "text", parts=2, docs_per_part=20, seed=3)
    vocab = train_vocab(parts, tmp_path / "vocab.txt", size=400)
    small = ["--max-seq-length", "64", "--max-predictions-per-seq", "10", "--dupe-factor", "1"]
    create(tmp_path / "text", vocab, tmp_path / "theirs", CreateOptions(64, 10, dupe_factor=1, layout="variable"))
    block = the_block("docs/data.md", "python -m input_preprocessing create --input TEXT_DIR")
    r = run_block(block, {"TEXT_DIR": str(tmp_path / "text"), "vocab.txt": str(vocab),
                          "--output ours": f"--output {tmp_path / 'ours'} {' '.join(small)}",
                          "--input ours": f"--input {tmp_path / 'ours'} --max-seq-length 64",
                          "THEIRS_DIR": f"{tmp_path / 'theirs'} --max-seq-length 64",
                          "ours.md5": str(tmp_path / "ours.md5"), "theirs.md5": str(tmp_path / "theirs.md5")})
    assert r.returncode == 0, r.stderr[-2000:]
    assert "the same examples, part for part" in r.stdout
    assert len((tmp_path / "ours.md5").read_text().splitlines()) == 2


def test_pretraining_data_script_runs_as_written_and_stops_on_held_out_text_in_training(tmp_path):
    """docs/pretraining.md's data script on real text (the standard library's docstrings, a
    few hundred KB: fewer held-out examples than 10,000, so --or-fewer takes them all), as
    written but for its line of paths and 16 shards; then with the held-out text the training
    text, where its last check stops it (set -e) before phase 2."""
    from copies_helpers import real_text

    text = real_text(tmp_path / "corpus")
    block = the_block("docs/pretraining.md", "set -euo pipefail")
    yours = "TEXT=corpus/train HELD_OUT_TEXT=corpus/held_out VOCAB=corpus/vocab.txt SHARDS=2048"
    ok = tmp_path / "ok"
    ok.mkdir()
    r = run_block(block, {yours: f"TEXT={text.text} HELD_OUT_TEXT={text.held_out} VOCAB={text.vocab} SHARDS=16"}, ok)
    assert r.returncode == 0, r.stderr[-3000:]
    for n in (1, 2):
        assert len(list((ok / f"p{n}" / "train").glob("*.hdf5"))) == 16
        (picked,) = (ok / f"p{n}" / "eval").glob("eval_*.hdf5")
        assert 0 < int(picked.stem.split("_")[1]) < 10000  # every example of the held-out text
    assert "fewer_than_asked" in r.stdout
    bad = tmp_path / "bad"
    bad.mkdir()
    r = run_block(block, {yours: f"TEXT={text.text} HELD_OUT_TEXT={text.text} VOCAB={text.vocab} SHARDS=16"}, bad)
    assert r.returncode == 1 and "are in the training shards" in r.stderr
    assert not (bad / "p2").exists()


def test_plan_block_runs():
    r = run_block(the_block("docs/pretraining.md", "python tools/plan.py --configs"), {})
    assert r.returncode == 0, r.stderr[-2000:]
    assert "phase1" in r.stdout and "phase2" in r.stdout


def test_show_block_prints_each_setting_and_where_it_came_from():
    r = run_block(the_block("docs/configuration.md", "python3 tools/config_env.py show"), {})
    assert r.returncode == 0, r.stderr[-2000:]
    assert "global batch 65536 = run.local_batch_size 64 x run.grad_accum_steps 32 x 32" in r.stdout
    assert "model.vocab_size=8000 (command line)" in r.stdout
    assert "optim.total_steps=7038 (MAX_STEPS in config_A100PCIE_8x4_pretrain_large_phase1.sh)" in r.stdout


def test_own_cluster_config_block_writes_a_config_the_launchers_read(tmp_path):
    """cluster.md's config for 4 x 8 H100, written and shown as the block does: the global
    batch it promises, BERT-Large on CUDA, every value the config's own."""
    mine = tmp_path / "config_H100_4x8.sh"
    r = run_block(the_block("docs/cluster.md", "cat > config_H100_4x8.sh"), {"config_H100_4x8.sh": str(mine)})
    assert r.returncode == 0, r.stderr[-2000:]
    assert "32 rank(s) (4 node(s) x 8), device cuda, global batch 3072 = run.local_batch_size 48 x " \
           "run.grad_accum_steps 2 x 32" in r.stdout
    settings = [ln for ln in r.stdout.splitlines() if ln.startswith("  ")]
    assert settings and all(ln.endswith(" in config_H100_4x8.sh)") for ln in settings), settings
    assert "a timed run would exit 2: run.init_checkpoint" in r.stdout  # INIT_CHECKPOINT is set at launch


def test_walkthrough_corpus_block_makes_text_in_the_format_create_reads(tmp_path):
    """The walkthrough's man pages -> text, as written but on 40 pages, in a directory of its
    own: three parts, a blank line between documents, sentences of four words or more; the
    vocab and create steps of the page then read it."""
    if shutil.which("man") is None or not list(Path("/usr/share/man/man1").glob("*.gz")):
        pytest.skip("no man pages here (man-db): the walkthrough's corpus is made of them")
    block = the_block("docs/pretraining.md", "# Man pages as text")
    assert "sed -n 1,1500p" in block.text
    r = subprocess.run(["bash", "-euo", "pipefail", "-c", block.text.replace("sed -n 1,1500p", "sed -n 1,40p")],
                       cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    counts = {line.split()[0]: int(line.split()[1]) for line in r.stdout.splitlines()}
    assert counts["train"] > counts["downstream"] > counts["heldout"] >= 1 and sum(counts.values()) <= 40, counts
    assert not list((tmp_path / "man").glob("raw_*"))
    docs = (tmp_path / "man" / "train" / "part-00.txt").read_text().split("\n\n")
    assert len(docs) == counts["train"] and all(len(line.split()) >= 4 for d in docs for line in d.split("\n") if line)
    from input_preprocessing.create import CreateOptions, create
    from input_preprocessing.wordpiece import train_vocab

    vocab = train_vocab([tmp_path / "man" / "train" / "part-00.txt"], tmp_path / "vocab.txt", size=500)
    made = create(tmp_path / "man" / "train", vocab, tmp_path / "parts", CreateOptions(128, 20, dupe_factor=1))
    assert made["samples_written_now"] > 0, made


def test_schedule_block_runs_with_its_options():
    block = the_block("docs/published_recipe.md", "python tools/schedule.py")
    r = run_block(block, {"[--steps N] [--json] [--plot lr.png] [--set PRECISION=fp16]": "--steps 3 --json"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert len(json.loads(r.stdout)["lr"]) == 3


def test_every_relative_link_and_anchor_resolves():
    dead = []
    for md in markdown_files():
        text = strip_code(md.read_text())
        text = re.sub(r"`[^`\n]*`", "", text)  # inline code is not a link
        for m in LINK.finditer(text):
            target = m.group(1) or m.group(2)
            if re.match(r"[a-z]+:", target):  # https:, mailto: ...
                continue
            path, _, anchor = target.partition("#")
            dest = (md.parent / path).resolve() if path else md
            where = f"{md.relative_to(ROOT)}: ({target})"
            if not dest.exists():
                dead.append(f"{where}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                dead.append(f"{where}: no heading with anchor #{anchor}")
    assert not dead, "\n".join(dead)


def test_the_link_check_sees_dead_links_and_anchors(tmp_path, monkeypatch):
    page = tmp_path / "a.md"
    page.write_text("# A\n\n## Two words\n\n[ok](#two-words) [bad](#none) [gone](b.md) `[code](x.md)`\n")
    assert anchors(page) == {"a", "two-words"}
    monkeypatch.setattr(sys.modules[__name__], "markdown_files", lambda: [page])
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    with pytest.raises(AssertionError) as e:
        test_every_relative_link_and_anchor_resolves()
    assert "#none" in str(e.value) and "b.md" in str(e.value) and "x.md" not in str(e.value)
    assert "#two-words" not in str(e.value)
