"""bert.optim's graph-safe LAMB variants: ``Lamb(capturable=True)`` (step counts
and lr on the device) and ``optim.impl=compiled`` (the same update under torch.compile),
against the plain foreach ``Lamb`` that tests/unit/test_optim.py checks against a per-tensor
oracle, with the project's own LambdaLR schedule; checkpoints across the variants; no
recompile per step; and, for the capturable step, no host read and no host value that
changes between steps (what a captured CUDA graph would bake in).

On the CPU the compiled variant runs with the "aot_eager" backend (the same Dynamo graph,
functionalized by AOTAutograd, without inductor's C++ build), plus one small inductor case.
"""

from __future__ import annotations

import io
import json

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from bert import optim
from bert.config import ConfigError, OptimConfig, build_config
from bert.optim import Lamb, build_optimizer, build_scheduler, lr_at, param_groups
from optim_helpers import make_model, set_grads
from lamb_fused_helpers import fresh_dynamo  # noqa: F401 - an autouse fixture


# A schedule that changes lr every step: warmup from a negative start, then decay.
CFG = OptimConfig(name="lamb", lr=0.05, warmup_steps=3, start_warmup_step=-1, total_steps=8,
                  end_lr=1e-3, weight_decay=0.01, impl="torch")


STEPS = 6


VARIANTS = {  # name -> Lamb keyword arguments
    "plain": {},
    "capturable": {"capturable": True},
    "compiled": {"compile_backend": "aot_eager"},
    "capturable_group": {"capturable": True, "group_correction": True},
    "compiled_group": {"compile_backend": "aot_eager", "group_correction": True},
}


def set_grads_as(model, seed: int, none: tuple[str, ...] = ()) -> None:
    """test_optim's deterministic gradients, in the model's dtype; parameters named in
    ``none`` get no gradient (skipped by the step, their step count stays)."""
    src = make_model()
    set_grads(src, seed)
    grads = {n: p.grad for n, p in src.named_parameters() if p.grad is not None}
    for n, p in model.named_parameters():
        if n in grads:
            p.grad = None if n in none else grads[n].to(p.dtype)


def run(variant: str, dtype=torch.float64, steps=range(STEPS), model=None, opt=None, sched=None,
        skip_at=2):
    """``steps`` updates of a LAMB ``variant`` on test_optim's tiny model, lr from
    build_scheduler; dense.weight has no gradient in step ``skip_at``."""
    if model is None:
        model = make_model().to(dtype)
        opt = Lamb(param_groups(model, CFG.weight_decay), lr=CFG.lr, weight_decay=CFG.weight_decay,
                   **VARIANTS[variant])
        sched = build_scheduler(opt, CFG)
    for k in steps:
        set_grads_as(model, k, none=("dense.weight",) if k == skip_at else ())
        opt.step()
        sched.step()
    return model, opt, sched


def assert_same(a, b, tol):
    for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(pa, pb, rtol=tol, atol=tol, msg=lambda m: f"{n}: {m}")


@pytest.mark.parametrize("bias_correction", [True, False])
def test_capturable_equals_plain_in_float64(bias_correction):
    """Same arithmetic: both groups, the zero-initialized weight (trust ratio 1), a skipped
    parameter; the lr a tensor that LambdaLR fills in place; the step counts on device."""
    plain = make_model().double()
    cap = make_model().double()
    opts = [Lamb(param_groups(m, CFG.weight_decay), lr=CFG.lr, weight_decay=CFG.weight_decay,
                 bias_correction=bias_correction, **kw)
            for m, kw in ((plain, {}), (cap, {"capturable": True}))]
    scheds = [build_scheduler(o, CFG) for o in opts]
    lr_tensors = [g["lr"] for g in opts[1].param_groups]
    assert all(isinstance(t, torch.Tensor) and t.dim() == 0 for t in lr_tensors)
    assert lr_tensors[0] is not lr_tensors[1]  # one per group: LambdaLR fills each
    for k in range(STEPS):
        assert [float(g["lr"]) for g in opts[1].param_groups] == pytest.approx([lr_at(k, CFG)] * 2)
        for m, o, s in zip((plain, cap), opts, scheds):
            run("", steps=[k], model=m, opt=o, sched=s)
        assert_same(plain, cap, tol=1e-13)
        if k == 0:
            assert torch.count_nonzero(cap.zero.weight) == 0  # both norms 0: ratio 1, no move
    assert torch.count_nonzero(cap.zero.weight) > 0
    assert all(g["lr"] is t for g, t in zip(opts[1].param_groups, lr_tensors))  # filled in place
    for p, q in zip(cap.parameters(), plain.parameters()):
        if p in opts[1].state:
            s_cap, s_plain = opts[1].state[p], opts[0].state[q]
            assert s_cap["step"].dtype == torch.float32 and s_cap["step"].device == p.device
            assert s_cap["step"].item() == s_plain["step"] == (STEPS - 1 if p is cap.dense.weight else STEPS)
            torch.testing.assert_close(s_cap["exp_avg_sq"], s_plain["exp_avg_sq"], rtol=1e-13, atol=0)


