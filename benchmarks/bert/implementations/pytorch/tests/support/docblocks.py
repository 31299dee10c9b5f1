"""The fenced code blocks and sections of the project's Markdown, for the tests that run them
(tests/{unit,integration}/test_docs.py; the README's quick start in tests/integration/test_launchers.py)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

PKG = Path(__file__).resolve().parents[2]
ROOT = PKG.parents[3]
# the languages of a block a reader may paste into a shell or an interpreter
COMMAND_LANGS = ("bash", "sh", "shell", "console", "python")
# the README section tests/integration/test_launchers.py runs as written
QUICK_START = "Quick start on a cluster"

_FENCE = re.compile(r"^```(\S*)[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)
_HEADING = re.compile(r"^(#{1,6}) +(.+?) *$", re.M)


@dataclass(frozen=True)
class Block:
    page: str  # path relative to the implementation directory (PKG), '../../../../README.md' for the root
    lang: str
    text: str
    line: int  # of the opening fence, 1-based
    heading: str  # the nearest heading above it (its words, without the #s)

    @property
    def first_line(self) -> str:
        return self.text.splitlines()[0].strip() if self.text.strip() else ""


def page_name(path: Path) -> str:
    try:
        return str(path.relative_to(PKG))
    except ValueError:
        return str(Path("../../../..") / path.relative_to(ROOT))


def strip_code(text: str) -> str:
    """``text`` with every fenced block blanked (every offset kept): headings and links inside
    code are not the page's."""
    return _FENCE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)


def blocks(path: Path) -> list[Block]:
    text = path.read_text()
    heads = [(m.start(), m.group(2)) for m in _HEADING.finditer(strip_code(text))]
    return [Block(page_name(path), m.group(1), m.group(2), text.count("\n", 0, m.start()) + 1,
                  next((h for at, h in reversed(heads) if at < m.start()), ""))
            for m in _FENCE.finditer(text)]


def command_blocks(path: Path) -> list[Block]:
    return [b for b in blocks(path) if b.lang in COMMAND_LANGS]


def section(path: Path, heading: str) -> str:
    """The text under the heading ``heading`` (its words, without the #s) up to the next
    heading of the same or a higher level."""
    text = path.read_text()
    plain = strip_code(text)
    for m in _HEADING.finditer(plain):
        if m.group(2) == heading:
            level = len(m.group(1))
            end = next((n.start() for n in _HEADING.finditer(plain, m.end()) if len(n.group(1)) <= level), len(text))
            return text[m.end():end]
    raise AssertionError(f"{page_name(path)} has no heading {heading!r}")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped (hyphens and
    underscores kept), spaces to hyphens."""
    h = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading.strip().lower())
    h = re.sub(r"[^\w\- ]", "", h)
    return h.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a page (a repeated heading gets -1, -2, ... as on GitHub)."""
    seen: dict[str, int] = {}
    out = set()
    for m in _HEADING.finditer(strip_code(path.read_text())):
        s = slug(m.group(2))
        n = seen.get(s, 0)
        out.add(s if n == 0 else f"{s}-{n}")
        seen[s] = n + 1
    return out
