"""BERT-Large phase 2 (seq 512) train-step throughput on one GPU, each technique on and off,
plus the GPU path end to end once: the prepared device run of issue 14.

    bench/h200.sh                                                        # on the device (BENCHMARKS.md 3)
    python bench/gpu_bert_large.py --out results/gpu.json --commit SHA   # on a GPU, ~5-6 min
    python bench/gpu_bert_large.py --cpu-smoke --out /tmp/smoke.json     # every path, tiny, CPU
    python bench/gpu_bert_large.py --table results/gpu.json              # the markdown table of a run

**Cases are config overrides.** Each case is a dict of dotted keys applied with the trainer's
own ``bert.config.build_config`` and built by the trainer itself (``bert.trainer.Trainer``:
model, precision, gradient sync with global-norm clip 1.0, ``bert.optim.build_optimizer``,
schedule), then run with the trainer's own step, prepared by ``Trainer.prepare`` (warm-up on
synthetic batches and, with ``run.cuda_graphs``, the captured step of bert/step_graph.py). A
new speed feature is therefore a new
case, or ``--case NAME:key=value,...`` on the command line, never new code. A case whose key
or value this tree does not know (``build_config`` raises ``ConfigError``), or that the
trainer refuses at build time (``run.cuda_graphs`` or Triton attention on a CPU), is recorded as
``status: "skipped: ..."`` with the reason, so the script runs on every branch. Keys under
``bench.`` are the script's own (``bench.compile=BACKEND``: the whole model under
``torch.compile``, dynamic shapes, as the 2026-11-29 run measured it).

Batches are drawn from the MLPerf Wikipedia length histogram (seq 512, 15% masked, at most
76; the same samples for every case of one local batch), collated by the trainer's collate
for the case's layout (with ``data.token_budgets``: the static token budget's), moved to the
device before timing, and cycled. Per case: ``--warmup`` untimed steps (at least one pass
over the cycle, so no shape is first seen, and compiled, inside the timing), then ``--steps``
timed steps.

Per case the JSON holds ``case``, ``local_batch``, ``status``, ``seq_per_s``, useful
``tokens_per_s``, ``step_ms``, ``mfu`` (useful model FLOP/s: real tokens, per-sequence
attention, MLM head on masked rows, training = 3x forward, over the bf16 GEMM peak measured
at the start of the same run), ``peak_mem_gb`` (CUDA peak allocated), ``optimizer_step_ms``
(``optimizer.step()`` alone on random gradients, median of 5, CUDA events), the optimizer's
class and ``param_groups[0]``'s ``fused``/``foreach``/``capturable`` flags, the attention
backend, the step kind (eager or graphed), the token padding a budget adds, and the time
spent before the timed steps (compile, warm-up, capture). The file holds ``device_name``,
``commit``, ``gemm_peak_tflops``, the torch / CUDA / cuDNN / Triton versions and ``checks``:

- ``fp16``: a few steps of the trainer's step with ``precision.dtype=fp16`` (dynamic loss
  scaling) at the small local batch: per step the loss, the scale and whether it was skipped;
- ``demo``: config_CPU_1x2.sh's model and data (bert/demo_data.py, as demo.sh makes them)
  trained on this device by ``run_and_time.sh`` in one process (LAUNCHER=task, the demo's
  global batch 64 as one local batch) to 0.720, then the MLPerf 5.0.0 compliance checker on
  its log: verdict, time to target (run_stop - run_start), steps. With ``--cpu-smoke`` it
  trains 3 steps only (the target is not expected; the suite trains the demo elsewhere).

The checks run first, then the cases (``plan`` says why and in which order). The JSON file
is rewritten after every task, so a run cut short by the device window keeps what it
measured; ``--budget-s`` skips what would start after it (``skipped: budget``),
``--task-limit-s`` stops a task that runs long (a compile) and ``--limit-s`` keeps every
task inside the wrapper's hard limit (both recorded as ``error: stopped at its time
limit``), and ``--only`` reruns chosen names. An out-of-memory case is recorded and the run
goes on.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import importlib.metadata
import importlib.util
import json
import logging
import math
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common  # noqa: E402
from bert import flops  # noqa: E402
from bert import config_script, loader  # noqa: E402
from bert.mlperf_log import read_events  # noqa: E402
from bert.evaluate import mlm_accuracy  # noqa: E402
from bert.trainer import Trainer, train_layout, train_step  # noqa: E402
from bert.config import Config, ConfigError, ModelConfig, build_config  # noqa: E402
from bert.distributed import DistEnv  # noqa: E402

PKG = common.PKG
SINGLE = DistEnv(rank=0, world_size=1, local_rank=0, master_addr="127.0.0.1", master_port=29500, launcher="single")

# The tiny model of --cpu-smoke (BERT-Large is the config's default and needs no override).
# Hidden 96 and intermediate 160 are no budget rung (multiples of 64): a token count equal
# to a static size would share its symbol in dynamo's shape analysis and be specialised.
SMOKE_MODEL = {"model.vocab_size": "1000", "model.hidden_size": "96", "model.num_layers": "2",
               "model.num_heads": "4", "model.intermediate_size": "160", "model.max_position_embeddings": "64",
               "eval.batch_size": "8"}
# --cpu-smoke: what stands in for a CUDA-only value (the case records the swap): the math
# backend for Triton's kernel (varlen without a host read, like Triton's), eager steps for
# CUDA graphs. The rest of the fast stack -- budgets, warm-ups, the compiled layers -- runs.
SMOKE_STAND_INS = {("model.attention_backend", "triton"): "math", ("run.cuda_graphs", "true"): "false"}

# The fast stack of issue 14 (keys from parts A, B, C and E; a tree without one skips the
# case): Triton varlen attention with dropout, static token budgets, the step replayed as CUDA
# graphs after a warm-up before run_start (LAMB capturable: its foreach kernels replay from
# the graph without launch cost), inductor per encoder layer. Compiled LAMB is an ablation,
# not in the head cases: its first inductor compile (153 s cold on the CPU for BERT-Large's
# 398 tensors, bench/lamb_step.py) could eat the head cases' window on a fresh machine.
FAST = {"model.attention_backend": "triton", "data.token_budgets": "auto",
        "run.cuda_graphs": "true", "run.warmup_steps": "1", "model.compile_layers": "true"}

# The stack the 2026-11-29 run measured (207 seq/s at local batch 16): SDPA on the padded
# grid, the config's LAMB (foreach without apex), eager. The "default_*" cases take whatever
# the tree's defaults are (attention auto: SDPA on CUDA without flash-attn; triton and
# nested are asked for by name until this run's attention check has passed).
BASELINE = {"model.attention_backend": "sdpa"}


@dataclasses.dataclass
class Case:
    """A throughput case: dotted config overrides (``run.local_batch_size`` included) and
    the script's own ``bench.*`` keys; ``est_s`` = its expected seconds (cold compile
    caches, warm ones) for the plan's time table."""

    name: str
    overrides: dict[str, str]
    est_s: tuple[float, float] = (40.0, 30.0)

    @property
    def batch(self) -> int:
        return int(self.overrides["run.local_batch_size"])


@dataclasses.dataclass
class Check:
    """One of the extra checks (``attention``, ``attention_blocks``, ``fp16``, ``demo``);
    results go under ``checks``."""

    name: str
    est_s: tuple[float, float] = (20.0, 15.0)


def _case(name: str, batch: int, est: tuple[float, float] = (40.0, 30.0), **groups: dict[str, str]) -> Case:
    over: dict[str, str] = {}
    for g in groups.values():
        over.update(g)
    over["run.local_batch_size"] = str(batch)
    return Case(f"{name}_b{batch}", over, est)


