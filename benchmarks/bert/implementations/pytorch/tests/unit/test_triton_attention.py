"""bert/triton_attention.py (the "triton" attention backend) against ``MathAttention``.

The kernels run in Triton's CPU interpreter (set up by conftest.py through
tests/support/triton_interpret.py, before anything imports triton). The interpreter executes each
program of the grid in Python, so the shapes here are small; the block sizes are shrunk to
16 where a test needs several blocks per sequence. The backend is built directly
(``TritonVarlenAttention``): ``build_attention`` refuses it on a CPU.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

import triton_interpret
from bert import triton_attention as ta
from bert.attention import MathAttention, TritonVarlenAttention, build_attention
from bert.config import ModelConfig
from bert.model import BertForPreTraining, pretraining_loss


_WHY = triton_interpret.why_not_interpreted()  # the skip reason of the interpreter's tests


needs_interpreter = pytest.mark.skipif(not triton_interpret.is_interpreted(), reason=_WHY)


SMALL_BLOCKS = (16, 16, 4, 2)  # several blocks per sequence in the interpreter, cheaply


TOL = dict(rtol=1e-5, atol=2e-6)


def _cu(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)


def _qkv(total, heads, dim, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(total, heads, dim, generator=g).requires_grad_() for _ in range(3)]


def _math_per_sequence(q, k, v, cu, keep=None, p=0.0):
    """MathAttention on each sequence alone; ``keep`` [B, H, S, S] applies that exact
    dropout mask (kept probabilities scaled by 1/(1-p)) instead of a random one."""
    math_attn = MathAttention()
    outs = []
    for b, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        qs, ks, vs = (t[s:e].transpose(0, 1)[None] for t in (q, k, v))  # [1, H, L, D]
        if keep is None:
            out = math_attn.padded(qs, ks, vs, torch.ones(1, e - s, dtype=torch.bool))
        else:  # MathAttention's arithmetic with the kernel's mask in place of F.dropout
            scores = qs @ ks.transpose(-1, -2) / math.sqrt(qs.size(-1))
            probs = torch.softmax(scores, dim=-1) * keep[b, :, : e - s, : e - s] / (1.0 - ta.applied_dropout(p))
            out = probs @ vs
        outs.append(out[0].transpose(0, 1))
    return torch.cat(outs)


def _grads(out, rows, q, k, v, upstream):
    for t in (q, k, v):
        t.grad = None
    (out[:rows] * upstream[:rows]).sum().backward()
    return [t.grad.clone() for t in (q, k, v)]


@needs_interpreter
@pytest.mark.parametrize("dim, lengths, blocks", [
    (16, [1, 17, 5, 33], SMALL_BLOCKS),   # length 1; 17, 33: one row past a block
    (64, [70, 3], ta.FWD_BLOCKS),         # BERT-Large's head dim, the default blocks
])
def test_matches_math_without_dropout_with_pad_rows(monkeypatch, dim, lengths, blocks):
    """Forward and q/k/v gradients equal the math backend per sequence; 4 pad rows past
    cu_seqlens[-1] (nonzero inputs, nonzero upstream gradient) get output 0 and grads 0."""
    monkeypatch.setattr(ta, "FWD_BLOCKS", blocks)
    monkeypatch.setattr(ta, "BWD_BLOCKS", blocks)
    real, pad, heads = sum(lengths), 4, 2
    cu = _cu(lengths)
    q, k, v = _qkv(real + pad, heads, dim)
    upstream = torch.randn(real + pad, heads, dim, generator=torch.Generator().manual_seed(1))
    backend = TritonVarlenAttention(ta.varlen)
    out = backend.varlen(q, k, v, cu, max(lengths) + 3, 0.0)  # max_seqlen may exceed the longest
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.equal(out[real:], torch.zeros_like(out[real:]))
    got = _grads(out, real + pad, q, k, v, upstream)  # pad rows' upstream grads included
    ref = _math_per_sequence(q, k, v, cu)
    torch.testing.assert_close(out[:real], ref, **TOL)
    want = _grads(ref, real, q, k, v, upstream)
    for g, w in zip(got, want):
        assert torch.equal(g[real:], torch.zeros_like(g[real:]))
        torch.testing.assert_close(g[:real], w[:real], **TOL)


@needs_interpreter
def test_dropout_keep_rate_and_fresh_masks():
    """The keep rate over 2 * 2 * 96^2 = 36,864 draws is 1 - p within 5 binomial sigmas (the
    applied rate is p to 1/65536);
    another seed gives another mask; a seed drawn per call comes from torch's generator
    (same torch seed, same mask; next call, new mask)."""
    p, batch, heads, s = 0.1, 2, 2, 96
    keep = ta.dropout_mask(torch.tensor([1234]), batch, heads, s, p)
    n = keep.numel()
    sigma = math.sqrt(n * p * (1 - p))
    assert abs(keep.sum().item() - n * (1 - p)) < 5 * sigma
    other = ta.dropout_mask(torch.tensor([1235]), batch, heads, s, p)
    assert (keep != other).float().mean() > 0.1  # about 2p(1-p) = 0.18 of elements differ
    # Heads and sequences draw different masks (distinct Philox counters).
    assert not torch.equal(keep[0, 0], keep[0, 1]) and not torch.equal(keep[0, 0], keep[1, 0])

    torch.manual_seed(7)
    first = ta.draw_seed(torch.device("cpu"))
    second = ta.draw_seed(torch.device("cpu"))
    torch.manual_seed(7)
    assert torch.equal(ta.draw_seed(torch.device("cpu")), first)
    assert not torch.equal(first, second)

    cu = _cu([20, 9])
    q, k, v = (t.detach() for t in _qkv(29, 2, 16))
    torch.manual_seed(3)
    a = ta.varlen(q, k, v, cu, 20, 0.3)
    b = ta.varlen(q, k, v, cu, 20, 0.3)
    torch.manual_seed(3)
    assert torch.equal(ta.varlen(q, k, v, cu, 20, 0.3), a)
    assert not torch.equal(a, b)


def _philox4x32(c0, c1, c2, c3, k0, k1, rounds=10):
    """Philox-4x32 (Salmon et al., SC'11) in numpy uint32 arithmetic: the reference for the
    kernels' dropout draws."""
    m0, m1, w0, w1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57), np.uint32(0x9E3779B9), np.uint32(0xBB67AE85)
    c0, c1, c2, c3 = (np.asarray(c, dtype=np.uint32) for c in (c0, c1, c2, c3))
    k0, k1 = np.uint32(k0), np.uint32(k1)
    with np.errstate(over="ignore"):
        for _ in range(rounds):
            p0, p1 = m0 * c0.astype(np.uint64), m1 * c2.astype(np.uint64)
            c0, c1, c2, c3 = ((p1 >> np.uint64(32)).astype(np.uint32) ^ c1 ^ k0, p1.astype(np.uint32),
                              (p0 >> np.uint64(32)).astype(np.uint32) ^ c3 ^ k1, p0.astype(np.uint32))
            k0, k1 = k0 + w0, k1 + w1
    return c0, c1, c2, c3


