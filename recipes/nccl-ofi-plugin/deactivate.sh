# shellcheck shell=sh
# The helpers are called through eval, which shellcheck cannot follow.
# shellcheck disable=SC2317
# nccl-ofi-plugin: undo activate.d/nccl-ofi-plugin.sh exactly, for this activation level only.
#
# Sourced into the user's shell like the activation script (POSIX sh, no `set -e`/`-u`); run with
# sh by the csh and fish wrappers, with NCCL_OFI_PLUGIN_EMIT saying which shell's commands to
# print. Each variable listed in NCCL_OFI_PLUGIN_VARS_<level> (level: CONDA_SHLVL, 0 outside
# conda) gets back the value saved in NCCL_OFI_PLUGIN_BACKUP_<level>_<NAME> (also when that value
# was empty), or is unset when it had none; the records of lower levels stay as they are.
case "${CONDA_SHLVL:-}" in
    '' | *[!0-9]*) nccl_ofi_plugin_level=0 ;;
    *) nccl_ofi_plugin_level="$CONDA_SHLVL" ;;
esac

nccl_ofi_plugin_put() {
    export "$1=$2"
    case "${NCCL_OFI_PLUGIN_EMIT:-}" in
        csh) printf "setenv %s '%s';\n" "$1" "$(printf '%s' "$2" | sed -e "s/'/'\\\\''/g" -e 's/!/\\!/g')" ;;
        fish) printf "set -gx %s '%s';\n" "$1" "$(printf '%s' "$2" | sed "s/[\\\\']/\\\\&/g")" ;;
    esac
}
nccl_ofi_plugin_drop() {
    unset "$1"
    case "${NCCL_OFI_PLUGIN_EMIT:-}" in
        csh) printf 'unsetenv %s;\n' "$1" ;;
        fish) printf 'set -e %s;\n' "$1" ;;
    esac
}

eval "nccl_ofi_plugin_rest=\"\${NCCL_OFI_PLUGIN_VARS_${nccl_ofi_plugin_level}:-}\""
while [ -n "$nccl_ofi_plugin_rest" ]; do
    nccl_ofi_plugin_name="${nccl_ofi_plugin_rest%% *}"
    case "$nccl_ofi_plugin_rest" in
        *" "*) nccl_ofi_plugin_rest="${nccl_ofi_plugin_rest#* }" ;;
        *) nccl_ofi_plugin_rest="" ;;
    esac
    nccl_ofi_plugin_backup="NCCL_OFI_PLUGIN_BACKUP_${nccl_ofi_plugin_level}_${nccl_ofi_plugin_name}"
    if eval "[ -n \"\${${nccl_ofi_plugin_backup}+x}\" ]"; then
        eval "nccl_ofi_plugin_put \"\$nccl_ofi_plugin_name\" \"\${${nccl_ofi_plugin_backup}}\""
        nccl_ofi_plugin_drop "$nccl_ofi_plugin_backup"
    else
        nccl_ofi_plugin_drop "$nccl_ofi_plugin_name"
    fi
done
if eval "[ -n \"\${NCCL_OFI_PLUGIN_VARS_${nccl_ofi_plugin_level}+x}\" ]"; then
    nccl_ofi_plugin_drop "NCCL_OFI_PLUGIN_VARS_${nccl_ofi_plugin_level}"
fi
unset -f nccl_ofi_plugin_put nccl_ofi_plugin_drop
unset nccl_ofi_plugin_level nccl_ofi_plugin_rest nccl_ofi_plugin_name nccl_ofi_plugin_backup
