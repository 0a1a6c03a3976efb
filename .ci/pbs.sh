#!/usr/bin/env bash
# Prepare the one-node OpenPBS that tests/test_pbs.py runs its jobs on: build and install OpenPBS from
# the source tarball in the channelsmith cache (once per source hash; 2 minutes on 2 idle cores, 5-7 under load,
# installing the Debian packages it needs first), and start and stop it once, so the tests only start
# the daemons (seconds). Without a cached source it says so and does nothing:
# the PBS tests then skip and name what is missing.
#
#   eval "$(bash .ci/pbs.sh)"    prepare (idempotent); prints nothing on stdout today: the tests start
#                                their own server through scripts/pbs-local.sh, as the Slurm tests do
set -euo pipefail

cd "$(dirname "$0")/.."
cache="${CHANNELSMITH_CACHE:-${HOME}/.cache/channelsmith}"

if ! compgen -G "${cache}/src_cache/pbs/openpbs-*.tar.gz" >/dev/null; then
    printf '[pbs] no OpenPBS source in %s/src_cache/pbs: the PBS tests will skip (docs/records/pbs-one-node-cpu.md says how to add it)\n' "$cache" >&2
    exit 0
fi
# Everything for people goes to stderr; the build's own output is in its log (shown on failure).
nice bash scripts/pbs-local.sh build >&2
# One start and stop leaves pbs_habitat's PBS_HOME beside the install (15-20 s once), so the tests'
# own start takes seconds. Their run folder is another one; this one is gone after the stop.
prefix="$(bash scripts/pbs-local.sh installed)"
if [ ! -f "${prefix}/home-template.tar" ]; then
    run_dir="$(mktemp -d)"
    CHANNELSMITH_PBS_DIR="$run_dir" bash scripts/pbs-local.sh start >/dev/null
    CHANNELSMITH_PBS_DIR="$run_dir" bash scripts/pbs-local.sh stop
fi
