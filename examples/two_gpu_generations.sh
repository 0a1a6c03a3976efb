#!/usr/bin/env bash
# docs/howto/deploy.md, "Two GPU generations in one cluster": one environment for an A100 partition (8.0) and an
# H100 partition (9.0), deployed from a login node. Solved for the lower capability, with builds that carry
# code for both (the generic site's sm_80 + sm_90 SASS and PTX: cuda-arch >=8.0), and the driver both
# partitions run. From the repository root; CHANNELS (the -c options, in priority order) and PREFIX default
# to the docs' paths.
# needs: conda-forge
set -euo pipefail
read -r -a channels <<< "${CHANNELS:--c /shared/channel -c conda-forge -c /shared/cuda-arch-channel}"
PREFIX=${PREFIX:-/shared/envs/pytorch}
channelsmith deploy pytorch site-env-generic --cuda-arch 8.0 --cuda-driver 12.4 --prefix "$PREFIX" "${channels[@]}"
