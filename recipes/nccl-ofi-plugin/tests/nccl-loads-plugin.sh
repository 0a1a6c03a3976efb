#!/usr/bin/env bash
# With a GPU: NCCL initialises a communicator and its NCCL_DEBUG=INFO log shows the aws-ofi-nccl
# plugin loaded ("NET/OFI" lines, the plugin's own). Without a GPU this test cannot run and says why.
set -euo pipefail

if ! nvidia-smi -L >/dev/null 2>&1; then
    echo "nccl-loads-plugin: skipped: no NVIDIA GPU visible (nvidia-smi -L failed); run on a GPU node"
    exit 0
fi
# The engine may run tests without conda's activation: apply ours explicitly.
if [[ -z "${NCCL_NET:-}" ]]; then
    # shellcheck source=/dev/null
    source "${PREFIX}/etc/conda/activate.d/nccl-ofi-plugin.sh"
fi

log="$(mktemp)"
status=0
LD_LIBRARY_PATH="${PREFIX}/lib${LD_LIBRARY_PATH:+:${LD_LIBRARY_PATH}}" NCCL_DEBUG=INFO \
    python tests/nccl_init.py >"$log" 2>&1 || status=$?
cat "$log"
if ! grep -q "NET/OFI" "$log"; then
    echo "nccl-loads-plugin: NCCL did not load the OFI plugin (no NET/OFI line above)" >&2
    exit 1
fi
# One GPU and no peer: NCCL may still refuse the forced network when no libfabric provider is
# usable here; loading the plugin is what this test proves.
echo "nccl-loads-plugin: NCCL loaded the OFI plugin (NCCL_NET=${NCCL_NET}, init exit status ${status})"
