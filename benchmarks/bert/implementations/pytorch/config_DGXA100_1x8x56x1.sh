#!/usr/bin/env bash
# System: 1 x DGX A100 (8 x A100-SXM4-80GB). Closed division, LAMB, the 5.0.0 RCP's
# hyperparameters for global batch 448 (56 per GPU x 8 GPUs, no accumulation): lr 4.25e-4,
# 6,700 steps, no warmup, betas 0.9/0.999, eps 1e-6, weight decay 0.01 (rcps_bert.json,
# bert_ref_448). No deviation from the RCP.
# Expected: 0.720 masked-LM accuracy after about 2.41M samples (the RCP mean of GBS 448; its
# 23 reference runs took 1.98M-2.76M), ~5,400 of the 6,700 scheduled steps; not yet measured
# on this code (no GPU here). Sample cap: the schedule's end, 3.00M samples (run.max_samples
# 0), above every reference run; past it the rate is end_lr = 0 and LAMB changes nothing.
# Launch: source config_DGXA100_1x8x56x1.sh
#         CONT=<image> DATADIR=... EVALDIR=... INIT_CHECKPOINT=... sbatch -N "$DGXNNODES" -t "$WALLTIME" --gpus-per-node="$DGXNGPU" run.sub
# shellcheck source=config_DGXA100_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/config_DGXA100_common.sh"
CONFIG_SCRIPT=$(realpath "${BASH_SOURCE[0]}")  # this file: how launchers tell its values from yours
export CONFIG_SCRIPT
export DGXSYSTEM=DGXA100_1x8x56x1
export DGXNNODES=1
export WALLTIME=02:00:00

export DIVISION=closed
export OPTIMIZER=lamb
export BATCHSIZE=56         # per GPU
export GRADIENT_STEPS=1
export LR=4.25e-4
export MAX_STEPS=6700
export WARMUP_STEPS=0
export START_WARMUP_STEP=0
export OPT_LAMB_BETA_1=0.9
export OPT_LAMB_BETA_2=0.999
export OPT_EPSILON=1e-6
export WEIGHT_DECAY_RATE=0.01
export END_LR=0.0
export CONFIG_PARAMS="run.device=cuda"
