#!/usr/bin/env bash
# The prepared device run: bench/device_run.py on one GPU within one call's time limit, its
# JSON and logs written to $OUT (BENCHMARKS.md section 3 has the exact `run` call).
#
#   bench/h200.sh preflight      # HERE, before any device call: bench/preflight.sh, the run on the
#                             # device's Python, torch and Triton (a side environment, CPU only)
#   bench/h200.sh prepare [DIR]  # HERE, on the commit to measure, before the device call: the
#                             # mlperf-logging and torchao wheels (not on the device image;
#                             # pinned in constraints.txt) and that commit, into <repo>/.h200/ (ignored);
#                             # with DIR (an earlier call's returned files), its compile-cache
#                             # parts too, so the next call starts with warm caches; it fails,
#                             # saying which, unless both wheels are there
#   bench/h200.sh [ARGS...]   # ON THE DEVICE: logs the GPU's name, driver, compute mode and
#                             # clocks (read, never set), installs .h200/*.whl into /tmp/site,
#                             # imports the run's modules (one line and exit 3 if they fail; a
#                             # line per optional wheel missing, and what then fails), unpacks a
#                             # carried compile cache, runs bench/device_run.py [ARGS...] (e.g.
#                             # --only a,b) so that it ends H200_LIMIT_S (440) seconds after this
#                             # script started, then prints the table and packs inductor's and
#                             # Triton's caches into $OUT (compile_cache.tar.gz.partNN) within
#                             # H200_PACK_S (30): the whole call stays within H200_LIMIT_S +
#                             # H200_PACK_S + a few seconds (the run call's timeout_s: 510)
#
# The device gets a copy of the working tree without .git (tracked and untracked-not-ignored
# files, and the carried paths), so the commit measured travels as .h200/commit, written by
# `prepare` from `git rev-parse HEAD` (suffixed -dirty when tracked files differ from it).
# Writes $OUT/gpu_bert_large_<UTC date>_<commit, 10 hex>[_$H200_TAG].json (the file to commit under
# bench/results/; rewritten after every task, so a call cut short still returns it),
# $OUT/gpu_bert_large.log (everything printed), the demo check's demo_result_0.txt,
# demo_train.log, demo_compliance.txt, and at most 3 cache parts of at most 15 MiB (the device
# returns at most 8 files, 16 MiB each, 64 MiB in all; a cache larger than 45 MiB compressed is
# left out, and the log says so). Without $OUT: results/h200/.
# Exit status: the run's (124 when the hard limit cut it; the JSON keeps what finished).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
pkg="$(dirname "${here}")"
root="$(cd "${pkg}/../../../.." && pwd)"
h200="${H200_DIR:-${root}/.h200}"
py="${PYTHON:-python3}"
site="${H200_SITE:-/tmp/site}"  # where the carried wheels are installed (the device README's recipe)

cache_parts=3            # files: json, log, 3 demo files, and these: the device's 8
cache_part_mib=15
if [[ "${1:-}" == preflight ]]; then
  shift
  exec bash "${here}/preflight.sh" "$@"
