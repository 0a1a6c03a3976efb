#!/usr/bin/env bash
# Install the activation scripts of the nccl-ofi-plugin metapackage for plugin version PKG_VERSION.
set -euo pipefail

version="${PKG_VERSION:?the engine sets PKG_VERSION (the plugin version)}"
if [[ ! "$version" =~ ^([0-9]+)\.([0-9]+) ]]; then
    echo "nccl-ofi-plugin: cannot read a version from '${version}'" >&2
    exit 1
fi
release=$((BASH_REMATCH[1] * 1000 + BASH_REMATCH[2]))

# The network name the plugin registers: "AWS Libfabric" up to 1.12; "Libfabric" since 1.13.0
# (aws-ofi-nccl commit 7c014f0d), which still accepts "AWS Libfabric" and "OFI".
if ((release < 1013)); then
    net="AWS Libfabric"
else
    net="Libfabric"
fi
# Since 1.15.0 the plugin also installs libnccl-net-ofi.so, which NCCL_NET_PLUGIN=ofi selects by
# name (NCCL dlopens libnccl-net-<value>.so); older releases only have the default libnccl-net.so.
if ((release >= 1015)); then
    plugin_line="nccl_ofi_plugin_set NCCL_NET_PLUGIN ofi"
else
    plugin_line="# aws-ofi-nccl ${version} ships only libnccl-net.so, NCCL's default: NCCL_NET_PLUGIN stays as it is."
fi

mkdir -p "${PREFIX}/etc/conda/activate.d" "${PREFIX}/etc/conda/deactivate.d"
sed -e "s|@OFI_VERSION@|${version}|g" -e "s|@NCCL_NET@|${net}|g" \
    -e "s|^# @NCCL_NET_PLUGIN@\$|${plugin_line}|" \
    "${RECIPE_DIR}/activate.sh" >"${PREFIX}/etc/conda/activate.d/nccl-ofi-plugin.sh"
cp "${RECIPE_DIR}/deactivate.sh" "${PREFIX}/etc/conda/deactivate.d/nccl-ofi-plugin.sh"

# csh/tcsh and fish: conda sources activate.d/*.csh and *.fish in those shells. Each wrapper runs
# the POSIX script above with sh (CONDA_PREFIX is the environment while conda sources both
# directories) and applies the commands it prints, so every shell gets the same changes and records.
for change in activate deactivate; do
    script="\$CONDA_PREFIX/etc/conda/${change}.d/nccl-ofi-plugin.sh"
    printf '# nccl-ofi-plugin for csh/tcsh: nccl-ofi-plugin.sh beside this file makes the changes (see there).\n%s\n' \
        "eval \"\`env NCCL_OFI_PLUGIN_EMIT=csh sh ${script}\`\"" >"${PREFIX}/etc/conda/${change}.d/nccl-ofi-plugin.csh"
    printf '# nccl-ofi-plugin for fish: nccl-ofi-plugin.sh beside this file makes the changes (see there).\n%s\n' \
        "env NCCL_OFI_PLUGIN_EMIT=fish sh \"${script}\" | source" >"${PREFIX}/etc/conda/${change}.d/nccl-ofi-plugin.fish"
done
