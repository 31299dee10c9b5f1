"""One case of bench/cases.py measured through the trainer itself, for bench/gpu_bert_large.py
and bench/device_run.py: the device's setup, the result file's header, the GEMM peak, and
what ends a task (``record_failure``, ``report``).

A case's overrides are applied with the trainer's own ``bert.config.build_config`` and built
by the trainer (``bert.trainer.Trainer``: model, precision, gradient sync with global-norm
clip 1.0, ``bert.optim.build_optimizer``, schedule), then run with the trainer's own step,
prepared by ``Trainer.prepare_step`` (warm-up on synthetic batches and, with
``run.cuda_graphs``, the captured step of bert/step_graph.py). A case whose key or value this
tree does not know (``ConfigError``), or that the trainer refuses at build time
(``run.cuda_graphs`` or Triton attention on a CPU), is recorded as ``status: "skipped: ..."``
with the reason.

Batches are drawn from the MLPerf Wikipedia length histogram (seq 512, 15% masked, at most
76; the same samples for every case of one local batch), collated by the trainer's collate
for the case's layout, moved to the device before timing, and cycled. Per case: ``--warmup``
untimed steps (at least one pass over the cycle, so no shape is first seen, and compiled,
inside the timing), then ``--steps`` timed steps. The throughput, memory and compile counts
are recorded (and ``save`` called) before any extra; each extra (the kernel-class profile of
a case that asks for one, the evaluation's warm-up and timing, the optimizer step alone)
runs in its own try, so a failing extra loses only itself; ``measure_case`` returns them
unrun, for a caller that runs them later (bench/device_run.py runs the headline's after the
core numbers of the other cases).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import re
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import common, kernel_profile, provenance  # noqa: E402
from bench.cases import Case, resolved_overrides  # noqa: E402
from bert import flops, loader  # noqa: E402
from bert.config import Config, ConfigError, ModelConfig, build_config  # noqa: E402
from bert.distributed import DistEnv  # noqa: E402
from bert.evaluate import mlm_accuracy  # noqa: E402
from bert.trainer import Trainer, train_layout, train_step  # noqa: E402

SINGLE = DistEnv(rank=0, world_size=1, local_rank=0, master_addr="127.0.0.1", master_port=29500, launcher="single")

# The tiny model of --cpu-smoke (BERT-Large is the config's default and needs no override).
# Hidden 96 and intermediate 160 are no budget rung (multiples of 64): a token count equal
# to a static size would share its symbol in dynamo's shape analysis and be specialised.
SMOKE_MODEL = {"model.vocab_size": "1000", "model.hidden_size": "96", "model.num_layers": "2",
               "model.num_heads": "4", "model.intermediate_size": "160", "model.max_position_embeddings": "64",
               "eval.batch_size": "4"}
# --cpu-smoke: what stands in for a CUDA-only value (the case records the swap): the math
# backend for Triton's kernel (varlen through the padded grid without a host read, like
# the GPU's sdpa), eager steps for CUDA graphs. The rest -- budgets, warm-ups, the compiled
# layers -- runs.
SMOKE_STAND_INS = {("model.attention_backend", "triton"): "math", ("run.cuda_graphs", "true"): "false"}


def setup_device(args) -> torch.device | None:
    """The device of the run (None: no CUDA and no --cpu-smoke), and --cpu-smoke's sizes."""
    if args.cpu_smoke:
        args.small, args.big, args.old, args.fast_sweep, args.default_sweep = 2, 4, 3, [3], [3, 4]
        args.steps, args.warmup = 1, 1
        args.num_batches, args.seq_len, args.max_pred = 2, 64, 10
        device = torch.device("cpu")
    elif not torch.cuda.is_available():
        return None
    else:
        device = torch.device("cuda", torch.cuda.current_device())
        torch.backends.cuda.matmul.allow_tf32 = True
    args.device_type = device.type
    # One compiled layer per variant the cases run (attention backend, autocast cache, grad
    # mode): more than dynamo's default limit of 8 entries per frame across the run.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    return device


