#!/usr/bin/env bash
# Pretrain BERT from scratch on a SLURM cluster: both phases submitted at once, phase 2
# held until phase 1 completes successfully (--dependency=afterok), each job requeued on
# preemption or near its time limit and resumed from its train-state checkpoint, for as
# many job instances (days) as it takes. Prints the two job ids.
#
#   DATADIR1=<seq-128 shards> EVALDIR1=<held-out, 128> DATADIR2=<seq-512 shards> EVALDIR2=<held-out, 512> \
#   OUTDIR=<shared dir> [CONT=<image>] ./submit_pretrain.sh <phase 1 config_*.sh> <phase 2 config_*.sh>
#
# Each phase is one run.sub job (NEXP=1, no compliance check: pretraining is not an MLPerf
# result) with LOGDIR=OUTDIR/phase<N>: its log phase<N>_1.log, curves phase<N>_1_curves.png,
# TensorBoard curves phase<N>_1_tb/ (TENSORBOARD=0 turns them off; docs/watching.md),
# checkpoints phase<N>_1_ckpt/, final weights OUTDIR/phase1/final.pt, which phase 2 starts
# from (run.init_checkpoint) with a fresh optimizer and schedule. sbatch --signal=B:USR1@LEAD
# (SIGNAL_LEAD, default 300 s) makes run.sub checkpoint and requeue itself before the time
# limit; --requeue lets SLURM requeue it after a preemption or node failure too, and the
# next instance resumes from the newest checkpoint (periodic ones bound what is lost).
# SBATCH_EXTRA: further sbatch options (partition, account, ...), word-split.
# shellcheck disable=SC2153  # DATADIR1/EVALDIR1/... are the caller's (checked below), not typos
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
if (( $# != 2 )); then
  echo "usage: $0 <phase 1 config_*.sh> <phase 2 config_*.sh>" >&2
  exit 2
fi
missing=()
for var in DATADIR1 EVALDIR1 DATADIR2 EVALDIR2 OUTDIR; do [[ -n "${!var:-}" ]] || missing+=("${var}"); done
if (( ${#missing[@]} )); then echo "$0: missing variable(s): ${missing[*]}" >&2; exit 2; fi
read -r -a extra <<< "${SBATCH_EXTRA:-}"

submit() { # submit PHASE CONFIG DATADIR EVALDIR [DEPENDENCY]: prints the job id
  (
    # shellcheck disable=SC1090  # the config is the caller's
    if [[ "$2" == */* ]]; then source "$2"; else source "./$2"; fi
    export DATADIR="$3" EVALDIR="$4" LOGDIR="${OUTDIR}/phase$1" DATESTAMP="phase$1" NEXP=1 CLEAR_CACHES=0 \
      CHECK_COMPLIANCE=0 SAVE_CHECKPOINT=final.pt SEED="${SEED:-$((12344 + $1))}" TENSORBOARD="${TENSORBOARD:-1}"
    if (( $1 == 2 )); then export INIT_CHECKPOINT="${OUTDIR}/phase1/final.pt"; fi
    mkdir -p "${LOGDIR}"
    dep=()
    if [[ -n "${5:-}" ]]; then dep=(--dependency="afterok:$5" --kill-on-invalid-dep=yes); fi
    sbatch --parsable --requeue --signal="B:USR1@${SIGNAL_LEAD:-300}" -N "${DGXNNODES}" -t "${WALLTIME}" \
      -J "bert-pretrain-phase$1" -o "${LOGDIR}/slurm-%j.out" --open-mode=append "${dep[@]}" "${extra[@]}" run.sub \
      | cut -d';' -f1
  )
}
job1=$(submit 1 "$1" "${DATADIR1}" "${EVALDIR1}")
job2=$(submit 2 "$2" "${DATADIR2}" "${EVALDIR2}" "${job1}")
echo "phase 1: job ${job1} (${OUTDIR}/phase1)"
echo "phase 2: job ${job2} (${OUTDIR}/phase2), after job ${job1} succeeds"
