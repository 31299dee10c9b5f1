"""bert.optim's graph-safe LAMB variants: the tests that start processes (peers, launchers,
tools); tests/unit/test_lamb_fused.py has the rest and says what the file covers."""

from __future__ import annotations

import pytest
import torch

from bert.optim import Lamb
from cxx_compiler import cxx_unavailable
from lamb_fused_helpers import fresh_dynamo  # noqa: F401 - an autouse fixture


def test_compiled_with_inductor_on_cpu():
    """The real backend once (inductor's C++ kernels on the CPU; on CUDA the same graph
    becomes Triton kernels), on a small parameter list to keep the build short."""
    why = cxx_unavailable()
    if why:
        pytest.skip(why)
    torch.manual_seed(0)
    ps = {v: [torch.nn.Parameter(torch.randn(s)) for s in ((5, 4), (4,))] for v in ("a", "b")}
    with torch.no_grad():
        for a, b in zip(ps["a"], ps["b"]):
            b.copy_(a)
    plain = Lamb([{"params": ps["a"][:1], "weight_decay": 0.01}, {"params": ps["a"][1:], "weight_decay": 0.0}], lr=0.01)
    comp = Lamb([{"params": ps["b"][:1], "weight_decay": 0.01}, {"params": ps["b"][1:], "weight_decay": 0.0}], lr=0.01,
                compile_backend="inductor")
    gen = torch.Generator().manual_seed(3)
    for k in range(3):
        for a, b in zip(ps["a"], ps["b"]):
            a.grad = torch.randn(a.shape, generator=gen)
            b.grad = a.grad.clone()
        plain.step()
        comp.step()
    for a, b in zip(ps["a"], ps["b"]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
