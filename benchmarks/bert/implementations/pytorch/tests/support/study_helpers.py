"""Helpers of test_study.py's unit and integration tests (and of other test files that import them)."""

from __future__ import annotations

import study  # noqa: E402  (tools/ holds scripts, not a package)


PLAN = study.DEFAULT_PLAN
