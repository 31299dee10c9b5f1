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
CONFIG_SCRIPT=$(realpath "${BASH_SOURCE[0]}")  # this file: how launchers tell its values from yours
export CONFIG_SCRIPT
export DGXSYSTEM=CPU_1x2_pretrain
export DGXNNODES=1
export DGXNGPU=2            # ranks: CPU processes here
export WALLTIME=01:00:00
export CPU_THREADS_PER_RANK=1

export DIVISION=open
export OPTIMIZER=lamb
export BATCHSIZE=8          # per rank per micro-step
export GRADIENT_STEPS=2
export LR=5e-3
export MAX_STEPS=120
export WARMUP_STEPS=12
export START_WARMUP_STEP=0
export OPT_LAMB_BETA_1=0.9
export OPT_LAMB_BETA_2=0.999
export WEIGHT_DECAY_RATE=0.01
export EVAL_ITER_SAMPLES=640
export CONFIG_PARAMS="run.mode=pretrain model.hidden_size=192 model.num_layers=3 model.num_heads=4 \
model.intermediate_size=768 model.max_position_embeddings=512 model.hidden_dropout=0 model.attention_dropout=0 \
data.max_seq_length=512 data.max_predictions_per_seq=80 data.eval_samples=0 eval.batch_size=50 \
log.progress_interval_steps=20 ckpt.interval_minutes=5"
