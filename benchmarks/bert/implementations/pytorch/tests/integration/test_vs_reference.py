"""create and eval against the reference itself: the integration tier's (processes started, or
long); tests/unit/test_vs_reference.py has the rest and says what the file covers."""

from __future__ import annotations

import unicodedata

from bench import google_bert
from input_preprocessing.create import load_vocab
from input_preprocessing.wordpiece import Tokenizer


def test_every_code_point_in_context_tokenizes_as_the_reference(tmp_path):
    """Each code point but the surrogates and "\\n": inside a word and alone, both casings;
    the assigned ones also beside a capital sigma (the Final_Sigma context). Compared word for
    word with the reference's BasicTokenizer, and id for id with its FullTokenizer on a vocab
    of every character the lines hold."""
    g = google_bert.load()
    points = [c for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF and c != 10]
    assigned = [c for c in points if unicodedata.category(chr(c)) not in ("Cn", "Co")]

    def lines(cps, context):
        return [" ".join(context(chr(c)) for c in cps[i:i + 32]) for i in range(0, len(cps), 32)]

    cases = [(True, lines(points, lambda s: f"a{s}b {s}")),
             (True, lines(assigned, lambda s: f"ΑΣ{s} a{s}Σ")),
             (False, lines(assigned, lambda s: f"a{s}b {s}"))]
    for lowercase, ls in cases:
        basic = g.tokenization.BasicTokenizer(do_lower_case=lowercase)
        mine = Tokenizer(["[UNK]"], lowercase)
        bad = [(ln, want, got) for ln in ls if (want := basic.tokenize(ln)) != (got := mine.words(ln))]
        assert not bad, f"{len(bad)} of {len(ls)} lines differ (lowercase={lowercase}), first: {bad[0]}"
    # ids: a vocab of every word piece the reference makes of a slice of the sweep
    sample = cases[0][1][::97] + cases[1][1][::31]
    basic = g.tokenization.BasicTokenizer(do_lower_case=True)
    chars = sorted({c for ln in sample for w in basic.tokenize(ln) for c in w})
    vocab = tmp_path / "v.txt"
    vocab.write_text("".join(t + "\n" for t in ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "ab", "##b"]
                             + [t for c in chars for t in (c, "##" + c) if t not in ("ab", "##b")]), encoding="utf-8")
    full = g.tokenization.FullTokenizer(str(vocab), do_lower_case=True)
    mine = Tokenizer(load_vocab(vocab).tokens, True)
    for ln in sample:
        assert mine.ids(ln) == full.convert_tokens_to_ids(full.tokenize(ln)), ln
