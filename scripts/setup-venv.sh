#!/usr/bin/env bash
# Create the virtual environment the tooling runs in (default ./.venv) and install channelsmith into it.
# Debian and Ubuntu refuse `pip install` into the system Python (PEP 668), and their python3 has no
# venv module until the python3-venv package is there: this installs it first when it is missing
# (as root, or with sudo).
#
#   bash scripts/setup-venv.sh [VENV]   then: . VENV/bin/activate
set -euo pipefail

cd "$(dirname "$0")/.."
venv="${1:-.venv}"

as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi
}

if [ ! -x "${venv}/bin/python" ] && ! python3 -m venv "$venv" 2>/dev/null; then
  rm -rf "$venv"
  if ! command -v apt-get >/dev/null; then
    echo "setup-venv: python3 -m venv failed; install your distribution's venv package (python3-venv)" >&2
    exit 2
  fi
  echo "setup-venv: installing python3-venv (python3 -m venv needs it on Debian and Ubuntu)" >&2
  export DEBIAN_FRONTEND=noninteractive
  as_root apt-get update -qq
  as_root apt-get install -y -qq --no-install-recommends python3-venv >&2
  python3 -m venv "$venv"
fi
"${venv}/bin/python" -m pip install -q -e . >&2
echo "setup-venv: channelsmith is installed in ${venv}; activate it with: . ${venv}/bin/activate" >&2
