"""The pins for ``pip install`` in the image: constraints.txt less torch and less every package
the base image pins itself.

    python tools/image_constraints.py constraints.txt --base "$PIP_CONSTRAINT" > /tmp/constraints-image.txt

NGC PyTorch images (25.03 and later) export ``PIP_CONSTRAINT=/etc/pip/constraint.txt``, a file
pinning every Python package they ship, which pip applies to every install beside any ``-c``
file. A package pinned to two versions fails the install (ResolutionImpossible), and the
base's versions are the ones NVIDIA tested with its own torch build, so the base's pin wins:
ours stays only for packages the base does not pin. torch is always dropped (the image keeps
the base's build; our pin names the CPU wheel). ``--base`` takes PIP_CONSTRAINT's value as pip
reads it (whitespace-separated files; empty: no base pins). What was dropped goes to stderr.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

# A requirement line's project name (PEP 508), before any version, extra, marker or "@ url".
_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")
ALWAYS_DROPPED = frozenset({"torch"})


def canonical(name: str) -> str:
    """PEP 503 normalisation: Py_YAML, py.yaml and PyYAML are one project."""
    return re.sub(r"[-_.]+", "-", name).lower()


def pinned_names(text: str) -> set[str]:
    """The projects a constraints file names (comments, blank lines and pip options skipped)."""
    names = set()
    for line in text.splitlines():
        line = line.split("#", 1)[0]
        if line.lstrip().startswith("-"):
            continue
        m = _NAME.match(line)
        if m:
            names.add(canonical(m.group(1)))
    return names


def image_constraints(ours: str, base: list[str]) -> tuple[str, list[str]]:
    """(our constraints text without the pins the base overrides, the dropped lines)."""
    taken = set(ALWAYS_DROPPED)
    for text in base:
        taken |= pinned_names(text)
    kept, dropped = [], []
    for line in ours.splitlines():
        m = _NAME.match(line.split("#", 1)[0])
        if m and canonical(m.group(1)) in taken:
            dropped.append(line.strip())
        else:
            kept.append(line)
    return "\n".join(kept) + "\n", dropped


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    ap.add_argument("constraints", type=Path, help="our pins (constraints.txt)")
    ap.add_argument("--base", default="", help="the base image's PIP_CONSTRAINT (whitespace-separated files)")
    args = ap.parse_args(argv)
    texts = []
    for name in [args.constraints, *map(Path, args.base.split())]:
        try:
            texts.append(name.read_text())
        except OSError as e:
            print(f"image_constraints: {name}: {e.strerror}", file=sys.stderr)
            return 2
    text, dropped = image_constraints(texts[0], texts[1:])
    sys.stdout.write(text)
    for line in dropped:
        print(f"image_constraints: {line}: the base image's own version stays", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
