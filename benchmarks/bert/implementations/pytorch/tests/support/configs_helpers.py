"""Helpers of test_configs.py's unit and integration tests (and of other test files that import them)."""

from __future__ import annotations

from conftest import PKG


CONFIGS = sorted(p.name for p in PKG.glob("config_*.sh") if not p.name.endswith("_common.sh"))


# The global batch each config's header states.
GLOBAL_BATCH = {"config_CPU_1x2.sh": 64, "config_DGXA100_1x8x56x1.sh": 448, "config_DGXA100_8x8x48x1.sh": 3072,
                "config_DGXA100_128x8.sh": 16384, "config_A100PCIE_8x4x24x4.sh": 3072,
                "config_A100PCIE_8x4_pretrain_large_phase1.sh": 65536, "config_A100PCIE_8x4_pretrain_large_phase2.sh": 32768,
                "config_A100PCIE_8x4_pretrain_base_phase1.sh": 65536, "config_A100PCIE_8x4_pretrain_base_phase2.sh": 32768,
                "config_CPU_1x2_pretrain_phase1.sh": 64, "config_CPU_1x2_pretrain_phase2.sh": 32}
