"""bert.optim: LAMB against a plainly written per-tensor oracle, Adam(W) against torch's own
AdamW, parameter groups, and the warmup + polynomial-decay schedule (hand-computed values).
"""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from bert import optim
from bert.config import ConfigError, OptimConfig
from bert.optim import Lamb, build_optimizer, build_scheduler, lr_at, param_groups
from optim_helpers import make_model, set_grads


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def lamb_reference(model: nn.Module, groups_wd: dict[str, float], state: dict, lr: float,
                   betas=(0.9, 0.999), eps=1e-6, bias_correction=True) -> None:
    """One LAMB step written out per tensor in float64, independent of bert.optim."""
    b1, b2 = betas
    with torch.no_grad():
        for name, p in model.named_parameters():  # tied weight: listed once
            if p.grad is None:
                continue
            s = state.setdefault(name, {"t": 0, "m": torch.zeros_like(p, dtype=torch.float64),
                                        "v": torch.zeros_like(p, dtype=torch.float64)})
            s["t"] += 1
            t = s["t"]
            g = p.grad.double()
            w = p.double()
            wd = groups_wd[name]
            s["m"] = b1 * s["m"] + (1 - b1) * g
            s["v"] = b2 * s["v"] + (1 - b2) * g * g
            if bias_correction:
                m_hat = s["m"] / (1 - b1**t)
                v_hat = s["v"] / (1 - b2**t)
            else:
                m_hat, v_hat = s["m"], s["v"]
            u = m_hat / (v_hat.sqrt() + eps) + wd * w
            r = 1.0
            if wd != 0:
                wn, un = w.norm().item(), u.norm().item()
                if wn > 0 and un > 0:
                    r = wn / un
            p.copy_((w - lr * r * u).float())


def wd_by_name(model: nn.Module, wd: float) -> dict[str, float]:
    """What the groups should be, written from the names (the param_groups oracle)."""
    out = {}
    for name, p in model.named_parameters():
        no = name.endswith("bias") or "LayerNorm" in name
        out[name] = 0.0 if no else wd
    return out


def assert_params_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], tol=1e-6):
    assert a.keys() == b.keys()
    for n in a:
        torch.testing.assert_close(a[n], b[n], rtol=tol, atol=tol, msg=lambda m: f"{n}: {m}")


@pytest.mark.parametrize("bias_correction", [True, False])
def test_lamb_matches_per_tensor_reference_over_several_steps(bias_correction):
    wd, lrs = 0.01, [0.05, 0.02, 0.03, 0.01, 0.04]
    ours, ref = make_model(), make_model()
    opt = Lamb(param_groups(ours, wd), lr=lrs[0], betas=(0.9, 0.999), eps=1e-6,
               weight_decay=wd, bias_correction=bias_correction)
    ref_state: dict = {}
    ref_wd = wd_by_name(ref, wd)
    before = params_of(ours)
    for k, lr in enumerate(lrs):
        set_grads(ours, k)
        set_grads(ref, k)
        for g in opt.param_groups:
            g["lr"] = lr
        opt.step()
        lamb_reference(ref, ref_wd, ref_state, lr, bias_correction=bias_correction)
        assert_params_close(params_of(ours), params_of(ref))
        if k == 0:
            # One step already moved the decayed weights and LayerNorm, and the zero weight
            # with zero grad (both norms 0) stayed exactly 0.
            after = params_of(ours)
            assert not torch.equal(after["dense.weight"], before["dense.weight"])
            assert not torch.equal(after["LayerNorm.weight"], before["LayerNorm.weight"])
            assert torch.count_nonzero(after["zero.weight"]) == 0
    # The zero-initialized weight moved once it got a gradient (parameter norm 0 -> ratio 1).
    assert torch.count_nonzero(ours.zero.weight) > 0
    # Per-parameter integer step count, tied weight counted once.
    steps = [opt.state[p]["step"] for g in opt.param_groups for p in g["params"]]
    assert steps == [len(lrs)] * len(steps)


