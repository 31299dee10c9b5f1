"""create and eval against the reference itself: Google's own ``create_pretraining_data.py``
and ``tokenization.py`` (``bert-tensorflow`` 1.0.4, the algorithm of MLCommons' copies; loaded
by ``bench/google_bert.py`` from ``.venv/oracle``, where ``make venv`` installs it).

Every example our ``create`` writes (the fixed-layout hdf5 file, read back) is compared with
every example the reference writes for the same part (``write_instance_to_example_files``,
its writer kept in memory): token ids, input mask, segment ids, masked positions and ids,
their weights, the next-sentence label, in order. The parts: generated text of mixed scripts
with the characters the two tokenizers of the issue disagreed on (Greek capitals ending in
sigma, line breaks other than "\n", controls, marks, private-use and unassigned code points,
words of 100-250 characters); uncased and cased; the benchmark's flags. The tokenizer alone
is compared on every code point in context; the eval pick on counts where float and integer
arithmetic disagree; the vocab refusal against what the reference would do.
"""

from __future__ import annotations

import random
import unicodedata
from pathlib import Path

import h5py
import numpy as np
import pytest

from bench import google_bert
from input_preprocessing import draws
from input_preprocessing.__main__ import main
from input_preprocessing.common import PrepError
from input_preprocessing.create import CreateOptions, create, load_vocab
from input_preprocessing.pick_eval import pick_indices
from input_preprocessing.wordpiece import train_vocab
from input_preprocessing.wordpiece import Tokenizer


FEATURES = ("input_ids", "input_mask", "segment_ids", "masked_lm_positions", "masked_lm_ids", "next_sentence_labels")


SMALL = CreateOptions(max_seq_length=128, max_predictions_per_seq=20, dupe_factor=2)


# Words of many scripts, each with something a tokenizer can get wrong; escapes where the
# character is invisible or easily mistaken.
WORDS = (
    # Latin: accents precomposed and combining (two marks NFD must reorder), special lowercasings
    "the", "of", "and", "Zürich", "naïve", "café", "Ångström", "façade", "São", "Straße", "\u1e9e", "İstanbul",
    "ıi", "\u01c4", "\u01c5", "\ufb01", "\u216b", "\u212a", "\u212b", "\u2126", "e\u0301\u0323", "o\u0308\u0304",
    "don't", "l'homme", "ＡＢＣ",
    # Greek: capitals ending in sigma (Final_Sigma), behind case-ignorable characters or not
    "ΑΛΕΞΑΝΔΡΟΣ", "ΟΔΥΣΣΕΥΣ", "Σ", "ΣΣ", "ΑΣ", "ΑΣ'", "ΑΣ\u0301", "ΑΣ\u00ad", "ΑΣ\u2019Α", "ΑΣ.Α", "ΑΣ1",
    "λόγος", "ΛΟΓΟΣ.", "ΛΟΓΟΣ,", "ὈΔΥΣΣΕΎΣ", "ΐ", "ς", "σ", "Ἀθῆναι", "ΣΑ",
    # other scripts
    "Москва", "ПРИВЕТ", "Ё", "北京大学", "東京", "ひらがな", "カタカナ", "한국어", "中文,", "\U00020000\U00020001", "〇",
    "ｶﾀｶﾅ", "العربية", "مَرْحَبًا", "עִבְרִית", "\u200fמימין\u200e", "हिन्दी", "தமிழ்", "ไทย", "ພາສາລາວ",
    # emoji, symbols, punctuation in and out of ASCII
    "😀", "👍🏽", "👨\u200d👩\u200d👧", "🇫🇷", "❤\ufe0f", "$5", "€10", "100%", "a^b", "`x`", "~", "©", "°C", "½", "²",
    "…", "—", "–", "“quoted”", "«guillemets»", "¿qué?", "¡sí!", "、", "。", "·", "‰",
    # invisible, control, private-use, unassigned, replacement, noncharacter
    "\u200bzero\u200bwidth", "\ufeffbom", "a\u00a0b", "a\u3000b", "a\u2009b", "a\x01b", "a\x7fb", "x\u00ady",
    "\ue000pua", "\U000f0000", "\u0378x", "\uffff", "a\ufffdb", "a\x00b", "a\u180eb", "a\u061cb", "\U000e0041",
    "a\u034fb", "\u0600\u0661",
    # long words: the reference gives [UNK] above 200 characters (Hugging Face's BERT: above 100)
    "x" * 150, "y" * 199, "z" * 200, "w" * 201, "é" * 120, "a" * 250, "ab" * 60,
)


