"""The GLUE tasks' data: files, columns, labels and metrics of each task; reading them from
GLUE's published layout or from a Hugging Face ``datasets`` cache; BERT inputs from them.

GLUE's layout (what its download script writes; the facts below are those of Hugging Face's
``glue`` loader, which reads the same files): one folder per task under a root,
``<root>/<TASK>/train.tsv`` and ``dev.tsv`` (MNLI: ``dev_matched.tsv`` and
``dev_mismatched.tsv``), tab-separated, no quoting (a ``"`` is text), UTF-8. Every file has a
header row naming its columns except CoLA's train and dev files, which have four unnamed
fields: source, label, the author's original mark, sentence. The columns read, by header name:

    CoLA   field 3 | label field 1 (0/1)                     Matthews correlation
    SST-2  sentence | label (0/1)                            accuracy
    MRPC   #1 String, #2 String | Quality (0/1)              F1 (of 1 = equivalent), accuracy
    QQP    question1, question2 | is_duplicate (0/1)         F1 (of 1 = duplicate), accuracy
    STS-B  sentence1, sentence2 | score (0..5, a float)      Pearson, Spearman
    MNLI   sentence1, sentence2 | gold_label (contradiction/entailment/neutral)
                                                             accuracy on matched and on mismatched
    QNLI   question, sentence | label (entailment/not_entailment)   accuracy
    RTE    sentence1, sentence2 | label (entailment/not_entailment) accuracy
    WNLI   sentence1, sentence2 | label (0/1)                accuracy

MRPC's header may begin with a byte-order mark (the download script copies it from
``msr_paraphrase_train.txt``): files are read as ``utf-8-sig``.

The ``datasets`` cache (``load_dataset("nyu-mll/glue", config)`` once, on a machine with a
network): read with ``datasets``' own cache builder, the one ``load_dataset`` falls back to
offline, so nothing is fetched; the hub's ``nyu-mll/glue`` and the older ``glue`` loader's
cache folders are both found. Its label is a class index whose names are checked against the
task's (e.g. MNLI: entailment, neutral, contradiction; the TSV's label strings are mapped
through them).

Bad input (a missing task folder or file, a row with the wrong number of fields, a label
outside the task's set, a header without a column) raises ``GlueDataError`` naming the file
and line.
"""

from __future__ import annotations

import csv
import hashlib
import io
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from input_preprocessing.common import PrepError
from input_preprocessing.create import load_vocab
from input_preprocessing.wordpiece import Tokenizer


class GlueDataError(ValueError):
    """A task's data is missing or malformed; the message names the file (and line)."""


@dataclass(frozen=True)
class Dev:
    """One evaluation split: the metric names get ``suffix`` (MNLI: _matched, _mismatched)."""
    suffix: str
    file: str
    hf_split: str


@dataclass(frozen=True)
class Task:
    name: str
    directory: str  # the task's folder under the GLUE root
    text_columns: tuple  # header names; field indices where the file has no header (CoLA)
    label_column: str | int
    labels: tuple[str, ...]  # the TSV's label strings, index = class; () = regression
    metrics: tuple[str, ...]  # tools/glue_metrics.py names, per dev split
    dev: tuple[Dev, ...] = (Dev("", "dev.tsv", "validation"),)
    header: bool = True
    fields: int = 0  # headerless files: the exact number of fields a row has
    label_range: tuple[float, float] = (0.0, 5.0)  # regression labels must lie in it
    hf_config: str = ""  # the datasets config name; "" = not in the GLUE dataset
    hf_text: tuple[str, ...] = ()
    hf_label_names: tuple[str, ...] = ()  # the cache's ClassLabel names, in class-index order
    glue: bool = True  # counted in the GLUE average

    @property
    def num_labels(self) -> int:
        return len(self.labels) or 1  # regression: one output

    @property
    def regression(self) -> bool:
        return not self.labels

    @property
    def pair(self) -> bool:
        return len(self.text_columns) == 2

    def metric_names(self) -> list[str]:
        return [m + d.suffix for d in self.dev for m in self.metrics]


_PAIR = ("sentence1", "sentence2")
_BINARY = ("0", "1")
_NLI2 = ("entailment", "not_entailment")

