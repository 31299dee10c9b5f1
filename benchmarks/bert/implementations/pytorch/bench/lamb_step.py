"""Time of one LAMB optimizer step, per variant of bert.optim.Lamb, on BERT-Large's parameter
list (every tensor of the real model, its two groups), optionally scaled down.

    flock /tmp/bench.lock python bench/lamb_step.py [--scale 4] [--reps 10] [--device cpu]
        [--variants foreach capturable compiled] [--backend inductor] [--json out.json]

A benchmark, not a test: it prints a table (and one JSON object with --json). ``--scale s``
divides hidden and intermediate sizes by s (the vocabulary too), keeping the 24 layers, so
the number of tensors (~400, what makes foreach LAMB launch-bound) is BERT-Large's while
the parameter count shrinks by ~s^2. Variants (bert/optim.py's docstring gives their
costs):

  foreach      Lamb(): Python-int steps, float lr (optim.impl=torch)
  capturable   Lamb(capturable=True): step counts and lr on the device, no host read
  compiled     Lamb(compile_backend=--backend): the capturable update under torch.compile
               (optim.impl=compiled); its first step, reported apart, includes the compile
  *-graph      on CUDA only: the capturable / compiled step captured once in a CUDA graph
               and replayed (what bert/step_graph.py does); capture time reported apart

Each variant gets the same model (same seed) and the same fixed gradients; steps are timed
one by one (device synchronized), the median of --reps reported, after one untimed step
(state allocation, compile). On CUDA ``kernels`` counts the device kernels of one step
(torch.profiler) and ``transient_mb`` is the step's peak allocation above what it started
with.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

if str(Path(__file__).resolve().parent.parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import machine, sync  # noqa: E402
from bert.config import ModelConfig  # noqa: E402
from bert.model import BertForPreTraining  # noqa: E402
from bert.optim import Lamb, param_groups  # noqa: E402

WD, LR = 0.01, 4.25e-4


def model_of(scale: int, device: torch.device) -> BertForPreTraining:
    large = ModelConfig()
    cfg = ModelConfig(vocab_size=large.vocab_size // scale, hidden_size=large.hidden_size // scale,
                      num_layers=large.num_layers, num_heads=max(1, large.num_heads // scale),
                      intermediate_size=large.intermediate_size // scale)
    torch.manual_seed(0)
    model = BertForPreTraining(cfg).to(device)
    gen = torch.Generator(device=device).manual_seed(1)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen, device=device) * 1e-3
    return model


def lamb(variant: str, model: torch.nn.Module, backend: str) -> Lamb:
    kw = {"foreach": {}, "capturable": {"capturable": True}, "compiled": {"compile_backend": backend}}
    return Lamb(param_groups(model, WD), lr=LR, weight_decay=WD, **kw[variant.removesuffix("-graph")])


def count_kernels(step) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def run_variant(variant: str, scale: int, reps: int, device: torch.device, backend: str) -> dict:
    model = model_of(scale, device)
    opt = lamb(variant, model, backend)
    t = time.perf_counter()
    opt.step()  # state allocated; compiled: traced and compiled here
    sync(device)
    out = {"variant": variant, "first_step_s": time.perf_counter() - t}
    step = opt.step
    if variant.endswith("-graph"):
        # Warm up on a side stream (as torch.cuda.graphs asks), then capture one step.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                opt.step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        t = time.perf_counter()
        with torch.cuda.graph(graph):
            opt.step()
        sync(device)
        out["capture_s"] = time.perf_counter() - t
        step = graph.replay
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        t = time.perf_counter()
        step()
        sync(device)
        times.append(time.perf_counter() - t)
        if device.type == "cuda":
            out["transient_mb"] = (torch.cuda.max_memory_allocated(device) - base) / 2**20
    out["step_ms"] = 1e3 * float(np.median(times))
    out["tensors"] = sum(1 for _ in model.parameters())
    out["params_m"] = sum(p.numel() for p in model.parameters()) / 1e6
    if device.type == "cuda":
        out["kernels"] = count_kernels(step)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", type=int, default=4)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backend", default="inductor", help="torch.compile backend of 'compiled'")
    ap.add_argument("--variants", nargs="+", default=["foreach", "capturable", "compiled"],
                    choices=["foreach", "capturable", "compiled", "capturable-graph", "compiled-graph"])
    ap.add_argument("--threads", type=int, default=0, help="intra-op threads (0: torch's default)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    result = {"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()}, "cases": []}
    print(f"{'variant':18s} {'tensors':>7s} {'params M':>8s} {'first s':>8s} {'step ms':>8s} extra")
    for v in args.variants:
        r = run_variant(v, args.scale, args.reps, device, args.backend)
        result["cases"].append(r)
        extra = {k: round(r[k], 2) for k in ("capture_s", "kernels", "transient_mb") if k in r}
        print(f"{v:18s} {r['tensors']:7d} {r['params_m']:8.1f} {r['first_step_s']:8.2f} {r['step_ms']:8.1f} {extra}")
        if args.json:  # rewritten after every case: a cut-short run keeps what it measured
            args.json.write_text(json.dumps(result, indent=1))
    result["machine"]["loadavg_end"] = machine()["loadavg"]
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
