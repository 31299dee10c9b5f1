"""create: text parts + vocab.txt -> pretraining examples (NSP pairs, masked LM), one hdf5 per part.

The algorithm is the reference ``create_pretraining_data.py`` (Google BERT's, which MLPerf runs
over each of the 500 Wikipedia parts with the same flags and seed), restated on token ids,
example for example:

1. read the part: a line ends at "\\n" only (TensorFlow's GFile); each line stripped
   (Python's ``str.strip``); a blank line starts a new document; every other line is
   tokenized with the reference's tokenizer (``wordpiece.py``), and kept when it has tokens;
   documents without any are dropped; shuffle the documents;
2. ``dupe_factor`` times, for every document: fill chunks of sentences up to a target length
   (``max_seq_length - 3``, or with probability ``short_seq_prob`` a random length from 2),
   split each chunk at a random sentence into A and B; with probability 1/2 (or when the
   chunk is one sentence) B is replaced by text from a random other document and the unused
   sentences are put back; trim the longer side at a random end until the pair fits;
3. mask: ``min(max_predictions, max(1, round(len * masked_lm_prob)))`` positions, chosen by
   shuffling every non-[CLS]/[SEP] position; each becomes [MASK] (80%), itself (10%) or a
   uniformly random vocabulary id (10%); the label is the original token;
4. shuffle the part's examples and write them.

Every random draw is ``random.Random(seed)``'s, one generator per part, in the reference's
order (``draws.py`` makes them faster), so a part's output depends only on its text, the vocab
and the flags: never on which worker ran it or how many there were. The character classes are
Python's ``unicodedata`` on the running interpreter, as the reference's are.

Guards around it, none of which changes an example:

- each part's bytes are hashed (md5) as they are read and the digest recorded beside its shard
  (``OUT/.sources/<shard>.md5``, written after the shard, with the shard's own md5), so a rerun
  skips a part only when its text is the one the shard was made from, whatever its size; and
  two parts with the same text are refused, naming both (every part is seeded alike, so both
  would give the same examples), unless ``allow_same_text``;
- the output directory's md5 list (``OUT/md5sums.txt``) is written at the end from those
  records: every step and run that reads the shards checks them against it;
- the [UNK] rate of the tokenized text: above ``max_unk_rate`` create refuses, naming the
  likely cause (a cased/uncased mismatch between the vocab and ``--cased``). A sample of the
  first parts' text is judged before the output directory is made, every part again before
  its shard is written; fewer than ``MIN_UNK_TOKENS`` tokens are too few to judge.
"""

from __future__ import annotations

import array
import hashlib
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np

from bert.shards import Shard

from .common import (PrepError, input_directory, parallel_map, prepare_output, reference_lines, write_md5_list,
                     write_shard_atomic, write_text)
from .draws import MASK, reference_random
from .wordpiece import UNICODE_VERSION, UNK, Tokenizer, vocab_tokens

SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
MAX_TOKEN_ID = 32767  # shards store token ids as int16
MAX_UNK_RATE = 0.01  # real text with a vocab made for it: under 0.1%; an uncased vocab with --cased: 7-15%
MIN_UNK_TOKENS = 5000  # fewer tokens than this are not judged: a few [UNK]s in a short text are not a rate
PREFLIGHT_BYTES = 1 << 16  # of the first parts' text, tokenized before the output directory is made
SOURCES = ".sources"  # OUT/.sources/<shard>.md5: the md5 of the text part each shard was made from