def run_header(args, device: torch.device, peak: dict, commit: str, commit_source: str) -> dict[str, Any]:
    """The result file's fields before any case: device, commit, peak, versions, sizes."""
    import datetime

    return {"device_name": (torch.cuda.get_device_name(device) if device.type == "cuda"
                            else f"cpu: {common.machine().get('cpu', '')}"),
            "commit": commit, "commit_source": commit_source,
            "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "gemm_peak_tflops": peak["flops_per_s"] / 1e12, "gemm_peak_n": peak["n"], "gemm_dtype": "bf16",
            "versions": provenance.versions(), "machine": common.machine(), "cpu_smoke": args.cpu_smoke,
            "model": dataclasses.asdict(ModelConfig()) if not args.cpu_smoke else SMOKE_MODEL,
            "seq_len": args.seq_len, "steps": args.steps, "warmup": args.warmup,
            "fast_attention": args.fast_attention, "cases": [], "checks": {}}


def gemm_peak(args, device: torch.device) -> dict:
    return common.gemm_peak(torch.bfloat16, device, sizes=(512,) if args.cpu_smoke else (4096, 8192),
                            reps=3 if args.cpu_smoke else 10)


def case_config(case: Case, args) -> tuple[Config, dict[str, str]]:
    """The trainer's config of ``case`` (raises ConfigError for a key or value this tree
    does not know) and the ``bench.*`` keys, apart."""
    overrides = resolved_overrides(case, args)
    base = {"run.seed": str(args.seed), "run.device": args.device_type, "data.max_seq_length": str(args.seq_len),
            "data.max_predictions_per_seq": str(args.max_pred)}
    if args.cpu_smoke:
        base.update(SMOKE_MODEL)
    over = {**base, **{k: v for k, v in overrides.items() if not k.startswith("bench.")}}
    if args.cpu_smoke:  # the CUDA-only keys' CPU stand-ins, so the smoke runs the rest of the path
        over.update({k: SMOKE_STAND_INS[(k, v)] for k, v in over.items() if (k, v) in SMOKE_STAND_INS})
    own = {k: v for k, v in overrides.items() if k.startswith("bench.")}
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


def _noted(fn: Callable[[], None]) -> list[str]:
    """``fn()`` with the lines the trainer logs meanwhile caught."""
    notes = _Notes()
    logger = logging.getLogger("bert")
    level = logger.level
    logger.addHandler(notes)
    logger.setLevel(logging.INFO)
    try:
        fn()
    finally:
        logger.removeHandler(notes)
        logger.setLevel(level)
    return notes.lines


def prepare_case(trainer: Trainer, own: dict[str, str], device: torch.device) -> tuple[str, dict]:
    """``bench.compile``, then the trainer's ``prepare_step`` (the evaluation's warm-up is
    an extra, ``time_eval``: after the throughput)."""
    impl = trainer.optimizer_impl
    learner = trainer.learner
    if own.get("bench.compile"):
        learner.train_model = torch.compile(learner.model, dynamic=True, backend=own["bench.compile"])
        impl += f" + compile({own['bench.compile']})"
    t0, f0 = time.perf_counter(), _frames()
    notes = _noted(trainer.prepare_step)
    common.sync(device)
    info: dict[str, Any] = {"prepare_s": time.perf_counter() - t0, "compiles_in_prepare": _frames() - f0,
                            **_timings(notes)}
    if notes:
        info["prepare_notes"] = notes
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


def samples_for(batch: int, args, vocab: int, samples_cache: dict) -> list:
    """The Wikipedia-length samples of a local batch, drawn once per run."""
    if batch not in samples_cache:
        samples_cache[batch] = common.make_batches(args.num_batches, batch, args.seq_len, args.max_pred, vocab,
                                                   args.seed)
    return samples_cache[batch]


def run_case(case: Case, args, device: torch.device, peak: float, samples_cache: dict,
             rec: dict | None = None, save: Callable[[], None] = lambda: None) -> dict:
    """One case into ``rec`` (filled in place, so a caller that is stopped mid-extra still
    holds the throughput): skipped with the reason, or measured; ``save()`` after the
    throughput and after each extra."""
    rec = {} if rec is None else rec
    run_extras(rec, measure_case(case, args, device, peak, samples_cache, rec, save), save)
    return rec


Extras = list[tuple[str, Callable[[], dict]]]


def run_extras(rec: dict, extras: Extras, save: Callable[[], None] = lambda: None) -> None:
    """Each extra of ``measure_case`` in its own try, into ``rec``; ``save()`` after each."""
    for name, extra in extras:
        try:
            rec.update(extra())
        except Exception as e:  # noqa: BLE001 - the throughput stands; say which extra failed
            rec.setdefault("extra_errors", {})[name] = f"{type(e).__name__}: {e}"
        save()


