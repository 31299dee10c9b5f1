#!/usr/bin/env bash
# The whole data chain for the real MLPerf BERT dataset, from the MLCommons downloads to the
# directories the configs point at. Every step resumes when rerun with the same arguments.
#
# Inputs (download them first; this machine-independent script does not fetch anything).
# They are published by MLCommons in two Google Drive folders (the links the reference
# implementation's README gives):
#   dataset folder  https://drive.google.com/drive/folders/1cywmDnAsrP5-2vsr8GDc6QUc7VWe-M3v
#     results_text.tar.gz                   Wikipedia 2020-01-01 text: results4/ with 500 parts
#                                           part-00000-of-00500 ... plus eval.txt (~13 GB unpacked)
#     bert_reference_results_text_md5.txt   md5 of every file in results4/ (checked below)
#   checkpoint folder  https://drive.google.com/drive/folders/1oQF4diVHNPCclykwdvQJw8n_VIWwV0PT
#     vocab.txt                             uncased WordPiece vocab, 30,522 tokens (checked below)
#     bert_config.json                      BERT-Large architecture
#     tf1_ckpt/model.ckpt-28252.{index,data-00000-of-00001,meta}   phase-1 checkpoint
# Put them in one directory (DOWNLOAD) as named above; results_text.tar.gz may be unpacked
# already (DOWNLOAD/results4/).
#
# Outputs under OUT:
#   hdf5/training/            one fixed-length hdf5 per text part (create; 500 for MLPerf's)
#   hdf5/training_<N>/        N variable-length shards (shard)     -> DATADIR of the configs
#   hdf5/training_<N>_strata/ the same by length stratum (stratify) -> the stratified sampler
#   hdf5/eval_all/            all eval examples (create on eval.txt)
#   hdf5/eval_varlength/      eval_10k.hdf5 (eval)                 -> EVALDIR of the configs
#   check.json                check of the training shards: defects, copies, and the eval set
#                             kept out of them (the script stops, exit 1, on any finding)
#   phase1/model.ckpt-28252.pt  the phase-1 weights in our format  -> INIT_CHECKPOINT
#   stats/                    length histogram and padding numbers of the training shards
# and md5sums.txt in every hdf5 directory, written by the step that makes it with its shards;
# every step checks its input directory against its list before it writes anything, so a
# shard changed on the way stops the chain (exit 2) naming it instead of being listed anew
# (check a directory later with `... verify --input DIR`).
#
# Usage: input_preprocessing/prepare_data.sh DOWNLOAD OUT [NUM_SHARDS (2048)] [WORKERS (all cores)]
# Run from benchmarks/bert/implementations/pytorch with the venv active (pip install .[prep]).
# The checkpoint is read without TensorFlow (bert/tf_bundle.py); SKIP_CHECKPOINT=1 skips it
# (then bert_config.json and tf1_ckpt/ are not needed).
# Your own corpus instead of MLPerf's: the same layout (results4/part-* and results4/eval.txt,
# a vocab.txt, e.g. from `python -m input_preprocessing vocab`, and the md5 list, e.g.
# `(cd results4 && md5sum *) > bert_reference_results_text_md5.txt`), with
# EXPECT_VOCAB=<lines of your vocab.txt>, EVAL_SAMPLES=<eval set size, at most the eval
# examples eval.txt yields> and SKIP_CHECKPOINT=1 (the phase-1 checkpoint fits MLPerf's vocab only).
set -euo pipefail

