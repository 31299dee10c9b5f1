"""The fixture both halves of test_lamb_fused.py use."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Dynamo's cache lives on the code object, shared by every compiled Lamb: start each
    test from an empty one so its compile count is its own."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()
