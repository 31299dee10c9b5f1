"""Helpers of test_compat_log.py's unit and integration tests (and of other test files that import them)."""

from __future__ import annotations


RULESETS_WITH_NAMES = ("1.1.0", "2.0.0", "2.1.0")