def measure_case(case: Case, args, device: torch.device, peak: float, samples_cache: dict,
                 rec: dict, save: Callable[[], None] = lambda: None) -> Extras:
    """The core numbers of one case into ``rec`` (skipped with the reason, or measured;
    ``save()`` once the throughput is in) and its extras, not run: the kernel-class profile
    (a case that asks for one), the evaluation, the optimizer step alone. They hold the
    case's model and graphs until run (or dropped)."""
    rec.update(case=case.name, local_batch=case.batch, overrides=resolved_overrides(case, args))
    if case.recompiles:
        rec["recompiles_by_design"] = case.recompiles
    if args.cpu_smoke:
        rec["smoke_stand_ins"] = {k: SMOKE_STAND_INS[(k, v)] for k, v in rec["overrides"].items()
                                  if (k, v) in SMOKE_STAND_INS}
    try:
        cfg, own = case_config(case, args)
        collate, layout = collate_for(cfg)
    except ConfigError as e:
        rec["status"] = f"skipped: {e}"
        return []
    if args.cpu_smoke and own.get("bench.compile"):
        own["bench.compile"] = "eager"  # see smoke_compile
    samples = samples_for(case.batch, args, cfg.model.vocab_size, samples_cache)
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
    # already compiled (same code and guards: parameters are inputs) reuses it, so a run
    # compiles each variant once (setup_device raises dynamo's recompile limit to hold them).
    t0 = time.perf_counter()
    try:
        trainer = Trainer(cfg, SINGLE, device)
    except (ConfigError, ValueError) as e:  # the trainer's refusal (CUDA graphs or Triton on a CPU)
        rec["status"] = f"skipped: refused at build: {type(e).__name__}: {e}"
        return []
    common.sync(device)
    build_s = time.perf_counter() - t0
    impl, info = prepare_case(trainer, own, device)
    step, learner, feed = trainer.step, trainer.learner, _cycle(on_dev)
    # Every batch of the cycle once at least before the clock starts: a shape seen first
    # inside the timed steps would put its compile (or its eager fallback) in the number.
    f_ready = _frames()
    warm = max(args.warmup, len(on_dev))
    for _ in range(warm):
        step(feed, 1)
    common.sync(device)
    ready_s = time.perf_counter() - t0
    f_warm = _frames()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        loss, _skipped = step(feed, 1)
    common.sync(device)
    secs = time.perf_counter() - t0
    f_timed = _frames()
    done = range(warm, warm + args.steps)  # batch index k % num_batches
    n = len(samples)
    fl = 3 * sum(useful[k % n] for k in done)
    tok = sum(real[k % n] for k in done)
    model = learner.model
    rec.update({
        "status": "ok", "seq_per_s": case.batch * args.steps / secs, "tokens_per_s": tok / secs,
        "step_ms": 1000 * secs / args.steps, "useful_tflops_per_s": fl / secs / 1e12, "mfu": fl / secs / peak,
        "peak_mem_gb": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        "optimizer_impl": impl, "optimizer": type(learner.optimizer).__name__, "param_groups": _flags(learner.optimizer),
        "attention": getattr(getattr(model, "attn_backend", None), "name", None),
        "precision": learner.precision.train, **fp8_label(cfg), "step_kind": step_kind(step),
        "graph_eager_shapes": len(getattr(step, "eager_shapes", ())),
        "token_budget_rungs": list(getattr(layout, "rungs", ())) or None, "batch_shapes": sorted(set(fed)),
        "tokens_real_per_batch": sum(real) / n, "tokens_fed_per_batch": sum(fed) / n,
        "token_padding_frac": sum(fed) / sum(real) - 1, "ready_s": ready_s, "build_s": build_s, **info,
        # Compiles in the untimed steps after the warm-up, and inside the timed ones: 0 for a
        # case whose warm-up prepared it (else recompiles_by_design says why not).
        "compiles_untimed": f_warm - f_ready, "compiles_timed": f_timed - f_warm,
        "compiles_after_prepare": f_timed - f_ready, "final_loss": float(loss)})
    save()
    extras: Extras = [("eval", lambda: time_eval(trainer, device, reps=1 if args.cpu_smoke else 2)),
                      ("optimizer", lambda: {"optimizer_step_ms": time_optimizer(learner.optimizer, device)})]
    if case.profile:  # last: its eager steps leave the graphs' gradients behind
        extras.append(("kernel_breakdown", lambda: profile_eager(learner, feed, device)))
    return extras


