#!/usr/bin/env bash
# Pretraining from scratch (run.mode=pretrain), BERT-Large, phase 2 of 2 (seq 512, 80 predictions).
# System: an academic cluster: 8 nodes x 4 A100-PCIe-40GB, one 25 GbE link per node (no
# InfiniBand, no NVLink between nodes), as config_A100PCIE_8x4x24x4.sh assumes.
# Recipe: NVIDIA DeepLearningExamples' two-phase LAMB (phase 1: seq 128, 20 predictions,
# batch 65,536, 7,038 steps, lr 6e-3, warmup 28.43%; phase 2: seq 512, 80 predictions,
# batch 32,768, 1,563 steps, lr 4e-3, warmup 12.8%), the big batches reached by gradient
# accumulation: global batch = 16 per GPU x 64 micro-steps x 32 GPUs. docs/pretraining.md
# ("Pretraining from scratch") says where this differs from Lin et al. (2020) and Izsak et
# al. (2021). Predicted time: python tools/plan.py --configs <phase 1> <phase 2> --throughput ...
# Expected: the step count reached (no accuracy target); held-out MLM/NSP curves in
# <LOGDIR>/phaseN_1_curves.png. Not run on this cluster: the days are plan.py's prediction.
# Launch: DATADIR1=... EVALDIR1=... DATADIR2=... EVALDIR2=... OUTDIR=... \
#         ./submit_pretrain.sh <phase 1 config> <phase 2 config>   (both phases as SLURM jobs,
#         phase 2 --dependency=afterok on phase 1, each requeued on preemption and resumed)
CONFIG_SCRIPT=$(realpath "${BASH_SOURCE[0]}")  # this file: how launchers tell its values from yours
export CONFIG_SCRIPT
export DGXSYSTEM=A100PCIE_8x4_pretrain
export DGXNNODES=8
export DGXNGPU=4
export WALLTIME=24:00:00    # per job instance; a longer phase is requeued and resumed

export DIVISION=open
export OPTIMIZER=lamb
export BATCHSIZE=16          # per GPU per micro-step
export GRADIENT_STEPS=64
export LR=4e-3
export MAX_STEPS=1563
export WARMUP_STEPS=200
export START_WARMUP_STEP=0
export OPT_LAMB_BETA_1=0.9
export OPT_LAMB_BETA_2=0.999
export OPT_EPSILON=1e-6
export WEIGHT_DECAY_RATE=0.01
export END_LR=0.0
export EVAL_ITER_SAMPLES=6553600   # held-out MLM/NSP accuracy and loss every 200 steps
export PRECISION=bf16
# Checkpoints every 30 min bound the work a node failure loses; SIGUSR1/SIGTERM checkpoint too.
export CONFIG_PARAMS="run.device=cuda run.mode=pretrain data.max_seq_length=512 data.max_predictions_per_seq=80 \
data.eval_samples=0 grad_sync.bucket_cap_mb=100 grad_sync.compression=bf16 \
ckpt.interval_minutes=30"
