"""The vocab step (``python -m input_preprocessing vocab``, ``wordpiece.train_vocab``): the same
corpus makes the same bytes every run, and ties go the way its --help says.

Left to itself, Hugging Face tokenizers' WordPiece trainer numbers the ``##`` pieces of single
characters in hash-map order, which changes with every map it makes (in one process too), and
breaks ties between equally frequent pairs by those numbers: on these corpora three runs of it
wrote three different files."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import pytest

from input_preprocessing import wordpiece
from input_preprocessing.__main__ import main
from input_preprocessing.toy_corpus import make_corpus
from input_preprocessing.wordpiece import ALPHABET_LIMIT, SPECIAL_TOKENS, TIE_BREAK, train_vocab

PKG = Path(__file__).resolve().parents[2]
pytest.importorskip("tokenizers")


def docstrings(root: Path) -> Path:
    """Real English text the tests can build: the standard library's docstrings as
    tools/pretrain_demo.py writes them (3 training parts, ~180 KB)."""
    sys.path.insert(0, str(PKG / "tools"))
    import pretrain_demo

    pretrain_demo.write_corpus(root, max_docs=1200, parts=3)
    return root / "train"


@pytest.mark.parametrize("corpus, size", [("docstrings", 2000), ("syllables", 1500)])
def test_the_same_corpus_makes_the_same_vocab_three_times(tmp_path, capsys, corpus, size):
    """The CLI three times: one file, byte for byte."""
    text = docstrings(tmp_path / "doc") if corpus == "docstrings" else tmp_path / "syl"
    if corpus == "syllables":
        make_corpus(text, parts=3, docs_per_part=40, seed=1)
    digests = set()
    for i in range(3):
        out = tmp_path / f"vocab{i}.txt"
        assert main(["vocab", "--input", str(text), "--output", str(out), "--size", str(size)]) == 0
        digests.add(hashlib.md5(out.read_bytes()).hexdigest())
    capsys.readouterr()
    assert len(digests) == 1, digests
    tokens = out.read_text(encoding="utf-8").splitlines()
    assert len(tokens) == size and tuple(tokens[:5]) == SPECIAL_TOKENS
    assert len(set(tokens)) == size and any(t.startswith("##") and len(t) > 3 for t in tokens)


# Each word once: every pair is seen once, a tie everywhere. The text lists the words in the
# reverse of the order the rule takes them, so that no first-seen order can pass for it.
@pytest.mark.parametrize("text, size, after_specials", [
    # the second piece decides: ##b is numbered before ##c ... (before training, by code point)
    ("xg xf xe xd xc xb\n", 20, "b c d e f g x ##b ##c ##d ##e ##f ##g xb xc"),
    # the first piece decides: b before c ...
    ("gz fz ez dz cz bz\n", 15, "b c d e f g z ##z bz cz"),
    # a merged piece is numbered when made, after every starting piece: of the three pairs seen
    # twice, (x, ##b) goes first; then (##y, ##z) before (xb, ##y), xb being the newer piece;
    # then xbyz, then yy (seen once)
    ("xbyz xbyz yy\n", 16, "b x y z ##b ##y ##z xb ##yz xbyz yy"),
])
def test_ties_go_as_the_help_says(tmp_path, text, size, after_specials):
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "part-0.txt").write_text(text, encoding="utf-8")
    for i in range(3):
        got = train_vocab([tmp_path / "text" / "part-0.txt"], tmp_path / f"v{i}.txt", size=size)
        assert got.read_text(encoding="utf-8").split() == [*SPECIAL_TOKENS, *after_specials.split()]


def test_the_alphabet_keeps_the_most_frequent_characters_and_the_lower_code_point_on_a_tie(tmp_path):
    """More distinct characters than the alphabet holds, most of them seen once: the frequent
    ones are kept, then those seen once by code point (the trainer alone drops an arbitrary
    set of the ones seen once)."""
    cjk = [chr(0x4E00 + i) for i in range(ALPHABET_LIMIT + 100)]  # each its own word (the normalizer spaces them)
    part = tmp_path / "part-0.txt"
    part.write_text(" ".join(reversed(cjk)) + "\nab ab ab\n", encoding="utf-8")
    tokens = train_vocab([part], tmp_path / "v.txt", size=10).read_text(encoding="utf-8").split()
    assert tokens == [*SPECIAL_TOKENS, "a", "b", *cjk[:ALPHABET_LIMIT - 2], "##b"]


def test_a_continuation_piece_the_count_missed_gives_the_same_vocab(tmp_path, monkeypatch):
    """Should the count of starting pieces miss a character that continues a word, the
    trainer would number its ``##`` piece itself, in hash-map order: the vocab is then trained
    again with it, and comes out as if it had not been missed."""
    text = tmp_path / "syl"
    files = make_corpus(text, parts=2, docs_per_part=20, seed=3)
    want = train_vocab(files, tmp_path / "want.txt", size=800).read_bytes()
    real = wordpiece._starting_pieces

    def missing_two(*a, **kw):
        alphabet, continuing = real(*a, **kw)
        return alphabet, continuing[2:]

    monkeypatch.setattr(wordpiece, "_starting_pieces", missing_two)
    trained = []
    real_train = wordpiece._train
    monkeypatch.setattr(wordpiece, "_train", lambda *a: trained.append(a[-1]) or real_train(*a))
    assert train_vocab(files, tmp_path / "got.txt", size=800).read_bytes() == want
    assert len(trained) == 2 and len(trained[1]) == len(trained[0]) + 2


def test_the_help_states_the_tie_break(capsys):
    with pytest.raises(SystemExit):
        main(["vocab", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "byte for byte, on every run and machine" in out and " ".join(TIE_BREAK.split()) in out
