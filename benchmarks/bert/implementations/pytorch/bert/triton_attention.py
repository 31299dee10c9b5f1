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
- Dropout: Philox-4x32-10 (Triton's ``tl.philox``, 32-bit arithmetic) keyed by a seed that
  lives in a device tensor, drawn per call with ``torch.randint`` on q's device (so a
  captured CUDA graph draws a new seed on each replay; no host int per step). One Philox
  call gives four 32-bit words, and each word two 16-bit draws: 8 keep decisions per call,
  for 8 adjacent keys of one query. The element (b, h, i, j) -- query i, key j of sequence
  b, head h -- is decided by the call with counter (c0, c1) = (i * ceil(max_seqlen / 8) +
  j // 8, b * H + h), word (j % 8) // 2, half j % 2 (low first); kept when that 16-bit draw
  is >= ``dropout_threshold(p)`` = round(p * 65536). The mask thus depends on no block size,
  and the backward regenerates exactly the forward's mask from the saved seed
  (``dropout_mask`` returns it, for tests); or, with ``mask_bits``, the forward stores
  each Philox call's 8 decisions as one byte (``mask_buffer``: [B, H, max_seqlen,
  ceil(max_seqlen / 8)] uint8, bit d = key 8 * group + d) and both backward kernels read
  those bytes instead of drawing again: the same mask, one byte read per 8 scores in place
  of a Philox call, at the price of the buffer (kept from forward to backward: 50 MB a layer
  at 96 sequences of up to 512, 16 heads). The rate applied is that threshold / 65536
  (``applied_dropout(0.1)`` = 0.1000061), and kept values are scaled by 1 / (1 - that), so
  the expectation is exact. Cost: one Philox call per 8 score elements in the forward and
  in each of the two backward kernels (dK/dV and dQ recompute it), plus the shuffle that
  spreads the 8 draws over 8 columns (``tl.join`` and a reshape).
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
guesses for an H100/H200 at head dim 64, not measured; ``forward``/``backward`` take
others (bench/gpu_bert_large.py sweeps a few, and records ``kernel_stats``: registers and
spills of every compiled kernel).
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
# program's registers at head dim 64; the device run sweeps a few (bench/gpu_bert_large.py).
FWD_BLOCKS = (64, 64, 4, 2)
BWD_BLOCKS = (64, 64, 4, 2)
# The forward tiles ``model.triton_fwd_tile`` names: 64x64 is FWD_BLOCKS; 128x64 with 8 warps
# holds twice the query rows per program (half the K/V reloads) without spilling for sm_90
# (bench/triton_sm90.py; the 4-warp 128x64 spills).
FWD_TILES = {"64x64": FWD_BLOCKS, "128x64": (128, 64, 8, 2)}
DEFAULT_FWD_TILE = "64x64"  # FWD_BLOCKS
LOG2E = 1.4426950408889634
KEYS_PER_CALL = 8  # keep decisions per Philox call: 4 words x 2 halves of 16 bits
DRAW_LEVELS = 65536  # a 16-bit draw: the dropout rate is applied in steps of 1 / 65536