def test_compiled_equals_plain_and_compiles_once():
    """fp32, the project's schedule; one graph for the whole step (both groups), and after
    the first step any recompile is an error (a Python-int step or float lr in the guards
    would recompile every step). Every parameter has a gradient in every step here: a step
    that skips one is another parameter list, hence another graph."""
    plain, _, _ = run("plain", torch.float32, skip_at=None)
    model, opt, sched = run("compiled", torch.float32, steps=[0])
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    with torch._dynamo.config.patch(error_on_recompile=True):
        run("", steps=range(1, STEPS), model=model, opt=opt, sched=sched, skip_at=None)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert_same(plain, model, tol=1e-6)


def _checkpoint(variant, steps):
    model, opt, sched = run(variant, torch.float32, steps=steps)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict(), "sched": sched.state_dict()}, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("src, dst", [("plain", "capturable"), ("capturable", "plain"),
                                      ("compiled", "plain"), ("plain", "compiled"),
                                      ("capturable", "capturable")])
def test_checkpoint_loads_across_variants(src, dst):
    """A checkpoint written by one variant resumes in another (bert/checkpoint.py's order:
    model, optimizer, scheduler) and continues as an uninterrupted plain run; a capturable
    optimizer that already holds state loads into the same tensors (a captured graph's
    addresses stay valid)."""
    whole, _, _ = run("plain", torch.float32)
    ckpt = _checkpoint(src, range(3))
    model = make_model(seed=123).float()
    opt = Lamb(param_groups(model, CFG.weight_decay), lr=CFG.lr, weight_decay=CFG.weight_decay, **VARIANTS[dst])
    sched = build_scheduler(opt, CFG)
    if opt.capturable:  # state and lr tensors exist before the load (as after a warm-up)
        run("", torch.float32, steps=[5], model=model, opt=opt, sched=sched)
        held = {p: [s["step"], s["exp_avg"], s["exp_avg_sq"]] for p, s in opt.state.items()}
        held_lr = [g["lr"] for g in opt.param_groups]
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["optim"])
    sched.load_state_dict(ckpt["sched"])
    for p, s in opt.state.items():
        if opt.capturable:
            assert isinstance(s["step"], torch.Tensor) and s["step"].dtype == torch.float32
            assert all(x is y for x, y in zip(held[p], [s["step"], s["exp_avg"], s["exp_avg_sq"]]))
        else:
            assert type(s["step"]) is int
        assert int(s["step"]) == (2 if p is model.dense.weight else 3)
    if opt.capturable:
        assert all(g["lr"] is t for g, t in zip(opt.param_groups, held_lr))
    assert [float(g["lr"]) for g in opt.param_groups] == pytest.approx([lr_at(3, CFG)] * 2)
    run("", torch.float32, steps=range(3, STEPS), model=model, opt=opt, sched=sched)
    assert_same(whole, model, tol=1e-6)


