"""Helpers of test_model.py's unit and integration tests (and of other test files that import them)."""

from __future__ import annotations

import dataclasses

import pytest
import torch


transformers = pytest.importorskip("transformers")

from bert.config import ModelConfig  # noqa: E402
from bert.model import BertForPreTraining  # noqa: E402
from bert.weights import HF_ACTIVATIONS, hf_config  # noqa: E402


TINY = ModelConfig(vocab_size=100, hidden_size=64, num_layers=2, num_heads=4,
                   intermediate_size=128, max_position_embeddings=64, type_vocab_size=2,
                   hidden_dropout=0.0, attention_dropout=0.0)


def hf_model(cfg: ModelConfig, seed: int = 0):
    """HF's BertForPreTraining of ``cfg`` (its activation by HF's name: bert.weights.hf_config)."""
    hf_cfg = transformers.BertConfig(**hf_config(cfg), attn_implementation="eager")
    torch.manual_seed(seed)
    model = transformers.BertForPreTraining(hf_cfg)
    # Perturb every parameter so zero biases and unit LayerNorm weights cannot hide a
    # wrong mapping (named_parameters yields each tied tensor once).
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


def ours_from(hf, cfg: ModelConfig) -> BertForPreTraining:
    """Our model of ``cfg`` with ``hf``'s weights and activation (read from its config by
    Hugging Face's names: bert.weights.HF_ACTIVATIONS)."""
    model = BertForPreTraining(dataclasses.replace(cfg, activation=HF_ACTIVATIONS[hf.config.hidden_act]))
    model.load_state_dict(hf.state_dict(), strict=True)
    return model


def make_batch(seed: int = 1):
    """Three sequences of real lengths 13, 9, 4 in S=16: padding at the end of every row,
    so max_seqlen (13) is below S as well."""
    g = torch.Generator().manual_seed(seed)
    lengths, seq = [13, 9, 4], 16
    batch = len(lengths)
    input_ids = torch.zeros(batch, seq, dtype=torch.long)
    token_type_ids = torch.zeros(batch, seq, dtype=torch.long)
    attention_mask = torch.zeros(batch, seq, dtype=torch.long)
    labels = torch.full((batch, seq), -100, dtype=torch.long)
    for b, n in enumerate(lengths):
        input_ids[b, :n] = torch.randint(1, TINY.vocab_size, (n,), generator=g)
        attention_mask[b, :n] = 1
        token_type_ids[b, n // 2:n] = 1  # second segment
        masked = torch.randperm(n - 1, generator=g)[: max(1, n // 4)] + 1  # never [CLS]
        labels[b, masked] = torch.randint(1, TINY.vocab_size, (masked.numel(),), generator=g)
    nsp = torch.tensor([0, 1, 1])
    return dict(input_ids=input_ids, token_type_ids=token_type_ids,
                attention_mask=attention_mask), labels, nsp


def pack(padded: dict, labels: torch.Tensor):
    """The unpadded inputs of a padded batch, built independently of the model."""
    mask = padded["attention_mask"].bool()
    lengths = mask.sum(1)
    flat_mask = mask.flatten()
    positions = torch.arange(mask.size(1)).expand_as(mask).flatten()
    packed_row = torch.cumsum(flat_mask.long(), 0) - 1  # padded flat index -> packed row
    is_masked = labels.flatten() != -100
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lengths, 0)
    inputs = dict(
        input_ids=padded["input_ids"].flatten()[flat_mask],
        token_type_ids=padded["token_type_ids"].flatten()[flat_mask],
        position_ids=positions[flat_mask],
        cu_seqlens=cu,
        max_seqlen=int(lengths.max()),
        masked_index=packed_row[is_masked],
    )
    return inputs, labels.flatten()[is_masked]


@pytest.fixture(scope="module", params=["gelu_tanh", "gelu_erf"])
def hf(request):
    """HF's model (dropout 0.1) in each model.activation: the tests that use it run in both."""
    return hf_model(dataclasses.replace(TINY, hidden_dropout=0.1, attention_dropout=0.1,
                                        activation=request.param)).eval()