@dataclass(frozen=True)
class CreateOptions:
    max_seq_length: int = 512
    max_predictions_per_seq: int = 76
    masked_lm_prob: float = 0.15
    short_seq_prob: float = 0.1
    dupe_factor: int = 10
    seed: int = 12345
    lowercase: bool = True  # the benchmark's vocab is uncased
    layout: str = "fixed"  # what create_pretraining_data writes; `shard` converts to variable
    # The reference drops empty documents (two blank lines in a row, or a document whose
    # lines hold no tokens) without a word; we drop them too, and count them in the summary.
    # strict: stop at the first one instead (a sign of a malformed part).
    strict_documents: bool = False

    def check(self) -> None:
        if not 8 <= self.max_seq_length <= 4096:
            raise PrepError(f"max_seq_length must be in [8, 4096], got {self.max_seq_length}")
        if not 1 <= self.max_predictions_per_seq <= self.max_seq_length:
            raise PrepError(f"max_predictions_per_seq must be in [1, max_seq_length], got {self.max_predictions_per_seq}")
        if not 0 < self.masked_lm_prob < 1 or not 0 <= self.short_seq_prob <= 1:
            raise PrepError("masked_lm_prob must be in (0, 1) and short_seq_prob in [0, 1]")
        if self.dupe_factor < 1 or self.seed < 0:
            raise PrepError("dupe_factor must be >= 1 and seed >= 0")
        if self.layout not in ("fixed", "variable"):
            raise PrepError(f"layout must be 'fixed' or 'variable', got {self.layout!r}")


# ---------------------------------------------------------------- vocab and tokenizer


@dataclass(frozen=True)
class Vocab:
    path: Path
    size: int
    cls: int
    sep: int
    mask: int
    unk: int
    md5: str
    tokens: tuple[str, ...] = field(default=(), repr=False, compare=False)  # id = position


def load_vocab(path: str | Path) -> Vocab:
    """Check ``vocab.txt`` (one WordPiece token per line, id = line number, as the reference
    reads it: ``wordpiece.vocab_tokens``)."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        raise PrepError(f"{p}: vocab file does not exist") from None
    except OSError as e:
        raise PrepError(f"{p}: cannot read vocab file: {e.strerror}") from None
    words = vocab_tokens(p, raw)
    if not words:
        raise PrepError(f"{p}: vocab file is empty")
    ids = {w: i for i, w in enumerate(words)}
    missing = [s for s in SPECIALS[1:] if s not in ids]
    if missing:
        raise PrepError(f"{p}: vocab lacks the special token(s) {missing}")
    if len(words) - 1 > MAX_TOKEN_ID:
        raise PrepError(f"{p}: {len(words)} tokens; ids above {MAX_TOKEN_ID} do not fit the int16 shard format")
    return Vocab(p, len(words), ids["[CLS]"], ids["[SEP]"], ids["[MASK]"], ids[UNK], hashlib.md5(raw).hexdigest(),
                 tuple(words))


def unk_cause(tokens: tuple[str, ...], lowercase: bool) -> str:
    """The likely reason a text is full of [UNK]: the vocab's case against create's."""
    cased = sum(1 for t in tokens if t != t.lower() and not (t.startswith("[") and t.endswith("]")))
    if not lowercase and not cased:
        return ("the vocab is uncased (no token holds a capital letter) and --cased keeps the text's capitals: "
                "drop --cased")
    if lowercase and cased:
        return f"the vocab is cased ({cased} tokens hold capital letters) and create lowercases the text: add --cased"
    return ("the vocab was not made for this text (another language or script?): train one on it with "
            "python -m input_preprocessing vocab")


def _judge_unk(where: str, unk: int, tokens: int, max_rate: float, vocab: Vocab, lowercase: bool) -> None:
    if tokens >= MIN_UNK_TOKENS and unk > max_rate * tokens:
        raise PrepError(f"{where}: {unk / tokens:.1%} of its {tokens} tokens are [UNK] (more than --max-unk-rate "
                        f"{max_rate:g}): {unk_cause(vocab.tokens, lowercase)}; or raise --max-unk-rate if this text "
                        "is meant to hold them")


# ---------------------------------------------------------------- reading a part


STRICT_HINT = "drop and count them as the reference does: rerun without --strict-documents"


class PartText(NamedTuple):
    docs: list[list[list[int]]]  # documents of sentences of token ids, before shuffling
    dropped: int  # empty documents dropped
    tokens: int  # tokens of the text
    unk: int  # of them [UNK]


def read_documents(path: Path, raw: bytes, tokenizer: Tokenizer, strict: bool) -> PartText:
    """The documents of a part's bytes ``raw``, and how many empty documents were dropped
    (``strict``: a ``PrepError`` at the first instead)."""
    lines = reference_lines(path, raw)
    if not any(lines):
        raise PrepError(f"{path}: empty part (no text)")

    docs: list[list[list[int]]] = []
    current: list[list[int]] = []
    start, blank_run, dropped, tokens, unk = 0, 0, 0, 0, 0
    unk_id = tokenizer.unk

    def close(line_no: int) -> None:
        nonlocal current, dropped
        if not current:
            if strict:
                raise PrepError(f"{path}: line {line_no}: empty document (no sentence with tokens; "
                                f"{STRICT_HINT})")
            dropped += 1
        else:
            docs.append(current)
        current = []

    for i, ln in enumerate(lines):
        if ln:
            if blank_run:
                start, blank_run = i, 0
            ids = tokenizer.ids(ln)
            if ids:
                current.append(ids)
                tokens += len(ids)
                unk += ids.count(unk_id)
        else:
            blank_run += 1
            if blank_run == 1 and i > 0:
                close(start + 1)
            elif strict:  # a second blank line: an empty document between them
                raise PrepError(f"{path}: line {i + 1}: empty document (two blank lines in a row; {STRICT_HINT})")
            elif i > 0:
                dropped += 1
    if lines[-1]:
        close(start + 1)
    if not docs:
        raise PrepError(f"{path}: no document with tokens")
    return PartText(docs, dropped, tokens, unk)


def read_part(path: Path) -> tuple[bytes, str]:
    """A part's bytes and their md5, hashed as they are read."""
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise PrepError(f"{path}: cannot read: {e.strerror}") from None
    return raw, hashlib.md5(raw).hexdigest()


