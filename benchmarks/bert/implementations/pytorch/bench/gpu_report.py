"""The markdown table of a device run's result file (what BENCHMARKS.md section 3 shows).

    python bench/gpu_report.py FILE.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _num(c: dict, key: str, fmt: str = "{:.1f}") -> str:
    return fmt.format(c[key]) if c.get(key) is not None else "-"


def cases_table(result: dict) -> list[str]:
    lines = ["| case | local batch | seq/s | MFU | peak mem GB | step ms | optimizer ms | optimizer | attention "
             "| step | eval ms/batch | compile / warm-up / capture s | status |",
             "|---|---:|---:|---:|---:|---:|---:|---|---|---|---:|---|---|"]
    for c in result.get("cases", []):
        if c.get("status") == "ok":
            prep = f"{_num(c, 'compile_s')} / {_num(c, 'warmup_s')} / {_num(c, 'capture_s')}"
            mfu = f"{c['mfu']:.1%}" + (" (FP8 vs bf16 peak)" if c.get("fp8", "off") != "off" else "")
            status = "ok" + (f"; extras failed: {', '.join(sorted(c['extra_errors']))}" if c.get("extra_errors") else "")
            lines.append(f"| {c['case']} | {c['local_batch']} | {c['seq_per_s']:.1f} | {mfu} | "
                         f"{_num(c, 'peak_mem_gb')} | {c['step_ms']:.1f} | {_num(c, 'optimizer_step_ms', '{:.2f}')} | "
                         f"{c['optimizer_impl']} | {c['attention']} | {c['step_kind']} | "
                         f"{_num(c, 'eval_ms_per_batch')} | {prep} | {status} |")
        else:
            lines.append(f"| {c['case']} | {c['local_batch']} | | | | | | | | | | | {str(c.get('status'))[:80]} |")
    return lines


def checks_lines(result: dict) -> list[str]:
    checks, lines = result.get("checks", {}), []
    att = checks.get("attention", {})
    if "backends" in att:
        lines.append("\nattention check: " + "; ".join(f"{b} {v['outcome']}" for b, v in att["backends"].items())
                     + f"; the fast stack ran {att['chosen']} ({att['why']})")
    elif att:
        lines.append(f"\nattention check: {att.get('status')}")
    gpu = checks.get("gpu", {})
    for name, v in sorted(gpu.get("tests", {}).items()):
        detail = ""
        if "fp16_steps" in v:
            rows = v["fp16_steps"]
            detail = (f": {sum(r['skipped'] for r in rows)} of {len(rows)} steps skipped, final scale "
                      f"{rows[-1]['scale']:g}, losses " + ", ".join(f"{r['loss']:.3f}" for r in rows))
        elif "graphed_vs_eager" in v:
            g = v["graphed_vs_eager"]
            detail = f": max parameter difference {g['max_param_diff']:.2e}, losses {g['graphed_losses']} vs {g['eager_losses']}"
        lines.append(f"{name}: {v['outcome']}{detail}")
    blocks = checks.get("attention_blocks", {})
    if blocks.get("status") == "ok":
        lines.append("\nattention blocks (forward / backward ms): " + "; ".join(
            f"{r['forward_blocks']} / {r['backward_blocks']}: "
            + (f"{r['forward_ms']:.2f} / {r['backward_ms']:.2f}" if r["status"] == "ok" else r["status"][:60])
            for r in blocks["configs"]))
    if "demo" in checks:
        d = checks["demo"]
        lines.append(f"demo: {d.get('status')}; run_stop {d.get('run_stop')} after {d.get('steps')} steps, "
                     f"time to target {d.get('time_to_target_s')} s, checker {d.get('checker')}")
    for c in result.get("cases", []):
        kb = c.get("kernel_breakdown")
        if kb:
            lines.append(f"\n{c['case']} by kernel class ({kb['source']}, ms per step): " + ", ".join(
                f"{k} {v:.1f} ({kb['share'][k]:.0%})" for k, v in kb["ms_per_step"].items()))
    return lines


def headline_lines(result: dict) -> list[str]:
    """The headline: its case, seq/s and what it changed from the fast stack, or why none;
    each attempt that did not measure, with its status."""
    head = result.get("headline")
    if not head:
        return []
    if head.get("case"):
        changed = ", ".join(f"{k}={v}" for k, v in head.get("changes_from_fast", {}).items()) or "none"
        lines = [f"headline: {head['case']} {head['seq_per_s']:.1f} seq/s (changed from the fast stack: {changed})"]
    else:
        lines = [f"headline: none ({head.get('why', 'not decided')})"]
    lines += [f"  not the headline: {a['case']}: {str(a['status'])[:160]}" for a in head.get("attempts", [])
              if a["case"] != head.get("case")]
    return lines + [""]


def table(result: dict) -> str:
    lines = headline_lines(result) + cases_table(result) + checks_lines(result)
    versions = result.get("versions", {})
    lines.append(f"\n{result.get('device_name')}, commit {result.get('commit')}, bf16 GEMM peak "
                 f"{result.get('gemm_peak_tflops', 0):.1f} TFLOP/s, torch {versions.get('torch')}, "
                 f"fast stack attention {result.get('fast_attention')}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python bench/gpu_report.py FILE.json", file=sys.stderr)
        return 2
    try:
        result = json.loads(Path(argv[0]).read_text())
    except (OSError, ValueError) as e:
        print(f"gpu_report: {argv[0]}: {e}", file=sys.stderr)
        return 2
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
