"""Pretraining mode (``run.mode=pretrain``): the loop of a from-scratch phase, outside MLPerf's rules.

What differs from the benchmark loop in ``bert.train`` (chosen once, in ``bert.train._run``):
no accuracy target ends the run: it ends at its step count (``optim.total_steps`` x global
batch, or ``run.max_samples``) with status success; every ``eval.interval_samples`` it
evaluates masked-LM and next-sentence accuracy and loss on the held-out set (any size: the
benchmark's 10,000-sample rule does not apply), logs them (MLPerf-style lines: the checker is
not the judge here) and appends them to ``<log stem>_curves.jsonl`` beside the log; at the
end it plots every row of that file (``<log stem>_curves.png``). The file is appended, never
rewritten, so a run resumed after a preemption plots its whole history.

Phase 2 starts from phase 1's final weights (``run.init_checkpoint`` = phase 1's
``run.save_checkpoint``) with a fresh optimizer and schedule, as ``bert.train.build`` always
builds them: only weights cross the hand-over.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from . import distributed
from .data import IGNORE_INDEX

METRICS = ("mlm_accuracy", "mlm_loss", "nsp_accuracy", "nsp_loss")


def evaluate(model: torch.nn.Module, eval_batches: list[dict], device: torch.device,
             autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
             interrupted: Callable[[], bool] = lambda: False) -> dict[str, float] | None:
    """MLM and NSP accuracy and mean loss over the whole held-out set: sums across ranks,
    then divided (exact, whatever the split). One host sync. None after Ctrl-C, as
    bert.train.evaluate does it."""
    was_training = model.training
    model.eval()
    # [mlm correct, mlm count, mlm loss sum, nsp correct, nsp count, nsp loss sum, ranks interrupted]
    t = torch.zeros(7, dtype=torch.float64, device=device)
    with torch.no_grad():
        for batch in eval_batches:
            if interrupted():
                t[6] = 1
                break
            b = {k: (v.to(device, non_blocking=True) if torch.is_tensor(v) else v) for k, v in batch.items()}
            mlm_labels, nsp_labels = b.pop("mlm_labels").reshape(-1), b.pop("nsp_labels").reshape(-1)
            with autocast():
                mlm_logits, nsp_logits = model(**b)
            mlm_logits = mlm_logits.reshape(-1, mlm_logits.size(-1)).float()
            labelled = mlm_labels != IGNORE_INDEX
            t[0] += ((mlm_logits.argmax(-1) == mlm_labels) & labelled).sum()
            t[1] += labelled.sum()
            t[2] += F.cross_entropy(mlm_logits, mlm_labels, ignore_index=IGNORE_INDEX, reduction="sum")
            nsp_logits = nsp_logits.reshape(-1, 2).float()
            t[3] += (nsp_logits.argmax(-1) == nsp_labels).sum()
            t[4] += nsp_labels.numel()
            t[5] += F.cross_entropy(nsp_logits, nsp_labels, reduction="sum")
    distributed.all_reduce_sum(t)
    model.train(was_training)
    mc, mn, ml, nc, nn_, nl, stopped = t.tolist()  # sync point, once per evaluation
    if stopped:
        return None
    return {"mlm_accuracy": mc / max(mn, 1), "mlm_loss": ml / max(mn, 1),
            "nsp_accuracy": nc / max(nn_, 1), "nsp_loss": nl / max(nn_, 1)}


def curves_path(log_path: Path) -> Path:
    return log_path.with_name(log_path.stem + "_curves.jsonl")


def loop(train_step: Callable, log_path: Path, is_main: bool) -> Callable:
    """The pretraining loop, with the benchmark's ``train_step`` (same step, same checkpoints)."""

    def train(p, cfg, log, say, s, ckpt):
        curves = curves_path(log_path)
        last_t, last_samples = time.perf_counter(), s.samples
        log.block_start(s.samples, p.eval_interval)
        while True:
            loss, skipped = train_step(p, cfg.run.grad_accum_steps)
            s.advance(loss, skipped, p.global_batch)
            if s.step % cfg.log.progress_interval_steps == 0:
                now = time.perf_counter()
                value, streak = torch.stack([loss.double(), s.nonfinite[1].double()]).tolist()  # one sync
                say(f"step {s.step:6d} | samples {s.samples:9d} | loss {value:7.4f} | "
                    f"lr {p.scheduler.get_last_lr()[0]:.3e} | {(s.samples - last_samples) / (now - last_t):8.1f} samples/s")
                last_t, last_samples = now, s.samples
                if streak >= cfg.run.max_nonfinite_steps:
                    say(f"loss NaN/inf for the last {int(streak)} steps (run.max_nonfinite_steps="
                        f"{cfg.run.max_nonfinite_steps}): ending the run")
                    return "aborted", s
            done = s.samples >= p.max_samples
            if s.samples >= s.next_eval or done:
                log.block_stop(s.next_eval - p.eval_interval, s.samples)
                log.eval_start(s.samples)
                m = evaluate(p.model, p.eval_batches, p.device, p.precision.eval_autocast,
                             lambda: ckpt.stop.interrupted)
                if m is None:  # Ctrl-C during the evaluation: every rank stops here, nothing saved
                    return "interrupted", s
                log.eval_stop(s.samples)
                log.eval_accuracy(m["mlm_accuracy"], s.samples)
                for k in METRICS[1:]:  # own keys: never a dict holding "eval_accuracy" (RCP checker)
                    log.event(f"eval_{k}", m[k], epoch_num=s.samples)
                if is_main:
                    with curves.open("a") as f:
                        f.write(json.dumps({"step": s.step, "samples": s.samples, "train_loss": float(loss), **m}) + "\n")
                say(f"eval  @ step {s.step} ({s.samples} samples): " + ", ".join(f"{k} {m[k]:.4f}" for k in METRICS))
                if done:
                    if is_main:
                        say(f"curves: {plot(curves)}")
                    return "success", s
                while s.next_eval <= s.samples:
                    s.next_eval += p.eval_interval
                log.block_start(s.samples, p.eval_interval)
                last_t = time.perf_counter()
            stop = ckpt.at_boundary(p, s, say)
            if stop:
                return stop, s

    return train


def read_curves(path: Path) -> list[dict]:
    """Rows by step; a step evaluated twice (resumed from a checkpoint before that eval)
    keeps its last row."""
    rows = {r["step"]: r for r in (json.loads(ln) for ln in path.read_text().splitlines() if ln.strip())}
    return [rows[k] for k in sorted(rows)]


def plot(curves: Path, out: Path | None = None, extra: list[tuple[str, Path]] = (), label: str = "") -> Path:
    """Accuracy and loss against samples: this file's rows, and those of ``extra`` (label, file)
    runs, e.g. both phases in one figure."""
    import matplotlib

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