# ---------------------------------------------------------------- the reference algorithm


def _truncate_pair(a: list[int], b: list[int], max_tokens: int, rng) -> tuple[list[int], list[int]]:
    """The reference's trimming: while the pair is too long, drop one token of the longer side
    (B on a tie), at the front when ``random() < 0.5``, else at the back; here counted, then
    cut once."""
    la, lb = len(a), len(b)
    if la + lb <= max_tokens:
        return a, b
    fa = fb = 0
    for front in rng.halves(la + lb - max_tokens):  # one draw per token dropped
        if la > lb:
            la -= 1
            fa += front
        else:
            lb -= 1
            fb += front
    return a[fa:fa + la], b[fb:fb + lb]


def _example(a: list[int], b: list[int], o: CreateOptions, v: Vocab, rng, is_random: bool,
             positions: list[int]) -> tuple:
    """The draws of masking ``[CLS] a [SEP] b [SEP]``: (its tokens, len(a), the chosen
    positions in the order drawn, what each becomes (``draws.MASK``, ``draws.KEEP`` or an id),
    is_random), the arrays int16 (~1 kB an example, not ~15 kB of Python ints); ``_pack``
    applies them. ``positions``: ``range(S)`` as a list, whose slices copy references instead
    of making an int object per position."""
    la, lb = len(a), len(b)
    # Every position but [CLS] and the two [SEP]s: no text token is either (the tokenizer splits
    # "[" and "]" off every word), so they are these two runs.
    candidates = positions[1:la + 1] + positions[la + 2:la + lb + 2]
    n = min(o.max_predictions_per_seq, max(1, int(round((la + lb + 3) * o.masked_lm_prob))))
    chosen = rng.shuffle_head(candidates, n)  # the first n of the shuffled candidates
    kinds = rng.mask_kinds(len(chosen), v.size)  # drawn in the shuffled order
    return (array.array("h", [v.cls, *a, v.sep, *b, v.sep]), la, array.array("h", chosen),
            array.array("h", kinds), is_random)


