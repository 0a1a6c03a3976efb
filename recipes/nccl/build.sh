#!/usr/bin/env bash
# Build NCCL for the site's GPU architectures only and install the shared library and headers.
set -euo pipefail

# shellcheck source=recipes/nccl/gencode.sh
source "${RECIPE_DIR}/gencode.sh"

# One -gencode per architecture of the site: NCCL's default covers every architecture since
# sm_50 and multiplies compile time and package size.
gencode="$(nccl_gencode "${NCCL_CUDA_ARCH_LIST:?recipe.yaml sets it from the cuda_arch_list variant}")"
echo "nccl: NVCC_GENCODE=${gencode}"

# conda's CUDA compiler (cuda-nvcc) keeps nvcc in $BUILD_PREFIX/bin and the runtime headers and
# libraries under targets/<triple>, not in the include/ and lib64/ NCCL's Makefile assumes; a
# system toolkit (CUDA_HOME, e.g. /usr/local/cuda) has the standard layout.
if [[ -x "${BUILD_PREFIX}/bin/nvcc" ]]; then
    case "${target_platform:-linux-64}" in
        linux-64) triple=x86_64-linux ;;
        linux-aarch64) triple=sbsa-linux ;;
        *) echo "nccl: unsupported target_platform ${target_platform}" >&2; exit 1 ;;
    esac
    cuda_home="${BUILD_PREFIX}"
    cuda_inc="${BUILD_PREFIX}/targets/${triple}/include"
    cuda_lib="${BUILD_PREFIX}/targets/${triple}/lib"
else
    cuda_home="${CUDA_HOME:?no nvcc in BUILD_PREFIX: set CUDA_HOME to a CUDA toolkit}"
    cuda_inc="${cuda_home}/include"
    cuda_lib="${cuda_home}/lib64"
fi

# The static library's rule calls a bare `ar`. conda's toolchain names its archiver in $AR
# (x86_64-conda-linux-gnu-ar), and a build host may have another `ar` on PATH: whenever $AR is
# set, `ar` is $AR, so the archive is made by the toolchain that compiled its objects
# (conda-forge's nccl-feedstock patches the Makefile for the same reason).
if [[ -n "${AR:-}" ]]; then
    if ! ar_program="$(command -v "$AR")"; then
        echo "nccl: AR='${AR}' names no program on PATH" >&2
        exit 1
    fi
    shim="${SRC_DIR}/.nccl-tools"
    mkdir -p "$shim"
    ln -sf "$ar_program" "${shim}/ar"
    export PATH="${shim}:${PATH}"
elif ! command -v ar >/dev/null; then
    echo "nccl: no ar on PATH and AR is not set" >&2
    exit 1
fi

make_args=(
    CUDA_HOME="${cuda_home}"
    CUDA_INC="${cuda_inc}"
    CUDA_LIB="${cuda_lib}"
    NVCC="${cuda_home}/bin/nvcc"
    NVCC_GENCODE="${gencode}"
    PREFIX="${PREFIX}"
)
make -C "${SRC_DIR}" -j"${CPU_COUNT:-1}" src.build "${make_args[@]}"

# From 2.29: NCCL's device API as LLVM bitcode (lib/libnccl_device.bc) and its wrapper header
# (include/nccl_device_wrapper.h), for compilers that link NCCL's device functions into their own
# kernels (nccl4py's CuTe bindings). NVIDIA's nvidia-nccl-cu13 2.30.7 wheel and conda-forge's nccl
# (2.29.7, 2.30.4) ship both. bindings/ir/Makefile builds them with clang, opt, llvm-dis and
# llvm-as; src.install then copies them with the rest of build/lib and build/include.
if [[ "${NCCL_EMIT_LLVM_IR:-0}" == 1 ]]; then
    # clang's CUDA wrapper includes curand_mtgp32_kernel.h unconditionally; NCCL uses none of it and
    # conda's CUDA build env has no curand, so an empty one goes into the throw-away build env, as
    # conda-forge's nccl-feedstock build.sh does. A system toolkit has the real header.
    if [[ "${cuda_inc}" == "${BUILD_PREFIX}"/* && ! -e "${cuda_inc}/curand_mtgp32_kernel.h" ]]; then
        touch "${cuda_inc}/curand_mtgp32_kernel.h"
    fi
    make -C "${SRC_DIR}" ir.build EMIT_LLVM_IR=1 "${make_args[@]}"
fi
make -C "${SRC_DIR}" src.install "${make_args[@]}"

# Consumers (PyTorch with USE_SYSTEM_NCCL=1) must load the one shared libnccl of the environment,
# never link a private static copy.
rm "${PREFIX}/lib/libnccl_static.a"