if [[ $# -lt 2 ]]; then
    sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
    exit 2
fi
DOWNLOAD=$(realpath "$1")
OUT=$(realpath -m "$2")
NUM_SHARDS=${3:-2048}
WORKERS=${4:-$(nproc)}
PY=${PYTHON:-python}
# Overridable for a small rehearsal on a toy corpus (the tests do that); the benchmark's values:
EXPECT_VOCAB=${EXPECT_VOCAB:-30522}
EVAL_SAMPLES=${EVAL_SAMPLES:-10000}
prep() { "$PY" -m input_preprocessing "$@"; }
say() { printf '\n== %s\n' "$*"; }

needed=(vocab.txt bert_reference_results_text_md5.txt)
[[ "${SKIP_CHECKPOINT:-0}" == 1 ]] || needed+=(bert_config.json)
for f in "${needed[@]}"; do
    [[ -f "$DOWNLOAD/$f" ]] || { echo "error: $DOWNLOAD/$f is missing (see the header of $0)" >&2; exit 2; }
done
vocab_lines=$(wc -l < "$DOWNLOAD/vocab.txt")
[[ "$vocab_lines" -eq "$EXPECT_VOCAB" ]] || { echo "error: $DOWNLOAD/vocab.txt has $vocab_lines lines, expected $EXPECT_VOCAB" >&2; exit 2; }

say "text: unpack and check md5"
if [[ ! -d "$DOWNLOAD/results4" ]]; then
    [[ -f "$DOWNLOAD/results_text.tar.gz" ]] || { echo "error: neither $DOWNLOAD/results4/ nor results_text.tar.gz" >&2; exit 2; }
    tar -xzf "$DOWNLOAD/results_text.tar.gz" -C "$DOWNLOAD"
fi
(cd "$DOWNLOAD/results4" && md5sum --quiet --check "$DOWNLOAD/bert_reference_results_text_md5.txt")

num_parts=$(find -H "$DOWNLOAD/results4" -maxdepth 1 -type f -name 'part-*' | wc -l)
[[ "$num_parts" -gt 0 ]] || { echo "error: $DOWNLOAD/results4/ holds no part-* text files" >&2; exit 2; }
say "training examples: $num_parts parts (seq 512, 76 predictions, dupe factor 10, seed 12345)"
prep create --input "$DOWNLOAD/results4" --pattern 'part-*' --vocab "$DOWNLOAD/vocab.txt" \
    --output "$OUT/hdf5/training" --workers "$WORKERS"

say "eval examples and the $EVAL_SAMPLES-sample eval set"
prep create --input "$DOWNLOAD/results4" --pattern 'eval.txt' --vocab "$DOWNLOAD/vocab.txt" \
    --output "$OUT/hdf5/eval_all" --workers 1
prep eval --input "$OUT/hdf5/eval_all" --output "$OUT/hdf5/eval_varlength" --num-samples "$EVAL_SAMPLES" --layout variable

say "re-chop into $NUM_SHARDS variable-length shards"
prep shard --input "$OUT/hdf5/training" --output "$OUT/hdf5/training_$NUM_SHARDS" \
    --num-shards "$NUM_SHARDS" --layout variable --workers "$WORKERS"

say "check: every training sample's bytes, copies, and no eval sample among the training shards"
prep check --input "$OUT/hdf5/training_$NUM_SHARDS" --vocab "$DOWNLOAD/vocab.txt" --eval "$OUT/hdf5/eval_varlength" \
    --workers "$WORKERS" > "$OUT/check.json"
echo "check: clean ($OUT/check.json)"

say "length strata (1-128, 129-256, 257-384, 385-512)"
prep stratify --input "$OUT/hdf5/training_$NUM_SHARDS" --output "$OUT/hdf5/training_${NUM_SHARDS}_strata" \
    --workers "$WORKERS"

say "statistics"
prep stats --input "$OUT/hdf5/training_$NUM_SHARDS" --vocab "$DOWNLOAD/vocab.txt" --output "$OUT/stats"

if [[ "${SKIP_CHECKPOINT:-0}" != 1 ]]; then
    say "phase-1 checkpoint -> our state dict"
    prep checkpoint --input "$DOWNLOAD/tf1_ckpt/model.ckpt-28252" --bert-config "$DOWNLOAD/bert_config.json" \
        --output "$OUT/phase1/model.ckpt-28252.pt"
fi

say "done"
echo "DATADIR=$OUT/hdf5/training_$NUM_SHARDS"
echo "EVALDIR=$OUT/hdf5/eval_varlength"
echo "STRATADIR=$OUT/hdf5/training_${NUM_SHARDS}_strata"
[[ "${SKIP_CHECKPOINT:-0}" == 1 ]] || echo "INIT_CHECKPOINT=$OUT/phase1/model.ckpt-28252.pt"
