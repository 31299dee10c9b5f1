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
# What each job gets: the phase's config, with every variable you set before this command over
# it (LR=..., EXTRA_PARAMS="model.vocab_size=8000": the one precedence, tools/config_env.py),
# and the phase's own DATADIR/EVALDIR/LOGDIR; the job's first lines say where each setting
# came from. Checked before anything is submitted (exit 2 naming what): both phases resolve
# (their settings are printed, as `tools/config_env.py show` prints them), their data
# directories exist, each eval set holds the data.eval_samples its config reads, and phase 2
# can start from phase 1's weights (the same model: vocab, sizes, positions).
# Submitting again with the same OUTDIR is safe: a phase that completed is found done by its
# job (nothing trained again); a phase that failed (its run.sub record says so) is run again,
# from its newest train-state checkpoint when there is one (resumed: the same settings are
# required), else from the start; this says which before submitting.
# NODES: the jobs' node count (sbatch -N; default each config's DGXNNODES), a number or a range
# (2-4: SLURM starts or requeues a job on what it has). On another count than the config's the
# job keeps the config's global batch (run.sub: BATCHSIZE x GRADIENT_STEPS x DGXNNODES x
# DGXNGPU, split anew), so a phase stopped on 2 nodes continues on 1 when submitted again with
# NODES=1 (docs/cluster.md); a count over which the batch cannot split is refused here (exit 2,
# naming those that keep it), nothing submitted. DGXNNODES is the config's, part of its batch:
# setting it changes the global batch, which a resume refuses (exit 2, the job stops unrecorded).
# A config that runs on GPUs (run.device=cuda) asks SLURM for DGXNGPU of them per node
# (--gpus-per-node). Partition, account and other sbatch options: sbatch's own variables
# (SBATCH_PARTITION, SBATCH_ACCOUNT, ...: they reach both jobs) or SBATCH_EXTRA, word-split.
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
config() { # a config as given: from the caller's directory, else this one's
  if [[ "$1" == /* ]]; then echo "$1"; elif [[ -f "${OLDPWD}/$1" ]]; then echo "${OLDPWD}/$1"; else echo "${PWD}/$1"; fi
}
cfg1=$(config "$1") cfg2=$(config "$2")
for p in 1 2; do
  cfg="cfg${p}" data="DATADIR${p}" eval="EVALDIR${p}"
  DATADIR="${!data}" EVALDIR="${!eval}" python3 tools/config_env.py show "${!cfg}" || exit 2
done
python3 tools/config_env.py phases "${cfg1}" "${cfg2}" || exit 2
if [[ -n "${NODES:-}" ]]; then
  if [[ ! "${NODES}" =~ ^([1-9][0-9]*)(-([1-9][0-9]*))?$ ]]; then
    echo "$0: NODES=${NODES}: a number of nodes, or a range such as 2-4" >&2
    exit 2
  fi
  low=${BASH_REMATCH[1]} high=${BASH_REMATCH[3]:-${BASH_REMATCH[1]}}
  for p in 1 2; do  # every count of the range: SLURM may start or requeue the job on any of them
    cfg="cfg${p}"
    for (( n = low; n <= high; n++ )); do
      if ! (envs=$(python3 tools/config_env.py env "${!cfg}") && eval "${envs}" &&
            python3 tools/config_env.py split "${n}" > /dev/null); then
        echo "$0: phase ${p} ($(basename "${!cfg}")) on NODES=${NODES}: nothing submitted" >&2
        exit 2
      fi
    done
  done
fi
# A resubmission: run.sub skips a run its state file records as done, failed or not; a failed
# phase's record goes, so that its job runs it again (resuming from its checkpoints, if any).
# A phase stopped by a signal and not requeued (scancel, a preemption), or whose resume was
# refused, has no record: its job continues it.
for p in 1 2; do
  state="${OUTDIR}/phase${p}/phase${p}_state.txt"
  ckpt="${OUTDIR}/phase${p}/phase${p}_1_ckpt"  # run.sub's CKPT_DIR; finished.json: ended, never resumed
  resumes=0
  if compgen -G "${ckpt}/step_*" > /dev/null && [[ ! -f "${ckpt}/finished.json" ]]; then resumes=1; fi
  if [[ -f "${state}" ]] && read -r _ _ rc _ < <(grep "^done 1 " "${state}"); then
    if (( rc == 0 )); then
      echo "phase ${p}: completed before (${state}): its job finds it done"
    else
      sed -i '/^done 1 /d' "${state}"
      how="from the start"
      if (( resumes )); then how="resumed from its newest checkpoint in ${ckpt}"; fi
      echo "phase ${p}: failed before (training exit ${rc}): run again, ${how}"
    fi
  elif (( resumes )); then
    echo "phase ${p}: stopped before its end: its job continues it from its newest checkpoint in ${ckpt}"
  fi
done

submit() { # submit PHASE CONFIG DATADIR EVALDIR [DEPENDENCY]: prints the job id
  (
    envs=$(python3 tools/config_env.py env "$2") || exit 2
    eval "${envs}"
    export DATADIR="$3" EVALDIR="$4" LOGDIR="${OUTDIR}/phase$1" DATESTAMP="phase$1" NEXP=1 CLEAR_CACHES=0 \
      CHECK_COMPLIANCE=0 SAVE_CHECKPOINT=final.pt SEED="${SEED:-$((12344 + $1))}" TENSORBOARD="${TENSORBOARD:-1}"
    if (( $1 == 2 )); then export INIT_CHECKPOINT="${OUTDIR}/phase1/final.pt"; fi
    mkdir -p "${LOGDIR}"
    dep=() gpus=()
    if [[ -n "${5:-}" ]]; then dep=(--dependency="afterok:$5" --kill-on-invalid-dep=yes); fi
    device=$(python3 tools/config_env.py get run.device) || exit 2
    if [[ "${device}" == cuda ]]; then gpus=(--gpus-per-node="${DGXNGPU}"); fi
    sbatch --parsable --requeue --signal="B:USR1@${SIGNAL_LEAD:-300}" -N "${NODES:-${DGXNNODES}}" -t "${WALLTIME}" \
      --ntasks-per-node="${DGXNGPU}" "${gpus[@]}" \
      -J "bert-pretrain-phase$1" -o "${LOGDIR}/slurm-%j.out" --open-mode=append "${dep[@]}" "${extra[@]}" run.sub \
      | cut -d';' -f1
  )
}
job1=$(submit 1 "${cfg1}" "${DATADIR1}" "${EVALDIR1}")
job2=$(submit 2 "${cfg2}" "${DATADIR2}" "${EVALDIR2}" "${job1}")
echo "phase 1: job ${job1} (${OUTDIR}/phase1)"
echo "phase 2: job ${job2} (${OUTDIR}/phase2), after job ${job1} succeeds"
