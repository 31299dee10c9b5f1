#!/usr/bin/env bash
# One node with docker, as MLPerf's single-node launcher: NEXP timed runs of one config in
# the image CONT, each log checked by the MLCommons compliance checker (ruleset 5.0.0).
#
#   source config_<SYSTEM>.sh
#   CONT=<image> DATADIR=... EVALDIR=... [LOGDIR=...] ./run_with_docker.sh [key.sub=value ...]
#
# Each run is one `docker run` of the image's run_and_time.sh (torchrun, DGXNGPU local ranks),
# with --gpus all where nvidia-smi lists a GPU and no GPU otherwise (config_CPU_1x2.sh on a
# CPU machine), host networking and IPC, and the caller's uid:gid, so that what the runs
# write into LOGDIR is the caller's. The paths are mounted at the same paths inside (DATADIR,
# EVALDIR and INIT_CHECKPOINT's directory read-only), so the trainer's messages name the
# paths given here.
#
# Variables: the config's (every variable the sourced config exports: CONFIG_SCRIPT, or CONFIG,
# else config_${DGXSYSTEM}.sh; and every input of run_and_time.sh that is set reach the
# container, with the values they have here: what you set after sourcing the config, and your
# EXTRA_PARAMS, over the config's); the arguments: the trainer's command line; CONT, DATADIR, EVALDIR
# (required; the paths are checked before the first run, as INIT_CHECKPOINT is); LOGDIR
# (default results/<DGXSYSTEM>/bert at the repository root); NEXP (default 1); SEED (the
# first run's; default random; each run adds its index, as the closed division requires);
# DATESTAMP; CLEAR_CACHES (default 1: drop the page cache before each run, as root or via
# passwordless sudo; where neither is allowed it says so and the log says cache_clear false);
# CHECK_COMPLIANCE (default 1); INIT_CHECKPOINT; SAVE_CHECKPOINT (the final weights, into
# LOGDIR under that file name); MOUNTS (more mounts, src:dst[:ro],...).
# Per run i (1..NEXP), as run.sub writes them: ${LOGDIR}/${DATESTAMP}_${i}.log (the MLPerf
# log), its resolved config beside it, ${DATESTAMP}_${i}_compliance.txt and _checker.out, and
# ${DATESTAMP}_${i}_ckpt (train-state checkpoints: on a signal, or as the config asks).
#
# Exit status: the worst run's: its training exit (run_and_time.sh's: 0 target, 1 sample
# limit, 2 bad input, 3 stopped by SIGTERM/SIGUSR1, 4 a rank failed, 5 a write failed, 130
# Ctrl-C), at least 1 for a log the checker rejects; 2 for bad input found before the first
# run (nothing run, nothing written). SIGTERM, SIGINT and SIGUSR1 go to the running container
# (its ranks checkpoint and exit 3; 130 for SIGINT); no later run starts.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
prog=run_with_docker.sh
fail() { printf 'run_with_docker.sh: %s\n' "$@" >&2; exit 2; }

missing=()
for var in DGXSYSTEM DGXNGPU CONT DATADIR EVALDIR; do
  [[ -n "${!var:-}" ]] || missing+=("${var}")
