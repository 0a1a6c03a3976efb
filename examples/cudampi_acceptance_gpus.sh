#!/usr/bin/env bash
# docs/howto/mpi-without-a-rebuild.md: the acceptance suite on a site after `conda install torch-mpi-backend`: 8 ranks,
# 4 per node (Cray PALS's or MPICH's mpiexec, in a job over 2 GPU nodes), cudampi and NCCL side by side;
# the report goes to ./cudampi.json.
# needs: mpiexec, gpus
set -euo pipefail
mpiexec -n 8 -ppn 4 python -m torch_dist_check --import torch_mpi_backend --plugin cudampi:launch=mpi \
    --backends cudampi,nccl --checks correctness,bandwidth --json cudampi.json
