"""tools/glue.sub: the GLUE grid as a SLURM array on a one-node cluster (one run per array task),
then the table from their results; the rest of GLUE fine-tuning: tests/unit/test_glue.py."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

from conftest import PKG
from glue_helpers import _grid, examples, tiny_model, write_task  # noqa: F401 - tiny_model: a fixture

sys.path.insert(0, str(PKG / "tools"))
import glue  # noqa: E402  (tools/ holds scripts, not a package)


def test_array_on_slurm_runs_one_run_per_task_and_the_table_follows(slurm_cluster, tmp_path, tiny_model):
    rng = random.Random(3)
    for task in ("RTE", "CoLA"):
        write_task(tmp_path / "glue", task, examples(task, 64, rng), examples(task, 16, rng))
    grid = _grid(tmp_path, tiny_model, tmp_path / "glue", tasks=["RTE", "CoLA"], lrs=[1e-3, 2e-3], seeds=[1])
    r = subprocess.run([sys.executable, "tools/glue.py", "plan", "--grid", str(grid)], cwd=PKG,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "4 runs:" in r.stdout and "--array=0-3 " in r.stdout, r.stdout + r.stderr
    env = dict(os.environ, GRID=str(grid), GLUE_WORKDIR=str(tmp_path / "w"), SLURM_CONF=slurm_cluster.env["SLURM_CONF"],
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    sub = subprocess.run(["sbatch", "--parsable", "--array=0-3%2", "-N", "1", "-t", "10",
                          "-o", str(tmp_path / "task_%a.out"), "tools/glue.sub"],
                         cwd=PKG, env=env, capture_output=True, text=True, timeout=60)
    assert sub.returncode == 0, sub.stderr
    job = sub.stdout.strip().split(";")[0]
    for i in range(4):
        state = slurm_cluster.wait_job(f"{job}_{i}", timeout_s=300)
        out = "\n".join(p.read_text() for p in sorted(tmp_path.glob("task_*.out")))
        assert state["JobState"] == "COMPLETED", out + slurm_cluster.logs()
    g = glue.load_grid(grid)
    for i, run in enumerate(glue.runs(g)):  # array task i ran run i
        assert json.loads(run.path(tmp_path / "w" / "t").read_text())["lr"] == run.lr
        assert f"glue.sub: run {i} of" in (tmp_path / f"task_{i}.out").read_text()
    assert glue.main(["table", "--grid", str(grid), "--workdir", str(tmp_path / "w")]) == 0
    table = json.loads((tmp_path / "w" / "t" / "table.json").read_text())["inits"]["pretrained"]
    assert table["tasks"]["RTE"]["complete"] and table["tasks"]["CoLA"]["complete"]
