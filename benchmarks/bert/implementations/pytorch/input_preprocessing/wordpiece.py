"""The reference's tokenizer, restated on token ids: Google BERT's ``tokenization.py``
(``FullTokenizer``: ``BasicTokenizer`` then ``WordpieceTokenizer``), as MLPerf's
``create_pretraining_data.py`` runs it, and its ``load_vocab``.

Per line of text, as the reference does it:

1. clean: drop U+0000, U+FFFD and every control character (Unicode category Cc or Cf, less
   tab, newline and carriage return); turn whitespace (space, tab, newline, carriage return,
   category Zs) into a space;
2. put spaces around every CJK ideograph (the reference's eight code-point ranges);
3. split at whitespace (Python's ``str.split()``);
4. uncased: lowercase each word with Python's ``str.lower()`` (Unicode's full mappings,
   Final_Sigma included: a capital sigma ending a word becomes a final sigma), decompose it
   (NFD) and drop the nonspacing marks (category Mn);
5. split every punctuation character off into a word of its own (ASCII's non-alphanumeric
   printable characters, and category P*);
6. WordPiece: greedy longest match first, continuation pieces prefixed ``##``; a word that
   has no such split, or has more than 200 characters, becomes ``[UNK]``.

Every character class is Python's ``unicodedata`` on the running interpreter, as in the
reference (``UNICODE_VERSION`` says which tables). Hugging Face ``tokenizers``' BERT
normalizer differs from it (it lowercases character by character, drops unassigned and
private-use characters, has other tables and stops at 100 characters a word), so it is not
used here.

Steps 1, 2, 4 and 5 are applied to the whole line rather than word by word: they map one
character at a time, except the two that look at neighbours, neither of which crosses
whitespace (NFD reorders only combining marks, and whitespace is none; Final_Sigma looks past
case-ignorable characters only, and whitespace is not one). The tables are filled on first
sight of a character and the WordPiece split of each distinct word is kept, so a part costs
about one dictionary look-up per character and per word.

``train_vocab`` makes a ``vocab.txt`` from a corpus (``python -m input_preprocessing vocab``):
Hugging Face ``tokenizers``' WordPiece trainer (BPE merges over the words of its BERT
normalizer and pre-tokenizer, continuation pieces prefixed ``##``), made to give the same bytes
on every run and machine. Left alone, the trainer numbers the ``##`` pieces of single
characters in the order it walks a hash map, which changes from run to run, and breaks ties
between pairs seen equally often by those numbers (huggingface/tokenizers#1794): another run
gives other pieces, or the same pieces at other ids. Here every starting piece is numbered
before the trainer runs (``TIE_BREAK`` says how), so it creates none of its own.
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter
from pathlib import Path
from typing import Iterable, Sequence

from .common import PrepError, reference_lines

UNICODE_VERSION = unicodedata.unidata_version
UNK = "[UNK]"
MAX_WORD_CHARS = 200  # the reference's max_input_chars_per_word
SPECIAL_TOKENS = ("[PAD]", UNK, "[CLS]", "[SEP]", "[MASK]")  # ids 0-4 of a vocab train_vocab makes
CONTINUATION = "##"
ALPHABET_LIMIT = 1000  # characters kept as pieces (tokenizers' BertWordPieceTokenizer.train keeps as many)
# How train_vocab decides what hash-map order decided: the rule the vocab step's --help states.
TIE_BREAK = (f"Tokens are numbered in this order: BERT's special tokens, then the {ALPHABET_LIMIT:,} most "
             "frequent characters of the words (equal counts: the lower code point kept) by code point, then "
             "'##' and each of them that continues a word, by code point, then each merged piece as it is "
             "made. Each merge joins the pair of pieces seen most often side by side in a word; among pairs "
             "seen equally often, the one whose first piece has the lower number, then whose second piece has.")
# What str.split() takes for whitespace and the BERT normalizer deletes (control characters):
# taken out before splitting, so a word is split where the trainer splits it.
_SPLIT_ONLY_IN_PYTHON = re.compile("[\x0b\x0c\x1c-\x1f\x85]")


def vocab_tokens(path: Path, raw: bytes) -> list[str]:
    """The tokens of a ``vocab.txt`` as the reference reads it, token id = position: a line
    ends at "\\n" only (TensorFlow's GFile), each line stripped of whitespace (Python's
    ``str.strip``). A token on two lines is refused, naming both: the reference keeps the
    first and numbers the next token one lower, so every later id would differ from its
    line's."""
    tokens = reference_lines(path, raw, "vocab is ")
    first: dict[str, int] = {}
    for i, t in enumerate(tokens):
        j = first.setdefault(t, i)
        if j != i:
            raise PrepError(f"{path}: line {i + 1} repeats the token {t!r} of line {j + 1} (a token must appear "
                            "once: the reference would give every token after it the id of its line minus one)")
    return tokens


