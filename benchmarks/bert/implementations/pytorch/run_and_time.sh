#!/usr/bin/env bash
# Per-run launcher: runs training with the config_*.sh variables that are set, and prints the
# start/end and, for a run that trained, one RESULT line (rank 0's).
#
#   source config_CPU_1x2.sh && DATADIR=... EVALDIR=... [LOGDIR=...] ./run_and_time.sh [key.sub=value ...]
#
# What the run gets, lowest precedence first (bert/config_script.py; the run's first lines name
# where each setting came from): the defaults (bert/config.py); the config script's variables
# (the table of bert/config.py's LAUNCHER_VARIABLES) and its CONFIG_PARAMS; what you set after
# sourcing it (LR=... before ./run_and_time.sh) and EXTRA_PARAMS (key=value words and flags such
# as --dry-run: yours, no config script sets it); this script's arguments.
#
# Relative paths (DATADIR, EVALDIR, LOGDIR, INIT_CHECKPOINT, SAVE_CHECKPOINT, CKPT_DIR) are
# relative to the directory it is called from. LOGDIR defaults to results/<DGXSYSTEM>/bert
# four levels up (the repository root here, the organisation's folder in a submission).
#
# Exit status: the trainer's own (python -m bert.train: 0 target, 1 sample limit, 2 bad
# input, 3 checkpointed on a signal, 4 a peer rank failed, 5 a file could not be written,
# 6 diverged (NaN/inf), 130 Ctrl-C; the worst rank's, 2 when any rank's is 2), under torchrun
# too; 2 when no config was sourced.
#
# LAUNCHER=torchrun (default) starts DGXNGPU local ranks itself; LAUNCHER=task means this
# script already is one rank (started by srun or mpirun), so it runs one process.
#
# Signals. SIGUSR1 / SIGTERM (and SIGHUP, as SIGTERM) to this script reach the training
# processes, which checkpoint at their next poll and exit 3 (bert/checkpoint.py): bash would
# otherwise die of SIGUSR1 and leave them orphaned, and torchrun would die of it too, so
# under torchrun the signal goes to its workers (found in /proc: no procps needed). A signal
# that comes before they can catch it (torchrun not started, its workers not yet past their
# start-up) is noted in the status directory, and each rank acts on it once it can: none is
# lost, whenever it comes. Ctrl-C (SIGINT): the ranks stop at their next poll, log run_stop
# aborted and exit 130; a second Ctrl-C ends them at once. Under torchrun, torchrun and its
# workers run in process groups of their own and ignore the terminal: this script passes the
# first Ctrl-C to the workers and ends torchrun and them with the second (SIGKILL, so torchrun
# prints no traceback). Under LAUNCHER=task srun (with --disable-status, as run.sub has it),
# mpirun or the terminal already signal every process of the task, the trainer too.
# Killed by what it cannot trap (kill -9, the OOM killer), the script takes torchrun and the
# workers with it (bert/tether.py: the kernel's parent-death signal), under LAUNCHER=task the
# trainer: nothing trains on unseen.
set -euo pipefail
if [[ -z "${DGXSYSTEM:-}" || ( -z "${DGXNGPU:-}" && "${LAUNCHER:-torchrun}" == torchrun ) ]]; then
  echo "run_and_time.sh: no config: source a config_*.sh first (e.g. source config_CPU_1x2.sh)" >&2
  exit 2