class _Trace(TorchDispatchMode):
    """Every aten op a step dispatches, with its non-tensor arguments (the host values a
    captured CUDA graph would freeze)."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not str(func).startswith("profiler."):  # torch.optim's record_function markers
            host = tuple(x for x in tree_leaves((args, kwargs)) if not isinstance(x, torch.Tensor))
            self.ops.append((str(func), host))
        return func(*args, **kwargs)


def _traces(variant):
    model, opt, sched = run(variant, torch.float32, steps=[0])  # state created
    out = []
    for k in (1, 3):  # different lr, different step counts, all parameters with gradients
        set_grads_as(model, k)
        with _Trace() as t:
            opt.step()
        sched.step()
        out.append(t.ops)
    return out


def test_capturable_step_has_no_host_read_and_replays_identically():
    """The capturable step reads nothing back to the host (no ``item``: aten's
    ``_local_scalar_dense``, no ``is_nonzero``) and dispatches the very same ops with the
    same host arguments on two different steps, so a graph captured on one replays the
    other. The plain step fails the second check (its lr and bias corrections are host
    floats): the check can tell."""
    a, b = _traces("capturable")
    names = {op for op, _ in a}
    assert not names & {"aten._local_scalar_dense.default", "aten.is_nonzero.default", "aten.item.default"}
    assert a == b and len(a) > 20
    plain_a, plain_b = _traces("plain")
    assert plain_a != plain_b


@pytest.mark.parametrize("variant", ["capturable_group", "compiled_group"])
def test_group_bias_correction_is_the_per_tensor_update_with_the_group_step_count(variant):
    """optim.lamb_bias_correction=group: while every parameter steps, the per-tensor
    variant's very update (float64, bit for bit); after a step that skips dense.weight, its
    update is the per-tensor one with its step count raised to the group's (apex FusedLAMB's
    one count per group), the other parameters' unchanged. Its divisions by the corrections
    take one 0-dim tensor for the whole list (the Tensor overload: one multi-tensor kernel
    on CUDA) where the per-tensor variant passes a list of them."""
    every, _, _ = run("capturable", skip_at=None)
    group, _, _ = run(variant, skip_at=None)
    assert_same(every, group, tol=0)
    per_tensor, opt, sched = run("capturable", steps=range(3))  # dense.weight skipped at step 2
    opt.state[per_tensor.dense.weight]["step"].add_(1)  # the group's count: 3 steps
    run("", steps=range(3, STEPS), model=per_tensor, opt=opt, sched=sched)
    grouped, _, _ = run(variant)
    plain, _, _ = run("capturable")
    assert_same(per_tensor, grouped, tol=1e-14)
    assert not torch.allclose(plain.dense.weight, grouped.dense.weight, rtol=1e-12, atol=0)
    assert torch.equal(plain.word_embeddings.weight, grouped.word_embeddings.weight)
    if variant == "capturable_group":
        ops = {op for op, _ in _traces(variant)[0]}
        assert "aten._foreach_div.Tensor" in ops and "aten._foreach_div.List" not in ops, sorted(ops)
        assert "aten._foreach_div.List" in {op for op, _ in _traces("capturable")[0]}


def test_build_optimizer_capturable_and_compiled_names():
    model = make_model()
    cases = {("lamb", "auto", False): "lamb:foreach", ("lamb", "auto", True): "lamb:foreach-capturable",
             ("lamb", "foreach", True): "lamb:foreach-capturable", ("lamb", "compiled", False): "lamb:compiled",
             ("lamb", "compiled", True): "lamb:compiled", ("adamw", "auto", True): "adamw:torch-fused-capturable",
             ("adam", "fused", True): "adam:torch-fused-capturable"}
    for (name, impl, capturable), expect in cases.items():
        opt, got = build_optimizer(model, OptimConfig(name=name, impl=impl), "cpu", capturable=capturable)
        assert got == expect, (name, impl, capturable)
        if name == "lamb":
            assert opt.capturable == (capturable or impl == "compiled")
            assert opt.compile_backend == ("inductor" if impl == "compiled" else None)
        if capturable:
            lrs = [g["lr"] for g in opt.param_groups]
            assert all(isinstance(t, torch.Tensor) for t in lrs) and lrs[0] is not lrs[1]
    with pytest.raises(ConfigError, match="optim.impl"):  # torch: capturable foreach is CUDA-only
        build_optimizer(model, OptimConfig(name="adamw", impl="foreach"), "cpu", capturable=True)
    with pytest.raises(ConfigError, match="optim.impl"):
        build_optimizer(model, OptimConfig(name="adamw", impl="compiled"), "cpu")
    with pytest.raises(ConfigError, match="optim.impl"):
        build_config({"optim.name": "adamw", "optim.impl": "compiled"})
    assert build_config({"optim.impl": "compiled"}).optim.impl == "compiled"


def test_capturable_never_takes_apex(monkeypatch):
    """apex's FusedLAMB keeps its step on the host: with capturable, auto passes it by and
    impl=apex is refused (no step runs: CPU tensors, only the choice is checked)."""
    fake = type("apex_optimizers", (), {"FusedLAMB": None, "FusedAdam": None})
    monkeypatch.setattr(optim, "_load_apex", lambda: fake)
    model = make_model()
    assert build_optimizer(model, OptimConfig(name="lamb"), "cuda", capturable=True)[1] == "lamb:foreach-capturable"
    assert build_optimizer(model, OptimConfig(name="adamw"), "cuda", capturable=True)[1] == "adamw:torch-fused-capturable"
    assert build_optimizer(model, OptimConfig(name="adamw", impl="foreach"), "cuda",
                           capturable=True)[1] == "adamw:torch-foreach-capturable"
    with pytest.raises(ConfigError, match="capturable"):
        build_optimizer(model, OptimConfig(name="lamb", impl="apex"), "cuda", capturable=True)


def test_capturable_adamw_equals_plain_adamw():
    """torch's AdamW with capturable=True and a tensor lr per group follows the same
    schedule and makes the same updates as the float-lr AdamW."""
    cfg = OptimConfig(name="adamw", lr=3e-3, warmup_steps=2, total_steps=6, weight_decay=0.03)
    models = [make_model(), make_model()]
    opts = [build_optimizer(m, cfg, "cpu", capturable=c)[0] for m, c in zip(models, (False, True))]
    scheds = [build_scheduler(o, cfg) for o in opts]
    lr0 = opts[1].param_groups[0]["lr"]
    for k in range(5):
        for m, o, s in zip(models, opts, scheds):
            set_grads(m, k)
            o.step()
            s.step()
    assert opts[1].param_groups[0]["lr"] is lr0
    assert_same(*models, tol=1e-6)


def test_bench_lamb_step_runs(tmp_path):
    """bench/lamb_step.py end to end on a tiny scale (the eager variants: a compile of its
    ~400 tensors takes minutes on this CPU): every tensor of BERT-Large, its JSON written."""
    from bench import lamb_step

    out = tmp_path / "lamb.json"
    result = lamb_step.main(["--scale", "64", "--reps", "1", "--variants", "foreach", "capturable",
                             "--json", str(out)])
    assert [c["variant"] for c in result["cases"]] == ["foreach", "capturable"]
    assert all(c["tensors"] == 398 and c["step_ms"] > 0 for c in result["cases"])
    assert json.loads(out.read_text())["cases"] == result["cases"]
