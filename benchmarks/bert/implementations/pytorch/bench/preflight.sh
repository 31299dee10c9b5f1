#!/usr/bin/env bash
# The pre-flight: the device run on the device's own Python, torch and Triton, here on the CPU,
# before any device call (a device window is short; a version difference found here costs none).
#
#   bench/h200.sh preflight      # or: make preflight (from the repository's root)
#
# A side environment (<repo>/.preflight, ignored by git; PREFLIGHT_ENV to move it) with the
# device's Python (PREFLIGHT_PYTHON, else python3.12 on PATH, else pyenv's newest 3.12.x), its
# torch and Triton (constraints.txt's "# device-pin:" lines; PyPI's torch 2.11 for Linux is its
# CUDA 13.0 build, which imports and runs on a CPU: with its nvidia-* wheels the environment
# takes ~5 GB and ~2 min to build) and the project's pins for the rest; rebuilt when those lines
# change. Then, in it:
#   1. the versions, against the pins;
#   2. the run's modules imported, as bench/h200.sh does on the device;
#   3. bench/device_run.py --cpu-smoke: every task of the device run on a tiny model (it must exit
#      0, measure a headline, and leave no task in error);
#   4. the tests that hold the device run's claims on these versions: one compile for every
#      encoder layer with the Triton op in Triton's interpreter (aot_eager, and inductor with the
#      op's levers), the interpreter's kernel and lever tests, LAMB's variants, the kernel profile.
# Writes PREFLIGHT_OUT (default <pkg>/results/preflight): preflight.json (the smoke's JSON),
# preflight.log (everything). The last line says ok, or which step failed; exit 0 only if all passed.
set -euo pipefail
pkg="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
constraints="${pkg}/constraints.txt"
env="${PREFLIGHT_ENV:-$(cd "${pkg}/../../../.." && pwd)/.preflight}"
out="${PREFLIGHT_OUT:-${pkg}/results/preflight}"
mkdir -p "${out}"
log="${out}/preflight.log"
: > "${log}"

fail() {
  echo "preflight: FAILED: $*" | tee -a "${log}"
  exit 1
}

version="$(sed -n 's/^# device-python: *//p' "${constraints}")"
mapfile -t pins < <(sed -n 's/^# device-pin: *//p' "${constraints}")
[[ -n "${version}" && ${#pins[@]} -gt 0 ]] || fail "no '# device-python:' / '# device-pin:' lines in ${constraints}"
# The first candidate that runs and is that version (a pyenv shim on PATH may not run it).
python=""
shopt -s nullglob
pyenv=("${PYENV_ROOT:-${HOME}/.pyenv}/versions/${version}".*/bin/python)
shopt -u nullglob
mapfile -t pyenv < <(if (( ${#pyenv[@]} )); then printf '%s\n' "${pyenv[@]}" | sort -rV; fi)
for candidate in "${PREFLIGHT_PYTHON:-}" "$(command -v "python${version}" || true)" "${pyenv[@]}"; do
  if [[ -n "${candidate}" ]] && "${candidate}" -c "import sys; sys.exit(sys.version.split()[0].rsplit('.', 1)[0] != '${version}')" \
       2> /dev/null; then
    python="${candidate}"
    break
  fi
done
[[ -n "${python}" ]] || fail "no Python ${version} that runs (set PREFLIGHT_PYTHON, or install python${version})"

# The environment: built once per set of pins (the stamp holds them and the other pins).
stamp="${env}/.preflight-stamp"
want="$(printf '%s\n' "${version}" "${pins[@]}"; grep -v -E '^(#|$)' "${constraints}")"
if [[ ! -x "${env}/bin/python" || "$(cat "${stamp}" 2>/dev/null)" != "${want}" ]]; then
  echo "preflight: building ${env} on ${python} with ${pins[*]} (once per set of pins)" | tee -a "${log}"
  rm -rf "${env}"
  "${python}" -m venv "${env}" || fail "python -m venv ${env}"
  others="${env}/constraints-others.txt"
  names=()
  for pin in "${pins[@]}"; do names+=("${pin%%==*}"); done
  grep -v -E "^($(IFS='|'; echo "${names[*]}"))==" "${constraints}" > "${others}"
  # What the device run and these tests import; on the device, the image has them (mlperf-logging
  # and torchao travel as wheels: bench/h200.sh prepare).
  "${env}/bin/python" -m pip install -q -c "${others}" "${pins[@]}" numpy h5py pyyaml safetensors mlperf-logging \
    torchao pytest filelock 2>&1 | tee -a "${log}" || fail "pip install into ${env} (above)"
  echo "${want}" > "${stamp}"
fi
py="${env}/bin/python"

# 1. The versions.
got="$("${py}" -c 'import platform, torch, triton; print(platform.python_version(), torch.__version__, triton.__version__)')"
echo "preflight: python, torch, triton: ${got}" | tee -a "${log}"
read -r got_python got_torch got_triton <<< "${got}"
[[ "${got_python}" == "${version}".* ]] || fail "python ${got_python}, not ${version}"
for pin in "${pins[@]}"; do
  name="${pin%%==*}" want_v="${pin#*==}"
  have="$([[ ${name} == torch ]] && echo "${got_torch}" || echo "${got_triton}")"
  [[ "${have%%+*}" == "${want_v}" ]] || fail "${name} ${have}, not ${want_v}"
done

cd "${pkg}"
# 2. The run's modules.
if ! err="$("${py}" -c 'import bench.device_run' 2>&1)"; then
  fail "the run's modules do not import: ${err##*$'\n'}"
fi
# 3. The device run's dry run.
json="${out}/preflight.json"
rm -f "${json}"
if ! PYTHONUNBUFFERED=1 "${py}" bench/device_run.py --cpu-smoke --out "${json}" --artifacts "${out}" 2>&1 | tee -a "${log}"; then
  fail "bench/device_run.py --cpu-smoke exited non-zero (above)"
fi
verdict="$("${py}" - "${json}" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
bad = [f"{c['case']}: {c['status']}" for c in r["cases"] if not (c["status"] == "ok" or c["status"].startswith("skipped"))]
bad += [f"check_{k}: {v.get('status')}" for k, v in r["checks"].items()
        if not (v.get("status") == "ok" or str(v.get("status")).startswith("skipped"))]
if not r.get("headline", {}).get("case"):
    bad.append("no headline measured")
print("; ".join(bad)[:2000] if bad else f"ok: {len(r['cases'])} cases, {len(r['checks'])} checks, headline {r['headline']['case']}")
PY
)"
echo "preflight: smoke: ${verdict}" | tee -a "${log}"
[[ "${verdict}" == ok:* ]] || fail "the smoke: ${verdict}"
# 4. The tests of the run's claims on these versions.
if ! "${py}" -m pytest -q -p no:cacheprovider tests/unit/test_triton_attention.py tests/unit/test_lamb_fused.py \
     tests/unit/test_bench.py "tests/integration/test_triton_attention.py::test_one_compile_serves_every_layer_and_rung_with_the_triton_op" \
     2>&1 | tee -a "${log}"; then
  fail "the tests (above)"
fi
echo "preflight: ok on python ${got_python}, torch ${got_torch}, triton ${got_triton}: the smoke (${verdict#ok: }) and the tests" \
  | tee -a "${log}"
