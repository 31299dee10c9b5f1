"""tools/plan.py: the gradient it sends is the model's, its ring arithmetic is the textbook
one, overlap and the knobs move time the way they must, and its communication model
reproduces the grad-sync benchmark's measured simulated-link table (docs/grad_sync.md) within 20%."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import PKG


sys.path.insert(0, str(PKG / "tools"))


def test_cli_from_the_shipped_pretraining_configs():
    r = subprocess.run([sys.executable, "tools/plan.py", "--configs", "config_A100PCIE_8x4_pretrain_large_phase1.sh",
                        "config_A100PCIE_8x4_pretrain_large_phase2.sh", "--throughput", "400,90", "--json"],
                       cwd=PKG, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert [p["phase"] for p in out["phases"]] == ["phase1", "phase2"]
    assert out["phases"][0]["global_batch"] == 65536 and out["phases"][1]["global_batch"] == 32768
    assert out["total_days"] > 0 and out["best_knob"] in out["knobs_days"]