def profile_eager(learner, feed, device: torch.device, steps: int = 3) -> dict:
    """The kernel-class profile (bench/kernel_profile.py) of ``steps`` *eager* steps of the
    case's model (its compiled layers, its optimizer), after one unprofiled eager step: the
    kernels a graph replays, each timed by CUPTI outside any graph. Not the replays
    themselves: CUPTI before CUDA 13.1 times graph kernels wrongly, and a profiler first
    started after a capture is a known way to break later replays (BENCHMARKS.md section 3).
    Its eager steps set the gradients to None, so the case's graphs are not replayed after it."""
    eager = functools.partial(train_step, learner)
    eager(feed, 1)
    common.sync(device)
    out = kernel_profile.breakdown(lambda: [eager(feed, 1) for _ in range(steps)], steps, device)
    out["profiled"] = f"{steps} eager steps of the case's model (graph replays are not profiled)"
    return {"kernel_breakdown": out}


def time_eval(trainer: Trainer, device: torch.device, reps: int = 2) -> dict[str, Any]:
    """The trainer's evaluation made ready as a run makes it (``Trainer.prepare_eval``: its
    warm-up, and with CUDA graphs its capture) then timed (``bert.evaluate.mlm_accuracy``)
    over synthetic eval batches of the shapes a run evaluates (one per eval budget rung;
    ``Trainer.eval_warmup_batches``) after one untimed pass: ms per batch of
    ``eval.batch_size`` samples; the compiles of its warm-up, and after it (0)."""
    f0 = _frames()
    notes = _noted(trainer.prepare_eval)
    f1 = _frames()
    learner, batches = trainer.learner, trainer.eval_warmup_batches()
    args = (learner.model, batches, device, learner.precision.eval_autocast, trainer.eval_counts)
    mlm_accuracy(*args)
    common.sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        mlm_accuracy(*args)
    common.sync(device)
    ms = 1000 * (time.perf_counter() - t0) / (reps * len(batches))
    return {"eval_ms_per_batch": ms, "eval_seq_per_s": trainer.cfg.eval.batch_size * 1000 / ms,
            "eval_batch_shapes": len(batches), "eval_step_kind": type(args[-1]).__name__ if args[-1] else "eager",
            "eval_compiles_in_prepare": f1 - f0, "eval_compiles": _frames() - f1, **_timings(notes)}


def fp8_label(cfg: Config) -> dict[str, str]:
    """What a case's GEMMs ran in, and what its MFU is against: FP8 cases are labelled (the
    peak measured is bf16's; FP8 tensor cores peak at about twice that)."""
    recipe = cfg.precision.fp8
    if recipe == "off":
        return {"fp8": "off"}
    return {"fp8": recipe, "mfu_note": f"FP8 {recipe} GEMMs in the encoder; MFU against the bf16 GEMM peak"}


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


class nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def record_failure(rec: dict, e: Exception) -> None:
    """What ended a task, into its record (called in its ``except``): ``oom`` or ``error:
    <what>`` as its status, unless a case's throughput was already in (status ``ok``
    stays), and the traceback."""
    if rec.get("status") != "ok":
        rec["status"] = "oom" if isinstance(e, torch.OutOfMemoryError) else f"error: {type(e).__name__}: {e}"
    rec["traceback"] = traceback.format_exc(limit=6)


def report(name: str, r: dict) -> None:
    """One printed line per task."""
    if r.get("status") == "ok" and "seq_per_s" in r:
        print(f"{name:28s} b={r['local_batch']:3d} {r['seq_per_s']:8.1f} seq/s  MFU {r['mfu']:6.1%}  "
              f"{r['step_ms']:8.1f} ms/step  mem {r['peak_mem_gb'] or 0:6.1f} GB  {r['optimizer_impl']}  "
              f"{r['attention']}  {r['step_kind']}" + (f"  extras failed: {sorted(r['extra_errors'])}"
                                                       if r.get("extra_errors") else ""), flush=True)
    else:
        summary = {k: v for k, v in r.items()
                   if k in ("chosen", "passed", "failed", "error", "checker", "run_stop", "time_to_target_s")}
        print(f"{name:28s} {r.get('status')}  {json.dumps(summary)}", flush=True)
