"""Static token budgets, the whole feature: the batch format (``Layout``, ``pad_batch``,
``BudgetCollate``) and where the sizes go (the ladder: ``layout_for``, ``eval_layout_for``).
An unpadded micro-batch's token COUNT is padded up to one of a few fixed sizes, so every
training step has one of a few static shapes (what CUDA graphs and inductor without dynamic
shapes need); the config key is parsed in ``bert/config.py`` (``parse_budgets``).

The unpadded layout (``bert.batches.collate(..., unpad=True)``) packs a batch's real tokens
into ``[T]``; T changes every step. A *ladder* of budgets ``r_1 < ... < r_K`` (tokens) fixes
the shape: a batch of T real tokens is padded to the smallest rung ``r >= T`` (the rows past
T are pad tokens: id 0, segment 0, position 0). The top rung is always the full grid
``local_batch * max_seq_length``, the most tokens a batch can hold, so every batch fits a
rung: a budget pads tokens, it never drops or adds a sample.

The batch keeps the unpadded keys: ``input_ids``, ``token_type_ids``, ``position_ids``
exactly budget-long; ``cu_seqlens`` [B + 1] over the B real samples (pad rows lie past
``cu_seqlens[-1]``; every attention backend gives them output 0 and never attends to them,
see bert/attention.py); ``max_seqlen`` the constant ``max_seq_length``; ``masked_index`` /
``mlm_labels`` padded to a static count of ``local_batch * max_predictions_per_seq`` slots
(pad labels IGNORE_INDEX, pad indices row 0, a valid row whose prediction the loss
ignores). The graph key of a batch is therefore its rung alone.

Masked count: fixed at ``local_batch * max_predictions_per_seq`` (the most the data can
hold: one graph key per rung, not per (rung, count)). Wikipedia samples carry ~38.5 of the
76 slots on average, so the MLM head runs on ~2x its rows: +1.47% of a BERT-Large training
step's FLOPs at any local batch (tools/budget_ladder.py prints it; BENCHMARKS.md).

Evaluation gets static shapes too (``eval_layout_for``): a ladder for
``eval.batch_size`` samples, and a rank's last, short batch filled up to that many with
one-token samples that hold no prediction (``BudgetCollate(..., samples=N)``, ``FILLER``),
so evaluation compiles (and, with CUDA graphs, is captured) once per rung before run_start.
Accuracy is exact: the filler and the pad slots are never labelled.

*The ladder* (``data.token_budgets=auto``) depends only on what is known before the data
is touched (MLPerf's clock rule: warm-up and graph capture happen before ``run_start``): the
local batch, ``max_seq_length``, the sampler config and world size, and the shipped
Wikipedia length histogram (``data/wikipedia_seqlen_histogram_512.txt``, scaled to
``max_seq_length`` as the demo data is). From those it forms the distribution of a rank's
real tokens per micro-batch -- exactly (a convolution) for uniform random sampling, by
running the project's own ``IndexSampler`` over a synthetic population for every other mode
-- and places the rungs by dynamic programming to minimise the expected padding, on
multiples of 64 tokens (GEMM tiles). It adds rungs, up to 8, while the next one still saves
at least 0.5% of the real tokens. docs/performance.md ("Static token budgets") gives the
rule and its numbers. The warm-up before ``run_start`` (bert/step_graph.py) fills each rung
exactly with synthetic samples, so every shape the loader can produce is compiled and
captured there.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from .batches import collate
from .config import DataConfig, SamplerConfig, parse_budgets
from .lengths import length_distribution
from .model import IGNORE_INDEX
from .sampler import IndexSampler, Strata, deal, even_bounds
from .shards import Sample


@dataclass(frozen=True)
class Layout:
    """What a budget batch's shapes are: the token rungs and the masked slots."""

    rungs: tuple[int, ...]  # increasing; the last is local_batch * max_seq_length
    masked_slots: int  # static length of masked_index / mlm_labels
    max_seq_length: int  # static max_seqlen

    def rung(self, tokens: int) -> int:
        """The smallest rung that holds ``tokens`` real tokens."""
        i = bisect.bisect_left(self.rungs, tokens)
        if i == len(self.rungs):  # impossible from a valid collate: the top is the full grid
            raise ValueError(f"{tokens} tokens exceed the top token budget {self.rungs[-1]}")
        return self.rungs[i]


