"""Helpers of test_published_recipe.py's unit and integration tests (and of other test files that import them)."""

from __future__ import annotations

from conftest import PKG


CONFIG = PKG / "config_DGXA100_128x8.sh"
