#!/usr/bin/env bash
# System: 8 x DGX A100 (64 x A100-SXM4-80GB, 8 x HDR InfiniBand per node). Closed division,
# LAMB, the 5.0.0 RCP's hyperparameters for global batch 3,072 (48 per GPU x 64 GPUs):
# lr 2.0e-3, 1,141 steps, 100 warmup steps from step 0, betas 0.66/0.998, eps 1e-6, weight
# decay 0.01 (rcps_bert.json, bert_ref_3072; its runs accumulated 96 steps, ours none: the
# global batch, not the accumulation, is what the RCP fixes). No deviation from the RCP.
# Expected: 0.720 masked-LM accuracy after about 2.77M samples (the RCP mean of GBS 3072; its
# 20 reference runs took 2.48M-3.12M), ~900 of the 1,141 scheduled steps; not yet measured on
# this code (no GPU here). Sample cap: the schedule's end, 3.51M samples, above every
# reference run; past it the rate is end_lr = 0.
# Launch: source config_DGXA100_8x8x48x1.sh
#         CONT=<image> DATADIR=... EVALDIR=... INIT_CHECKPOINT=... sbatch -N "$DGXNNODES" -t "$WALLTIME" --gpus-per-node="$DGXNGPU" run.sub
# shellcheck source=config_DGXA100_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/config_DGXA100_common.sh"
CONFIG_SCRIPT=$(realpath "${BASH_SOURCE[0]}")  # this file: how launchers tell its values from yours
export CONFIG_SCRIPT
export DGXSYSTEM=DGXA100_8x8x48x1
export DGXNNODES=8
export WALLTIME=00:40:00

export DIVISION=closed
export OPTIMIZER=lamb
export BATCHSIZE=48         # per GPU
export GRADIENT_STEPS=1
export LR=2.0e-3
export MAX_STEPS=1141
export WARMUP_STEPS=100
export START_WARMUP_STEP=0
export OPT_LAMB_BETA_1=0.66
export OPT_LAMB_BETA_2=0.998
export OPT_EPSILON=1e-6
export WEIGHT_DECAY_RATE=0.01
export END_LR=0.0
export CONFIG_PARAMS="run.device=cuda"
