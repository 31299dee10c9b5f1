"""Our closed-division update (global-norm clip after the allreduce, then our foreach LAMB)
equals the two approved LAMBs, over several steps of a small BERT:

- the MLCommons TensorFlow reference: ``tf.clip_by_global_norm(grads, 1.0)`` in
  ``create_optimizer``, then ``LAMBOptimizer`` (``lamb_optimizer_v1.py``): bias-corrected
  moments, weight decay and layer adaptation both skipped for TF variable names matching
  "LayerNorm", "layer_norm" or "bias";
- apex ``FusedLAMB`` as its CUDA kernel computes it (``multi_tensor_lamb.cu``, adam_w_mode,
  grad_averaging, bias_correction, use_nvlamb=False), with its own global-norm clip
  (``max_grad_norm=1.0``) and NVIDIA's parameter groups (no decay for names containing
  bias, gamma, beta, LayerNorm).

Both transcriptions below are written from those sources' arithmetic, per tensor and
element-wise in float64, by TF name or NVIDIA's name rule: nothing is shared with
bert/optim.py or bert/grad_sync.py. docs/rules.md ("Optimizer equivalence") gives the equations.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

from bert.weights import TIED, name_map
from bert.config import GradSyncConfig, ModelConfig, OptimConfig
from bert.grad_sync import build as build_grad_sync
from bert.model import BertForPreTraining
from bert.optim import build_optimizer

CFG = ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64,
                  max_position_embeddings=32, hidden_dropout=0.0, attention_dropout=0.0)
LR, BETAS, EPS, WD, CLIP = 4.25e-4 * 20, (0.9, 0.999), 1e-6, 0.01, 1.0
# Global gradient norm of each step: above and below the clip norm, so both branches run.
NORMS = [5.0, 0.3, 20.0, 1.0, 0.05, 3.0, 0.7]
TF_EXCLUDE = ["LayerNorm", "layer_norm", "bias"]  # create_optimizer's exclude_from_weight_decay
NVIDIA_NO_DECAY = ["bias", "gamma", "beta", "LayerNorm"]  # NVIDIA run_pretraining.py's groups


def _model() -> BertForPreTraining:
    torch.manual_seed(0)
    return BertForPreTraining(CFG).double()


def _tf_names(model: BertForPreTraining) -> dict[str, str]:
    """Our parameter name -> its TensorFlow variable name (tied weights by their source)."""
    ours_to_tf = {m.ours: m.tf for m in name_map(CFG)}
    return {n: ours_to_tf[TIED.get(n, n)] for n, _ in model.named_parameters()}


def _grads(model: BertForPreTraining) -> list[dict[str, torch.Tensor]]:
    """Per step, a gradient per parameter with the step's global norm NORMS[t]."""
    gen = torch.Generator().manual_seed(1)
    out = []
    for norm in NORMS:
        g = {n: torch.randn(p.shape, generator=gen, dtype=torch.float64) for n, p in model.named_parameters()}
        total = math.sqrt(sum(float(x.pow(2).sum()) for x in g.values()))
        out.append({n: x * (norm / total) for n, x in g.items()})
    return out


def ours(steps: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """What a closed run does each step: GradSync's global clip after the allreduce, then
    the optimizer build_optimizer picks on CPU (our foreach LAMB)."""
    model = _model()
    opt, impl = build_optimizer(model, OptimConfig(name="lamb", lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS,
                                                   weight_decay=WD), "cpu")
    assert impl == "lamb:foreach"
    sync = build_grad_sync(GradSyncConfig(), None, model.parameters(), CLIP)
    params = dict(model.named_parameters())
    for grads in steps:
        for n, p in params.items():
            p.grad = grads[n].clone()
        sync.after_sync()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in params.items()}


def tf_reference(steps: list[dict[str, torch.Tensor]], exclude_layer_adaptation: bool = True) -> dict[str, torch.Tensor]:
    """The MLCommons TF reference's clip and LAMBOptimizer, one variable at a time."""
    model = _model()
    tf = _tf_names(model)
    p = {n: x.detach().clone() for n, x in model.named_parameters()}
    m = {n: torch.zeros_like(x) for n, x in p.items()}
    v = {n: torch.zeros_like(x) for n, x in p.items()}
    b1, b2 = BETAS

    def excluded(n: str, patterns: list[str]) -> bool:
        return any(re.search(r, tf[n]) for r in patterns)

    for t, grads in enumerate(steps, start=1):
        global_norm = math.sqrt(sum(float(g.pow(2).sum()) for g in grads.values()))
        scale = CLIP / max(global_norm, CLIP)  # tf.clip_by_global_norm
        for n in p:
            g = grads[n] * scale
            m[n] = m[n] * b1 + g * (1 - b1)
            v[n] = v[n] * b2 + (g * g) * (1 - b2)
            m_hat, v_hat = m[n] / (1.0 - b1**t), v[n] / (1.0 - b2**t)  # beta1_power, beta2_power
            update = m_hat / (v_hat.sqrt() + EPS)
            if not excluded(n, TF_EXCLUDE):
                update = update + WD * p[n]
            ratio = 1.0
            if not exclude_layer_adaptation or not excluded(n, TF_EXCLUDE):
                w_norm, g_norm = float(p[n].norm()), float(update.norm())
                ratio = (w_norm / g_norm if g_norm > 0 else 1.0) if w_norm > 0 else 1.0
            p[n] = p[n] - ratio * LR * update
    return p


