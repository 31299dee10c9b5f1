"""Helpers of test_optim.py's unit and integration tests (and of other test files that import them)."""

from __future__ import annotations

import torch
from torch import nn


class Tiny(nn.Module):
    """Embedding + dense + LayerNorm + a decoder tied to the embedding, HF-style names.

    ``zero`` is a zero-initialized weight (parameter norm 0: trust ratio must fall back
    to 1); ``frozen`` must stay out of every group.
    """

    def __init__(self) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(11, 6)
        self.dense = nn.Linear(6, 6)
        self.LayerNorm = nn.LayerNorm(6)
        self.zero = nn.Linear(6, 5, bias=False)
        nn.init.zeros_(self.zero.weight)
        self.decoder = nn.Linear(6, 11)
        self.decoder.weight = self.word_embeddings.weight  # tied, as BERT's MLM head
        self.frozen = nn.Parameter(torch.ones(3, 3), requires_grad=False)


def make_model(seed: int = 0) -> Tiny:
    torch.manual_seed(seed)
    m = Tiny()
    with torch.no_grad():  # non-trivial LayerNorm parameters
        m.LayerNorm.weight.add_(0.1 * torch.randn(6))
        m.LayerNorm.bias.add_(0.1 * torch.randn(6))
    return m


def set_grads(model: nn.Module, seed: int) -> None:
    """Deterministic gradients. dense.bias always gets an all-zero gradient, dense.weight
    one on seed 0; ``zero`` keeps a zero weight but a real gradient on odd seeds and a zero
    one on even seeds (then both of its norms, parameter and update, are 0 in step 1)."""
    g = torch.Generator().manual_seed(1000 + seed)
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        p.grad = torch.randn(p.shape, generator=g)
    model.dense.bias.grad.zero_()
    if seed % 2 == 0:
        model.zero.weight.grad.zero_()
    if seed == 0:  # a decayed weight with zero gradient: its update is wd * p alone
        model.dense.weight.grad.zero_()