def _instances(docs: list[list[list[int]]], d: int, o: CreateOptions, v: Vocab, rng, out: list,
               positions: list[int]) -> None:
    doc = docs[d]
    max_tokens = o.max_seq_length - 3  # [CLS] A [SEP] B [SEP]
    target = max_tokens
    if rng.random() < o.short_seq_prob:
        target = rng.randint(2, max_tokens)
    chunk: list[list[int]] = []
    length, i = 0, 0
    while i < len(doc):
        chunk.append(doc[i])
        length += len(doc[i])
        if i == len(doc) - 1 or length >= target:
            a_end = rng.randint(1, len(chunk) - 1) if len(chunk) >= 2 else 1
            a: list[int] = []
            for s in chunk[:a_end]:
                a.extend(s)
            b: list[int] = []
            if len(chunk) == 1 or rng.random() < 0.5:
                is_random = True
                for _ in range(10):  # the reference's retries for a different document
                    r = rng.randint(0, len(docs) - 1)
                    if r != d:
                        break
                other = docs[r]
                for s in other[rng.randint(0, len(other) - 1):]:
                    b.extend(s)
                    if len(b) >= target - len(a):
                        break
                i -= len(chunk) - a_end  # the unused sentences start the next chunk
            else:
                is_random = False
                for s in chunk[a_end:]:
                    b.extend(s)
            a, b = _truncate_pair(a, b, max_tokens, rng)
            if a and b:  # the reference asserts this; it holds for non-empty sentences
                out.append(_example(a, b, o, v, rng, is_random, positions))
            chunk, length = [], 0
        i += 1


def _int16(rows: list) -> np.ndarray:
    return np.frombuffer(b"".join(rows), np.int16).copy() if rows else np.zeros(0, np.int16)


def _pack(path: Path, inst: list, v: Vocab) -> Shard:
    """The examples, in their order, as a Shard: masks applied, predictions sorted by position.
    Per token only int16/int8 arrays (a 25 MB part holds ~60 million tokens)."""
    n = len(inst)
    lens = np.fromiter((len(x[0]) for x in inst), np.int64, n)
    plens = np.fromiter((len(x[2]) for x in inst), np.int64, n)
    offs, poffs = np.zeros(n + 1, np.int64), np.zeros(n + 1, np.int64)
    np.cumsum(lens, out=offs[1:])
    np.cumsum(plens, out=poffs[1:])
    tokens, pos, kinds = _int16([x[0] for x in inst]), _int16([x[2] for x in inst]), _int16([x[3] for x in inst])
    where = np.repeat(offs[:-1], plens) + pos  # each prediction's token in `tokens`
    labels = tokens[where]
    tokens[where[kinds == MASK]] = v.mask  # MASK: [MASK]; an id >= 0: that id; KEEP: as it was
    replaced = kinds >= 0
    tokens[where[replaced]] = kinds[replaced]
    order = np.argsort(where, kind="stable")  # by example, then position (each is once in its example)
    # segment 1 from B's first token (after [CLS] A [SEP]) to the example's end
    steps = np.zeros(len(tokens) + 1, np.int8)
    steps[offs[:-1] + np.fromiter((x[1] for x in inst), np.int64, n) + 2] = 1
    steps[offs[1:]] = -1
    segments = np.cumsum(steps[:-1], dtype=np.int8)
    nsp = np.fromiter((x[4] for x in inst), np.int8, n)
    return Shard(str(path), tokens, segments, offs, pos[order], labels[order], poffs, nsp)


def examples_of_part(path: Path, docs: list[list[list[int]]], vocab: Vocab, o: CreateOptions) -> Shard:
    """All examples of one text part's documents (``read_documents``), shuffled, as a Shard
    (the unit of parallel work)."""
    rng = reference_random(o.seed)
    rng.shuffle(docs)
    inst: list = []
    positions = list(range(o.max_seq_length))
    for _ in range(o.dupe_factor):
        for d in range(len(docs)):
            _instances(docs, d, o, vocab, rng, inst, positions)
    rng.shuffle(inst)
    if not inst:
        raise PrepError(f"{path}: produced no examples (documents too short?)")
    return _pack(path, inst, vocab)


