"""Helpers of test_package.py's unit and integration tests (and of other test files that import them)."""

from __future__ import annotations

import sys

from conftest import PKG


def _package_module():
    import importlib.util

    if "package_tool" in sys.modules:
        return sys.modules["package_tool"]
    spec = importlib.util.spec_from_file_location("package_tool", PKG / "tools" / "package.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["package_tool"] = mod  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod
