"""BERT-Large phase 2 (seq 512) train-step throughput on one GPU, each technique on and off.

    python bench/gpu_bert_large.py --out results/gpu.json --commit SHA   # on a GPU, every case
    python bench/gpu_bert_large.py --only fast_b96,fast_b16 --out X.json # chosen cases
    python bench/gpu_bert_large.py --cpu-smoke --out /tmp/smoke.json     # every path, tiny, CPU

The throughput script: it runs the cases of bench/cases.py one after another, each measured
by bench/measure.py, and writes the JSON after each. The device's one time-limited call (the
attention check first, the GPU tests, the window, the order) is bench/device_run.py's, which
runs the same cases through the same measurement; ``python bench/gpu_report.py FILE`` prints a
result's table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import provenance  # noqa: E402
from bench.cases import Case, ablations, add_case_args, fp8_case, head_cases, levers, other_cases  # noqa: E402
from bench.measure import (gemm_peak, nothing, record_failure, report, run_case, run_header,  # noqa: E402
                           setup_device, smoke_compile)


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
