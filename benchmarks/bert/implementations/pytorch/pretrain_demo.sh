#!/usr/bin/env bash
# `make pretrain-demo`: a small BERT pretrained from scratch through both phases on real
# English text, on the CPU (2 ranks), then used by Hugging Face `transformers`:
#   1. corpus: the docstrings of Python's standard library (tools/pretrain_demo.py corpus),
#      held-out documents apart; a WordPiece vocab trained on the training text (HF tokenizers);
#   2. data for both phases from the same text (`create` at 128/20 and 512/80, variable
#      layout; the eval sets from the held-out text), each checked by `check`;
#   3. phase 1 (seq 128, random init) and phase 2 (seq 512, phase 1's final weights, fresh
#      optimizer and schedule): config_CPU_1x2_pretrain_phase{1,2}.sh through run_and_time.sh,
#      as docs/pretraining.md's local recipe runs them;
#   4. the curves of both phases in one plot; phase 2 must end well above phase 1's start
#      and not collapse at the hand-over;
#   5. export to HF format from the run's own resolved config, load with BertForMaskedLM,
#      top-1 fill-mask on held-out sentences against the unigram model;
#   6. downstream: a sentence-pair task from docstrings pretraining never saw (do two sentences
#      come from the same docstring? tools/glue.py same-doc), fine-tuned from the pretrained model and
#      from a randomly initialised twin, over several seeds; the pretrained one's worst seed
#      must beat the twin's best seed by PD_GLUE_MARGIN (dev accuracy).
# The model and the phases are the two configs'; the PD_* variables below that are set go on
# run_and_time.sh's command line (the test suite's smaller version); your own variables and
# EXTRA_PARAMS reach the runs as they reach any (docs/configuration.md). BENCHMARKS.md, section
# 11, says what the defaults cost. Outputs in PD_OUT (default <repo>/build/pretrain_demo).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "${here}/../../../.." && pwd)"
cd "${here}"

out="${PD_OUT:-${root}/build/pretrain_demo}"
: "${PD_MAX_DOCS:=100000}" "${PD_VOCAB:=4000}" "${PD_DUPE:=4}" "${PD_EVAL_SAMPLES:=500}" "${PD_SENTENCES:=400}"
# Unset: the configs' values. PD_HIDDEN PD_LAYERS PD_HEADS PD_DROPOUT PD_RANKS (DGXNGPU), and per
# phase N: PD_STEPSN PD_BATCHN PD_ACCUMN PD_LRN PD_EVALN (optim.total_steps with 10% warmup,
# run.local_batch_size, run.grad_accum_steps, optim.lr, eval.interval_samples).
: "${PD_GLUE_PAIRS:=1}" "${PD_GLUE_EPOCHS:=3}" "${PD_GLUE_LRS:=[1.0e-4, 3.0e-4]}" "${PD_GLUE_SEEDS:=[1, 2, 3]}"
: "${PD_GLUE_MARGIN:=0.02}"
# Phase 2 must end this much masked-LM accuracy above phase 1's first evaluation.
: "${PD_GAIN:=0.05}"
rm -rf "${out}"
mkdir -p "${out}"
prep() { python -m input_preprocessing "$@" --workers 2 > /dev/null; }

echo "== 1. corpus and vocab"
python tools/pretrain_demo.py corpus --output "${out}/text" --max-docs "${PD_MAX_DOCS}"
python -m input_preprocessing vocab --input "${out}/text/train" --pattern '*.txt' --output "${out}/vocab.txt" \
  --size "${PD_VOCAB}" > /dev/null
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

