#!/usr/bin/env bash
# A stand-in for the NGC PyTorch base image, for machines that cannot pull nvcr.io (no
# registry, no NGC account, no GPU): Debian bookworm (debootstrap minbase) with Python 3.11,
# pip and the torch CPU wheel installed the way NGC installs its own torch, and NGC's pip
# constraint file (PIP_CONSTRAINT=/etc/pip/constraint.txt, NGC since 25.03) pinning every
# package it ships, numpy among them. Imports it into the current Docker engine as TAG:
#
#   tools/ngc_standin.sh [TAG]          # default TAG: ngc-standin:bookworm
#   docker build --network host --build-arg FROM_IMAGE_NAME=ngc-standin:bookworm -t mlperf-bert:cpu .
#
# The root filesystem is made once per machine and kept in STANDIN_CACHE (default
# build/ngc_standin at the repository root, git-ignored; remade when this script or
# constraints.txt's torch pin changes); later calls only import it. It stays a directory,
# streamed into `docker import`: a tarball of it would be another 1.1 GB to write (minutes on
# a busy disk) and read back. Making it needs root
# (debootstrap, chroot), the Debian mirror (DEBIAN_MIRROR, default the one apt uses here) and
# the torch CPU wheel where pip finds it without an index (pip's find-links): the index's
# torch is a CUDA build of several GB. The host's CA bundle (SSL_CERT_FILE, default
# /etc/ssl/certs/ca-certificates.crt) is baked in and named by PIP_CERT, so pip inside
# `docker build` reaches the index through a proxy that re-signs HTTPS.
#
# Exit status: 0 imported; 2 bad input (not root, no torch CPU wheel, no docker); else the
# failing step's.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
pkg="$(cd "${here}/.." && pwd)"
tag="${1:-ngc-standin:bookworm}"
cache="${STANDIN_CACHE:-$(cd "${pkg}/../../../.." && pwd)/build/ngc_standin}"
ca_bundle="${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}"
# NGC's 24.xx-25.03 images ship numpy 1.26.4, ours pins 2.x: an image built on the stand-in
# shows that our install keeps the base's pins (the Dockerfile drops ours where they clash).
standin_numpy=1.26.4
standin_pip=26.2.1
torch_pin="$(grep -E '^torch==' "${pkg}/constraints.txt")"

say() { printf 'ngc_standin: [%3d s] %s\n' "${SECONDS}" "$*"; }
die() { echo "ngc_standin: $*" >&2; exit 2; }
command -v docker >/dev/null || die "no docker client (apt-get install docker.io)"

# The Debian mirror apt uses here: deb822 stanzas (sources.list.d/*.sources) whose Suites
# name bookworm, else one-line "deb" entries, else Debian's own.
apt_mirror() {
  local line uris="" suites="" file
  for file in /etc/apt/sources.list.d/*.sources; do
    [[ -f "${file}" ]] || continue
    while IFS= read -r line || [[ -n "${line}" ]]; do
      case "${line}" in
        URIs:*) uris="${line#URIs:}" ;;
        Suites:*) suites=" ${line#Suites:} " ;;
        "") if [[ "${suites}" == *" bookworm "* && -n "${uris}" ]]; then break 2; fi; uris="" suites="" ;;
      esac
    done < "${file}"
    if [[ "${suites}" == *" bookworm "* && -n "${uris}" ]]; then break; fi
    uris="" suites=""
  done
  read -r -a uris <<< "${uris}"
  if [[ -z "${uris[0]:-}" ]]; then
    mapfile -t uris < <(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2> /dev/null |
      awk '{ sub(/\[[^]]*\] */, ""); split($0, f, " ") } f[1] == "deb" && f[3] == "bookworm" { print f[2] }')
  fi
  echo "${uris[0]:-http://deb.debian.org/debian}"
}

