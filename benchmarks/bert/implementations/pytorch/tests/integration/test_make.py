"""`make prereqs`, which `make` runs before it builds the venv: each missing system
prerequisite is named with the Debian package that provides it; a missing C++ compiler is
only a warning. Each case runs make on a PATH without the program (conftest.path_without)."""

from __future__ import annotations

import subprocess

import pytest

from conftest import PKG, PROCPS, path_without

ROOT = PKG.parents[3]


def make_prereqs(tmp_path, *without: str, python3: str | None = None) -> subprocess.CompletedProcess:
    path = path_without(tmp_path / "bin", PROCPS + without, venv=False)
    if python3 is not None:  # a stand-in python3, first on the PATH
        fake = tmp_path / "fake"
        fake.mkdir()
        (fake / "python3").write_text(f"#!/bin/sh\n{python3}\n")
        (fake / "python3").chmod(0o755)
        path = f"{fake}:{path}"
    return subprocess.run(["make", "--no-print-directory", "-C", str(ROOT), "prereqs"], env={"PATH": path},
                          capture_output=True, text=True, timeout=60)


def test_all_there(tmp_path):
    r = make_prereqs(tmp_path)
    assert r.returncode == 0 and "need" not in r.stderr and "not found" not in r.stderr, r.stderr


@pytest.mark.parametrize("without, python3, says", [
    (("git",), None, "make: git not found; install it (Debian: apt-get install git)"),
    ((), 'case "$1" in --version) echo "Python 3.10.12";; *) exit 1;; esac',
     "make: need python3 >= 3.11 (found: Python 3.10.12); install python3 (Debian: apt-get install python3)"),
    ((), 'case "$2" in *ensurepip*) exit 1;; esac',  # Debian's python3 without python3-venv
     "make: python3 has no venv/ensurepip module; install it (Debian: apt-get install python3-venv)"),
])
def test_missing_prerequisite_is_named(tmp_path, without, python3, says):
    r = make_prereqs(tmp_path, *without, python3=python3)
    assert r.returncode != 0 and says in r.stderr, r.stderr


def test_no_cxx_compiler_only_warns(tmp_path):
    r = make_prereqs(tmp_path, "g++")
    assert r.returncode == 0, r.stderr
    assert "warning: no working C++ compiler (g++" in r.stderr and "apt-get install g++" in r.stderr
