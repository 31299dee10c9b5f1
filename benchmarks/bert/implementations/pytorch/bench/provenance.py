"""What a device result was measured with: the software versions and the commit."""

from __future__ import annotations

import importlib.metadata
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch

PKG = Path(__file__).resolve().parent.parent


def versions() -> dict[str, Any]:
    """torch, CUDA, cuDNN, Triton, Python and mlperf-logging versions (None where missing)."""
    try:
        import triton
        tv = triton.__version__
    except Exception:  # noqa: BLE001 - missing, or broken on this machine: say which
        tv = None
    try:
        mv = importlib.metadata.version("mlperf-logging")
    except importlib.metadata.PackageNotFoundError:
        mv = None
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": cudnn, "triton": tv,
            "python": platform.python_version(), "mlperf_logging": mv}


def git_commit() -> tuple[str, str]:
    """(commit, where it came from): ``git rev-parse HEAD`` (suffixed -dirty when tracked files
    differ from it), or "unknown" outside a checkout (the device gets none: bench/h200.sh
    passes the carried commit instead)."""
    try:
        r = subprocess.run(["git", "rev-parse", "HEAD"], cwd=PKG, capture_output=True, text=True, timeout=10)
        if r.returncode == 0:
            dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=PKG,
                                   capture_output=True, text=True, timeout=10).stdout.strip()
            return r.stdout.strip() + ("-dirty" if dirty else ""), "git rev-parse HEAD"
    except (OSError, subprocess.TimeoutExpired):
        pass
    return "unknown", "none: no --commit and no git checkout"
