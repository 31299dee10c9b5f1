"""Where a training step's time goes, by kernel class: a few steps under ``torch.profiler``
and each kernel's time summed into GEMM, attention, elementwise, optimizer and
communication. On a GPU the classes are of the device kernels CUPTI saw (graph replays
included); on a CPU (the smoke) of the aten ops' self times."""

from __future__ import annotations

import re
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
    return summarise(rows(prof.key_averages(), cuda), steps, cuda, top)


def rows(averages: Iterable[Any], cuda: bool) -> list[tuple[str, float, int]]:
    """(name, self microseconds, calls) of what is classified, from the profiler's
    ``key_averages()``: on a GPU the device kernels (CUPTI's; a graph's replayed kernels
    among them), on a CPU the aten ops' self CPU time."""
    out = []
    for e in averages:
        if cuda:
            if e.device_type != torch.autograd.DeviceType.CUDA:
                continue
            us = e.self_device_time_total
        else:
            if not e.key.startswith("aten::"):
                continue
            us = e.self_cpu_time_total
        out.append((e.key, float(us), int(e.count)))
    return out


def summarise(kernels: Iterable[tuple[str, float, int]], steps: int, cuda: bool, top: int = 3) -> dict[str, Any]:
    """Per class: ms per step, share of the classified time, and the ``top`` names of each
    class with their ms per step; the kernels (calls) per step. Rows without time are left out."""
    per_class = {c: 0.0 for c in ALL}
    names: dict[str, dict[str, float]] = {c: {} for c in ALL}
    count = 0
    for name, us, calls in kernels:
        if us <= 0:
            continue
        cls = classify(name)
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
