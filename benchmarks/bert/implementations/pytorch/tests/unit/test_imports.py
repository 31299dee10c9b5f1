"""Imports among ``bert/`` modules run one way (from train.py down to config.py: the README's
"What runs" table, data -> sampler -> model -> loss -> sync -> optimizer -> eval -> log).

Every import of a ``bert`` module is counted, at module level and inside functions alike: a
function-level import that dodges a cycle is still a cycle. An import inside a function is
allowed only for a reason its line states (a comment), e.g. an optional dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2]
BERT = PKG / "bert"


def bert_imports(path: Path) -> list[tuple[str, int, bool]]:
    """(imported bert module, line, inside a function?) for every import in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    out: list[tuple[str, int, bool]] = []

    def visit(node: ast.AST, nested: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = nested or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.ImportFrom):
                base = "bert" if child.level == 1 else (child.module or "")
                if child.level == 1 and child.module:
                    base = f"bert.{child.module}"
                if base == "bert":  # from . import x / from bert import x: each name is a module
                    out.extend((f"bert.{a.name}", child.lineno, nested) for a in child.names)
                elif base.startswith("bert."):
                    out.append((base, child.lineno, nested))
            elif isinstance(child, ast.Import):
                out.extend((a.name, child.lineno, nested) for a in child.names if a.name.startswith("bert."))
            visit(child, inner)

    visit(tree, False)
    return [(name.split(".")[1], line, nested) for name, line, nested in out]


def import_graph(root: Path) -> dict[str, set[str]]:
    modules = {p.stem for p in root.glob("*.py")}
    return {p.stem: {m for m, _, _ in bert_imports(p) if m in modules and m != p.stem}
            for p in sorted(root.glob("*.py"))}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path [a, b, ..., a], or None (depth-first, three colours)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (found := dfs(m)):
                return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (found := dfs(n)):
            return found
    return None


def test_bert_modules_import_in_one_direction():
    cycle = find_cycle(import_graph(BERT))
    assert cycle is None, "bert/ modules import each other in a circle: " + " -> ".join(cycle)


def test_function_level_imports_of_bert_modules_say_why():
    lines_without_reason = []
    for path in sorted(BERT.glob("*.py")):
        text = path.read_text().splitlines()
        for module, line, nested in bert_imports(path):
            if nested and "#" not in text[line - 1]:
                lines_without_reason.append(f"{path.name}:{line}: imports bert.{module} inside a function")
    assert not lines_without_reason, "\n".join(lines_without_reason)


@pytest.mark.parametrize("source, cyclic", [
    # the knot this project had: config -> budget (inside validate) -> sampler (inside a function) -> budget
    ({"config.py": "def f():\n    from .budget import check\n",
      "budget.py": "from .config import X\ndef g():\n    from .sampler import S\n",
      "sampler.py": "from .data import D\ndef h():\n    from .budget import B\n",
      "data.py": ""}, True),
    ({"config.py": "", "budget.py": "from .config import X\n", "sampler.py": "from bert import budget, config\n",
      "ladder.py": "import bert.sampler\nfrom .budget import Layout\n"}, False),
])
def test_the_cycle_check_sees_function_level_imports(tmp_path, source, cyclic):
    for name, text in source.items():
        (tmp_path / name).write_text(text)
    assert (find_cycle(import_graph(tmp_path)) is not None) is cyclic
