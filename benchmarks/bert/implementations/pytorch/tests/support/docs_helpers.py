"""Helpers of test_docs.py's unit and integration tests (and of other test files that import them)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from docblocks import PKG, ROOT, command_blocks


PAGES = [PKG / "README.md", *sorted((PKG / "docs").glob("*.md")), ROOT / "README.md"]


def all_blocks():
    return [b for page in PAGES for b in command_blocks(page)]


def the_block(page: str, start: str):
    return next(b for b in all_blocks() if b.page == page and b.first_line.startswith(start))


def markdown_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "*.md"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    tracked = [ROOT / p for p in out.split()]
    return sorted(set(tracked) | set(PAGES))  # pages not yet committed count too


LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