fi
if [[ "${1:-}" == prepare ]]; then
  rm -rf "${h200}"
  mkdir -p "${h200}"
  if [[ -n "${2:-}" ]]; then  # an earlier call's returned files: carry its compile cache
    shopt -s nullglob
    parts=("${2}"/compile_cache.tar.gz.part*)
    if (( ${#parts[@]} )); then
      cp "${parts[@]}" "${h200}/"
      echo "h200.sh prepare: carrying ${#parts[@]} compile-cache part(s) from ${2}"
    else
      echo "h200.sh prepare: no compile_cache.tar.gz.part* in ${2}: the next call starts cold" >&2
    fi
  fi
  # The device's python is CPython 3.12 on x86-64 (KINDS.md). mlperf-logging is pure Python, its
  # needs (numpy, pandas, pyyaml, scipy) on the device image; torchao (precision.fp8, bert/fp8.py;
  # 3.4 MB) is an abi3 wheel without dependencies, its float8 training pure Python over torch.
  for name in mlperf-logging torchao; do
    pin="$(grep -E "^${name}==" "${pkg}/constraints.txt")"
    if ! "${py}" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d "${h200}" "${pin}"; then
      echo "h200.sh prepare: ${pin} did not download (above): not prepared" >&2
      exit 1
    fi
  done
  shopt -s nullglob
  for wheel in mlperf_logging torchao; do
    found=("${h200}/${wheel}"-*.whl)
    if (( ${#found[@]} != 1 )); then
      echo "h200.sh prepare: ${#found[@]} ${wheel} wheel(s) in ${h200}, not 1: not prepared" >&2
      exit 1
    fi
  done
  commit="$(git -C "${root}" rev-parse HEAD)"
  if [[ -n "$(git -C "${root}" status --porcelain --untracked-files=no)" ]]; then commit="${commit}-dirty"; fi
  echo "${commit}" > "${h200}/commit"
  echo "h200.sh prepare: ${h200}: $(cd "${h200}" && echo ./*.whl) and commit ${commit}"
  exit 0
fi

out="${OUT:-${pkg}/results/h200}"
mkdir -p "${out}"
log="${out}/gpu_bert_large.log"
: > "${log}"
# First, before anything can fail: the GPU as found (a reading only: clocks, power and modes
# stay as they are). An Exclusive_Process compute mode lets one process hold a context.
if command -v nvidia-smi > /dev/null; then
  nvidia-smi --query-gpu=name,driver_version,compute_mode,clocks.sm,clocks.max.sm,clocks.mem,clocks.max.mem,power.draw,power.limit,temperature.gpu \
    --format=csv 2>&1 | tee -a "${log}" || true
else
  echo "h200.sh: no nvidia-smi here" | tee -a "${log}"
fi
shopt -s nullglob
wheels=("${h200}"/*.whl)
if (( ${#wheels[@]} )); then
  if "${py}" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "${site}" "${wheels[@]}" \
       2>&1 | tee -a "${log}"; then
    export PYTHONPATH="${site}${PYTHONPATH:+:${PYTHONPATH}}"
  else
    echo "h200.sh: installing the carried wheels failed (above): going on without them" | tee -a "${log}"
  fi
else
  echo "h200.sh: no wheels in ${h200} (run 'bench/h200.sh prepare' here and carry .h200)" | tee -a "${log}" >&2
fi
if [[ -f "${h200}/commit" ]]; then
  commit="$(< "${h200}/commit")"
else
  commit="$(git -C "${root}" rev-parse HEAD 2>/dev/null || echo unknown)"
fi
short="${commit:0:10}"
if [[ "${commit}" == *-dirty ]]; then short="${short}-dirty"; fi
json="${out}/gpu_bert_large_$(date -u +%Y-%m-%d)_${short}${H200_TAG:+_${H200_TAG}}.json"
# The run's modules, imported once before the window starts: one line and stop if they fail
# (no task could run; the JSON then holds that line), and a line for each optional wheel that
# is missing, and what then fails.
if ! err="$(cd "${pkg}" && "${py}" -c 'import bench.device_run' 2>&1)"; then
  line="h200.sh: the run's modules do not import: ${err##*$'\n'}"
  echo "${line}" | tee -a "${log}"
  "${py}" -c 'import json, sys; open(sys.argv[1], "w").write(json.dumps({"status": sys.argv[2], "commit": sys.argv[3]}) + "\n")' \
    "${json}" "error: ${line#h200.sh: }" "${commit}" || true
  exit 3
fi
for optional in "mlperf_logging:the demo check (its MLPerf log and checker)" "torchao:the FP8 cases"; do
  if ! "${py}" -c "import ${optional%%:*}" 2> /dev/null; then
    echo "h200.sh: ${optional%%:*} does not import: ${optional#*:} will fail" | tee -a "${log}"
  fi
done
# Inductor's and Triton's caches in one folder: unpacked from the carried parts, packed
# into $OUT after the run (a rerun then loads its kernels instead of compiling them).
cache="${H200_CACHE:-/tmp/bert_compile_cache}"
mkdir -p "${cache}"
export TORCHINDUCTOR_CACHE_DIR="${cache}/inductor" TRITON_CACHE_DIR="${cache}/triton"
warm=cold
parts=("${h200}"/compile_cache.tar.gz.part*)
if (( ${#parts[@]} )); then
  if cat "${parts[@]}" | tar -xzf - -C "${cache}"; then warm=warm; else echo "h200.sh: the carried cache did not unpack" >&2; fi
fi
cd "${pkg}"
rc=0
limit="${H200_LIMIT_S:-440}"
left=$(( limit - SECONDS ))  # the wheels and the cache took this script's first seconds
# The run counts its --limit-s from its own start and stops its own task before it; the hard
# kill 5 s later rarely has to.
PYTHONUNBUFFERED=1 timeout -k 10 "$(( left + 5 ))" "${py}" bench/device_run.py --out "${json}" --artifacts "${out}" \
  --commit "${commit}" --limit-s "${left}" --compile-cache "${warm}" "$@" 2>&1 | tee -a "${log}" || rc=$?
if [[ -f "${json}" ]]; then
  "${py}" bench/gpu_report.py "${json}" | tee -a "${log}" || true
fi
rm -f "${out}"/compile_cache.tar.gz.part*
if [[ -n "$(ls -A "${cache}")" ]]; then
  packed="$(mktemp)"
  if timeout "${H200_PACK_S:-30}" tar -czf "${packed}" -C "${cache}" .; then
    mib=$(( ($(stat -c %s "${packed}") + 1048575) / 1048576 ))
    if (( mib <= cache_parts * cache_part_mib )); then
      split -b "${cache_part_mib}m" -d -a 2 "${packed}" "${out}/compile_cache.tar.gz.part"
      returned=("${out}"/compile_cache.tar.gz.part*)
      echo "h200.sh: compile cache ${mib} MiB in ${#returned[@]} part(s)" | tee -a "${log}"
    else
      echo "h200.sh: compile cache ${mib} MiB > ${cache_parts} x ${cache_part_mib} MiB: not returned" | tee -a "${log}"
    fi
  else
    echo "h200.sh: packing the compile cache took over ${H200_PACK_S:-30} s: not returned" | tee -a "${log}"
  fi
  rm -f "${packed}"
fi
echo "h200.sh: exit ${rc}; wrote ${json}"
exit "${rc}"
