# shellcheck shell=sh
# pytorch-nccl-fault: defaults that let a job survive a dead NCCL peer and use its GPU again within
# seconds (docs/explain/nccl-fault-tolerance.md). A value the user already set, under the current or the legacy
# name, wins; deactivate.d/pytorch-nccl-fault.sh unsets exactly what this script set.
#
# POSIX sh, sourced into the user's shell; csh/tcsh and fish wrappers run it with sh and
# _PYTORCH_NCCLFT_EMIT=csh or fish, and it prints each change as a command of that shell. What
# it set is listed per activation level (CONDA_SHLVL, 0 outside conda) in
# _PYTORCH_NCCLFT_SET_<level>, so leaving a stacked environment unsets only what that level set.
case "${CONDA_SHLVL:-}" in
    '' | *[!0-9]*) _pytorch_ncclft_level=0 ;;
    *) _pytorch_ncclft_level="$CONDA_SHLVL" ;;
esac

# _pytorch_ncclft_put NAME VALUE: export NAME=VALUE, and print the same change for the shell named
# in _PYTORCH_NCCLFT_EMIT (the value quoted for that shell).
_pytorch_ncclft_put() {
    export "$1=$2"
    case "${_PYTORCH_NCCLFT_EMIT:-}" in
        csh) printf "setenv %s '%s';\n" "$1" "$(printf '%s' "$2" | sed -e "s/'/'\\\\''/g" -e 's/!/\\!/g')" ;;
        fish) printf "set -gx %s '%s';\n" "$1" "$(printf '%s' "$2" | sed "s/[\\\\']/\\\\&/g")" ;;
    esac
}

_pytorch_ncclft_default() {
    # $1: variable, $2: value, $3: legacy name that also counts as "set by the user" (may be empty)
    if eval "[ -n \"\${$1+x}\" ]" || { [ -n "$3" ] && eval "[ -n \"\${$3+x}\" ]"; }; then
        return 0
    fi
    _pytorch_ncclft_put "$1" "$2"
    _pytorch_ncclft_set=""
    eval "_pytorch_ncclft_set=\"\${_PYTORCH_NCCLFT_SET_${_pytorch_ncclft_level}:-}\""
    _pytorch_ncclft_put "_PYTORCH_NCCLFT_SET_${_pytorch_ncclft_level}" "${_pytorch_ncclft_set:+$_pytorch_ncclft_set }$1"
}

# CleanUpOnly: the watchdog aborts the failed communicators and the error is raised in Python; the
# upstream default (3, SkipCleanUp) takes the whole process down instead.
_pytorch_ncclft_default TORCH_NCCL_ASYNC_ERROR_HANDLING 2 NCCL_ASYNC_ERROR_HANDLING
# The watchdog sleeps 4 x TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC (60 s by default) before it aborts the
# communicator, whether or not a dump is taken: 0 removes that wait (measured: GPU usable after 72 s -> ~12 s).
_pytorch_ncclft_default TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC 0 ""
# No flight recorder: symbolizing its stack traces delays the abort by up to 8 s more (measured: ~12 s -> 2.4-5.3 s).
_pytorch_ncclft_default TORCH_NCCL_TRACE_BUFFER_SIZE 0 ""
# Fallback for a dead peer inside one node: with NCCL's cuMem buffers the survivor's CUDA context was
# lost after the abort in 9 of 11 runs, with 0 it stayed usable in 7 of 7 (2 x H200, NCCL 2.28.9).
# Its cost in bandwidth and memory is not measured yet (needs 2 GPUs).
_pytorch_ncclft_default NCCL_CUMEM_ENABLE 0 ""
# The peer watcher (package torch-peer-watcher, PyTorch >= 2.6): every process group is watched, a
# dead or stuck peer aborts the groups that contain it. TORCH_PEER_WATCHER=0 turns it off. Its links
# authenticate with TORCH_PEER_WATCHER_SECRET (or _SECRET_FILE), which the job script exports once for all
# ranks; activation cannot make it (each node would make its own). Without it the watcher warns
# (docs/explain/peer-watcher.md, "Security").
_pytorch_ncclft_default TORCH_PEER_WATCHER 1 ""
# PyTorch 2.15.0 resolves "nccl" to the torchcomms-based c10d::nccl2 backend, which this flavor's patches do
# not touch; 0 keeps "nccl" on the legacy ProcessGroupNCCL, the one patched (docs/explain/peer-watcher.md,
# "Which backend 2.15.0 runs"). Older releases ignore the variable (2.14.1's default is legacy already).
_pytorch_ncclft_default TORCH_DIST_USE_NCCL2 0 ""

unset -f _pytorch_ncclft_put _pytorch_ncclft_default
unset _pytorch_ncclft_level _pytorch_ncclft_set