def test_philox_reference_matches_the_published_answers():
    """The numpy Philox-4x32-10 against Random123's known-answer vectors (kat_vectors)."""
    got = _philox4x32(0, 0, 0, 0, 0, 0)
    assert [int(w) for w in got] == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    got = _philox4x32(0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344, 0xA4093822, 0x299F31D0)
    assert [int(w) for w in got] == [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]


@needs_interpreter
def test_dropout_mask_is_8_keys_per_philox_call_from_32_bit_counters():
    """The mask, key by key, from the numpy Philox: query i, key j of (b, h) is the 16-bit
    half j % 2 of word (j % 8) // 2 of the call with counter (i * ceil(S / 8) + j // 8,
    b * H + h, 0, 0) under the seed's two 32-bit halves, kept when >= round(p * 65536).
    So all four words are used, 8 decisions per call, and the rate is p to 1/65536."""
    p, batch, heads, s = 0.3, 2, 3, 40  # 40: a partial group of 8 past 32 keys, a partial block
    seed = (0x1234_5678 << 32) | 0x9ABC_DEF0
    keep = ta.dropout_mask(torch.tensor([seed], dtype=torch.int64), batch, heads, s, p).numpy()
    groups = -(-s // 8)
    i, j = np.meshgrid(np.arange(s), np.arange(s), indexing="ij")
    thr = ta.dropout_threshold(p)
    assert thr == round(0.3 * 65536) and ta.applied_dropout(p) == thr / 65536
    for b in range(batch):
        for h in range(heads):
            words = _philox4x32(i * groups + j // 8, np.full_like(i, b * heads + h), 0, 0,
                                seed & 0xFFFFFFFF, seed >> 32)
            word = np.choose((j % 8) // 2, words)
            draw = np.where(j % 2 == 0, word & 0xFFFF, word >> 16)
            np.testing.assert_array_equal(keep[b, h], draw >= thr, err_msg=f"b={b} h={h}")


@needs_interpreter
def test_dropout_forward_and_backward_use_the_same_mask(monkeypatch):
    """With a fixed seed, output and q/k/v gradients equal the math reference that applies
    ``dropout_mask``'s mask: so forward and backward regenerate the one mask, whatever the
    block sizes (the kernels use 16 x 16 tiles here, the mask kernel 32 x 32). A pad row
    past cu_seqlens[-1] stays 0."""
    monkeypatch.setattr(ta, "FWD_BLOCKS", SMALL_BLOCKS)
    monkeypatch.setattr(ta, "BWD_BLOCKS", SMALL_BLOCKS)
    p, lengths, heads, dim, max_seqlen = 0.25, [19, 1, 12], 2, 16, 24
    real, cu = sum(lengths), _cu(lengths)
    q, k, v = _qkv(real + 1, heads, dim, seed=2)
    upstream = torch.randn(real + 1, heads, dim, generator=torch.Generator().manual_seed(3))
    seed = torch.tensor([987654321], dtype=torch.int64)
    out = ta.varlen(q, k, v, cu, max_seqlen, p, seed=seed)
    got = _grads(out, real + 1, q, k, v, upstream)
    keep = ta.dropout_mask(seed, len(lengths), heads, max_seqlen, p)
    assert 0 < keep.float().mean() < 1
    ref = _math_per_sequence(q, k, v, cu, keep=keep, p=p)
    torch.testing.assert_close(out[:real], ref, **TOL)
    assert torch.equal(out[real:], torch.zeros_like(out[real:]))
    want = _grads(ref, real, q, k, v, upstream)
    for g, w in zip(got, want):
        torch.testing.assert_close(g[:real], w[:real], **TOL)
        assert torch.equal(g[real:], torch.zeros_like(g[real:]))
    # Without the mask (plain softmax) the output would differ: the mask did something.
    assert not torch.allclose(out[:real], _math_per_sequence(q, k, v, cu), atol=1e-3)


def _unpack_bits(mask: torch.Tensor, max_seqlen: int) -> torch.Tensor:
    """The stored uint8 [B, H, S, ceil(S / 8)] mask as bool [B, H, S, S] (bit d = key 8g + d)."""
    return ((mask[..., None].int() >> torch.arange(8)) & 1).flatten(-2)[..., :max_seqlen].bool()


@needs_interpreter
@pytest.mark.parametrize("fwd", [SMALL_BLOCKS, ta.FWD_TILES["128x64"]])
def test_stored_mask_is_the_drawn_mask_and_the_backward_reads_it(monkeypatch, fwd):
    """model.triton_dropout_mask=bits: the bytes the forward stores are, bit for bit, the
    Philox mask ``dropout_mask`` draws (every real query and key; 44 keys: a partial group of
    8); the backward, which reads them and draws nothing, gives the drawn path's output and
    q/k/v gradients exactly and the math reference's that applies the mask; with the backward
    told a mask with every bit cleared, its gradients change (it reads the bytes)."""
    monkeypatch.setattr(ta, "BWD_BLOCKS", SMALL_BLOCKS)
    p, lengths, heads, dim, max_seqlen = 0.25, [19, 1, 12, 40], 2, 16, 44
    real, cu = sum(lengths), _cu(lengths)
    q, k, v = _qkv(real + 2, heads, dim, seed=5)
    upstream = torch.randn(real + 2, heads, dim, generator=torch.Generator().manual_seed(6))
    seed = torch.tensor([2468], dtype=torch.int64)
    mask = ta.mask_buffer(len(lengths), heads, max_seqlen, q.device)
    assert mask.shape == (4, heads, max_seqlen, 6) and mask.dtype == torch.uint8
    out, lse = ta.forward(q.detach(), k.detach(), v.detach(), cu, max_seqlen, p, seed, fwd, mask=mask)
    keep = ta.dropout_mask(seed, len(lengths), heads, max_seqlen, p)
    stored = _unpack_bits(mask, max_seqlen)
    for b, n in enumerate(lengths):
        assert torch.equal(stored[b, :, :n, :n], keep[b, :, :n, :n]), b
    drawn_out, _ = ta.forward(q.detach(), k.detach(), v.detach(), cu, max_seqlen, p, seed, fwd)
    assert torch.equal(out, drawn_out)
    args = (upstream, q.detach(), k.detach(), v.detach(), out, lse, cu, max_seqlen, p)
    read = ta.backward(*args, None, mask=mask)  # no seed: nothing to draw from
    drawn = ta.backward(*args, seed)
    for a, w in zip(read, drawn):
        assert torch.equal(a, w)
    ref = _math_per_sequence(q, k, v, cu, keep=keep, p=p)
    torch.testing.assert_close(out[:real], ref, **TOL)
    want = _grads(ref, real, q, k, v, upstream)
    for g, w in zip(read, want):
        torch.testing.assert_close(g[:real], w[:real], **TOL)
        assert torch.equal(g[real:], torch.zeros_like(g[real:]))
    cleared = ta.backward(*args, None, mask=torch.zeros_like(mask))
    assert not torch.allclose(cleared[2], read[2])


@needs_interpreter
def test_levers_through_the_op_the_backend_and_compile(monkeypatch):
    """varlen's levers (fwd_tile="128x64", mask_bits): the tuned custom op passes opcheck
    (schema, fake, autograd registration), gives the plain op's output and gradients, and
    torch.compile(fullgraph=True) traces it whole; the backend passes the levers the model's
    config names (bert.attention.triton_levers), none by default."""
    monkeypatch.setattr(ta, "BWD_BLOCKS", SMALL_BLOCKS)
    cu = _cu([7, 3, 20])
    q, k, v = _qkv(32, 2, 16, seed=3)  # 2 pad rows
    seed = torch.tensor([11], dtype=torch.int64)
    for args in ((q, k, v, cu, 24, 0.2, seed, "128x64", True), (q, k, v, cu, 24, 0.0, None, "64x64", True)):
        torch.library.opcheck(ta._varlen_fwd_tuned, args,
                              test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    plain = ta.varlen(q, k, v, cu, 24, 0.2, seed=seed)
    plain_grads = torch.autograd.grad(plain.square().sum(), (q, k, v))

    def tuned(q, k, v, cu):
        return ta.varlen(q, k, v, cu, 24, 0.2, seed=seed, fwd_tile="128x64", mask_bits=True)

    for fn in (tuned, torch.compile(tuned, backend="aot_eager", fullgraph=True)):
        got = fn(q, k, v, cu)
        torch.testing.assert_close(got, plain, rtol=0, atol=0)
        for g, w in zip(torch.autograd.grad(got.square().sum(), (q, k, v)), plain_grads):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
    with pytest.raises(ValueError, match="fwd_tile"):
        ta.varlen(q, k, v, cu, 24, 0.2, fwd_tile="32x32")
    from bert.attention import triton_levers

    assert triton_levers("64x64", "philox") == {}
    assert triton_levers("128x64", "bits") == {"fwd_tile": "128x64", "mask_bits": True}
    calls = []
    backend = build_attention("triton", "cuda", 0.1, triton=lambda: lambda *a, **kw: calls.append(kw),
                              triton_options=triton_levers("64x64", "bits"))
    backend.varlen(q, k, v, cu, 24, 0.1)
    assert calls == [{"mask_bits": True}]
    model = BertForPreTraining(dataclasses.replace(_TINY, attention_backend="sdpa", triton_dropout_mask="bits"))
    assert model.attn_backend.name == "sdpa"  # the levers are the triton backend's only


@needs_interpreter
def test_custom_op_registrations_and_compile_without_graph_break():
    """torch.library.opcheck validates the schema, fake (meta) and autograd registrations;
    torch.compile(fullgraph=True) through AOT autograd traces forward and backward as one
    opaque op (a graph break would raise) and gives the eager numbers."""
    cu = _cu([7, 3])
    q, k, v = _qkv(12, 2, 16)  # 2 pad rows
    seed = torch.tensor([5], dtype=torch.int64)
    torch.library.opcheck(ta._varlen_fwd, (q, k, v, cu, 8, 0.2, seed),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))

    def forward(q, k, v, cu):
        return ta.varlen(q, k, v, cu, 8, 0.2, seed=seed) * 2.0

    compiled = torch.compile(forward, backend="aot_eager", fullgraph=True)
    got, want = compiled(q, k, v, cu), forward(q, k, v, cu)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    # The compiled graph's backward (AOT autograd's, calling our backward op) = eager's.
    got_grads = torch.autograd.grad(got.square().sum(), (q, k, v))
    want_grads = torch.autograd.grad(want.square().sum(), (q, k, v))
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


_TINY = ModelConfig(vocab_size=50, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                    max_position_embeddings=32, hidden_dropout=0.0, attention_dropout=0.0, attention_backend="math")


@needs_interpreter
def test_tiny_bert_matches_math_backend():
    """A 2-layer BertForPreTraining (head dim 16) on an unpadded batch: the triton backend's
    loss and every parameter gradient equal the math backend's."""
    cfg = _TINY
    torch.manual_seed(0)
    model = BertForPreTraining(cfg)
    g = torch.Generator().manual_seed(4)
    lengths = [13, 1, 20]
    total = sum(lengths)
    cu = _cu(lengths)
    batch = dict(input_ids=torch.randint(1, 50, (total,), generator=g),
                 token_type_ids=torch.randint(0, 2, (total,), generator=g),
                 position_ids=torch.cat([torch.arange(n) for n in lengths]),
                 cu_seqlens=cu, max_seqlen=max(lengths),
                 masked_index=torch.tensor([0, 5, 13, 20, 30]))
    mlm_labels = torch.randint(0, 50, (5,), generator=g)
    nsp_labels = torch.tensor([0, 1, 1])

    def loss_and_grads():
        model.zero_grad()
        loss = pretraining_loss(*model(**batch), mlm_labels, nsp_labels)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    want_loss, want = loss_and_grads()
    model.attn_backend = TritonVarlenAttention(ta.varlen)
    got_loss, got = loss_and_grads()
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-6, atol=1e-6)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)


