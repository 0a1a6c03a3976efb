#!/usr/bin/env bash
# docs/howto/verify.md: channelsmith verify of a deployed pytorch-nccl-fault environment: the suite with that
# prefix's python, and NCCL loaded from inside the prefix. PREFIX: the environment (default /opt/envs/torch-ncclft).
# needs: gpus
set -euo pipefail
PREFIX=${PREFIX:-/opt/envs/torch-ncclft}
channelsmith verify --prefix "$PREFIX" -- --expect-nccl-under "$PREFIX"
