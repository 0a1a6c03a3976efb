#!/usr/bin/env bash
# docs/howto/verify.md, "A prefix without conda-forge": a virtual environment whose python imports torch is a
# prefix `channelsmith verify` takes, as a batch job too. Run from a checkout whose .venv has torch
# (scripts/install-test-deps.sh makes it: torch 2.15.0), the local Slurm started
# (eval "$(bash scripts/slurm-local.sh start)"); or pass your own virtual environment as $1.
set -euo pipefail
prefix="${1:-$PWD/.venv}"
channelsmith verify --scheduler slurm --prefix "$prefix" --backends gloo --time 00:10:00 \
    --run-dir "${TMPDIR:-/tmp}/verify-venv" -- --quick --checks env,correctness
