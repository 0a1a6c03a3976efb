#!/usr/bin/env bash
# docs/records/pbs-one-node-cpu.md, "Verification: PBS": OpenPBS's source at commit cd7ab5eda, as a tarball in the cache
# where scripts/pbs-local.sh build finds it. From a folder where ./openpbs is (or becomes) a clone.
# needs: github
set -euo pipefail
CACHE=${CHANNELSMITH_CACHE:-$HOME/.cache/channelsmith}
[ -d openpbs ] || git clone https://github.com/openpbs/openpbs
mkdir -p "$CACHE/src_cache/pbs"
git -C openpbs archive --format=tar.gz --prefix=openpbs-cd7ab5e/ \
    -o "$CACHE/src_cache/pbs/openpbs-cd7ab5e.tar.gz" cd7ab5eda
