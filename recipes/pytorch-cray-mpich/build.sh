#!/usr/bin/env bash
# PyTorch, flavor cray_mpich (CUDA-aware MPI backend on the host's Cray MPICH), in three stages chosen
# by recipe.yaml:
#   build    (staging output) compiles libtorch once per (PyTorch version, CUDA, site);
#   libtorch installs the C++ libraries of that build (the libtorch package);
#   pytorch  (one per Python) reuses that build tree and installs torch for this output's Python.
# Kept in step with recipes/pytorch-nccl-fault/build.sh: same groups, same order; the flavor's own
# lines are marked "flavor". Each recipe keeps its own copy because a package records only its own
# recipe folder (info/recipe), so a script sourced from outside it would be missing there.
set -euo pipefail

stage="${PYTORCH_BUILD_STAGE:?PYTORCH_BUILD_STAGE is set by recipe.yaml (build or pytorch)}"

# Version and build number baked into torch.__version__ (setup.py would ask git otherwise).
export PYTORCH_BUILD_VERSION="${PYTORCH_BUILD_VERSION:?set by recipe.yaml}"
export PYTORCH_BUILD_NUMBER="${PYTORCH_BUILD_NUMBER:?set by recipe.yaml}"

# One compile job per core the engine grants; rattler-build exports CPU_COUNT. By hand, one per CPU this
# shell may run on, whatever OMP_NUM_THREADS says (GNU nproc honors it; HPC shells often set it to 1).
export MAX_JOBS="${CPU_COUNT:-$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)}"

# Only the site's GPUs (cuda_arch_list): each extra architecture costs compile time and package size.
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:?set by recipe.yaml from the site variant}"

# CUDA from conda-forge's split packages: headers and libraries in $PREFIX, nvcc in $BUILD_PREFIX.
export CUDA_HOME="$PREFIX"
export CUDAToolkit_ROOT="$PREFIX"
export CUDA_TOOLKIT_ROOT_DIR="$PREFIX"
export CUDAToolkit_BIN_DIR="$BUILD_PREFIX/bin"
export CMAKE_CUDA_COMPILER="$BUILD_PREFIX/bin/nvcc"

# The channel's NCCL, linked dynamically (never the static copy in third_party/nccl).
export USE_NCCL=1
export USE_SYSTEM_NCCL=1
export USE_STATIC_NCCL=0
export NCCL_ROOT_DIR="$PREFIX"
export NCCL_INCLUDE_DIR="$PREFIX/include"
export NCCL_LIB_DIR="$PREFIX/lib"

# Distributed backends: NCCL, gloo and (flavor) MPI.
export USE_DISTRIBUTED=1
export USE_GLOO=1
export USE_TENSORPIPE=1
export USE_MPI=1
export USE_UCC=0
export USE_C10D_UCC=0

# GPU: CUDA with cuDNN as shared libraries; no ROCm/XPU/MPS; optional CUDA extras off (no packages).
export USE_CUDA=1
export USE_CUDNN=1
export USE_STATIC_CUDNN=0
export USE_CUSPARSELT=0
export USE_CUDSS=0
export USE_CUFILE=0
export USE_MAGMA=0
export USE_NVRTC=0
export USE_FLASH_ATTENTION=1
export USE_MEM_EFF_ATTENTION=1
export USE_ROCM=0
export USE_XPU=0
export USE_MPS=0

# CPU kernels: MKL as BLAS (mkl-devel in host), oneDNN, FBGEMM and the quantized/mobile kernels as
# upstream ships them; NUMA and ITT off (no libnuma or ittapi in host).
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
export USE_KINETO=1
export USE_NUMA=0
export USE_ITT=0
export USE_FFMPEG=0
export USE_OPENCV=0
export USE_LMDB=0
export USE_LEVELDB=0
export USE_REDIS=0
export USE_ZSTD=0

# Nothing that is not shipped: no tests, benchmarks or caffe2 operators (BUILD_CAFFE2* exist up to 2.3).
export BUILD_TEST=0
export INSTALL_TEST=0
export BUILD_CAFFE2=0
export BUILD_CAFFE2_OPS=0
export BUILD_BINARY=0
export USE_PRECOMPILED_HEADERS=0

# flavor: the host's Cray MPICH (site_mpi_root), never an MPI from the build environment: CMake's
# FindMPI looks in MPI_HOME first. The conda package `mpich` is only conda-forge's external stub.
export MPI_HOME="${SITE_MPI_ROOT:?set by recipe.yaml from the site variant (site_mpi_root)}"
if [[ ! -f "$MPI_HOME/include/mpi.h" ]]; then
    echo "pytorch-cray-mpich: no $MPI_HOME/include/mpi.h: load the site's cray-mpich module or fix site_mpi_root" >&2
    exit 1
