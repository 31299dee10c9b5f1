"""Pretraining mode (``run.mode=pretrain``): how a from-scratch phase ends and what it
records, outside MLPerf's rules. It runs the trainer's one loop (bert/trainer.py) with its
own evaluation (``bert.evaluate.held_out_metrics``: MLM and NSP accuracy and loss on the
held-out set, of any size: the benchmark's 10,000-sample rule does not apply) and this goal:
no accuracy target ends the run; it ends at its step count (``optim.total_steps`` x global
batch, or ``run.max_samples``) with status success. Every evaluation appends a row to
``<log stem>_curves.jsonl`` beside the MLPerf log; at the end every row of that file is
plotted (``<log stem>_curves.png``). The file is appended, never rewritten, so a run resumed
after a preemption plots its whole history.

Phase 2 starts from phase 1's final weights (``run.init_checkpoint`` = phase 1's
``run.save_checkpoint``) with a fresh optimizer and schedule, as the trainer always builds
them: only weights cross the hand-over.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from .evaluate import HELD_OUT_METRICS
from .state import TrainState

log = logging.getLogger(__name__)


def curves_path(log_path: Path) -> Path:
    return log_path.with_name(log_path.stem + "_curves.jsonl")


class Phase:
    """The goal of a pretraining phase (the trainer's ``goal``): success at its last step;
    ``is_main`` writes the curves."""

    def __init__(self, log_path: Path, is_main: bool) -> None:
        self.curves, self.is_main = curves_path(log_path), is_main

    def line(self, state: TrainState, metrics: dict[str, float]) -> str:
        return (f"eval  @ step {state.step} ({state.samples} samples): "
                + ", ".join(f"{k} {metrics[k]:.4f}" for k in HELD_OUT_METRICS))

    def after_eval(self, state: TrainState, metrics: dict[str, float], train_loss: float, done: bool) -> str | None:
        if self.is_main:
            with self.curves.open("a") as f:
                f.write(json.dumps({"step": state.step, "samples": state.samples, "train_loss": train_loss,
                                    **metrics}) + "\n")
        if not done:
            return None
        if self.is_main:
            log.info(f"curves: {plot(self.curves)}")
        return "success"


def read_curves(path: Path) -> list[dict]:
    """Rows by step; a step evaluated twice (resumed from a checkpoint before that eval)
    keeps its last row."""
    rows = {r["step"]: r for r in (json.loads(ln) for ln in path.read_text().splitlines() if ln.strip())}
    return [rows[k] for k in sorted(rows)]


def plot(curves: Path, out: Path | None = None, extra: list[tuple[str, Path]] = (), label: str = "") -> Path:
    """Accuracy and loss against samples: this file's rows, and those of ``extra`` (label, file)
    runs, e.g. both phases in one figure."""
    import matplotlib  # optional (the tools extra): only a pretraining run's end plots

    matplotlib.use("Agg")  # files only; no display on a cluster node
    import matplotlib.pyplot as plt

    out = out or curves.with_suffix(".png")
    fig, (acc, loss) = plt.subplots(1, 2, figsize=(11, 4))
    offset = 0
    for name, path in [(label, curves), *extra]:
        rows = read_curves(path)
        x = [offset + r["samples"] for r in rows]
        for k, ax in (("mlm_accuracy", acc), ("nsp_accuracy", acc), ("mlm_loss", loss), ("nsp_loss", loss)):
            ax.plot(x, [r[k] for r in rows], marker=".", label=f"{name} {k}".strip())
        offset = x[-1] if x else offset
    for ax, title in ((acc, "held-out accuracy"), (loss, "held-out loss")):
        ax.set_xlabel("training samples")
        ax.set_title(title)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