# ---------------------------------------------------------------- padding a batch


def pad_batch(batch: dict[str, Any], layout: Layout) -> dict[str, Any]:
    """An unpadded batch (``collate(..., unpad=True)``) padded to its rung and the static
    masked count. Allocates one copy of the per-token tensors (host side, in the loader)."""
    total = batch["input_ids"].numel()
    pad = layout.rung(total) - total
    m = batch["masked_index"].numel()
    if m > layout.masked_slots:  # never drop a prediction: refuse instead
        raise ValueError(f"a batch holds {m} masked positions > run.local_batch_size x "
                         f"data.max_predictions_per_seq = {layout.masked_slots}: data made with more "
                         "predictions per sample; raise data.max_predictions_per_seq")
    out = dict(batch)
    for key in ("input_ids", "token_type_ids", "position_ids"):
        out[key] = torch.nn.functional.pad(batch[key], (0, pad))  # id 0, segment 0, position 0
    extra = layout.masked_slots - m
    out["masked_index"] = torch.nn.functional.pad(batch["masked_index"], (0, extra))  # row 0: valid
    out["mlm_labels"] = torch.nn.functional.pad(batch["mlm_labels"], (0, extra), value=IGNORE_INDEX)
    out["max_seqlen"] = layout.max_seq_length  # static: a Python int >= every length
    return out


FILLER = Sample(np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64), np.zeros(0, dtype=np.int64),
                np.zeros(0, dtype=np.int64), 0)  # one pad token, no prediction


class BudgetCollate:
    """The loaders' collate in budget mode: unpadded collate, then ``pad_batch``. With
    ``samples``, a batch of fewer samples is first filled up to that many with ``FILLER``
    (evaluation's last batch: one ``cu_seqlens`` shape for every batch)."""

    def __init__(self, layout: Layout, samples: int | None = None):
        self.layout, self.samples = layout, samples

    def __call__(self, samples: Sequence[Sample]) -> dict[str, Any]:
        if self.samples is not None and len(samples) < self.samples:
            samples = [*samples, *[FILLER] * (self.samples - len(samples))]
        return pad_batch(collate(samples, True, self.layout.max_seq_length), self.layout)


# ---------------------------------------------------------------- where the rungs go: the ladder
ALIGN = 64  # rungs on multiples of 64 tokens: whole bf16 GEMM tiles (the top rung excepted)
MAX_RUNGS = 8  # each rung costs a CUDA graph capture (and a compile) before run_start
MIN_GAIN = 0.005  # add a rung only while it saves >= 0.5% of the real tokens
MAX_BINS = 1024  # DP grid cap: O(K * bins^2) time, 8 MB per bins^2 matrix; coarser beyond
MC_DRAWS = 4096  # per-rank micro-batches simulated for sampler modes without a closed form
MC_SEED = 0  # the simulation's seed: the ladder is a pure function of the config
TAIL = 1e-4  # share of batches left to the full grid (beyond every simulated batch)


def layout_for(d: DataConfig, sm: SamplerConfig, local_batch: int, world_size: int, hidden: int) -> Layout | None:
    """The training budget layout of ``local_batch`` samples per rank (None when
    ``data.token_budgets`` is off); touches no data, so it may be built before run_start
    (warm-up, graph capture) and again by the loader. ``hidden``: the model's width (the
    sampler's cost deal weighs attention by it)."""
    if not d.token_budgets:
        return None
    rungs = parse_budgets(d.token_budgets, local_batch, d.max_seq_length)
    if rungs is None:
        pmf = token_pmf(sm, d.max_seq_length, local_batch, world_size, hidden)
        rungs = auto_ladder(pmf, local_batch * d.max_seq_length)
    return Layout(rungs, local_batch * d.max_predictions_per_seq, d.max_seq_length)