def without(base: dict[str, str], *keys: str, **changes: str) -> dict[str, str]:
    out = {k: v for k, v in base.items() if k not in keys}
    out.update({k.replace("__", "."): v for k, v in changes.items()})
    return out


# Expected seconds per task (cold caches, warm caches), H200 host, for the time table the
# run prints before it starts. From what the pieces cost where measured and what the
# device's CUDA/Triton/inductor compiles are known to cost (bench/results/ records each
# task's true seconds, ``task_s``, so the next run's table can be corrected):
# - a case on eager BERT-Large at b16: building the model on the GPU (~2 s), 8 untimed +
#   20 timed steps (~0.1 s each), the optimizer timing: ~15 s;
# - the fast stack's first case: inductor on one encoder layer, forward and backward, and
#   its no-grad twin for evaluation (dynamic shapes: once for every rung), plus one graph
#   capture per rung (3 side-stream passes + the capture): ~150 s cold, ~40 s with the
#   carried inductor/Triton caches (dynamo and AOT still trace; inductor loads);
# - a further case of the same attention backend reuses the compiled layer: its graphs
#   and steps only (~40 s at b96); another backend compiles its own layer (~90 s cold);
# - compiled LAMB: inductor over BERT-Large's 398 tensors, 153 s cold on the 2-core CPU
#   (bench/lamb_step.py): ~150 s cold on the device's host, ~45 s warm.
EST_EAGER_SMALL = (15.0, 15.0)
EST_FAST_FIRST = (150.0, 40.0)
EST_SAME_COMPILE_BIG = (45.0, 40.0)
EST_NEW_COMPILE_BIG = (90.0, 45.0)
EST_COMPILED_LAMB = (150.0, 50.0)


def levers(big: int) -> list[Case]:
    """Issue 26 part 2's levers on the fast stack at ``big``, for the ``decide`` list: what
    decides the defaults of ``model.fused_qkv`` (on: the case turns it off; the layer
    compiles anew) and ``model.vocab_pad_multiple`` (64: the case runs the 30,522 rows
    unpadded; the compiled layer is reused), then FP8 GEMMs in the encoder (bert/fp8.py;
    torchao, carried by ``h200.sh prepare``) with each scaling, a layer compile each. The
    FP8 cases come last: torchao's conversion patches inductor's Triton min/max codegen
    for the rest of the process (numerically the same; bert/fp8.py)."""
    return [_case("fast_no_fused_qkv", big, EST_NEW_COMPILE_BIG, f=without(FAST, model__fused_qkv="false")),
            _case("fast_vocab_unpadded", big, EST_SAME_COMPILE_BIG, f=without(FAST, model__vocab_pad_multiple="1")),
            _case("fast_fp8_tensorwise", big, EST_NEW_COMPILE_BIG, f=without(FAST, precision__fp8="tensorwise")),
            _case("fast_fp8_rowwise", big, EST_NEW_COMPILE_BIG, f=without(FAST, precision__fp8="rowwise"))]


def plan(small: int, big: int, old: int, fast_sweep: list[int], default_sweep: list[int]) -> list[Case | Check]:
    """Everything the run does, in this order (a run cut short keeps the head):

    1. ``attention``: the Triton and nested kernels against a float32 reference, each in
       its own try, at a ladder rung's token count (the kernels compiled here are the ones
       the cases reuse);
    2. ``baseline`` at ``small``: the 2026-11-29 stack, this run's own baseline;
    3. ``fast`` (``FAST``) at ``small`` (16) and ``big`` (96, the best <= 96 the issue asks);
    4. the cases that decide the GPU defaults (``decide``): the attention kernels' block
       sizes (``attention_blocks``), CUDA graphs, the attention backend, LAMB's variant,
       the per-layer compile, then issue 26's levers (``levers``: the fused QKV projection,
       the padded vocabulary, FP8 GEMMs), at ``big``. **A new lever is a new entry here** (a
       ``_case`` with its overrides and expected seconds), ordered by what a default depends on;
    5. ``fp16`` and ``demo``, the checks that decide no default;
    6. the rest, run when time is left (a rerun with ``--only`` picks them): the other
       ablations, the AdamW pair, the sweeps, the 2026-11-29 cases at ``old`` (32).
    """
    head: list[Case | Check] = [
        Check("attention", (30.0, 10.0)),
        _case("baseline", small, EST_EAGER_SMALL, a=BASELINE),
        _case("fast", small, EST_FAST_FIRST, f=FAST),
        _case("fast", big, EST_SAME_COMPILE_BIG, f=FAST)]
    decide: list[Case | Check] = [
        Check("attention_blocks", (30.0, 12.0)),
        _case("fast_no_graphs", big, EST_SAME_COMPILE_BIG, f=without(FAST, run__cuda_graphs="false")),
        # The other varlen kernel with dropout (SDPA on nested jagged tensors).
        _case("fast_nested", big, EST_NEW_COMPILE_BIG, f=without(FAST, model__attention_backend="nested")),
        _case("fast_compiled_lamb", big, EST_COMPILED_LAMB, f=without(FAST, optim__impl="compiled")),
        _case("fast_no_compile_layers", big, (40.0, 40.0), f=without(FAST, model__compile_layers="false")),
        *levers(big),
    ]
    checks: list[Case | Check] = [Check("fp16", (20.0, 15.0)), Check("demo", (60.0, 50.0))]
    rest: list[Case | Check] = [
        # The padded-grid SDPA fallback the 2026-11-29 run used, inside the fast stack.
        _case("fast_sdpa", big, EST_NEW_COMPILE_BIG, f=without(FAST, model__attention_backend="sdpa")),
        # CUDA graphs need static shapes: without budgets the graphs go too.
        _case("fast_no_budget_no_graphs", big, EST_SAME_COMPILE_BIG,
              f=without(FAST, data__token_budgets="", run__cuda_graphs="false")),
        # One feature on the default stack: what a static budget costs or saves alone (its
        # padded tokens, its warm-up), and LAMB compiled alone.
        _case("default_budget", big, (30.0, 30.0), o={"data.token_budgets": "auto", "run.warmup_steps": "1"}),
        _case("default_compiled_lamb", big, EST_COMPILED_LAMB, o={"optim.impl": "compiled"}),
        _case("adamw_fused", old, EST_EAGER_SMALL, o={"optim.name": "adamw", "optim.impl": "fused"}),
        _case("adamw_foreach", old, EST_EAGER_SMALL, o={"optim.name": "adamw", "optim.impl": "foreach"}),
        *[_case("fast", b, EST_SAME_COMPILE_BIG, f=FAST) for b in fast_sweep],
        *[_case("default", b, (20.0, 20.0)) for b in default_sweep],
        _case("padded", old, (20.0, 20.0), m={"model.unpad": "false"}),
        _case("lamb_foreach", old, EST_EAGER_SMALL, o={"optim.impl": "foreach"}),
        _case("compiled", old, EST_NEW_COMPILE_BIG, b={"bench.compile": "inductor"}),
    ]
    out: list[Case | Check] = []
    seen: set[str] = set()
    for task in head + decide + checks + rest:
        if task.name not in seen:  # the smoke's small batches repeat names: run each once
            seen.add(task.name)
            out.append(task)
    return out


def task_name(task: Case | Check) -> str:
    return f"check_{task.name}" if isinstance(task, Check) else task.name


