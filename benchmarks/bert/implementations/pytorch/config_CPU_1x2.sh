#!/usr/bin/env bash
# System: one CPU machine, 2 ranks (gloo), no GPU. The embedded default and `make demo`.
# Model: tiny BERT (hidden 128, 2 layers) on the synthetic demo data (bert/demo_data.py),
# closed division, LAMB. Expected: masked-LM accuracy >= 0.720 within ~2 minutes.
# Launch: source config_CPU_1x2.sh && DATADIR=... EVALDIR=... ./run_and_time.sh
#     or: source config_CPU_1x2.sh && DATADIR=... EVALDIR=... sbatch -N "$DGXNNODES" -t "$WALLTIME" run.sub
#   (DATADIR/EVALDIR: the demo data, `python -m bert.demo_data` as demo.sh runs it; `make demo` does it all)
CONFIG_SCRIPT=$(realpath "${BASH_SOURCE[0]}")  # this file: how launchers tell its values from yours
export CONFIG_SCRIPT
export DGXSYSTEM=CPU_1x2
export DGXNNODES=1
export DGXNGPU=2            # ranks per node: here CPU processes
export WALLTIME=00:15:00
export CPU_THREADS_PER_RANK=1

export DIVISION=closed
export OPTIMIZER=lamb
export BATCHSIZE=32         # per rank
export GRADIENT_STEPS=1
export LR=0.02
export MAX_STEPS=2000
export WARMUP_STEPS=50
export START_WARMUP_STEP=0
export OPT_LAMB_BETA_1=0.9
export OPT_LAMB_BETA_2=0.999
export WEIGHT_DECAY_RATE=0.01
export EVAL_ITER_SAMPLES=6400
export MAX_SAMPLES_TERMINATION=128000   # the schedule's end (2,000 steps of 64): past it the rate is 0

# The demo data geometry (bert/demo_data.py; demo.sh generates it) and the tiny model.
export DEMO_VOCAB=128 DEMO_SEQ_LEN=128 DEMO_MAX_PRED=20 DEMO_TRAIN_SAMPLES=20000 DEMO_EVAL_SAMPLES=2000
export CONFIG_PARAMS="model.vocab_size=${DEMO_VOCAB} model.hidden_size=128 model.num_layers=2 model.num_heads=4 \
model.intermediate_size=512 model.max_position_embeddings=${DEMO_SEQ_LEN} model.hidden_dropout=0.0 \
model.attention_dropout=0.0 data.max_seq_length=${DEMO_SEQ_LEN} data.max_predictions_per_seq=${DEMO_MAX_PRED} \
data.eval_samples=${DEMO_EVAL_SAMPLES} eval.batch_size=250 log.progress_interval_steps=25"
