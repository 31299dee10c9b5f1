#!/usr/bin/env bash
# Per-run launcher: runs training with the config_*.sh variables that are set (the trainer
# reads them, --from-env, by the one table of bert/config.py's LAUNCHER_VARIABLES; unset
# variables leave its defaults; EXTRA_PARAMS' words follow as command-line overrides), and
# prints the start/end and, for a run that trained, one RESULT line (rank 0's).
#
#   source config_CPU_1x2.sh && DATADIR=... EVALDIR=... [LOGDIR=...] ./run_and_time.sh
#
# Relative paths (DATADIR, EVALDIR, LOGDIR, INIT_CHECKPOINT, SAVE_CHECKPOINT, CKPT_DIR) are
# relative to the directory it is called from. LOGDIR defaults to results/<DGXSYSTEM>/bert
# four levels up (the repository root here, the organisation's folder in a submission).
#
# Exit status: the trainer's own (python -m bert.train: 0 target, 1 sample limit, 2 bad
# input, 3 checkpointed on a signal, 4 a peer rank failed, 5 a file could not be written,
# 130 Ctrl-C; the worst rank's), under torchrun too; 2 when no config was sourced.
#
# LAUNCHER=torchrun (default) starts DGXNGPU local ranks itself; LAUNCHER=task means this
# script already is one rank (started by srun or mpirun), so it runs one process.
#
# Signals. SIGUSR1 / SIGTERM (and SIGHUP, as SIGTERM) to this script reach the training
# processes, which checkpoint at their next poll and exit 3 (bert/resume.py): bash would
# otherwise die of SIGUSR1 and leave them orphaned, and torchrun would die of it too, so
# under torchrun the signal goes to its workers (found in /proc: no procps needed). Ctrl-C
# (SIGINT): the ranks stop at their next poll, log run_stop aborted and exit 130; a second
# Ctrl-C ends them at once. Under torchrun, torchrun and its workers run in process groups
# of their own and ignore the terminal: this script passes the first Ctrl-C to the workers
# and ends torchrun and them with the second (SIGKILL, so torchrun prints no traceback). Under LAUNCHER=task it
# passes SIGINT on to nobody: srun (with --disable-status, as run.sub has it), mpirun or the
# terminal already signal every process of the task, the trainer too. A signal that cannot be
# delivered is reported on stderr.
set -euo pipefail
if [[ -z "${DGXSYSTEM:-}" || ( -z "${DGXNGPU:-}" && "${LAUNCHER:-torchrun}" == torchrun ) ]]; then
  echo "run_and_time.sh: no config: source a config_*.sh first (e.g. source config_CPU_1x2.sh)" >&2
  exit 2
