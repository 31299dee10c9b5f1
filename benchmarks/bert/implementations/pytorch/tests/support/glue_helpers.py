"""Helpers of test_glue.py's unit and integration tests: files in GLUE's layout with a rule a tiny
model can learn, the grid, and a tiny model in Hugging Face format."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

from conftest import PKG

sys.path.insert(0, str(PKG / "tools"))
import glue_data  # noqa: E402  (tools/ holds scripts, not a package)

# ---------------------------------------------------------------- files in GLUE's layout

HEADERS = {
    "SST-2": "sentence\tlabel",
    "MRPC": "\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String",  # the BOM the download script copies
    "QQP": "id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate",
    "STS-B": "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore",
    "MNLI": "index\tpromptID\tpairID\tgenre\tsentence1_binary_parse\tsentence2_binary_parse\tsentence1_parse\t"
            "sentence2_parse\tsentence1\tsentence2\tlabel1\tgold_label",
    "MNLI-dev": "index\tpromptID\tpairID\tgenre\tsentence1_binary_parse\tsentence2_binary_parse\tsentence1_parse\t"
                "sentence2_parse\tsentence1\tsentence2\tlabel1\tlabel2\tlabel3\tlabel4\tlabel5\tgold_label",
    "QNLI": "index\tquestion\tsentence\tlabel",
    "RTE": "index\tsentence1\tsentence2\tlabel",
    "WNLI": "index\tsentence1\tsentence2\tlabel",
    "SAME-DOC": "index\tsentence1\tsentence2\tlabel",
}


def row(task: str, i: int, a: str, b: str | None, y: str, dev: bool = False) -> str:
    """One line of ``task``'s files, every column where GLUE's files have it."""
    if task == "CoLA":
        return f"gj04\t{y}\t{'' if y == '1' else '*'}\t{a}"  # source, label, original mark, sentence
    if task == "SST-2":
        return f"{a}\t{y}"
    if task == "MRPC":
        return f"{y}\t{1000 + i}\t{2000 + i}\t{a}\t{b}"
    if task == "QQP":
        return f"{i}\t{2 * i}\t{2 * i + 1}\t{a}\t{b}\t{y}"
    if task == "STS-B":
        return f"{i}\tmain-captions\tMSRvid\t2012test\t{i:04d}\tnone\tnone\t{a}\t{b}\t{y}"
    if task == "MNLI":
        labels = f"{y}\t{y}\t{y}\t{y}\t{y}\t{y}" if dev else f"{y}\t{y}"
        return f"{i}\t{31193 + i}\t{31193 + i}n\tgovernment\t( ( {a} ) )\t( {b} )\t(ROOT (S {a}))\t(ROOT (S {b}))\t{a}\t{b}\t{labels}"
    return f"{i}\t{a}\t{b}\t{y}"  # QNLI, RTE, WNLI, SAME-DOC


WORDS = ("the cat dog sat ran on a mat hat big small red blue old new it is was not very good bad "
         "film movie plot quite".split())


def label_of(task: str, a: str, b: str | None) -> str:
    """A rule a tiny model can learn: the label follows from the words."""
    t = glue_data.TASKS[task]
    words = (a + " " + (b or "")).split()
    if t.regression:
        return f"{min(5.0, 1.25 * words.count('good')):.3f}"
    return t.labels[1 if "good" in words else 0 if "bad" in words or len(t.labels) == 2 else 2]


def examples(task: str, n: int, rng: random.Random) -> list[tuple[str, str | None, str]]:
    t = glue_data.TASKS[task]
    out = []
    for _ in range(n):
        a = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9)))
        b = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9))) if t.pair else None
        if rng.random() < 0.1:
            a = f'"{a}" .'  # a quote is text (no quoting in GLUE's files)
        out.append((a, b, label_of(task, a, b)))
    return out


def write_task(root: Path, task: str, train, dev) -> Path:
    t = glue_data.TASKS[task]
    d = root / t.directory
    d.mkdir(parents=True, exist_ok=True)
    for name, rows, is_dev in [("train.tsv", train, False)] + [(x.file, dev, True) for x in t.dev]:
        header = [] if not t.header else [HEADERS["MNLI-dev" if task == "MNLI" and is_dev else task]]
        lines = header + [row(task, i, a, b, y, is_dev) for i, (a, b, y) in enumerate(rows)]
        (d / name).write_text("\n".join(lines) + "\n", encoding="utf-8")
    return d


def as_examples(task: str, rows) -> list[glue_data.Example]:
    t = glue_data.TASKS[task]
    return [glue_data.Example(a, b, float(y) if t.regression else t.labels.index(y)) for a, b, y in rows]


def _grid(tmp_path: Path, model_dir: Path, glue_dir: Path, **extra) -> Path:
    import yaml

    g = {"name": "t", "model": str(model_dir), "glue_dir": str(glue_dir), "lrs": [1e-3], "seeds": [1],
         "epochs": 1, "threads": 1, "max_seq_length": 64, **extra}
    p = tmp_path / "grid.yaml"
    p.write_text(yaml.safe_dump(g))
    return p


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    """An HF-format directory (config.json, model.safetensors, vocab.txt) of a tiny BERT with
    random weights and a vocab of WORDS, as `checkpoint --to hf` and pretrain_demo.sh leave it."""
    from bert.weights import export_hf
    from bert.config import ModelConfig
    from bert.model import BertForPreTraining

    d = tmp_path_factory.mktemp("tiny_model")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", '"', *WORDS]
    (d / "vocab.txt").write_text("\n".join(vocab) + "\n")
    cfg = ModelConfig(vocab_size=len(vocab), hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                      max_position_embeddings=64)
    torch.manual_seed(0)
    export_hf(BertForPreTraining(cfg).state_dict(), cfg, d)
    return d