TASKS: dict[str, Task] = {t.name: t for t in (
    Task("CoLA", "CoLA", (3,), 1, _BINARY, ("matthews",), header=False, fields=4, hf_config="cola",
         hf_text=("sentence",), hf_label_names=("unacceptable", "acceptable")),
    Task("SST-2", "SST-2", ("sentence",), "label", _BINARY, ("accuracy",), hf_config="sst2",
         hf_text=("sentence",), hf_label_names=("negative", "positive")),
    Task("MRPC", "MRPC", ("#1 String", "#2 String"), "Quality", _BINARY, ("f1", "accuracy"), hf_config="mrpc",
         hf_text=_PAIR, hf_label_names=("not_equivalent", "equivalent")),
    Task("QQP", "QQP", ("question1", "question2"), "is_duplicate", _BINARY, ("f1", "accuracy"), hf_config="qqp",
         hf_text=("question1", "question2"), hf_label_names=("not_duplicate", "duplicate")),
    Task("STS-B", "STS-B", _PAIR, "score", (), ("pearson", "spearman"), hf_config="stsb", hf_text=_PAIR),
    Task("MNLI", "MNLI", _PAIR, "gold_label", ("contradiction", "entailment", "neutral"), ("accuracy",),
         dev=(Dev("_matched", "dev_matched.tsv", "validation_matched"),
              Dev("_mismatched", "dev_mismatched.tsv", "validation_mismatched")),
         hf_config="mnli", hf_text=("premise", "hypothesis"), hf_label_names=("entailment", "neutral", "contradiction")),
    Task("QNLI", "QNLI", ("question", "sentence"), "label", _NLI2, ("accuracy",), hf_config="qnli",
         hf_text=("question", "sentence"), hf_label_names=_NLI2),
    Task("RTE", "RTE", _PAIR, "label", _NLI2, ("accuracy",), hf_config="rte", hf_text=_PAIR, hf_label_names=_NLI2),
    Task("WNLI", "WNLI", _PAIR, "label", _BINARY, ("accuracy",), hf_config="wnli", hf_text=_PAIR,
         hf_label_names=("not_entailment", "entailment")),
    # Not GLUE: a downstream task made offline from text held out of pretraining (same_doc_task:
    # does the second sentence follow the first in the same document?). Balanced classes:
    # accuracy alone (F1 would reward answering 1 to everything).
    Task("SAME-DOC", "SAME-DOC", _PAIR, "label", _BINARY, ("accuracy",), glue=False),
)}
GLUE_TASKS = [name for name, t in TASKS.items() if t.glue]


def task(name: str) -> Task:
    try:
        return TASKS[name]
    except KeyError:
        raise GlueDataError(f"unknown task {name!r}; known: {list(TASKS)}") from None


class Example(NamedTuple):
    text_a: str
    text_b: str | None
    label: int | float  # class index, or the regression target


@dataclass
class TaskData:
    task: Task
    train: list[Example]
    dev: dict[str, list[Example]] = field(default_factory=dict)  # by Dev.suffix
    source: str = ""


# ---------------------------------------------------------------- GLUE's layout


def _label(t: Task, raw: str, where: str) -> int | float:
    if t.regression:
        try:
            value = float(raw)
        except ValueError:
            value = math.nan
        lo, hi = t.label_range
        if not (math.isfinite(value) and lo <= value <= hi):
            raise GlueDataError(f"{where}: label {raw!r} is not a number in [{lo:g}, {hi:g}] ({t.name}'s score)")
        return value
    try:
        return t.labels.index(raw)
    except ValueError:
        raise GlueDataError(f"{where}: label {raw!r} is not one of {list(t.labels)} ({t.name})") from None


def read_tsv(path: Path, t: Task) -> list[Example]:
    """The examples of one of ``t``'s TSV files; ``GlueDataError`` names ``path:line`` of the
    first bad row."""
    if not path.is_file():
        raise GlueDataError(f"{path}: no such file ({t.name} in GLUE's layout has "
                            f"{', '.join(['train.tsv', *(d.file for d in t.dev)])})")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise GlueDataError(f"{path}:{line}: not UTF-8 (byte 0x{raw[e.start]:02x})") from None
    reader = csv.reader(io.StringIO(text, newline=""), delimiter="\t", quoting=csv.QUOTE_NONE)
    if t.header:
        header = next(reader, None)
        if header is None:
            raise GlueDataError(f"{path}: empty file; {t.name}'s files begin with a header row")
        missing = [c for c in (*t.text_columns, t.label_column) if c not in header]
        if missing:
            raise GlueDataError(f"{path}:1: the header lacks column(s) {missing} ({t.name}); it has {header}")
        width = len(header)
        text_at = [header.index(c) for c in t.text_columns]
        label_at = header.index(t.label_column)
    else:
        width, text_at, label_at = t.fields, list(t.text_columns), t.label_column
    out = []
    for row in reader:
        where = f"{path}:{reader.line_num}"
        if len(row) != width:
            raise GlueDataError(f"{where}: {len(row)} tab-separated fields, {t.name}'s rows have {width}"
                                + (" (as its header)" if t.header else ""))
        texts = [row[i] for i in text_at]
        out.append(Example(texts[0], texts[1] if t.pair else None, _label(t, row[label_at], where)))
    if not out:
        raise GlueDataError(f"{path}: no examples")
    return out