fi
for var in DATADIR EVALDIR LOGDIR INIT_CHECKPOINT SAVE_CHECKPOINT CKPT_DIR; do
  if [[ -n "${!var:-}" && "${!var}" != /* ]]; then printf -v "${var}" '%s/%s' "${PWD}" "${!var}"; fi
done
cd "$(dirname "${BASH_SOURCE[0]}")"
: "${LOGDIR:=$(cd ../../../.. && pwd)/results/${DGXSYSTEM}/bert}"
export LOGDIR

# EXTRA_PARAMS: further key=value overrides, whitespace separated (word splitting intended).
read -r -a args <<< "${EXTRA_PARAMS:-}"

# Each rank writes its exit status here and exits 0 (bert/train.py --exit-status-dir).
status_dir=$(mktemp -d)
trap 'rm -rf "${status_dir}"' EXIT
start=$(date +%s)
echo "STARTING TIMING RUN AT $(date '+%Y-%m-%d %r')"
# Until the traps below are set, Ctrl-C is ignored, by the trainer's processes too (they
# inherit it; bert/resume.py installs its own handler).
trap '' INT
if [[ "${LAUNCHER:-torchrun}" == torchrun ]]; then
  # torchrun's own choice for several local ranks, made here so it prints no warning box about it.
  if [[ -z "${OMP_NUM_THREADS:-}" ]] && (( DGXNGPU > 1 )); then export OMP_NUM_THREADS=1; fi
  # torchrun leaves SIGINT alone (PET_SIGNALS_TO_HANDLE: its --signals-to-handle, which older
  # versions ignore): it would pass Ctrl-C on as the workers' second, and die with a traceback.
  # --standalone: a private rendezvous on this node; one process per GPU (CPU rank). set -m for
  # this line only: torchrun and its workers get a process group of their own.
  set -m
  PET_SIGNALS_TO_HANDLE=SIGTERM,SIGHUP,SIGQUIT torchrun --standalone --nnodes=1 --nproc_per_node="${DGXNGPU}" \
    -m bert.train --from-env --exit-status-dir "${status_dir}" "${args[@]}" &
  set +m
else
  python -m bert.train --from-env --exit-status-dir "${status_dir}" "${args[@]}" &
fi
child=$!
signalled=0 interrupts=0 kids=()
# shellcheck disable=SC2317  # called from the traps below
children_of() { # sets kids: the PIDs whose parent is $1, read from /proc (no subshell: a
  kids=()        # second Ctrl-C to this process group would end one mid-walk)
  local stat line fields
  for stat in /proc/[0-9]*/stat; do
    { read -r line < "${stat}"; } 2>/dev/null || continue  # a process that just ended
    line=${line##*) }  # after "pid (command) ": the command may hold spaces and parentheses
    read -r -a fields <<< "${line}"  # state ppid ...
    if [[ "${fields[1]}" == "$1" ]]; then stat=${stat#/proc/}; kids+=("${stat%/stat}"); fi
  done
}
# shellcheck disable=SC2317
forward() { # forward SIG: to the trainer (under torchrun: to its workers, not to torchrun)
  signalled=1
  local targets=("${child}")
  if [[ "${LAUNCHER:-torchrun}" == torchrun ]]; then children_of "${child}"; targets=("${kids[@]}"); fi
  if (( ${#targets[@]} == 0 )) || ! kill -s "$1" "${targets[@]}" 2>/dev/null; then
    echo "run_and_time.sh: WARNING: SIG$1 could not be delivered to the training processes" \
         "(${targets[*]:-torchrun ${child} has no workers (yet)}): they were not told to stop" >&2
  fi
}
# shellcheck disable=SC2317
interrupt() { # Ctrl-C: the first asks the ranks to stop at their next poll, a second ends them at once
  signalled=1 interrupts=$(( interrupts + 1 ))
  if [[ "${LAUNCHER:-torchrun}" != torchrun ]]; then
    if (( interrupts > 1 )); then kill -s KILL "${child}" 2>/dev/null || true; fi
  elif (( interrupts == 1 )); then
    forward INT
  else  # torchrun first, so that it sees no worker die (and prints no traceback about it)
    children_of "${child}"
    kill -s KILL "${child}" "${kids[@]}" 2>/dev/null || true
  fi
}
trap 'forward USR1' USR1
trap 'forward TERM' TERM
trap 'forward TERM' HUP
trap interrupt INT
# A trapped signal ends `wait` early (status > 128) while the trainer runs on: wait again.
while :; do
  signalled=0
  rc=0
  wait "${child}" 2>/dev/null || rc=$?  # quiet: bash would report a SIGKILLed torchrun as "Killed"
  (( signalled && rc > 128 )) || break
done
trap - USR1 TERM HUP
trap '' INT
end=$(date +%s)
echo "ENDING TIMING RUN AT $(date '+%Y-%m-%d %r')"
if (( interrupts > 1 )); then
  echo "interrupted (Ctrl-C twice): the training processes were ended at once; nothing saved" >&2
  exit 130
fi
# The worst status any rank wrote; a rank that crashed wrote none, and the launcher says so.
trained=none seed=""
for f in "${status_dir}"/rank_*; do
  [[ -f "${f}" ]] || continue
  read -r status what used < "${f}"
  if (( status > rc )); then rc=${status}; fi
  if [[ "${f}" == */rank_0 ]]; then trained=${what} seed=${used:-}; fi
done
if [[ "${trained}" == trained ]]; then
  # The seed the run used, as its MLPerf log has it (drawn from the OS when SEED is unset).
  echo "RESULT,bert,${seed:-${SEED:-unknown}},$((end - start)),${USER:-$(id -un)},$(date -d "@${start}" '+%Y-%m-%d %r')"
fi
exit "${rc}"
