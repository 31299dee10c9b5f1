"""The one time-limited device call: what runs, in which order, and within which window.

    bench/h200.sh                                                   # on the device: runs this
    python bench/device_run.py --out X.json --limit-s 440           # the same, by hand
    python bench/device_run.py --cpu-smoke --out results/dry.json   # the dry run on a CPU

The order (``plan``), so that a run cut short keeps what matters most:

1. ``check_attention``: tests/integration/test_gpu.py's attention tests in child processes (their own
   CUDA contexts: a sticky CUDA error ends that child, not this run), Triton in one, nested
   and SDPA in another, side by side; the fast stack's backend is the first of triton,
   nested whose test passed, else sdpa (``fast_attention`` and ``checks.attention`` record
   the choice and every verdict); a case on a backend whose test failed is skipped, but
   for sdpa, the last resort (its cases run and carry the verdict, ``attention_check``);
2. ``baseline`` at the small batch (16): the first measured stack (``BASELINE``), this run's own baseline;
3. ``fast`` at the big batch (96): the headline, with its kernel-class profile; then ``fast``
   at 16;
4. ``check_gpu``: the other tests of tests/integration/test_gpu.py in a child (fp16 loss scaling on
   BERT-Large, graphed steps equal to eager ones);
5. ``fast_fp8_tensorwise`` at 96;
6. ``check_attention_blocks`` (the Triton block-size sweep, if triton passed), the ablations
   (bench/gpu_bert_large.py's ``ablations``), ``check_demo`` (the demo to 0.720 and the
   MLPerf checker), then the other cases.

The window: ``--limit-s`` counts from this process's start (so the interpreter's and
torch's start-up count too; bench/h200.sh passes what is left of its own limit). Before
anything runs, the expected seconds of every task are printed with their running sum. A
task whose expected seconds exceed what is left (less ``--margin-s`` for writing the
results) is skipped with that reason and the next one is tried; a task that runs past
``--task-limit-s``, or into the margin, is stopped and recorded. The JSON is rewritten
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

from bench import attention_blocks, demo_check, gpu_bert_large as gbl, provenance  # noqa: E402
from bench.common import PKG  # noqa: E402

IMPORTED = time.monotonic()
MAX_RESTARTS = 3  # fresh processes after a broken CUDA context, at most (each skips what is done)


@dataclasses.dataclass
class Check:
    """A task that is not a throughput case (``attention``, ``gpu``, ``attention_blocks``,
    ``demo``); its result goes under ``checks``. ``est_s``: expected seconds (cold, warm)."""

    name: str
    est_s: tuple[float, float]


def plan(args) -> list[gbl.Case | Check]:
    """Every task in the order of the module docstring (names once), then ``--case`` ones."""
    baseline, fast_big, fast_small = gbl.head_cases(args.small, args.big)
    tasks = [Check("attention", (40.0, 25.0)), baseline, fast_big, fast_small, Check("gpu", (45.0, 35.0)),
             gbl.fp8_case(args.big), Check("attention_blocks", (30.0, 12.0)), *gbl.ablations(args.big),
             Check("demo", (60.0, 50.0)),
             *gbl.other_cases(args.big, args.old, args.fast_sweep, args.default_sweep), *args.case]
    out, seen = [], set()
    for t in tasks:
        if task_name(t) not in seen:
            seen.add(task_name(t))
            out.append(t)
    return out


def task_name(task: gbl.Case | Check) -> str:
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


def check_attention(tmp: Path, timeout_s: float) -> dict:
    """The attention tests in two children (Triton alone: the new kernel is the likeliest to
    break its context) and the fast stack's backend from their verdicts."""
    verdicts = run_tests([[f"{ATTENTION_TEST}[triton]"], [f"{ATTENTION_TEST}[nested]", f"{ATTENTION_TEST}[sdpa]"]],
                         tmp, timeout_s)
    backends = {b: verdicts.get(f"{ATTENTION_TEST}[{b}]", {"outcome": "error", "message": "no verdict"})
                for b in gbl.FAST_BACKENDS}
    passed = [b for b in gbl.FAST_BACKENDS[:-1] if backends[b]["outcome"] == "passed"]
    chosen = passed[0] if passed else gbl.FAST_BACKENDS[-1]
    why = (f"{chosen}: the first of {list(gbl.FAST_BACKENDS[:-1])} whose check passed" if passed
           else f"sdpa: neither of {list(gbl.FAST_BACKENDS[:-1])} passed its check")
    return {"status": "ok", "backends": backends, "chosen": chosen, "why": why}


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

    cfg, _ = gbl.case_config(gbl._case("blocks", args.small, f=gbl.FAST), args)
    samples = gbl.samples_for(args.small, args, cfg.model.vocab_size, samples_cache)
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


def attention_verdict(case: gbl.Case, args, result: dict) -> str:
    """The attention check's outcome for ``case``'s backend ("" when unchecked)."""
    backend = gbl.resolved_overrides(case, args).get("model.attention_backend")
    return result["checks"].get("attention", {}).get("backends", {}).get(backend, {}).get("outcome", "")


