#!/usr/bin/env bash
# Build, publish and deploy through a local channel (docs/howto/deploy.md). Run it in an empty folder inside a
# checkout of this repository (channelsmith finds the recipes upwards from there); everything it writes
# stays in that folder: ./staging (a build's own channel), ./channel (moved to ./moved at the end), and the
# prefixes ./env, ./env2 and ./env3.
set -euo pipefail
channelsmith build site-env --variant site=derecho --channel-dir ./staging  # stands in for a build elsewhere
channelsmith publish ./staging/noarch/site-env-derecho-1.0.0-*.conda   # into ./channel
channelsmith publish --check                     # repodata against files, sha256 included
channelsmith publish --reindex                   # rebuild repodata from the package files
channelsmith deploy site-env-derecho --prefix ./env                    # solve, install, lock
channelsmith deploy --lock ./env/channelsmith.lock --prefix ./env2     # same packages, no solve
mv ./channel ./moved                             # the channel moves (or the lock goes to another machine)
channelsmith deploy --lock ./env/channelsmith.lock --prefix ./env3 --channel-map "$PWD/channel=$PWD/moved"
