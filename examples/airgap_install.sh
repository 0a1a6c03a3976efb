#!/usr/bin/env bash
# Air gap, step 3 (docs/howto/air-gap.md): on the compute node, with channelsmith installed (the route to take
# where it is), install the bundle, refused unless its sha256 is HEX, the one that came apart from it:
#   HEX=<sha256 pack printed> PREFIX=/scratch/$USER/env bash airgap_install.sh env.tar
# Then: . "$PREFIX/activate.sh". A refused bundle exits 2 and leaves no PREFIX.
set -euo pipefail
: "${HEX:?set HEX to the sha256 that came apart from the bundle}" "${PREFIX:?set PREFIX to a new prefix}"
channelsmith deploy --bundle "${1:-env.tar}" --sha256 "$HEX" --prefix "$PREFIX"
