#!/usr/bin/env bash
# docs/howto/verify.md: the acceptance suite on this node, 2 local ranks (the python on PATH has torch and
# torch_dist_check). On a CPU-only machine every check that needs a GPU or MPI is skipped, saying why.
set -euo pipefail
python -m torch_dist_check --nproc 2                           # 2 local ranks, every check, every backend found
python -m torch_dist_check --nproc 2 --backends gloo --quick   # what CI runs (CPU)
