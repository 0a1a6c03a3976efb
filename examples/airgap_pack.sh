#!/usr/bin/env bash
# Air gap, step 1 (docs/howto/air-gap.md): where the channel is reachable (a login node, a build node), deploy the
# environment and pack its lock into one file. Run it in the folder that will hold the bundle:
#   ENV=/path/to/new/env bash airgap_pack.sh pytorch-cray-mpich site-env-derecho -c conda-forge
# (the arguments are channelsmith deploy's specs and channel options). It writes env.tar and
# anchors/env.tar.sha256, and prints the sha256: carry the anchor APART from env.tar (step 2).
set -euo pipefail
: "${ENV:?set ENV to the prefix to deploy into}"
channelsmith deploy "$@" --prefix "$ENV"
channelsmith pack --lock "$ENV/channelsmith.lock" -o env.tar --anchor-dir anchors/
