"""The one time-limited device call: what runs, in which order, and within which window.

    bench/h200.sh                                                   # on the device: runs this
    python bench/device_run.py --out X.json --limit-s 440           # the same, by hand
    python bench/device_run.py --cpu-smoke --out results/dry.json   # the dry run on a CPU

The order (``plan``), so that a run cut short keeps what matters most:

1. ``check_attention``: tests/integration/test_gpu.py's attention tests in child processes (their own
   CUDA contexts: a sticky CUDA error ends that child, not this run), Triton in one, Triton
   with its speed levers in another, nested and SDPA in a third, side by side; the fast
   stack's backend is the first of triton, nested whose test passed, else sdpa
   (``fast_attention`` and ``checks.attention`` record the choice and every verdict); a case
   on a backend whose test failed is skipped, but for sdpa, the last resort (its cases run
   and carry the verdict, ``attention_check``); when no test ran at all (every child failed
   to start), or none passed under an exclusive compute mode (``gpu_state``), the check is
   inconclusive, blocks nothing, and the headline's fallbacks find out;
2. ``baseline`` at the small batch (16): the first measured stack (``BASELINE``), this run's own baseline;
3. ``headline`` at the big batch (96): the fast stack, and if it fails, at once the stacks of
   ``cases.headline_attempts`` in turn (CUDA graphs off, the per-layer compile off,
   both, then the next attention backends) until one measures: that one is the headline
   (``headline`` in the JSON: which case and stack, and every attempt's status, so why the
   others did not), and every later case built on the fast stack drops what it dropped
   (``fast_stack_changes``); each case's core numbers only (its optimizer step alone too),
   the headline's evaluation and kernel-class profile later (7.);
4. ``fast`` at 16; ``check_gpu``: the other tests of tests/integration/test_gpu.py in a child
   (fp16 loss scaling on BERT-Large, graphed steps equal to eager ones);
5. ``fast_fp8_tensorwise`` at 96;
6. the speed levers at 96 (``cases.levers``: the Triton mask stored as bits, its
   128x64 forward tile, LAMB's group bias correction, the bf16 residual stream);
7. ``headline_extras``: the headline's evaluation (warm-up, capture, timing) and its
   kernel-class profile (eager steps of its model: no profiler over graph replays), after
   the core numbers; its expected seconds are kept free by every task before it, and the
   headline's model and graphs held on the device until then;
8. ``check_attention_blocks`` (the Triton block-size sweep, if triton passed), the ablations
   (``cases.ablations``), ``check_demo`` (the demo to 0.720 and the MLPerf
   checker), then the other cases.

The window: ``--limit-s`` counts from this process's start (so the interpreter's and
torch's start-up count too; bench/h200.sh passes what is left of its own limit). Before
anything runs, the expected seconds of every task are printed with their running sum. A
task whose expected seconds exceed what is left (less ``--margin-s`` for writing the
results) is skipped with that reason and the next one is tried; a task that runs past its
cap -- ``--cap-factor`` (2) times its cold expected seconds, at most ``--task-limit-s`` when
given -- or into the margin, is stopped and recorded. The JSON is rewritten
after every task and inside a case as soon as its throughput is measured (its extras
follow); SIGTERM (the wrapper's timeout) records the task in flight and writes the JSON.
Should a case leave the CUDA context broken (a sticky error: the device no longer answers a
small operation), the run restarts in a fresh process of its own (exec: the same process,
so the limit keeps counting from the same start) with ``--resume``, which skips what the
JSON already holds.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import attention_blocks, cases, demo_check, measure, provenance  # noqa: E402
from bench.common import PKG  # noqa: E402

IMPORTED = time.monotonic()
MAX_RESTARTS = 3  # fresh processes after a broken CUDA context, at most (each skips what is done)


@dataclasses.dataclass
class Check:
    """A task that is not a throughput case (``attention``, ``gpu``, ``attention_blocks``,
    ``demo``); its result goes under ``checks``. ``est_s``: expected seconds (cold, warm)."""

    name: str
    est_s: tuple[float, float]


@dataclasses.dataclass
class Headline:
    """The headline at the big batch: ``cases.headline_attempts`` in turn until one
    measures (each a case of its own in ``cases``); ``est_s``: the first attempt's."""

    name: str
    est_s: tuple[float, float]