# ---------------------------------------------------------------- the step


@dataclass(frozen=True)
class _Job:
    path: Path
    out: Path
    vocab: Vocab
    opts: CreateOptions
    max_unk_rate: float
    claims: Path | None  # where parts register their text's md5; None: the same text twice is allowed


class _Done(NamedTuple):
    name: str  # the shard's file name
    md5: str  # the shard's md5
    samples: int  # -1: written by an earlier run from the same text
    tokens: int
    seconds: float
    dropped: int
    text_tokens: int
    unk: int


def output_name(part: Path) -> str:
    return part.name[:-len(part.suffix)] + ".hdf5" if part.suffix == ".txt" else part.name + ".hdf5"


def _source(shard: Path) -> Path:
    return shard.parent / SOURCES / (shard.name + ".md5")


def _made_from(shard: Path) -> tuple[str, str] | None:
    """(the md5 of the text a complete shard was made from, the shard's md5), or None. The
    record is written after the shard's rename: a shard without one (killed in between, or made
    by a create that kept no shard md5) is made again."""
    try:
        lines = _source(shard).read_text(encoding="utf-8").split() if shard.is_file() else []
    except OSError:
        return None
    return (lines[0], lines[1]) if len(lines) == 2 else None


def _claim(claims: Path, md5: str, part: Path) -> None:
    """Register ``part``'s text; a ``PrepError`` naming both parts when another part of this
    run has the same text. A hard link is made or refused atomically, so two workers reading
    copies at the same moment cannot both pass."""
    mark = claims / md5
    tmp = claims / f".{md5}.{os.getpid()}"
    tmp.write_text(str(part), encoding="utf-8")
    try:
        os.link(tmp, mark)
    except FileExistsError:
        other = mark.read_text(encoding="utf-8")
        if other != str(part):
            a, b = sorted((other, str(part)))
            raise PrepError(f"{a} and {b} hold the same text (md5 {md5}): a part given twice makes the same "
                            "examples twice (every part is seeded alike); remove one, or pass --allow-same-text "
                            "if you mean it") from None
    finally:
        tmp.unlink(missing_ok=True)


def _create_one(job: _Job) -> _Done:
    t0 = time.perf_counter()
    raw, md5 = read_part(job.path)
    target = job.out / output_name(job.path)
    made = _made_from(target)
    if made is not None and made[0] == md5:
        if job.claims:
            _claim(job.claims, md5, job.path)
        return _Done(target.name, made[1], -1, 0, 0.0, 0, 0, 0)
    o = job.opts
    text = read_documents(job.path, raw, Tokenizer(job.vocab.tokens, o.lowercase), o.strict_documents)
    if job.claims:
        _claim(job.claims, md5, job.path)
    _judge_unk(str(job.path), text.unk, text.tokens, job.max_unk_rate, job.vocab, o.lowercase)
    shard = examples_of_part(job.path, text.docs, job.vocab, o)
    written = write_shard_atomic(target, shard, o.layout, o.max_seq_length, o.max_predictions_per_seq)
    write_text(_source(target), f"{md5}\n{written}\n")
    return _Done(target.name, written, len(shard), int(len(shard.tokens)), time.perf_counter() - t0, text.dropped,
                 text.tokens, text.unk)


def list_parts(input_dir: str | Path, pattern: str = "*") -> list[Path]:
    d = Path(input_dir)
    if d.is_file():
        raise PrepError(f"{d}: is a file, not a directory; --input takes the directory of the text parts "
                        f"(this part alone: --input {d.parent} --pattern {d.name})")
    input_directory(d, "text parts")
    parts = sorted(p for p in d.glob(pattern) if p.is_file() and not p.name.startswith("."))
    if not parts:
        raise PrepError(f"{d}: no text parts matching {pattern!r}")
    return parts


