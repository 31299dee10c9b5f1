"""Where a training step's time goes, by kernel class: a few steps under ``torch.profiler``
and each kernel's time summed into GEMM, attention, elementwise, optimizer and
communication. On a GPU the classes are of the device kernels CUPTI saw; on a CPU (the
smoke) of the aten ops' self times.

A kernel's class is its name's (``classify``), but for everything launched inside the
optimizer's step (torch's ``Optimizer.step#<class>.step`` profiler range, which every
torch.optim.Optimizer subclass opens, ours and apex's too): that is the optimizer's,
whatever its name says. LAMB's per-tensor kernels (a division by each tensor's own bias
correction, the trust-ratio scaling) are plain ATen elementwise kernels by name.
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Any, Callable, Iterable

import torch

# First match wins; anything unmatched is elementwise (norms, activations, dropout, casts,
# copies, memsets, reductions: memory-bound work). Names: cuBLAS/CUTLASS (sm90_xmma, nvjet,
# cutlass, gemm), inductor's templates (triton_tem_..._mm), torchao's FP8 GEMM (_scaled_mm);
# our Triton attention (_fwd_kernel, _bwd_*), flash / memory-efficient SDPA (fmha, flash,
# attention); the foreach LAMB / AdamW kernels (multi_tensor, foreach) and compiled LAMB's
# fused kernels; NCCL. "lamb" not followed by "da": ATen's elementwise kernels are templates
# over lambdas, and their demangled names say so.
CLASSES: list[tuple[str, re.Pattern]] = [
    ("communication", re.compile(r"nccl|all_?reduce|reduce_?scatter|all_?gather", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|attn|_fwd_kernel|_bwd_(dkdv|dq)_kernel|_bwd_preprocess"
                             r"|_mask_kernel|scaled_dot_product", re.I)),
    ("gemm", re.compile(r"gemm|xmma|nvjet|cutlass|cublas|wgmma|_mm\b|\bmm\b|aten::(mm|addmm|bmm|baddbmm|matmul|linear)"
                        r"|scaled_mm|triton_tem_", re.I)),
    ("optimizer", re.compile(r"multi_tensor|foreach|lamb(?!da)|adam", re.I)),
]
ALL = ["gemm", "attention", "elementwise", "optimizer", "communication"]
# The profiler ranges whose kernels are the optimizer's (torch.optim.Optimizer's step and
# zero_grad hooks).
OPTIMIZER_RANGE = re.compile(r"^Optimizer\.(step|zero_grad)#")


def classify(name: str) -> str:
    """The kernel class of a CUDA kernel's or an aten op's name."""
    for cls, pattern in CLASSES:
        if pattern.search(name):
            return cls
    return "elementwise"


def breakdown(run_steps: Callable[[], None], steps: int, device: torch.device, top: int = 3) -> dict[str, Any]:
    """Profile ``run_steps()`` (``steps`` training steps, synchronised at the end) and sum the
    time per class (``summarise``)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        run_steps()
        if cuda:
            torch.cuda.synchronize(device)
    return summarise(rows(prof.events(), cuda), steps, cuda, top)


def in_optimizer(event: Any) -> bool:
    """Whether a CPU event runs inside the optimizer's profiler range (itself or a parent)."""
    while event is not None:
        if OPTIMIZER_RANGE.match(event.name):
            return True
        event = event.cpu_parent
    return False


def rows(events: Iterable[Any], cuda: bool) -> list[tuple[str, float, int, bool]]:
    """(name, microseconds, calls, inside the optimizer) per kernel name, from the profiler's
    ``events()``: on a GPU the device kernels' times, each kernel's share launched by a CPU
    op inside the optimizer's range (the op's ``kernels``) apart from the rest; on a CPU the
    aten ops' self CPU time, apart likewise."""
    us: dict[tuple[str, bool], float] = defaultdict(float)
    calls: dict[tuple[str, bool], int] = defaultdict(int)
    device, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    for e in events:
        if cuda and e.device_type == device:
            us[e.name, False] += e.time_range.elapsed_us()
            calls[e.name, False] += 1
        elif cuda and e.device_type == cpu and e.kernels and in_optimizer(e):
            for k in e.kernels:  # moved from the kernel's name class to the optimizer's
                us[k.name, True] += k.duration
                us[k.name, False] -= k.duration
                calls[k.name, True] += 1
                calls[k.name, False] -= 1
        elif not cuda and e.device_type == cpu and e.name.startswith("aten::"):
            us[e.name, in_optimizer(e)] += e.self_cpu_time_total
            calls[e.name, in_optimizer(e)] += 1
    return [(name, float(t), calls[name, opt], opt) for (name, opt), t in us.items()]


def summarise(kernels: Iterable[tuple[str, float, int, bool]], steps: int, cuda: bool, top: int = 3) -> dict[str, Any]:
    """Per class: ms per step, share of the classified time, and the ``top`` names of each
    class with their ms per step; the kernels (calls) per step. A row inside the optimizer is
    the optimizer's class (``rows``). Rows without time are left out."""
    per_class = {c: 0.0 for c in ALL}
    names: dict[str, dict[str, float]] = {c: {} for c in ALL}
    count = 0
    for name, us, calls, optimizer in kernels:
        if us <= 0:
            continue
        cls = "optimizer" if optimizer else classify(name)
        per_class[cls] += us / 1000 / steps
        names[cls][name] = names[cls].get(name, 0.0) + us / 1000 / steps
        count += calls
    total = sum(per_class.values())
    out: dict[str, Any] = {"steps": steps, "source": "CUDA kernels (CUPTI)" if cuda else "aten ops' CPU self time",
                           "ms_per_step": per_class, "total_ms_per_step": total,
                           "share": {c: (v / total if total else 0.0) for c, v in per_class.items()},
                           "kernels_per_step": count / steps,
                           "top": {c: sorted(n.items(), key=lambda kv: -kv[1])[:top] for c, n in names.items() if n}}
    if not total:
        out["note"] = "the profiler recorded no kernel time"
    return out
