#!/usr/bin/env python3
"""The pieces of ``make pretrain-demo`` (pretrain_demo.sh) that are not existing steps.

    python tools/pretrain_demo.py corpus --output DIR [--max-docs N]
    python tools/pretrain_demo.py fill-mask --model HF_DIR --vocab vocab.txt --text HELD_OUT.txt \\
        --train-text DIR [--sentences N] [--out result.json]

``corpus``: real English text available offline: the docstrings of Python's own standard
library, read from its source files with ``ast`` (nothing is imported or run). Each module,
class or function docstring with a prose sentence is a document, one sentence a line,
in the MLPerf text format; every 20th document (by a hash of its text, so the split does not
depend on the order) goes to ``eval/`` as held-out text, the rest to ``train/``.

Three more in 20 by that hash go into ``downstream.txt`` instead: the text of a fine-tuning
task that pretraining never sees (``python tools/glue.py same-doc``: does the second sentence
follow the first in the same document?).

``fill-mask``: loads the exported model with ``transformers.BertForMaskedLM`` and its
tokenizer from the vocab, masks one word piece in each of ``--sentences`` held-out
sentences, and compares the model with the unigram model of the training text (word-piece
frequencies, add-one smoothed: a model that ignores context): top-1 accuracy against the most
frequent piece, and the mean negative log-likelihood of the masked piece. Prints and writes
both; exits 1 unless the model's likelihood beats the unigram model's.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import re
import sys
import sysconfig
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from glue_data import document_bucket  # noqa: E402  (tools/ holds scripts, not a package)

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z(\"'])")
_CODE = re.compile(r">>>|[{}=<>\\|#@$^`~]|::")


def _sentences(doc: str) -> list[str]:
    """Prose sentences of a docstring: paragraphs joined, split at sentence ends; lines that
    look like code, tables or parameter lists are dropped."""
    out = []
    for para in re.split(r"\n\s*\n", doc):
        text = " ".join(para.split())
        if not text or ">>>" in text:
            continue
        for s in _SENTENCE_END.split(text):
            words = s.split()
            if (4 <= len(words) <= 60 and s[-1] in ".!?" and not _CODE.search(s)
                    and sum(w.strip(".,;:!?()'\"").isalpha() for w in words) >= 0.7 * len(words)):
                out.append(s)
    return out


def stdlib_documents(max_docs: int) -> list[list[str]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    docs, seen = [], set()
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).parts
        if any(p in ("test", "tests", "idle_test", "site-packages", "lib2to3") for p in rel):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                sents = _sentences(doc) if doc else []
                key = " ".join(sents)
                if sents and key not in seen:
                    seen.add(key)
                    docs.append(sents)
                    if len(docs) >= max_docs:
                        return docs
    return docs


DOWNSTREAM_BUCKETS = (1, 2, 3)  # 3 in 20 of the documents: the fine-tuning task's text


def write_corpus(output: Path, max_docs: int, parts: int = 4) -> dict:
    docs = stdlib_documents(max_docs)
    held = [d for d in docs if document_bucket(d) == 0]
    downstream = [d for d in docs if document_bucket(d) in DOWNSTREAM_BUCKETS]
    train = [d for d in docs if document_bucket(d) != 0 and document_bucket(d) not in DOWNSTREAM_BUCKETS]
    (output / "train").mkdir(parents=True, exist_ok=True)
    (output / "eval").mkdir(parents=True, exist_ok=True)
    for i in range(parts):  # round-robin: parts of equal size, processed in parallel by create
        chunk = train[i::parts]
        (output / "train" / f"part-{i:05d}.txt").write_text("\n\n".join("\n".join(d) for d in chunk) + "\n")
    (output / "eval" / "eval.txt").write_text("\n\n".join("\n".join(d) for d in held) + "\n")
    (output / "downstream.txt").write_text("\n\n".join("\n".join(d) for d in downstream) + "\n")
    return {"documents": len(docs), "train_documents": len(train), "eval_documents": len(held),
            "downstream_documents": len(downstream), "train_sentences": sum(map(len, train)),
            "eval_sentences": sum(map(len, held)), "downstream_sentences": sum(map(len, downstream))}


def fill_mask(model_dir: str, vocab: str, text: str, train_text: str, sentences: int, seed: int = 0) -> dict:
    import random

    import torch
    from transformers import AutoTokenizer, BertForMaskedLM

    # the exported directory holds vocab.txt: the tokenizer loads from it like the model
    tok = AutoTokenizer.from_pretrained(model_dir, do_lower_case=True)
    if len(tok) != sum(1 for _ in open(vocab, encoding="utf-8")):
        raise SystemExit(f"{model_dir}: its tokenizer has {len(tok)} pieces, {vocab} has another count")
    model = BertForMaskedLM.from_pretrained(model_dir).eval()
    counts: Counter = Counter()
    for part in sorted(Path(train_text).glob("*.txt")):
        for line in part.read_text().splitlines():
            if line.strip():
                counts.update(tok(line, add_special_tokens=False)["input_ids"])
    unigram = counts.most_common(1)[0][0]
    # The unigram model with add-one smoothing over the vocab: what a model that learned only
    # token frequencies scores. Its negative log-likelihood is the bar the model must clear:
    # unlike top-1 hits on a few hundred sentences, it does not tie when a small model's best
    # guess is still the most frequent piece.
    total = sum(counts.values()) + len(tok)
    lines = [ln for ln in Path(text).read_text().splitlines() if ln.strip()]
    rng = random.Random(seed)
    rng.shuffle(lines)
    right_model = right_unigram = n = 0
    nll_model = nll_unigram = 0.0
    examples = []
    for line in lines:
        if n >= sentences:
            break
        enc = tok(line, truncation=True, max_length=128, return_tensors="pt")
        ids = enc["input_ids"][0]
        if len(ids) < 6:
            continue
        pos = rng.randrange(1, len(ids) - 1)
        truth = int(ids[pos])
        ids = ids.clone()
        ids[pos] = tok.mask_token_id
        with torch.no_grad():
            logits = model(input_ids=ids[None], attention_mask=enc["attention_mask"],
                           token_type_ids=enc["token_type_ids"]).logits
        guess = int(logits[0, pos].argmax())
        nll_model -= float(torch.log_softmax(logits[0, pos].float(), dim=-1)[truth])
        nll_unigram -= math.log((counts[truth] + 1) / total)
        right_model += guess == truth
        right_unigram += unigram == truth
        n += 1
        if len(examples) < 8:
            examples.append({"masked": tok.decode(ids[1:-1]), "truth": tok.convert_ids_to_tokens(truth),
                             "model": tok.convert_ids_to_tokens(guess)})
    return {"sentences": n, "model_top1": right_model / n, "unigram_top1": right_unigram / n,
            "model_nll": nll_model / n, "unigram_nll": nll_unigram / n,
            "unigram_token": tok.convert_ids_to_tokens(unigram), "examples": examples}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("corpus")
    c.add_argument("--output", required=True)
    c.add_argument("--max-docs", type=int, default=100000)
    c.add_argument("--parts", type=int, default=4)
    f = sub.add_parser("fill-mask")
    f.add_argument("--model", required=True)
    f.add_argument("--vocab", required=True)
    f.add_argument("--text", required=True, help="held-out text (one sentence a line)")
    f.add_argument("--train-text", required=True, help="directory of the training text parts")
    f.add_argument("--sentences", type=int, default=500)
    f.add_argument("--out", default="")
    a = ap.parse_args(argv)
    if a.cmd == "corpus":
        print(json.dumps(write_corpus(Path(a.output), a.max_docs, a.parts)))
        return 0
    r = fill_mask(a.model, a.vocab, a.text, a.train_text, a.sentences)
    if a.out:
        Path(a.out).write_text(json.dumps(r, indent=1) + "\n")
    for e in r["examples"]:
        print(f"  {e['masked']!r}: truth {e['truth']!r}, model {e['model']!r}")
    print(f"fill-mask on {r['sentences']} held-out sentences: model top-1 {r['model_top1']:.3f}, "
          f"unigram guess ({r['unigram_token']!r}) {r['unigram_top1']:.3f}; negative log-likelihood of the "
          f"truth: model {r['model_nll']:.3f}, unigram {r['unigram_nll']:.3f}")
    return 0 if r["model_nll"] < r["unigram_nll"] else 1


if __name__ == "__main__":
    sys.exit(main())
