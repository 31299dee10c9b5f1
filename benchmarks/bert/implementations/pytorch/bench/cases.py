"""The model's benchmark cases: BERT-Large phase 2 (seq 512) train steps, each technique on
and off, as config overrides. bench/gpu_bert_large.py runs them one after another;
bench/device_run.py orders them within its one time-limited device call; bench/measure.py
measures one. Nothing here imports torch: the plan is read before anything is built.

**Cases are config overrides.** Each case is a dict of dotted keys applied with the trainer's
own ``bert.config.build_config`` and built by the trainer itself (bench/measure.py says how).
A new speed feature is therefore a new case, or ``--case NAME:key=value,...``, never new code.
Keys under ``bench.`` are the scripts' own (``bench.compile=BACKEND``: the whole model under
``torch.compile``, dynamic shapes). The fast stack's attention backend is ``--fast-attention``
(the device run passes the one its attention check chose); the case records it.

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
