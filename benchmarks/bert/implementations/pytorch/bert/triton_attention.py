"""Variable-length flash attention with attention-probability dropout, in Triton.

``varlen(q, k, v, cu_seqlens, max_seqlen, dropout_p)``: q, k, v ``[T, H, D]`` (bf16/fp16
under autocast on a GPU; fp32 works too, its products then in tf32, Triton's default for
``tl.dot`` on a GPU), the real tokens of B sequences back to back
(``cu_seqlens`` int32 ``[B + 1]``), ``max_seqlen`` a Python int >= every length ->
``[T, H, D]`` in q's dtype. Attention costs sum L^2 (no padded grid), the scores never
reach memory, and dropout is applied inside the kernel -- what the GPU lacks without
flash-attn (torch's own varlen kernel has no dropout; see bert/attention.py).

Why each piece is the way it is:

- Grid ``(cdiv(max_seqlen, BLOCK), B, H)``: each program reads its sequence's bounds from
  ``cu_seqlens`` on the device and returns at once when its block starts past the
  sequence's end, so the host never learns a length (no sync; the launch shape depends on
  ``max_seqlen`` and B only, which are static in budget mode). Cost: up to
  B * H * cdiv(max_seqlen, BLOCK) programs of which the ones past a short sequence do
  nothing but two loads.
- Rows past ``cu_seqlens[-1]`` (a static token budget's padding) belong to no program: the
  output and the gradients are allocated zero-filled, so they are exactly 0 there. Cost: a
  memset of each output (T * H * D elements; small next to the attention itself).
- Softmax in fp32 with the flash-attention-2 online rescaling, in base 2 (``exp2``; the
  scale folds in log2(e)). The forward stores the row log-sum-exp (base 2, fp32, ``[H, T]``)
  so the backward recomputes P = exp2(S - lse) without a second reduction.
- Dropout: a Philox stream keyed by a seed that lives in a device tensor, drawn per call
  with ``torch.randint`` on q's device (so a captured CUDA graph draws a new seed on each
  replay; no host int per step). The element (b, h, i, j) -- query i, key j of sequence b,
  head h -- uses counter ((b * H + h) * max_seqlen + i) * max_seqlen + j (int64), so the
  mask does not depend on the block sizes and the backward regenerates exactly the
  forward's mask from the saved seed (``dropout_mask`` returns it, for tests). A key is
  kept when its uniform draw is >= p and kept values are scaled by 1 / (1 - p). Cost: one
  Philox evaluation per score element in the forward and two in the backward (dK/dV and
  dQ recompute it).
- Backward as in flash-attention 2: a preprocess computes delta = rowsum(dO * O) (valid
  with dropout too: rowsum(dP o P) = rowsum(dO o O) when O uses the dropped, rescaled P);
  one kernel per key block accumulates dK and dV over the query blocks, one per query
  block accumulates dQ over the key blocks. No atomics (deterministic); the price is
  computing Q K^T (and the dropout mask) twice.
- Exposed as ``torch.library.custom_op`` (``bert::triton_varlen_fwd`` / ``_bwd``) with fake
  (meta) implementations and registered autograd, so ``torch.compile`` keeps it as one
  opaque op without a graph break.

Triton is optional: without it this module still imports, ``AVAILABLE`` is False and
``varlen`` raises. On a CPU the kernels run only in Triton's interpreter
(``TRITON_INTERPRET=1`` set before triton is first imported; tests/conftest.py does it).

Block sizes (``FWD_BLOCKS``, ``BWD_BLOCKS``) and ``num_warps``/``num_stages`` are first
guesses for an H100/H200 at head dim 64, not measured; a GPU session should tune them.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the backend is then unavailable; bert.attention falls back
    triton = None
    tl = None

AVAILABLE = triton is not None

# (BLOCK_M query rows, BLOCK_N key rows, num_warps, num_stages). Untuned guesses: 64 x 64
# tiles keep the fp32 scores, the Philox state and a 64-wide accumulator within a 4-warp
# program's registers at head dim 64; a GPU session should sweep 32..128 and 4/8 warps.
FWD_BLOCKS = (64, 64, 4, 2)
BWD_BLOCKS = (64, 64, 4, 2)
LOG2E = 1.4426950408889634


if AVAILABLE:

    @triton.jit
    def _keep(seed, bh, rows, cols, max_seqlen, dropout_p):
        """True where the dropout mask keeps score (rows, cols) of program (b, h).

        ``rows``/``cols`` are broadcastable position tiles within the sequence; the Philox
        counter numbers a dense [B, H, max_seqlen, max_seqlen] grid. int64, because int32
        would wrap once B * H > 8192 at max_seqlen 512 (BERT-Large: 16 heads, 512 samples).
        """
        base = bh.to(tl.int64) * max_seqlen * max_seqlen
        offsets = base + (rows * max_seqlen + cols).to(tl.int64)
        return tl.rand(seed, offsets) >= dropout_p

    @triton.jit
    def _fwd_kernel(Q, K, V, O, LSE, CU, SEED,
                    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                    stride_ot, stride_oh, n_heads, n_tokens, max_seqlen,
                    qk_scale, dropout_p, keep_scale,
                    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    DROPOUT: tl.constexpr):
        pid_m = tl.program_id(0)
        b = tl.program_id(1)
        h = tl.program_id(2)
        start = tl.load(CU + b)
        seqlen = tl.load(CU + b + 1) - start
        if pid_m * BLOCK_M >= seqlen:
            return
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols0 = tl.arange(0, BLOCK_N)
        dims = tl.arange(0, HEAD_DIM)
        row_ok = rows < seqlen
        # The sequence's first row as an int64 scalar offset (T * stride can pass 2^31 for
        # large budgets); tile offsets within a sequence stay int32.
        row0 = start.to(tl.int64)
        q_base = Q + row0 * stride_qt + h * stride_qh
        k_base = K + row0 * stride_kt + h * stride_kh
        v_base = V + row0 * stride_vt + h * stride_vh
        q = tl.load(q_base + rows[:, None] * stride_qt + dims[None, :], mask=row_ok[:, None], other=0.0)
        if DROPOUT:
            seed = tl.load(SEED)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        for start_n in range(0, seqlen, BLOCK_N):
            cols = start_n + cols0
            col_ok = cols < seqlen
            k = tl.load(k_base + cols[:, None] * stride_kt + dims[None, :], mask=col_ok[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k)) * qk_scale  # fp32 scores, base-2 units
            s = tl.where(col_ok[None, :], s, float("-inf"))
            # Column 0 is real in the first block, so m_new is finite from the start.
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)  # the normaliser counts dropped keys too
            acc = acc * alpha[:, None]
            if DROPOUT:
                p = tl.where(_keep(seed, b * n_heads + h, rows[:, None], cols[None, :],
                                   max_seqlen, dropout_p), p, 0.0)
            v = tl.load(v_base + cols[:, None] * stride_vt + dims[None, :], mask=col_ok[:, None], other=0.0)
            acc += tl.dot(p.to(v.dtype), v)
            m_i = m_new
        acc = acc * (keep_scale / l_i)[:, None]
        o_ptrs = O + row0 * stride_ot + h * stride_oh + rows[:, None] * stride_ot + dims[None, :]
        tl.store(o_ptrs, acc.to(O.dtype.element_ty), mask=row_ok[:, None])
        tl.store(LSE + h * n_tokens + row0 + rows, m_i + tl.log2(l_i), mask=row_ok)

    @triton.jit
    def _bwd_preprocess(O, DO, DELTA, CU, stride_ot, stride_oh, stride_dot, stride_doh,
                        n_tokens, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
        """delta[h, t] = sum_d dO[t, h, d] * O[t, h, d], in fp32, for the real rows."""
        pid_m = tl.program_id(0)
        b = tl.program_id(1)
        h = tl.program_id(2)
        start = tl.load(CU + b)
        seqlen = tl.load(CU + b + 1) - start
        if pid_m * BLOCK_M >= seqlen:
            return
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        dims = tl.arange(0, HEAD_DIM)
        row_ok = rows < seqlen
        row0 = start.to(tl.int64)
        o = tl.load(O + row0 * stride_ot + h * stride_oh + rows[:, None] * stride_ot + dims[None, :],
                    mask=row_ok[:, None], other=0.0).to(tl.float32)
        do = tl.load(DO + row0 * stride_dot + h * stride_doh + rows[:, None] * stride_dot + dims[None, :],
                     mask=row_ok[:, None], other=0.0).to(tl.float32)
        tl.store(DELTA + h * n_tokens + row0 + rows, tl.sum(o * do, 1), mask=row_ok)

    @triton.jit
    def _bwd_dkdv_kernel(Q, K, V, DO, DK, DV, LSE, DELTA, CU, SEED,
                         stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                         stride_dot, stride_doh, stride_gt, stride_gh,
                         n_heads, n_tokens, max_seqlen, qk_scale, sm_scale, dropout_p, keep_scale,
                         HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         DROPOUT: tl.constexpr):
        """One key block: dV = sum over query blocks of Pd^T dO, dK = dS^T Q * scale.

        Works on transposed tiles ([BLOCK_N, BLOCK_M]) so the accumulators are [BLOCK_N, D].
        DK and DV share strides (both freshly allocated, contiguous).
        """
        pid_n = tl.program_id(0)
        b = tl.program_id(1)
        h = tl.program_id(2)
        start = tl.load(CU + b)
        seqlen = tl.load(CU + b + 1) - start
        if pid_n * BLOCK_N >= seqlen:
            return
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rows0 = tl.arange(0, BLOCK_M)
        dims = tl.arange(0, HEAD_DIM)
        col_ok = cols < seqlen
        row0 = start.to(tl.int64)
        q_base = Q + row0 * stride_qt + h * stride_qh
        do_base = DO + row0 * stride_dot + h * stride_doh
        stat_base = h * n_tokens + row0
        k = tl.load(K + row0 * stride_kt + h * stride_kh + cols[:, None] * stride_kt + dims[None, :],
                    mask=col_ok[:, None], other=0.0)
        v = tl.load(V + row0 * stride_vt + h * stride_vh + cols[:, None] * stride_vt + dims[None, :],
                    mask=col_ok[:, None], other=0.0)
        if DROPOUT:
            seed = tl.load(SEED)
        dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
        dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
        for start_m in range(0, seqlen, BLOCK_M):
            rows = start_m + rows0
            row_ok = rows < seqlen
            q = tl.load(q_base + rows[:, None] * stride_qt + dims[None, :], mask=row_ok[:, None], other=0.0)
            do = tl.load(do_base + rows[:, None] * stride_dot + dims[None, :], mask=row_ok[:, None], other=0.0)
            lse = tl.load(LSE + stat_base + rows, mask=row_ok, other=0.0)
            delta = tl.load(DELTA + stat_base + rows, mask=row_ok, other=0.0)
            s_t = tl.dot(k, tl.trans(q)) * qk_scale
            valid = col_ok[:, None] & row_ok[None, :]
            p_t = tl.where(valid, tl.exp2(s_t - lse[None, :]), 0.0)
            dp_t = tl.dot(v, tl.trans(do))  # d(dropped P)^T
            if DROPOUT:
                keep = _keep(seed, b * n_heads + h, rows[None, :], cols[:, None], max_seqlen, dropout_p)
                pd_t = tl.where(keep, p_t * keep_scale, 0.0)
                dp_t = tl.where(keep, dp_t * keep_scale, 0.0)
            else:
                pd_t = p_t
            dv += tl.dot(pd_t.to(do.dtype), do)
            ds_t = p_t * (dp_t - delta[None, :])
            dk += tl.dot(ds_t.to(q.dtype), q)
        g_off = row0 * stride_gt + h * stride_gh + cols[:, None] * stride_gt + dims[None, :]
        tl.store(DK + g_off, (dk * sm_scale).to(DK.dtype.element_ty), mask=col_ok[:, None])
        tl.store(DV + g_off, dv.to(DV.dtype.element_ty), mask=col_ok[:, None])

    @triton.jit
    def _bwd_dq_kernel(Q, K, V, DO, DQ, LSE, DELTA, CU, SEED,
                       stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                       stride_dot, stride_doh, stride_gt, stride_gh,
                       n_heads, n_tokens, max_seqlen, qk_scale, sm_scale, dropout_p, keep_scale,
                       HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       DROPOUT: tl.constexpr):
        """One query block: dQ = sum over key blocks of dS K * scale."""
        pid_m = tl.program_id(0)
        b = tl.program_id(1)
        h = tl.program_id(2)
        start = tl.load(CU + b)
        seqlen = tl.load(CU + b + 1) - start
        if pid_m * BLOCK_M >= seqlen:
            return
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols0 = tl.arange(0, BLOCK_N)
        dims = tl.arange(0, HEAD_DIM)
        row_ok = rows < seqlen
        row0 = start.to(tl.int64)
        k_base = K + row0 * stride_kt + h * stride_kh
        v_base = V + row0 * stride_vt + h * stride_vh
        q = tl.load(Q + row0 * stride_qt + h * stride_qh + rows[:, None] * stride_qt + dims[None, :],
                    mask=row_ok[:, None], other=0.0)
        do = tl.load(DO + row0 * stride_dot + h * stride_doh + rows[:, None] * stride_dot + dims[None, :],
                     mask=row_ok[:, None], other=0.0)
        lse = tl.load(LSE + h * n_tokens + row0 + rows, mask=row_ok, other=0.0)
        delta = tl.load(DELTA + h * n_tokens + row0 + rows, mask=row_ok, other=0.0)
        if DROPOUT:
            seed = tl.load(SEED)
        dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        for start_n in range(0, seqlen, BLOCK_N):
            cols = start_n + cols0
            col_ok = cols < seqlen
            k = tl.load(k_base + cols[:, None] * stride_kt + dims[None, :], mask=col_ok[:, None], other=0.0)
            v = tl.load(v_base + cols[:, None] * stride_vt + dims[None, :], mask=col_ok[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k)) * qk_scale
            p = tl.where(row_ok[:, None] & col_ok[None, :], tl.exp2(s - lse[:, None]), 0.0)
            dp = tl.dot(do, tl.trans(v))
            if DROPOUT:
                keep = _keep(seed, b * n_heads + h, rows[:, None], cols[None, :], max_seqlen, dropout_p)
                dp = tl.where(keep, dp * keep_scale, 0.0)
            ds = p * (dp - delta[:, None])
            dq += tl.dot(ds.to(k.dtype), k)
        tl.store(DQ + row0 * stride_gt + h * stride_gh + rows[:, None] * stride_gt + dims[None, :],
                 (dq * sm_scale).to(DQ.dtype.element_ty), mask=row_ok[:, None])

    @triton.jit
    def _mask_kernel(OUT, SEED, n_heads, max_seqlen, dropout_p, BLOCK: tl.constexpr):
        """keep[b, h, i, j] for every (i, j) < max_seqlen: the kernels' mask, for tests."""
        pid_m = tl.program_id(0)
        b = tl.program_id(1)
        h = tl.program_id(2)
        seed = tl.load(SEED)
        rows = pid_m * BLOCK + tl.arange(0, BLOCK)
        for start_n in range(0, max_seqlen, BLOCK):
            cols = start_n + tl.arange(0, BLOCK)
            keep = _keep(seed, b * n_heads + h, rows[:, None], cols[None, :], max_seqlen, dropout_p)
            bh = (b * n_heads + h).to(tl.int64)
            ptrs = OUT + (bh * max_seqlen + rows[:, None]) * max_seqlen + cols[None, :]
            tl.store(ptrs, keep.to(tl.int8), mask=(rows[:, None] < max_seqlen) & (cols[None, :] < max_seqlen))


