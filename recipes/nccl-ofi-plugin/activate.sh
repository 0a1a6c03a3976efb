# shellcheck shell=sh
# nccl-ofi-plugin: make NCCL use the aws-ofi-nccl @OFI_VERSION@ plugin of this environment.
#
# conda sources this file into the user's own shell (bash, zsh, dash), so it is POSIX sh, never
# `set -e`/`-u`, and safe under a user's `set -u`. csh/tcsh and fish get the same changes: their
# activate.d wrappers run this file with sh and NCCL_OFI_PLUGIN_EMIT=csh or fish, and it prints
# each change as a command of that shell.
#
# Records are kept per activation level (CONDA_SHLVL: the level being activated while conda or
# mamba source activate.d, the level being left while they source deactivate.d; 0 outside
# conda): each variable this level sets is listed in NCCL_OFI_PLUGIN_VARS_<level>, and its earlier
# value, when it had one (even an empty one), kept in NCCL_OFI_PLUGIN_BACKUP_<level>_<NAME>;
# deactivate.d/nccl-ofi-plugin.sh puts them back and clears only that level's record, so a
# stacked environment leaves the one below it as it found it.
case "${CONDA_SHLVL:-}" in
    '' | *[!0-9]*) nccl_ofi_plugin_level=0 ;;
    *) nccl_ofi_plugin_level="$CONDA_SHLVL" ;;
esac

# nccl_ofi_plugin_put NAME VALUE: export NAME=VALUE, and print the same change for the shell named
# in NCCL_OFI_PLUGIN_EMIT (the value quoted for that shell).
nccl_ofi_plugin_put() {
    export "$1=$2"
    case "${NCCL_OFI_PLUGIN_EMIT:-}" in
        csh) printf "setenv %s '%s';\n" "$1" "$(printf '%s' "$2" | sed -e "s/'/'\\\\''/g" -e 's/!/\\!/g')" ;;
        fish) printf "set -gx %s '%s';\n" "$1" "$(printf '%s' "$2" | sed "s/[\\\\']/\\\\&/g")" ;;
    esac
}

# nccl_ofi_plugin_set NAME VALUE: export NAME=VALUE, recording NAME's state before this level
# first changes it (a repeated activation keeps the first record).
nccl_ofi_plugin_set() {
    nccl_ofi_plugin_vars=""
    eval "nccl_ofi_plugin_vars=\"\${NCCL_OFI_PLUGIN_VARS_${nccl_ofi_plugin_level}:-}\""
    case " $nccl_ofi_plugin_vars " in
        *" $1 "*) ;;
        *)
            if eval "[ -n \"\${$1+x}\" ]"; then
                eval "nccl_ofi_plugin_put NCCL_OFI_PLUGIN_BACKUP_${nccl_ofi_plugin_level}_$1 \"\${$1}\""
            fi
            nccl_ofi_plugin_put "NCCL_OFI_PLUGIN_VARS_${nccl_ofi_plugin_level}" \
                "${nccl_ofi_plugin_vars:+$nccl_ofi_plugin_vars }$1"
            ;;
    esac
    nccl_ofi_plugin_put "$1" "$2"
}

# NCCL_NET names the network the plugin registers: NCCL then fails loudly instead of falling back
# to TCP sockets when the plugin or the fabric is unusable.
nccl_ofi_plugin_set NCCL_NET '@NCCL_NET@'
# @NCCL_NET_PLUGIN@

unset -f nccl_ofi_plugin_put nccl_ofi_plugin_set
unset nccl_ofi_plugin_level nccl_ofi_plugin_vars
