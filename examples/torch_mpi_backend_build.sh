#!/usr/bin/env bash
# docs/howto/mpi-without-a-rebuild.md: build the backend for PyTorch 2.6.0 and Derecho's Cray MPICH, with rattler-build
# or with channelsmith (the same build). From the repository root.
# needs: conda-forge, rattler-build
set -euo pipefail
rattler-build build -r recipes/torch-mpi-backend -m conda_build_config.yaml \
  --variant pytorch_version=2.6.0 --variant site=derecho \
  -c conda-forge/label/mpi-external -c conda-forge      # CONDA_OVERRIDE_CUDA=12.6 on a node without a GPU
channelsmith build torch-mpi-backend --variant pytorch_version=2.6.0 --variant site=derecho \
  -c conda-forge/label/mpi-external -c conda-forge