def time_table(tasks: list[Case | Check], warm: bool, budget_s: float, limit_s: float) -> tuple[str, list[str]]:
    """The plan's expected seconds, task by task and summed, for this cache state, and the
    tasks expected to start after ``budget_s`` (or to end past ``limit_s``): printed before
    the run starts, so a reader knows what the window will hold."""
    col = 1 if warm else 0
    lines = [f"plan ({'warm' if warm else 'cold'} compile caches): expected seconds per task, and summed",
             f"  {'task':34s} {'est':>6s} {'sum':>7s}"]
    t, late = 0.0, []
    for task in tasks:
        est = task.est_s[col]
        starts = t
        t += est
        over = starts > budget_s or (limit_s and t > limit_s)
        if over:
            late.append(task_name(task))
        lines.append(f"  {task_name(task):34s} {est:6.0f} {t:7.0f}{'  (past the window)' if over else ''}")
    lines.append(f"  expected in all: {t:.0f} s; the window: start nothing after {budget_s:.0f} s"
                 + (f", stop at {limit_s:.0f} s" if limit_s else "") + f"; {len(late)} task(s) expected past it")
    return "\n".join(lines), late


def parse_case(text: str) -> Case:
    """``NAME:key=value,key=value`` (``run.local_batch_size`` required) -> Case."""
    name, sep, rest = text.partition(":")
    over = dict(kv.split("=", 1) for kv in rest.split(",") if kv)
    if not sep or not name or "run.local_batch_size" not in over:
        raise argparse.ArgumentTypeError(f"--case {text!r}: expected NAME:run.local_batch_size=N[,key=value...]")
    return Case(name, over)


# ---------------------------------------------------------------- building a case


def case_config(case: Case, args) -> tuple[Config, dict[str, str]]:
    """The trainer's config of ``case`` (raises ConfigError for a key or value this tree
    does not know) and the ``bench.*`` keys, apart."""
    base = {"run.seed": str(args.seed), "run.device": args.device_type, "data.max_seq_length": str(args.seq_len),
            "data.max_predictions_per_seq": str(args.max_pred)}
    if args.cpu_smoke:
        base.update(SMOKE_MODEL)
    over = {**base, **{k: v for k, v in case.overrides.items() if not k.startswith("bench.")}}
    if args.cpu_smoke:  # the CUDA-only keys' CPU stand-ins, so the smoke runs the rest of the path
        over.update({k: SMOKE_STAND_INS[(k, v)] for k, v in over.items() if (k, v) in SMOKE_STAND_INS})
    own = {k: v for k, v in case.overrides.items() if k.startswith("bench.")}
    unknown = set(own) - {"bench.compile"}
    if unknown:
        raise ValueError(f"case {case.name}: unknown bench key(s) {sorted(unknown)}")
    return build_config(over), own


def collate_for(cfg: Config) -> tuple[Callable[[list], dict], Any]:
    """The trainer's training collate for ``cfg`` on one device, as ``bert.loader.train_batches``
    builds it (the static token budget's collate when ``data.token_budgets`` is set), and the
    budget layout (``bert.trainer.train_layout``; None when off)."""
    m, d = cfg.model, cfg.data
    layout = train_layout(cfg, 1)
    return loader.batch_collate(m.unpad, m.pack, d.max_seq_length, layout), layout


def _flags(opt: torch.optim.Optimizer) -> dict[str, Any]:
    """``fused`` / ``foreach`` / ``capturable`` of group 0 (torch's optimizers keep them
    there); an optimizer that keeps one on itself (our Lamb's ``capturable``) is read there."""
    g = opt.param_groups[0]
    out = {}
    for k in ("fused", "foreach", "capturable"):
        v = g[k] if g.get(k) is not None else getattr(opt, k, None)
        out[k] = None if v is None else bool(v)
    return out


def build_case(cfg: Config, own: dict[str, str], device: torch.device) -> tuple[Trainer, str, dict]:
    """One case through the trainer itself, its step prepared (warmed up and, with
    run.cuda_graphs, captured: ``trainer.step``)."""
    trainer = Trainer(cfg, SINGLE, device)
    impl, info = prepare_case(trainer, own, device)
    return trainer, impl, info


class _Notes(logging.Handler):
    """The trainer's lines (bert.console's loggers) while a case prepares."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def prepare_case(trainer: Trainer, own: dict[str, str], device: torch.device) -> tuple[str, dict]:
    """``bench.compile``, then the trainer's ``prepare_step`` and ``prepare_eval``."""
    impl = trainer.optimizer_impl
    learner = trainer.learner
    if own.get("bench.compile"):
        learner.train_model = torch.compile(learner.model, dynamic=True, backend=own["bench.compile"])
        impl += f" + compile({own['bench.compile']})"
    info: dict[str, Any] = {}
    notes = _Notes()
    logger = logging.getLogger("bert")
    level = logger.level
    logger.addHandler(notes)
    logger.setLevel(logging.INFO)
    t0, f0 = time.perf_counter(), _frames()
    try:
        trainer.prepare()
    finally:
        logger.removeHandler(notes)
        logger.setLevel(level)
    common.sync(device)
    info["prepare_s"] = time.perf_counter() - t0
    info["compiles_in_prepare"] = _frames() - f0
    info.update(_timings(notes.lines))
    if notes.lines:
        info["prepare_notes"] = notes.lines
    return impl, info


def _frames() -> int:
    """Frames torch.compile has compiled in this process (a recompile is one more)."""
    return int(torch._dynamo.utils.counters["frames"]["ok"])


def _timings(notes: list[str]) -> dict[str, float]:
    """compile / warm-up / capture seconds from the trainer's warm-up lines
    (``Trainer.prepare_step`` and ``prepare_eval`` log them)."""
    out: dict[str, float] = {}
    for line in notes:
        m = re.search(r"^(eval )?warm-up before run_start: .* ([\d.]+) s \(compile ([\d.]+) s(?:, capture ([\d.]+) s)?\)",
                      line)
        if m:
            pre = "eval_" if m.group(1) else ""
            out[f"{pre}warmup_s"], out[f"{pre}compile_s"] = float(m.group(2)), float(m.group(3))
            if m.group(4) is not None:
                out[f"{pre}capture_s"] = float(m.group(4))
    return out


def time_optimizer(opt: torch.optim.Optimizer, device: torch.device, reps: int = 5) -> float:
    """Median ms of ``opt.step()`` alone on random gradients (never zeros), after one
    untimed step: CUDA events on a GPU (the GPU's time from the first kernel to the last,
    launch gaps included), the host clock on a CPU. Writes the gradients in place when they
    exist (a graphed step's persistent ones) and changes the weights: run it last."""
    params = [p for g in opt.param_groups for p in g["params"]]
    with torch.no_grad():
        for p in params:
            g = torch.randn_like(p).mul_(1e-3)
            if p.grad is None:
                p.grad = g
            else:
                p.grad.copy_(g)
    times = []
    for i in range(reps + 1):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            opt.step()
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end)
        else:
            t = time.perf_counter()
            opt.step()
            ms = 1000 * (time.perf_counter() - t)
        if i:
            times.append(ms)
    return float(statistics.median(times))


def step_kind(step: Callable) -> str:
    """eager: bert.trainer.train_step; graphed: bert/step_graph.py's GraphedStep; else the name."""
    if getattr(step, "func", None) is train_step:
        return "eager"
    return "graphed" if type(step).__name__ == "GraphedStep" else getattr(step, "__name__", type(step).__name__)


def _to_device(batch: dict, device: torch.device) -> dict:
    return {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in batch.items()}


def _cycle(batches: list[dict]):
    k = 0
    while True:
        yield batches[k % len(batches)]
        k += 1