def eval_layout_for(d: DataConfig, batch_size: int) -> Layout | None:
    """The evaluation's budget layout of ``batch_size`` samples when ``data.token_budgets``
    is set (None otherwise): the ``auto`` ladder for that many samples drawn at random,
    ``batch_size * max_predictions_per_seq`` masked slots. Touches no data."""
    if not d.token_budgets:
        return None
    n, s = batch_size, d.max_seq_length
    rungs = auto_ladder(random_token_pmf(length_pmf(s), n), n * s)
    return Layout(rungs, n * d.max_predictions_per_seq, s)


# ---------------------------------------------------------------- the distribution of T


def length_pmf(max_seq_length: int) -> np.ndarray:
    """P(length = L) for L = 0..max_seq_length: the shipped Wikipedia histogram, scaled."""
    lengths, probs = length_distribution(max_seq_length)
    out = np.zeros(max_seq_length + 1)
    out[lengths] = probs
    return out


def random_token_pmf(pmf: np.ndarray, local_batch: int) -> np.ndarray:
    """P(T = t), t = 0..local_batch * S, for local_batch i.i.d. lengths: the B-fold
    convolution, by one FFT (exact up to float rounding, clipped at 0)."""
    n = local_batch * (len(pmf) - 1) + 1
    size = 1 << (n - 1).bit_length()
    out = np.fft.irfft(np.fft.rfft(pmf, size) ** local_batch, size)[:n]
    out = np.clip(out, 0.0, None)
    return out / out.sum()


def simulated_token_counts(sm: SamplerConfig, *, max_seq_length: int, local_batch: int, world_size: int, hidden: int,
                           pmf: np.ndarray, draws: int = MC_DRAWS, seed: int = MC_SEED) -> np.ndarray:
    """Real tokens of ``draws`` micro-batches of one rank's group, drawn by the project's own
    ``IndexSampler`` (strata, counts, rounding, deal) over a synthetic population of lengths
    from ``pmf``. Without a manifest before run_start, ``strata_width=0`` assumes the
    stratify step's default strata: four of max_seq_length / 4 tokens (as many as
    ``sampler.counts`` lists, when it is set)."""
    s = max_seq_length
    rng = np.random.default_rng(seed)
    population = rng.choice(len(pmf), size=max(65536, 4 * draws), p=pmf)
    strata = None
    if sm.mode == "stratified":
        n = len(sm.counts) if sm.counts else 4
        strata = Strata.from_lengths(population, even_bounds(s, sm.strata_width or math.ceil(s / n)))
    group = min(sm.group_size or world_size, world_size) if sm.deal != "none" else 1
    sampler = IndexSampler(population, strata, rank=0, world_size=group, local_batch=local_batch, seed=seed,
                           group=group, draw=sm.draw,
                           deal_policy=sm.deal, counts=sm.counts, rounding=sm.rounding,
                           hidden=hidden)
    out = []
    for step in range(math.ceil(draws / group)):
        if sm.deal == "none":
            out.append([int(population[sampler.unit_ids(step, 0)].sum())])
            continue
        ids = sampler.group_ids(step)
        lengths = population[ids]
        owner = deal(lengths, group, sm.deal, hidden)
        out.append(np.bincount(owner, weights=lengths, minlength=group).astype(np.int64).tolist())
    return np.concatenate(out)[:draws]


def token_pmf(sm: SamplerConfig, max_seq_length: int, local_batch: int, world_size: int, hidden: int) -> np.ndarray:
    """P(T = t) of one rank's real tokens per micro-batch of ``local_batch`` samples under
    the sampler ``sm``."""
    pmf = length_pmf(max_seq_length)
    full = local_batch * max_seq_length
    if sm.mode == "random" and sm.deal == "none":
        return random_token_pmf(pmf, local_batch)
    t = simulated_token_counts(sm, max_seq_length=max_seq_length, local_batch=local_batch, world_size=world_size,
                               hidden=hidden, pmf=pmf)
    counts = np.bincount(t, minlength=full + 1).astype(np.float64)
    # The simulated population is not the run's data: a run's token counts sit a little
    # apart (held-out populations shift the mean by up to ~0.5 std for fine strata). A
    # Gaussian blur of half a std (at least ALIGN tokens) stands for that, so the rungs and
    # the tail cover do not fit one population's noise; costs ~0.2 points of padding.
    sigma = max(float(ALIGN), 0.5 * float(t.std()))
    half = int(4 * sigma)
    kernel = np.exp(-0.5 * (np.arange(-half, half + 1) / sigma) ** 2)
    smooth = np.convolve(counts, kernel)[half: half + full + 1]
    return smooth / smooth.sum()


