"""BERT-Large phase 2 (seq 512) train-step throughput on one GPU, each technique on and off.

    python bench/gpu_bert_large.py --out results/gpu.json --commit SHA   # on a GPU, every case
    python bench/gpu_bert_large.py --only fast_b96,fast_b16 --out X.json # chosen cases
    python bench/gpu_bert_large.py --cpu-smoke --out /tmp/smoke.json     # every path, tiny, CPU

The throughput script: it runs cases one after another and writes the JSON after each.
The device's one time-limited call (the attention check first, the GPU tests, the window,
the order) is bench/device_run.py's, which runs these cases through ``run_case``;
``python bench/gpu_report.py FILE`` prints a result's table.

**Cases are config overrides.** Each case is a dict of dotted keys applied with the trainer's
own ``bert.config.build_config`` and built by the trainer itself (``bert.trainer.Trainer``:
model, precision, gradient sync with global-norm clip 1.0, ``bert.optim.build_optimizer``,
schedule), then run with the trainer's own step, prepared by ``Trainer.prepare_step`` (warm-up
on synthetic batches and, with ``run.cuda_graphs``, the captured step of bert/step_graph.py).
A new speed feature is therefore a new case, or ``--case NAME:key=value,...``, never new code.
A case whose key or value this tree does not know (``ConfigError``), or that the trainer
refuses at build time (``run.cuda_graphs`` or Triton attention on a CPU), is recorded as
``status: "skipped: ..."`` with the reason. Keys under ``bench.`` are the script's own
(``bench.compile=BACKEND``: the whole model under ``torch.compile``, dynamic shapes). The
fast stack's attention backend is ``--fast-attention`` (the device run passes the one its
attention check chose); the case records it.

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

**The fast stack's fallbacks.** ``headline_attempts`` lists, for the headline's batch, the
fast stack and the stacks that drop one thing at a time (CUDA graphs, the per-layer compile,
both, then the other attention backends); ``fast_stack_changes`` is what an attempt changes
from the fast stack, and ``--fast-stack`` (key=value,...) applies such changes to every later
case built on the fast stack (``resolved_overrides``), so that what broke the fast stack is
not tried again by each of them.
"""

from __future__ import annotations

import argparse
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

# The fast stack's attention backends in the order the device run prefers them, the first
# whose check passed being its choice: our Triton varlen kernel with dropout, SDPA on nested
# jagged tensors (torch's flash kernel with dropout), SDPA on the padded grid (ran on an
# H200 before).
FAST_BACKENDS = ("triton", "nested", "sdpa")
CHOSEN = "chosen"  # FAST's attention value: replaced by --fast-attention when a case is built
# The fast stack: static token budgets, the step replayed as
# CUDA graphs after a warm-up before run_start (LAMB capturable: its foreach kernels replay
# from the graph without launch cost), inductor per encoder layer.
FAST = {"model.attention_backend": CHOSEN, "data.token_budgets": "auto", "run.cuda_graphs": "true",
        "run.warmup_steps": "1", "model.compile_layers": "true"}
# The first stack measured on the device (BENCHMARKS.md section 3 has its seq/s): SDPA on the
# padded grid, the config's LAMB (foreach without apex), eager.
BASELINE = {"model.attention_backend": "sdpa"}


@dataclasses.dataclass
class Case:
    """A throughput case: dotted config overrides (``run.local_batch_size`` included) and
    the script's own ``bench.*`` keys; ``est_s`` = its expected seconds on the device
    (cold compile caches, warm ones); ``profile``: also the kernel-class profile;
    ``recompiles``: why it compiles after its warm-up by design (said in its record), empty
    for a case that must not."""

    name: str
    overrides: dict[str, str]
    est_s: tuple[float, float] = (40.0, 30.0)
    profile: bool = False
    recompiles: str = ""

    @property
    def batch(self) -> int:
        return int(self.overrides["run.local_batch_size"])


def _case(name: str, batch: int, est: tuple[float, float] = (40.0, 30.0), profile: bool = False,
          recompiles: str = "", **groups: dict[str, str]) -> Case:
    over: dict[str, str] = {}
    for g in groups.values():
        over.update(g)
    over["run.local_batch_size"] = str(batch)
    return Case(f"{name}_b{batch}", over, est, profile, recompiles)


def without(base: dict[str, str], *keys: str, **changes: str) -> dict[str, str]:
    out = {k: v for k, v in base.items() if k not in keys}
    out.update({k.replace("__", "."): v for k, v in changes.items()})
    return out


