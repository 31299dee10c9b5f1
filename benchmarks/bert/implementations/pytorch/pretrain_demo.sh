#!/usr/bin/env bash
# `make pretrain-demo`: a small BERT pretrained from scratch through both phases on real
# English text, on the CPU (2 ranks), then used by Hugging Face `transformers`:
#   1. corpus: the docstrings of Python's standard library (tools/pretrain_demo.py corpus),
#      held-out documents apart; a WordPiece vocab trained on the training text (HF tokenizers);
#   2. data for both phases from the same text (`create` at 128/20 and 512/80, variable
#      layout; the eval sets from the held-out text), each checked by `check`;
#   3. phase 1 (seq 128, random init) and phase 2 (seq 512, phase 1's final weights, fresh
#      optimizer and schedule) through run_and_time.sh in pretraining mode (run.mode=pretrain);
#   4. the curves of both phases in one plot; phase 2 must end well above phase 1's start
#      and not collapse at the hand-over;
#   5. export to HF format, load with BertForMaskedLM, top-1 fill-mask on held-out sentences
#      against the unigram model;
#   6. downstream: a sentence-pair task from docstrings pretraining never saw (do two sentences
#      come from the same docstring?), fine-tuned by tools/glue.py from the pretrained model and
#      from a randomly initialised twin, over several seeds; the pretrained one's worst seed
#      must beat the twin's best seed by PD_GLUE_MARGIN (dev accuracy).
# Sizes come from PD_* variables (defaults: BENCHMARKS.md, section 11, says what they cost); the test suite
# runs a smaller version. Outputs in PD_OUT (default <repo>/build/pretrain_demo).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "${here}/../../../.." && pwd)"
cd "${here}"

out="${PD_OUT:-${root}/build/pretrain_demo}"
: "${PD_MAX_DOCS:=100000}" "${PD_VOCAB:=4000}" "${PD_DUPE:=4}" "${PD_EVAL_SAMPLES:=500}"
: "${PD_HIDDEN:=192}" "${PD_LAYERS:=3}" "${PD_HEADS:=4}"
: "${PD_STEPS1:=300}" "${PD_BATCH1:=32}" "${PD_ACCUM1:=1}" "${PD_LR1:=1e-2}" "${PD_EVAL1:=3200}"
: "${PD_STEPS2:=120}" "${PD_BATCH2:=8}" "${PD_ACCUM2:=2}" "${PD_LR2:=5e-3}" "${PD_EVAL2:=640}"
: "${PD_SENTENCES:=400}" "${PD_RANKS:=2}" "${PD_DROPOUT:=0}"
: "${PD_GLUE_PAIRS:=1}" "${PD_GLUE_EPOCHS:=3}" "${PD_GLUE_LRS:=[1.0e-4, 3.0e-4]}" "${PD_GLUE_SEEDS:=[1, 2, 3]}"
: "${PD_GLUE_MARGIN:=0.02}"
# Phase 2 must end this much masked-LM accuracy above phase 1's first evaluation.
: "${PD_GAIN:=0.05}"
rm -rf "${out}"
mkdir -p "${out}"
prep() { python -m input_preprocessing "$@" --workers 2 > /dev/null; }

echo "== 1. corpus and vocab"
python tools/pretrain_demo.py corpus --output "${out}/text" --max-docs "${PD_MAX_DOCS}"
python -c "import sys, pathlib; from input_preprocessing.toy_corpus import train_vocab
train_vocab(sorted(pathlib.Path(sys.argv[1]).glob('*.txt')), sys.argv[2], size=int(sys.argv[3]))" \
  "${out}/text/train" "${out}/vocab.txt" "${PD_VOCAB}"
vocab_size=$(wc -l < "${out}/vocab.txt")

