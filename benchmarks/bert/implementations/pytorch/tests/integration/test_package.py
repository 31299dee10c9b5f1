"""tools/package.py on 10 short CPU runs: the package layout, and success from every MLCommons
check that applies (compliance, package checker, result summarizer; the RCPs describe
BERT-Large, so for the demo model that check is reported n/a)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bert import train
from conftest import PKG, mllog_events
from package_helpers import _package_module


SYSTEM = "CPU_1x2"


@pytest.fixture(scope="module")
def ten_runs(trained, demo_data, tmp_path_factory):
    """10 runs of the demo config from the trained model, 1 rank each, run.seed unset: each
    draws its own seed (the package checker's seed check is the oracle)."""
    assert trained.returncode == 0, trained.stdout[-3000:]
    out = tmp_path_factory.mktemp("ten_runs")
    logs = []
    for i in range(1, 11):
        rc = train.main([*demo_data.env["CONFIG_PARAMS"].split(), f"data.train_dir={demo_data.train}",
                         f"data.eval_dir={demo_data.eval}", "data.eval_samples=300", f"log.output_dir={out}",
                         f"log.log_file=run_{i}.log", f"log.system={SYSTEM}",
                         f"run.init_checkpoint={trained.checkpoint}", "run.local_batch_size=32", "optim.lr=1e-4",
                         "eval.interval_samples=32", "run.max_samples=320", "run.cache_cleared=true"])
        assert rc == 0
        logs.append(out / f"run_{i}.log")
    return logs


def test_package_ten_cpu_runs_succeeds(ten_runs, tmp_path):
    out = tmp_path / "submission"
    r = subprocess.run([sys.executable, "tools/package.py", "--system", SYSTEM, "--org", "reference", "--out", str(out),
                        *map(str, ten_runs)], cwd=PKG, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    table = r.stdout
    assert "package: SUCCESS" in table
    for i, log in enumerate(ten_runs):  # which input log each result file is
        assert f"result_{i}.txt <- {log}\n" in table
    assert "compliance checker (5.0.0)  PASS     10/10 logs pass" in table
    assert "logs vs system JSON         PASS     org, division, status, platform agree" in table
    assert "package checker (5.0.0)     PASS" in table
    assert "RCP checker (5.0.0)         n/a" in table
    assert "result summarizer (5.0.0)   PASS     bert score" in table
    org = out / "reference"
    results = sorted((org / "results" / SYSTEM / "bert").iterdir())
    assert [p.name for p in results] == sorted(f"result_{i}.txt" for i in range(10))
    assert (org / "systems" / f"{SYSTEM}.json").exists()
    impl = org / "benchmarks" / "bert" / "implementations" / "pytorch"
    assert (impl / "run.sub").exists() and (impl / "bert" / "train.py").exists() and not (impl / "results").exists()
    png = (out / "eval_accuracy.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    # The summarizer's score is the olympic mean of run_stop - run_start, in minutes.
    durations = sorted(
        (next(e for e in ev if e["key"] == "run_stop")["time_ms"] - next(e for e in ev if e["key"] == "run_start")["time_ms"])
        for ev in map(mllog_events, ten_runs))
    expected = sum(durations[1:-1]) / 8 / 60000
    score = float(table.split("bert score ", 1)[1].split()[0])
    assert score == pytest.approx(expected, rel=0.02, abs=0.01)


def test_package_fails_when_a_check_fails(ten_runs, tmp_path):
    """Seeds must differ across closed-division runs: the same log 10 times fails the package checker."""
    r = subprocess.run([sys.executable, "tools/package.py", "--system", SYSTEM, "--out", str(tmp_path / "p"),
                        *[str(ten_runs[0])] * 10], cwd=PKG, capture_output=True, text=True, timeout=600)
    assert r.returncode == 1
    assert "package: FAILED" in r.stdout and "package checker (5.0.0)     FAIL" in r.stdout


def test_package_help_documents_the_tool():
    r = subprocess.run([sys.executable, "tools/package.py", "--help"], cwd=PKG, capture_output=True, text=True)
    assert r.returncode == 0 and "--system" in r.stdout and "result summarizer" in r.stdout


def _copy_log(src, dst, **values):
    """A copy of log ``src`` with some events' values replaced (key=new value), and a
    resolved config beside it saying BERT-Large when ``large``."""
    lines = []
    for line in src.read_text().splitlines():
        if ":::MLLOG" in line:
            head, body = line.split(":::MLLOG", 1)
            e = json.loads(body)
            if e["key"] in values:
                e["value"] = values[e["key"]]
                line = f"{head}:::MLLOG {json.dumps(e)}"
        lines.append(line)
    dst.write_text("\n".join(lines) + "\n")
    return dst


def _say_bert_large(log):
    log.with_name(log.stem + "_config.json").write_text(json.dumps(
        {"model": {"hidden_size": 1024, "num_layers": 24}, "data": {"max_seq_length": 512}}))


def test_rcp_check_follows_the_logged_division(ten_runs, tmp_path):
    """RCPs are for the closed division (the package checker skips them for open): a
    BERT-Large log that says closed gets the RCP check, the same log saying open does not,
    and neither does the closed demo model."""
    pkg = _package_module()
    closed = _copy_log(ten_runs[0], tmp_path / "closed.log")
    _say_bert_large(closed)
    opened = _copy_log(ten_runs[0], tmp_path / "open.log", submission_division="open")
    _say_bert_large(opened)
    assert pkg.rcp_applies_to([closed]) == (True, "")
    applies, why = pkg.rcp_applies_to([opened])
    assert not applies and "closed division only" in why and "open" in why
    applies, why = pkg.rcp_applies_to([ten_runs[0]])
    assert not applies and "BERT-Large" in why


def test_package_flags_logs_that_disagree_with_the_system_json(ten_runs, tmp_path):
    pkg = _package_module()
    desc = json.loads((PKG.parents[3] / "systems" / f"{SYSTEM}.json").read_text())
    assert pkg.system_mismatches(ten_runs, desc) == []
    wrong = _copy_log(ten_runs[0], tmp_path / "onprem.log", submission_status="onprem", submission_org="other")
    got = pkg.system_mismatches([wrong], desc)
    assert len(got) == 2 and any("submission_status 'Available on-premise'" in g for g in got)
