"""log.compat: the same run's log also passes the older MLCommons rulesets (1.0.0-4.1.0),
which add submission_status, opt_epsilon and, in 1.1.0-2.1.0, one weights_initialization
event per TensorFlow checkpoint tensor name (the checker's own list is the oracle)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from bert.weights import tf_tensor_names
from bert.config import ModelConfig
from compat_log_helpers import RULESETS_WITH_NAMES


def checker_tensor_names(ruleset: str) -> list[str]:
    """The tensor names the ruleset's closed_bert.yaml demands, read from the installed checker."""
    import mlperf_logging.compliance_checker as cc

    text = (Path(cc.__file__).parent / f"training_{ruleset}" / "closed_bert.yaml").read_text()
    return re.findall(r'"((?:bert|cls)/[^"]+)"', text)


@pytest.mark.parametrize("ruleset", RULESETS_WITH_NAMES)
def test_tf_names_of_bert_large_are_the_checkers_398(ruleset):
    want = checker_tensor_names(ruleset)
    assert len(want) == 398
    assert sorted(tf_tensor_names(ModelConfig())) == sorted(want)