def test_lamb_trust_ratio_only_where_weight_decay():
    """Independent of the oracle: a LayerNorm weight's first step is the plain Adam step
    lr * sign(g) (|m_hat|/sqrt(v_hat) = 1), while a decayed weight's update has norm
    lr * ||p|| (the trust ratio rescales it)."""
    model, lr, wd = make_model(), 0.01, 0.01
    before = params_of(model)
    opt = Lamb(param_groups(model, wd), lr=lr, weight_decay=wd, eps=0.0)
    set_grads(model, 1)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    opt.step()
    after = params_of(model)
    delta_ln = after["LayerNorm.weight"] - before["LayerNorm.weight"]
    torch.testing.assert_close(delta_ln, -lr * torch.sign(grads["LayerNorm.weight"]))
    delta_w = after["dense.weight"] - before["dense.weight"]
    torch.testing.assert_close(delta_w.norm(), lr * before["dense.weight"].norm())


def test_lamb_skips_params_without_grad():
    model = make_model()
    opt = Lamb(param_groups(model, 0.01), lr=0.01)
    set_grads(model, 1)
    model.dense.weight.grad = None
    w = model.dense.weight.detach().clone()
    opt.step()
    assert torch.equal(model.dense.weight, w)
    assert model.dense.weight not in opt.state


def _run_steps(model, opt, seeds, sched=None):
    for s in seeds:
        set_grads(model, s)
        opt.step()
        if sched is not None:
            sched.step()


@pytest.mark.parametrize("name", ["lamb", "adamw"])
def test_state_dict_round_trip(name):
    cfg = OptimConfig(name=name, lr=0.02, warmup_steps=3, total_steps=10, impl="torch")
    a = make_model()
    opt_a, _ = build_optimizer(a, cfg, "cpu")
    sched_a = build_scheduler(opt_a, cfg)
    _run_steps(a, opt_a, [0, 1], sched_a)

    buf = io.BytesIO()
    torch.save({"model": a.state_dict(), "optim": opt_a.state_dict(),
                "sched": sched_a.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)

    b = make_model(seed=123)  # different init: everything must come from the checkpoint
    b.load_state_dict(ckpt["model"])
    opt_b, _ = build_optimizer(b, cfg, "cpu")
    sched_b = build_scheduler(opt_b, cfg)
    opt_b.load_state_dict(ckpt["optim"])
    sched_b.load_state_dict(ckpt["sched"])
    if name == "lamb":
        assert all(isinstance(s["step"], int) and s["step"] == 2 for s in opt_b.state.values())

    _run_steps(a, opt_a, [2, 3, 4], sched_a)
    _run_steps(b, opt_b, [2, 3, 4], sched_b)
    for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), n
    assert opt_a.param_groups[0]["lr"] == opt_b.param_groups[0]["lr"]


def step_beside_torch_adamw(ours, opt, ref, cfg, steps=5):
    """``steps`` updates of ``opt`` on ``ours`` and of torch's plain per-tensor AdamW on
    ``ref`` (same groups, same gradients)."""
    ref_opt = torch.optim.AdamW(param_groups(ref, cfg.weight_decay), lr=cfg.lr,
                                betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, foreach=False)
    for k in range(steps):
        set_grads(ours, k)
        set_grads(ref, k)
        opt.step()
        ref_opt.step()


@pytest.mark.parametrize("name", ["adamw", "adam"])
def test_adamw_matches_torch_plain_adamw(name):
    cfg = OptimConfig(name=name, lr=3e-3, beta1=0.8, beta2=0.817, eps=1e-9,
                      weight_decay=0.00289 * 10, impl="auto")
    ours, ref = make_model(), make_model()
    opt, impl = build_optimizer(ours, cfg, "cpu")
    assert impl == f"{name}:torch-fused"
    step_beside_torch_adamw(ours, opt, ref, cfg)
    assert_params_close(params_of(ours), params_of(ref))
    # Decoupled decay reached the decayed weights and not the LayerNorm/bias ones.
    wds = {id(p): g["weight_decay"] for g in opt.param_groups for p in g["params"]}
    assert wds[id(ours.dense.weight)] == cfg.weight_decay
    assert wds[id(ours.LayerNorm.weight)] == 0.0


def test_param_groups_split_and_cover_each_param_once():
    model, wd = make_model(), 0.01
    groups = param_groups(model, wd)
    assert [g["weight_decay"] for g in groups] == [wd, 0.0]
    listed = [p for g in groups for p in g["params"]]
    assert len(listed) == len({id(p) for p in listed})  # no duplicates (tied weight once)
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    assert {id(p) for p in listed} == trainable
    assert id(model.frozen) not in {id(p) for p in listed}
    names = {id(p): n for n, p in model.named_parameters()}
    got = {names[id(p)]: g["weight_decay"] for g in groups for p in g["params"]}
    assert got == {n: w for n, w in wd_by_name(model, wd).items() if n != "frozen"}
    assert got["word_embeddings.weight"] == wd  # embedding (and tied decoder) decayed
    assert got["decoder.bias"] == 0.0