# Characters that end a line for str.splitlines() but not for the reference (it reads to "\n")
BREAKS = ("\u2028", "\u2029", "\u0085", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x1f", "\r")


# What may stand between two documents: blank to the reference (strip() empties it) or not
# (a line of a zero-width space has no tokens, but it is not blank: no document ends there)
GAPS = ("\n\n", "\n\n", "\n\n", "\n \n", "\n\u00a0\n", "\n\u2028\n", "\n\n\n", "\r\n\r\n", "\n\u200b\n", "\n\t\x0b\n")


def mixed_text(seed: int, documents: int) -> str:
    rng = random.Random(seed)
    plain = ["time", "world", "river", "north", "history", "music", "city", "played", "known"]
    docs = []
    for _ in range(documents):
        sents = []
        for _ in range(rng.randint(1, 12)):
            ws = [rng.choice(WORDS) if rng.random() < 0.35 else rng.choice(plain) for _ in range(rng.randint(1, 25))]
            if rng.random() < 0.15:
                ws.insert(rng.randint(0, len(ws)), rng.choice(BREAKS))
            sents.append(rng.choice((" ", " ", " ", "\t", "  ")).join(ws) + rng.choice((".", ".", "!", "?", "")))
        docs.append("\n".join(sents))
    text = docs[0]
    for d in docs[1:]:
        text += rng.choice(GAPS) + d
    return text + "\n"


def rich_vocab(texts: list[str], path: Path, lowercase: bool, tmp: Path) -> Path:
    """A WordPiece vocab trained on the text, plus every character the reference's basic
    tokenizer makes of it, alone and as a ## piece: a character the two tokenizers treat
    differently then gives another id, not [UNK] on both sides."""
    files = []
    for i, t in enumerate(texts):
        files.append(tmp / f"train_{i}.txt")
        files[-1].write_text(t, encoding="utf-8")
    train_vocab(files, path, size=3000, lowercase=lowercase)
    tokens = path.read_text(encoding="utf-8").split("\n")[:-1]
    basic = google_bert.load().tokenization.BasicTokenizer(do_lower_case=lowercase)
    chars = sorted({c for t in texts for line in t.split("\n") for w in basic.tokenize(line) for c in w})
    have = set(tokens)
    tokens += [t for c in chars for t in (c, "##" + c) if t not in have]
    path.write_text("".join(t + "\n" for t in tokens), encoding="utf-8")
    assert len(tokens) == len(set(tokens)) < 32768
    return path


def reference(part: Path, vocab: Path, o: CreateOptions) -> dict[str, np.ndarray]:
    """What the reference writes for ``part`` alone (as MLPerf runs it, one part a run)."""
    g = google_bert.load()
    cpd = g.create_pretraining_data
    tok = g.tokenization.FullTokenizer(str(vocab), do_lower_case=o.lowercase)
    inst = cpd.create_training_instances([str(part)], tok, o.max_seq_length, o.dupe_factor, o.short_seq_prob,
                                         o.masked_lm_prob, o.max_predictions_per_seq, random.Random(o.seed))
    cpd.write_instance_to_example_files(inst, tok, o.max_seq_length, o.max_predictions_per_seq, ["part"])
    rows = [e.values() for e in g.written["part"]]
    assert rows, "the reference made no example"
    return {k: np.array([r[k] for r in rows]) for k in rows[0]}


def ours(part: Path, vocab: Path, o: CreateOptions, out: Path) -> dict[str, np.ndarray]:
    create(part.parent, vocab, out, o, workers=1, pattern=part.name)
    with h5py.File(out / (part.stem + ".hdf5")) as f:
        return {k: f[k][()] for k in f}


def assert_same(ref: dict[str, np.ndarray], got: dict[str, np.ndarray]) -> int:
    n = len(ref["input_ids"])
    assert len(got["input_ids"]) == n, f"{len(got['input_ids'])} examples, the reference {n}"
    for k in FEATURES:
        r = ref[k].reshape(got[k].shape)
        bad = np.nonzero((r != got[k]).reshape(n, -1).any(axis=1))[0]
        assert not len(bad), f"{k} differs in {len(bad)} of {n} examples, first #{bad[0]}: {got[k][bad[0]]} vs {r[bad[0]]}"
    np.testing.assert_array_equal(ref["masked_lm_weights"], (got["masked_lm_positions"] != 0).astype(float))
    return n


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """Three parts of mixed text and the vocabs (uncased, cased) trained on them."""
    root = tmp_path_factory.mktemp("mixed")
    (root / "text").mkdir()
    texts = [mixed_text(seed, 120) for seed in range(3)]
    parts = []
    for i, t in enumerate(texts):
        parts.append(root / "text" / f"part-{i:05d}.txt")
        parts[-1].write_bytes(t.encode("utf-8"))
    return parts, {lc: rich_vocab(texts, root / f"vocab_{lc}.txt", lc, root) for lc in (True, False)}


def test_the_oracle_is_googles_and_loads_without_touching_our_bert():
    import sys

    import bert

    before = set(sys.modules)  # tensorboard (tests/unit/test_curves.py) brings absl with it
    g = google_bert.load()
    assert Path(g.tokenization.__file__).parent == google_bert.ORACLE_DIR / "bert"
    loaded = set(sys.modules) - before
    assert sys.modules["bert"] is bert and "tensorflow" not in sys.modules and "absl" not in loaded
    assert (google_bert.ORACLE_DIR / f"bert_tensorflow-{google_bert.VERSION}.dist-info").is_dir()


@pytest.mark.parametrize("lowercase", [True, False], ids=["uncased", "cased"])
def test_every_example_of_mixed_scripts_is_the_reference_s(mixed, tmp_path, lowercase):
    parts, vocabs = mixed
    o = CreateOptions(**{**SMALL.__dict__, "lowercase": lowercase})
    counts = [assert_same(reference(p, vocabs[lowercase], o), ours(p, vocabs[lowercase], o, tmp_path / p.stem))
              for p in parts]
    assert min(counts) > 300


def test_the_benchmark_s_flags_through_the_cli(mixed, tmp_path):
    """seq 512, 76 predictions, dupe factor 10, seed 12345: create's defaults, as MLPerf runs it."""
    parts, vocabs = mixed
    out = tmp_path / "out"
    assert main(["create", "--input", str(parts[0].parent), "--pattern", parts[0].name, "--vocab",
                 str(vocabs[True]), "--output", str(out), "--workers", "1"]) == 0
    with h5py.File(out / (parts[0].stem + ".hdf5")) as f:
        got = {k: f[k][()] for k in f}
    assert assert_same(reference(parts[0], vocabs[True], CreateOptions()), got) > 500


def test_the_exact_fallback_draws_are_the_reference_s_too(mixed, tmp_path, monkeypatch):
    """Where the word stream does not reproduce random.Random (another interpreter), create
    draws through random.Random itself: both paths give the reference's examples."""
    parts, vocabs = mixed
    made = []
    real = draws.reference_random

    def forced(seed):
        made.append(type(real(seed)))
        return draws.Exact(seed)

    monkeypatch.setattr("input_preprocessing.create.reference_random", forced)
    assert_same(reference(parts[1], vocabs[True], SMALL), ours(parts[1], vocabs[True], SMALL, tmp_path / "o"))
    assert made == [draws.Stream]  # on this interpreter the fast path would have been taken


def _part(tmp: Path, name: str, text: str) -> Path:
    (tmp / "text").mkdir(exist_ok=True)
    p = tmp / "text" / name
    p.write_bytes(text.encode("utf-8"))
    return p


def test_line_breaks_other_than_newline_stay_inside_their_line(tmp_path):
    """U+2028/2029/0085, FF, VT, U+001C-1F and a lone CR inside a sentence, alone on a line,
    at its ends: the reference's lines end at "\\n" only (and a line its strip() empties is a
    document break)."""
    rng = random.Random(7)
    docs = []
    for d in range(60):
        sents = []
        for s in range(rng.randint(2, 8)):
            c = BREAKS[(d + s) % len(BREAKS)]
            sents.append(rng.choice((f"one two{c}three four five", f"{c}start of it here", f"end of it here{c}",
                                     f"{c}", f"a{c}{c}b c d e f g", f"plain words {d} and {s}")))
        docs.append("\n".join(sents))
    part = _part(tmp_path, "breaks.txt", "\n\n".join(docs) + "\n")
    vocab = rich_vocab([part.read_text(encoding="utf-8")], tmp_path / "v.txt", True, tmp_path)
    n = assert_same(reference(part, vocab, SMALL), ours(part, vocab, SMALL, tmp_path / "o"))
    assert n > 100


def test_greek_capitals_ending_in_sigma_are_lowercased_as_python_does(tmp_path):
    words = ["ΑΛΕΞΑΝΔΡΟΣ", "ΟΔΟΣ.", "ΣΟΦΟΣ'", "ΑΣ\u0301Α", "ΣΑΣ", "Σ", "ΧΑΟΣ\u2019", "ΚΟΣΜΟΣ-ΧΑΟΣ"]
    tok = Tokenizer(["[UNK]"], lowercase=True)
    assert tok.words("ΑΛΕΞΑΝΔΡΟΣ ΟΔΟΣ.") == ["αλεξανδρος", "οδος", "."]  # the final sigma, as str.lower() gives
    rng = random.Random(3)
    docs = ["\n".join(" ".join(rng.choice(words + ["word", "other"]) for _ in range(rng.randint(3, 15)))
                      for _ in range(rng.randint(1, 6))) for _ in range(80)]
    part = _part(tmp_path, "sigma.txt", "\n\n".join(docs) + "\n")
    vocab = rich_vocab([part.read_text(encoding="utf-8")], tmp_path / "v.txt", True, tmp_path)
    assert {"ς", "σ"} <= set(load_vocab(vocab).tokens)
    assert assert_same(reference(part, vocab, SMALL), ours(part, vocab, SMALL, tmp_path / "o")) > 100


def test_wordpiece_splits_and_long_words_as_the_reference(tmp_path):
    vocab = tmp_path / "v.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "un", "##aff", "##able", "x", "##x",
                                "y", "##y", "a", "##a", "##b", "é", "e"]) + "\n", encoding="utf-8")
    full = google_bert.load().tokenization.FullTokenizer(str(vocab), do_lower_case=True)
    mine = Tokenizer(load_vocab(vocab).tokens, True)
    for text in ["unaffable", "unaffablex", "x" * 100, "x" * 101, "x" * 200, "x" * 201, "y" * 150, "ab" * 100,
                 "ab" * 101, "É" * 150, "q", "unq", "a b  c", ""]:
        assert mine.ids(text) == full.convert_tokens_to_ids(full.tokenize(text)), text[:20]
    assert mine.ids("x" * 150) == [load_vocab(vocab).tokens.index("x")] + [load_vocab(vocab).tokens.index("##x")] * 149


