"""bert/triton_attention.py (the "triton" attention backend) against ``MathAttention``: the
tests that start processes (peers, launchers, tools); tests/unit/test_triton_attention.py
has the rest and says what the file covers."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from bert import triton_attention as ta
from cxx_compiler import cxx_unavailable
import layer_compile_helpers
import triton_interpret
from conftest import PKG


_WHY = triton_interpret.why_not_interpreted()  # the skip reason of the interpreter's tests


def test_without_triton_the_module_imports_and_auto_skips_it():
    """A Python where ``import triton`` fails: bert.triton_attention still imports (backend
    unavailable), ``auto`` on CUDA works, asking for it by name says why."""
    code = """
import sys
sys.modules["triton"] = None  # import triton now raises ImportError
import pytest
from bert import triton_attention as ta
from bert.attention import build_attention, triton_varlen_func
assert not ta.AVAILABLE and triton_varlen_func() is None
none = lambda: None
assert build_attention("auto", "cuda", 0.1, flash=none, torch_varlen=none).name == "sdpa"
with pytest.raises(ValueError, match="the triton package .*kernel missing"):
    build_attention("triton", "cuda")
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], cwd=PKG, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr


@pytest.mark.skipif(not ta.AVAILABLE, reason=_WHY)
def test_every_kernel_and_swept_block_size_compiles_for_h200_without_spills_by_default(tmp_path):
    """The interpreter does not type-check like the compiler: bench/triton_sm90.py compiles
    every kernel (the mask kernel too) for sm_90, the H200, through Triton's whole pipeline
    to the cubin (triton's wheel carries ptxas; no GPU needed), bound from a training
    call's arguments as the device's launcher binds them, for every block configuration the
    device run sweeps, with and without dropout, and the speed levers' (the stored dropout
    mask at each forward tile, and read by the backward). A fresh process, without
    TRITON_INTERPRET. The default blocks must not spill (ptxas's own report), nor the levers'
    kernels: the mask-bits variants and the 128x64 8-warp forward tile."""
    from bench.attention_blocks import BLOCK_CONFIGS

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    out = tmp_path / "sm90.json"
    r = subprocess.run([sys.executable, "bench/triton_sm90.py", "--json", str(out)], cwd=PKG, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    rows = json.loads(out.read_text())["kernels"]
    assert {row["kernel"] for row in rows} == {k.__name__ for k in ta.KERNELS}

    def compiled(kernel, blocks, dropout, bits=False):
        return [row for row in rows if row["kernel"] == kernel and row.get("DROPOUT") == dropout
                and row.get("MASK_BITS", False) == bits
                and (row["BLOCK_M"], row["BLOCK_N"], row["num_warps"], row["num_stages"]) == blocks]

    for fwd, bwd in BLOCK_CONFIGS:
        assert len(compiled("_fwd_kernel", fwd, True)) == 1, fwd
        for kernel in ("_bwd_dkdv_kernel", "_bwd_dq_kernel"):
            assert len(compiled(kernel, bwd, True)) == 1, (kernel, bwd)
    defaults = compiled("_fwd_kernel", ta.FWD_BLOCKS, False) + compiled("_fwd_kernel", ta.FWD_BLOCKS, True)
    for kernel in ("_bwd_dkdv_kernel", "_bwd_dq_kernel"):
        defaults += compiled(kernel, ta.BWD_BLOCKS, False) + compiled(kernel, ta.BWD_BLOCKS, True)
    assert len(defaults) == 6
    for row in rows:
        assert 0 < row["n_regs"] <= 255 and row["cubin_bytes"] > 0, row
    levers = compiled("_fwd_kernel", ta.FWD_TILES["128x64"], True)
    for tile in ta.FWD_TILES.values():
        levers += compiled("_fwd_kernel", tile, True, bits=True)
    for kernel in ("_bwd_dkdv_kernel", "_bwd_dq_kernel"):
        levers += compiled(kernel, ta.BWD_BLOCKS, True, bits=True)
    assert len(levers) == 5
    for row in defaults + levers:
        assert row["spill_stores_bytes"] == 0 and row["spill_loads_bytes"] == 0, row
    assert "| _mask_kernel | 32 |" in r.stdout


@pytest.mark.skipif(not triton_interpret.is_interpreted(), reason=triton_interpret.why_not_interpreted())
@pytest.mark.parametrize("backend, levers", [("aot_eager", {}), ("inductor", {}),
                                             ("inductor", {"fwd_tile": "128x64", "mask_bits": True})],
                         ids=["aot_eager", "inductor", "inductor-levers"])
def test_one_compile_serves_every_layer_and_rung_with_the_triton_op(monkeypatch, backend, levers):
    """model.compile_layers on a 4-layer model with the Triton op in Triton's interpreter (plain,
    and with its levers), the trainer's own build and warm-ups: one training compile for the 4
    layers and every budget rung, one no-grad compile for evaluation, none after (dynamo
    raising on a recompile). ``aot_eager``: AOT autograd over forward and backward through the
    op's fake implementation; ``inductor``: C++ on the CPU, its passes over the op, the dynamic
    shapes and the partition that the GPU's inductor shares. bench/preflight.sh runs these on
    the device's torch and Triton."""
    if backend == "inductor" and (why := cxx_unavailable()):
        pytest.skip(why)
    got = layer_compile_helpers.compiles_per_phase(monkeypatch, backend, levers)
    assert got == {"train_warmup": 1, "eval_warmup": 1, "after": 0, "rungs": got["rungs"],
                   "compiled_layers": layer_compile_helpers.LAYERS}, got
    assert got["rungs"] > 1