@dataclasses.dataclass
class HeadlineExtras:
    """The headline case's extras (evaluation, kernel-class profile), run after the core
    numbers of the cases before it; its ``est_s`` is kept free by every task before it."""

    name: str
    est_s: tuple[float, float]


Task = cases.Case | Check | Headline | HeadlineExtras


def plan(args) -> list[Task]:
    """Every task in the order of the module docstring (names once), then ``--case`` ones."""
    baseline, fast_big, fast_small = cases.head_cases(args.small, args.big)
    tasks = [Check("attention", (45.0, 25.0)), baseline, Headline("headline", fast_big.est_s), fast_small,
             Check("gpu", (45.0, 35.0)), cases.fp8_case(args.big), *cases.levers(args.big),
             HeadlineExtras("headline_extras", (60.0, 20.0)), Check("attention_blocks", (30.0, 12.0)),
             *cases.ablations(args.big), Check("demo", (60.0, 50.0)),
             *cases.other_cases(args.big, args.old, args.fast_sweep, args.default_sweep), *args.case]
    out, seen = [], set()
    for t in tasks:
        if task_name(t) not in seen:
            seen.add(task_name(t))
            out.append(t)
    return out


def task_name(task: Task) -> str:
    return f"check_{task.name}" if isinstance(task, Check) else task.name


