"""Evaluation, eager and graphed: the benchmark's masked-LM accuracy (the number that ends
an MLPerf run) and the pretraining mode's held-out metrics, each over the whole eval set with
counts summed across ranks and divided once (exact, whatever the split; one host sync).

Both stop after the batch in hand when Ctrl-C reaches a rank (``interrupted``): every rank
learns it from the sum that ends every evaluation, and the result is None.

``warm_up_eval`` runs one no-grad forward per evaluation shape on synthetic batches before
run_start, so the evaluation's compile (torch.compile guards on grad mode: a compile of its
own) is not timed, and with CUDA graphs captures each shape (``GraphedEval``): the forward
and its (correct, labelled) counts replayed, the model's weights read in place, so each replay
sees the trained weights.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F

from . import distributed
from .batches import LABEL_KEYS, to_device
from .model import IGNORE_INDEX, mlm_correct_and_count
from .step_graph import compile_seconds, compiled_frames, note_uncaptured, shape_key, sync

Counts = Callable[[dict], tuple[torch.Tensor, torch.Tensor]]  # eval batch -> (correct, labelled)
Autocast = Callable[[], contextlib.AbstractContextManager]
HELD_OUT_METRICS = ("mlm_accuracy", "mlm_loss", "nsp_accuracy", "nsp_loss")


def eval_counts(model: torch.nn.Module, batch: dict, autocast: Autocast) -> tuple[torch.Tensor, torch.Tensor]:
    """(correct, labelled) masked-LM predictions of one eval batch already on the device, as
    0-d int64 tensors (no host sync): the eager evaluation step. Call under no_grad, with
    the model in eval mode."""
    inputs = {k: v for k, v in batch.items() if k not in LABEL_KEYS}
    with autocast():
        mlm_logits, _ = model(**inputs)
    return mlm_correct_and_count(mlm_logits, batch["mlm_labels"])


def mlm_accuracy(model: torch.nn.Module, eval_batches: list[dict], device: torch.device,
                 autocast: Autocast = contextlib.nullcontext, counts: Counts | None = None,
                 interrupted: Callable[[], bool] = lambda: False) -> float | None:
    """Masked-LM accuracy over the whole eval set. ``counts``: the graphed per-batch step
    (``GraphedEval``), else the eager one. None when Ctrl-C reached a rank during it."""
    was_training = model.training
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # correct, count, ranks interrupted
    with torch.no_grad():
        for batch in eval_batches:
            if interrupted():
                totals[2] = 1
                break
            if counts is None:
                correct, count = eval_counts(model, to_device(batch, device), autocast)
            else:
                correct, count = counts(batch)
            totals[0] += correct
            totals[1] += count
    distributed.all_reduce_sum(totals)
    model.train(was_training)
    correct, count, stopped = totals.tolist()  # sync point, once per evaluation
    if stopped:
        return None
    return correct / count if count else 0.0


def held_out_metrics(model: torch.nn.Module, eval_batches: list[dict], device: torch.device,
                     autocast: Autocast = contextlib.nullcontext,
                     interrupted: Callable[[], bool] = lambda: False) -> dict[str, float] | None:
    """MLM and NSP accuracy and mean loss over the whole held-out set (``HELD_OUT_METRICS``).
    None when Ctrl-C reached a rank during it."""
    was_training = model.training
    model.eval()
    # [mlm correct, mlm count, mlm loss sum, nsp correct, nsp count, nsp loss sum, ranks interrupted]
    t = torch.zeros(7, dtype=torch.float64, device=device)
    with torch.no_grad():
        for batch in eval_batches:
            if interrupted():
                t[6] = 1
                break
            b = to_device(batch, device)
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


class GraphedEval:
    """``eval_counts`` as CUDA graphs, one per eval batch shape; ``graphs`` does the capturing
    (``bert.step_graph.CudaGraphs``, or the tests' stand-in). Call under no_grad with the
    model in eval mode, as ``mlm_accuracy`` does; a shape that was not captured runs eagerly
    (noted once)."""

    def __init__(self, model: torch.nn.Module, autocast: Autocast, device: torch.device, graphs: Any) -> None:
        self.model, self.autocast, self.device, self.graphs = model, autocast, device, graphs
        self.captured: dict[tuple, tuple[Callable[[], None], dict, torch.Tensor]] = {}
        self.eager_shapes: set[tuple] = set()

    def _counts_into(self, static: dict, out: torch.Tensor) -> None:
        correct, count = eval_counts(self.model, static, self.autocast)
        out[0].copy_(correct)
        out[1].copy_(count)

    def capture(self, batch: dict) -> tuple:
        key = shape_key(batch)
        if key not in self.captured:
            static = {k: (v.to(self.device).clone() if torch.is_tensor(v) else v) for k, v in batch.items()}
            out = torch.zeros(2, dtype=torch.int64, device=self.device)
            self.captured[key] = (self.graphs.capture(lambda: self._counts_into(static, out)), static, out)
        return key

    def __call__(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        key = shape_key(batch)
        entry = self.captured.get(key)
        if entry is None:
            note_uncaptured(self.eager_shapes, key, "eval batch shape", "it runs")
            return eval_counts(self.model, to_device(batch, self.device), self.autocast)
        replay, static, out = entry
        for k, v in batch.items():
            if torch.is_tensor(v):
                static[k].copy_(v, non_blocking=True)
        replay()
        return out[0].clone(), out[1].clone()  # the next replay overwrites out


def warm_up_eval(model: torch.nn.Module, autocast: Autocast, device: torch.device, eval_batches: list[dict],
                 graphs: Any = None) -> tuple[GraphedEval | None, dict[str, Any]]:
    """One no-grad evaluation forward per batch of ``eval_batches`` (one per eval shape),
    under the evaluation's autocast, and with ``graphs`` a ``GraphedEval`` capturing each.
    Changes no state (no gradient, no optimizer, no dropout: the model is in eval mode).
    Returns the graphed counts (None without graphs: evaluation stays eager) and what
    happened (``seconds``, ``compile_s``, ``compiled_frames``, ``shapes``, ``graphs``)."""
    t0, c0, f0 = time.perf_counter(), compile_seconds(), compiled_frames()
    was = model.training
    model.eval()
    graphed = GraphedEval(model, autocast, device, graphs) if graphs is not None else None
    with torch.no_grad():
        for batch in eval_batches:
            on_device = {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in batch.items()}
            eval_counts(model, on_device, autocast)
            if graphed is not None:
                graphed.capture(on_device)
    model.train(was)
    sync(device)
    info = {"seconds": time.perf_counter() - t0, "compile_s": compile_seconds() - c0,
            "compiled_frames": compiled_frames() - f0, "shapes": len({shape_key(b) for b in eval_batches}),
            "graphs": len(graphed.captured) if graphed is not None else 0}
    return graphed, info
