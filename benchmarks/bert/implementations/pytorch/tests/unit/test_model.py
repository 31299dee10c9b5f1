"""The model against Hugging Face ``BertForPreTraining`` as the oracle, on a tiny config."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from bert.attention import AttentionBackend, build_attention  # noqa: E402
from bert.config import ModelConfig  # noqa: E402
from bert.model import BertForPreTraining, mlm_correct_and_count, pretraining_loss  # noqa: E402
from bert.weights import HF_ACTIVATIONS  # noqa: E402
from model_helpers import TINY, hf, hf_model, make_batch, ours_from, pack  # noqa: F401 - fixtures: hf


TOL = dict(rtol=0, atol=1e-5)


@pytest.mark.parametrize("backend", ["sdpa", "math"])
@pytest.mark.parametrize("unpad", [False, True])
def test_matches_hf_in_eval(hf, backend, unpad):
    # Nonzero dropout in both configs: eval mode must switch all of it off.
    cfg = dataclasses.replace(TINY, hidden_dropout=0.1, attention_dropout=0.1,
                              attention_backend=backend, unpad=unpad)
    ours = ours_from(hf, cfg).eval()
    padded, labels, nsp = make_batch()
    with torch.no_grad():
        ref = hf(**padded, labels=labels, next_sentence_label=nsp)
        if unpad:
            inputs, mlm_labels = pack(padded, labels)
            mlm, nsp_logits = ours(**inputs)
            loss = pretraining_loss(mlm, nsp_logits, mlm_labels, nsp)
            ref_mlm = ref.prediction_logits[labels != -100]
            assert mlm.shape == (int((labels != -100).sum()), cfg.vocab_size)
        else:
            mlm, nsp_logits = ours(**padded)
            loss = pretraining_loss(mlm, nsp_logits, labels, nsp)
            real = padded["attention_mask"].bool()  # padded query rows are don't-care
            mlm, ref_mlm = mlm[real], ref.prediction_logits[real]
    torch.testing.assert_close(mlm, ref_mlm, **TOL)
    torch.testing.assert_close(nsp_logits, ref.seq_relationship_logits, **TOL)
    torch.testing.assert_close(loss, ref.loss, **TOL)
    assert ref_mlm.abs().max() > 0.1  # the comparison is not between near-zero tensors


def test_gelu_tanh_is_googles_formula_and_erf_is_the_exact_one():
    """model.activation's two GELUs, in float64 on [-10, 10]: gelu_tanh is modeling.gelu of
    Google's BERT (the reference's) as it is written there, 0.5 x (1 + tanh(sqrt(2/pi) (x +
    0.044715 x^3))); gelu_erf is x Phi(x); the two differ by up to 4.7e-4 (near |x| = 2.7)."""
    from bert.model import Intermediate

    x = torch.linspace(-10, 10, 200001, dtype=torch.float64)
    google = 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3))))
    exact = x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))
    out = {}
    for act in ("gelu_tanh", "gelu_erf"):
        layer = Intermediate(dataclasses.replace(TINY, activation=act, intermediate_size=1, hidden_size=1)).double()
        with torch.no_grad():
            layer.dense.weight.fill_(1.0)
            layer.dense.bias.zero_()
            out[act] = layer(x[:, None])[:, 0]
    torch.testing.assert_close(out["gelu_tanh"], google, rtol=0, atol=1e-14)
    torch.testing.assert_close(out["gelu_erf"], exact, rtol=0, atol=1e-14)
    gap = (out["gelu_tanh"] - out["gelu_erf"]).abs()
    assert 4.7e-4 < float(gap.max()) < 4.8e-4 and 2.6 < abs(float(x[gap.argmax()])) < 2.8
    with pytest.raises(ValueError, match="model.activation: 'relu' is not one of"):
        Intermediate(dataclasses.replace(TINY, activation="relu"))


def test_the_hf_oracle_tells_the_two_gelus_apart(hf):
    """Each setting of model.activation matches HF's model of that activation (the hf
    fixture's two) and misses the other's by far more than the oracle's tolerance: the
    comparisons above are not blind to the activation."""
    padded, _, _ = make_batch()
    real = padded["attention_mask"].bool()
    with torch.no_grad():
        ref = hf(**padded).prediction_logits[real]
        gaps = {}
        for act in ("gelu_tanh", "gelu_erf"):
            ours = BertForPreTraining(dataclasses.replace(TINY, unpad=False, activation=act)).eval()
            ours.load_state_dict(hf.state_dict())
            gaps[act] = float((ours(**padded)[0][real] - ref).abs().max())
    same = HF_ACTIVATIONS[hf.config.hidden_act]
    other = ({"gelu_tanh", "gelu_erf"} - {same}).pop()
    assert gaps[same] <= TOL["atol"] and gaps[other] > 20 * TOL["atol"], gaps


def test_padded_logits_full_shape(hf):
    ours = ours_from(hf, dataclasses.replace(TINY, unpad=False)).eval()
    padded, labels, nsp = make_batch()
    with torch.no_grad():
        mlm, nsp_logits = ours(**padded)
        ref = hf(**padded)
    assert mlm.shape == (3, 16, TINY.vocab_size) and nsp_logits.shape == (3, 2)
    torch.testing.assert_close(mlm, ref.prediction_logits, **TOL)
    # The padded loss takes [B, S] labels with -100 at unmasked positions.
    loss = pretraining_loss(mlm, nsp_logits, labels, nsp)
    with torch.no_grad():
        ref_loss = hf(**padded, labels=labels, next_sentence_label=nsp).loss
    torch.testing.assert_close(loss, ref_loss, **TOL)


def test_mlm_accuracy_counts(hf):
    padded, labels, _ = make_batch()
    with torch.no_grad():
        ref_logits = hf(**padded).prediction_logits
    labelled = labels != -100
    # Make some predictions right so "correct" is not trivially zero.
    labels = labels.clone()
    labels[0, labelled[0].nonzero()[0]] = ref_logits[0, labelled[0].nonzero()[0]].argmax(-1)
    want_correct = int((ref_logits[labelled].argmax(-1) == labels[labelled]).sum())
    assert want_correct >= 1
    ours = ours_from(hf, dataclasses.replace(TINY, unpad=True)).eval()
    inputs, packed_labels = pack(padded, labels)
    with torch.no_grad():
        mlm, _ = ours(**inputs)
    correct, count = mlm_correct_and_count(mlm, packed_labels)
    assert isinstance(correct, torch.Tensor) and isinstance(count, torch.Tensor)
    assert (int(correct), int(count)) == (want_correct, int(labelled.sum()))
    correct, count = mlm_correct_and_count(ref_logits, labels)  # padded [B, S] labels
    assert (int(correct), int(count)) == (want_correct, int(labelled.sum()))


def test_state_dict_matches_hf_both_ways(hf):
    ours = BertForPreTraining(TINY)
    hf_sd, our_sd = hf.state_dict(), ours.state_dict()
    assert list(our_sd) == list(hf_sd)
    assert {k: v.shape for k, v in our_sd.items()} == {k: v.shape for k, v in hf_sd.items()}
    fresh_hf = hf_model(TINY, seed=3)
    fresh_hf.load_state_dict(our_sd, strict=True)
    for k, v in fresh_hf.state_dict().items():
        assert torch.equal(v, our_sd[k]), k


def test_decoder_is_tied():
    ours = BertForPreTraining(TINY)
    head = ours.cls.predictions
    assert head.decoder.weight is ours.bert.embeddings.word_embeddings.weight
    assert head.decoder.bias is head.bias
    # Tying survives loading a checkpoint (load_state_dict copies in place).
    ours.load_state_dict(hf_model(TINY).state_dict(), strict=True)
    assert head.decoder.weight is ours.bert.embeddings.word_embeddings.weight
    # Shared tensors are counted once by the optimizer's view of the model.
    names = [n for n, _ in ours.named_parameters()]
    assert "cls.predictions.decoder.weight" not in names


def test_init():
    cfg = dataclasses.replace(TINY, vocab_size=1000, hidden_size=128, num_heads=4,
                              intermediate_size=256, initializer_range=0.05)
    torch.manual_seed(0)
    ours = BertForPreTraining(cfg)
    std = ours.bert.encoder.layer[0].intermediate.dense.weight.std().item()
    assert math.isclose(std, 0.05, rel_tol=0.05)
    assert math.isclose(ours.bert.embeddings.word_embeddings.weight.std().item(), 0.05,
                        rel_tol=0.05)
    for name, p in ours.named_parameters():
        if name.endswith("bias"):
            assert torch.all(p == 0), name
        if "LayerNorm.weight" in name:
            assert torch.all(p == 1), name


def test_autocast_residual_is_as_close_to_hf_as_the_float32_residual():
    """model.autocast_residual against Hugging Face's float32 model, under bf16 autocast on 12
    layers of width 256: the residual stream in bf16 (checked: the embedding's and every
    sublayer's LayerNorm return bf16; float32 with the flag off) keeps the MLM logits within
    bf16 tolerance of HF, no further from it than the float32 stream is by more than half;
    without autocast the flag changes nothing."""
    cfg = dataclasses.replace(TINY, num_layers=12, hidden_size=256, intermediate_size=1024)
    hf = hf_model(cfg).eval()
    padded, labels, nsp = make_batch()
    inputs, mlm_labels = pack(padded, labels)
    with torch.no_grad():
        ref = hf(**padded, labels=labels, next_sentence_label=nsp).prediction_logits[labels != -100]
    scale, errs = float(ref.abs().max()), {}
    for flag in (False, True):
        ours = ours_from(hf, dataclasses.replace(cfg, autocast_residual=flag)).eval()
        dtypes = set()
        norms = [ours.bert.embeddings.LayerNorm] + [n for layer in ours.bert.encoder.layer
                                                     for n in (layer.attention.output.LayerNorm, layer.output.LayerNorm)]
        hooks = [n.register_forward_hook(lambda m, i, o: dtypes.add(o.dtype)) for n in norms]
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            mlm, _ = ours(**inputs)
        for h in hooks:
            h.remove()
        assert dtypes == {torch.bfloat16 if flag else torch.float32}
        errs[flag] = float((mlm.float() - ref).abs().max())
        with torch.no_grad():
            torch.testing.assert_close(ours(**inputs)[0], ref, rtol=0, atol=1e-4)
    assert errs[True] <= 0.06 * scale and errs[False] <= 0.06 * scale, (errs, scale)
    assert errs[True] <= 1.5 * errs[False], errs


@pytest.mark.parametrize("backend", ["sdpa", "math", "nested"])
def test_unpadded_gradients_equal_padded(backend):
    hf = hf_model(TINY, seed=5)
    padded, labels, nsp = make_batch(seed=7)
    inputs, packed_labels = pack(padded, labels)
    grads = {}
    for unpad in (False, True):
        model = ours_from(hf, dataclasses.replace(TINY, attention_backend=backend,
                                                  unpad=unpad)).train()
        if unpad:
            mlm, nsp_logits = model(**inputs)
            loss = pretraining_loss(mlm, nsp_logits, packed_labels, nsp)
        else:
            mlm, nsp_logits = model(**padded)
            loss = pretraining_loss(mlm, nsp_logits, labels, nsp)
        loss.backward()
        grads[unpad] = {n: p.grad for n, p in model.named_parameters()}
    assert grads[False].keys() == grads[True].keys()
    for name, g in grads[False].items():
        assert g is not None and grads[True][name] is not None, name
        torch.testing.assert_close(grads[True][name], g, **TOL, msg=lambda m: f"{name}: {m}")
    assert grads[True]["bert.encoder.layer.0.attention.self.query.weight"].abs().max() > 0


def test_attention_dropout_applies_only_in_training():
    cfg = dataclasses.replace(TINY, attention_dropout=0.5, unpad=True)
    model = ours_from(hf_model(TINY), cfg)
    inputs, _ = pack(*make_batch()[:2])
    torch.manual_seed(0)
    with torch.no_grad():
        a = model.eval()(**inputs)[0]
        b = model.eval()(**inputs)[0]
        c = model.train()(**inputs)[0]
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not torch.allclose(a, c, atol=1e-3)


def test_build_attention_resolves_and_rejects():
    auto = build_attention("auto", "cpu")
    assert isinstance(auto, AttentionBackend)
    assert callable(auto.padded) and callable(auto.varlen)
    assert build_attention("math", "cpu").name == "math"
    assert build_attention("sdpa", "cuda").name == "sdpa"
    with pytest.raises(ValueError, match="bogus"):
        build_attention("bogus", "cpu")


def _reference_attention(q, k, v):
    """One unmasked sequence, [S, H, D], in float64."""
    q, k, v = (t.double().transpose(0, 1) for t in (q, k, v))
    p = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.size(-1)), dim=-1)
    return (p @ v).transpose(0, 1).float()


@pytest.mark.parametrize("name", ["sdpa", "math", "nested"])
def test_varlen_equals_attention_per_sequence(name):
    backend = build_attention(name, "cpu")
    g = torch.Generator().manual_seed(0)
    lengths = [5, 1, 8, 3]
    total, heads, dim = sum(lengths), 2, 8
    q, k, v = (torch.randn(total, heads, dim, generator=g) for _ in range(3))
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    out = backend.varlen(q, k, v, cu, max_seqlen=10)  # larger than needed is allowed
    assert out.shape == (total, heads, dim)
    for b in range(len(lengths)):
        s, e = int(cu[b]), int(cu[b + 1])
        torch.testing.assert_close(out[s:e], _reference_attention(q[s:e], k[s:e], v[s:e]),
                                   rtol=0, atol=1e-5)


def test_padded_backends_agree_and_ignore_masked_keys():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 3, 6, 8, generator=g) for _ in range(3))
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    sdpa = build_attention("sdpa", "cpu").padded(q, k, v, mask)
    math_ = build_attention("math", "cpu").padded(q, k, v, mask)
    torch.testing.assert_close(sdpa, math_, rtol=0, atol=1e-5)
    k2, v2 = k.clone(), v.clone()
    k2[0, :, 4:] += 100.0  # changing masked keys/values must not change the output
    v2[0, :, 4:] -= 100.0
    torch.testing.assert_close(build_attention("math", "cpu").padded(q, k2, v2, mask), math_,
                               rtol=0, atol=1e-5)


def test_nested_backend_pad_rows_and_dropout():
    """backend "nested": rows past cu_seqlens[-1] (a token budget's padding) give exactly 0
    and take no gradient; real rows are unchanged by them; with dropout the output changes
    between calls and stays finite."""
    backend = build_attention("nested", "cpu")
    g = torch.Generator().manual_seed(2)
    lengths, pad, heads, dim = [4, 7, 2], 11, 2, 8  # 11 pad rows > max_seqlen: two pad segments
    total = sum(lengths) + pad
    q, k, v = (torch.randn(total, heads, dim, generator=g, requires_grad=True) for _ in range(3))
    cu = torch.tensor([0, 4, 11, 13], dtype=torch.int32)
    out = backend.varlen(q, k, v, cu, max_seqlen=8)
    assert torch.equal(out[13:], torch.zeros_like(out[13:]))
    exact = backend.varlen(*(t[:13] for t in (q, k, v)), cu, max_seqlen=8)
    torch.testing.assert_close(out[:13], exact, rtol=0, atol=1e-6)
    out.sum().backward()
    for t in (q, k, v):
        assert not t.grad[13:].any() and t.grad[:13].abs().sum() > 0
    with torch.no_grad():
        a, b = (backend.varlen(q, k, v, cu, max_seqlen=8, dropout_p=0.5) for _ in range(2))
    assert torch.isfinite(a).all() and not torch.equal(a, b) and not torch.equal(a[:13], exact)


@pytest.mark.parametrize("lengths, total, max_seqlen", [
    ([4, 7, 2], 13, 8),    # no pad rows: every pad segment is an appended row
    ([4, 7, 2], 14, 8),    # one pad row, fewer than the segments
    ([4, 7, 2], 24, 8),    # 11 pad rows > max_seqlen
    ([8, 8], 64, 8),       # pad rows = 3x the real ones
    ([1], 5, 1),           # max_seqlen 1: segments of up to 2 rows (the hint is raised to 2)
])
def test_nested_pad_segments_are_never_empty(lengths, total, max_seqlen):
    """The nested backend tells SDPA min_seqlen=1: every pad segment holds 1 to max_seqlen
    rows, the segments cover the pad rows and the appended ones, and the real offsets come
    first unchanged."""
    from bert.attention import pad_segments

    cu = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32)
    offsets, n = pad_segments(cu, total, max_seqlen)
    assert offsets[: len(cu)].tolist() == cu.tolist() and int(offsets[-1]) == total + n
    seg = (offsets[len(cu):] - offsets[len(cu) - 1:-1]).tolist()
    assert len(seg) == n and min(seg) >= 1 and max(seg) <= max(max_seqlen, 2), seg


PLAIN = dataclasses.replace(TINY, fused_qkv=False, vocab_pad_multiple=1, hidden_dropout=0.1, attention_dropout=0.1)


VARIANTS = {"fused_qkv": dict(fused_qkv=True), "vocab_pad": dict(vocab_pad_multiple=64),
            "both": dict(fused_qkv=True, vocab_pad_multiple=64)}


def _forward(model, unpad: bool, seed: int = 3):
    """(loss, MLM logits) on the test batch, dropout (in train mode) drawn from ``seed``."""
    padded, labels, nsp = make_batch(seed=7)
    torch.manual_seed(seed)
    if unpad:
        inputs, labels = pack(padded, labels)
        mlm, nsp_logits = model(**inputs)
    else:
        mlm, nsp_logits = model(**padded)
    return pretraining_loss(mlm, nsp_logits, labels, nsp), mlm


def _train_pass(model, unpad: bool, seed: int = 3):
    """Loss, logits and gradients of one training forward + backward."""
    model.zero_grad()
    loss, mlm = _forward(model, unpad, seed)
    loss.backward()
    return loss, mlm, {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("variant, unpad", [("fused_qkv", True), ("vocab_pad", True), ("both", True),
                                            ("both", False)])
def test_fused_qkv_and_padded_vocab_are_the_plain_model(variant, unpad):
    """model.fused_qkv and model.vocab_pad_multiple change how the model computes, not what:
    from one seed the same weights (state dicts equal exactly, HF names and vocab_size rows),
    and the same logits, loss and gradients, dropout included, up to float rounding; the pad
    rows take no gradient at all."""
    cfg = dataclasses.replace(PLAIN, unpad=unpad, **VARIANTS[variant])
    models = {}
    for name, c in (("plain", dataclasses.replace(PLAIN, unpad=unpad)), (variant, cfg)):
        torch.manual_seed(0)
        models[name] = BertForPreTraining(c).train()
    plain_sd, sd = models["plain"].state_dict(), models[variant].state_dict()
    assert list(sd) == list(plain_sd) and all(torch.equal(sd[k], v) for k, v in plain_sd.items())
    rows = models[variant].bert.embeddings.word_embeddings.weight.shape[0]
    assert rows == (128 if cfg.vocab_pad_multiple == 64 else TINY.vocab_size)
    ref_loss, ref_mlm, ref_grads = _train_pass(models["plain"], unpad)
    loss, mlm, grads = _train_pass(models[variant], unpad)
    assert mlm.shape == ref_mlm.shape and mlm.shape[-1] == TINY.vocab_size
    torch.testing.assert_close(mlm, ref_mlm, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    assert list(grads) == list(ref_grads)
    for name, g in grads.items():
        want = ref_grads[name]
        assert torch.equal(g[want.shape[0]:], torch.zeros_like(g[want.shape[0]:])), name  # pad rows: no gradient
        torch.testing.assert_close(g[: want.shape[0]], want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    assert ref_grads["bert.encoder.layer.0.attention.self.value.weight"].abs().max() > 1e-3


def test_padded_vocab_stays_zero_under_lamb_and_never_wins():
    """Three LAMB steps (global clip 1.0) of the padded + fused model track the plain one
    (LAMB's per-tensor trust ratios see the same norms: the pad rows are zero and stay
    zero); and pad rows that were not zero still could not reach the loss or the argmax."""
    from bert.config import OptimConfig
    from bert.optim import build_optimizer

    models, opts = {}, {}
    for name, c in (("plain", PLAIN), ("both", dataclasses.replace(PLAIN, **VARIANTS["both"]))):
        torch.manual_seed(0)
        models[name] = BertForPreTraining(dataclasses.replace(c, unpad=True)).train()
        opts[name], _ = build_optimizer(models[name], OptimConfig(lr=1e-2), "cpu")
    for step in range(3):
        for name, model in models.items():
            loss, _, _ = _train_pass(model, True, seed=step)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opts[name].step()
    plain, both = models["plain"].state_dict(), models["both"].state_dict()
    moved = max(float((v - BertForPreTraining(PLAIN).state_dict()[k]).abs().max()) for k, v in plain.items())
    assert moved > 1e-3  # the steps did change the weights
    for k, v in plain.items():
        torch.testing.assert_close(both[k], v, rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")
    emb, bias = models["both"].bert.embeddings.word_embeddings.weight, models["both"].cls.predictions.bias
    assert not emb[TINY.vocab_size:].any() and not bias[TINY.vocab_size:].any()
    # Pad logits made huge: still sliced off before the loss and the argmax.
    model = models["both"].eval()
    with torch.no_grad():
        before = _forward(model, True)
        bias[TINY.vocab_size:] = 1e4
        after = _forward(model, True)
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])
    assert int(after[1].argmax(-1).max()) < TINY.vocab_size


def test_padded_vocab_rows_and_checks():
    from bert.config import ConfigError, build_config, padded_vocab_size

    assert padded_vocab_size(ModelConfig()) == 30528  # NVIDIA's padding of the 30,522 WordPiece ids
    assert padded_vocab_size(dataclasses.replace(TINY, vocab_pad_multiple=1)) == TINY.vocab_size
    with pytest.raises(ConfigError, match="model.vocab_pad_multiple"):
        build_config({"model.vocab_pad_multiple": "0"})
    # HF weights in: the pad rows are zero, whatever they held before.
    ours = BertForPreTraining(dataclasses.replace(TINY, vocab_pad_multiple=64))
    with torch.no_grad():
        ours.bert.embeddings.word_embeddings.weight.fill_(1.0)
        ours.cls.predictions.bias.fill_(1.0)
    ours.load_state_dict(hf_model(TINY).state_dict(), strict=True)
    assert ours.cls.predictions.decoder.weight is ours.bert.embeddings.word_embeddings.weight
    assert not ours.bert.embeddings.word_embeddings.weight[TINY.vocab_size:].any()
    assert not ours.cls.predictions.bias[TINY.vocab_size:].any()
