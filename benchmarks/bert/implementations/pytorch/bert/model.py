"""BERT for pre-training (masked LM + next-sentence prediction) as a pure ``nn.Module``.

Parameter names and shapes are those of Hugging Face ``BertForPreTraining``, so its state
dict loads here with ``strict=True`` and ours loads there. Precision, distribution and
checkpoint formats are applied from outside.

Two forward paths share the same weights:

- padded: ``[B, S]`` inputs, HF's arithmetic; the oracle the tests compare against.
- unpadded: the real tokens of the batch packed into ``[T]``; every op except attention
  runs on ``[T, hidden]`` and the MLM head only on the M masked rows, which skips the
  padding's FLOPs and the ``[B, S, vocab]`` logits.

A third, packed path (``cfg.pack``: up to 3 sequences per row, attention kept within each
sequence) serves fixed-width kernels. ``cfg.pack``/``cfg.unpad`` pick which one ``forward`` runs (DDP only ever calls ``forward``); both stay
callable by name for evaluation and tests.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

from .attention import AttentionBackend, build_attention, triton_levers
from .config import ModelConfig, padded_vocab_size

IGNORE_INDEX = -100  # MLM label of positions that are not predicted (HF's convention)


# ---------------------------------------------------------------- encoder pieces
# Each module works on any leading shape ([B, S, E] or [T, E]); only the attention core
# cares about the layout, and it receives that as the ``attend`` callable.


class ResidualLayerNorm(nn.LayerNorm):
    """nn.LayerNorm whose output is in the autocast dtype while autocast is on
    (``model.autocast_residual``): the residual stream it feeds is then half the bytes; the
    normalisation runs in float32 as autocast runs it. Same parameters as nn.LayerNorm."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        device = out.device.type
        if torch.is_autocast_enabled(device):
            return out.to(torch.get_autocast_dtype(device))
        return out


def residual_norm(cfg: ModelConfig) -> nn.LayerNorm:
    """The LayerNorm whose output is the residual stream (``model.autocast_residual`` picks it)."""
    cls = ResidualLayerNorm if cfg.autocast_residual else nn.LayerNorm
    return cls(cfg.hidden_size, eps=cfg.layer_norm_eps)


class Embeddings(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        # No padding_idx: HF's only freezes the [PAD] row's lookup gradient, and the pad
        # token never reaches the loss here (masked as a key, absent when unpadded).
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.LayerNorm = residual_norm(cfg)
        self.dropout = nn.Dropout(cfg.hidden_dropout)

    def forward(self, input_ids, token_type_ids, position_ids):
        # position_ids may be [S] and broadcast over a [B, S] batch.
        x = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
        x = x + self.position_embeddings(position_ids)
        return self.dropout(self.LayerNorm(x))


class SelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.hidden_size // cfg.num_heads
        self.dropout_p = cfg.attention_dropout
        self.fused = cfg.fused_qkv
        # Three parameters in both modes: HF's names are the contract, and LAMB's trust
        # ratio is per tensor (one fused [3E, E] parameter would change the update).
        self.query = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.key = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.value = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x, attend):
        # [..., E] -> [..., H, D]: a view, no copy.
        heads = (self.num_heads, self.head_dim)
        if self.fused:
            # One [3E, E] GEMM on the concatenated weights (a copy of them per call; the
            # backward of the cat is three views).
            weight = torch.cat((self.query.weight, self.key.weight, self.value.weight))
            bias = torch.cat((self.query.bias, self.key.bias, self.value.bias))
            qkv = _linear_as(self.query, x, weight, bias)
            q, k, v = qkv.unflatten(-1, (3, *heads)).unbind(-3)  # views of the [..., 3E] output
        else:
            q = self.query(x).unflatten(-1, heads)
            k = self.key(x).unflatten(-1, heads)
            v = self.value(x).unflatten(-1, heads)
        out = attend(q, k, v, dropout_p=self.dropout_p if self.training else 0.0)
        return out.flatten(-2)


