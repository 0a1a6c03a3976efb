# shellcheck shell=bash
# nccl_gencode ARCH_LIST: NCCL's NVCC_GENCODE for a site's cuda_arch_list.
#
# ARCH_LIST uses TORCH_CUDA_ARCH_LIST's syntax (the shared matrix feeds both from one key):
# entries like 8.0, 9.0 or 9.0a separated by ';', ',' or spaces; a "+PTX" suffix also embeds
# that architecture's PTX. "8.0;9.0+PTX" gives
#   -gencode=arch=compute_80,code=sm_80 -gencode=arch=compute_90,code=sm_90
#   -gencode=arch=compute_90,code=compute_90
# Each architecture costs compile time and package size, so an empty or malformed list is an
# error instead of falling back to NCCL's all-architecture default.
nccl_gencode() {
    local list="${1:-}" entry arch ptx flags=()
    list="${list//[;,]/ }"
    for entry in $list; do
        ptx=0
        if [[ "$entry" == *+PTX ]]; then
            ptx=1
            entry="${entry%+PTX}"
        fi
        if [[ ! "$entry" =~ ^[0-9]+\.[0-9][af]?$ ]]; then
            echo "nccl_gencode: '$entry' is not a CUDA architecture like 8.0 or 9.0a" >&2
            return 1
        fi
        arch="${entry/./}"
        flags+=("-gencode=arch=compute_${arch},code=sm_${arch}")
        if ((ptx)); then
            flags+=("-gencode=arch=compute_${arch},code=compute_${arch}")
        fi
    done
    if ((${#flags[@]} == 0)); then
        echo "nccl_gencode: the site's cuda_arch_list is empty" >&2
        return 1
    fi
    printf '%s\n' "${flags[*]}"
}