def test_param_groups_detects_layernorm_by_type_and_by_name():
    class Named(nn.Module):  # a LayerNorm that is not nn.LayerNorm, found by its name
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(4))
            self.bias = nn.Parameter(torch.zeros(4))

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm((2, 4))  # 2-D gain: found only by its type
            self.LayerNorm = Named()
            self.scale = nn.Parameter(torch.ones(4))  # 1-D, neither bias nor LayerNorm
            self.proj = nn.Linear(4, 4)

    m = M()
    groups = param_groups(m, 0.1)
    decayed = {id(p) for p in groups[0]["params"]}
    assert decayed == {id(m.proj.weight)}
    assert len(groups[1]["params"]) == 6


def test_schedule_warmup_then_linear_decay_to_end_lr():
    cfg = OptimConfig(lr=1e-3, warmup_steps=10, start_warmup_step=0, total_steps=100,
                      end_lr=1e-4, decay_power=1.0)
    assert lr_at(0, cfg) == 0.0
    assert lr_at(5, cfg) == pytest.approx(5e-4)
    assert lr_at(9, cfg) == pytest.approx(9e-4)
    # End of warmup: the decay branch, already 10% down the line from 1e-3 to 1e-4.
    assert lr_at(10, cfg) == pytest.approx(9.1e-4)
    assert lr_at(55, cfg) == pytest.approx(5.05e-4)
    assert lr_at(100, cfg) == pytest.approx(1e-4)
    assert lr_at(250, cfg) == pytest.approx(1e-4)


def test_schedule_no_warmup_and_power_two():
    cfg = OptimConfig(lr=2e-3, warmup_steps=0, total_steps=10, end_lr=0.0, decay_power=2.0)
    assert lr_at(0, cfg) == pytest.approx(2e-3)
    assert lr_at(5, cfg) == pytest.approx(5e-4)  # 2e-3 * 0.5**2
    assert lr_at(10, cfg) == 0.0
    assert lr_at(11, cfg) == 0.0


def test_schedule_negative_start_warmup_step():
    cfg = OptimConfig(lr=1e-3, warmup_steps=100, start_warmup_step=-25, total_steps=1000)
    assert lr_at(0, cfg) == pytest.approx(2.5e-4)
    assert lr_at(74, cfg) == pytest.approx(9.9e-4)
    assert lr_at(75, cfg) == pytest.approx(9.25e-4)  # decay uses the step itself: 1 - 75/1000
    # The paper's recipe: warmup 82 from -16, linear to 4.95e-5 at 179.
    paper = OptimConfig(lr=3.93e-4, warmup_steps=82, start_warmup_step=-16, total_steps=179,
                        end_lr=4.95e-5)
    assert lr_at(0, paper) == pytest.approx(3.93e-4 * 16 / 82)
    assert lr_at(66, paper) == pytest.approx((3.93e-4 - 4.95e-5) * (1 - 66 / 179) + 4.95e-5)
    assert lr_at(179, paper) == pytest.approx(4.95e-5)


def test_schedule_positive_start_holds_zero_before_start():
    cfg = OptimConfig(lr=1e-3, warmup_steps=10, start_warmup_step=5, total_steps=100)
    assert lr_at(0, cfg) == 0.0
    assert lr_at(10, cfg) == pytest.approx(5e-4)


@pytest.mark.parametrize("name", ["lamb", "adamw"])
def test_scheduler_drives_optimizer_lr(name):
    cfg = OptimConfig(name=name, lr=1e-3, warmup_steps=4, start_warmup_step=-1,
                      total_steps=12, end_lr=1e-5, impl="torch")
    model = make_model()
    opt, _ = build_optimizer(model, cfg, "cpu")
    sched = build_scheduler(opt, cfg)
    seen = []
    for k in range(15):
        for g in opt.param_groups:
            assert g["lr"] == pytest.approx(lr_at(k, cfg), rel=1e-12, abs=1e-15)
        seen.append(opt.param_groups[0]["lr"])
        set_grads(model, k)
        opt.step()
        sched.step()
    assert seen[0] == pytest.approx(2.5e-4)
    assert seen[3] == pytest.approx((1e-3 - 1e-5) * (1 - 3 / 12) + 1e-5)  # decay began
    assert seen[-1] == pytest.approx(1e-5)