def _linear_as(module: nn.Module, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``module``'s linear map with ``weight`` and ``bias`` in place of its own: F.linear for
    a plain nn.Linear; any other linear module (bert.fp8's FP8 one) runs its own forward on
    them through functional_call, whose parameter swap costs tens of microseconds of host
    time a call (traced away under torch.compile, not replayed by CUDA graphs)."""
    if type(module) is nn.Linear:
        return F.linear(x, weight, bias)
    return torch.func.functional_call(module, {"weight": weight, "bias": bias}, (x,))


class AttentionOutput(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.LayerNorm = residual_norm(cfg)
        self.dropout = nn.Dropout(cfg.hidden_dropout)

    def forward(self, h, residual):
        return self.LayerNorm(self.dropout(self.dense(h)) + residual)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self = SelfAttention(cfg)  # "self" is HF's name, part of the state-dict key
        self.output = AttentionOutput(cfg)

    def forward(self, x, attend):
        return self.output(self.self(x, attend), x)


# model.activation -> F.gelu's ``approximate``: one elementwise kernel either way (one fused
# expression under torch.compile). On a CPU the tanh form's kernel costs ~1.4x the erf one's,
# a step's time moves by less than its noise (BENCHMARKS.md section 13).
GELU_APPROXIMATE = {"gelu_tanh": "tanh", "gelu_erf": "none"}


def gelu_approximate(cfg: ModelConfig) -> str:
    """``approximate`` for F.gelu of ``cfg.activation``; ValueError naming the key if unknown."""
    try:
        return GELU_APPROXIMATE[cfg.activation]
    except KeyError:
        raise ValueError(f"model.activation: {cfg.activation!r} is not one of {list(GELU_APPROXIMATE)}") from None


class Intermediate(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.approximate = gelu_approximate(cfg)

    def forward(self, x):
        return F.gelu(self.dense(x), approximate=self.approximate)


class Output(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.LayerNorm = residual_norm(cfg)
        self.dropout = nn.Dropout(cfg.hidden_dropout)

    def forward(self, h, residual):
        return self.LayerNorm(self.dropout(self.dense(h)) + residual)


class Layer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention = Attention(cfg)
        self.intermediate = Intermediate(cfg)
        self.output = Output(cfg)

    def forward(self, x, attend):
        a = self.attention(x, attend)
        return self.output(self.intermediate(a), a)


class Encoder(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.layer = nn.ModuleList(Layer(cfg) for _ in range(cfg.num_layers))

    def forward(self, x, attend):
        for layer in self.layer:
            x = layer(x, attend)
        return x


class Pooler(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, first_tokens):
        return torch.tanh(self.dense(first_tokens))


class BertModel(nn.Module):
    """Holder of the ``bert.*`` parameters; the paths in BertForPreTraining drive it."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embeddings = Embeddings(cfg)
        self.encoder = Encoder(cfg)
        self.pooler = Pooler(cfg)


# ---------------------------------------------------------------- heads


class PredictionHeadTransform(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.approximate = gelu_approximate(cfg)

    def forward(self, x):
        return self.LayerNorm(F.gelu(self.dense(x), approximate=self.approximate))


class LMPredictionHead(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.vocab_size = cfg.vocab_size
        self.transform = PredictionHeadTransform(cfg)
        self.decoder = nn.Linear(cfg.hidden_size, cfg.vocab_size)
        # One bias under both HF names (cls.predictions.bias and .decoder.bias).
        self.bias = nn.Parameter(torch.zeros(cfg.vocab_size))
        self.decoder.bias = self.bias

    def forward(self, x):
        # The GEMM runs on the padded rows (aligned shapes); the slice is a view that drops
        # the pad columns, so they never reach the loss or the argmax. Where autocast casts
        # the logits to float32 for the loss that cast makes the copy it needs anyway.
        return self.decoder(self.transform(x))[..., : self.vocab_size]


class PreTrainingHeads(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.predictions = LMPredictionHead(cfg)
        self.seq_relationship = nn.Linear(cfg.hidden_size, 2)


# ---------------------------------------------------------------- the model


def _attend_padded(backend: AttentionBackend, key_mask, q, k, v, dropout_p):
    # [B, S, H, D] -> [B, H, S, D] and back: strided views; the kernels accept them.
    out = backend.padded(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                         key_mask, dropout_p)
    return out.transpose(1, 2)


def encode_padded(bert: BertModel, backend: AttentionBackend, input_ids, token_type_ids, attention_mask):
    """The encoder on [B, S] ids, segment ids and mask (nonzero = real): hidden states
    [B, S, hidden] and the pooled [CLS] [B, hidden] (pretraining's and fine-tuning's path)."""
    key_mask = attention_mask.bool()
    position_ids = torch.arange(input_ids.size(1), device=input_ids.device)
    attend = functools.partial(_attend_padded, backend, key_mask)
    h = bert.encoder(bert.embeddings(input_ids, token_type_ids, position_ids), attend)
    return h, bert.pooler(h[:, 0])


def _attend_packed(backend: AttentionBackend, real_index, cu_seqlens, max_seqlen, q, k, v, dropout_p):
    # Allocates one [R * S, H, D] output; the gathers copy the T real rows of q, k, v.
    out = backend.varlen(q.index_select(0, real_index), k.index_select(0, real_index),
                         v.index_select(0, real_index), cu_seqlens, max_seqlen, dropout_p)
    return q.new_zeros(q.shape).index_copy(0, real_index, out)


class BertForPreTraining(nn.Module):
    def __init__(self, cfg: ModelConfig, device_type: str = "cpu"):
        """``device_type`` ("cpu", "cuda") is where the model will run; it only steers the
        attention backend, resolved once here (the model is built before it is moved)."""
        super().__init__()
        self.unpad, self.pack = cfg.unpad, cfg.pack
        self.vocab_size = cfg.vocab_size  # the real rows; padded_vocab_size(cfg) inside
        self.initializer_range = cfg.initializer_range
        self.attn_backend = build_attention(cfg.attention_backend, device_type, cfg.attention_dropout,
                                            triton_options=triton_levers(cfg.triton_fwd_tile, cfg.triton_dropout_mask)
                                            if cfg.attention_backend == "triton" else None)
        self.bert = BertModel(cfg)
        self.cls = PreTrainingHeads(cfg)
        self.apply(self._init_weights)
        rows = padded_vocab_size(cfg)
        if rows > cfg.vocab_size:
            self._pad_vocab(rows - cfg.vocab_size)
        # Tied after init so the embedding's init is the one that stands.
        self.cls.predictions.decoder.weight = self.bert.embeddings.word_embeddings.weight

    def _pad_vocab(self, extra: int) -> None:
        """Append ``extra`` zero rows to the word embedding and the MLM bias (model.vocab_pad_multiple).

        After init, so the random draws are those of the unpadded model (same seed, same
        weights). The pad rows stay 0 in training: no input id reaches them and the logits
        are sliced before the loss, so their gradient is 0, and a zero row with zero
        gradient gets a zero Adam/LAMB update (norms and trust ratios unchanged too). The
        state dict hooks keep every state dict at vocab_size rows.
        """
        emb, head = self.bert.embeddings.word_embeddings, self.cls.predictions
        with torch.no_grad():
            emb.weight = nn.Parameter(F.pad(emb.weight, (0, 0, 0, extra)))
            head.bias = nn.Parameter(F.pad(head.bias, (0, extra)))  # same key, same parameter order
        head.decoder.bias = head.bias
        emb.num_embeddings = head.decoder.out_features = emb.weight.shape[0]
        self.register_state_dict_post_hook(_drop_pad_rows)
        self.register_load_state_dict_pre_hook(_add_pad_rows)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=self.initializer_range)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
        elif isinstance(module, LMPredictionHead):
            nn.init.zeros_(module.bias)

    def forward(self, **inputs):
        """The path fixed at construction by ``cfg.unpad``; see the two methods below."""
        if self.pack:
            return self.forward_packed(**inputs)
        if self.unpad:
            return self.forward_unpadded(**inputs)
        return self.forward_padded(**inputs)

    def forward_padded(self, input_ids, token_type_ids, attention_mask):
        """[B, S] ids, segment ids and mask (nonzero = real) -> ([B, S, V], [B, 2])."""
        h, pooled = encode_padded(self.bert, self.attn_backend, input_ids, token_type_ids, attention_mask)
        return self.cls.predictions(h), self.cls.seq_relationship(pooled)

    def forward_packed(self, input_ids, token_type_ids, position_ids, real_index, cu_seqlens,
                       max_seqlen, masked_index, first_index):
        """Packed rows (``bert.batches.collate_packed``) -> (MLM logits [M, V], NSP [B, 2]).

        Every op but attention runs on the [R, S] grid, padding cells included (the fixed
        row width is what packing is for); attention gathers the T real tokens, attends
        within each sequence (``varlen``) and scatters back, so padding cells get zeros
        there and sequences sharing a row never see each other.
        """
        attend = functools.partial(_attend_packed, self.attn_backend, real_index, cu_seqlens, max_seqlen)
        h = self.bert.embeddings(input_ids, token_type_ids, position_ids).flatten(0, 1)
        h = self.bert.encoder(h, attend)
        pooled = self.bert.pooler(h.index_select(0, first_index))
        mlm = self.cls.predictions(h.index_select(0, masked_index))
        return mlm, self.cls.seq_relationship(pooled)

    def forward_unpadded(self, input_ids, token_type_ids, position_ids, cu_seqlens,
                         max_seqlen, masked_index):
        """Packed real tokens -> (MLM logits [M, V] at ``masked_index``, NSP logits [B, 2]).

        input_ids, token_type_ids, position_ids: [T]; cu_seqlens: int32 [B + 1];
        max_seqlen: Python int >= the longest sequence; masked_index: int64 [M] rows of T.
        """
        attend = functools.partial(self.attn_backend.varlen, cu_seqlens=cu_seqlens,
                                   max_seqlen=max_seqlen)
        h = self.bert.embeddings(input_ids, token_type_ids, position_ids)
        h = self.bert.encoder(h, attend)
        pooled = self.bert.pooler(h.index_select(0, cu_seqlens[:-1].long()))
        # The head (a hidden x hidden GEMM and the hidden x vocab decoder) sees M rows, not T.
        mlm = self.cls.predictions(h.index_select(0, masked_index))
        return mlm, self.cls.seq_relationship(pooled)


# State-dict keys of the padded vocabulary rows (model.vocab_pad_multiple); the tied ones too.
VOCAB_ROWS = ("bert.embeddings.word_embeddings.weight", "cls.predictions.decoder.weight",
              "cls.predictions.bias", "cls.predictions.decoder.bias")


def _drop_pad_rows(module: BertForPreTraining, state: dict, prefix: str, local_metadata) -> None:
    # Views, not copies: step_graph.restore writes the model back through state_dict()
    # tensors in place, and a copy would swallow those writes.
    for name in VOCAB_ROWS:
        if prefix + name in state:
            state[prefix + name] = state[prefix + name][: module.vocab_size]


def _add_pad_rows(module: BertForPreTraining, state: dict, prefix: str, *_args) -> None:
    # load_state_dict hands hooks its own copy of the mapping: the caller's stays untouched.
    rows = module.bert.embeddings.word_embeddings.weight.shape[0]
    for name in VOCAB_ROWS:
        t = state.get(prefix + name)
        if t is not None and t.shape[:1] == (module.vocab_size,):
            state[prefix + name] = torch.cat((t, t.new_zeros((rows - module.vocab_size, *t.shape[1:]))))


# ---------------------------------------------------------------- loss and accuracy


def pretraining_loss(mlm_logits, nsp_logits, mlm_labels, nsp_labels):
    """Mean MLM cross-entropy over labelled positions + mean NSP cross-entropy (HF's loss).

    Padded: mlm_logits [B, S, V], mlm_labels [B, S] with IGNORE_INDEX where unmasked.
    Unpadded: [M, V] and [M]. Under autocast, cross_entropy runs in float32 on its own.
    """
    mlm = F.cross_entropy(mlm_logits.reshape(-1, mlm_logits.size(-1)), mlm_labels.reshape(-1),
                          ignore_index=IGNORE_INDEX)
    nsp = F.cross_entropy(nsp_logits.reshape(-1, 2), nsp_labels.reshape(-1))
    return mlm + nsp


@torch.no_grad()
def mlm_correct_and_count(mlm_logits, mlm_labels):
    """(correct, labelled) MLM predictions as 0-d int64 tensors; no host sync, so callers
    can sum them across batches and ranks and divide once at the end (exact accuracy)."""
    labelled = mlm_labels != IGNORE_INDEX
    correct = (mlm_logits.argmax(dim=-1) == mlm_labels) & labelled
    return correct.sum(), labelled.sum()
