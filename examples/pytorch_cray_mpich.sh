#!/usr/bin/env bash
# docs/reference/pytorch-cray-mpich.md: build the flavor on a Derecho build node, then install it. From the repository
# root, with CHANNEL the site channel: CHANNEL=/path/to/channel bash examples/pytorch_cray_mpich.sh
# needs: conda-forge, rattler-build, conda, cray-mpich
set -euo pipefail
: "${CHANNEL:?set CHANNEL to the site channel}"
rattler-build build -r recipes/pytorch-cray-mpich -m conda_build_config.yaml \
  -c "$CHANNEL" -c conda-forge/label/mpi-external -c conda-forge      # on a Derecho build node
conda install -c "$CHANNEL" -c conda-forge/label/mpi-external -c conda-forge pytorch-cray-mpich
