#!/usr/bin/env bash
# Installs what the test suite needs on a fresh Debian machine (run as root, or with sudo available).
# Only PyPI and Debian's archive are used; nothing else is reachable from CI.
set -euo pipefail

cd "$(dirname "$0")/.."

as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi
}

# ShellCheck for lint; MPICH (the MPI backend tests, the patch compile check); xz and dpkg-dev for
# Debian's source packages; g++, ninja and patch for the torch-mpi-backend build; zsh for one more
# activation-script case; Slurm and munge for the one-node cluster the scheduler tests start
# (scripts/slurm-local.sh); unzip and zstd for the POSIX unpack.sh of air-gap bundles (a .conda is a zip of zstd tars).
apt_packages=(shellcheck mpich libmpich-dev xz-utils dpkg-dev g++ ninja-build patch zsh slurm-wlm munge unzip zstd)
missing=()
for pkg in "${apt_packages[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if [ "${#missing[@]}" -gt 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  as_root apt-get update -qq
  as_root apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# Debian's source packages (PyTorch 2.6.0 lives in trixie): patches are checked against real upstream source.
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
  as_root apt-get update -qq
fi

# The tooling itself, pytest, and a CPU PyTorch for the acceptance suite's gloo checks.
python3 -m pip install -q -e '.[test]' 'torch==2.13.0' matplotlib
