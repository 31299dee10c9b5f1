"""Scaled dot-product attention backends, chosen once at build time.

Every backend offers the same two entry points:

- ``padded(q, k, v, key_mask, dropout_p)``: q, k, v ``[B, H, S, D]``, ``key_mask`` bool
  ``[B, S]`` (True = real token) -> ``[B, H, S, D]``. Padded query rows get finite values
  that callers ignore.
- ``varlen(q, k, v, cu_seqlens, max_seqlen, dropout_p)``: q, k, v ``[T, H, D]`` holding the
  real tokens of B sequences back to back, ``cu_seqlens`` int32 ``[B + 1]`` their offsets,
  ``max_seqlen`` (a Python int, so no device sync) at least the longest length ->
  ``[T, H, D]``. Every sequence must have at least one token.

``dropout_p`` is the attention-probability dropout to apply *now*: the caller passes 0.0
outside training, so backends never look at a training flag.

``varlen`` may get more rows than ``cu_seqlens[-1]`` (a static token budget, bert/budget.py,
pads the token count): rows past it are padding; their output is exactly 0 and no real row
attends to them (so their gradients are 0 too). No backend reads ``cu_seqlens[-1]`` on the
host to find them on CUDA (that would be a sync point).

The portable ``varlen`` pads into ``[B, max_seqlen]``, runs ``padded`` and gathers back
(attention then costs B * max_seqlen^2 instead of sum L^2). Overrides:

- ``flash``: flash-attn's ``flash_attn_varlen_func`` (fp16/bf16 inputs, i.e. under
  autocast; attention dropout supported). Only when ``flash_attn`` imports.
- on CPU, ``sdpa``'s ``varlen`` runs one SDPA call per sequence (``SdpaPerSequence``):
  attention follows real tokens there too.
- ``torch_varlen``: ``torch.nn.attention.varlen.varlen_attn`` (torch's own flash kernel).
  It has no dropout argument, so ``auto`` picks it only when ``attention_dropout`` is 0,
  and it raises if asked for dropout.
- ``triton``: our own Triton kernel (bert/triton_attention.py): varlen flash attention
  *with* dropout (Philox mask from a seed drawn on the device per call, so CUDA-graph
  safe), rows past ``cu_seqlens[-1]`` exactly 0. Only when ``triton`` imports; a
  torch.library custom op, so torch.compile keeps it whole. ``padded`` stays SDPA's.
- ``nested``: SDPA on nested jagged tensors (torch's flash kernel on CUDA, with dropout;
  math per sequence on the CPU).

``auto`` on CUDA: flash > torch_varlen (attention dropout 0 only) > sdpa (with BERT's 0.1
attention dropout and no flash-attn: the memory-efficient kernel on the padded grid); on
CPU ``sdpa``. ``triton`` and ``nested`` are chosen by name only until a GPU run has checked
them against ``math`` in bf16 and timed them (bench/gpu_bert_large.py): an untested kernel
must not become a GPU user's default silently. ``build_attention`` refuses ``triton`` on a
CPU (there it would run only in Triton's interpreter, which is for tests:
tests/{unit,integration}/test_triton_attention.py builds ``TritonVarlenAttention`` directly).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

BACKENDS = ("auto", "sdpa", "math", "flash", "torch_varlen", "triton", "nested")


def flash_varlen_func():
    """flash-attn's varlen kernel, or None when the package is missing (import-guarded)."""
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