def test_build_optimizer_cpu_reports_foreach_and_fused():
    model = make_model()
    opt, impl = build_optimizer(model, OptimConfig(name="lamb"), "cpu")
    assert impl == "lamb:foreach" and isinstance(opt, Lamb)
    opt, impl = build_optimizer(model, OptimConfig(name="adamw"), "cpu")
    assert impl == "adamw:torch-fused"
    assert isinstance(opt, torch.optim.AdamW) and opt.defaults["fused"] is True


def test_impl_apex_without_apex_raises(monkeypatch):
    monkeypatch.setattr(optim, "_load_apex", lambda: None)
    model = make_model()
    for name in ("lamb", "adamw"):
        with pytest.raises(ConfigError, match="optim.impl"):
            build_optimizer(model, OptimConfig(name=name, impl="apex"), "cuda")
    with pytest.raises(ConfigError, match="need CUDA"):  # even with apex, CPU cannot
        build_optimizer(model, OptimConfig(name="lamb", impl="apex"), "cpu")


def test_auto_takes_apex_when_present(monkeypatch):
    """auto + CUDA + apex -> FusedLAMB with clipping off (inf, not 0) and the groups."""
    made = {}

    class FakeFused(torch.optim.Optimizer):
        def __init__(self, params, **kw):
            made.update(kw)
            super().__init__(params, {k: v for k, v in kw.items() if k != "max_grad_norm"})

    fake = type("apex_optimizers", (), {"FusedLAMB": FakeFused, "FusedAdam": FakeFused})
    monkeypatch.setattr(optim, "_load_apex", lambda: fake)
    model = make_model()
    opt, impl = build_optimizer(model, OptimConfig(name="lamb"), "cuda")
    assert impl == "lamb:apex-fused"
    assert made["max_grad_norm"] == float("inf") and made["use_nvlamb"] is False
    assert [g["weight_decay"] for g in opt.param_groups] == [0.01, 0.0]
    _, impl = build_optimizer(model, OptimConfig(name="adam"), "cuda")
    assert impl == "adam:apex-fused" and made["adam_w_mode"] is True
    _, impl = build_optimizer(model, OptimConfig(name="lamb", impl="torch"), "cuda")
    assert impl == "lamb:foreach"


@pytest.mark.parametrize("impl, expect", [("fused", "adamw:torch-fused"), ("foreach", "adamw:torch-foreach"),
                                          ("torch", "adamw:torch-fused")])
def test_adamw_implementations_agree_on_cpu(impl, expect):
    """Each AdamW implementation that runs on CPU (torch's fused kernel included) makes the
    same update as torch's plain per-tensor AdamW on the same groups."""
    cfg = OptimConfig(name="adamw", lr=3e-3, beta1=0.8, beta2=0.817, eps=1e-9, weight_decay=0.03, impl=impl)
    ours, ref = make_model(), make_model()
    opt, name = build_optimizer(ours, cfg, "cpu")
    assert name == expect and opt.defaults[expect.rsplit("-", 1)[1]] is True
    step_beside_torch_adamw(ours, opt, ref, cfg)
    assert_params_close(params_of(ours), params_of(ref), tol=1e-6)


def test_impl_choices_on_cuda_without_apex(monkeypatch):
    """What each impl picks on CUDA when apex is absent (built on CPU tensors: only the
    choice is checked, no step runs)."""
    monkeypatch.setattr(optim, "_load_apex", lambda: None)
    model = make_model()
    picks = {impl: build_optimizer(model, OptimConfig(name="adamw", impl=impl), "cuda")[1]
             for impl in ("auto", "torch", "fused", "foreach")}
    assert picks == {"auto": "adamw:torch-fused", "torch": "adamw:torch-fused",
                     "fused": "adamw:torch-fused", "foreach": "adamw:torch-foreach"}
    assert build_optimizer(model, OptimConfig(name="lamb", impl="foreach"), "cuda")[1] == "lamb:foreach"
    with pytest.raises(ConfigError, match="optim.impl"):
        build_optimizer(model, OptimConfig(name="lamb", impl="fused"), "cpu")