fi
for var in DATADIR EVALDIR LOGDIR INIT_CHECKPOINT SAVE_CHECKPOINT CKPT_DIR TENSORBOARD_DIR; do
  if [[ -n "${!var:-}" && "${!var}" != /* ]]; then printf -v "${var}" '%s/%s' "${PWD}" "${!var}"; fi
done
cd "$(dirname "${BASH_SOURCE[0]}")"
: "${LOGDIR:=$(cd ../../../.. && pwd)/results/${DGXSYSTEM}/bert}"
export LOGDIR

# Each rank writes its exit status here and exits 0 (bert/train.py --exit-status-dir); a
# signal that comes before a training process can catch it is noted here too (signals).
status_dir=$(mktemp -d)
trap 'rm -rf "${status_dir}"' EXIT
child="" signalled=0 interrupts=0 kids=() usr1=$(kill -l USR1)
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
catches() { # catches PID SIGNUM: PID has a handler for it now (SigCgt in /proc/PID/status)
  local key mask  # (an explicit status: a bare `return` in a trap returns the trapped command's)
  while read -r key mask; do
    if [[ "${key}" == SigCgt: ]]; then return $(( ((16#${mask} >> ($2 - 1)) & 1) == 0 )); fi
  done < "/proc/$1/status" 2>/dev/null
  return 1
}
# shellcheck disable=SC2317
forward() { # forward SIG: to the trainer (under torchrun: to its workers, not to torchrun)
  signalled=1
  # First noted for the processes that cannot catch it yet (not started, or not yet past
  # their start-up), which raise it once they can (bert/checkpoint.py StopFlag.installed); then
  # sent to those that catch it now. A process sees it one way or the other, never both lost.
  echo "$1" >> "${status_dir}/signals"
  local targets=() pid
  if [[ -n "${child}" ]]; then
    if [[ "${LAUNCHER:-torchrun}" == torchrun ]]; then children_of "${child}"; targets=("${kids[@]}"); else targets=("${child}"); fi
  fi
  # A trainer catches SIGUSR1 from the moment its handlers are in place (SIGINT tells
  # nothing: torchrun's workers start with Python's own KeyboardInterrupt handler).
  for pid in "${targets[@]}"; do
    if catches "${pid}" "${usr1}" && ! kill -s "$1" "${pid}" 2>/dev/null && [[ -d "/proc/${pid}" ]]; then
      echo "run_and_time.sh: WARNING: SIG$1 could not be delivered to training process ${pid}" >&2
    fi
  done
}
# shellcheck disable=SC2317
interrupt() { # Ctrl-C: the first asks the ranks to stop at their next poll, a second ends them at once
  signalled=1 interrupts=$(( interrupts + 1 ))
  if (( interrupts == 1 )); then
    # Under LAUNCHER=task srun, mpirun or the terminal signal every process of the task
    # themselves; noting it covers a trainer that cannot catch it yet.
    if [[ "${LAUNCHER:-torchrun}" == torchrun ]]; then forward INT; else echo INT >> "${status_dir}/signals"; fi
  elif [[ -z "${child}" ]]; then
    :  # nothing started yet: the launch below is skipped
  elif [[ "${LAUNCHER:-torchrun}" != torchrun ]]; then
    kill -s KILL "${child}" 2>/dev/null || true
  else  # torchrun first, so that it sees no worker die (and prints no traceback about it)
    children_of "${child}"
    kill -s KILL "${child}" "${kids[@]}" 2>/dev/null || true
  fi
}
# From here on a signal is never lost, whenever it comes (before torchrun, before its
# workers, before their handlers): the traps note it for the training processes.
trap 'forward USR1' USR1
trap 'forward TERM' TERM
trap 'forward TERM' HUP
trap interrupt INT
start=$(date +%s)
echo "STARTING TIMING RUN AT $(date '+%Y-%m-%d %r')"
if (( interrupts > 1 )); then
  echo "interrupted (Ctrl-C twice) before the training started: nothing was run" >&2
  exit 130
fi
# The training processes are tethered (bert/tether.py): torchrun dies with this script and
# its workers with torchrun, by whatever signal, kill -9 included; so does the trainer under
# LAUNCHER=task. Until their handlers are in place they ignore Ctrl-C (`trap '' INT` is
# inherited; the trap above notes it for them).
if [[ "${LAUNCHER:-torchrun}" == torchrun ]]; then
  # torchrun's own choice for several local ranks, made here so it prints no warning box about it.
  if [[ -z "${OMP_NUM_THREADS:-}" ]] && (( DGXNGPU > 1 )); then export OMP_NUM_THREADS=1; fi
  # torchrun leaves SIGINT alone (PET_SIGNALS_TO_HANDLE: its --signals-to-handle, which older
  # versions ignore): it would pass Ctrl-C on as the workers' second, and die with a traceback.
  # --standalone: a private rendezvous on this node; one process per GPU (CPU rank). set -m for
  # this line only: torchrun and its workers get a process group of their own (and so ignore
  # the terminal's Ctrl-C, which the trap above passes on).
  set -m
  (trap '' INT; PET_SIGNALS_TO_HANDLE=SIGTERM,SIGHUP,SIGQUIT exec python -m bert.tether --parent $$ -- \
    torchrun --standalone --nnodes=1 --nproc_per_node="${DGXNGPU}" \
    -m bert.train --from-env --exit-status-dir "${status_dir}" "$@") &
  set +m
else
  (trap '' INT; BERT_PARENT_PID=$$ exec python -m bert.train --from-env --exit-status-dir "${status_dir}" "$@") &
fi
child=$!
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
if (( interrupts && rc == 130 )) && ! compgen -G "${status_dir}/rank_*" > /dev/null; then
  # The Ctrl-C reached the launch itself, in the instant between fork and its `trap '' INT`.
  echo "interrupted (Ctrl-C) as the training processes were being started: nothing was run" >&2
  exit 130
fi
# The worst status any rank wrote (a rank that crashed wrote none, and the launcher says so),
# except that bad input (2) outranks everything: a peer of the rank that saw it reports that
# rank's death (4) when it could not learn why.
trained=none seed="" bad_input=0
for f in "${status_dir}"/rank_*; do
  [[ -f "${f}" ]] || continue
  read -r status what used < "${f}"
  if (( status > rc )); then rc=${status}; fi
  if (( status == 2 )); then bad_input=1; fi
  if [[ "${f}" == */rank_0 ]]; then trained=${what} seed=${used:-}; fi
done
if (( bad_input )); then rc=2; fi
if [[ "${trained}" == trained ]]; then
  # The seed the run used, as its MLPerf log has it (drawn from the OS when SEED is unset).
  echo "RESULT,bert,${seed:-${SEED:-unknown}},$((end - start)),${USER:-$(id -un)},$(date -d "@${start}" '+%Y-%m-%d %r')"
fi
exit "${rc}"