fi
# flavor: Cray MPICH moves GPU buffers only through its GTL library, which must be linked into the
# program (MPI_Init aborts with MPICH_GPU_SUPPORT_ENABLED=1 otherwise); it lives in
# <mpich>/<version>/gtl/lib beside ofi/<compiler>/<version>. Both paths are kept as rpaths (the
# recipe's rpath_allowlist), so no LD_LIBRARY_PATH is needed at run time.
gtl_dir="$MPI_HOME/../../../gtl/lib"
if [[ ! -f "$gtl_dir/libmpi_gtl_cuda.so" ]]; then
    echo "pytorch-cray-mpich: no libmpi_gtl_cuda.so in $gtl_dir: Cray MPICH's CUDA support is missing" >&2
    exit 1
fi
gtl_dir="$(cd "$gtl_dir" && pwd -P)"
export LDFLAGS="${LDFLAGS:-} -Wl,-rpath,$MPI_HOME/lib -L$gtl_dir -Wl,-rpath,$gtl_dir -Wl,--no-as-needed -lmpi_gtl_cuda -Wl,--as-needed"

# Release build with Ninja; the engine's compiler flags stay in charge.
export CMAKE_BUILD_TYPE=Release
export CMAKE_GENERATOR=Ninja
export CMAKE_PREFIX_PATH="$PREFIX"
# conda-forge's LDFLAGS bind every symbol at load time (-z now); lazy binding lets torch import on a
# login node without the CUDA driver, as conda-forge's own build does.
export LDFLAGS="${LDFLAGS:-}"
export LDFLAGS="${LDFLAGS//-Wl,-z,now/-Wl,-z,lazy}"

case "$stage" in
    build)
        # The staging Python is fixed (3.12 in recipe.yaml): the CMake cache written here is pointed
        # at each output's Python in the pytorch stage.
        "$PREFIX/bin/python" setup.py build
        cp build/CMakeCache.txt build/CMakeCache.txt.staging
        ;;
    libtorch)
        # The C++ half of the build tree into $PREFIX, as conda-forge's libtorch output does
        # (pytorch-cpu-feedstock 74dd3d46 recipe/build.sh): libraries, headers, CMake config, tools;
        # libtorch_python belongs to the pytorch output.
        built=(build/lib.*/torch)
        mkdir -p "$PREFIX/bin" "$PREFIX/lib" "$PREFIX/share" "$PREFIX/include"
        if [[ -d "${built[0]}/bin" ]]; then
            cp -a "${built[0]}/bin/." "$PREFIX/bin/"
        fi
        cp -a "${built[0]}/lib/." "$PREFIX/lib/"
        cp -a "${built[0]}/share/." "$PREFIX/share/"
        cp -a "${built[0]}/include/." "$PREFIX/include/"
        rm -f "$PREFIX"/lib/libtorch_python.*
        ;;
    pytorch)
        # Reuse the cached build tree: only the Python bindings are rebuilt for this Python.
        py_ver="$("$PREFIX/bin/python" -c 'import sys; print("{}.{}".format(*sys.version_info[:2]))')"
        py_nodot="${py_ver/./}"
        sed -e "s/3\\.12/${py_ver}/g" -e "s/3;12/${py_ver/./;}/g" -e "s/cpython-312/cpython-${py_nodot}/g" \
            build/CMakeCache.txt.staging >build/CMakeCache.txt
        "$PREFIX/bin/python" -m pip install . --no-deps --no-build-isolation --no-clean -v
        # libtorch (host, this build's) already holds the libraries, tools and CMake files: torch's
        # copies become links to them, so one process loads one libtorch. libtorch_python stays here
        # and is also copied next to them for TorchConfig.cmake, as conda-forge does. Headers stay
        # (torch.utils.cpp_extension looks for them in site-packages).
        sp_dir="$("$PREFIX/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
        cp "$sp_dir"/torch/lib/libtorch_python.so "$PREFIX/lib/"
        for f in "$sp_dir"/torch/{bin,lib,share}/*; do
            rel="${f#"$sp_dir"/torch/}"
            if [[ -e "$PREFIX/$rel" && "$rel" != lib/libtorch_python.so ]]; then
                rm -rf "$f"
                ln -s "$PREFIX/$rel" "$f"
            fi
        done
        ;;
    *)
        echo "build.sh: unknown PYTORCH_BUILD_STAGE '$stage' (expected build, libtorch or pytorch)" >&2
        exit 1
        ;;
esac
