"""BERT for sequence classification and regression (GLUE fine-tuning) as a pure ``nn.Module``.

The encoder is ``bert/model.py``'s (``BertModel``: embeddings, encoder, pooler), driven by the
padded path; on top, dropout and one linear layer on the pooled [CLS] vector, as Hugging Face
``BertForSequenceClassification`` has it: the same parameter names (``bert.*``,
``classifier.*``), so its state dict loads here and the logits agree (tests/unit/test_glue.py).
``num_labels`` 1 is regression (STS-B); the loss is chosen by the caller.

The pretraining heads (``cls.*``) are not here: ``encoder_state`` takes the ``bert.*`` part of
a pretraining state dict (ours, HF's, a TF checkpoint's after ``bert.weights``' import).
The word embedding has exactly ``vocab_size`` rows (no ``model.vocab_pad_multiple`` padding:
no vocab-sized GEMM runs here).
"""

from __future__ import annotations

from typing import Mapping

import torch
import torch.nn as nn

from .attention import build_attention
from .config import ModelConfig
from .model import BertForPreTraining, BertModel, encode_padded

ENCODER_PREFIX = "bert."


class BertForSequenceClassification(nn.Module):
    def __init__(self, cfg: ModelConfig, num_labels: int, device_type: str = "cpu"):
        super().__init__()
        self.num_labels = num_labels
        self.initializer_range = cfg.initializer_range
        self.attn_backend = build_attention(cfg.attention_backend, device_type, cfg.attention_dropout)
        self.bert = BertModel(cfg)
        self.dropout = nn.Dropout(cfg.hidden_dropout)
        self.classifier = nn.Linear(cfg.hidden_size, num_labels)
        self.apply(self._init_weights)

    # BertForPreTraining's init (normal(0, initializer_range), zero biases, unit LayerNorm):
    # a randomly initialised twin is the same draw a pretraining run starts from.
    _init_weights = BertForPreTraining._init_weights

    def forward(self, input_ids, token_type_ids, attention_mask):
        """[B, S] ids, segment ids and mask (nonzero = real) -> logits [B, num_labels]."""
        _, pooled = encode_padded(self.bert, self.attn_backend, input_ids, token_type_ids, attention_mask)
        return self.classifier(self.dropout(pooled))

    def load_encoder(self, state: Mapping[str, torch.Tensor]) -> None:
        """Load the ``bert.*`` tensors of a pretraining state dict; every encoder tensor must be
        there (strict), the classifier keeps its initialisation."""
        missing, unexpected = self.load_state_dict(encoder_state(state), strict=False)
        missing = [k for k in missing if not k.startswith("classifier.")]
        if missing or unexpected:
            raise KeyError(f"encoder state: {len(missing)} missing (e.g. {missing[:3]}), "
                           f"{len(unexpected)} unexpected (e.g. {unexpected[:3]})")


def encoder_state(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The ``bert.*`` entries of a state dict (the pretraining heads and HF's position_ids
    buffer dropped)."""
    return {k: v for k, v in state.items() if k.startswith(ENCODER_PREFIX) and not k.endswith("position_ids")}