def _is_cjk(cp: int) -> bool:
    return (0x4E00 <= cp <= 0x9FFF or 0x3400 <= cp <= 0x4DBF or 0x20000 <= cp <= 0x2A6DF
            or 0x2A700 <= cp <= 0x2B73F or 0x2B740 <= cp <= 0x2B81F or 0x2B820 <= cp <= 0x2CEAF
            or 0xF900 <= cp <= 0xFAFF or 0x2F800 <= cp <= 0x2FA1F)


def _is_punctuation(c: str) -> bool:
    cp = ord(c)
    return 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126 or \
        unicodedata.category(c).startswith("P")


class _Memo(dict):
    """A str.translate table filled per character on first sight, by ``_map``."""

    def _map(self, c: str) -> str | None:
        raise NotImplementedError

    def __missing__(self, cp: int) -> str | None:
        out = self[cp] = self._map(chr(cp))
        return out


class _Clean(_Memo):
    """str.translate table of steps 1-2."""

    def _map(self, c: str) -> str | None:
        cp, cat = ord(c), unicodedata.category(c)
        if c in "\t\n\r" or cat == "Zs":
            return " "
        if cp == 0 or cp == 0xFFFD or cat in ("Cc", "Cf"):
            return None
        return f" {c} " if _is_cjk(cp) else c


class _Pieces(_Memo):
    """str.translate table of steps 4 (the nonspacing marks, when uncased) and 5."""

    def __init__(self, strip_marks: bool) -> None:
        super().__init__()
        self.strip_marks = strip_marks

    def _map(self, c: str) -> str | None:
        if self.strip_marks and unicodedata.category(c) == "Mn":
            return None
        return f" {c} " if _is_punctuation(c) else c


class Tokenizer:
    """``FullTokenizer(vocab, do_lower_case=lowercase)`` of the reference, on ids.

    Holds what it has seen (the character tables, each distinct word's pieces): one per part.
    """

    def __init__(self, tokens: Sequence[str], lowercase: bool = True) -> None:
        self.vocab = {t: i for i, t in enumerate(tokens)}
        if UNK not in self.vocab:
            raise PrepError(f"the vocab lacks {UNK}")
        self.unk = self.vocab[UNK]
        self.lowercase = lowercase
        self._clean = _Clean()
        self._pieces = _Pieces(strip_marks=lowercase)
        self._words: dict[str, list[int]] = {}

    def words(self, text: str) -> list[str]:
        """Steps 1-5: the reference's ``BasicTokenizer.tokenize``."""
        t = text.translate(self._clean)
        if self.lowercase:
            t = t.lower()
            if not t.isascii():  # NFD leaves ASCII as it is
                t = unicodedata.normalize("NFD", t)
        return t.translate(self._pieces).split()

    def _wordpiece(self, word: str) -> list[int]:
        if len(word) > MAX_WORD_CHARS:
            return [self.unk]
        vocab, out, start, n = self.vocab, [], 0, len(word)
        while start < n:
            end = n
            while start < end:
                piece = word[start:end] if start == 0 else "##" + word[start:end]
                found = vocab.get(piece)
                if found is not None:
                    break
                end -= 1
            else:
                return [self.unk]  # no piece of the vocab starts here: the whole word is unknown
            out.append(found)
            start = end
        return out

    def ids(self, text: str) -> list[int]:
        """Token ids of one line: ``convert_tokens_to_ids(tokenize(text))``."""
        seen, out = self._words, []
        for w in self.words(text):
            pieces = seen.get(w)
            if pieces is None:
                pieces = seen[w] = self._wordpiece(w)
            out.extend(pieces)
        return out


