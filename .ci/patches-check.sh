#!/usr/bin/env bash
# Check every patch series against the real upstream source this machine can obtain (Debian's source
# packages, the source cache) and print the table of what was verified and what was not.
# Called by .ci/run. Downloads go to $CHANNELSMITH_CACHE (default ~/.cache/channelsmith), outside the
# repository. Exit status: that of `channelsmith patches check` (1 when a patch failed, 2 on bad input).
# It also compiles the patched units (-fsyntax-only, about a minute); CHANNELSMITH_COMPILE_CHECK=0 skips that.
set -euo pipefail

cd "$(dirname "$0")/.."

# The Debian source index is what tells which PyTorch versions Debian serves; a fresh machine has none.
if [ -z "$(apt-cache showsrc pytorch 2>/dev/null)" ]; then
    echo "patches-check: Debian's source index is empty; running apt-get update"
    apt-get update -qq
fi

echo "== channelsmith patches check"
channelsmith patches check

if [ "${CHANNELSMITH_COMPILE_CHECK:-1}" = "1" ]; then
    echo "== channelsmith patches compile-check"
    channelsmith patches compile-check
fi