echo "== 2. data for both phases (create, eval, check)"
for phase in "1 128 20" "2 512 80"; do
  read -r p seq pred <<< "${phase}"
  prep create --input "${out}/text/train" --vocab "${out}/vocab.txt" --output "${out}/p${p}_train" \
    --max-seq-length "${seq}" --max-predictions-per-seq "${pred}" --dupe-factor "${PD_DUPE}" --layout variable
  prep create --input "${out}/text/eval" --vocab "${out}/vocab.txt" --output "${out}/p${p}_evalraw" \
    --max-seq-length "${seq}" --max-predictions-per-seq "${pred}" --dupe-factor "${PD_DUPE}" --layout variable
  n=$(python -c "import sys; from bert.shards import list_shards, shard_size
print(min(int(sys.argv[2]), sum(shard_size(p) for p in list_shards(sys.argv[1]))))" "${out}/p${p}_evalraw" "${PD_EVAL_SAMPLES}")
  python -m input_preprocessing eval --input "${out}/p${p}_evalraw" --output "${out}/p${p}_eval" \
    --num-samples "${n}" > /dev/null
  python -m input_preprocessing check --input "${out}/p${p}_train" --vocab "${out}/vocab.txt" \
    --max-seq-length "${seq}" > "${out}/p${p}_check.json"
done

# The model: small BERT, the vocab just trained; 512 positions in both phases.
model="model.vocab_size=${vocab_size} model.hidden_size=${PD_HIDDEN} model.num_layers=${PD_LAYERS} \
model.num_heads=${PD_HEADS} model.intermediate_size=$((4 * PD_HIDDEN)) model.max_position_embeddings=512 \
model.hidden_dropout=${PD_DROPOUT} model.attention_dropout=${PD_DROPOUT}"
run_phase() { # run_phase P SEQ PRED STEPS BATCH ACCUM LR EVAL_SAMPLES [INIT]
  local p=$1
  env DGXSYSTEM=CPU_1x2 DGXNGPU="${PD_RANKS}" CPU_THREADS_PER_RANK=1 DIVISION=open OPTIMIZER=lamb SEED=$((41 + p)) \
    DATADIR="${out}/p${p}_train" EVALDIR="${out}/p${p}_eval" LOGDIR="${out}/phase${p}" LOGFILE=log.txt \
    BATCHSIZE="$5" GRADIENT_STEPS="$6" LR="$7" MAX_STEPS="$4" WARMUP_STEPS=$(($4 / 10)) EVAL_ITER_SAMPLES="$8" \
    SAVE_CHECKPOINT="${out}/phase${p}/final.pt" INIT_CHECKPOINT="${9:-}" CKPT_DIR="${out}/phase${p}/ckpt" \
    TENSORBOARD_DIR="${out}/phase${p}/tb" \
    EXTRA_PARAMS="run.mode=pretrain ${model} data.max_seq_length=$2 data.max_predictions_per_seq=$3 \
data.eval_samples=0 eval.batch_size=50 log.progress_interval_steps=20 \
ckpt.interval_minutes=5 optim.max_grad_norm=1.0" \
    ./run_and_time.sh
}
echo "== 3a. phase 1: seq 128, from random weights"
run_phase 1 128 20 "${PD_STEPS1}" "${PD_BATCH1}" "${PD_ACCUM1}" "${PD_LR1}" "${PD_EVAL1}"
echo "== 3b. phase 2: seq 512, from phase 1's final weights, fresh optimizer and schedule"
run_phase 2 512 80 "${PD_STEPS2}" "${PD_BATCH2}" "${PD_ACCUM2}" "${PD_LR2}" "${PD_EVAL2}" "${out}/phase1/final.pt"

echo "== 4. curves and the hand-over"
python - "${out}" "${PD_GAIN}" <<'EOF'
import json, sys
from pathlib import Path
from bert.pretrain import plot, read_curves
out = Path(sys.argv[1])
p1, p2 = out / "phase1/log_curves.jsonl", out / "phase2/log_curves.jsonl"
print("plot:", plot(p1, out / "curves.png", extra=[("phase2", p2)], label="phase1"))
a, b = read_curves(p1), read_curves(p2)
summary = {"phase1_first_mlm_accuracy": a[0]["mlm_accuracy"], "phase1_last_mlm_accuracy": a[-1]["mlm_accuracy"],
           "phase2_first_mlm_accuracy": b[0]["mlm_accuracy"], "phase2_last_mlm_accuracy": b[-1]["mlm_accuracy"],
           "phase2_last_nsp_accuracy": b[-1]["nsp_accuracy"]}
(out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
print(json.dumps(summary))
ok = (summary["phase2_last_mlm_accuracy"] > summary["phase1_first_mlm_accuracy"] + float(sys.argv[2])
      and summary["phase2_first_mlm_accuracy"] > summary["phase1_last_mlm_accuracy"] - 0.1)
sys.exit(0 if ok else "phase 2 did not end well above phase 1's start, or collapsed at the hand-over")
EOF

echo "== 5. Hugging Face: export, BertForMaskedLM, fill-mask against the unigram model"
python -c "import json, sys; json.dump({'vocab_size': int(sys.argv[1]), 'hidden_size': int(sys.argv[2]),
'num_hidden_layers': int(sys.argv[3]), 'num_attention_heads': int(sys.argv[4]), 'intermediate_size': 4 * int(sys.argv[2]),
'max_position_embeddings': 512, 'type_vocab_size': 2}, open(sys.argv[5], 'w'))" \
  "${vocab_size}" "${PD_HIDDEN}" "${PD_LAYERS}" "${PD_HEADS}" "${out}/bert_config.json"
python -m input_preprocessing checkpoint --input "${out}/phase2/final.pt" --output "${out}/hf" --to hf \
  --bert-config "${out}/bert_config.json" > /dev/null
cp "${out}/vocab.txt" "${out}/hf/vocab.txt"
python tools/pretrain_demo.py fill-mask --model "${out}/hf" --vocab "${out}/vocab.txt" \
  --text "${out}/text/eval/eval.txt" --train-text "${out}/text/train" --sentences "${PD_SENTENCES}" \
  --out "${out}/fill_mask.json"
echo "== 6. downstream: same-docstring pairs, fine-tuned from the pretrained model and from random weights"
python tools/pretrain_demo.py same-doc-task --text "${out}/text/downstream.txt" --output "${out}/downstream" \
  --pairs "${PD_GLUE_PAIRS}"
grid="${out}/same_doc_grid.yaml"
cat > "${grid}" <<EOF
name: same_doc
model: ${out}/hf
glue_dir: ${out}/downstream
tasks: [STDLIB-SAME-DOC]
inits: [pretrained, random]
lrs: ${PD_GLUE_LRS}
seeds: ${PD_GLUE_SEEDS}
epochs: ${PD_GLUE_EPOCHS}
threads: 1
EOF
glue() { python tools/glue.py "$1" --grid "${grid}" --workdir "${out}/glue" "${@:2}"; }
# Two runs at a time, single-threaded, as two array tasks would run them.
seq 0 $(( $(glue plan --count) - 1 )) | xargs -P "${PD_RANKS}" -I{} \
  python tools/glue.py run --grid "${grid}" --workdir "${out}/glue" --index {}
glue table > /dev/null
cat "${out}/glue/same_doc/table.md"
glue compare --task STDLIB-SAME-DOC --margin "${PD_GLUE_MARGIN}" --out "${out}/same_doc_compare.json"
echo "pretrain-demo: both phases done; curves ${out}/curves.png (TensorBoard: tensorboard --logdir ${out});" \
  "HF model ${out}/hf; downstream ${out}/glue/same_doc/table.md"