def process_age_s() -> float:
    """Seconds since this process started: its start time in /proc/self/stat (clock ticks
    since boot) against the boot clock; where /proc is not there, since this module loaded."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        if age >= 0:
            return age
    except (OSError, ValueError, IndexError, AttributeError):
        pass
    return time.monotonic() - IMPORTED


def time_table(tasks: list, warm: bool, limit_s: float, start_s: float) -> str:
    """Every task's expected seconds and their running sum from ``start_s`` (the process's
    age now), marking those expected to end past ``limit_s``: printed before anything runs."""
    col = 1 if warm else 0
    lines = [f"plan ({'warm' if warm else 'cold'} compile caches): expected seconds per task, and the process's "
             f"age at its end (now {start_s:.0f} s)", f"  {'task':34s} {'est':>6s} {'ends':>7s}"]
    t, late = start_s, 0
    for task in tasks:
        t += task.est_s[col]
        over = bool(limit_s) and t > limit_s
        late += over
        lines.append(f"  {task_name(task):34s} {task.est_s[col]:6.0f} {t:7.0f}{'  (past the limit)' if over else ''}")
    lines.append(f"  expected in all: {t - start_s:.0f} s" + (f"; the limit: {limit_s:.0f} s from the process's start; "
                                                            f"{late} task(s) expected past it" if limit_s else ""))
    return "\n".join(lines)


# ---------------------------------------------------------------- child processes: tests/integration/test_gpu.py


def start_pytest(node_ids: list[str], junit: Path) -> subprocess.Popen:
    """pytest on ``node_ids`` in a child process (a session of its own, so a stop ends the
    whole group), its verdicts into ``junit`` (xunit1: the tests' record_property entries)."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "junit_family=xunit1",
           f"--junitxml={junit}", f"--basetemp={junit.with_suffix('.tmp')}", *node_ids]
    return subprocess.Popen(cmd, cwd=PKG, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def wait_all(procs: list[subprocess.Popen], timeout_s: float) -> list[tuple[int | None, str]]:
    """(exit status or None when stopped at ``timeout_s``, output) of each child; any
    exception here (this task's time limit, SIGTERM) ends every child's group first."""
    out: list[tuple[int | None, str]] = []
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            try:
                text, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
                out.append((p.returncode, text))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                text, _ = p.communicate()
                out.append((None, text))
    except BaseException:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        raise
    return out


def junit_verdicts(path: Path) -> dict[str, dict]:
    """Per test (its name, e.g. ``test_x[triton]``): ``outcome`` (passed, failed, error,
    skipped), ``message``, ``seconds`` and its recorded properties (JSON-decoded)."""
    out = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        rec: dict[str, Any] = {"outcome": "passed", "seconds": float(case.get("time", 0))}
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                rec["outcome"] = {"failure": "failed"}.get(tag, tag if tag == "error" else "skipped")
                rec["message"] = (el.get("message") or el.text or "")[:2000]
        for prop in case.iter("property"):
            try:
                rec[prop.get("name")] = json.loads(prop.get("value"))
            except (TypeError, ValueError):
                rec[prop.get("name")] = prop.get("value")
        out[case.get("name")] = rec
    return out


def run_tests(groups: list[list[str]], tmp: Path, timeout_s: float) -> dict[str, dict]:
    """Each group of tests/integration/test_gpu.py's tests in a child process of its own, side by side;
    every test's verdict (``junit_verdicts``), or what ended a child that left none."""
    junits = [tmp / f"tests_{os.getpid()}_{i}_{time.monotonic_ns()}.xml" for i in range(len(groups))]
    procs = [start_pytest([f"tests/integration/test_gpu.py::{t}" for t in g], j) for g, j in zip(groups, junits)]
    verdicts: dict[str, dict] = {}
    for group, junit, (rc, text) in zip(groups, junits, wait_all(procs, timeout_s)):
        found = junit_verdicts(junit) if junit.exists() else {}
        for test in group:
            for name, rec in found.items():
                if name == test or name.startswith(f"{test}["):
                    verdicts[name] = rec
            if not any(n == test or n.startswith(f"{test}[") for n in found):
                why = "stopped at its time limit" if rc is None else f"the child ended with exit {rc} and no verdict"
                verdicts[test] = {"outcome": "error", "message": f"{why}: {text[-1500:]}"}
    return verdicts


ATTENTION_TEST = "test_attention_matches_fp32_reference"


def check_attention(tmp: Path, timeout_s: float, exclusive: bool = False) -> dict:
    """The attention tests in three children (Triton alone, and with its levers alone: the
    new kernels are the likeliest to break their context) and the fast stack's backend from
    their verdicts. Inconclusive when no backend passed and either no test ran (every
    verdict an error without a test's own outcome: the children could not start) or the GPU
    is in an exclusive compute mode (``exclusive``: this process holds the one context it
    allows, so every child fails at its first CUDA call): then nothing is blocked and the
    fast stack takes the first backend, which the headline's fallbacks test for real."""
    verdicts = run_tests([[f"{ATTENTION_TEST}[triton]"], [f"{ATTENTION_TEST}[triton_levers]"],
                          [f"{ATTENTION_TEST}[nested]", f"{ATTENTION_TEST}[sdpa]"]], tmp, timeout_s)

    def verdict(name: str) -> dict:
        return verdicts.get(f"{ATTENTION_TEST}[{name}]", {"outcome": "error", "message": "no verdict"})

    backends = {b: verdict(b) for b in cases.FAST_BACKENDS}
    out = {"status": "ok", "backends": backends, "triton_levers": verdict("triton_levers")}
    none_ran = all(v["outcome"] == "error" and "seconds" not in v for v in backends.values())
    if none_ran or (exclusive and not any(v["outcome"] == "passed" for v in backends.values())):
        cause = ("no attention test ran (every child failed before its tests)" if none_ran else
                 "no attention test passed, in an exclusive compute mode (a child cannot open a context)")
        out.update(inconclusive=True, chosen=cases.FAST_BACKENDS[0],
                   why=f"{cases.FAST_BACKENDS[0]}: {cause}; the headline's fallbacks try the backends in turn")
        return out
    passed = [b for b in cases.FAST_BACKENDS[:-1] if backends[b]["outcome"] == "passed"]
    chosen = passed[0] if passed else cases.FAST_BACKENDS[-1]
    why = (f"{chosen}: the first of {list(cases.FAST_BACKENDS[:-1])} whose check passed" if passed
           else f"sdpa: neither of {list(cases.FAST_BACKENDS[:-1])} passed its check")
    out.update(chosen=chosen, why=why)
    return out


def check_gpu(tmp: Path, timeout_s: float) -> dict:
    verdicts = run_tests([["test_fp16_loss_scaling_on_bert_large", "test_graphed_steps_equal_eager_steps"]], tmp,
                         timeout_s)
    counts = {o: sum(v["outcome"] == o for v in verdicts.values()) for o in ("passed", "failed", "error", "skipped")}
    return {"status": "ok", "tests": verdicts, **counts}


def check_attention_blocks(args, device: torch.device, samples_cache: dict) -> dict:
    """The block-size sweep on a training micro-batch of the small local batch (the
    Wikipedia lengths, padded to its budget rung, 16 heads of 64, bf16, dropout 0.1)."""
    if device.type != "cuda":
        return {"status": "skipped: the Triton kernels run on CUDA only"}
    from bert import budget
    from bert.trainer import train_layout

    cfg, _ = measure.case_config(cases._case("blocks", args.small, f=cases.FAST), args)
    samples = measure.samples_for(args.small, args, cfg.model.vocab_size, samples_cache)
    batch = budget.BudgetCollate(train_layout(cfg, 1))(samples[0])
    return attention_blocks.sweep(batch["cu_seqlens"].to(device), int(batch["input_ids"].numel()),
                                  cfg.model.num_heads, cfg.model.hidden_size // cfg.model.num_heads,
                                  cfg.data.max_seq_length, device)


# ---------------------------------------------------------------- the run


class TaskTimeout(BaseException):
    """A task ran past its share of the window (BaseException: no ``except Exception``
    inside torch or the trainer swallows it)."""


class Terminated(BaseException):
    """SIGTERM (the wrapper's ``timeout``): record the task in flight, write the JSON, stop."""


def _raise(exc: type[BaseException]) -> Callable:
    def handler(signum, frame):
        raise exc()
    return handler


def cuda_alive(device: torch.device) -> bool:
    """Whether the device still answers a small operation (False: a sticky error broke the
    context, and nothing more can run in this process)."""
    if device.type != "cuda":
        return True
    try:
        torch.ones(1, device=device).add_(1).item()
        torch.cuda.synchronize(device)
        return True
    except Exception:  # noqa: BLE001 - any error here means the context is gone
        return False


def attention_verdict(case: cases.Case, args, result: dict) -> str:
    """The attention check's outcome for ``case``'s backend ("" when unchecked): for a case
    with a Triton lever on, the check of the kernel with its levers."""
    over = cases.resolved_overrides(case, args)
    att = result["checks"].get("attention", {})
    if over.get("model.attention_backend") == "triton" and triton_levers_on(over):
        return att.get("triton_levers", {}).get("outcome", "")
    return att.get("backends", {}).get(over.get("model.attention_backend"), {}).get("outcome", "")


def triton_levers_on(over: dict[str, str]) -> list[str]:
    """The Triton levers a case's overrides turn on (``cases.TRITON_LEVERS``)."""
    return [k for k, off in cases.TRITON_LEVERS.items() if over.get(k, off) != off]


def blocked(case: cases.Case, args, result: dict) -> str:
    """Why ``case`` must not run: its attention backend failed the check (but sdpa, the last
    resort, which ran on this GPU before: its cases run and carry the verdict; and nothing
    when the check was inconclusive), a Triton lever on another backend (the same stack
    again), or another case already ran with the same overrides ("" when it may run)."""
    over = cases.resolved_overrides(case, args)
    backend, verdict = over.get("model.attention_backend"), attention_verdict(case, args, result)
    if triton_levers_on(over) and backend != "triton":
        return f"skipped: {', '.join(triton_levers_on(over))}: a lever of the triton backend, the fast stack runs {backend}"
    inconclusive = result["checks"].get("attention", {}).get("inconclusive", False)
    if verdict in ("failed", "error") and backend != cases.FAST_BACKENDS[-1] and not inconclusive:
        return f"skipped: the attention check of {backend}{' with its levers' if triton_levers_on(over) else ''} {verdict}"
    for done in result["cases"]:
        if done.get("status") == "ok" and done.get("overrides") == over and done["case"] != case.name:
            return f"skipped: the same overrides as {done['case']}"
    return ""


def main(argv: list[str] | None = None, age: Callable[[], float] = process_age_s) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="results/gpu_bert_large.json")
    ap.add_argument("--artifacts", default="", help="where the demo check's logs go (default: beside --out)")
    ap.add_argument("--commit", default="", help="the commit measured (the device gets no .git: bench/h200.sh "
                                                 "passes .h200/commit); default: git rev-parse HEAD")
    ap.add_argument("--only", default="", help="comma-separated task names to run (cases, check_NAME)")
    ap.add_argument("--limit-s", type=float, default=0.0,
                    help="the run's limit in seconds from this process's start (0 = none): no task starts that is "
                         "expected to end past it, none runs past it")
    ap.add_argument("--margin-s", type=float, default=10.0, help="kept free before --limit-s for the last writes")
    ap.add_argument("--cap-factor", type=float, default=2.0,
                    help="stop a task after this many times its cold expected seconds, and go on")
    ap.add_argument("--task-limit-s", type=float, default=0.0,
                    help="and after at most this many seconds, whatever its estimate (0 = no such bound)")
    ap.add_argument("--compile-cache", choices=("cold", "warm"), default="cold",
                    help="whether inductor's and Triton's caches were carried in (bench/h200.sh says): which "
                         "column of the expected seconds applies")
    ap.add_argument("--demo-data", default="", help="existing demo data (train/, eval/) instead of generating it")
    ap.add_argument("--demo-timeout-s", type=float, default=240.0)
    ap.add_argument("--resume", action="store_true", help="continue the run in --out: skip what it holds "
                                                          "(the restart after a broken CUDA context)")
    cases.add_case_args(ap)
    args = ap.parse_args(argv)
    device = measure.setup_device(args)
    if device is None:
        print("no CUDA device: use --cpu-smoke to check the run on a CPU", file=sys.stderr)
        return 2
    tasks = plan(args)
    names = [task_name(t) for t in tasks]
    only = set(filter(None, args.only.split(",")))
    if only - set(names):  # a misspelt name would spend a device window on nothing
        print(f"--only: not in the plan: {sorted(only - set(names))}; the plan: {names}", file=sys.stderr)
        return 2
    selected = [t for t in tasks if not only or task_name(t) in only]
    out = Path(args.out)
    if args.resume:
        if not out.is_file():
            print(f"--resume: {out} does not exist", file=sys.stderr)
            return 2
        result = json.loads(out.read_text())
        done = ({c["case"] for c in result["cases"]} | {f"check_{k}" for k in result["checks"]}
                | ({"headline"} if result.get("headline", {}).get("decided") else set()))
        selected = [t for t in selected if task_name(t) not in done]
        args.fast_attention = result["fast_attention"]
        args.fast_stack = result.get("fast_stack_changes", {})
        result["restarts"] = result.get("restarts", 0) + 1
        peak = {"flops_per_s": result["gemm_peak_tflops"] * 1e12, "n": result["gemm_peak_n"]}
    warm = args.compile_cache == "warm"
    state = gpu_state() if not args.resume else result.get("gpu_state", {})
    print(f"GPU state (read, not set): {json.dumps(state)}", flush=True)
    print(time_table(selected, warm, args.limit_s, age()), flush=True)
    if not args.resume:
        out.parent.mkdir(parents=True, exist_ok=True)
        commit, source = (args.commit, "--commit") if args.commit else provenance.git_commit()
        peak = measure.gemm_peak(args, device)
        result = measure.run_header(args, device, peak, commit, source)
        result["gpu_state"] = state
        result.update(plan=names, only=sorted(only), compile_cache=args.compile_cache, limit_s=args.limit_s,
                      expected_s={task_name(t): t.est_s[warm] for t in selected}, started_age_s=age())
    artifacts = Path(args.artifacts) if args.artifacts else out.parent

    def save() -> None:
        result["age_s"] = age()
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=2) + "\n")
        tmp.replace(out)  # never a half-written file

    saved_term = signal.signal(signal.SIGTERM, _raise(Terminated))
    signal.signal(signal.SIGALRM, _raise(TaskTimeout))
    try:
        outcome = run_tasks(selected, args, device, peak["flops_per_s"], result, save, artifacts, age)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGTERM, saved_term)
    if outcome == "restart" and result.get("restarts", 0) < MAX_RESTARTS:
        print("the CUDA context is broken: restarting this run in a fresh process (--resume)", flush=True)
        sys.stdout.flush()
        os.execv(sys.executable, [sys.executable, str(Path(__file__).resolve()),
                                  *[a for a in argv if a != "--resume"], "--resume"])
    print(f"bf16 GEMM peak {result['gemm_peak_tflops']:.1f} TFLOP/s; wrote {out}")
    return 128 + signal.SIGTERM if outcome == "terminated" else 0


