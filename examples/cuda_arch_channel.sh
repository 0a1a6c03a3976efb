#!/usr/bin/env bash
# docs/howto/deploy.md, "GPU architecture on login nodes": this repository's cuda-arch in a channel of its own,
# listed after conda-forge, then a deploy from the site channel. From the repository root; CHANNEL (the
# site channel), ARCH_CHANNEL and PREFIX default to the docs' paths.
# needs: conda-forge
set -euo pipefail
CHANNEL=${CHANNEL:-/shared/channel} ARCH_CHANNEL=${ARCH_CHANNEL:-/shared/cuda-arch-channel} PREFIX=${PREFIX:-./env}
channelsmith build cuda-arch --channel-dir "$ARCH_CHANNEL"
channelsmith deploy pytorch site-env-derecho --prefix "$PREFIX" -c "$CHANNEL" -c conda-forge -c "$ARCH_CHANNEL"
