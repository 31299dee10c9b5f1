#!/usr/bin/env bash
# System: 8 x DGX A100 (64 x A100-SXM4-80GB, 8 x HDR InfiniBand per node). Closed division,
# LAMB, the MLPerf reference hyperparameters for global batch 3,072 (48 per GPU x 64 GPUs).
# Expected: 0.720 masked-LM accuracy after about 2.8M samples (RCP range of GBS 3072,
# ~900-1,000 of the 1,271 scheduled steps); not yet measured on this code (no GPU here).
# Launch: source config_DGXA100_8x8x48x1.sh
#         CONT=<image> DATADIR=... EVALDIR=... INIT_CHECKPOINT=... sbatch -N "$DGXNNODES" -t "$WALLTIME" run.sub
# shellcheck source=config_DGXA100_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/config_DGXA100_common.sh"
export DGXSYSTEM=DGXA100_8x8x48x1
export DGXNNODES=8
export WALLTIME=00:40:00

export DIVISION=closed
export OPTIMIZER=lamb
export BATCHSIZE=48         # per GPU
export GRADIENT_STEPS=1
export LR=1.5e-3
export MAX_STEPS=1271
export WARMUP_STEPS=100
export START_WARMUP_STEP=-25
export OPT_LAMB_BETA_1=0.83
export OPT_LAMB_BETA_2=0.925
export OPT_EPSILON=1e-6
export WEIGHT_DECAY_RATE=0.01
export END_LR=0.0
export EXTRA_PARAMS=""
