#!/usr/bin/env bash
# Installs what the test suite needs on a fresh Debian machine (run as root, or with sudo available).
# Only PyPI and Debian's archive are used; nothing else is reachable from CI.
set -euo pipefail

cd "$(dirname "$0")/.."

as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi
}

# ShellCheck for lint, MPICH (the MPI backend tests and the patch compile check), xz for Debian sources,
# zsh for one more activation-script case.
apt_packages=(shellcheck mpich libmpich-dev xz-utils dpkg-dev zsh)
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
sources_list=/etc/apt/sources.list.d/channelsmith-deb-src.sources
if ! grep -rqs "^Types: deb-src" /etc/apt/sources.list.d/ && [ ! -f "$sources_list" ]; then
  as_root tee "$sources_list" >/dev/null <<'SRC'
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: trixie
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
  as_root apt-get update -qq
fi

# The tooling itself, pytest, and a CPU PyTorch for the acceptance suite's gloo checks.
python3 -m pip install -q -e '.[test]' 'torch==2.13.0' matplotlib
