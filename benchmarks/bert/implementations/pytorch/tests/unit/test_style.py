"""What the reviews ask of every file, checked: comments and docstrings of code and tests
state what is true now, so they carry no issue numbers and no dates (history lives in the
commit messages, measurements in BENCHMARKS.md); hand-offs of many values are keyword-only."""

from __future__ import annotations

import ast
import inspect
import io
import re
import tokenize
from pathlib import Path

import pytest

from bert.budget import simulated_token_counts
from bert.checkpoint import Checkpointer
from bert.curves import Curves
from bert.demo_data import generate
from bert.loader import TrainLoader, train_batches
from bert.sampler import IndexSampler, build_sampler
from bert.state import Learner

PKG = Path(__file__).resolve().parents[2]
ROOTS = ("bert", "tests", "tools", "bench", "input_preprocessing")

# An issue or pull-request number: a word for one followed by a number (a list of them too),
# or a bare hash-number reference. An upstream one written owner/repo#N names another project's
# tracker, a fact about a dependency, and passes; section numbers and counts are not matched.
ISSUE = re.compile(r"\b(?:issues?|PRs?|pull requests?|tickets?)\s*#?\s*\d+|(?<![\w&#/])#\d{2,}\b", re.I)
_MONTH = (r"(?:Jan(?:uary)?|Feb(?:ruary)?|Mar(?:ch)?|Apr(?:il)?|May|June?|July?|Aug(?:ust)?|Sep(?:t(?:ember)?)?"
          r"|Oct(?:ober)?|Nov(?:ember)?|Dec(?:ember)?)")
# A calendar date or month: ISO year-month(-day), month name and year (with or without the day,
# either order). A bare year (a citation's) is not a date.
DATE = re.compile(rf"\b(?:19|20)\d\d-(?:0[1-9]|1[0-2])(?:-(?:0[1-9]|[12]\d|3[01]))?\b"
                  rf"|\b{_MONTH}\.? (?:\d{{1,2}}(?:st|nd|rd|th)?,? )?(?:19|20)\d\d\b"
                  rf"|\b\d{{1,2}} {_MONTH} (?:19|20)\d\d\b")


def python_files() -> list[Path]:
    return sorted(p for root in ROOTS for p in (PKG / root).rglob("*.py") if "__pycache__" not in p.parts)


def comments_and_docstrings(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every comment and every module, class and function docstring."""
    source = path.read_text()
    out = [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(source).readline)
           if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source, str(path))):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                first = node.body[0].lineno
                out += [(first + i, line) for i, line in enumerate(doc.splitlines())]
    return out


def history_in(path: Path) -> list[str]:
    return [f"{path.relative_to(PKG)}:{line}: {text.strip()}" for line, text in comments_and_docstrings(path)
            if ISSUE.search(text) or DATE.search(text)]


def test_comments_and_docstrings_carry_no_issue_numbers_or_dates():
    found = [hit for path in python_files() for hit in history_in(path)]
    assert not found, "history in comments or docstrings (say what is true now):\n" + "\n".join(found)


@pytest.mark.parametrize("text, history", [
    ("# the fix for issue 45", True), ("# see issues 41, 44", True), ("# as in #123", True),
    ("# measured 2024-05-17", True), ("# since May 2024", True), ("# on 3 March 2025", True),
    ("# Kim et al., 2024", False), ("# BENCHMARKS.md section 10", False), ("# 4,320 shards", False),
    ("# fixed by triton-lang/triton#9172", False), ('def f():\n    """Measured on 2025-01-31."""', True),
    ("x = 'a string, not a comment: issue 45'", False),
    ("# 512 tokens at 2048-way", False), ("# the # of ranks", False),
])
def test_the_patterns_find_history_and_only_history(tmp_path, text, history):
    path = tmp_path / "x.py"
    path.write_text(f'"""A module."""\n\n{text}\nx = 1\n')
    assert bool(history_in_file(path)) == history


def history_in_file(path: Path) -> list[str]:
    return [text for _line, text in comments_and_docstrings(path) if ISSUE.search(text) or DATE.search(text)]


@pytest.mark.parametrize("fn, positional", [
    (Checkpointer.__init__, ["self"]), (TrainLoader.__init__, ["self"]), (train_batches, []),
    (IndexSampler.__init__, ["self", "lengths", "strata"]), (build_sampler, ["cfg", "index"]),
    (Learner.__init__, ["self"]), (simulated_token_counts, ["sm"]), (generate, ["output"]),
    (Curves.__init__, ["self", "log_dir"]),
])
def test_hand_offs_of_many_values_are_keyword_only(fn, positional):
    """A call that passes seven values by position breaks silently when one is added or two
    trade places: these take their values by name."""
    params = inspect.signature(fn).parameters.values()
    assert [p.name for p in params if p.kind != p.KEYWORD_ONLY] == positional
