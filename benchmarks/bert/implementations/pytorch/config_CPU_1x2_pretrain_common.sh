#!/usr/bin/env bash
# What both phases of config_CPU_1x2_pretrain_phase{1,2}.sh share (sourced by them, not by
# users): the machine (one CPU machine, 2 gloo ranks) and the model, one definition, so that
# phase 2 can always load phase 1's weights: a small BERT (hidden 192, 3 layers, 4 heads),
# 512 positions from phase 1 on, no dropout; LAMB; held-out MLM/NSP on all of EVALDIR.
export DGXSYSTEM=CPU_1x2_pretrain
export DGXNNODES=1
export DGXNGPU=2            # ranks: CPU processes here
export WALLTIME=01:00:00
export CPU_THREADS_PER_RANK=1

export DIVISION=open
export OPTIMIZER=lamb
export START_WARMUP_STEP=0
export OPT_LAMB_BETA_1=0.9
export OPT_LAMB_BETA_2=0.999
export WEIGHT_DECAY_RATE=0.01
export CONFIG_PARAMS="run.mode=pretrain model.hidden_size=192 model.num_layers=3 model.num_heads=4 \
model.intermediate_size=768 model.max_position_embeddings=512 model.hidden_dropout=0 model.attention_dropout=0 \
data.eval_samples=0 eval.batch_size=50 log.progress_interval_steps=20 ckpt.interval_minutes=5"