def blocked(case: gbl.Case, args, result: dict) -> str:
    """Why ``case`` must not run: its attention backend failed the check (but sdpa, the last
    resort, which ran on this GPU before: its cases run and carry the verdict), or another
    case already ran with the same overrides ("" when it may run)."""
    over = gbl.resolved_overrides(case, args)
    backend, verdict = over.get("model.attention_backend"), attention_verdict(case, args, result)
    if verdict in ("failed", "error") and backend != gbl.FAST_BACKENDS[-1]:
        return f"skipped: the attention check of {backend} {verdict}"
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
    ap.add_argument("--task-limit-s", type=float, default=240.0, help="stop a task after this many seconds and go on")
    ap.add_argument("--compile-cache", choices=("cold", "warm"), default="cold",
                    help="whether inductor's and Triton's caches were carried in (bench/h200.sh says): which "
                         "column of the expected seconds applies")
    ap.add_argument("--demo-data", default="", help="existing demo data (train/, eval/) instead of generating it")
    ap.add_argument("--demo-timeout-s", type=float, default=240.0)
    ap.add_argument("--resume", action="store_true", help="continue the run in --out: skip what it holds "
                                                          "(the restart after a broken CUDA context)")
    gbl.add_case_args(ap)
    args = ap.parse_args(argv)
    device = gbl.setup_device(args)
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
        done = {c["case"] for c in result["cases"]} | {f"check_{k}" for k in result["checks"]}
        selected = [t for t in selected if task_name(t) not in done]
        args.fast_attention = result["fast_attention"]
        result["restarts"] = result.get("restarts", 0) + 1
        peak = {"flops_per_s": result["gemm_peak_tflops"] * 1e12, "n": result["gemm_peak_n"]}
    warm = args.compile_cache == "warm"
    print(time_table(selected, warm, args.limit_s, age()), flush=True)
    if not args.resume:
        out.parent.mkdir(parents=True, exist_ok=True)
        commit, source = (args.commit, "--commit") if args.commit else provenance.git_commit()
        peak = gbl.gemm_peak(args, device)
        result = gbl.run_header(args, device, peak, commit, source)
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


def run_tasks(tasks: list, args, device: torch.device, peak: float, result: dict, save: Callable[[], None],
              artifacts: Path, age: Callable[[], float]) -> str:
    """Each task in turn within the window; "done", "terminated" or "restart"."""
    samples_cache: dict[int, list] = {}
    warm = args.compile_cache == "warm"
    with gbl.smoke_compile() if args.cpu_smoke else gbl.nothing(), \
            tempfile.TemporaryDirectory(prefix="device_run_") as tmp_name:
        tmp = Path(tmp_name)
        for task in tasks:
            name, t0 = task_name(task), time.perf_counter()
            left = args.limit_s - age() - args.margin_s if args.limit_s else float("inf")
            est = task.est_s[warm]
            rec: dict[str, Any] = {}
            if isinstance(task, Check):
                result["checks"][task.name] = rec
            else:
                result["cases"].append(rec)
                rec.update(case=task.name, local_batch=task.batch, overrides=gbl.resolved_overrides(task, args))
                if attention_verdict(task, args, result):
                    rec["attention_check"] = attention_verdict(task, args, result)
            why = blocked(task, args, result) if isinstance(task, gbl.Case) else ""
            if est > left:
                why = f"skipped: expected {est:.0f} s, {max(left, 0):.0f} s left before --limit-s"
            if why:
                rec["status"] = why
            else:
                cap = min(args.task_limit_s, left)
                signal.setitimer(signal.ITIMER_REAL, cap)
                try:
                    if isinstance(task, gbl.Case):
                        gbl.run_case(task, args, device, peak, samples_cache, rec, save)
                    elif task.name == "attention":
                        rec.update(check_attention(tmp, cap))
                        args.fast_attention = result["fast_attention"] = rec["chosen"]
                    elif task.name == "gpu":
                        rec.update(check_gpu(tmp, cap))
                    elif task.name == "attention_blocks":
                        verdict = result["checks"].get("attention", {}).get("backends", {}).get("triton", {})
                        if verdict.get("outcome") in ("failed", "error"):
                            rec["status"] = f"skipped: the attention check of triton {verdict['outcome']}"
                        else:
                            rec.update(check_attention_blocks(args, device, samples_cache))
                    else:
                        rec.update(demo_check.check_demo(tmp, artifacts, args.cpu_smoke,
                                                         Path(args.demo_data) if args.demo_data else None,
                                                         timeout_s=args.demo_timeout_s))
                except (TaskTimeout, Terminated) as e:
                    what = ("stopped at its time limit" if isinstance(e, TaskTimeout)
                            else "terminated (SIGTERM: the wrapper's time limit)")
                    if rec.get("status") == "ok":  # a case's throughput is in: its extras were cut
                        rec["extras_stopped"] = what
                    else:
                        rec["status"] = f"error: {what} ({cap:.0f} s)" if isinstance(e, TaskTimeout) else f"error: {what}"
                    if isinstance(e, Terminated):
                        rec["task_s"] = time.perf_counter() - t0
                        save()
                        return "terminated"
                except Exception as e:  # noqa: BLE001 - keep the other results; say what failed
                    gbl.record_failure(rec, e)
                finally:
                    signal.setitimer(signal.ITIMER_REAL, 0)
            rec["task_s"] = time.perf_counter() - t0
            save()
            gbl.report(name, {"local_batch": getattr(task, "batch", 0), **rec})
            if not cuda_alive(device):
                result["cuda_context_lost_after"] = result.get("cuda_context_lost_after", []) + [name]
                save()
                return "restart"
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return "done"


if __name__ == "__main__":
    sys.exit(main())
