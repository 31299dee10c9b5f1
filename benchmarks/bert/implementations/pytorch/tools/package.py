"""Package the MLPerf logs of NEXP runs as an MLPerf Training submission and check it.

    python tools/package.py --system DGXA100_8x8x48x1 --out build/submission results/*_[0-9]*.log

Lays out ``<out>/<org>/systems/<system>.json`` (from the repository's systems/),
``<out>/<org>/results/<system>/bert/result_<N>.txt`` (the logs, in the order given) and
``<out>/<org>/benchmarks/bert/implementations/<impl>/`` (this implementation's code), then
runs the MLCommons tools of the ruleset (default 5.0.0) and prints one verdict table:

- compliance checker on every result file,
- package checker (``PACKAGE CHECKER FOUND NO ERRORS`` is its success line),
- the logs' submission_org / division / status / platform against the system JSON,
- RCP checker (reference convergence points; closed division only, decided by the division
  the logs name, as the package checker does; and they describe BERT-Large phase 2, so for
  other models, such as the CPU demo, the check does not apply: ``--rcp auto`` reports n/a
  and the package checker runs with ``--rcp-bypass``),
- result summarizer (the score: mean time to train without the fastest and slowest run).

It also writes ``<out>/eval_accuracy.png``: eval accuracy against training samples, one
line per run. Exit status 0 when every applicable check passed.
"""

from __future__ import annotations

import argparse
import csv
import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from bert import mlperf_log

PKG = Path(__file__).resolve().parent.parent
RUNS = 10  # logs an MLPerf BERT result consists of (the summarizer drops the fastest and slowest)
ROOT = PKG.parents[3]
# What never goes into the implementation folder of a package.
IGNORE = shutil.ignore_patterns(".venv", "__pycache__", "*.pyc", "*.egg-info", ".pytest_cache", "results", "build",
                                "*.hdf5", "*.h5", "*.pt", "*.ckpt", "*.log", "slurm-*.out", "compliance_checker.log")


@dataclass
class Verdict:
    check: str
    status: str  # PASS | FAIL | n/a
    detail: str


def is_benchmark_model(log: Path) -> bool:
    """BERT-Large at seq 512, per the resolved config written beside the log (if any)."""
    cfg = log.with_name(log.stem + "_config.json")
    if not cfg.exists():
        return True  # nothing says otherwise: check it
    tree = json.loads(cfg.read_text())
    m = tree.get("model", {})
    return (m.get("hidden_size"), m.get("num_layers"), tree.get("data", {}).get("max_seq_length")) == (1024, 24, 512)


def logged(log: Path, key: str) -> object:
    """The value of ``key``'s first event in the log (None when absent)."""
    return next((e["value"] for e in mlperf_log.read_events(log) if e["key"] == key), None)


def rcp_applies_to(logs: list[Path]) -> tuple[bool, str]:
    """Whether the RCP check applies, and why not: RCPs are for the closed division only (the
    package checker skips them for open results), decided by the division each log names;
    and they describe BERT-Large phase 2, so other models (the CPU demo) are out too."""
    divisions = {logged(p, "submission_division") for p in logs}
    if divisions != {"closed"}:
        return False, f"RCPs apply to the closed division only; these runs logged {sorted(map(str, divisions))}"
    if not all(is_benchmark_model(p) for p in logs):
        return False, "the reference convergence points are for BERT-Large phase 2; these runs are another model"
    return True, ""


# The log's submission_status -> the system description's status (MLPerf's wording).
STATUS_NAMES = {"onprem": "Available on-premise", "cloud": "Available cloud",
                "research": "Research, Development, or Internal (RDI)", "preview": "Preview"}


def system_mismatches(logs: list[Path], desc: dict) -> list[str]:
    """Where a log's submission_org/division/status/platform disagree with the system JSON."""
    out = []
    for p in logs:
        got = {k: logged(p, f"submission_{k}") for k in ("org", "division", "status", "platform")}
        want = {"org": desc.get("submitter"), "division": desc.get("division"),
                "status": desc.get("status"), "platform": desc.get("system_name")}
        got["status"] = STATUS_NAMES.get(str(got["status"]), got["status"])
        out += [f"{p.name}: submission_{k} {got[k]!r}, system JSON {want[k]!r}" for k in got if got[k] != want[k]]
    return out