if AVAILABLE:

    @triton.jit
    def _keep(seed, bh, rows, col0, n_groups, threshold, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """[BLOCK_M, BLOCK_N] bool: True where the dropout mask keeps score (row, col) of
        program (b, h), for the query positions ``rows`` ([BLOCK_M], within the sequence)
        and the BLOCK_N keys from ``col0`` (a multiple of 8) on.

        One Philox-4x32 call per (row, group of 8 keys): counter (row * n_groups + key // 8,
        b * H + h, 0, 0), key = the seed's two 32-bit halves. Its four words give 8 16-bit
        draws; the join tree below puts draw d of a group at key 8 * group + d, d = 2 * word
        + half (low half first). 32-bit counters: row * n_groups + group < max_seqlen^2 / 8.
        """
        groups = col0 // 8 + tl.arange(0, BLOCK_N // 8)
        c0 = rows[:, None] * n_groups + groups[None, :]  # int32 [BLOCK_M, BLOCK_N // 8]
        c1 = tl.zeros_like(c0) + bh
        zero = tl.zeros_like(c0)
        w0, w1, w2, w3 = tl.philox(seed, c0, c1, zero, zero)
        lo0 = (w0 & 0xFFFF).to(tl.int32) >= threshold
        lo1 = (w1 & 0xFFFF).to(tl.int32) >= threshold
        lo2 = (w2 & 0xFFFF).to(tl.int32) >= threshold
        lo3 = (w3 & 0xFFFF).to(tl.int32) >= threshold
        hi0 = (w0 >> 16).to(tl.int32) >= threshold
        hi1 = (w1 >> 16).to(tl.int32) >= threshold
        hi2 = (w2 >> 16).to(tl.int32) >= threshold
        hi3 = (w3 >> 16).to(tl.int32) >= threshold
        # Each join appends a last dim of 2, and the reshape reads the last dim fastest: so
        # join by word // 2 first, then word % 2, then the half -> key offset 2 * word + half.
        lo = tl.join(tl.join(lo0, lo2), tl.join(lo1, lo3))
        hi = tl.join(tl.join(hi0, hi2), tl.join(hi1, hi3))
        keep = tl.join(lo, hi)  # [BLOCK_M, BLOCK_N // 8, 2, 2, 2]
        return tl.reshape(keep, [BLOCK_M, BLOCK_N])

    @triton.jit
    def _keep_bits(seed, bh, rows, col0, n_groups, threshold, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """``_keep``'s decisions packed, [BLOCK_M, BLOCK_N // 8] uint8: one byte per Philox
        call, bit d for key 8 * group + d (d = 2 * word + half, as ``_keep`` places them)."""
        groups = col0 // 8 + tl.arange(0, BLOCK_N // 8)
        c0 = rows[:, None] * n_groups + groups[None, :]
        c1 = tl.zeros_like(c0) + bh
        zero = tl.zeros_like(c0)
        w0, w1, w2, w3 = tl.philox(seed, c0, c1, zero, zero)
        bits = ((w0 & 0xFFFF).to(tl.int32) >= threshold).to(tl.int32)
        bits |= ((w0 >> 16).to(tl.int32) >= threshold).to(tl.int32) << 1
        bits |= ((w1 & 0xFFFF).to(tl.int32) >= threshold).to(tl.int32) << 2
        bits |= ((w1 >> 16).to(tl.int32) >= threshold).to(tl.int32) << 3
        bits |= ((w2 & 0xFFFF).to(tl.int32) >= threshold).to(tl.int32) << 4
        bits |= ((w2 >> 16).to(tl.int32) >= threshold).to(tl.int32) << 5
        bits |= ((w3 & 0xFFFF).to(tl.int32) >= threshold).to(tl.int32) << 6
        bits |= ((w3 >> 16).to(tl.int32) >= threshold).to(tl.int32) << 7
        return bits.to(tl.uint8)

    @triton.jit
    def _unpack(bits, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """[BLOCK_M, BLOCK_N // 8] bytes -> the [BLOCK_M, BLOCK_N] keep mask they hold."""
        shifted = bits.to(tl.int32)[:, :, None] >> tl.arange(0, 8)[None, None, :]
        return tl.reshape((shifted & 1) != 0, [BLOCK_M, BLOCK_N])

    @triton.jit
    def _mask_offsets(rows, col0, n_groups, BLOCK_N: tl.constexpr):
        """Offsets of the [rows, BLOCK_N // 8 groups from key col0] bytes in one (b, h)'s
        [max_seqlen, n_groups] slice of the stored mask, and which of them lie inside it."""
        groups = col0 // 8 + tl.arange(0, BLOCK_N // 8)
        return rows[:, None] * n_groups + groups[None, :], (groups < n_groups)[None, :]

    @triton.jit
    def _fwd_kernel(Q, K, V, O, LSE, CU, SEED, MASK,
                    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                    stride_ot, stride_oh, n_heads, n_tokens, n_groups, mask_bh_stride,
                    qk_scale, threshold, keep_scale,
                    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    DROPOUT: tl.constexpr, MASK_BITS: tl.constexpr):
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
            if MASK_BITS:
                mask_base = MASK + (b * n_heads + h).to(tl.int64) * mask_bh_stride
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
                if MASK_BITS:  # drawn once here, stored for both backward kernels
                    bits = _keep_bits(seed, b * n_heads + h, rows, start_n, n_groups, threshold, BLOCK_M, BLOCK_N)
                    offs, in_mask = _mask_offsets(rows, start_n, n_groups, BLOCK_N)
                    tl.store(mask_base + offs, bits, mask=row_ok[:, None] & in_mask)
                    keep = _unpack(bits, BLOCK_M, BLOCK_N)
                else:
                    keep = _keep(seed, b * n_heads + h, rows, start_n, n_groups, threshold, BLOCK_M, BLOCK_N)
                p = tl.where(keep, p, 0.0)
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
    def _bwd_dkdv_kernel(Q, K, V, DO, DK, DV, LSE, DELTA, CU, SEED, MASK,
                         stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                         stride_dot, stride_doh, stride_gt, stride_gh,
                         n_heads, n_tokens, n_groups, mask_bh_stride, qk_scale, sm_scale, threshold, keep_scale,
                         HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         DROPOUT: tl.constexpr, MASK_BITS: tl.constexpr):
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
            if MASK_BITS:
                mask_base = MASK + (b * n_heads + h).to(tl.int64) * mask_bh_stride
            else:
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
                # The [queries, keys] tile the forward drew, transposed to this kernel's [keys, queries].
                if MASK_BITS:
                    offs, in_mask = _mask_offsets(rows, pid_n * BLOCK_N, n_groups, BLOCK_N)
                    keep = tl.trans(_unpack(tl.load(mask_base + offs, mask=row_ok[:, None] & in_mask, other=0),
                                            BLOCK_M, BLOCK_N))
                else:
                    keep = tl.trans(_keep(seed, b * n_heads + h, rows, pid_n * BLOCK_N, n_groups, threshold,
                                          BLOCK_M, BLOCK_N))
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
    def _bwd_dq_kernel(Q, K, V, DO, DQ, LSE, DELTA, CU, SEED, MASK,
                       stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                       stride_dot, stride_doh, stride_gt, stride_gh,
                       n_heads, n_tokens, n_groups, mask_bh_stride, qk_scale, sm_scale, threshold, keep_scale,
                       HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       DROPOUT: tl.constexpr, MASK_BITS: tl.constexpr):
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
            if MASK_BITS:
                mask_base = MASK + (b * n_heads + h).to(tl.int64) * mask_bh_stride
            else:
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
                if MASK_BITS:
                    offs, in_mask = _mask_offsets(rows, start_n, n_groups, BLOCK_N)
                    keep = _unpack(tl.load(mask_base + offs, mask=row_ok[:, None] & in_mask, other=0), BLOCK_M, BLOCK_N)
                else:
                    keep = _keep(seed, b * n_heads + h, rows, start_n, n_groups, threshold, BLOCK_M, BLOCK_N)
                dp = tl.where(keep, dp * keep_scale, 0.0)
            ds = p * (dp - delta[:, None])
            dq += tl.dot(ds.to(k.dtype), k)
        tl.store(DQ + row0 * stride_gt + h * stride_gh + rows[:, None] * stride_gt + dims[None, :],
                 (dq * sm_scale).to(DQ.dtype.element_ty), mask=row_ok[:, None])

    @triton.jit
    def _mask_kernel(OUT, SEED, n_heads, max_seqlen, n_groups, threshold, BLOCK: tl.constexpr):
        """keep[b, h, i, j] for every (i, j) < max_seqlen: the kernels' mask, for tests."""
        pid_m = tl.program_id(0)
        b = tl.program_id(1)
        h = tl.program_id(2)
        seed = tl.load(SEED)
        rows = pid_m * BLOCK + tl.arange(0, BLOCK)
        for start_n in range(0, max_seqlen, BLOCK):
            cols = start_n + tl.arange(0, BLOCK)
            keep = _keep(seed, b * n_heads + h, rows, start_n, n_groups, threshold, BLOCK, BLOCK)
            bh = (b * n_heads + h).to(tl.int64)
            ptrs = OUT + (bh * max_seqlen + rows[:, None]) * max_seqlen + cols[None, :]
            tl.store(ptrs, keep.to(tl.int8), mask=(rows[:, None] < max_seqlen) & (cols[None, :] < max_seqlen))

    # Every kernel of this module (kernel_stats; bench/triton_sm90.py compiles each for sm_90).
    KERNELS = (_fwd_kernel, _bwd_preprocess, _bwd_dkdv_kernel, _bwd_dq_kernel, _mask_kernel)


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


def dropout_threshold(dropout_p: float) -> int:
    """The 16-bit draw at and above which a score is kept: round(p * 65536), in [0, 65535]."""
    return min(DRAW_LEVELS - 1, max(0, round(dropout_p * DRAW_LEVELS)))


def applied_dropout(dropout_p: float) -> float:
    """The dropout rate the kernels apply for ``dropout_p``: the threshold's share of the
    16-bit draws (0.1 -> 6554 / 65536 = 0.1000061); kept values are scaled by 1 / (1 - it)."""
    return dropout_threshold(dropout_p) / DRAW_LEVELS


def _check_blocks(blocks: tuple[int, int, int, int]) -> tuple[int, int, int, int]:
    block_m, block_n, warps, stages = blocks
    for name, b in (("BLOCK_M", block_m), ("BLOCK_N", block_n)):
        if b < 16 or b & (b - 1):
            raise ValueError(f"{name}={b} must be a power of two >= 16 (tl.dot tiles; 8 keys per Philox call)")
    return blocks


def _launch(kernel, grid, *args, **kwargs):
    kernel[grid](*args, **kwargs)


def mask_buffer(batch: int, heads: int, max_seqlen: int, device: torch.device) -> torch.Tensor:
    """Where ``forward(..., mask=)`` stores the keep decisions: uint8 [batch, heads,
    max_seqlen, ceil(max_seqlen / 8)], one bit per score (bytes of rows and key groups past a
    sequence's length are never written nor read: ``empty``, no memset)."""
    return torch.empty((batch, heads, max_seqlen, -(-max_seqlen // KEYS_PER_CALL)), dtype=torch.uint8, device=device)


def _mask_args(mask, dropout, cu_seqlens):
    """The kernels' MASK pointer, its (b, h) stride and MASK_BITS (a stand-in pointer and
    0 when no mask is stored or read)."""
    bits = dropout and mask is not None
    return (mask if bits else cu_seqlens), (mask.stride(1) if bits else 0), bits


def forward(q, k, v, cu_seqlens, max_seqlen, dropout_p, seed, blocks=None, launch=_launch, mask=None):
    """The forward kernel: (out, lse). ``blocks`` (BLOCK_M, BLOCK_N, num_warps, num_stages)
    defaults to ``FWD_BLOCKS``; another choice changes the speed, never the numbers' meaning
    (the dropout mask depends on no block size). ``launch(kernel, grid, *args, **kwargs)``
    runs each kernel (bench/triton_sm90.py passes one that compiles it for sm_90 instead,
    from the arguments a real call passes). ``mask`` (``mask_buffer``'s, with dropout): the
    keep decisions are stored there for ``backward(..., mask=)``."""
    _check(q, k, v, cu_seqlens)
    q, k, v = _row_major(q), _row_major(k), _row_major(v)
    total, heads, dim = q.shape
    batch = cu_seqlens.numel() - 1
    block_m, block_n, warps, stages = _check_blocks(blocks or FWD_BLOCKS)
    out = torch.zeros_like(q, memory_format=torch.contiguous_format)  # pad rows stay 0
    lse = torch.empty((heads, total), dtype=torch.float32, device=q.device)
    sm_scale = 1.0 / math.sqrt(dim)
    dropout = dropout_p > 0.0
    grid = (triton.cdiv(max_seqlen, block_m), batch, heads)
    mask_ptr, mask_stride, bits = _mask_args(mask, dropout, cu_seqlens)
    if batch > 0 and max_seqlen > 0:
        launch(_fwd_kernel, grid,
               q, k, v, out, lse, cu_seqlens, seed if dropout else cu_seqlens, mask_ptr,
               q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
               out.stride(0), out.stride(1), heads, total, triton.cdiv(max_seqlen, KEYS_PER_CALL), mask_stride,
               sm_scale * LOG2E, dropout_threshold(dropout_p), 1.0 / (1.0 - applied_dropout(dropout_p)),
               HEAD_DIM=dim, BLOCK_M=block_m, BLOCK_N=block_n, DROPOUT=dropout, MASK_BITS=bits,
               num_warps=warps, num_stages=stages)
    return out, lse


def backward(grad_out, q, k, v, out, lse, cu_seqlens, max_seqlen, dropout_p, seed, blocks=None, launch=_launch,
             mask=None):
    """The three backward kernels: (dq, dk, dv). ``blocks`` defaults to ``BWD_BLOCKS``;
    ``launch`` as ``forward``'s; ``mask``: the forward's stored keep decisions, read instead
    of drawn again (``seed`` then unused)."""
    q, k, v, out, do = (_row_major(t) for t in (q, k, v, out, grad_out))
    total, heads, dim = q.shape
    batch = cu_seqlens.numel() - 1
    block_m, block_n, warps, stages = _check_blocks(blocks or BWD_BLOCKS)
    dq = torch.zeros_like(q, memory_format=torch.contiguous_format)  # pad rows stay 0
    dk = torch.zeros_like(k, memory_format=torch.contiguous_format)
    dv = torch.zeros_like(v, memory_format=torch.contiguous_format)
    if batch == 0 or max_seqlen == 0:
        return dq, dk, dv
    delta = torch.empty_like(lse)
    dropout = dropout_p > 0.0
    seed_arg = seed if dropout else cu_seqlens
    sm_scale = 1.0 / math.sqrt(dim)
    launch(_bwd_preprocess, (triton.cdiv(max_seqlen, block_m), batch, heads),
           out, do, delta, cu_seqlens, out.stride(0), out.stride(1), do.stride(0), do.stride(1),
           total, HEAD_DIM=dim, BLOCK_M=block_m)
    common = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
              do.stride(0), do.stride(1))
    mask_ptr, mask_stride, bits = _mask_args(mask, dropout, cu_seqlens)
    scalars = (heads, total, triton.cdiv(max_seqlen, KEYS_PER_CALL), mask_stride, sm_scale * LOG2E, sm_scale,
               dropout_threshold(dropout_p), 1.0 / (1.0 - applied_dropout(dropout_p)))
    meta = dict(HEAD_DIM=dim, BLOCK_M=block_m, BLOCK_N=block_n, DROPOUT=dropout, MASK_BITS=bits,
                num_warps=warps, num_stages=stages)
    launch(_bwd_dkdv_kernel, (triton.cdiv(max_seqlen, block_n), batch, heads),
           q, k, v, do, dk, dv, lse, delta, cu_seqlens, seed_arg, mask_ptr, *common,
           dk.stride(0), dk.stride(1), *scalars, **meta)
    launch(_bwd_dq_kernel, (triton.cdiv(max_seqlen, block_m), batch, heads),
           q, k, v, do, dq, lse, delta, cu_seqlens, seed_arg, mask_ptr, *common,
           dq.stride(0), dq.stride(1), *scalars, **meta)
    return dq, dk, dv


def kernel_stats() -> list[dict]:
    """Every attention kernel Triton has compiled in this process, from its JIT caches: name,
    the block sizes and flags it was specialised to, warps, stages, shared memory, and the
    registers per thread and spilled registers the driver reported when it loaded the
    binary (``n_regs`` / ``n_spills``; None until a kernel has been loaded). Empty in the
    interpreter, which compiles nothing."""
    rows = []
    for fn in KERNELS if AVAILABLE else ():
        for device, caches in sorted(getattr(fn, "device_caches", {}).items(), key=lambda kv: str(kv[0])):
            for kernel in caches[0].values():
                kernel = kernel.result() if hasattr(kernel, "result") else kernel
                meta = kernel.metadata
                consts = {}
                for key, val in (getattr(kernel.src, "constants", None) or {}).items():
                    idx = key[0] if isinstance(key, tuple) else key
                    name = fn.arg_names[idx] if isinstance(idx, int) and idx < len(fn.arg_names) else str(idx)
                    if name.isupper():  # the constexprs (HEAD_DIM, BLOCK_M, ...), not pointer hints
                        consts[name] = val
                rows.append({"kernel": fn.__name__, "device": str(device), **consts,
                             "num_warps": getattr(meta, "num_warps", None), "num_stages": getattr(meta, "num_stages", None),
                             "shared_bytes": getattr(meta, "shared", None),
                             "n_regs": getattr(kernel, "n_regs", None), "n_spills": getattr(kernel, "n_spills", None)})
    return rows


# ---------------------------------------------------------------- torch ops


@torch.library.custom_op("bert::triton_varlen_fwd", mutates_args=())
def _varlen_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                max_seqlen: int, dropout_p: float,
                seed: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return forward(q, k, v, cu_seqlens, max_seqlen, dropout_p, seed)


@_varlen_fwd.register_fake
def _(q, k, v, cu_seqlens, max_seqlen, dropout_p, seed):
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            q.new_empty((q.size(1), q.size(0)), dtype=torch.float32))


@torch.library.custom_op("bert::triton_varlen_bwd", mutates_args=())
def _varlen_bwd(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                out: torch.Tensor, lse: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                dropout_p: float, seed: Optional[torch.Tensor]
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return backward(grad_out, q, k, v, out, lse, cu_seqlens, max_seqlen, dropout_p, seed)


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


# The same attention with the speed levers of model.triton_fwd_tile and model.triton_dropout_mask:
# ops of their own, so that with both off a model runs the ops above unchanged. The third
# output is the stored mask (``mask_buffer``'s; an empty tensor when none is stored).


def _no_mask(q: torch.Tensor) -> torch.Tensor:
    return q.new_empty((0,), dtype=torch.uint8)


@torch.library.custom_op("bert::triton_varlen_fwd_tuned", mutates_args=())
def _varlen_fwd_tuned(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                      max_seqlen: int, dropout_p: float, seed: Optional[torch.Tensor], fwd_tile: str,
                      mask_bits: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    mask = (mask_buffer(cu_seqlens.numel() - 1, q.size(1), max_seqlen, q.device) if mask_bits and dropout_p > 0.0
            else _no_mask(q))
    out, lse = forward(q, k, v, cu_seqlens, max_seqlen, dropout_p, seed, FWD_TILES[fwd_tile],
                       mask=mask if mask.numel() else None)
    return out, lse, mask


@_varlen_fwd_tuned.register_fake
def _(q, k, v, cu_seqlens, max_seqlen, dropout_p, seed, fwd_tile, mask_bits):
    mask = (q.new_empty((cu_seqlens.size(0) - 1, q.size(1), max_seqlen, (max_seqlen + KEYS_PER_CALL - 1) // KEYS_PER_CALL),
                        dtype=torch.uint8) if mask_bits and dropout_p > 0.0 else _no_mask(q))
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            q.new_empty((q.size(1), q.size(0)), dtype=torch.float32), mask)


@torch.library.custom_op("bert::triton_varlen_bwd_tuned", mutates_args=())
def _varlen_bwd_tuned(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      out: torch.Tensor, lse: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                      dropout_p: float, seed: Optional[torch.Tensor], mask: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return backward(grad_out, q, k, v, out, lse, cu_seqlens, max_seqlen, dropout_p, seed,
                    mask=mask if mask.numel() else None)


@_varlen_bwd_tuned.register_fake
def _(grad_out, q, k, v, out, lse, cu_seqlens, max_seqlen, dropout_p, seed, mask):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


def _setup_context_tuned(ctx, inputs, output):
    q, k, v, cu_seqlens, max_seqlen, dropout_p, seed, _tile, _bits = inputs
    out, lse, mask = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens, seed, mask)
    ctx.max_seqlen, ctx.dropout_p = max_seqlen, dropout_p


def _autograd_backward_tuned(ctx, grad_out, grad_lse, grad_mask):
    q, k, v, out, lse, cu_seqlens, seed, mask = ctx.saved_tensors
    dq, dk, dv = _varlen_bwd_tuned(grad_out, q, k, v, out, lse, cu_seqlens, ctx.max_seqlen, ctx.dropout_p, seed, mask)
    return dq, dk, dv, None, None, None, None, None, None


_varlen_fwd_tuned.register_autograd(_autograd_backward_tuned, setup_context=_setup_context_tuned)


def draw_seed(device: torch.device) -> torch.Tensor:
    """A fresh Philox seed as a one-element int64 tensor on ``device``, drawn from torch's
    generator (graph-safe: under CUDA graph capture each replay draws anew)."""
    return torch.randint(0, 2**62, (1,), device=device, dtype=torch.int64)


def varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
           max_seqlen: int, dropout_p: float = 0.0, seed: Optional[torch.Tensor] = None, *,
           fwd_tile: Optional[str] = None, mask_bits: bool = False) -> torch.Tensor:
    """Variable-length attention with dropout (see the module docstring); differentiable.

    ``seed`` (int64 ``[1]`` on q's device) fixes the dropout mask, for tests; by default one
    is drawn per call when ``dropout_p > 0``. ``fwd_tile`` (a ``FWD_TILES`` name) and
    ``mask_bits`` (the mask stored by the forward, read by the backward) are the speed levers
    of ``model.triton_fwd_tile`` / ``model.triton_dropout_mask``: the same numbers, other
    kernels; with neither, the plain ops run.
    """
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if fwd_tile is not None and fwd_tile not in FWD_TILES:
        raise ValueError(f"fwd_tile {fwd_tile!r} is not one of {sorted(FWD_TILES)}")
    if dropout_p > 0.0 and seed is None:
        seed = draw_seed(q.device)
    seed = seed if dropout_p > 0.0 else None
    if fwd_tile is None and not mask_bits:
        return _varlen_fwd(q, k, v, cu_seqlens, max_seqlen, float(dropout_p), seed)[0]
    return _varlen_fwd_tuned(q, k, v, cu_seqlens, max_seqlen, float(dropout_p), seed,
                             fwd_tile or DEFAULT_FWD_TILE, bool(mask_bits))[0]


def dropout_mask(seed: torch.Tensor, batch: int, heads: int, max_seqlen: int,
                 dropout_p: float, launch=_launch) -> torch.Tensor:
    """The keep mask bool ``[batch, heads, max_seqlen, max_seqlen]`` that ``varlen`` applies
    with this seed: [b, h, i, j] for query i and key j of sequence b (same ``_keep`` call
    and counters as the kernels; the rate is ``applied_dropout(dropout_p)``)."""
    if not AVAILABLE:
        raise RuntimeError("bert.triton_attention needs the triton package")
    out = torch.empty((batch, heads, max_seqlen, max_seqlen), dtype=torch.int8, device=seed.device)
    block = 32
    launch(_mask_kernel, (triton.cdiv(max_seqlen, block), batch, heads),
           out, seed, heads, max_seqlen, triton.cdiv(max_seqlen, KEYS_PER_CALL), dropout_threshold(dropout_p),
           BLOCK=block)
    return out.bool()
