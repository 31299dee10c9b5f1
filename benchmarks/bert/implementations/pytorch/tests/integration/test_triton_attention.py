"""bert/triton_attention.py (the "triton" attention backend) against ``MathAttention``: the
tests that start processes (peers, launchers, tools); tests/unit/test_triton_attention.py
has the rest and says what the file covers."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from bert import triton_attention as ta
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


_COMPILE_FOR_H200 = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from bert import triton_attention as ta

FLOATS = {"qk_scale", "sm_scale", "keep_scale"}
STATS = {"LSE", "DELTA"}


def compile_kernel(fn, blocks, dropout):
    consts = dict(HEAD_DIM=64, BLOCK_M=blocks[0], DROPOUT=dropout)
    if "BLOCK_N" in fn.arg_names:
        consts["BLOCK_N"] = blocks[1]
    consts = {k: v for k, v in consts.items() if k in fn.arg_names}
    sig = {}
    for name in fn.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name in STATS:
            sig[name] = "*fp32"
        elif name == "CU":
            sig[name] = "*i32"
        elif name == "SEED":
            sig[name] = "*i64"
        elif name.isupper():
            sig[name] = "*bf16"
        else:
            sig[name] = "fp32" if name in FLOATS else "i32"
    opts = dict(num_warps=blocks[2], num_stages=blocks[3])
    triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32), options=opts)


for dropout in (False, True):
    compile_kernel(ta._fwd_kernel, ta.FWD_BLOCKS, dropout)
compile_kernel(ta._bwd_preprocess, ta.BWD_BLOCKS, True)
compile_kernel(ta._bwd_dkdv_kernel, ta.BWD_BLOCKS, True)
compile_kernel(ta._bwd_dq_kernel, ta.BWD_BLOCKS, True)
print("ok")
"""


@pytest.mark.skipif(not ta.AVAILABLE, reason=_WHY)
def test_kernels_compile_for_h200(tmp_path):
    """The interpreter does not type-check like the compiler: compile every kernel (bf16,
    head dim 64, the default blocks, with dropout; the forward without too) for sm_90, the
    H200, through Triton's whole pipeline down to the cubin (triton's wheel carries ptxas;
    no GPU needed). A fresh process, without TRITON_INTERPRET, and a private cache."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    r = subprocess.run([sys.executable, "-c", _COMPILE_FOR_H200], cwd=PKG, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr[-3000:]
