# shellcheck shell=sh
# nccl-ofi-plugin: undo activate.d/nccl-ofi-plugin.sh exactly.
#
# Sourced into the user's shell like the activation script (POSIX sh, no `set -e`/`-u`). Each
# variable listed in NCCL_OFI_PLUGIN_VARS gets back the value saved in
# NCCL_OFI_PLUGIN_BACKUP_<NAME> (also when that value was empty), or is unset when it had none.

nccl_ofi_plugin_rest="${NCCL_OFI_PLUGIN_VARS:-}"
while [ -n "$nccl_ofi_plugin_rest" ]; do
    nccl_ofi_plugin_name="${nccl_ofi_plugin_rest%% *}"
    case "$nccl_ofi_plugin_rest" in
        *" "*) nccl_ofi_plugin_rest="${nccl_ofi_plugin_rest#* }" ;;
        *) nccl_ofi_plugin_rest="" ;;
    esac
    if eval "[ -n \"\${NCCL_OFI_PLUGIN_BACKUP_${nccl_ofi_plugin_name}+x}\" ]"; then
        eval "export ${nccl_ofi_plugin_name}=\"\${NCCL_OFI_PLUGIN_BACKUP_${nccl_ofi_plugin_name}}\""
        unset "NCCL_OFI_PLUGIN_BACKUP_${nccl_ofi_plugin_name}"
    else
        unset "${nccl_ofi_plugin_name}"
    fi
done
unset NCCL_OFI_PLUGIN_VARS nccl_ofi_plugin_rest nccl_ofi_plugin_name