GPU_QUERY = ("name,driver_version,compute_mode,clocks.sm,clocks.max.sm,clocks.mem,clocks.max.mem,power.draw,"
             "power.limit,temperature.gpu,persistence_mode")


def gpu_state() -> dict[str, str]:
    """The GPU's name, driver, compute mode, clocks, power and temperature as nvidia-smi
    reads them (nothing is set), or why there is no reading. An Exclusive_Process compute
    mode lets one process hold a context: the check children then fail to start."""
    try:
        r = subprocess.run(["nvidia-smi", f"--query-gpu={GPU_QUERY}", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"error": f"nvidia-smi: {type(e).__name__}: {e}"}
    if r.returncode != 0 or not r.stdout.strip():
        return {"error": f"nvidia-smi exit {r.returncode}: {(r.stderr or r.stdout).strip()[-300:]}"}
    return dict(zip(GPU_QUERY.split(","), (v.strip() for v in r.stdout.splitlines()[0].split(","))))


class Window:
    """The run's time: what is left for a task before --limit-s (less the margin and the
    expected seconds of the reserved tasks still ahead of it), and each task's cap."""

    def __init__(self, args, tasks: list, age: Callable[[], float]) -> None:
        self.args, self.age = args, age
        self.col = 1 if args.compile_cache == "warm" else 0
        self.reserved = {task_name(t): t.est_s[self.col] for t in tasks if isinstance(t, HeadlineExtras)}

    def left(self, name: str) -> float:
        if not self.args.limit_s:
            return float("inf")
        ahead = sum(est for n, est in self.reserved.items() if n != name)
        return self.args.limit_s - self.age() - self.args.margin_s - ahead

    def done(self, name: str) -> None:
        self.reserved.pop(name, None)

    def why_not(self, task, name: str) -> str:
        est, left = task.est_s[self.col], self.left(name)
        if est > left:
            return f"skipped: expected {est:.0f} s, {max(left, 0):.0f} s left before --limit-s" + (
                " and the reserved tasks" if len(self.reserved) - (name in self.reserved) else "")
        return ""

    def cap(self, task, name: str) -> float:
        """--cap-factor times the task's cold expected seconds, within --task-limit-s and what is left."""
        cap = self.args.cap_factor * max(task.est_s)
        if self.args.task_limit_s:
            cap = min(cap, self.args.task_limit_s)
        return max(1.0, min(cap, self.left(name)))


class Stopped(Exception):
    """The run must stop after this task: ``outcome`` ("terminated" or "restart")."""

    def __init__(self, outcome: str) -> None:
        super().__init__(outcome)
        self.outcome = outcome


def run_tasks(tasks: list, args, device: torch.device, peak: float, result: dict, save: Callable[[], None],
              artifacts: Path, age: Callable[[], float]) -> str:
    """Each task in turn within the window; "done", "terminated" or "restart"."""
    window = Window(args, tasks, age)
    if result.get("headline", {}).get("decided"):  # a restart after the headline: its model is gone
        window.done("headline_extras")
    run = Runner(args, device, peak, result, save, artifacts, window)
    with measure.smoke_compile() if args.cpu_smoke else measure.nothing(), \
            tempfile.TemporaryDirectory(prefix="device_run_") as tmp_name:
        run.tmp = Path(tmp_name)
        try:
            for task in tasks:
                if isinstance(task, Headline):
                    run.headline(task)
                elif isinstance(task, HeadlineExtras):
                    run.extras(task)
                elif isinstance(task, Check):
                    run.check(task)
                else:
                    run.case(task)
                window.done(task_name(task))
        except Stopped as s:
            return s.outcome
    return "done"


class Runner:
    """The run's tasks: each one records itself in ``result``, is saved, reported, and followed
    by a check that the CUDA context still answers."""

    def __init__(self, args, device: torch.device, peak: float, result: dict, save: Callable[[], None],
                 artifacts: Path, window: Window) -> None:
        self.args, self.device, self.peak, self.result, self.save = args, device, peak, result, save
        self.artifacts, self.window = artifacts, window
        self.samples_cache: dict[int, list] = {}
        self.tmp = Path(".")
        self.held: measure.Extras = []  # the headline's extras, until headline_extras runs them
        self.held_rec: dict[str, Any] = {}

    # -- one task within its cap ------------------------------------------------------------

    def timed(self, name: str, task, rec: dict, body: Callable[[float], None]) -> None:
        """``body(cap)`` under the task's cap; a stop, SIGTERM or error recorded in ``rec``;
        the task's seconds, a save, its printed line, and the CUDA context checked after."""
        t0 = time.perf_counter()
        cap = self.window.cap(task, name)
        signal.setitimer(signal.ITIMER_REAL, cap)
        try:
            body(cap)
        except (TaskTimeout, Terminated) as e:
            what = ("stopped at its time limit" if isinstance(e, TaskTimeout)
                    else "terminated (SIGTERM: the wrapper's time limit)")
            if rec.get("status") == "ok":  # a case's throughput is in: its extras were cut
                rec["extras_stopped"] = what
            else:
                rec["status"] = f"error: {what} ({cap:.0f} s)" if isinstance(e, TaskTimeout) else f"error: {what}"
            if isinstance(e, Terminated):
                rec["task_s"] = time.perf_counter() - t0
                self.save()
                raise Stopped("terminated") from None
        except Exception as e:  # noqa: BLE001 - keep the other results; say what failed
            measure.record_failure(rec, e)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        rec["task_s"] = time.perf_counter() - t0
        self.finish(name, rec, getattr(task, "batch", 0))

    def finish(self, name: str, rec: dict, batch: int) -> None:
        self.save()
        measure.report(name, {"local_batch": batch, **rec})
        if not cuda_alive(self.device):
            self.result["cuda_context_lost_after"] = self.result.get("cuda_context_lost_after", []) + [name]
            self.save()
            raise Stopped("restart")
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # -- the kinds of task --------------------------------------------------------------------

    def new_case(self, case: cases.Case) -> dict | None:
        """``case``'s record, appended to ``cases``; None when it is there already (measured as
        an attempt of the headline, or before a restart)."""
        if any(c["case"] == case.name for c in self.result["cases"]):
            print(f"{case.name:28s} in the file already", flush=True)
            return None
        rec: dict[str, Any] = {"case": case.name, "local_batch": case.batch,
                               "overrides": cases.resolved_overrides(case, self.args)}
        verdict = attention_verdict(case, self.args, self.result)
        if verdict:
            rec["attention_check"] = verdict
        self.result["cases"].append(rec)
        return rec

    def measure(self, case: cases.Case, rec: dict) -> measure.Extras:
        """A case's core numbers and its optimizer step alone; its other extras, unrun."""
        extras = measure.measure_case(case, self.args, self.device, self.peak, self.samples_cache, rec, self.save)
        measure.run_extras(rec, [e for e in extras if e[0] == "optimizer"], self.save)
        return [e for e in extras if e[0] != "optimizer"]

    def case(self, case: cases.Case) -> None:
        rec = self.new_case(case)
        if rec is None:
            return
        why = blocked(case, self.args, self.result) or self.window.why_not(case, case.name)
        if why:
            rec["status"] = why
            rec["task_s"] = 0.0
            self.finish(case.name, rec, case.batch)
            return

        def body(cap: float) -> None:
            later = self.measure(case, rec)
            if later:
                rec["extras_not_run"] = [n for n, _ in later]  # the headline's alone run (headline_extras)

        self.timed(case.name, case, rec, body)

    def headline(self, task: Headline) -> None:
        """The attempts in turn until one measures; ``headline`` records which, with what stack
        and what it changed from the fast stack, and each attempt's status; later fast-stack
        cases take the stack that measured (``--fast-attention``, ``--fast-stack``)."""
        head = self.result.setdefault("headline", {})
        for case in cases.headline_attempts(self.args.big, self.args.fast_attention):
            rec = next((c for c in self.result["cases"] if c["case"] == case.name), None)
            if rec is None:  # else measured before a restart
                rec = self.new_case(case)
                rec["headline_attempt"] = 1 + sum("headline_attempt" in c for c in self.result["cases"][:-1])
                why = blocked(case, self.args, self.result) or self.window.why_not(case, task.name)
                if why:
                    rec.update(status=why, task_s=0.0)
                else:
                    def body(cap: float, case=case, rec=rec) -> None:
                        self.held, self.held_rec = self.measure(case, rec), rec

                    self.timed(case.name, case, rec, body)
            head["attempts"] = [{"case": c["case"], "status": c.get("status")} for c in self.result["cases"]
                                if "headline_attempt" in c]
            if rec.get("status", "").startswith("skipped"):
                self.finish(case.name, rec, case.batch)
            if rec.get("status") == "ok":
                changes = cases.fast_stack_changes(case, self.args)
                head.update(decided=True, case=case.name, seq_per_s=rec["seq_per_s"], stack=rec["overrides"],
                            changes_from_fast=dict(changes))
                self.args.fast_attention = changes.pop("model.attention_backend", self.args.fast_attention)
                self.args.fast_stack = changes
                self.result.update(fast_attention=self.args.fast_attention, fast_stack_changes=changes)
                self.save()
                return
            self.held, self.held_rec = [], {}
        head.update(decided=True, case=None, why="no attempt measured (each attempt's status in attempts)")
        self.window.done("headline_extras")
        self.save()

    def extras(self, task: HeadlineExtras) -> None:
        """The headline's evaluation and kernel-class profile, into the headline's record;
        ``checks.headline_extras`` says which case and how it went."""
        head = self.result.get("headline", {})
        mark: dict[str, Any] = {"case": head.get("case")}
        self.result["checks"][task.name] = mark
        name = task_name(task)
        held, rec = self.held, self.held_rec
        self.held, self.held_rec = [], {}
        why = self.window.why_not(task, name)
        if not held:
            why = ("skipped: no headline was measured" if not head.get("case") else
                   "skipped: the run restarted in a fresh process after the headline: its model is gone")
        if why:
            mark["status"] = why
            self.finish(name, mark, 0)
            return

        def body(cap: float) -> None:
            measure.run_extras(rec, held, self.save)
            rec.pop("extras_not_run", None)
            mark.update(status="ok", extra_errors=rec.get("extra_errors", {}))

        self.timed(name, task, mark, body)

    def check(self, task: Check) -> None:
        rec: dict[str, Any] = {}
        self.result["checks"][task.name] = rec
        name = task_name(task)
        why = self.window.why_not(task, name)
        if why:
            rec["status"] = why
            self.finish(name, rec, 0)
            return
        args, result = self.args, self.result

        def body(cap: float) -> None:
            if task.name == "attention":
                mode = str(result.get("gpu_state", {}).get("compute_mode", ""))
                rec.update(check_attention(self.tmp, cap, exclusive=mode.startswith("Exclusive")))
                args.fast_attention = result["fast_attention"] = rec["chosen"]
            elif task.name == "gpu":
                rec.update(check_gpu(self.tmp, cap))
            elif task.name == "attention_blocks":
                verdict = result["checks"].get("attention", {}).get("backends", {}).get("triton", {})
                if verdict.get("outcome") in ("failed", "error"):
                    rec["status"] = f"skipped: the attention check of triton {verdict['outcome']}"
                else:
                    rec.update(check_attention_blocks(args, self.device, self.samples_cache))
            else:
                rec.update(demo_check.check_demo(self.tmp, self.artifacts, args.cpu_smoke,
                                                 Path(args.demo_data) if args.demo_data else None,
                                                 timeout_s=min(args.demo_timeout_s, cap)))

        self.timed(name, task, rec, body)


if __name__ == "__main__":
    sys.exit(main())
