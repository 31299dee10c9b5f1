"""Every shipped config_*.sh sources cleanly and, through run_and_time.sh, resolves to a
valid training config: a dry run builds the model, optimizer, data and eval set (trains
nothing) and the resolved config says what the config file's header promises."""

from __future__ import annotations
from configs_helpers import CONFIGS, GLOBAL_BATCH


def test_every_config_is_listed():
    assert set(CONFIGS) == set(GLOBAL_BATCH), "add the new config's global batch to GLOBAL_BATCH"
