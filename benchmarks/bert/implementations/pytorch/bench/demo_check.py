"""The demo end to end on this machine's device: config_CPU_1x2.sh's model and data trained by
``run_and_time.sh`` in one process to 0.720, then the MLPerf 5.0.0 compliance checker on its
log (a device-run task, bench/device_run.py; the suite runs it on a CPU from the trained demo
weights)."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

PKG = Path(__file__).resolve().parent.parent
if str(PKG) not in sys.path:
    sys.path.insert(0, str(PKG))


def check_demo(workdir: Path, artifacts: Path, smoke: bool, data_dir: Path | None = None,
               extra_env: dict[str, str] | None = None, timeout_s: float = 300.0) -> dict:
    """config_CPU_1x2.sh's model and data, trained by ``run_and_time.sh`` in one process on
    this machine's device (LAUNCHER=task; BATCHSIZE = the config's per-rank batch x its
    ranks, so the global batch and the schedule are the config's), then the 5.0.0 checker
    on its log. ``smoke``: 3 steps, eval on 64 samples after each (the target is not
    expected). ``extra_env`` overrides the launcher's variables (the tests start from the
    trained demo model). Copies the log, the trainer's output and the checker's output to
    ``artifacts`` as demo_result_0.txt, demo_train.log, demo_compliance.txt."""
    from bert import config_script, demo_data
    from bert.mlperf_log import read_events

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
        env.update(EVAL_ITER_SAMPLES="64", EXTRA_PARAMS="run.max_steps=3 data.eval_samples=64")
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
                           "local_batch": int(env["BATCHSIZE"]), "config_params": env["CONFIG_PARAMS"],
                           "extra_params": env.get("EXTRA_PARAMS", "")}
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
