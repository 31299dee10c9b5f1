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