def test_build_attention_ranks_triton():
    """auto on CUDA: flash > torch_varlen (dropout 0 only) > sdpa, never triton until a GPU
    run has checked it; on CPU sdpa; "triton" by name needs CUDA and triton (stand-in
    kernels play the GPU machine)."""
    kernel, none = (lambda *a, **kw: None), (lambda: None)
    have = lambda: kernel  # noqa: E731
    pick = lambda **kw: build_attention("auto", "cuda", 0.1, **kw).name  # noqa: E731
    assert pick(flash=have, triton=have, torch_varlen=have) == "flash"
    assert pick(flash=none, triton=have, torch_varlen=have) == "sdpa"
    assert build_attention("auto", "cuda", 0.0, flash=none, triton=have, torch_varlen=have).name == "torch_varlen"
    assert pick(flash=none, triton=none, torch_varlen=have) == "sdpa"
    assert build_attention("auto", "cpu", 0.1, flash=have, triton=have, torch_varlen=have).name == "sdpa"
    backend = build_attention("triton", "cuda", 0.1, triton=have)
    assert isinstance(backend, TritonVarlenAttention) and backend.fn is kernel
    with pytest.raises(ValueError, match="'triton' needs a CUDA device and the triton package"):
        build_attention("triton", "cpu", triton=have)
    with pytest.raises(ValueError, match="kernel missing"):
        build_attention("triton", "cuda", triton=none)
    assert dataclasses.replace(ModelConfig(), attention_backend="triton").attention_backend == "triton"
