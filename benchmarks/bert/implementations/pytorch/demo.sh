#!/usr/bin/env bash
# `make demo`: synthetic data -> 2 CPU ranks (torchrun, gloo) via run_and_time.sh with
# config_CPU_1x2.sh -> MLPerf log in <repo>/results/CPU_1x2/bert/result_0.txt -> the
# MLCommons compliance checker (ruleset 5.0.0). Exits non-zero if training or the check failed.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "${here}/../../../.." && pwd)"
cd "${here}"

# shellcheck source=config_CPU_1x2.sh
source ./config_CPU_1x2.sh
data="${root}/build/demo_data"
export DATADIR="${data}/train" EVALDIR="${data}/eval"
export LOGDIR="${root}/results/${DGXSYSTEM}/bert" LOGFILE=result_0.txt

if [[ ! -f "${data}/.complete" ]]; then
  rm -rf "${data}"
  python -m bert.demo_data --output "${data}" --seed 1 --vocab "${DEMO_VOCAB}" --seq-len "${DEMO_SEQ_LEN}" \
    --max-pred "${DEMO_MAX_PRED}" --train-samples "${DEMO_TRAIN_SAMPLES}" --eval-samples "${DEMO_EVAL_SAMPLES}"
  touch "${data}/.complete"
fi

rc=0
./run_and_time.sh || rc=$?
log="${LOGDIR}/${LOGFILE}"
# The checker's INFO lines go to a file beside the log; the demo prints its verdict.
report="${LOGDIR}/${LOGFILE%.*}_compliance.txt"
check=0
python -m mlperf_logging.compliance_checker --usage training --ruleset 5.0.0 --log_output "${report}" "${log}" \
  > "${report}.out" 2>&1 || check=$?
if [[ ${check} -eq 0 ]]; then verdict=PASS; else verdict=FAIL; tail -n 5 "${report}.out" >&2; fi
echo "== compliance checker (5.0.0) on ${log}: ${verdict} (its output: ${report}.out)"
if [[ ${rc} -ne 0 ]]; then echo "demo: training did not reach the target (exit ${rc})" >&2; exit "${rc}"; fi
if [[ ${check} -ne 0 ]]; then echo "demo: the compliance checker rejected ${log}" >&2; exit "${check}"; fi
echo "demo: target reached and the log passes the 5.0.0 compliance checker"