def read_glue_dir(root: str | Path, t: Task) -> TaskData:
    d = Path(root) / t.directory
    if not d.is_dir():
        raise GlueDataError(f"{d}: no such directory (GLUE's layout: {Path(root)}/<TASK>/train.tsv, "
                            f"dev.tsv; {t.name}'s folder is {t.directory})")
    return TaskData(t, read_tsv(d / "train.tsv", t), {x.suffix: read_tsv(d / x.file, t) for x in t.dev}, str(d))


# ---------------------------------------------------------------- a datasets cache

HF_NAMES = ("nyu-mll/glue", "glue")  # the hub dataset's cache folder (nyu-mll___glue), the old loader's


def read_hf_split(cache_dir: str | Path, t: Task, split: str):
    """One split of ``t`` from a ``datasets`` cache, offline (datasets' cache builder)."""
    if not t.hf_config:
        raise GlueDataError(f"{t.name} is not in the GLUE dataset; read it from a folder in GLUE's layout")
    try:
        from datasets.packaged_modules.cache.cache import Cache  # optional extra [glue]
    except ImportError:
        raise GlueDataError("reading a datasets cache needs the datasets package "
                            "(pip install -e '.[glue]')") from None
    tried = []
    for name in HF_NAMES:
        try:
            builder = Cache(cache_dir=str(cache_dir), repo_id=name, dataset_name=name.split("/")[-1],
                            config_name=t.hf_config, version="auto", hash="auto")
        except (ValueError, FileNotFoundError) as e:
            tried.append(f"{name}: {e}")
            continue
        try:
            return builder.as_dataset(split=split)
        except (ValueError, KeyError, FileNotFoundError) as e:
            raise GlueDataError(f"{cache_dir}: {name} {t.hf_config} has no split {split!r} ({e})") from None
    raise GlueDataError(f"{cache_dir}: no datasets cache of GLUE's {t.hf_config} ({'; '.join(tried)})")


def _hf_examples(ds, t: Task, where: str) -> list[Example]:
    cols = list(t.hf_text) + ["label"]
    missing = [c for c in cols if c not in ds.column_names]
    if missing:
        raise GlueDataError(f"{where}: lacks column(s) {missing}; has {ds.column_names}")
    if not t.regression:
        names = tuple(getattr(ds.features["label"], "names", ()))
        if names != t.hf_label_names:
            raise GlueDataError(f"{where}: label names {list(names)}, {t.name}'s are {list(t.hf_label_names)}")
        # cache class index -> the TSV's label string -> our class index
        to_ours = [t.labels.index(str(i) if t.labels == _BINARY else n) for i, n in enumerate(names)]
    out = []
    for i, row in enumerate(ds.select_columns(cols).to_list()):
        y = row["label"]
        if t.regression:
            y = _label(t, str(y), f"{where} row {i}")
        elif not (isinstance(y, int) and 0 <= y < len(to_ours)):
            raise GlueDataError(f"{where} row {i}: label {y!r} is not a class of {list(t.hf_label_names)} "
                                "(test splits have none)")
        else:
            y = to_ours[y]
        out.append(Example(row[t.hf_text[0]], row[t.hf_text[1]] if t.pair else None, y))
    if not out:
        raise GlueDataError(f"{where}: no examples")
    return out


def read_hf_cache(cache_dir: str | Path, t: Task) -> TaskData:
    def split(name: str) -> list[Example]:
        return _hf_examples(read_hf_split(cache_dir, t, name), t, f"{cache_dir} [{t.hf_config}/{name}]")

    return TaskData(t, split("train"), {d.suffix: split(d.hf_split) for d in t.dev}, f"{cache_dir} ({t.hf_config})")


def load_task(t: Task, glue_dir: str | Path = "", hf_cache: str | Path = "") -> TaskData:
    """``t``'s train and dev examples from ``glue_dir`` (GLUE's layout) if given, else from the
    ``hf_cache`` datasets cache."""
    if glue_dir:
        return read_glue_dir(glue_dir, t)
    if hf_cache:
        return read_hf_cache(hf_cache, t)
    raise GlueDataError(f"{t.name}: give a GLUE folder or a datasets cache")


# ---------------------------------------------------------------- BERT inputs