def _preflight(parts: list[Path], vocab: Vocab, opts: CreateOptions, max_unk_rate: float) -> None:
    """The [UNK] rate of the first ``PREFLIGHT_BYTES`` of text, judged before anything is
    written (a vocab that does not fit fails in a fraction of a second, not after a part)."""
    tok = Tokenizer(vocab.tokens, opts.lowercase)
    left, tokens, unk, read = PREFLIGHT_BYTES, 0, 0, []
    for p in parts:
        try:
            with p.open("rb") as f:
                head = f.read(left + 1)
        except OSError:
            continue  # the part's own read names it
        read.append(p.name)
        if len(head) > left:
            head = head[:head.rfind(b"\n", 0, left) + 1]  # whole lines only
        left -= len(head)
        for line in head.decode("utf-8", "ignore").split("\n"):
            ids = tok.ids(line.strip())
            tokens += len(ids)
            unk += ids.count(tok.unk)
        if left <= 0 or len(head) < p.stat().st_size:
            break
    if read:
        _judge_unk(f"{parts[0].parent}: the first {PREFLIGHT_BYTES - left} bytes of text ({', '.join(read)})",
                   unk, tokens, max_unk_rate, vocab, opts.lowercase)


def create(input_dir: str | Path, vocab_path: str | Path, output_dir: str | Path, opts: CreateOptions = CreateOptions(),
           workers: int = 1, pattern: str = "*", *, max_unk_rate: float = MAX_UNK_RATE,
           allow_same_text: bool = False) -> dict:
    """Every part of ``input_dir`` -> ``output_dir/<part>.hdf5``; returns a summary with throughput."""
    opts.check()
    if not 0 <= max_unk_rate <= 1:
        raise PrepError(f"max_unk_rate must be in [0, 1], got {max_unk_rate}")
    parts = list_parts(input_dir, pattern)
    vocab = load_vocab(vocab_path)
    _preflight(parts, vocab, opts, max_unk_rate)
    # The tokenizer and its Unicode tables decide the examples as much as the flags: a run is
    # not resumed by a create that tokenizes otherwise (an older one, another Python's tables).
    # Each part's text is told apart by the md5 its shard records, not here.
    out = prepare_output(output_dir, "create", {**asdict(opts), "vocab_md5": vocab.md5,
                                                "tokenizer": f"reference, Unicode {UNICODE_VERSION}",
                                                "inputs": [str(p.relative_to(input_dir)) for p in parts]})
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="create_claims_") as claims:
        jobs = [_Job(p, out, vocab, opts, max_unk_rate, None if allow_same_text else Path(claims)) for p in parts]
        results = parallel_map(_create_one, jobs, workers, "create")
    write_md5_list(out, {r.name: r.md5 for r in results})
    wall = time.perf_counter() - t0
    done = [r for r in results if r.samples >= 0]
    samples, busy = sum(r.samples for r in done), sum(r.seconds for r in done)
    dropped = {job_part.name: r.dropped for job_part, r in zip(parts, results) if r.dropped}
    text_tokens, unk = sum(r.text_tokens for r in done), sum(r.unk for r in done)
    return {"parts": len(parts), "parts_written_now": len(done), "samples_written_now": samples,
            # what the reference drops silently; a part written by an earlier run is not recounted
            "empty_documents_dropped_now": sum(dropped.values()), "empty_documents_by_part": dropped,
            "tokens_written_now": sum(r.tokens for r in done),
            "unk_rate_now": round(unk / text_tokens, 6) if text_tokens else None,
            "wall_s": round(wall, 3),
            # per core: samples over the summed per-part compute time of all workers
            "samples_per_s_per_core": round(samples / busy, 1) if busy else None,
            "samples_per_s": round(samples / wall, 1) if done else None}