# The trainer's command line for phase $1: the vocab just trained, and each PD_* that is set.
phase_args() {
  local p=$1 var
  args=("model.vocab_size=${vocab_size}")
  add() { if [[ -n "${!2:-}" ]]; then args+=("$1=${!2}"); fi; }
  add model.hidden_size PD_HIDDEN
  if [[ -n "${PD_HIDDEN:-}" ]]; then args+=("model.intermediate_size=$((4 * PD_HIDDEN))"); fi
  add model.num_layers PD_LAYERS
  add model.num_heads PD_HEADS
  add model.hidden_dropout PD_DROPOUT
  add model.attention_dropout PD_DROPOUT
  add optim.total_steps "PD_STEPS${p}"
  var="PD_STEPS${p}"
  if [[ -n "${!var:-}" ]]; then args+=("optim.warmup_steps=$(( ${!var} / 10 ))"); fi
  add run.local_batch_size "PD_BATCH${p}"
  add run.grad_accum_steps "PD_ACCUM${p}"
  add optim.lr "PD_LR${p}"
  add eval.interval_samples "PD_EVAL${p}"
}
run_phase() { # run_phase P [INIT]: config_CPU_1x2_pretrain_phaseP.sh as a launcher applies it (tools/config_env.py)
  local p=$1 envs args=()
  envs=$(python tools/config_env.py env "config_CPU_1x2_pretrain_phase${p}.sh")
  phase_args "${p}"
  (
    eval "${envs}"
    DGXNGPU="${PD_RANKS:-${DGXNGPU}}" SEED=$((41 + p)) DATADIR="${out}/p${p}_train" EVALDIR="${out}/p${p}_eval" \
      LOGDIR="${out}/phase${p}" LOGFILE=log.txt SAVE_CHECKPOINT="${out}/phase${p}/final.pt" INIT_CHECKPOINT="${2:-}" \
      CKPT_DIR="${out}/phase${p}/ckpt" TENSORBOARD_DIR="${out}/phase${p}/tb" ./run_and_time.sh "${args[@]}"
  )
}
echo "== 3a. phase 1: seq 128, from random weights"
run_phase 1
echo "== 3b. phase 2: seq 512, from phase 1's final weights, fresh optimizer and schedule"
run_phase 2 "${out}/phase1/final.pt"

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

echo "== 5. Hugging Face: export (the architecture from the run's resolved config), BertForMaskedLM, fill-mask"
python -m input_preprocessing checkpoint --input "${out}/phase2/final.pt" --output "${out}/hf" --to hf \
  --bert-config "${out}/phase2/log_config.json" > /dev/null
cp "${out}/vocab.txt" "${out}/hf/vocab.txt"
python tools/pretrain_demo.py fill-mask --model "${out}/hf" --vocab "${out}/vocab.txt" \
  --text "${out}/text/eval/eval.txt" --train-text "${out}/text/train" --sentences "${PD_SENTENCES}" \
  --out "${out}/fill_mask.json"
echo "== 6. downstream: same-docstring pairs, fine-tuned from the pretrained model and from random weights"
python tools/glue.py same-doc --text "${out}/text/downstream.txt" --output "${out}/downstream" --pairs "${PD_GLUE_PAIRS}"
grid="${out}/same_doc_grid.yaml"
cat > "${grid}" <<EOF
name: same_doc
model: ${out}/hf
glue_dir: ${out}/downstream
tasks: [SAME-DOC]
inits: [pretrained, random]
lrs: ${PD_GLUE_LRS}
seeds: ${PD_GLUE_SEEDS}
epochs: ${PD_GLUE_EPOCHS}
threads: 1
EOF
glue() { python tools/glue.py "$1" --grid "${grid}" --workdir "${out}/glue" "${@:2}"; }
# Two runs at a time, single-threaded, as two array tasks would run them.
seq 0 $(( $(glue plan --count) - 1 )) | xargs -P "${PD_RANKS:-2}" -I{} \
  python tools/glue.py run --grid "${grid}" --workdir "${out}/glue" --index {}
glue table > /dev/null
cat "${out}/glue/same_doc/table.md"
glue compare --task SAME-DOC --margin "${PD_GLUE_MARGIN}" --out "${out}/same_doc_compare.json"
echo "pretrain-demo: both phases done; curves ${out}/curves.png (TensorBoard: tensorboard --logdir ${out});" \
  "HF model ${out}/hf; downstream ${out}/glue/same_doc/table.md"
