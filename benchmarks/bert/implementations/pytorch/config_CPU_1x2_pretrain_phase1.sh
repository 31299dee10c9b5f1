#!/usr/bin/env bash
# Pretraining from scratch (run.mode=pretrain) on one machine, phase 1 of 2 (seq 128, 20 predictions).
# System: one CPU machine, 2 ranks (gloo), no GPU, as config_CPU_1x2.sh; any one machine (the
# launcher starts DGXNGPU ranks: GPUs, else CPU processes; on GPUs add run.device=cuda).
# Model: a small BERT (hidden 192, 3 layers, 4 heads), 512 positions from phase 1 on, so that
# phase 2 (config_CPU_1x2_pretrain_phase2.sh) starts from these weights; the vocab is yours:
# EXTRA_PARAMS="model.vocab_size=$(wc -l < vocab.txt)". LAMB, global batch 64 (32 per rank),
# 300 steps at lr 1e-2 with 10% warmup, held-out MLM/NSP every 3,200 samples (every sample of
# EVALDIR), no dropout. `make pretrain-demo` runs both phases on Python's docstrings;
# docs/pretraining.md ("Locally, without SLURM") on your own text.
# Expected: the step count reached (no target); held-out curves in <LOGDIR>/<log>_curves.png;
# on Python's docstrings masked-LM accuracy ~0.06 -> ~0.12 (BENCHMARKS.md, section 11).
# Launch: source config_CPU_1x2_pretrain_phase1.sh
#         DATADIR=... EVALDIR=... LOGDIR=... SAVE_CHECKPOINT=.../final.pt EXTRA_PARAMS="model.vocab_size=N" ./run_and_time.sh
# shellcheck source=config_CPU_1x2_pretrain_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/config_CPU_1x2_pretrain_common.sh"
CONFIG_SCRIPT=$(realpath "${BASH_SOURCE[0]}")  # this file: how launchers tell its values from yours
export CONFIG_SCRIPT
export BATCHSIZE=32        # per rank per micro-step
export GRADIENT_STEPS=1
export LR=1e-2
export MAX_STEPS=300
export WARMUP_STEPS=30
export EVAL_ITER_SAMPLES=3200
export CONFIG_PARAMS="${CONFIG_PARAMS} data.max_seq_length=128 data.max_predictions_per_seq=20"