done
if (( ${#missing[@]} )); then
  fail "missing variable(s): ${missing[*]} (source a config_*.sh; set CONT to the image, DATADIR and EVALDIR)"
fi
if (( ${DGXNNODES:-1} != 1 )); then
  fail "the config wants DGXNNODES=${DGXNNODES} nodes; this launcher runs one (sbatch run.sub for more)"
fi
config="${CONFIG:-${CONFIG_SCRIPT:-${here}/config_${DGXSYSTEM}.sh}}"
[[ -f "${config}" ]] || fail "CONFIG=${config}: no such file (set CONFIG to the config_*.sh you sourced)"

# Bad paths would spend a run and leave the checker a stub log, and docker would create a
# missing one (as root): check them now. The container sees them at the same paths.
bad=()
abs() { (cd "$1" && pwd); }
for var in DATADIR EVALDIR; do
  if [[ -d "${!var}" ]]; then
    printf -v "${var}" '%s' "$(abs "${!var}")"
  else
    bad+=("${var}=${!var} (no such directory)")
  fi
done
if [[ -n "${INIT_CHECKPOINT:-}" ]]; then
  if [[ -e "${INIT_CHECKPOINT}" || -e "${INIT_CHECKPOINT}.index" ]]; then
    INIT_CHECKPOINT="$(abs "$(dirname "${INIT_CHECKPOINT}")")/$(basename "${INIT_CHECKPOINT}")"
  else
    bad+=("INIT_CHECKPOINT=${INIT_CHECKPOINT} (no such file, nor a TF checkpoint prefix)")
  fi
fi
: "${LOGDIR:=${here}/../../../../results/${DGXSYSTEM}/bert}"
[[ "${LOGDIR}" == /* ]] || LOGDIR="${PWD}/${LOGDIR}"
for path in "${DATADIR}" "${EVALDIR}" "${LOGDIR}"; do
  # The image's own directories: a mount there would hide what the run needs.
  case "${path%/}/" in
    /|/bin/*|/dev/*|/etc/*|/lib/*|/lib64/*|/proc/*|/sbin/*|/sys/*|/usr/*|/workspace/|/workspace/bert/*)
      bad+=("${path}: the image's own directory; mount the data elsewhere") ;;
  esac
done
if (( ${#bad[@]} )); then
  printf 'run_with_docker.sh: %s\n' "${bad[@]}" >&2
  fail "nothing was run (input_preprocessing/prepare_data.sh prints the paths to use)"
fi
command -v docker > /dev/null || fail "no docker client on PATH (apt-get install docker.io)"

# What reaches the container: the config's variables and the trainer's launcher variables
# (bert/config.py's LAUNCHER_VARIABLES: standard-library Python, read by the host's python3),
# with the values they have here (a variable set on the command line overrides the config's).
mapfile -t inputs < <(python3 -c 'import sys; sys.path.insert(0, sys.argv[1])
from bert.config import LAUNCHER_VARIABLES, CONFIG_PARAMS, CONFIG_SCRIPT, EXTRA_PARAMS
print(*LAUNCHER_VARIABLES, CONFIG_PARAMS, CONFIG_SCRIPT, EXTRA_PARAMS, sep="\n")' "${here}" 2> /dev/null)
[[ " ${inputs[*]} " == *" DATADIR "* ]] || fail "cannot read the trainer's launcher variables (bert/config.py) with python3 (3.10 or newer)"
mapfile -t exported < <(cd "${here}" && env -i bash -c "source '${config}' > /dev/null && compgen -e" |
                         grep -vxE 'PWD|SHLVL|_')
env_args=()
declare -A passed=([DATADIR]=1 [EVALDIR]=1 [LOGDIR]=1 [LOGFILE]=1 [SEED]=1 [CACHE_CLEARED]=1  # set per run below
                   [INIT_CHECKPOINT]=1 [SAVE_CHECKPOINT]=1 [CKPT_DIR]=1)
for var in "${exported[@]}" "${inputs[@]}"; do
  if [[ -z "${passed[${var}]:-}" && -n "${!var+set}" ]]; then env_args+=(--env "${var}=${!var}"); fi
  passed[${var}]=1
done

: "${NEXP:=1}"
: "${CLEAR_CACHES:=1}"
: "${CHECK_COMPLIANCE:=1}"
: "${DATESTAMP:=$(date +'%y%m%d%H%M%S%N')}"
: "${SEED:=$(( (RANDOM << 15 | RANDOM) % 1000000 ))}"
mkdir -p "${LOGDIR}"
LOGDIR="$(abs "${LOGDIR}")"

# The mounts, each target once (EVALDIR may be DATADIR; the checkpoint may lie in LOGDIR).
declare -A mounted=()
mounts=()
add_mount() { # add_mount PATH [ro]
  [[ -n "${mounted[$1]:-}" ]] && return 0
  mounted[$1]=1
  mounts+=(--volume "$1:$1${2:+:$2}")
}
add_mount "${LOGDIR}"
add_mount "${DATADIR}" ro
add_mount "${EVALDIR}" ro
if [[ -n "${INIT_CHECKPOINT:-}" ]]; then add_mount "$(dirname "${INIT_CHECKPOINT}")" ro; fi
if [[ -n "${MOUNTS:-}" ]]; then
  IFS=, read -r -a extra <<< "${MOUNTS}"
  for m in "${extra[@]}"; do mounts+=(--volume "${m}"); done
fi
gpus=none gpu_args=()
if command -v nvidia-smi > /dev/null && nvidia-smi -L 2> /dev/null | grep -q '^GPU '; then
  # MLPerf's GPU settings: every GPU, unlimited locked memory (NCCL's and the loader's pinned
  # buffers), NVIDIA's 64 MiB stack. Not on a CPU host: raising the memlock limit takes
  # CAP_SYS_RESOURCE, which a sandboxed engine may lack, and gloo pins nothing.
  gpus=all gpu_args=(--gpus all --ulimit memlock=-1 --ulimit stack=67108864)
fi
# Host network (torchrun's rendezvous, NCCL's sockets) and IPC (NCCL, the data loader's shared
# memory), as MLPerf's launcher has them; --init: a PID 1 that passes signals on to
# run_and_time.sh. HOME: the caller's uid need have no home in the image, and torch and
# Triton keep their caches there.
docker_run=(docker run --rm --init --network host --ipc host "${gpu_args[@]}" --user "$(id -u):$(id -g)"
            --env "USER=$(id -un 2> /dev/null || id -u)" --env HOME=/tmp "${mounts[@]}")

echo "${prog}: ${DGXSYSTEM}, 1 node x ${DGXNGPU} rank(s), ${NEXP} run(s), logs in ${LOGDIR}, image ${CONT}," \
     "GPUs: ${gpus}"

clear_caches() {
  if sync && { echo 3 > /proc/sys/vm/drop_caches || sudo -n /sbin/sysctl -q vm.drop_caches=3; } 2> /dev/null; then
    return 0
  fi
  echo "${prog}: could not drop the page cache (needs root or passwordless sudo sysctl); logging cache_clear=false" >&2
  return 1
}

# A signal goes to the running container; the loop then ends after that run.
container="" got_signal=""
# shellcheck disable=SC2317  # called from the traps
on_signal() {
  got_signal=$1
  if [[ -n "${container}" ]]; then docker kill --signal "$1" "${container}" > /dev/null 2>&1 || true; fi
}
trap 'on_signal TERM' TERM
trap 'on_signal INT' INT
trap 'on_signal USR1' USR1

# run_in NAME ARGS...: `docker run` of ARGS (options, the image, its command) in a container
# named NAME, waited on in the background so that the traps run (bash runs them between
# commands); returns the container's status (docker's own, 125-127, when it did not start).
run_in() {
  local rc=0
  container=$1
  shift
  "${docker_run[@]}" --name "${container}" "$@" &
  local pid=$!
  while :; do
    rc=0
    wait "${pid}" || rc=$?
    # a trapped signal ends `wait` early (status > 128) while the container runs on
    if (( rc <= 128 )) || ! kill -0 "${pid}" 2> /dev/null; then break; fi
  done
  container=""
  return "${rc}"
}

worst=0 failed=0 runs=0
for (( i = 1; i <= NEXP; i++ )); do
  if [[ -n "${got_signal}" ]]; then
    echo "${prog}: stopped by SIG${got_signal} before run ${i}" >&2
    break
  fi
  seed=$(( SEED + i - 1 ))
  log="${LOGDIR}/${DATESTAMP}_${i}.log"
  echo "== run ${i}/${NEXP}: seed ${seed}, log ${log} ($(date '+%F %T'))"
  cleared=0
  if [[ "${CLEAR_CACHES}" == 1 ]]; then
    clear_caches && cleared=1
  else
    echo "${prog}: CLEAR_CACHES=${CLEAR_CACHES}: page cache not dropped; logging cache_clear=false"
  fi
  rc=0
  run_in "mlperf-bert-${DATESTAMP}-${i}" "${env_args[@]}" \
    --env SEED="${seed}" --env CACHE_CLEARED="${cleared}" --env DATADIR="${DATADIR}" --env EVALDIR="${EVALDIR}" \
    --env LOGDIR="${LOGDIR}" --env LOGFILE="${DATESTAMP}_${i}.log" --env INIT_CHECKPOINT="${INIT_CHECKPOINT:-}" \
    --env CKPT_DIR="${LOGDIR}/${DATESTAMP}_${i}_ckpt" \
    --env SAVE_CHECKPOINT="${SAVE_CHECKPOINT:+${LOGDIR}/$(basename "${SAVE_CHECKPOINT}")}" \
    "${CONT}" ./run_and_time.sh "$@" || rc=$?
  runs=$(( runs + 1 ))
  check=0 verdict="not run"
  if [[ "${CHECK_COMPLIANCE}" == 1 && -z "${got_signal}" ]]; then
    run_in "mlperf-bert-${DATESTAMP}-${i}-check" "${CONT}" \
      python -m mlperf_logging.compliance_checker --usage training --ruleset 5.0.0 \
        --log_output "${LOGDIR}/${DATESTAMP}_${i}_compliance.txt" "${log}" \
      > "${LOGDIR}/${DATESTAMP}_${i}_checker.out" 2>&1 || check=$?
    if (( check == 0 )); then verdict=PASS; else verdict=FAIL; fi
  fi
  echo "== run ${i}/${NEXP}: training exit ${rc}; compliance checker (5.0.0): ${verdict}"
  status=${rc}
  if (( check != 0 )); then
    tail -n 5 "${LOGDIR}/${DATESTAMP}_${i}_checker.out" >&2 || true
    (( status > 0 )) || status=1
  fi
  if (( status != 0 )); then failed=$(( failed + 1 )); fi
  if (( status > worst )); then worst=${status}; fi
done
echo "${prog}: ${runs} run(s), ${failed} failed; exit status ${worst} (the worst run's)"
exit "${worst}"