def test_a_repeated_vocab_token_is_refused_naming_both_lines(tmp_path, capsys):
    """The reference keeps the first of the two and numbers every later token one lower than
    its line: a silent shift of the ids the shards hold."""
    lines = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "river", "the", "north"]
    vocab = tmp_path / "dup.txt"
    vocab.write_text("\n".join(lines) + "\n", encoding="utf-8")
    ref = google_bert.load().tokenization.load_vocab(str(vocab))
    assert ref["north"] == 7 != lines.index("north")  # what we refuse to let happen
    with pytest.raises(PrepError, match=r"dup.txt: line 8 repeats the token 'the' of line 6"):
        load_vocab(vocab)
    part = _part(tmp_path, "p.txt", "the river\nthe north\n")
    for argv in (["create", "--input", str(part.parent), "--vocab", str(vocab), "--output", str(tmp_path / "o")],
                 ["check", "--input", str(tmp_path), "--vocab", str(vocab)]):
        assert main(argv) == 2
        assert "line 8 repeats the token 'the' of line 6" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_vocab_lines_end_at_newline_only(tmp_path):
    """A token holding U+2028 or a form feed is one line to the reference, as to us."""
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a\u2028b", "c\x0cd", " padded ", "e"]
    vocab = tmp_path / "v.txt"
    vocab.write_text("\n".join(tokens) + "\n", encoding="utf-8")
    ref = google_bert.load().tokenization.load_vocab(str(vocab))
    assert list(load_vocab(vocab).tokens) == list(ref) and len(ref) == 9


