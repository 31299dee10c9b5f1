"""The order `make test` hands the test files to its workers (conftest.pytest_collection_modifyitems):
the files that need no `trained` run first, while it trains in the background; those that need
it after; the image's last; the longest first within each group; a file's tests together."""

from __future__ import annotations

from types import SimpleNamespace

from conftest import LONGEST_FIRST, PKG, pytest_collection_modifyitems


ROOT = PKG.parents[3]


def _item(file: str, *fixtures: str, name: str = "test_x") -> SimpleNamespace:
    return SimpleNamespace(path=PKG / "tests" / file, nodeid=f"tests/{file}::{name}", fixturenames=fixtures)


def test_files_without_trained_first_then_with_it_longest_first_image_last():
    items = [_item("unit/test_a.py"), _item("integration/test_launchers.py", "trained"),
             _item("integration/test_image.py", "docker_image"), _item("integration/test_b.py", "trained"),
             _item("integration/test_b.py", name="test_y"), _item("integration/test_precision.py"),
             _item("unit/test_precision.py"), _item("integration/test_pretrain.py", "demo_data")]
    pytest_collection_modifyitems(items)
    assert [i.nodeid for i in items] == [
        "tests/integration/test_pretrain.py::test_x", "tests/integration/test_precision.py::test_x",
        "tests/unit/test_a.py::test_x", "tests/unit/test_precision.py::test_x",
        "tests/integration/test_launchers.py::test_x", "tests/integration/test_b.py::test_x",
        "tests/integration/test_b.py::test_y", "tests/integration/test_image.py::test_x"]


def test_longest_first_names_files_that_exist():
    assert [n for n in LONGEST_FIRST if not (PKG / "tests" / n).is_file()] == []


def test_make_test_keeps_that_order():
    """xdist would otherwise hand out the files with the most tests first (its loadscope reorder)."""
    assert "--dist loadfile --no-loadscope-reorder" in (ROOT / "Makefile").read_text()
