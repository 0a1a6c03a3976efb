#!/usr/bin/env bash
# docs/howto/verify.md, "Plug-in backends": the acceptance suite over the cudampi backend (torch-mpi-backend) on
# 2 ranks of this node under mpiexec; the report goes to ./cudampi.json. The python on PATH has torch,
# torch_mpi_backend and torch_dist_check.
# needs: mpiexec
set -euo pipefail
mpiexec -n 2 python -m torch_dist_check --import torch_mpi_backend --plugin cudampi:launch=mpi \
    --backends cudampi --checks correctness,bandwidth --quick --json cudampi.json
