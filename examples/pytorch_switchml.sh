#!/usr/bin/env bash
# docs/reference/switchml.md: build the client into ./channel, then PyTorch 1.7.1 against it (rattler-build writes to
# ./output unless told), then install the rdma flavor for Derecho from the site channel "internal". From the
# repository root.
# needs: conda-forge, rattler-build, conda
set -euo pipefail
rattler-build build -r recipes/switchml-client -m conda_build_config.yaml --output-dir ./channel
rattler-build build -r recipes/pytorch-switchml -m conda_build_config.yaml -c ./channel -c conda-forge --output-dir ./channel
conda install -c internal "pytorch-switchml=*=switchml_rdma_*_derecho_*"     # strict channel priority
