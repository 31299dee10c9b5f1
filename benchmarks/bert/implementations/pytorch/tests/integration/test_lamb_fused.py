"""bert.optim's graph-safe LAMB variants: ``Lamb(capturable=True)`` (step counts
and lr on the device) and ``optim.impl=compiled`` (the same update under torch.compile),
against the plain foreach ``Lamb`` that tests/unit/test_optim.py checks against a per-tensor
oracle, with the project's own LambdaLR schedule; checkpoints across the variants; no
recompile per step; and, for the capturable step, no host read and no host value that
changes between steps (what a captured CUDA graph would bake in).

On the CPU the compiled variant runs with the "aot_eager" backend (the same Dynamo graph,
functionalized by AOTAutograd, without inductor's C++ build), plus one small inductor case.
"""

from __future__ import annotations

import os
import subprocess
import tempfile

import pytest
import torch

from bert.optim import Lamb


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Dynamo's cache lives on the code object, shared by every compiled Lamb: start each
    test from an empty one so its compile count is its own."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()


def _cxx_problem() -> str | None:
    """Why inductor cannot build C++ kernels here (no working compiler), or None."""
    from torch._inductor import cpp_builder, exc

    try:
        cxx = cpp_builder.get_cpp_compiler()
    except exc.InvalidCxxCompiler as e:
        return str(e)
    with tempfile.TemporaryDirectory() as d:
        r = subprocess.run([cxx, "-x", "c++", "-", "-o", os.path.join(d, "a.out")], input="int main() { return 0; }\n",
                           capture_output=True, text=True)
    return f"{cxx} cannot build a C++ program: {r.stderr.strip()[:300]}" if r.returncode else None


def test_compiled_with_inductor_on_cpu():
    """The real backend once (inductor's C++ kernels on the CPU; on CUDA the same graph
    becomes Triton kernels), on a small parameter list to keep the build short."""
    why = _cxx_problem()
    if why:
        pytest.skip(f"inductor needs a working C++ compiler (Debian: apt-get install g++): {why}")
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