make_rootfs() { # make_rootfs DIR: debootstrap, pip, torch, the constraint file -> DIR
  local dir=$1 work rootfs wheels mirror whl pip_whl
  [[ "$(id -u)" == 0 ]] || die "making the stand-in needs root (debootstrap, chroot); ${dir} is not there yet"
  command -v debootstrap >/dev/null || die "no debootstrap (apt-get install debootstrap)"
  [[ -f "${ca_bundle}" ]] || die "no CA bundle at ${ca_bundle} (set SSL_CERT_FILE)"
  work="$(mktemp -d "${cache}/work.XXXXXX")"
  # shellcheck disable=SC2064  # expand now: the trap outlives this function's locals
  trap "rm -rf '${work}'" EXIT
  rootfs="${work}/rootfs" wheels="${work}/wheels"
  mirror="${DEBIAN_MIRROR:-$(apt_mirror)}"

  # The wheels first (seconds, from this machine's disk where pip has them): torch only from
  # a find-links directory (--no-index), never the index's CUDA build.
  say "wheels: ${torch_pin} (pip's find-links), numpy==${standin_numpy}, pip==${standin_pip}"
  python3 -m pip download --quiet --no-index --no-deps --dest "${wheels}" "${torch_pin}" \
    || die "${torch_pin}: no CPU wheel where pip finds it without an index (pip config list: find-links)"
  whl=("${wheels}"/torch-*.whl)
  [[ "${whl[0]}" == *+cpu-* ]] || die "${whl[0]##*/}: not a CPU build (want torch-${torch_pin#torch==}+cpu-*.whl)"
  python3 -m pip download --quiet --only-binary=:all: --find-links "${wheels}" --dest "${wheels}" \
    "${torch_pin}" "numpy==${standin_numpy}" "pip==${standin_pip}"

  # python-is-python3: `python`, as NGC has; procps: pgrep (run_and_time.sh forwards signals).
  say "debootstrap minbase bookworm from ${mirror} (the slow part: 2-4 minutes)"
  debootstrap --variant=minbase --include=python3,python-is-python3,procps bookworm "${rootfs}" "${mirror}" \
    > "${work}/debootstrap.log" 2>&1 || { tail -n 20 "${work}/debootstrap.log" >&2; exit 1; }

  say "pip, torch and numpy into the stand-in (its own pip, in a chroot)"
  cp "${wheels}"/*.whl "${rootfs}/tmp/"
  # Debian strips ensurepip; pip's wheel installs itself. NGC's pip installs into the system
  # Python (no PEP 668 marker), as does this one.
  rm -f "${rootfs}"/usr/lib/python3*/EXTERNALLY-MANAGED
  whl=("${wheels}"/pip-*.whl)
  pip_whl="/tmp/${whl[0]##*/}"
  chroot "${rootfs}" python3 "${pip_whl}/pip" install --quiet --no-cache-dir --no-index "${pip_whl}"
  chroot "${rootfs}" python3 -m pip install --quiet --no-cache-dir --no-index --find-links /tmp \
    "${torch_pin}" "numpy==${standin_numpy}"
  mkdir -p "${rootfs}/etc/pip"
  chroot "${rootfs}" python3 -m pip freeze > "${rootfs}/etc/pip/constraint.txt"
  grep -q '^numpy==' "${rootfs}/etc/pip/constraint.txt" || die "the stand-in's constraint file lacks numpy"
  install -D -m 0644 "${ca_bundle}" "${rootfs}/etc/ssl/certs/ca-certificates.crt"
  rm -rf "${rootfs}"/tmp/* "${rootfs}"/var/cache/apt/archives/*.deb "${rootfs}"/var/lib/apt/lists/* \
    "${rootfs}"/root/.cache
  mkdir -p "${rootfs}/workspace"

  mv "${rootfs}" "${dir}"  # whole or not at all
  rm -rf "${work}"
  trap - EXIT
}

mkdir -p "${cache}"
# One maker at a time per cache (two test sessions of one checkout).
exec 9> "${cache}/.lock"
flock 9
# Its name carries what it was made from: another script or torch pin, another directory.
key="$( (cat "${BASH_SOURCE[0]}"; echo "${torch_pin}") | sha256sum | cut -c1-16)"
rootfs="${cache}/rootfs-${key}"
if [[ -d "${rootfs}" ]]; then
  say "cached: ${rootfs}"
else
  rm -rf "${cache}"/rootfs-*
  make_rootfs "${rootfs}"
  say "made: ${rootfs}"
fi

say "docker import as ${tag}"
# What NGC's image config sets and we rely on; CMD as NGC's (a shell).
tar -C "${rootfs}" --numeric-owner -c . | docker import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LC_ALL=C.UTF-8' \
  --change 'ENV PIP_CONSTRAINT=/etc/pip/constraint.txt' \
  --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
  --change 'WORKDIR /workspace' \
  --change 'CMD ["/bin/bash"]' \
  - "${tag}" > /dev/null
say "${tag}: $(docker image inspect --format '{{.Size}}' "${tag}" | awk '{ printf "%.0f MB", $1 / 1e6 }')"
