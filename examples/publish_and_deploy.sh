#!/usr/bin/env bash
# Build, publish and deploy through a local channel (docs/deploy.md). Run it in an empty folder inside a
# checkout of this repository (channelsmith finds the recipes upwards from there); everything it writes
# stays in that folder: ./staging (a build's own channel), ./channel, and the prefixes ./env and ./env2.
set -euo pipefail
channelsmith build site-env --variant site=derecho --channel-dir ./staging  # stands in for a build elsewhere
channelsmith publish ./staging/noarch/site-env-derecho-1.0.0-*.conda   # into ./channel
channelsmith publish --check                     # repodata against files, sha256 included
channelsmith publish --reindex                   # rebuild repodata from the package files
channelsmith deploy site-env-derecho --prefix ./env                    # solve, install, lock
channelsmith deploy --lock ./env/channelsmith.lock --prefix ./env2     # same packages, no solve