class Encoder:
    """WordPiece inputs (the pretraining data's tokenizer, input_preprocessing.wordpiece):
    ``[CLS] a [SEP]`` or ``[CLS] a [SEP] b [SEP]``, segment ids 0 then 1, cut to
    ``max_seq_length`` by dropping the last token of the longer text until it fits (BERT's
    rule for pairs)."""

    def __init__(self, vocab_path: str | Path, max_seq_length: int, lowercase: bool = True):
        try:
            self.vocab = load_vocab(vocab_path)
        except PrepError as e:
            raise GlueDataError(str(e)) from None
        self.tokenizer = Tokenizer(self.vocab.tokens, lowercase)
        self.max_seq_length = max_seq_length

    def _ids(self, texts: list[str]) -> list[list[int]]:
        return [self.tokenizer.ids(t) for t in texts]

    def encode(self, examples: list[Example]) -> tuple[list[list[int]], list[list[int]]]:
        """(token ids, segment ids) of each example."""
        a = self._ids([e.text_a for e in examples])
        b = self._ids([e.text_b for e in examples]) if examples and examples[0].text_b is not None else None
        cls, sep = self.vocab.cls, self.vocab.sep
        ids, types = [], []
        for i, x in enumerate(a):
            y = b[i] if b is not None else None
            budget = self.max_seq_length - (3 if y is not None else 2)
            if y is None:
                x = x[:budget]
            else:
                x, y = list(x), list(y)
                while len(x) + len(y) > budget:
                    (x if len(x) > len(y) else y).pop()
            row = [cls, *x, sep] + ([*y, sep] if y is not None else [])
            ids.append(row)
            types.append([0] * (len(x) + 2) + [1] * (len(row) - len(x) - 2))
        return ids, types


# ---------------------------------------------------------------- a downstream task from your own text


def document_bucket(doc: list[str], n: int = 20, salt: str = "") -> int:
    """A document's bucket of ``n`` by a hash of its text: a split that does not depend on the
    documents' order."""
    return int(hashlib.md5((salt + " ".join(doc)).encode()).hexdigest(), 16) % n


def read_documents(path: str | Path) -> list[list[str]]:
    """The documents of a text file, or of every file of a directory (sorted), in the format
    ``create`` reads: one sentence a line, a blank line between documents."""
    p = Path(path)
    files = sorted(f for f in p.iterdir() if f.is_file() and not f.name.startswith(".")) if p.is_dir() else [p]
    if not files or not files[0].is_file():
        raise GlueDataError(f"{p}: no such text file or directory of text files")
    return [[" ".join(line.split()) for line in block.splitlines() if line.strip()]
            for f in files for block in f.read_text(encoding="utf-8").split("\n\n") if block.strip()]


def same_doc_task(text: str | Path, output: str | Path, pairs: int = 1, seed: int = 0) -> dict:
    """Write SAME-DOC/{train,dev}.tsv under ``output`` (GLUE's layout, RTE's columns) from the
    documents of ``text``: does the second sentence follow the first in the same document?
    Each training document of two or more sentences gives up to ``pairs`` positive pairs (a
    sentence and the next one; a dev document gives all of its pairs) and as many negative
    ones (the same first sentence and a sentence of another document of its split); a
    document's pairs all go to one split (1 in 5 documents to dev, by a hash of its text)."""
    import random

    docs = read_documents(text)
    rng = random.Random(seed)
    task = Path(output) / "SAME-DOC"
    counts = {}
    splits = {split: [d for d in docs if keep(document_bucket(d, 5, salt="dev"))]
              for split, keep in (("train", lambda b: b != 0), ("dev", lambda b: b == 0))}
    for split, part in splits.items():
        if sum(len(d) >= 2 for d in part) < 2:
            raise GlueDataError(f"{text}: the {split} split has {sum(len(d) >= 2 for d in part)} document(s) of two "
                                f"or more sentences out of {len(docs)} documents; it needs 2 (a blank line between "
                                "documents, one sentence a line)")
    task.mkdir(parents=True, exist_ok=True)
    for split, part in splits.items():
        rows = []
        for i, d in enumerate(part):
            if len(d) < 2:
                continue
            cap = len(d) - 1 if split == "dev" else min(pairs, len(d) - 1)  # dev: every pair, for a finer measure
            for a in rng.sample(range(len(d) - 1), cap):
                rows.append((d[a], d[a + 1], 1))
                other = rng.choice([j for j in range(len(part)) if j != i])
                rows.append((d[a], rng.choice(part[other]), 0))
        rng.shuffle(rows)
        lines = ["index\tsentence1\tsentence2\tlabel"] + [f"{n}\t{a}\t{b}\t{y}" for n, (a, b, y) in enumerate(rows)]
        tmp = task / f"{split}.tsv.tmp"
        tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
        tmp.replace(task / f"{split}.tsv")
        counts[split] = {"documents": len(part), "pairs": len(rows)}
    return counts