def apex_fused_lamb(steps: list[dict[str, torch.Tensor]], max_grad_norm: float = CLIP) -> dict[str, torch.Tensor]:
    """apex FusedLAMB (adam_w_mode=1, grad_averaging=1, bias_correction=1, use_nvlamb=False)
    as multi_tensor_lamb.cu computes it, including its internal global-norm clip."""
    model = _model()
    p = {n: x.detach().clone() for n, x in model.named_parameters()}
    decay = {n: 0.0 if any(k in n for k in NVIDIA_NO_DECAY) else WD for n in p}
    m = {n: torch.zeros_like(x) for n, x in p.items()}
    v = {n: torch.zeros_like(x) for n, x in p.items()}
    b1, b2 = BETAS
    beta3 = 1 - b1  # grad_averaging
    for step, grads in enumerate(steps, start=1):
        global_grad_norm = math.sqrt(sum(float(g.pow(2).sum()) for g in grads.values()))  # over every group
        clipped = global_grad_norm / max_grad_norm if global_grad_norm > max_grad_norm else 1.0
        bc1, bc2 = 1 - b1**step, 1 - b2**step
        for n in p:
            scaled_grad = grads[n] / clipped
            m[n] = m[n] * b1 + beta3 * scaled_grad
            v[n] = v[n] * b2 + (1 - b2) * scaled_grad * scaled_grad
            update = (m[n] / bc1) / ((v[n] / bc2).sqrt() + EPS) + decay[n] * p[n]  # MOMENT_MODE_1
            ratio = LR
            if decay[n] != 0.0:  # use_nvlamb=False: adaptation only where the group decays
                param_norm, update_norm = float(p[n].norm()), float(update.norm())
                if update_norm != 0.0 and param_norm != 0.0:
                    ratio = LR * (param_norm / update_norm)
            p[n] = p[n] - ratio * update
    return p


@pytest.fixture(scope="module")
def steps():
    return _grads(_model())


@pytest.fixture(scope="module")
def our_result(steps):
    return ours(steps)


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    for n in want:
        # The one known difference: torch's clip divides by (norm + 1e-6), TF and apex by the
        # norm, so a clipped gradient (and at norm 1.0 ours clips by 1 - 1e-6, they don't) is
        # 1e-6 smaller relative; each update of at most ~LR moves by ~1e-6 of it.
        torch.testing.assert_close(got[n], want[n], rtol=1e-6, atol=1e-6 * LR * len(NORMS),
                                   msg=lambda s, n=n: f"{n}: {s}")


def test_groups_agree_with_the_references_name_rules():
    """Which tensors decay (and adapt): ours by module type and rank, TF's by its regexes on
    TF names, NVIDIA's by its name list: the same set, and not a trivial one."""
    model = _model()
    opt, _ = build_optimizer(model, OptimConfig(name="lamb", weight_decay=WD), "cpu")
    names = {id(p): n for n, p in model.named_parameters()}
    ours_decayed = {names[id(p)] for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    tf = _tf_names(model)
    tf_decayed = {n for n in tf if not any(re.search(r, tf[n]) for r in TF_EXCLUDE)}
    nvidia_decayed = {n for n in tf if not any(k in n for k in NVIDIA_NO_DECAY)}
    assert ours_decayed == tf_decayed == nvidia_decayed
    assert 0 < len(ours_decayed) < len(tf)


def test_lamb_matches_the_mlcommons_tf_reference(steps, our_result):
    want = tf_reference(steps)
    _assert_same(our_result, want)
    start = dict(_model().named_parameters())
    moved = max(float((our_result[n] - start[n]).abs().max()) for n in start)
    assert moved > 1e-3  # seven steps moved the weights: the comparison is not of two no-ops


def test_lamb_matches_apex_fused_lamb_with_its_own_clip(steps, our_result):
    _assert_same(our_result, apex_fused_lamb(steps))


def test_the_comparison_sees_a_wrong_detail(steps, our_result):
    """The same references with one detail changed differ from ours: layer adaptation on
    biases and LayerNorm (TF), no clip (apex). So the equalities above are not loose."""
    for wrong in (tf_reference(steps, exclude_layer_adaptation=False), apex_fused_lamb(steps, max_grad_norm=math.inf)):
        assert any(not torch.allclose(our_result[n], wrong[n], rtol=1e-4, atol=1e-8) for n in wrong)
