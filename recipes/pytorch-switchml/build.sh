#!/usr/bin/env bash
# PyTorch 1.7.1, flavor switchml (gloo's CUDA allreduce through SwitchML), in two stages chosen by
# recipe.yaml:
#   build   (staging output) compiles libtorch once per (switchml backend, site);
#   pytorch (the one Python, 3.8) reuses that build tree and installs torch.
# Follows recipes/pytorch-nccl-fault/build.sh (same groups, same order) for a 1.7-era tree; the
# flavor's own lines are marked "flavor". Each recipe keeps its own copy because a package records
# only its own recipe folder (info/recipe).
set -euo pipefail

stage="${PYTORCH_BUILD_STAGE:?PYTORCH_BUILD_STAGE is set by recipe.yaml (build or pytorch)}"

# Version and build number baked into torch.__version__ (setup.py would ask git otherwise).
export PYTORCH_BUILD_VERSION="${PYTORCH_BUILD_VERSION:?set by recipe.yaml}"
export PYTORCH_BUILD_NUMBER="${PYTORCH_BUILD_NUMBER:?set by recipe.yaml}"

# One compile job per core the engine grants; rattler-build exports CPU_COUNT. By hand, one per CPU this
# shell may run on, whatever OMP_NUM_THREADS says (GNU nproc honors it; HPC shells often set it to 1).
export MAX_JOBS="${CPU_COUNT:-$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)}"

# Only the site's GPUs (cuda_arch_list, 8.0[+PTX] for CUDA 11.0): each extra architecture costs
# compile time and package size.
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:?set by recipe.yaml from the site variant}"

# CUDA 11.0: conda-forge's nvcc wrapper drives the toolkit installed on the build node, whose root
# it exports as CUDA_HOME; the runtime libraries come from cudatoolkit in $PREFIX.
export CUDA_HOME="${CUDA_HOME:?the nvcc 11.0 wrapper needs a CUDA 11.0 toolkit on the build node (CUDA_HOME)}"
export CUDA_TOOLKIT_ROOT_DIR="$CUDA_HOME"
export CUDNN_INCLUDE_DIR="$PREFIX/include"
export CUDNN_LIB_DIR="$PREFIX/lib"

# The channel's NCCL, linked dynamically (never the static copy in third_party/nccl).
export USE_NCCL=1
export USE_SYSTEM_NCCL=1
export USE_STATIC_NCCL=0
export NCCL_ROOT_DIR="$PREFIX"
export NCCL_INCLUDE_DIR="$PREFIX/include"
export NCCL_LIB_DIR="$PREFIX/lib"

# flavor: c10d links switchml-client (patch 0001 reads SWITCHML_INC_DIR, SWITCHML_LINK_DIR and
# SWITCHML_LINK_LIB, ;-separated lists taken from switchml-client.pc).
while IFS='=' read -r key value; do
    export "${key}=${value}"
    echo "pytorch-switchml: ${key}=${value}"
done < <("$RECIPE_DIR/switchml-env.sh" "$PREFIX")

# Distributed backends: gloo (which SwitchML patches), NCCL, TensorPipe; no MPI backend.
export USE_DISTRIBUTED=1
export USE_GLOO=1
export USE_TENSORPIPE=1
export USE_MPI=0

# GPU: CUDA with cuDNN as shared libraries; no ROCm; no MAGMA (no CUDA 11.0 build in host).
export USE_CUDA=1
export USE_CUDNN=1
export USE_STATIC_CUDNN=0
export USE_MAGMA=0
export USE_NVRTC=0
export USE_ROCM=0

# CPU kernels: MKL as BLAS (mkl-devel in host), oneDNN, FBGEMM and the quantized/mobile kernels as
# upstream ships them; NUMA off (no libnuma in host); no optional I/O or storage backends.
export BLAS=MKL
export USE_MKL=1
export USE_MKLDNN=1
export USE_FBGEMM=1
export USE_NNPACK=1
export USE_QNNPACK=1
export USE_PYTORCH_QNNPACK=1
export USE_XNNPACK=1
export USE_OPENMP=1
export USE_NUMPY=1
export USE_NUMA=0
export USE_TBB=0
export USE_FFMPEG=0
export USE_OPENCV=0
export USE_LMDB=0
export USE_LEVELDB=0
export USE_REDIS=0
export USE_ZSTD=0
export USE_FAKELOWP=0
export USE_METAL=0
export USE_ASAN=0

# Nothing that is not shipped: no tests, benchmarks, binaries or caffe2 operators.
export BUILD_TEST=0
export INSTALL_TEST=0
export BUILD_CAFFE2_OPS=0
export BUILD_BINARY=0

# Release build with Ninja; the engine's compiler flags stay in charge.
export CMAKE_BUILD_TYPE=Release
export CMAKE_GENERATOR=Ninja
export CMAKE_PREFIX_PATH="$PREFIX"
# conda-forge's LDFLAGS bind every symbol at load time (-z now); lazy binding lets torch import on a
# login node without the CUDA driver.
export LDFLAGS="${LDFLAGS:-}"
export LDFLAGS="${LDFLAGS//-Wl,-z,now/-Wl,-z,lazy}"

case "$stage" in
    build)
        "$PREFIX/bin/python" setup.py build
        # flavor: fail here, not in a test hours later, if c10d did not pick up SwitchML.
        if ! "${NM:-nm}" -C build/lib/libc10d.a | grep -q 'switchml::Context::GetInstance'; then
            echo "pytorch-switchml: build/lib/libc10d.a does not call SwitchML (was SWITCHML_LINK_LIB seen by CMake?)" >&2
            exit 1
        fi
        ;;
    pytorch)
        # One Python (3.8) for staging and output: the cached build tree is reused as it is.
        "$PREFIX/bin/python" -m pip install . --no-deps --no-build-isolation --no-clean -v
        ;;
    *)
        echo "build.sh: unknown PYTORCH_BUILD_STAGE '$stage' (expected build or pytorch)" >&2
        exit 1
        ;;
esac
