"""FP8 GEMMs under torch.compile (bert/fp8.py through torchao's CPU emulation): a converted
layer traced whole, with autograd; the rest of the FP8 tests are in tests/unit/test_fp8.py."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

pytest.importorskip("torchao.float8")

from bert import fp8  # noqa: E402
from bert.model import BertForPreTraining  # noqa: E402
from model_helpers import TINY  # noqa: E402


def test_a_compiled_layer_traces_fp8_whole_with_autograd():
    """dynamo + AOT autograd (aot_eager: inductor's front end without its code generation)
    take a converted layer, fused QKV included, as one graph with dynamic shapes (as
    bert.trainer compiles each layer), with eager's result."""
    model = BertForPreTraining(dataclasses.replace(TINY, unpad=True, fused_qkv=True))
    fp8.convert(model, "tensorwise", "cpu")
    layer = model.bert.encoder.layer[0]
    x = torch.randn(24, TINY.hidden_size, requires_grad=True)
    attend = model.attn_backend.padded  # any callable of (q, k, v, dropout_p): the layer's contract
    attend = functools.partial(_attend_one_sequence, attend)
    want = layer(x, attend)
    want.square().sum().backward()
    want_grad = layer.attention.self.query.weight.grad.clone()
    layer.zero_grad()
    torch._dynamo.reset()
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True, dynamic=True)
    got = compiled(x, attend)
    got.square().sum().backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.attention.self.query.weight.grad, want_grad, rtol=1e-5, atol=1e-5)


def _attend_one_sequence(padded, q, k, v, dropout_p):
    # [T, H, D] as one unmasked sequence through the padded kernel: [1, H, T, D] views.
    mask = torch.ones(1, q.shape[0], dtype=torch.bool)
    out = padded(*(t.transpose(0, 1)[None] for t in (q, k, v)), mask, dropout_p)
    return out[0].transpose(0, 1)