# Expected seconds per case (cold caches, warm caches) on the device's host, for the time
# table the device run prints first and for its skip rule (bench/results/ records each
# task's true seconds, ``task_s``, to correct these):
# - eager BERT-Large at b16: the model built on the GPU (~2 s), 8 untimed + 20 timed steps
#   (~0.1 s each), the extras: ~15 s;
# - the fast stack's first case: inductor on one encoder layer, forward and backward
#   (dynamic shapes: once for every rung), plus one graph capture per rung: ~110 s cold,
#   ~35 s with the carried inductor/Triton caches; its evaluation (the layer's no-grad
#   compile, one eval graph per rung) ~40 s more cold, the device run's headline_extras;
# - a further case of the same backend reuses the compiled layer: its graphs and steps
#   only (~40 s at b96); another backend or FP8 compiles its own layer (~90 s cold);
# - compiled LAMB: inductor over BERT-Large's 398 tensors (153 s on the 2-core CPU here,
#   bench/lamb_step.py): ~150 s cold on the device's host, ~45 s warm.
EST_EAGER_SMALL = (15.0, 15.0)
EST_FAST_FIRST = (110.0, 35.0)
EST_SAME_COMPILE = (45.0, 40.0)
EST_NEW_COMPILE = (90.0, 45.0)
EST_COMPILED_LAMB = (150.0, 50.0)
# The old dynamic-shape stack: no warm-up before its timing starts, so its compiles come in
# its untimed steps.
WHOLE_MODEL_COMPILE = ("bench.compile: the whole model compiles at its first (untimed) steps, as the "
                       "first measured stack did without a warm-up before run_start; dynamic shapes: a frame per "
                       "graph break, and a recompile when a size first varies")


def head_cases(small: int, big: int) -> list[Case]:
    """What the device run measures first: the baseline stack (BASELINE: the defaults, SDPA attention) at
    ``small``, the fast stack at ``big`` (the headline; with the kernel-class profile) and
    at ``small``."""
    return [_case("baseline", small, EST_EAGER_SMALL, a=BASELINE),
            _case("fast", big, EST_FAST_FIRST, profile=True, f=FAST),
            _case("fast", small, EST_SAME_COMPILE, f=FAST)]


def fp8_case(big: int) -> Case:
    """FP8 GEMMs in the encoder (bert/fp8.py, torchao's tensorwise recipe) on the fast stack.
    torchao's conversion patches inductor's Triton min/max codegen for the rest of the
    process (numerically the same; bert/fp8.py): the cases after it compile with the patch."""
    return _case("fast_fp8_tensorwise", big, EST_NEW_COMPILE, f=without(FAST, precision__fp8="tensorwise"))


def levers(big: int) -> list[Case]:
    """The speed levers not yet on by default, each alone on the fast stack at ``big``
    (bert/config.py holds their switches, off; BENCHMARKS.md section 3 their estimated gains):
    the Triton kernel's dropout mask stored as bits and its 128x64 forward tile (cases of the
    triton backend only: bench/device_run.py skips them when the fast stack runs another),
    one bias correction per LAMB group, the residual stream in bf16. **A new lever is a new
    entry here** (a ``_case`` with its overrides and expected seconds)."""
    return [_case("fast_mask_bits", big, EST_NEW_COMPILE, f=without(FAST, model__triton_dropout_mask="bits")),
            _case("fast_fwd_tile_128x64", big, EST_NEW_COMPILE, f=without(FAST, model__triton_fwd_tile="128x64")),
            _case("fast_lamb_group_correction", big, EST_SAME_COMPILE,
                  f=without(FAST, optim__lamb_bias_correction="group")),
            _case("fast_autocast_residual", big, EST_NEW_COMPILE, f=without(FAST, model__autocast_residual="true"))]


# Keys a triton-only lever sets, with the value that is off.
TRITON_LEVERS = {"model.triton_dropout_mask": "philox", "model.triton_fwd_tile": "64x64"}


# The fallbacks of the headline, in order: what each drops from the fast stack.
NO_GRAPHS = {"run.cuda_graphs": "false"}
NO_COMPILE = {"model.compile_layers": "false"}
EST_EAGER_BIG = (40.0, 40.0)


def headline_attempts(big: int, chosen: str) -> list[Case]:
    """The headline's stacks at ``big``, tried in order until one measures: the fast stack on
    the ``chosen`` backend, then without CUDA graphs, without the per-layer compile, without
    both, then each backend after ``chosen`` in FAST_BACKENDS, whole and without both. Each
    drops what the one before it may have broken: a capture, a compile, the kernel."""
    out = [_case("fast", big, EST_FAST_FIRST, f=FAST),
           _case("fast_no_graphs", big, EST_NEW_COMPILE, f=without(FAST, **_kw(NO_GRAPHS))),
           _case("fast_no_compile_layers", big, EST_EAGER_BIG, f=without(FAST, **_kw(NO_COMPILE))),
           _case("fast_eager", big, EST_EAGER_BIG, f=without(FAST, **_kw({**NO_GRAPHS, **NO_COMPILE})))]
    for b in FAST_BACKENDS[FAST_BACKENDS.index(chosen) + 1:]:
        out += [_case(f"fast_{b}", big, EST_NEW_COMPILE, f=without(FAST, model__attention_backend=b)),
                _case(f"fast_{b}_eager", big, EST_EAGER_BIG,
                      f=without(FAST, model__attention_backend=b, **_kw({**NO_GRAPHS, **NO_COMPILE})))]
    return [dataclasses.replace(c, profile=True) for c in out]  # whichever measures is the headline