def _mlperf(tool: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", f"mlperf_logging.{tool}", *args], cwd=cwd, capture_output=True,
                          text=True)


def _last_lines(text: str, n: int = 3) -> str:
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith("**")]
    return " | ".join(lines[-n:])


def lay_out(logs: list[Path], org_dir: Path, system: str, systems_dir: Path, impl: str) -> Path:
    """The submission tree; returns the results folder of the benchmark."""
    if org_dir.exists():
        shutil.rmtree(org_dir)
    (org_dir / "systems").mkdir(parents=True)
    desc = systems_dir / f"{system}.json"
    if not desc.exists():
        raise SystemExit(f"package: no system description {desc}")
    shutil.copy(desc, org_dir / "systems" / desc.name)
    results = org_dir / "results" / system / "bert"
    results.mkdir(parents=True)
    for i, log in enumerate(logs):
        shutil.copy(log, results / f"result_{i}.txt")
    shutil.copytree(PKG, org_dir / "benchmarks" / "bert" / "implementations" / impl, ignore=IGNORE)
    return results


def check(org_dir: Path, results: Path, ruleset: str, rcp_applies: bool, work: Path,
          rcp_why_not: str = "") -> list[Verdict]:
    out: list[Verdict] = []
    passed, failed = [], []
    for f in sorted(results.glob("result_*.txt")):
        r = _mlperf("compliance_checker", "--usage", "training", "--ruleset", ruleset,
                    "--log_output", str(work / f"{f.stem}_compliance.log"), str(f), cwd=work)
        (passed if r.returncode == 0 and "SUCCESS" in r.stdout + r.stderr else failed).append(f.stem)
    out.append(Verdict(f"compliance checker ({ruleset})", "PASS" if passed and not failed else "FAIL",
                       f"{len(passed)}/{len(passed) + len(failed)} logs pass" + (f"; failed: {', '.join(failed)}"
                                                                                 if failed else "")))

    if rcp_applies:
        r = _mlperf("rcp_checker", "--rcp_version", ruleset, "--log_output", str(work / "rcp_checker.log"),
                    str(results), cwd=work)
        out.append(Verdict(f"RCP checker ({ruleset})", "PASS" if r.returncode == 0 else "FAIL",
                           _last_lines(r.stdout + r.stderr, 1)))
    else:
        out.append(Verdict(f"RCP checker ({ruleset})", "n/a", rcp_why_not))

    args = [str(org_dir), "training", ruleset, "--log_output", str(work / "package_checker.log")]
    if not rcp_applies:
        args.append("--rcp-bypass")
    r = _mlperf("package_checker", *args, cwd=work)
    text = r.stdout + r.stderr
    ok = "PACKAGE CHECKER FOUND NO ERRORS, SUCCESS" in text
    errors = [ln for ln in text.splitlines() if ln.startswith("ERROR")]
    out.append(Verdict(f"package checker ({ruleset})", "PASS" if ok else "FAIL",
                       ("--rcp-bypass; " if not rcp_applies else "") + ("no errors" if ok else " | ".join(errors[:3]))))

    table = work / "summary.csv"
    r = _mlperf("result_summarizer", str(org_dir), "training", ruleset, "--csv", str(table), cwd=work)
    score = _summarized_score(table)
    runs = len(list(results.glob("result_*.txt")))
    if score:
        detail = f"bert score {score} minutes"
    elif runs < RUNS:  # its own words would be a numpy warning about an empty mean
        detail = f"no score: BERT's score is the mean of {RUNS} runs without the fastest and slowest; got {runs}"
    else:
        detail = _last_lines(r.stdout + r.stderr)
    out.append(Verdict(f"result summarizer ({ruleset})", "PASS" if r.returncode == 0 and score else "FAIL", detail))
    return out