def torch_varlen_func():
    """torch's own varlen attention, or None in a torch without it."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def triton_varlen_func():
    """bert.triton_attention's varlen kernel, or None without the triton package.

    Imported here, on first ask, so that importing this module never imports triton.
    """
    from bert import triton_attention  # lazy: importing it imports triton (seconds; a GPU-only dependency)

    return triton_attention.varlen if triton_attention.AVAILABLE else None


class AttentionBackend:
    """Base: ``padded`` is the kernel; ``varlen`` defaults to pad -> padded -> gather."""

    name = "base"

    def padded(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               key_mask: torch.Tensor, dropout_p: float = 0.0) -> torch.Tensor:
        raise NotImplementedError

    def varlen(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               cu_seqlens: torch.Tensor, max_seqlen: int, dropout_p: float = 0.0) -> torch.Tensor:
        return varlen_via_padded(self.padded, q, k, v, cu_seqlens, max_seqlen, dropout_p)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class SdpaAttention(AttentionBackend):
    """torch's fused ``scaled_dot_product_attention``; it picks its own kernel per device.

    A boolean mask rules out the flash kernel (it takes no mask); on GPU torch then uses
    the memory-efficient kernel, on CPU its fused CPU kernel.
    """

    name = "sdpa"

    def padded(self, q, k, v, key_mask, dropout_p=0.0):
        # [B, 1, 1, S] broadcasts over heads and query rows; no [B, H, S, S] mask is built.
        mask = key_mask[:, None, None, :]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)


class SdpaPerSequence(SdpaAttention):
    """CPU: ``varlen`` as one unmasked SDPA call per sequence, so attention costs sum L^2
    (not B * max_seqlen^2) and no padded grid is built. Reads ``cu_seqlens`` on the host:
    free on CPU, a device sync on GPU -- hence chosen for CPU only. Costs a Python loop over
    the batch's sequences per layer (microseconds each against milliseconds of kernels).
    """

    def varlen(self, q, k, v, cu_seqlens, max_seqlen, dropout_p=0.0):
        bounds = cu_seqlens.tolist()
        outs = []
        for a, b in zip(bounds[:-1], bounds[1:]):
            # [L, H, D] -> [1, H, L, D]: views; SDPA returns a fresh [1, H, L, D].
            qs, ks, vs = (t[a:b].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
            outs.append(F.scaled_dot_product_attention(qs, ks, vs, dropout_p=dropout_p)[0].transpose(0, 1))
        # A token budget's pad rows (none without a budget): output 0, never attended. Always
        # appended, even empty: a branch on their count would make torch.compile guard on it
        # and recompile when a batch fills its rung exactly.
        outs.append(q.new_zeros(q.size(0) - bounds[-1], *q.shape[1:]))
        return torch.cat(outs)


class MathAttention(AttentionBackend):
    """softmax(Q K^T / sqrt(d) + mask) V written out; the reference the others answer to.

    Materialises the [B, H, S, S] scores and takes the softmax in float32 (allocates a
    float32 copy under reduced precision): slow, but nothing is hidden in a kernel.
    """

    name = "math"

    def padded(self, q, k, v, key_mask, dropout_p=0.0):
        scores = torch.matmul(q, k.transpose(-1, -2)).float() * (1.0 / math.sqrt(q.size(-1)))
        # Additive mask, as in the original BERT: the most negative float, not -inf, so a
        # row is never all -inf (that would give NaN).
        neg = torch.finfo(scores.dtype).min
        bias = torch.zeros(key_mask.shape, dtype=scores.dtype, device=scores.device)
        bias = bias.masked_fill(~key_mask, neg)[:, None, None, :]
        probs = torch.softmax(scores + bias, dim=-1).to(v.dtype)
        if dropout_p > 0.0:
            probs = F.dropout(probs, p=dropout_p, training=True)
        return torch.matmul(probs, v)


class FlashVarlenAttention(SdpaAttention):
    """flash-attn's variable-length kernel: cost sum L^2, no padded grid, no mask."""

    name = "flash"

    def __init__(self, fn):
        self.fn = fn

    def varlen(self, q, k, v, cu_seqlens, max_seqlen, dropout_p=0.0):
        out = self.fn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p=dropout_p)
        return zero_past_end(out, cu_seqlens)


class TorchVarlenAttention(SdpaAttention):
    """``torch.nn.attention.varlen.varlen_attn``: flash-style varlen kernel without dropout."""

    name = "torch_varlen"

    def __init__(self, fn):
        self.fn = fn

    def varlen(self, q, k, v, cu_seqlens, max_seqlen, dropout_p=0.0):
        if dropout_p > 0.0:  # a Python float: no device sync
            raise RuntimeError("torch_varlen attention has no dropout; set model.attention_dropout=0 "
                               "or use the flash / sdpa backend")
        return zero_past_end(self.fn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen), cu_seqlens)