def _word_chunks(files: Sequence[Path]) -> Counter:
    """Each whitespace-separated chunk of the corpus's raw text with its count (what the BERT
    normalizer and pre-tokenizer cut into the trainer's words), read 1 MB of lines at a time."""
    chunks: Counter = Counter()
    for f in files:
        try:
            with open(f, encoding="utf-8", newline="") as fh:
                while lines := fh.readlines(1 << 20):
                    chunks.update(_SPLIT_ONLY_IN_PYTHON.sub("", "".join(lines)).split())
        except UnicodeDecodeError as e:
            raise PrepError(f"{f}: not UTF-8 (byte 0x{e.object[e.start]:02x}): the vocab step reads UTF-8 text") from None
    return chunks


def _starting_pieces(chunks: Counter, normalizer, pre_tokenizer) -> tuple[list[str], list[str]]:
    """The alphabet (the ``ALPHABET_LIMIT`` most frequent characters of the words, equal counts
    to the lower code point; by code point) and the characters of it that continue a word (by
    code point): the pieces the trainer starts from. Normalizes each distinct chunk once (a
    call into tokenizers per chunk: ~0.1 s for the 25,000 of a 4 MB corpus)."""
    chars: Counter = Counter()
    normalized = []
    for chunk, n in chunks.items():
        text = normalizer.normalize_str(chunk)
        normalized.append(text)
        for c, k in Counter(text).items():
            chars[c] += k * n
    chars.pop(" ", None)  # the normalizer's word gaps (whitespace, around CJK): no word holds one
    alphabet = sorted(sorted(chars, key=lambda c: (-chars[c], c))[:ALPHABET_LIMIT])
    words = pre_tokenizer.pre_tokenize_str(" ".join(normalized))
    following = set("".join(w[1:] for w, _ in words))
    return alphabet, [c for c in alphabet if c in following]


def _train(files: Sequence[Path], size: int, lowercase: bool, alphabet: list[str],
           continuing: Iterable[str]) -> list[str]:
    """The trainer's tokens by id, ``alphabet`` and ``continuing`` numbered before it runs."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers  # the [prep] extra

    tok = Tokenizer(models.WordPiece(unk_token=UNK))
    tok.normalizer = _normalizer(lowercase)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    # Given as special tokens, every starting piece is numbered in this order before training;
    # initial_alphabet with the limit at its size keeps exactly this alphabet.
    seeds = [*SPECIAL_TOKENS, *alphabet, *(CONTINUATION + c for c in continuing)]
    trainer = trainers.WordPieceTrainer(vocab_size=size, min_frequency=1, show_progress=False, special_tokens=seeds,
                                        limit_alphabet=len(alphabet), initial_alphabet=alphabet,
                                        continuing_subword_prefix=CONTINUATION)
    tok.train([str(f) for f in files], trainer)
    return [t for t, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1])]


def _normalizer(lowercase: bool):
    from tokenizers import normalizers  # the [prep] extra

    # as create tokenizes: uncased lowercases and strips accents, cased does neither
    return normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, strip_accents=lowercase,
                                      lowercase=lowercase)


def train_vocab(files: Sequence[Path], path: str | Path, size: int = 2000, lowercase: bool = True) -> Path:
    """A BERT WordPiece ``vocab.txt`` of about ``size`` tokens (the special tokens first; uncased
    unless ``lowercase=False``) learned from ``files``: the same bytes for the same corpus on
    every run and machine (``TIE_BREAK``). Costs a pass over the text in Python before the
    trainer's own (BENCHMARKS.md section 16) and a dict of the corpus's distinct chunks."""
    from tokenizers import pre_tokenizers  # the [prep] extra

    alphabet, continuing = _starting_pieces(_word_chunks(files), _normalizer(lowercase),
                                           pre_tokenizers.BertPreTokenizer())
    tokens = _train(files, size, lowercase, alphabet, continuing)
    # A ## piece of one character the trainer made itself was numbered in hash-map order: train
    # again with it among the starting pieces (the count above would have to differ from the
    # trainer's split for this; the result is then the same as if it had not).
    made = {t[len(CONTINUATION):] for t in tokens if t.startswith(CONTINUATION) and len(t) == len(CONTINUATION) + 1}
    missed = made - set(continuing)
    if missed:
        tokens = _train(files, size, lowercase, alphabet, sorted({*continuing, *missed}))
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text("".join(t + "\n" for t in tokens), encoding="utf-8")
    return p