def _summarized_score(table: Path) -> str:
    """The bert column of the summarizer's csv (minutes), or '' when it produced none."""
    if not table.exists():
        return ""
    with table.open() as f:
        rows = list(csv.reader(f))
    for header_row in range(min(3, len(rows))):  # header rows vary by version: find the bert column
        if "bert" in rows[header_row]:
            col = rows[header_row].index("bert")
            values = [row[col] for row in rows[header_row + 1:] if len(row) > col and row[col].strip()]
            return values[-1] if values else ""
    return ""


def plot(logs: list[Path], path: Path, target: float) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, log in enumerate(logs):
        curve = mlperf_log.eval_curve(mlperf_log.read_events(log))
        if curve:
            xs, ys = zip(*curve)
            ax.plot(xs, ys, marker="o", markersize=3, linewidth=1, label=f"result_{i}")
    ax.axhline(target, color="black", linestyle="--", linewidth=0.8, label=f"target {target}")
    ax.set_xlabel("training samples")
    ax.set_ylabel("eval masked-LM accuracy")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python tools/package.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("logs", nargs="+", type=Path, help="MLPerf logs of the runs (MLPerf wants exactly 10)")
    ap.add_argument("--system", required=True, help="system name: systems/<system>.json, results/<system>/")
    ap.add_argument("--out", type=Path, required=True, help="directory to write the package into")
    ap.add_argument("--org", default="reference", help="submitting organization (the package's top folder)")
    ap.add_argument("--impl", default="pytorch", help="implementation folder name")
    ap.add_argument("--systems-dir", type=Path, default=ROOT / "systems", help="where <system>.json lives")
    ap.add_argument("--ruleset", default="5.0.0", help="MLPerf Training ruleset (5.0.0: the last with BERT)")
    ap.add_argument("--rcp", choices=("auto", "on", "off"), default="auto",
                    help="auto: check convergence against the RCPs only for BERT-Large phase-2 runs")
    ap.add_argument("--target", type=float, default=0.720, help="accuracy line drawn on the plot")
    args = ap.parse_args(argv)

    missing = [str(p) for p in args.logs if not p.is_file()]
    if missing:
        print(f"package: no such log(s): {', '.join(missing)}", file=sys.stderr)
        return 2
    if len(args.logs) != RUNS:
        print(f"package: {len(args.logs)} logs given; an MLPerf BERT submission has exactly {RUNS}", file=sys.stderr)
    out = args.out.resolve()
    if out == PKG or (PKG in out.parents and out.relative_to(PKG).parts[0] not in ("build", "results")):
        print(f"package: --out {args.out} is inside the implementation it copies; use build/ or elsewhere",
              file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    org_dir = args.out / args.org
    results = lay_out(args.logs, org_dir, args.system, args.systems_dir, args.impl)
    print(f"package: {results}")
    for i, log in enumerate(args.logs):  # the checkers name result_N.txt: which run is that
        print(f"  result_{i}.txt <- {log}")
    work = args.out / "checks"
    work.mkdir(exist_ok=True)
    auto, why_not = rcp_applies_to(args.logs)
    rcp_applies = args.rcp == "on" or (args.rcp == "auto" and auto)
    verdicts = check(org_dir, results, args.ruleset, rcp_applies, work, why_not or "--rcp off")
    desc = json.loads((org_dir / "systems" / f"{args.system}.json").read_text())
    wrong = system_mismatches(args.logs, desc)
    verdicts.insert(0, Verdict("logs vs system JSON", "FAIL" if wrong else "PASS",
                               " | ".join(wrong[:3]) if wrong else "org, division, status, platform agree"))
    png = args.out / "eval_accuracy.png"
    plot(args.logs, png, args.target)

    width = max(len(v.check) for v in verdicts)
    print(f"\nsubmission package {org_dir} ({len(args.logs)} runs of {args.system}); checker logs in {work}")
    print(f"{'check':<{width}}  verdict  detail")
    for v in verdicts:
        print(f"{v.check:<{width}}  {v.status:<7}  {v.detail}")
    print(f"plot: {png}")
    ok = all(v.status != "FAIL" for v in verdicts)
    print("package: SUCCESS (every applicable check passed)" if ok else "package: FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