@pytest.mark.parametrize("total,n", [(30, 22), (10, 4), (100, 7), (12345, 10000), (400000, 10000), (10000, 10000)])
def test_eval_pick_is_the_reference_s_float_ratio(total, n):
    """pick_eval_samples.py keeps records[int(i * (N / n))]: a float product, which rounds
    below an integer where i * N // n does not (N=30, n=22: i=11 gives 14, not 15)."""
    want = [int(i * (total / n)) for i in range(n)]
    assert pick_indices(total, n).tolist() == want
    if (total, n) == (30, 22):
        assert want[11] == 14 and 11 * 30 // 22 == 15


def test_eval_pick_differs_from_integer_arithmetic_where_the_reference_does():
    hits = 0
    for total in range(10000, 12000, 7):
        got = pick_indices(total, 10000).tolist()
        assert got == [int(i * (total / 10000)) for i in range(10000)]
        hits += got != (np.arange(10000) * total // 10000).tolist()
    assert hits > 0  # the counts tried include some where the two arithmetics part


def test_draws_are_random_random_s():
    """The word stream against random.Random itself: a random mix of every draw create makes,
    over seeds and sizes that cross the bit-length boundaries of below(n)."""
    for seed in (0, 1, 12345, 2**40 + 3):
        ours_, theirs = draws.Stream(seed), draws.Exact(seed)
        plan = random.Random(seed + 1)
        for _ in range(400):
            op, m = plan.randrange(5), plan.choice([0, 1, 2, 3, 4, 127, 128, 129, 255, 256, 257, 509, 4097, 70000])
            if op == 0:
                a, b = list(range(m)), list(range(m))
                ours_.shuffle(a)
                theirs.shuffle(b)
                assert a == b
            elif op == 1:
                n = plan.randint(0, m)
                assert ours_.shuffle_head(list(range(m)), n) == theirs.shuffle_head(list(range(m)), n)
            elif op == 2:
                size = plan.choice([5, 30522, 32768, 65536])
                assert ours_.mask_kinds(m % 90, size) == theirs.mask_kinds(m % 90, size)
            elif op == 3:
                assert ours_.halves(m % 600) == theirs.halves(m % 600)
            else:
                assert ours_.randint(2, m + 2) == theirs.randint(2, m + 2) and ours_.random() == theirs.random()
        assert ours_.random() == theirs.random()


def test_check_digests_say_a_part_made_by_the_reference_is_ours(mixed, tmp_path, capsys):
    """The reference's examples of a part, written to hdf5 as NVIDIA's scripts lay them out
    (int64, padded), and ours of the same part, in both layouts: one examples_md5, which
    `check --digests` writes; another part's differs."""
    parts, vocabs = mixed
    ref = reference(parts[0], vocabs[True], SMALL)
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    with h5py.File(theirs / "part-00000.hdf5", "w") as f:
        for k in FEATURES:
            f.create_dataset(k, data=ref[k].reshape(len(ref[k]), -1).squeeze(-1) if k == "next_sentence_labels"
                             else ref[k])
    create(parts[0].parent, vocabs[True], tmp_path / "fixed", SMALL, pattern="part-0000[01].txt")
    create(parts[0].parent, vocabs[True], tmp_path / "variable", CreateOptions(**{**SMALL.__dict__, "layout": "variable"}),
           pattern="part-0000[01].txt")
    digests = {}
    for name in ("theirs", "fixed", "variable"):
        assert main(["check", "--input", str(tmp_path / name), "--vocab", str(vocabs[True]), "--max-seq-length", "128",
                     "--digests", str(tmp_path / f"{name}.md5")]) == 0
        capsys.readouterr()
        digests[name] = dict(ln.split("  ")[::-1] for ln in (tmp_path / f"{name}.md5").read_text().splitlines())
    assert digests["theirs"]["part-00000.hdf5"] == digests["fixed"]["part-00000.hdf5"] == \
        digests["variable"]["part-00000.hdf5"] != digests["fixed"]["part-00001.hdf5"]


def test_a_run_of_another_tokenizer_is_not_resumed(mixed, tmp_path):
    """A directory an older create (Hugging Face's tokenizer) or another Python's Unicode
    tables began is refused, not completed with parts made otherwise."""
    import json

    parts, vocabs = mixed
    out = tmp_path / "o"
    create(parts[0].parent, vocabs[True], out, SMALL, pattern=parts[0].name)
    record = json.loads((out / ".run.json").read_text())
    assert record["params"]["tokenizer"] == f"reference, Unicode {unicodedata.unidata_version}"
    del record["params"]["tokenizer"]  # as the create before this one wrote it
    (out / ".run.json").write_text(json.dumps(record))
    with pytest.raises(PrepError, match=r"already holds a different run \(different tokenizer\)"):
        create(parts[0].parent, vocabs[True], out, SMALL, pattern=parts[0].name)
