#!/usr/bin/env bash
# System: 1 x DGX A100 (8 x A100-SXM4-80GB). Closed division, LAMB, the MLPerf reference
# hyperparameters for global batch 448 (56 per GPU x 8 GPUs, no accumulation).
# Expected: 0.720 masked-LM accuracy after about 2.41M samples (the 5.0.0 RCP mean for
# GBS 448, ~5,400 of the 7,100 scheduled steps); not yet measured on this code (no GPU here).
# Launch: source config_DGXA100_1x8x56x1.sh
#         CONT=<image> DATADIR=... EVALDIR=... INIT_CHECKPOINT=... sbatch -N "$DGXNNODES" -t "$WALLTIME" run.sub
# shellcheck source=config_DGXA100_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/config_DGXA100_common.sh"
export DGXSYSTEM=DGXA100_1x8x56x1
export DGXNNODES=1
export WALLTIME=02:00:00

export DIVISION=closed
export OPTIMIZER=lamb
export BATCHSIZE=56         # per GPU
export GRADIENT_STEPS=1
export LR=3.5e-4
export MAX_STEPS=7100
export WARMUP_STEPS=0
export START_WARMUP_STEP=0
export OPT_LAMB_BETA_1=0.9
export OPT_LAMB_BETA_2=0.999
export OPT_EPSILON=1e-6
export WEIGHT_DECAY_RATE=0.01
export END_LR=0.0
export EXTRA_PARAMS=""
