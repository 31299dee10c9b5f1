#!/usr/bin/env bash
# System: a modest academic cluster: 8 nodes x 4 A100-PCIe-40GB, one 25 GbE link per node
# (no InfiniBand, no NVLink between nodes). Closed division, LAMB, global batch 3,072 =
# 24 per GPU x 4 accumulation steps x 32 GPUs, so the 5.0.0 RCP of GBS 3,072 applies
# unchanged (lr 2.0e-3, 1,141 steps, 100 warmup, betas 0.66/0.998, eps 1e-6, weight decay
# 0.01); accumulation cuts the allreduces (the slow link's cost) 4x.
# Expected: 0.720 after about 2.77M samples like config_DGXA100_8x8x48x1.sh (same GBS and
# hyperparameters; cap the schedule's end, 3.51M); hours rather than minutes on this
# network. Not yet measured.
# Launch: source config_A100PCIE_8x4x24x4.sh
#         CONT=<image> DATADIR=... EVALDIR=... INIT_CHECKPOINT=... sbatch -N "$DGXNNODES" -t "$WALLTIME" --gpus-per-node="$DGXNGPU" run.sub
CONFIG_SCRIPT=$(realpath "${BASH_SOURCE[0]}")  # this file: how launchers tell its values from yours
export CONFIG_SCRIPT
export DGXSYSTEM=A100PCIE_8x4x24x4
export DGXNNODES=8
export DGXNGPU=4
export WALLTIME=08:00:00


export DIVISION=closed
export OPTIMIZER=lamb
export BATCHSIZE=24         # per GPU per micro-step
export GRADIENT_STEPS=4
export LR=2.0e-3
export MAX_STEPS=1141
export WARMUP_STEPS=100
export START_WARMUP_STEP=0
export OPT_LAMB_BETA_1=0.66
export OPT_LAMB_BETA_2=0.998
export OPT_EPSILON=1e-6
export WEIGHT_DECAY_RATE=0.01
export END_LR=0.0
export PRECISION=bf16
# 25 GbE: fewer, larger allreduces and half the bytes on the wire (bf16 buckets).
export CONFIG_PARAMS="run.device=cuda grad_sync.bucket_cap_mb=100 grad_sync.compression=bf16"
