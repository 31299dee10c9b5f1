"""GLUE's metrics, on numpy arrays: accuracy, F1 of the positive class, Matthews correlation,
Pearson and Spearman correlation; a task's score; the GLUE average.

The definitions are scikit-learn's (``accuracy_score``, ``f1_score``, ``matthews_corrcoef``)
and scipy's (``pearsonr``, ``spearmanr``: Pearson on average ranks), which
tests/unit/test_glue.py checks them against; not imported here, so the harness needs neither.
Where a metric is undefined (no positive prediction or label for F1, a constant input for a
correlation) it is 0, as scikit-learn returns for F1 and Matthews (scipy's correlations
return nan there, which would poison a median and the average).

A task's score is the unweighted mean of its metrics (MRPC: F1 and accuracy; MNLI: matched
and mismatched accuracy), the GLUE paper's rule for tasks with more than one; the GLUE
average is the unweighted mean of the task scores.
"""

from __future__ import annotations

import numpy as np


def accuracy(pred, gold) -> float:
    pred, gold = np.asarray(pred), np.asarray(gold)
    return float((pred == gold).mean())


def f1(pred, gold) -> float:
    """F1 of class 1 (MRPC's "equivalent", QQP's "duplicate")."""
    pred, gold = np.asarray(pred) == 1, np.asarray(gold) == 1
    tp = int((pred & gold).sum())
    denom = int(pred.sum() + gold.sum())
    return 2 * tp / denom if denom else 0.0


def matthews(pred, gold) -> float:
    """Matthews correlation of two label vectors (any number of classes, as scikit-learn's)."""
    pred, gold = np.asarray(pred), np.asarray(gold)
    classes = np.union1d(pred, gold)
    p, g = np.searchsorted(classes, pred), np.searchsorted(classes, gold)
    c = np.zeros((len(classes), len(classes)), dtype=np.float64)
    np.add.at(c, (g, p), 1)
    t, q = c.sum(axis=1), c.sum(axis=0)  # true and predicted counts per class
    n, correct = c.sum(), np.trace(c)
    cov_pg = correct * n - t @ q
    cov_pp, cov_gg = n * n - q @ q, n * n - t @ t
    return float(cov_pg / np.sqrt(cov_pp * cov_gg)) if cov_pp * cov_gg else 0.0


def pearson(x, y) -> float:
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    dx, dy = x - x.mean(), y - y.mean()
    denom = np.sqrt((dx * dx).sum() * (dy * dy).sum())
    return float(np.clip((dx * dy).sum() / denom, -1.0, 1.0)) if denom else 0.0


def _ranks(x) -> np.ndarray:
    """1-based ranks, ties given their average rank (scipy.stats.rankdata's 'average')."""
    x = np.asarray(x, dtype=np.float64)
    order = np.argsort(x, kind="mergesort")
    sorted_x = x[order]
    starts = np.flatnonzero(np.r_[True, sorted_x[1:] != sorted_x[:-1]])
    ends = np.r_[starts[1:], len(x)]
    avg = (starts + ends + 1) / 2.0  # mean of the 1-based positions starts+1 .. ends
    ranks = np.empty(len(x))
    ranks[order] = np.repeat(avg, ends - starts)
    return ranks


def spearman(x, y) -> float:
    return pearson(_ranks(x), _ranks(y))


METRICS = {"accuracy": accuracy, "f1": f1, "matthews": matthews, "pearson": pearson, "spearman": spearman}


def score(metrics: dict[str, float]) -> float:
    """A task's score: the mean of its metrics."""
    return float(np.mean(list(metrics.values())))