def _row_major(t: torch.Tensor) -> torch.Tensor:
    """The kernels address [T, H, D] with free row/head strides but need a unit dim stride."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _check(q, k, v, cu_seqlens):
    if not AVAILABLE:
        raise RuntimeError("bert.triton_attention needs the triton package")
    if q.dim() != 3 or q.shape != k.shape or q.shape != v.shape:
        raise ValueError(f"q, k, v must share one [T, H, D] shape, got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    d = q.size(-1)
    if d < 16 or d & (d - 1):
        raise ValueError(f"head dim {d} must be a power of two >= 16 (tl.dot tiles)")
    if cu_seqlens.dtype != torch.int32:
        raise ValueError(f"cu_seqlens must be int32, got {cu_seqlens.dtype}")


def _forward(q, k, v, cu_seqlens, max_seqlen, dropout_p, seed):
    _check(q, k, v, cu_seqlens)
    q, k, v = _row_major(q), _row_major(k), _row_major(v)
    total, heads, dim = q.shape
    batch = cu_seqlens.numel() - 1
    block_m, block_n, warps, stages = FWD_BLOCKS
    out = torch.zeros_like(q, memory_format=torch.contiguous_format)  # pad rows stay 0
    lse = torch.empty((heads, total), dtype=torch.float32, device=q.device)
    sm_scale = 1.0 / math.sqrt(dim)
    dropout = dropout_p > 0.0
    grid = (triton.cdiv(max_seqlen, block_m), batch, heads)
    if batch > 0 and max_seqlen > 0:
        _fwd_kernel[grid](
            q, k, v, out, lse, cu_seqlens, seed if dropout else cu_seqlens,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            out.stride(0), out.stride(1), heads, total, max_seqlen,
            sm_scale * LOG2E, dropout_p, 1.0 / (1.0 - dropout_p),
            HEAD_DIM=dim, BLOCK_M=block_m, BLOCK_N=block_n, DROPOUT=dropout,
            num_warps=warps, num_stages=stages)
    return out, lse


def _backward(grad_out, q, k, v, out, lse, cu_seqlens, max_seqlen, dropout_p, seed):
    q, k, v, out, do = (_row_major(t) for t in (q, k, v, out, grad_out))
    total, heads, dim = q.shape
    batch = cu_seqlens.numel() - 1
    block_m, block_n, warps, stages = BWD_BLOCKS
    dq = torch.zeros_like(q, memory_format=torch.contiguous_format)  # pad rows stay 0
    dk = torch.zeros_like(k, memory_format=torch.contiguous_format)
    dv = torch.zeros_like(v, memory_format=torch.contiguous_format)
    if batch == 0 or max_seqlen == 0:
        return dq, dk, dv
    delta = torch.empty_like(lse)
    dropout = dropout_p > 0.0
    seed_arg = seed if dropout else cu_seqlens
    sm_scale = 1.0 / math.sqrt(dim)
    _bwd_preprocess[(triton.cdiv(max_seqlen, block_m), batch, heads)](
        out, do, delta, cu_seqlens, out.stride(0), out.stride(1), do.stride(0), do.stride(1),
        total, HEAD_DIM=dim, BLOCK_M=block_m)
    common = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
              do.stride(0), do.stride(1))
    scalars = (heads, total, max_seqlen, sm_scale * LOG2E, sm_scale, dropout_p, 1.0 / (1.0 - dropout_p))
    meta = dict(HEAD_DIM=dim, BLOCK_M=block_m, BLOCK_N=block_n, DROPOUT=dropout,
                num_warps=warps, num_stages=stages)
    _bwd_dkdv_kernel[(triton.cdiv(max_seqlen, block_n), batch, heads)](
        q, k, v, do, dk, dv, lse, delta, cu_seqlens, seed_arg, *common,
        dk.stride(0), dk.stride(1), *scalars, **meta)
    _bwd_dq_kernel[(triton.cdiv(max_seqlen, block_m), batch, heads)](
        q, k, v, do, dq, lse, delta, cu_seqlens, seed_arg, *common,
        dq.stride(0), dq.stride(1), *scalars, **meta)
    return dq, dk, dv


# ---------------------------------------------------------------- torch ops


@torch.library.custom_op("bert::triton_varlen_fwd", mutates_args=())
def _varlen_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                max_seqlen: int, dropout_p: float,
                seed: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward(q, k, v, cu_seqlens, max_seqlen, dropout_p, seed)


@_varlen_fwd.register_fake
def _(q, k, v, cu_seqlens, max_seqlen, dropout_p, seed):
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            q.new_empty((q.size(1), q.size(0)), dtype=torch.float32))


@torch.library.custom_op("bert::triton_varlen_bwd", mutates_args=())
def _varlen_bwd(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                out: torch.Tensor, lse: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                dropout_p: float, seed: Optional[torch.Tensor]
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward(grad_out, q, k, v, out, lse, cu_seqlens, max_seqlen, dropout_p, seed)


@_varlen_bwd.register_fake
def _(grad_out, q, k, v, out, lse, cu_seqlens, max_seqlen, dropout_p, seed):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


def _setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens, max_seqlen, dropout_p, seed = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens, seed)
    ctx.max_seqlen, ctx.dropout_p = max_seqlen, dropout_p


def _autograd_backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, cu_seqlens, seed = ctx.saved_tensors
    dq, dk, dv = _varlen_bwd(grad_out, q, k, v, out, lse, cu_seqlens, ctx.max_seqlen,
                             ctx.dropout_p, seed)
    return dq, dk, dv, None, None, None, None


_varlen_fwd.register_autograd(_autograd_backward, setup_context=_setup_context)


def draw_seed(device: torch.device) -> torch.Tensor:
    """A fresh Philox seed as a one-element int64 tensor on ``device``, drawn from torch's
    generator (graph-safe: under CUDA graph capture each replay draws anew)."""
    return torch.randint(0, 2**62, (1,), device=device, dtype=torch.int64)


def varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
           max_seqlen: int, dropout_p: float = 0.0, seed: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Variable-length attention with dropout (see the module docstring); differentiable.

    ``seed`` (int64 ``[1]`` on q's device) fixes the dropout mask, for tests; by default one
    is drawn per call when ``dropout_p > 0``.
    """
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if dropout_p > 0.0 and seed is None:
        seed = draw_seed(q.device)
    return _varlen_fwd(q, k, v, cu_seqlens, max_seqlen, float(dropout_p),
                       seed if dropout_p > 0.0 else None)[0]


def dropout_mask(seed: torch.Tensor, batch: int, heads: int, max_seqlen: int,
                 dropout_p: float) -> torch.Tensor:
    """The keep mask bool ``[batch, heads, max_seqlen, max_seqlen]`` that ``varlen`` applies
    with this seed: [b, h, i, j] for query i and key j of sequence b (same ``_keep`` call
    and counters as the kernels)."""
    if not AVAILABLE:
        raise RuntimeError("bert.triton_attention needs the triton package")
    out = torch.empty((batch, heads, max_seqlen, max_seqlen), dtype=torch.int8, device=seed.device)
    block = 32
    _mask_kernel[(triton.cdiv(max_seqlen, block), batch, heads)](
        out, seed, heads, max_seqlen, float(dropout_p), BLOCK=block)
    return out.bool()
