#!/usr/bin/env bash
# Pretraining from scratch (run.mode=pretrain) on one machine, phase 2 of 2 (seq 512, 80 predictions).
# System: one CPU machine, 2 ranks (gloo), no GPU, as config_CPU_1x2.sh; any one machine (the
# launcher starts DGXNGPU ranks: GPUs, else CPU processes; on GPUs add run.device=cuda).
# Model: phase 1's (config_CPU_1x2_pretrain_phase1.sh: hidden 192, 3 layers, 512 positions),
# from its final weights (INIT_CHECKPOINT) with a fresh optimizer and schedule; the same
# model.vocab_size as phase 1. LAMB, global batch 32 (8 per rank x 2 micro-steps), 120 steps at
# lr 5e-3 with 10% warmup, held-out MLM/NSP every 640 samples (every sample of EVALDIR).
# Expected: the step count reached (no target); masked-LM accuracy on its seq-512 held-out set
# above phase 1's start (~0.12 on Python's docstrings: BENCHMARKS.md, section 11).
# Launch: source config_CPU_1x2_pretrain_phase2.sh
#         INIT_CHECKPOINT=<phase 1>/final.pt EXTRA_PARAMS="model.vocab_size=N" \
#         DATADIR=... EVALDIR=... LOGDIR=... SAVE_CHECKPOINT=.../final.pt ./run_and_time.sh
# shellcheck source=config_CPU_1x2_pretrain_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/config_CPU_1x2_pretrain_common.sh"
CONFIG_SCRIPT=$(realpath "${BASH_SOURCE[0]}")  # this file: how launchers tell its values from yours
export CONFIG_SCRIPT
export BATCHSIZE=8         # per rank per micro-step
export GRADIENT_STEPS=2
export LR=5e-3
export MAX_STEPS=120
export WARMUP_STEPS=12
export EVAL_ITER_SAMPLES=640
export CONFIG_PARAMS="${CONFIG_PARAMS} data.max_seq_length=512 data.max_predictions_per_seq=80"
