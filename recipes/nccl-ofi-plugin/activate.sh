# shellcheck shell=sh
# nccl-ofi-plugin: make NCCL use the aws-ofi-nccl @OFI_VERSION@ plugin of this environment.
#
# conda sources this file into the user's own shell (bash, zsh, dash), so it is POSIX sh, never
# `set -e`/`-u`, and safe under a user's `set -u`. Each variable it sets is listed in
# NCCL_OFI_PLUGIN_VARS, and its earlier value, when it had one (even an empty one), is kept in
# NCCL_OFI_PLUGIN_BACKUP_<NAME>; deactivate.d/nccl-ofi-plugin.sh puts them back.

# nccl_ofi_plugin_set NAME VALUE: export NAME=VALUE, recording NAME's state before its first change
# (a repeated activation keeps the first record).
nccl_ofi_plugin_set() {
    case " ${NCCL_OFI_PLUGIN_VARS:-} " in
        *" $1 "*) ;;
        *)
            if eval "[ -n \"\${$1+x}\" ]"; then
                eval "export NCCL_OFI_PLUGIN_BACKUP_$1=\"\${$1}\""
            fi
            NCCL_OFI_PLUGIN_VARS="${NCCL_OFI_PLUGIN_VARS:+$NCCL_OFI_PLUGIN_VARS }$1"
            export NCCL_OFI_PLUGIN_VARS
            ;;
    esac
    export "$1=$2"
}

# NCCL_NET names the network the plugin registers: NCCL then fails loudly instead of falling back
# to TCP sockets when the plugin or the fabric is unusable.
nccl_ofi_plugin_set NCCL_NET '@NCCL_NET@'
# @NCCL_NET_PLUGIN@

unset -f nccl_ofi_plugin_set
