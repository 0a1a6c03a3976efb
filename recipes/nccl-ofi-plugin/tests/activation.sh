#!/usr/bin/env bash
# The installed activation script sets NCCL_NET (and NCCL_NET_PLUGIN from 1.15) for plugin
# OFI_VERSION; the deactivation script restores set, empty and unset variables exactly.
set -euo pipefail

activate="${PREFIX}/etc/conda/activate.d/nccl-ofi-plugin.sh"
deactivate="${PREFIX}/etc/conda/deactivate.d/nccl-ofi-plugin.sh"
version="${OFI_VERSION:?recipe.yaml sets OFI_VERSION}"
[[ "$version" =~ ^([0-9]+)\.([0-9]+) ]]
release=$((BASH_REMATCH[1] * 1000 + BASH_REMATCH[2]))
if ((release < 1013)); then want_net="AWS Libfabric"; else want_net="Libfabric"; fi

fail() {
    echo "activation: $*" >&2
    exit 1
}

# A prior NCCL_NET, an empty NCCL_NET_PLUGIN: both must come back as they were.
export NCCL_NET=Socket NCCL_NET_PLUGIN=""
# shellcheck source=/dev/null
source "$activate"
[[ "$NCCL_NET" == "$want_net" ]] || fail "NCCL_NET='$NCCL_NET', expected '$want_net' for $version"
if ((release >= 1015)); then
    [[ "$NCCL_NET_PLUGIN" == ofi ]] || fail "NCCL_NET_PLUGIN='$NCCL_NET_PLUGIN', expected 'ofi'"
else
    [[ -z "$NCCL_NET_PLUGIN" ]] || fail "NCCL_NET_PLUGIN changed to '$NCCL_NET_PLUGIN' for $version"
fi
# shellcheck source=/dev/null
source "$deactivate"
[[ "$NCCL_NET" == Socket ]] || fail "NCCL_NET not restored: '$NCCL_NET'"
[[ -n "${NCCL_NET_PLUGIN+x}" && -z "$NCCL_NET_PLUGIN" ]] || fail "empty NCCL_NET_PLUGIN not restored"

# Unset before activation: unset after deactivation, also after activating twice.
unset NCCL_NET NCCL_NET_PLUGIN
# shellcheck source=/dev/null
source "$activate"
# shellcheck source=/dev/null
source "$activate"
# shellcheck source=/dev/null
source "$deactivate"
[[ -z "${NCCL_NET+x}" && -z "${NCCL_NET_PLUGIN+x}" ]] || fail "variables left set after deactivation"
env | grep -q '^NCCL_OFI_PLUGIN_' && fail "bookkeeping variables left behind"
echo "activation: aws-ofi-nccl ${version} sets NCCL_NET='${want_net}' and restores on deactivation"
