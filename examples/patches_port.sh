#!/usr/bin/env bash
# docs/howto/newer-pytorch.md: port the cuda-aware-mpi series from PyTorch 2.6.0 to 2.7.1 and check the recipe's series
# against the 2.7.1 tree. From the repository root; SRC: a checkout of PyTorch v2.7.1 (cloned when absent).
# It writes patches/pytorch/2.7.1/cuda-aware-mpi/ (exit 1: a hunk needs a human, listed).
# needs: github
set -euo pipefail
SRC=${SRC:-$HOME/src/pytorch-v2.7.1}
[ -d "$SRC" ] || git clone --depth 1 --branch v2.7.1 https://github.com/pytorch/pytorch "$SRC"
channelsmith patches port pytorch/cuda-aware-mpi --from 2.6.0 --to 2.7.1 --source "$SRC"
channelsmith patches check pytorch-cray-mpich --version 2.7.1 --source "$SRC"
