"""Helpers of test_copies.py's unit and integration tests: the demo data as `make demo` makes it,
and real text (the standard library's docstrings) made into training shards and an eval set."""

from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from bert import demo_data
from bert.shards import list_shards

PKG = Path(__file__).resolve().parents[2]

# check's options for the demo's own vocabulary ([CLS] 2, [SEP] 3, [UNK] 1 of 128 ids)
DEMO_IDS = ["--vocab-size", "128", "--cls-id", str(demo_data.CLS), "--sep-id", str(demo_data.SEP),
            "--unk-id", str(demo_data.UNK)]


@dataclass
class Demo:
    train: Path
    eval: Path

    def copy(self, root: Path) -> Demo:
        """A copy to plant faults in."""
        shutil.copytree(self.train.parent, root)
        return Demo(root / self.train.name, root / self.eval.name)


def make_demo(root: Path) -> Demo:
    """The demo data of `make demo` (demo.sh with config_CPU_1x2.sh's DEMO_* sizes): 8 training
    shards of 2,500 samples at seq 128, one eval shard of 2,000."""
    demo_data.generate(root, train_samples=20000, eval_samples=2000, seed=1, seq_len=128, max_pred=20, vocab=128)
    return Demo(root / "train", root / "eval")


@dataclass
class RealText:
    text: Path  # training parts
    held_out: Path  # the held-out part's directory
    vocab: Path


def real_text(root: Path, max_docs: int = 1200) -> RealText:
    """The standard library's docstrings in the MLPerf text format (tools/pretrain_demo.py's
    corpus: held-out documents apart), with a vocab trained on the training parts."""
    sys.path.insert(0, str(PKG / "tools"))
    import pretrain_demo

    from input_preprocessing.wordpiece import train_vocab

    pretrain_demo.write_corpus(root, max_docs=max_docs, parts=3)
    vocab = train_vocab(sorted((root / "train").glob("*.txt")), root / "vocab.txt", size=2000)
    return RealText(root / "train", root / "eval", vocab)


def shard_names(d: Path) -> list[str]:
    return [p.name for p in list_shards(d)]