def run_case(case: Case, args, device: torch.device, peak: float, samples_cache: dict) -> dict:
    head: dict[str, Any] = {"case": case.name, "local_batch": case.batch, "overrides": case.overrides}
    if args.cpu_smoke:
        head["smoke_stand_ins"] = {k: SMOKE_STAND_INS[(k, v)] for k, v in case.overrides.items()
                                   if (k, v) in SMOKE_STAND_INS}
    try:
        cfg, own = case_config(case, args)
        collate, layout = collate_for(cfg)
    except ConfigError as e:
        return {**head, "status": f"skipped: {e}"}
    if args.cpu_smoke and own.get("bench.compile"):
        own["bench.compile"] = "eager"  # see smoke_compile
    if case.batch not in samples_cache:
        samples_cache[case.batch] = common.make_batches(args.num_batches, case.batch, args.seq_len, args.max_pred,
                                                        cfg.model.vocab_size, args.seed)
    samples = samples_cache[case.batch]
    batches = [collate(b) for b in samples]
    on_dev = [_to_device(b, device) for b in batches]
    shape = common.shape_of(cfg.model)
    useful = [flops.useful_forward_flops(shape, *common.batch_stats(b)) for b in samples]
    real = [sum(common.batch_stats(b)[0]) for b in samples]
    fed = [int(b["input_ids"].numel()) for b in batches]
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    # No torch._dynamo.reset() between cases: a case whose compiled layer another case
    # already compiled (same code and guards: parameters are inputs) reuses it, so the
    # plan compiles each variant once (main raises dynamo's recompile limit to hold them).
    t0 = time.perf_counter()
    try:
        trainer = Trainer(cfg, SINGLE, device)
    except (ConfigError, ValueError) as e:  # the trainer's refusal (CUDA graphs or Triton on a CPU)
        return {**head, "status": f"skipped: refused at build: {type(e).__name__}: {e}"}
    common.sync(device)
    build_s = time.perf_counter() - t0
    impl, info = prepare_case(trainer, own, device)
    step, parts = trainer.step, trainer.learner
    f_ready = _frames()
    batches = _cycle(on_dev)
    # Every batch of the cycle once at least before the clock starts: a shape seen first
    # inside the timed steps would put its compile (or its eager fallback) in the number.
    warm = max(args.warmup, len(on_dev))
    for _ in range(warm):
        step(batches, 1)
    common.sync(device)
    ready_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(args.steps):
        loss, _skipped = step(batches, 1)
    common.sync(device)
    secs = time.perf_counter() - t0
    compiles_timed = _frames() - f_ready  # in the untimed and the timed steps: 0 after a warm-up
    evaluation = time_eval(trainer, device)
    done = range(warm, warm + args.steps)  # batch index k % num_batches
    n = len(samples)
    fl = 3 * sum(useful[k % n] for k in done)
    tok = sum(real[k % n] for k in done)
    peak_mem = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    opt_ms = time_optimizer(parts.optimizer, device)
    model = parts.model
    return {**head, "status": "ok",
            "seq_per_s": case.batch * args.steps / secs, "tokens_per_s": tok / secs,
            "step_ms": 1000 * secs / args.steps,
            "useful_tflops_per_s": fl / secs / 1e12, "mfu": fl / secs / peak, "peak_mem_gb": peak_mem,
            "optimizer_step_ms": opt_ms, "optimizer_impl": impl, "optimizer": type(parts.optimizer).__name__,
            "param_groups": _flags(parts.optimizer),
            "attention": getattr(getattr(model, "attn_backend", None), "name", None),
            "precision": parts.precision.train, **fp8_label(cfg), "step_kind": step_kind(step),
            "graph_eager_shapes": len(getattr(step, "eager_shapes", ())),
            "token_budget_rungs": list(getattr(layout, "rungs", ())) or None, "batch_shapes": sorted(set(fed)),
            "tokens_real_per_batch": sum(real) / n,
            "tokens_fed_per_batch": sum(fed) / n, "token_padding_frac": sum(fed) / sum(real) - 1,
            "ready_s": ready_s, "build_s": build_s, **info, "compiles_after_prepare": compiles_timed,
            **evaluation, "final_loss": float(loss)}


def time_eval(trainer: Trainer, device: torch.device, reps: int = 2) -> dict[str, Any]:
    """The trainer's evaluation (``bert.evaluate.mlm_accuracy``, graphed where
    ``prepare_eval`` captured it) over synthetic eval batches of the shapes a run evaluates
    (one per eval budget rung; ``Trainer.eval_warmup_batches``), timed after one untimed
    pass: ms per batch of ``eval.batch_size`` samples."""
    cfg, learner = trainer.cfg, trainer.learner
    batches = trainer.eval_warmup_batches()
    args = (learner.model, batches, device, learner.precision.eval_autocast, trainer.eval_counts)
    f0 = _frames()
    mlm_accuracy(*args)
    common.sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        mlm_accuracy(*args)
    common.sync(device)
    ms = 1000 * (time.perf_counter() - t0) / (reps * len(batches))
    return {"eval_ms_per_batch": ms, "eval_seq_per_s": cfg.eval.batch_size * 1000 / ms,
            "eval_batch_shapes": len(batches), "eval_step_kind": type(args[-1]).__name__ if args[-1] else "eager",
            "eval_compiles": _frames() - f0}


def fp8_label(cfg: Config) -> dict[str, str]:
    """What a case's GEMMs ran in, and what its MFU is against: FP8 cases are labelled (the
    peak measured is bf16's; FP8 tensor cores peak at about twice that)."""
    recipe = getattr(cfg.precision, "fp8", "off")  # a tree before bert/fp8.py has no key
    if recipe == "off":
        return {"fp8": "off"}
    return {"fp8": recipe, "mfu_note": f"FP8 {recipe} GEMMs in the encoder; MFU against the bf16 GEMM peak"}


# ---------------------------------------------------------------- the extra checks