def _kw(over: dict[str, str]) -> dict[str, str]:
    """Dotted keys as ``without``'s keyword names."""
    return {k.replace(".", "__"): v for k, v in over.items()}


def fast_stack_changes(case: Case, args) -> dict[str, str]:
    """What ``case`` (an attempt of ``headline_attempts``) changes from the fast stack, the
    attention backend resolved: the changes ``--fast-stack`` then applies to later cases."""
    over = resolved_overrides(case, args)
    fast = {k: (args.fast_attention if v == CHOSEN else v) for k, v in FAST.items()}
    return {k: over[k] for k in fast if over.get(k) != fast[k]}


def ablations(big: int) -> list[Case]:
    """One technique of the fast stack off or swapped at ``big``, ordered by what a GPU
    default depends on: CUDA graphs, the other attention backends (the chosen one is the
    headline itself), LAMB's variant, the per-layer compile, the model's levers (the fused
    QKV projection, the padded vocabulary), FP8's rowwise recipe."""
    return [_case("fast_no_graphs", big, EST_SAME_COMPILE, f=without(FAST, run__cuda_graphs="false")),
            *[_case(f"fast_{b}", big, EST_NEW_COMPILE, f=without(FAST, model__attention_backend=b))
              for b in FAST_BACKENDS],
            _case("fast_compiled_lamb", big, EST_COMPILED_LAMB, f=without(FAST, optim__impl="compiled")),
            _case("fast_no_compile_layers", big, (40.0, 40.0), f=without(FAST, model__compile_layers="false")),
            _case("fast_no_fused_qkv", big, EST_NEW_COMPILE, f=without(FAST, model__fused_qkv="false")),
            _case("fast_vocab_unpadded", big, EST_SAME_COMPILE, f=without(FAST, model__vocab_pad_multiple="1")),
            _case("fast_fp8_rowwise", big, EST_NEW_COMPILE, f=without(FAST, precision__fp8="rowwise"))]


def other_cases(big: int, old: int, fast_sweep: list[int], default_sweep: list[int]) -> list[Case]:
    """The rest, for a run with time left or a rerun's ``--only``: budgets off, budgets or
    compiled LAMB alone on the default stack, the AdamW pair, the sweeps, the first measured
    stack's cases at ``old``."""
    return [
        # CUDA graphs need static shapes: without budgets the graphs go too.
        _case("fast_no_budget_no_graphs", big, EST_SAME_COMPILE,
              f=without(FAST, data__token_budgets="", run__cuda_graphs="false")),
        _case("default_budget", big, (30.0, 30.0), o={"data.token_budgets": "auto", "run.warmup_steps": "1"}),
        _case("default_compiled_lamb", big, EST_COMPILED_LAMB, o={"optim.impl": "compiled"}),
        _case("adamw_fused", old, EST_EAGER_SMALL, o={"optim.name": "adamw", "optim.impl": "fused"}),
        _case("adamw_foreach", old, EST_EAGER_SMALL, o={"optim.name": "adamw", "optim.impl": "foreach"}),
        *[_case("fast", b, EST_SAME_COMPILE, f=FAST) for b in fast_sweep],
        *[_case("default", b, (20.0, 20.0)) for b in default_sweep],
        _case("padded", old, (20.0, 20.0), m={"model.unpad": "false"}),
        _case("lamb_foreach", old, EST_EAGER_SMALL, o={"optim.impl": "foreach"}),
        _case("compiled", old, EST_NEW_COMPILE, recompiles=WHOLE_MODEL_COMPILE, b={"bench.compile": "inductor"}),
    ]


def all_cases(args) -> list[Case]:
    """Every case in the order this script runs them (names once: the smoke's small batches
    repeat some), then ``--case`` ones."""
    out, seen = [], set()
    for c in (head_cases(args.small, args.big) + [fp8_case(args.big)] + levers(args.big) + ablations(args.big)
              + other_cases(args.big, args.old, args.fast_sweep, args.default_sweep) + args.case):
        if c.name not in seen:
            seen.add(c.name)
            out.append(c)
    return out


