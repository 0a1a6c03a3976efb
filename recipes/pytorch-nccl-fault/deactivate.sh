# shellcheck shell=sh
# pytorch-nccl-fault: unset the defaults activate.d/pytorch-nccl-fault.sh set at this activation level
# (and only those: a variable the user had set was never touched, and a lower, stacked level keeps
# its own), restoring the environment as it was. Run with sh by the csh and fish wrappers, with
# _PYTORCH_NCCLFT_EMIT saying which shell's commands to print.
case "${CONDA_SHLVL:-}" in
    '' | *[!0-9]*) _pytorch_ncclft_level=0 ;;
    *) _pytorch_ncclft_level="$CONDA_SHLVL" ;;
esac
_pytorch_ncclft_set=""
eval "_pytorch_ncclft_set=\"\${_PYTORCH_NCCLFT_SET_${_pytorch_ncclft_level}:-}\""
# The list is split by hand, one name at a time: zsh (where users source this too) does not split an
# unquoted $var into words, so `for name in $list` would see the whole list as one name.
_pytorch_ncclft_rest="${_pytorch_ncclft_set:+$_pytorch_ncclft_set }_PYTORCH_NCCLFT_SET_${_pytorch_ncclft_level}"
while [ -n "$_pytorch_ncclft_rest" ]; do
    _pytorch_ncclft_var="${_pytorch_ncclft_rest%% *}"
    case "$_pytorch_ncclft_rest" in
        *" "*) _pytorch_ncclft_rest="${_pytorch_ncclft_rest#* }" ;;
        *) _pytorch_ncclft_rest="" ;;
    esac
    if eval "[ -n \"\${${_pytorch_ncclft_var}+x}\" ]"; then
        unset "$_pytorch_ncclft_var"
        case "${_PYTORCH_NCCLFT_EMIT:-}" in
            csh) printf 'unsetenv %s;\n' "$_pytorch_ncclft_var" ;;
            fish) printf 'set -e %s;\n' "$_pytorch_ncclft_var" ;;
        esac
    fi
done
unset _pytorch_ncclft_level _pytorch_ncclft_set _pytorch_ncclft_rest _pytorch_ncclft_var