# ---------------------------------------------------------------- placing the rungs


def _grid(top: int) -> np.ndarray:
    align = ALIGN * max(1, math.ceil(top / ALIGN / MAX_BINS))
    return np.append(np.arange(align, top, align), top)


def optimal_ladder(pmf: np.ndarray, top: int, rungs: int) -> tuple[int, ...]:
    """``rungs`` budgets on the aligned grid, the last ``top``, minimising E[rung(T)] for
    T ~ ``pmf`` (index = tokens). Dynamic programming over the grid points: f[k][i] = least
    expected rung covering every T up to grid point i with k rungs, the highest at i."""
    cand = _grid(top)
    n = len(cand)
    cum = np.concatenate([[0.0], np.cumsum(pmf)])  # cum[t] = P(T < t)
    pc = cum[np.minimum(cand + 1, len(pmf))]  # P(T <= cand[i])
    rungs = min(rungs, n)
    f = cand * pc  # k = 1: one rung at i serves every T <= cand[i]
    back = []
    lower = np.tril(np.ones((n, n), dtype=bool), -1)  # h < i
    for _ in range(rungs - 1):
        # cost[i, h] = f[h] + cand[i] * (P(T <= cand[i]) - P(T <= cand[h])), h < i
        cost = np.where(lower, f[None, :] + cand[:, None] * (pc[:, None] - pc[None, :]), np.inf)
        h = np.argmin(cost, axis=1)
        f = cost[np.arange(n), h]
        back.append(h)
    out, i = [n - 1], n - 1
    for h in reversed(back):
        i = int(h[i])
        out.append(i)
    return tuple(int(cand[i]) for i in reversed(out))


def expected_padding(pmf: np.ndarray, rungs: Sequence[int]) -> float:
    """E[rung(T) - T] / E[T]: padding as a fraction of the real tokens."""
    t = np.arange(len(pmf))
    rung_of = np.asarray(rungs)[np.searchsorted(rungs, t)]
    mean = float((pmf * t).sum())
    return float((pmf * (rung_of - t)).sum()) / mean


def tail_cover(pmf: np.ndarray, top: int) -> int:
    """The smallest aligned token count that all but TAIL of the batches fit (capped at
    ``top``): the highest rung below the full grid. Past it the full grid takes the batch."""
    tail = np.cumsum(pmf[::-1])[::-1]  # tail[t] = P(T >= t)
    t = int(np.argmax(np.append(tail, 0.0)[1:] <= TAIL))  # first t with P(T > t) <= TAIL
    return min(top, math.ceil(t / ALIGN) * ALIGN)


def ladder(pmf: np.ndarray, top: int, rungs: int) -> tuple[int, ...]:
    """``rungs`` budgets: the full grid ``top`` plus ``rungs - 1`` placed by
    ``optimal_ladder`` up to ``tail_cover`` (so the full grid serves only the rare tail a
    held-out draw exceeds; fitting the tail itself would chase noise in a simulated pmf)."""
    cover = tail_cover(pmf, top)
    if rungs == 1 or cover >= top:
        return optimal_ladder(pmf, top, rungs)
    return (*optimal_ladder(pmf[: cover + 1], cover, rungs - 1), top)


def auto_ladder(pmf: np.ndarray, top: int) -> tuple[int, ...]:
    """The fewest rungs (<= MAX_RUNGS) past which one more saves < MIN_GAIN of the tokens."""
    best = ladder(pmf, top, 1)
    pad = expected_padding(pmf, best)
    for k in range(2, MAX_RUNGS + 1):
        nxt = ladder(pmf, top, k)
        nxt_pad = expected_padding(pmf, nxt)
        if pad - nxt_pad < MIN_GAIN:
            break
        best, pad = nxt, nxt_pad
    return best