def parse_case(text: str) -> Case:
    """``NAME:key=value,key=value`` (``run.local_batch_size`` required) -> Case."""
    name, sep, rest = text.partition(":")
    over = dict(kv.split("=", 1) for kv in rest.split(",") if kv)
    if not sep or not name or "run.local_batch_size" not in over:
        raise argparse.ArgumentTypeError(f"--case {text!r}: expected NAME:run.local_batch_size=N[,key=value...]")
    return Case(name, over)


def parse_stack(text: str) -> dict[str, str]:
    """``key=value,...`` (keys of the fast stack) -> dict."""
    out = dict(kv.split("=", 1) for kv in text.split(",") if kv and "=" in kv)
    if any(kv and "=" not in kv for kv in text.split(",")) or set(out) - set(FAST):
        raise argparse.ArgumentTypeError(f"--fast-stack {text!r}: expected key=value,... with keys of {sorted(FAST)}")
    return out


def add_case_args(ap: argparse.ArgumentParser) -> None:
    """The options that shape the cases (this script's and bench/device_run.py's)."""
    ap.add_argument("--small", type=int, default=16, help="the small local batch (baseline, fast, fp16)")
    ap.add_argument("--big", type=int, default=96, help="the large local batch (the headline, the ablations)")
    ap.add_argument("--old", type=int, default=32, help="local batch of the first measured stack's on/off cases")
    ap.add_argument("--fast-sweep", type=lambda s: [int(x) for x in s.split(",") if x], default=[32, 48, 64])
    ap.add_argument("--default-sweep", type=lambda s: [int(x) for x in s.split(",") if x], default=[32, 64, 96])
    ap.add_argument("--case", type=parse_case, action="append", default=[],
                    help="an extra case NAME:run.local_batch_size=N,key=value,... (run after the others)")
    ap.add_argument("--fast-attention", choices=FAST_BACKENDS, default=FAST_BACKENDS[0],
                    help="the fast stack's attention backend (the device run passes its attention check's choice)")
    ap.add_argument("--fast-stack", type=parse_stack, default={},
                    help="key=value,...: changes to every case built on the fast stack where it has the fast "
                         "stack's value for that key (e.g. run.cuda_graphs=false; the device run sets them from "
                         "the headline's fallback)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--num-batches", type=int, default=8, help="distinct batches cycled through")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--max-pred", type=int, default=76)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="tiny model on the CPU, 1+1 steps per case, torch.compile through dynamo's eager "
                         "backend: exercises every path and the output file, measures nothing")


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


# ---------------------------------------------------------------- building a case


def resolved_overrides(case: Case, args) -> dict[str, str]:
    """The case's overrides with the fast stack's attention backend filled in, and
    ``args.fast_stack``'s changes where the case has the fast stack's value of a key."""
    stack = getattr(args, "fast_stack", {})
    out = {}
    for k, v in case.overrides.items():
        if k in stack and v == FAST[k]:
            v = stack[k]
        out[k] = args.fast_attention if (k, v) == ("model.attention_backend", CHOSEN) else v
    return out


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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="results/gpu_bert_large.json")
    ap.add_argument("--commit", default="", help="the commit measured; default: git rev-parse HEAD")
    ap.add_argument("--only", default="", help="comma-separated case names to run")
    add_case_args(ap)
    args = ap.parse_args(argv)
    device = setup_device(args)
    if device is None:
        print("no CUDA device: use --cpu-smoke to check the script on a CPU", file=sys.stderr)
        return 2
    cases = all_cases(args)
    only = set(filter(None, args.only.split(",")))
    names = [c.name for c in cases]
    if only - set(names):
        print(f"--only: not a case: {sorted(only - set(names))}; the cases: {names}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    commit, source = (args.commit, "--commit") if args.commit else provenance.git_commit()
    peak = gemm_peak(args, device)
    result = run_header(args, device, peak, commit, source)
    samples_cache: dict[int, list] = {}

    def save() -> None:
        out.write_text(json.dumps(result, indent=2) + "\n")

    with smoke_compile() if args.cpu_smoke else nothing():
        for case in cases:
            if only and case.name not in only:
                continue
            rec: dict[str, Any] = {}
            result["cases"].append(rec)
            t0 = time.perf_counter()
            try:
                run_case(case, args, device, peak["flops_per_s"], samples_cache, rec, save)
            except Exception as e:  # noqa: BLE001 - keep the other results; say what failed
                record_failure(rec, e)
            rec["task_s"] = time.perf_counter() - t0
            save()
            report(case.name, rec)
    print(f"bf16 GEMM peak {result['gemm_peak_tflops']:.1f} TFLOP/s (n={peak['n']}); wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
