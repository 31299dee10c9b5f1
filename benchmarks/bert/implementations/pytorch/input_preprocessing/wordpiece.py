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
"""

from __future__ import annotations

import unicodedata
from pathlib import Path
from typing import Sequence

from .common import PrepError, reference_lines

UNICODE_VERSION = unicodedata.unidata_version
UNK = "[UNK]"
MAX_WORD_CHARS = 200  # the reference's max_input_chars_per_word


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
