#!/usr/bin/env bash
# Build the aws-ofi-nccl plugin against the site's libfabric, run its unit tests, install it.
set -euo pipefail

version="${PKG_VERSION:?the engine sets PKG_VERSION (the plugin version)}"

# "conda" means conda-forge's libfabric in the host environment; an absolute path is the host's
# vendor libfabric (Cray's on Derecho), linked in place and never repackaged.
libfabric_root="${OFI_LIBFABRIC_ROOT:?recipe.yaml sets it from the libfabric_root variant}"
if [[ "$libfabric_root" == conda ]]; then
    libfabric_root="${PREFIX}"
fi
if [[ ! -e "${libfabric_root}/include/rdma/fabric.h" ]]; then
    echo "aws-ofi-nccl: no libfabric headers under ${libfabric_root}/include" >&2
    exit 1
fi
# hwloc comes from the host environment; the build-script test points this at the system's.
hwloc_root="${OFI_HWLOC_ROOT:-${PREFIX}}"

# conda's cuda-cudart-dev keeps headers and libraries under targets/<triple>; a system toolkit
# (CUDA_HOME) has them in include/ and lib64/. configure wants one root holding both.
case "${target_platform:-linux-64}" in
    linux-64) triple=x86_64-linux ;;
    linux-aarch64) triple=sbsa-linux ;;
    *) echo "aws-ofi-nccl: unsupported target_platform ${target_platform}" >&2; exit 1 ;;
esac
if [[ -e "${PREFIX}/targets/${triple}/include/cuda_runtime.h" ]]; then
    cuda_root="${PREFIX}/targets/${triple}"
    # configure looks in <root>/lib64 (>= 1.13) or lib; conda's layout has only lib.
    export LDFLAGS="-L${cuda_root}/lib ${LDFLAGS:-}"
else
    cuda_root="${CUDA_HOME:?no CUDA in the host environment: set CUDA_HOME to a CUDA toolkit}"
fi

# Archives of tags carry no configure script; from 1.19 autogen reads the version from
# .release_version when there is no .git (conda-forge's recipe does the same).
if [[ ! -x configure ]]; then
    [[ -e .release_version ]] || echo "${version}" >.release_version
    ./autogen.sh
fi

help="$(./configure --help)"
offers() { grep -q -- "$1" <<<"$help"; }

# A root of /usr is the compiler's default search path: configure would add -isystem
# /usr/include, which breaks the C++ headers' #include_next <stdlib.h>; let it search instead.
configure_root() {
    if [[ "$1" == /usr ]]; then echo yes; else echo "$1"; fi
}

args=(
    --prefix="${PREFIX}"
    --with-libfabric="$(configure_root "${libfabric_root}")"
    --with-cuda="${cuda_root}"
)
# The functional tests need MPI and real NICs and would install MPI programs into bin/; the unit
# tests (from 1.7.0) need neither. Without MPI configure keeps only the unit tests; releases
# without unit tests build functional ones with any mpicc on PATH, so they get none.
if [[ -d tests/unit ]]; then
    args+=(--with-mpi=no)
else
    args+=(--disable-tests)
fi
# hwloc is required from 1.7.0 on (1.6.0 has no such option).
if offers --with-hwloc; then
    args+=(--with-hwloc="$(configure_root "${hwloc_root}")")
fi
# Auto-detection of EC2 or of gdrcopy would make the package depend on the build machine.
if offers --enable-platform-aws; then
    args+=(--disable-platform-aws)
fi
if offers --with-gdrcopy; then
    args+=(--with-gdrcopy=no)
fi
# A host libfabric lives outside the environment: record where, so NCCL's dlopen of the plugin
# finds it without LD_LIBRARY_PATH (the recipe's rpath_allowlist keeps this entry). It stays an
# old-style DT_RPATH: the engine stores every packaged library's path as one, RUNPATH or not
# (tests/test_engine_rpath.py), which keeps the environment's own libraries ahead of the
# LD_LIBRARY_PATH that Cray's modules fill; a module's libfabric that NCCL or MPI loaded first is
# used anyway (one libfabric.so.1 per process).
if [[ "$libfabric_root" != "${PREFIX}" && "$libfabric_root" != /usr ]]; then
    libdir="${libfabric_root}/lib64"
    [[ -d "$libdir" ]] || libdir="${libfabric_root}/lib"
    export LDFLAGS="-Wl,-rpath,${libdir} ${LDFLAGS:-}"
fi

./configure "${args[@]}"
make -j"${CPU_COUNT:-1}"
make install

# The plugin's own unit tests (freelist, idpool, msgbuff, scheduler, ...) need no GPU or fabric;
# releases before 1.7.0 ship none.
if [[ -f tests/unit/Makefile ]]; then
    make -C tests/unit -j"${CPU_COUNT:-1}" check
else
    echo "aws-ofi-nccl ${version}: no tests/unit in this release, unit tests skipped"
fi

# libtool archives only record build paths; the topology XML files stay (NCCL reads them on AWS).
rm -f "${PREFIX}"/lib/libnccl-net*.la "${PREFIX}"/lib/libnccl-ofi*.la "${PREFIX}"/lib/libnccl-tuner*.la