def _attention_reference(q, k, v, cu: list[int], keep: torch.Tensor | None, p: float) -> torch.Tensor:
    """Per-sequence softmax(Q K^T / sqrt(d)) V in float32, rows past the last sequence 0;
    ``keep`` [B, H, S, S] applies a dropout mask (kept values scaled by 1/(1-p))."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for b, (a, e) in enumerate(zip(cu[:-1], cu[1:])):
        qs, ks, vs = (t[a:e].float().transpose(0, 1) for t in (q, k, v))  # [H, L, D]
        probs = torch.softmax(qs @ ks.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1)
        if keep is not None:
            probs = probs * keep[b, :, : e - a, : e - a] / (1.0 - p)
        out[a:e] = (probs @ vs).transpose(0, 1)
    return out


# Ragged lengths (1 and 512 included) and pad rows up to 1024 tokens: a multiple of 64 like
# every budget rung, so Triton specialises n_tokens as the runs' shapes do and the kernels
# compiled here are the ones the cases reuse (an odd token count compiles them again).
CHECK_LENGTHS, CHECK_TOKENS = [512, 1, 37, 300, 129], 1024


def check_attention(device: torch.device, smoke: bool) -> dict:
    """The varlen kernels with dropout (``triton``, ``nested``) against a float32 per-sequence
    reference, before any case is timed on them, each in its own try (one failing keeps the
    other's verdict): ragged lengths, pad rows past the last sequence, bf16 on a GPU (float32
    in the CPU smoke, where triton is refused). Triton runs what training and evaluation run:
    the forward at dropout 0 (evaluation), and forward and backward at dropout 0.1 against
    the reference applying the kernel's own mask (``triton_attention.dropout_mask``); nested
    its forward and backward at dropout 0. Records the max abs errors, a pass flag (bf16:
    0.03 of the reference's scale, 10x that for gradients) and, for triton, the compiled
    kernels' registers and spills (``kernel_stats``)."""
    lengths, heads, dim, total, max_len = (([9, 1, 5], 2, 16, 18, 16) if smoke
                                           else (CHECK_LENGTHS, 16, 64, CHECK_TOKENS, 512))
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    out: dict[str, Any] = {"lengths": lengths, "tokens": total, "pad_rows": total - sum(lengths), "heads": heads,
                           "head_dim": dim, "dtype": str(dtype)}
    for name in ("triton", "nested"):
        try:
            out[name] = _check_backend(name, device, lengths, heads, dim, total, max_len, dtype)
        except Exception as e:  # noqa: BLE001 - this backend's verdict; the other keeps its own
            out[name] = {"status": f"error: {type(e).__name__}: {e}", "pass": False,
                         "traceback": traceback.format_exc(limit=6)}
    out["status"] = "ok"
    return out


def _check_backend(name: str, device: torch.device, lengths: list[int], heads: int, dim: int, total: int,
                   max_len: int, dtype: torch.dtype) -> dict:
    from bert.attention import build_attention

    tol = 1e-4 if dtype == torch.float32 else 3e-2
    try:
        backend = build_attention(name, device.type, 0.1)
    except ValueError as e:
        return {"status": f"skipped: {e}"}
    gen = torch.Generator().manual_seed(0)
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    cu = torch.tensor(bounds, dtype=torch.int32, device=device)
    base = [torch.randn(total, heads, dim, generator=gen).to(device, dtype) for _ in range(4)]
    # (label, dropout, the kernel's own mask or None, whether the backward is checked)
    runs: list[tuple[str, float, Any, bool]] = [("dropout_0", 0.0, None, name != "triton")]
    if name == "triton":
        from bert import triton_attention
        seed = torch.tensor([1234], dtype=torch.int64, device=device)
        keep = triton_attention.dropout_mask(seed, len(lengths), heads, max_len, 0.1)
        runs.append(("dropout_0.1_same_mask", 0.1, (seed, keep), True))
    rec: dict[str, Any] = {}
    for label, p, fixed, grads in runs:
        q, k, v = (t.clone().requires_grad_(grads) for t in base[:3])
        rq, rk, rv = (t.detach().float().requires_grad_(grads) for t in base[:3])
        if fixed is None:
            got = backend.varlen(q, k, v, cu, max_len, p)
        else:
            got = triton_attention.varlen(q, k, v, cu, max_len, p, seed=fixed[0])
        applied = triton_attention.applied_dropout(p) if fixed is not None else p
        want = _attention_reference(rq, rk, rv, bounds, None if fixed is None else fixed[1], applied)
        scale = max(float(want.detach().abs().max()), 1.0)
        errs = {"out": float((got.detach().float() - want.detach()).abs().max())}
        if grads:
            got.backward(base[3])
            want.backward(base[3].float())
            for n_, a, b in (("dq", q, rq), ("dk", k, rk), ("dv", v, rv)):
                errs[n_] = float((a.grad.float() - b.grad).abs().max())
        pad_zero = bool((got[bounds[-1]:] == 0).all())
        rec[label] = {"max_abs_err": errs, "ref_scale": scale, "pad_rows_zero": pad_zero,
                      "pass": pad_zero and all(e <= tol * scale * (10 if n_ != "out" else 1)
                                               for n_, e in errs.items())}
    result = {"status": "ok", **rec, "pass": all(r["pass"] for r in rec.values())}
    if name == "triton":
        result["kernels"] = triton_attention.kernel_stats()
    return result


# The block-size sweep: (forward blocks, backward blocks), each (BLOCK_M, BLOCK_N, warps,
# stages); the first is the module's default. Each pair compiles its own kernels.
BLOCK_CONFIGS = [((64, 64, 4, 2), (64, 64, 4, 2)),
                 ((128, 64, 4, 3), (64, 128, 8, 2)),
                 ((128, 64, 8, 2), (128, 64, 8, 2))]


def check_attention_blocks(args, device: torch.device, samples_cache: dict, reps: int = 10) -> dict:
    """A small block-size sweep of the Triton kernels (``BLOCK_CONFIGS``) on a training
    micro-batch of the small local batch (the Wikipedia lengths, padded to its budget rung,
    16 heads of 64, bf16, dropout 0.1): per config the forward and backward ms (CUDA
    events, median of ``reps`` after two untimed), the max difference from the default
    config's output and gradients (the dropout mask depends on no block size, so only
    rounding differs), and each compiled kernel's registers and spills."""
    if device.type != "cuda":
        return {"status": "skipped: the Triton kernels run on CUDA only"}
    from bert import budget, triton_attention

    cfg, _ = case_config(_case("blocks", args.small, f=FAST), args)
    layout = train_layout(cfg, 1)
    if args.small not in samples_cache:
        samples_cache[args.small] = common.make_batches(args.num_batches, args.small, args.seq_len, args.max_pred,
                                                        cfg.model.vocab_size, args.seed)
    batch = budget.BudgetCollate(layout)(samples_cache[args.small][0])
    cu, total = batch["cu_seqlens"].to(device), int(batch["input_ids"].numel())
    heads, dim = cfg.model.num_heads, cfg.model.hidden_size // cfg.model.num_heads
    gen = torch.Generator().manual_seed(1)
    q, k, v, do = (torch.randn(total, heads, dim, generator=gen).to(device, torch.bfloat16) for _ in range(4))
    seed = torch.tensor([99], dtype=torch.int64, device=device)
    p, s = 0.1, cfg.data.max_seq_length
    out: dict[str, Any] = {"status": "ok", "tokens": total, "real_tokens": int(cu[-1]), "configs": []}
    ref = None
    for fwd_blocks, bwd_blocks in BLOCK_CONFIGS:
        row: dict[str, Any] = {"forward_blocks": fwd_blocks, "backward_blocks": bwd_blocks}
        try:
            def fwd():
                return triton_attention.forward(q, k, v, cu, s, p, seed, fwd_blocks)

            o, lse = fwd()

            def bwd():
                return triton_attention.backward(do, q, k, v, o, lse, cu, s, p, seed, bwd_blocks)

            grads = bwd()
            row["forward_ms"], row["backward_ms"] = _cuda_ms(fwd, reps), _cuda_ms(bwd, reps)
            if ref is None:
                ref = (o, *grads)
            row["max_diff_from_default"] = max(float((a.float() - b.float()).abs().max())
                                               for a, b in zip((o, *grads), ref))
            row["status"] = "ok"
        except Exception as e:  # noqa: BLE001 - a config that does not fit (shared memory): say so, go on
            row["status"] = f"error: {type(e).__name__}: {e}"
        out["configs"].append(row)
    out["kernels"] = triton_attention.kernel_stats()
    return out


def _cuda_ms(fn: Callable[[], Any], reps: int) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return float(statistics.median(times))


def check_fp16(args, device: torch.device, samples_cache: dict) -> dict:
    """``args.fp16_steps`` steps of the trainer's own ``train_step`` with
    ``precision.dtype=fp16`` (autocast fp16, dynamic loss scaling) on the default stack; per
    step the loss, the scale, whether it was skipped and whether the weights moved (a
    skipped step must leave them alone, every other step must move them). Should the default
    attention fail in fp16, the steps are retried with ``model.attention_backend=sdpa`` and
    both attempts are recorded."""
    out: dict[str, Any] = {"attempts": []}
    for extra in ({}, {"model.attention_backend": "sdpa"}):
        try:
            r = _fp16_steps(args, device, samples_cache, extra)
        except Exception as e:  # noqa: BLE001 - record it, try the portable attention
            out["attempts"].append({"overrides": extra, "error": f"{type(e).__name__}: {e}",
                                    "traceback": traceback.format_exc(limit=6)})
            continue
        out["attempts"].append({"overrides": extra, "status": "ok"})
        return {**r, **out}
    return {"status": "error: every attempt failed", **out}


def _fp16_steps(args, device: torch.device, samples_cache: dict, extra: dict[str, str]) -> dict:
    case = _case("fp16", args.small, p={"precision.dtype": "fp16", **args.fp16_overrides, **extra})
    cfg, _ = case_config(case, args)
    if case.batch not in samples_cache:
        samples_cache[case.batch] = common.make_batches(args.num_batches, case.batch, args.seq_len, args.max_pred,
                                                        cfg.model.vocab_size, args.seed)
    collate, _ = collate_for(cfg)
    batches = [_to_device(collate(b), device) for b in samples_cache[case.batch]]
    trainer = Trainer(cfg, SINGLE, device)
    parts, impl, feed = trainer.learner, trainer.optimizer_impl, _cycle(batches)
    watched = [p for p in parts.model.parameters() if p.requires_grad][-4:]  # the MLM head's, among others
    rows = []
    for i in range(args.fp16_steps):
        before = [p.detach().clone() for p in watched]
        with warnings.catch_warnings():
            # The trainer advances the schedule on a skipped step too (the samples were used);
            # torch warns when the first optimizer step was the one skipped.
            warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()`"))
            loss, skipped = train_step(parts, feed, 1)
        moved = any(not torch.equal(a, p.detach()) for a, p in zip(before, watched))
        # get_scale() syncs the host: fine in a check, never in the loop.
        rows.append({"step": i + 1, "loss": float(loss), "skipped": int(skipped), "scale": parts.scaler.get_scale(),
                     "weights_moved": moved})
    return {"status": "ok", "device": device.type, "local_batch": case.batch, "precision": parts.precision.train,
            "loss_scaling": parts.precision.hyperparameters(cfg.precision)["loss_scaling"],
            "attention": getattr(getattr(parts.model, "attn_backend", None), "name", None),
            "optimizer_impl": impl, "steps": rows, "skipped_total": sum(r["skipped"] for r in rows),
            "finite_losses": sum(math.isfinite(r["loss"]) for r in rows), "final_scale": rows[-1]["scale"],
            "skips_left_weights_alone": all(r["weights_moved"] != bool(r["skipped"]) for r in rows)}


def check_demo(workdir: Path, artifacts: Path, smoke: bool, data_dir: Path | None = None,
               extra_env: dict[str, str] | None = None, timeout_s: float = 300.0) -> dict:
    """config_CPU_1x2.sh's model and data, trained by ``run_and_time.sh`` in one process on
    this machine's device (LAUNCHER=task; BATCHSIZE = the config's per-rank batch x its
    ranks, so the global batch and the schedule are the config's), then the 5.0.0 checker
    on its log. ``smoke``: 3 steps, eval on 64 samples after each (the target is not
    expected). ``extra_env`` overrides the launcher's variables (the tests start from the
    trained demo model). Copies the log, the trainer's output and the checker's output to
    ``artifacts`` as demo_result_0.txt, demo_train.log, demo_compliance.txt."""
    from bert import demo_data

    conf = config_script.source(PKG / "config_CPU_1x2.sh", {"PATH": os.environ.get("PATH", "/usr/bin:/bin")})
    t0 = time.perf_counter()
    if data_dir is None:
        data_dir = workdir / "demo_data"
        if not (data_dir / "demo_data.json").exists():
            n_train, n_eval = (512, 128) if smoke else (int(conf["DEMO_TRAIN_SAMPLES"]), int(conf["DEMO_EVAL_SAMPLES"]))
            demo_data.generate(data_dir, train_samples=n_train, eval_samples=n_eval, seed=1,
                               seq_len=int(conf["DEMO_SEQ_LEN"]), max_pred=int(conf["DEMO_MAX_PRED"]),
                               vocab=int(conf["DEMO_VOCAB"]))
    data_s = time.perf_counter() - t0
    logdir = workdir / "demo_logs"
    shutil.rmtree(logdir, ignore_errors=True)
    # run_and_time.sh calls `python`: make it this interpreter (the device's is python3). A
    # script, not a symlink: a venv's python finds its pyvenv.cfg from the path it is run as.
    shim = workdir / "bin"
    shim.mkdir(parents=True, exist_ok=True)
    (shim / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (shim / "python").chmod(0o755)
    env = dict(os.environ, **conf)
    env.update(PATH=f"{shim}:{os.environ.get('PATH', '/usr/bin:/bin')}",
               DGXNGPU="1", LAUNCHER="task", BATCHSIZE=str(int(conf["BATCHSIZE"]) * int(conf["DGXNGPU"])),
               DATADIR=str(data_dir / "train"), EVALDIR=str(data_dir / "eval"), LOGDIR=str(logdir),
               LOGFILE="result_0.txt", SEED="1")
    if smoke:
        env.update(EVAL_ITER_SAMPLES="64", EXTRA_PARAMS=conf["EXTRA_PARAMS"] + " run.max_steps=3 data.eval_samples=64")
    env.update(extra_env or {})
    t0 = time.perf_counter()
    # Its own process group: run_and_time.sh starts the trainer in the background, so a stop
    # (timeout, or this task's time limit) must end the group, not the shell alone.
    proc = subprocess.Popen(["./run_and_time.sh"], cwd=PKG, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        rc, output = None, f"{output}\n[timed out after {timeout_s:.0f} s]"
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    wall_s = time.perf_counter() - t0
    artifacts.mkdir(parents=True, exist_ok=True)
    (artifacts / "demo_train.log").write_text(output)
    status = ("ok" if rc in (0, 1) else f"error: timed out after {timeout_s:.0f} s" if rc is None
              else f"error: run_and_time.sh exit {rc}")
    out: dict[str, Any] = {"status": status,
                           "smoke": smoke, "exit_code": rc, "wall_s": wall_s, "data_s": data_s,
                           "local_batch": int(env["BATCHSIZE"]), "extra_params": env["EXTRA_PARAMS"]}
    if smoke:
        out["note"] = "--cpu-smoke: 3 steps only, the target is not expected (the suite trains the demo elsewhere)"
    m = re.search(r"run_stop (\w+) after (\d+) steps, (\d+) samples", output)
    if m:
        out.update(run_stop=m.group(1), steps=int(m.group(2)), samples=int(m.group(3)))
    m = re.search(r"bert: .* on (\S+); optimizer (\S+); precision (\S+)", output)
    if m:
        out.update(device=m.group(1), optimizer_impl=m.group(2), precision=m.group(3))
    log = logdir / "result_0.txt"
    if not log.exists():
        out["checker"] = "not run: no log"
        return out
    shutil.copyfile(log, artifacts / "demo_result_0.txt")
    events = read_events(log)
    first = {e["key"]: e for e in reversed(events)}  # each key's first event
    accs = [(e["metadata"].get("epoch_num"), e["value"]) for e in events if e["key"] == "eval_accuracy"]
    out["eval_accuracy"] = accs
    if "run_start" in first and "run_stop" in first:
        out["run_s"] = (first["run_stop"]["time_ms"] - first["run_start"]["time_ms"]) / 1000
        if first["run_stop"]["metadata"].get("status") == "success":
            out["time_to_target_s"] = out["run_s"]
    if importlib.util.find_spec("mlperf_logging") is None:  # h200.sh installs it: not on the device image
        out["checker"] = "not run: mlperf_logging is not importable"
        return out
    report = workdir / "demo_compliance_detail.txt"
    c = subprocess.run([sys.executable, "-m", "mlperf_logging.compliance_checker", "--usage", "training",
                        "--ruleset", "5.0.0", "--log_output", str(report), str(log)],
                       capture_output=True, text=True, cwd=workdir, timeout=120)
    text = c.stdout + c.stderr
    (artifacts / "demo_compliance.txt").write_text(text)
    out["checker"] = "PASS" if c.returncode == 0 and "SUCCESS" in text else "FAIL"
    out["checker_exit_code"] = c.returncode
    out["checker_failed_checks"] = re.findall(r"Failed checks for (\S+)", text)
    out["checker_tail"] = text.strip().splitlines()[-3:]
    return out


# ---------------------------------------------------------------- the run


def versions() -> dict[str, Any]:
    try:
        import triton
        tv = triton.__version__
    except Exception:  # noqa: BLE001 - missing, or broken on this machine: say which
        tv = None
    try:
        mv = importlib.metadata.version("mlperf-logging")
    except importlib.metadata.PackageNotFoundError:
        mv = None
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": cudnn, "triton": tv,
            "python": platform.python_version(), "mlperf_logging": mv}


def git_commit() -> tuple[str, str]:
    try:
        r = subprocess.run(["git", "rev-parse", "HEAD"], cwd=PKG, capture_output=True, text=True, timeout=10)
        if r.returncode == 0:
            dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=PKG,
                                   capture_output=True, text=True, timeout=10).stdout.strip()
            return r.stdout.strip() + ("-dirty" if dirty else ""), "git rev-parse HEAD"
    except (OSError, subprocess.TimeoutExpired):
        pass
    return "unknown", "none: no --commit and no git checkout"


def table(result: dict) -> str:
    """The markdown table of a result file (what BENCHMARKS.md shows)."""
    lines = ["| case | local batch | seq/s | MFU | peak mem GB | step ms | optimizer ms | optimizer | attention "
             "| step | eval ms/batch | compile / warm-up / capture s | status |",
             "|---|---:|---:|---:|---:|---:|---:|---|---|---|---:|---|---|"]

    def num(c, key, fmt="{:.1f}"):
        return fmt.format(c[key]) if c.get(key) is not None else "-"

    for c in result["cases"]:
        if c["status"] == "ok":
            prep = f"{num(c, 'compile_s')} / {num(c, 'warmup_s')} / {num(c, 'capture_s')}"
            mfu = f"{c['mfu']:.1%}" + (" (FP8 vs bf16 peak)" if c.get("fp8", "off") != "off" else "")
            lines.append(f"| {c['case']} | {c['local_batch']} | {c['seq_per_s']:.1f} | {mfu} | "
                         f"{num(c, 'peak_mem_gb')} | {c['step_ms']:.1f} | {c['optimizer_step_ms']:.2f} | "
                         f"{c['optimizer_impl']} | {c['attention']} | {c['step_kind']} | {num(c, 'eval_ms_per_batch')} | "
                         f"{prep} | ok |")
        else:
            lines.append(f"| {c['case']} | {c['local_batch']} | | | | | | | | | | | {c['status'][:80]} |")
    checks = result.get("checks", {})
    if "attention" in checks:
        a = checks["attention"]
        lines.append("\nattention check: " + "; ".join(
            f"{n} {a[n].get('status')}" + (f", pass {a[n]['pass']}" if "pass" in a[n] else "")
            for n in ("triton", "nested") if n in a))
    if checks.get("attention_blocks", {}).get("status") == "ok":
        lines.append("\nattention blocks (forward / backward ms): " + "; ".join(
            f"{r['forward_blocks']} / {r['backward_blocks']}: "
            + (f"{r['forward_ms']:.2f} / {r['backward_ms']:.2f}" if r["status"] == "ok" else r["status"][:60])
            for r in checks["attention_blocks"]["configs"]))
    if "fp16" in checks:
        f = checks["fp16"]
        lines.append(f"\nfp16: {f.get('status')}; " + (
            f"{len(f['steps'])} steps, {f['skipped_total']} skipped, scale {f['final_scale']:g} at the end, losses "
            + ", ".join(f"{r['loss']:.3f}" for r in f["steps"]) if f.get("status") == "ok" else ""))
    if "demo" in checks:
        d = checks["demo"]
        lines.append(f"demo: {d.get('status')}; run_stop {d.get('run_stop')} after {d.get('steps')} steps, "
                     f"time to target {d.get('time_to_target_s')} s, checker {d.get('checker')}")
    lines.append(f"\n{result.get('device_name')}, commit {result.get('commit')}, bf16 GEMM peak "
                 f"{result.get('gemm_peak_tflops', 0):.1f} TFLOP/s, torch {result['versions']['torch']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="results/gpu_bert_large.json")
    ap.add_argument("--artifacts", default="", help="where the demo check's logs go (default: beside --out)")
    ap.add_argument("--commit", default="", help="the commit measured (the device gets no .git: bench/h200.sh "
                                                 "passes .h200/commit); default: git rev-parse HEAD")
    ap.add_argument("--small", type=int, default=16, help="the small local batch (fast stack, baseline, fp16)")
    ap.add_argument("--big", type=int, default=96, help="the large local batch (fast stack, ablations)")
    ap.add_argument("--old", type=int, default=32, help="local batch of the 2026-11-29 on/off cases")
    ap.add_argument("--fast-sweep", type=lambda s: [int(x) for x in s.split(",") if x], default=[32, 48, 64])
    ap.add_argument("--default-sweep", type=lambda s: [int(x) for x in s.split(",") if x], default=[32, 64, 96])
    ap.add_argument("--case", type=parse_case, action="append", default=[],
                    help="an extra case NAME:run.local_batch_size=N,key=value,... (run after the plan's)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--fp16-steps", type=int, default=8)
    ap.add_argument("--num-batches", type=int, default=8, help="distinct batches cycled through")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--max-pred", type=int, default=76)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budget-s", type=float, default=300.0, help="start nothing after this many seconds")
    ap.add_argument("--task-limit-s", type=float, default=240.0,
                    help="stop a task (a case's compile, the demo) after this many seconds and go on")
    ap.add_argument("--min-task-s", type=float, default=20.0,
                    help="start no task with less than this many seconds left before --limit-s")
    ap.add_argument("--limit-s", type=float, default=0.0,
                    help="the whole run's hard limit (bench/h200.sh's): no task runs past it; 0 = none")
    ap.add_argument("--only", default="", help="comma-separated names to run (cases, check_fp16, check_demo)")
    ap.add_argument("--demo-data", default="", help="existing demo data (train/, eval/) instead of generating it")
    ap.add_argument("--demo-timeout-s", type=float, default=240.0)
    ap.add_argument("--compile-cache", choices=("cold", "warm"), default="cold",
                    help="whether inductor's and Triton's caches were carried in (bench/h200.sh says): "
                         "which column of the plan's expected seconds to print")
    ap.add_argument("--table", metavar="JSON", help="print the markdown table of a result file and exit")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="tiny model on the CPU, 1+1 steps per case, torch.compile through dynamo's eager "
                         "backend, the demo check 3 steps: exercises every path and the output file, measures nothing")
    args = ap.parse_args(argv)
    if args.table:
        print(table(json.loads(Path(args.table).read_text())))
        return 0
    if args.cpu_smoke:
        device = torch.device("cpu")
        args.small, args.big, args.old, args.fast_sweep, args.default_sweep = 2, 4, 3, [3], [3, 4]
        args.steps, args.warmup, args.fp16_steps = 1, 1, 3
        # A first scale that overflows and a backoff to 1: step 1 is skipped, 2 and 3 are not,
        # so both paths of the check run (on the GPU the config's scale is used as it is).
        args.fp16_overrides = {"precision.loss_scale_init": "1e30", "precision.loss_scale_backoff": "1e-30"}
        args.num_batches, args.seq_len, args.max_pred = 2, 64, 10
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: use --cpu-smoke to check the script on a CPU", file=sys.stderr)
            return 2
        device = torch.device("cuda", torch.cuda.current_device())
        torch.backends.cuda.matmul.allow_tf32 = True
    args.device_type = device.type
    args.fp16_overrides = getattr(args, "fp16_overrides", {})
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    artifacts = Path(args.artifacts) if args.artifacts else out.parent
    commit, commit_source = (args.commit, "--commit") if args.commit else git_commit()
    only = set(filter(None, args.only.split(",")))
    tasks = plan(args.small, args.big, args.old, args.fast_sweep, args.default_sweep) + args.case
    plan_names = [task_name(t) for t in tasks]
    if only - set(plan_names):  # a misspelt name would spend a device window on nothing
        print(f"--only: not in the plan: {sorted(only - set(plan_names))}; the plan: {plan_names}", file=sys.stderr)
        return 2
    selected = [t for t in tasks if not only or task_name(t) in only]
    text, late = time_table(selected, args.compile_cache == "warm", args.budget_s, args.limit_s)
    print(text, flush=True)
    # One compiled layer per variant the plan runs (attention backend, autocast cache, grad
    # mode): more than dynamo's default limit of 8 entries per frame across the run.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    start = time.perf_counter()
    peak = common.gemm_peak(torch.bfloat16, device, sizes=(512,) if args.cpu_smoke else (4096, 8192),
                            reps=3 if args.cpu_smoke else 10)
    result: dict[str, Any] = {
        "device_name": (torch.cuda.get_device_name(device) if device.type == "cuda"
                        else f"cpu: {common.machine().get('cpu', '')}"),
        "commit": commit, "commit_source": commit_source,
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "gemm_peak_tflops": peak["flops_per_s"] / 1e12, "gemm_peak_n": peak["n"], "gemm_dtype": "bf16",
        "versions": versions(), "machine": common.machine(), "cpu_smoke": args.cpu_smoke,
        "model": dataclasses.asdict(ModelConfig()) if not args.cpu_smoke else SMOKE_MODEL,
        "seq_len": args.seq_len, "steps": args.steps, "warmup": args.warmup, "budget_s": args.budget_s,
        "plan": plan_names, "only": sorted(only), "compile_cache": args.compile_cache,
        "expected_s": {task_name(t): t.est_s[args.compile_cache == "warm"] for t in selected},
        "expected_past_window": late, "cases": [], "checks": {}}
    saved_term = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        terminated = run_tasks(tasks, only, args, device, peak["flops_per_s"], result, out, artifacts, start)
    finally:
        signal.signal(signal.SIGTERM, saved_term)
    print(f"bf16 GEMM peak {result['gemm_peak_tflops']:.1f} TFLOP/s (n={peak['n']}); wrote {out}")
    return 128 + signal.SIGTERM if terminated else 0


def run_tasks(tasks: list, only: set[str], args, device: torch.device, peak: float, result: dict, out: Path,
              artifacts: Path, start: float) -> bool:
    """Each task in turn, within the budget and the limits; the JSON rewritten after each.
    Returns whether SIGTERM ended the run."""
    samples_cache: dict[int, list] = {}
    ctx = smoke_compile() if args.cpu_smoke else _nothing()
    with ctx, tempfile.TemporaryDirectory(prefix="gpu_bert_large_") as tmp:
        for task in tasks:
            name = task_name(task)
            if only and name not in only:
                continue
            t0 = time.perf_counter()
            # The task's time: its cap, and never past the whole run's limit (the JSON then
            # records it, where the wrapper's hard kill would lose it).
            left = args.limit_s - (t0 - start) - 10 if args.limit_s else math.inf
            cap = min(args.task_limit_s, left)
            if t0 - start > args.budget_s or left < args.min_task_s:
                r: dict[str, Any] = {"status": "skipped: budget"}
            else:
                signal.signal(signal.SIGALRM, _raise_timeout)
                signal.setitimer(signal.ITIMER_REAL, cap)
                try:
                    if isinstance(task, Check) and task.name == "attention":
                        r = check_attention(device, args.cpu_smoke)
                    elif isinstance(task, Check) and task.name == "attention_blocks":
                        r = check_attention_blocks(args, device, samples_cache)
                    elif isinstance(task, Check) and task.name == "fp16":
                        r = check_fp16(args, device, samples_cache)
                    elif isinstance(task, Check):
                        r = check_demo(Path(tmp), artifacts, args.cpu_smoke, Path(args.demo_data) if args.demo_data
                                       else None, timeout_s=args.demo_timeout_s)
                    else:
                        r = run_case(task, args, device, peak, samples_cache)
                except TaskTimeout:
                    r = {"status": f"error: stopped at its time limit ({cap:.0f} s)",
                         "traceback": traceback.format_exc(limit=-8)}
                except Terminated:
                    r = {"status": "error: terminated (SIGTERM: the wrapper's time limit)", "terminated": True}
                except torch.OutOfMemoryError:
                    r = {"status": "oom"}
                except Exception as e:  # noqa: BLE001 - keep the other results; say what failed
                    r = {"status": f"error: {type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=6)}
                finally:
                    signal.setitimer(signal.ITIMER_REAL, 0)
            r["task_s"] = time.perf_counter() - t0
            if isinstance(task, Check):
                result["checks"][task.name] = r
            else:
                r = {"case": task.name, "local_batch": task.batch, "overrides": task.overrides, **r}
                result["cases"].append(r)
            result["elapsed_s"] = time.perf_counter() - start
            out.write_text(json.dumps(result, indent=2) + "\n")
            report(name, r)
            if r.get("terminated"):
                return True
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return False


def report(name: str, r: dict) -> None:
    if r.get("status") == "ok" and "seq_per_s" in r:
        print(f"{name:28s} b={r['local_batch']:3d} {r['seq_per_s']:8.1f} seq/s  MFU {r['mfu']:6.1%}  "
              f"{r['step_ms']:8.1f} ms/step  opt {r['optimizer_step_ms']:7.2f} ms  "
              f"mem {r['peak_mem_gb'] or 0:6.1f} GB  {r['optimizer_impl']}  {r['attention']}  {r['step_kind']}",
              flush=True)
    else:
        keys = ("checker", "checker_failed_checks", "run_stop", "time_to_target_s", "skipped_total", "final_scale",
                "skips_left_weights_alone")
        summary = {k: v for k, v in r.items() if k in keys}
        if isinstance(r.get("steps"), (int, list)):
            summary["steps"] = r["steps"] if isinstance(r["steps"], int) else [s["loss"] for s in r["steps"]]
        print(f"{name:28s} {r.get('status')}  {json.dumps(summary)}", flush=True)


class TaskTimeout(BaseException):
    """A task ran past its share of the device window (BaseException: no ``except
    Exception`` inside torch or the trainer swallows it)."""


def _raise_timeout(signum, frame):
    raise TaskTimeout()


class Terminated(BaseException):
    """SIGTERM (the wrapper's ``timeout``): record the task in flight, end its children
    (the demo's trainer runs in a session of its own, which the device would not end),
    write the JSON, stop."""


def _raise_terminated(signum, frame):
    raise Terminated()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class smoke_compile:
    """--cpu-smoke only: ``torch.compile`` uses dynamo's ``eager`` backend while the run
    lasts, also where the caller names inductor (the project's compile calls are traced,
    nothing is code-generated: inductor's C++ build takes minutes on a 2-core CPU). Restored
    on exit (the tests call ``main``)."""

    def __enter__(self):
        self.saved = torch.compile

        def compile_eager(*a, **kw):
            kw["backend"] = "eager"  # also where the caller names inductor (compiled LAMB does)
            return self.saved(*a, **kw)

        torch.compile = compile_eager
        return self

    def __exit__(self, *exc):
        torch.compile = self.saved
        return False


if __name__ == "__main__":
    sys.exit(main())