def zero_past_end(out: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """``out`` with the rows past ``cu_seqlens[-1]`` set to exactly 0, for kernels that leave
    them unwritten (flash-style varlen kernels allocate with ``empty_like``: garbage, maybe
    NaN, which would reach the weight gradients as 0 * NaN). ``where``, not a multiply, for
    that reason; one elementwise pass over [T, H, D], no host sync."""
    keep = torch.arange(out.size(0), device=out.device) < cu_seqlens[-1]
    return torch.where(keep[:, None, None], out, out.new_zeros(()))


class TritonVarlenAttention(SdpaAttention):
    """Our Triton varlen kernel with dropout (bert/triton_attention.py); ``padded`` is SDPA's.
    ``levers``: the kernel's speed levers (``fwd_tile``, ``mask_bits``: model.triton_fwd_tile,
    model.triton_dropout_mask) when any is on; empty, the kernel's plain ops run."""

    name = "triton"

    def __init__(self, fn, levers: dict | None = None):
        self.fn = fn
        self.levers = dict(levers or {})

    def varlen(self, q, k, v, cu_seqlens, max_seqlen, dropout_p=0.0):
        if self.levers:
            return self.fn(q, k, v, cu_seqlens, max_seqlen, dropout_p, **self.levers)
        return self.fn(q, k, v, cu_seqlens, max_seqlen, dropout_p)


class NestedAttention(SdpaAttention):
    """SDPA on nested jagged tensors (``torch.nested``, ``layout=torch.jagged``): torch's own
    fused kernels over the real tokens, attention cost sum L^2, dropout included (on CUDA
    the flash kernel takes bf16/fp16 NJT inputs with dropout; on the CPU it is the math
    kernel per sequence). No package beyond torch.

    Rows past ``cu_seqlens[-1]`` (a static token budget's padding) become extra segments
    of 1 to ``max_seqlen`` rows (``pad_segments``), so the kernel's grid stays (max_seqlen
    blocks) x (B + that many) x heads, no host sync is needed to find where the padding
    starts, and their output is set to exactly 0. No segment is ever empty, so the
    ``min_seqlen=1`` the kernel is told is true (SDPA's fused NJT kernels refuse a
    min_seqlen of 0 and would fall back to the math path; an empty segment under a claimed
    1 would break their stated precondition). To guarantee that, ``pad_segments`` appends
    as many zero rows as there are pad segments: a copy of q, k and v ([T + n, H, D]) per
    call, the price of the true hint. Plus one [T, H, D] select for the zeroing, and the
    NJT wrapping (metadata only, no copy).
    """

    name = "nested"

    def varlen(self, q, k, v, cu_seqlens, max_seqlen, dropout_p=0.0):
        total = q.shape[0]
        offsets, extra = pad_segments(cu_seqlens, total, max_seqlen)
        grown = [torch.cat([t, t.new_zeros(extra, *t.shape[1:])]) for t in (q, k, v)]
        nested = [torch.nested.nested_tensor_from_jagged(t, offsets, min_seqlen=1, max_seqlen=max(max_seqlen, 2))
                  .transpose(1, 2) for t in grown]
        out = F.scaled_dot_product_attention(*nested, dropout_p=dropout_p).transpose(1, 2).values()[:total]
        real = torch.arange(total, device=q.device) < cu_seqlens[-1]
        return torch.where(real[:, None, None], out, 0.0)


def pad_segments(cu_seqlens: torch.Tensor, total: int, max_seqlen: int) -> tuple[torch.Tensor, int]:
    """Offsets (int64, on the device) of the B real sequences followed by ``n`` pad segments
    that cover rows ``cu_seqlens[-1]`` .. ``total + n`` (the T - cu_seqlens[-1] pad rows plus
    ``n`` appended ones), each of 1 to max(max_seqlen, 2) rows, and ``n``. ``n`` depends
    only on ``total`` and ``max_seqlen`` (static shapes, no host read of cu_seqlens): it is
    the least count with n * (S - 1) >= total, so the pad rows (at most T) fit n segments
    of at most S rows even after one row of each is set aside to keep it non-empty.
    Segment i ends at end + min(i * S, P - n + i), P the rows to cover, end the last real
    offset: steps of S while there are rows to spare, then steps of 1."""
    s = max(max_seqlen, 2)
    n = max(1, -(-total // (s - 1)))
    end = cu_seqlens[-1].long()
    rows = total + n - end  # P: pad rows plus the n appended
    i = torch.arange(1, n + 1, device=cu_seqlens.device)
    ends = end + torch.minimum(i * s, rows - n + i)
    return torch.cat([cu_seqlens.long(), ends]), n


def varlen_via_padded(padded, q, k, v, cu_seqlens, max_seqlen, dropout_p=0.0):
    """Variable-length attention through a padded kernel: scatter, attend, gather.

    Costs a zero-filled ``[B * max_seqlen + 1, 3, H, D]`` buffer and attention over the
    padding of each sequence up to ``max_seqlen`` (not up to the model's maximum length).
    Rows past ``cu_seqlens[-1]`` (a token budget's padding) go to the one extra "trash" row
    of the buffer, which no sequence attends to, and are set to 0 on the way back (one
    ``where`` over [T, H, D]): output 0, gradient 0. Runs no host sync: ``max_seqlen`` is a
    Python int and each row finds its sequence by ``bucketize`` against ``cu_seqlens`` on
    the device (O(T log B)).
    """
    total, heads, dim = q.shape
    batch = cu_seqlens.numel() - 1
    cu = cu_seqlens.long()
    rows = torch.arange(total, device=q.device)
    # Sequence of each row: how many sequence ends lie at or before it; B for pad rows.
    batch_id = torch.bucketize(rows, cu[1:], right=True)
    position = rows - cu[batch_id]  # cu[B] = cu_seqlens[-1] for pad rows; overwritten below
    real = batch_id < batch
    trash = batch * max_seqlen
    slot = torch.where(real, batch_id * max_seqlen + position, trash)

    # One scatter for q, k and v together (the stack allocates [T, 3, H, D]); every pad row
    # lands on the trash row (duplicates: whichever wins is never read).
    qkv = torch.stack((q, k, v), dim=1)
    grid = qkv.new_zeros(trash + 1, 3, heads, dim).index_copy(0, slot, qkv)
    grid = grid[:trash].view(batch, max_seqlen, 3, heads, dim).permute(2, 0, 3, 1, 4)  # [3,B,H,S,D]
    lengths = cu[1:] - cu[:-1]
    key_mask = torch.arange(max_seqlen, device=q.device)[None, :] < lengths[:, None]

    out = padded(grid[0], grid[1], grid[2], key_mask, dropout_p)  # [B, H, S, D]
    out = out.transpose(1, 2).reshape(trash, heads, dim)
    # Pad rows read row 0 and are zeroed: cheaper than appending a zero row to the
    # [B * max_seqlen] output (a copy of all of it).
    out = out.index_select(0, torch.where(real, slot, 0))
    return torch.where(real[:, None, None], out, out.new_zeros(()))


def triton_levers(fwd_tile: str, dropout_mask: str) -> dict:
    """The Triton kernel's keyword arguments for model.triton_fwd_tile and
    model.triton_dropout_mask: only the levers that are on (none: the plain ops run)."""
    from bert import triton_attention  # lazy, as in triton_varlen_func

    levers: dict = {}
    if fwd_tile != triton_attention.DEFAULT_FWD_TILE:
        levers["fwd_tile"] = fwd_tile
    if dropout_mask == "bits":
        levers["mask_bits"] = True
    return levers


def build_attention(backend: str, device_type: str, attention_dropout: float = 0.0, *,
                    flash=flash_varlen_func, torch_varlen=torch_varlen_func,
                    triton=triton_varlen_func, triton_options: dict | None = None) -> AttentionBackend:
    """Resolve a backend name for a device type ("cpu", "cuda", ...) once, at build time.

    ``flash`` / ``torch_varlen`` / ``triton`` return the kernels or None (parameters so
    tests can stand in for a GPU machine). Asking by name for a kernel that is missing, or
    that cannot run on the device, raises; ``auto`` takes the best that works.
    ``triton_options``: the Triton kernel's levers (``triton_levers``), for that backend only.
    """
    if backend not in BACKENDS:
        raise ValueError(f"attention backend {backend!r} is not one of {list(BACKENDS)}")
    gpu = device_type == "cuda"
    if backend == "auto":
        # Not triton or nested: by name only until a GPU run has checked them (docstring).
        if gpu and flash() is not None:
            backend = "flash"
        elif gpu and attention_dropout == 0.0 and torch_varlen() is not None:
            backend = "torch_varlen"
        else:
            backend = "sdpa"
    if backend in ("flash", "torch_varlen", "triton"):
        fn = {"flash": flash, "torch_varlen": torch_varlen, "triton": triton}[backend]()
        needs = {"flash": "the flash_attn package", "torch_varlen": "torch.nn.attention.varlen",
                 "triton": "the triton package"}[backend]
        if not gpu or fn is None:
            raise ValueError(f"attention backend {backend!r} needs a CUDA device and {needs}"
                             f" (device {device_type!r}, kernel {'found' if fn else 'missing'})")
        if backend == "torch_varlen" and attention_dropout > 0.0:
            raise ValueError("attention backend 'torch_varlen' has no dropout; "
                             f"model.attention_dropout is {attention_dropout}")
        if backend == "triton":
            return TritonVarlenAttention(fn, triton_options)
        return {"flash": FlashVarlenAttention, "torch_varlen": TorchVarlenAttention}[backend](fn)
    if backend == "sdpa":
        return SdpaAttention() if gpu else SdpaPerSequence()
    if backend == "nested":
        return NestedAttention()
    return MathAttention()
