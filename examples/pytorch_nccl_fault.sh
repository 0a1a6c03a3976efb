#!/usr/bin/env bash
# docs/reference/pytorch-nccl-fault.md: build the flavor, then install it. From the repository root, with CHANNEL the
# site channel: CHANNEL=/path/to/channel bash examples/pytorch_nccl_fault.sh
# needs: conda-forge, rattler-build, conda
set -euo pipefail
: "${CHANNEL:?set CHANNEL to the site channel}"
rattler-build build -r recipes/pytorch-nccl-fault -m conda_build_config.yaml -c "$CHANNEL" -c conda-forge
conda install -c "$CHANNEL" pytorch-nccl-fault          # selects pytorch * *_ncclft_*
