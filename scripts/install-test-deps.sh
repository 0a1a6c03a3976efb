#!/usr/bin/env bash
# Installs what the test suite needs on a fresh Debian machine (run as root, or with sudo available).
# Only PyPI and Debian's archive are used; nothing else is reachable from CI.
#
# The tests run on the current PyTorch release, 2.15.0: PyPI's CUDA build (PyPI has no CPU build of
# 2.15.0 for x86_64), which also runs the CPU tests.
# CHANNELSMITH_TEST_TORCH=VERSION installs another release instead, e.g. for a fast local loop on a CPU
# build already on disk: CHANNELSMITH_TEST_TORCH=2.13.0 with a pip whose find-links hold
# torch-2.13.0+cpu (pip prefers the +cpu wheel to PyPI's 2.13.0). A value that is not a release
# (digits and dots, an optional +local label) is refused with exit 2 before anything is installed.
set -euo pipefail

torch_version="${CHANNELSMITH_TEST_TORCH:-2.15.0}"
if ! [[ "$torch_version" =~ ^[0-9]+(\.[0-9]+)+(\+[A-Za-z0-9.]+)?$ ]]; then
  echo "install-test-deps: CHANNELSMITH_TEST_TORCH='$torch_version' is not a PyTorch release: give one such as 2.15.0 or 2.13.0+cpu, or unset it for 2.15.0" >&2
  exit 2
fi

cd "$(dirname "$0")/.."

as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi
}

# One line per stage on stderr, with the seconds so far: apt and pip can take a minute between them.
stage_count=3
stage_number=0
stage() {
  stage_number=$((stage_number + 1))
  echo "install-test-deps: [$stage_number/$stage_count] $* (at ${SECONDS} s)" >&2
}
# On a terminal apt and pip draw their own progress; in a log (CI) only the stage lines and errors.
if [ -t 2 ]; then
  apt_quiet=()
  pip_quiet=()
else
  apt_quiet=(-qq)
  pip_quiet=(-q)
fi

# ShellCheck for lint; MPICH (the MPI backend tests, the patch compile check); xz and dpkg-dev for
# Debian's source packages; g++, ninja and patch for the torch-mpi-backend build; zsh for one more
# activation-script case; tcsh and fish for the csh and fish activation wrappers; Slurm and munge
# for the one-node cluster the scheduler tests start (scripts/slurm-local.sh); unzip and zstd for the
# POSIX unpack.sh of air-gap bundles (a .conda is a zip of zstd tars); iproute2 (ip, tc) for the
# namespace nodes of torch_dist_check --nodes (unshare, nsenter and setpriv come with util-linux);
# nftables for their lossy link where the kernel has no netem (loss alone).
apt_packages=(shellcheck mpich libmpich-dev xz-utils dpkg-dev g++ ninja-build patch zsh tcsh fish slurm-wlm munge unzip zstd iproute2 nftables)
missing=()
for pkg in "${apt_packages[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if [ "${#missing[@]}" -gt 0 ]; then
  stage "Debian packages: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  as_root apt-get update "${apt_quiet[@]}"
  as_root apt-get install -y "${apt_quiet[@]}" --no-install-recommends "${missing[@]}"
else
  stage "Debian packages: all ${#apt_packages[@]} installed"
fi

# Debian's source packages (PyTorch 2.6.0 lives in trixie): patches are checked against real upstream source.
stage "Debian source index (trixie, for PyTorch 2.6.0's source package)"
if ! grep -rqsE '^(Suites:.*\btrixie\b|deb-src .* trixie )' /etc/apt/sources.list.d/ /etc/apt/sources.list; then
  # The mirror this machine already uses (sites have their own; the repository names none).
  if ! archive="${CHANNELSMITH_DEBIAN_MIRROR:-$(bash scripts/debian-archive-uri.sh)}"; then
    echo "install-test-deps: set CHANNELSMITH_DEBIAN_MIRROR to your Debian mirror's URI (the one holding dists/trixie)" >&2
    exit 2
  fi
  printf 'Types: deb-src\nURIs: %s\nSuites: trixie\nComponents: main\nSigned-By: %s\n' \
    "$archive" /usr/share/keyrings/debian-archive-keyring.gpg |
    as_root tee /etc/apt/sources.list.d/channelsmith-trixie-src.sources >/dev/null
fi
# A fresh machine has no source index yet: that index is what `apt-get source` reads.
if [ -z "$(apt-cache showsrc pytorch 2>/dev/null)" ]; then
  as_root apt-get update "${apt_quiet[@]}"
fi

# The tooling itself, pytest, and PyTorch (2.15.0 unless CHANNELSMITH_TEST_TORCH says otherwise) for the acceptance
# suite's gloo checks: whichever build pip picks (PyPI's is the CUDA build, with its nvidia-* wheels; a site's pip or
# find-links may serve a CPU one); the tests take either.
python="$(command -v python3)"
if ! python3 -m pip --version >/dev/null 2>&1; then
  echo "install-test-deps: $python has no pip; run in the virtual environment: bash scripts/setup-venv.sh && . .venv/bin/activate" >&2
  exit 2
fi
stage "Python packages with torch==$torch_version into $(python3 -c 'import sys; print(sys.prefix)') with pip (the first time: PyPI's CUDA build of 2.15.0 is about 3.1 GB to download with its nvidia-* wheels and triton, 5.7 GB installed; a CPU wheel about 200 MB)"
python3 -m pip install "${pip_quiet[@]}" -e '.[test]' "torch==$torch_version" matplotlib
echo "install-test-deps: done in ${SECONDS} s" >&2
