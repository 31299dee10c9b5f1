#!/usr/bin/env bash
# DGX A100 facts shared by the config_DGXA100_*.sh files (sourced by them, not by users):
# 8 x A100-SXM4-80GB per node (NVLink/NVSwitch), 2 x AMD EPYC 7742 (64 cores each, SMT 2),
# 8 x 200 Gb/s HDR InfiniBand. The per-recipe files set the nodes, batch and optimizer.
export DGXNGPU=8            # tasks (one per GPU) per node
export DGXSOCKETCORES=64
export DGXNSOCKET=2
export DGXHT=2              # hardware threads per core
