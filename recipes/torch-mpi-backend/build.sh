#!/usr/bin/env bash
# Compile PyTorch's ProcessGroupMPI.cpp (from $SRC_DIR, already patched) with our registration module
# as a torch C++ extension against the pytorch that $PYTHON imports, linked to the site's MPI, and
# install the package torch_mpi_backend into $PREFIX.
#
# Runs under rattler-build / conda-build, or by hand with the same variables:
#   PREFIX SRC_DIR RECIPE_DIR CPU_COUNT PYTHON
#   TORCH_MPI_BACKEND_TORCH_VERSION  the pytorch_version variant (e.g. 2.6.0)
#   TORCH_MPI_BACKEND_SOURCE_VERSION optional: the release whose ProcessGroupMPI.cpp $SRC_DIR holds, when
#                                    it is not the same (2.6.0 for the reconstructed 2.11.0 variant)
#   TORCH_MPI_BACKEND_SITE_MPI       the site_mpi variant: cray-mpich | mpich-cuda | mpich | openmpi
#   TORCH_MPI_BACKEND_MPI_ROOT       the site_mpi_root variant (install root of the host's Cray MPICH or
#                                    CUDA-built MPICH; else empty)
#   MPICC                            optional: the MPI C wrapper to read flags from (overrides the above)
set -euo pipefail

torch_version="${TORCH_MPI_BACKEND_TORCH_VERSION:?set from the pytorch_version variant}"
source_version_wanted="${TORCH_MPI_BACKEND_SOURCE_VERSION:-$torch_version}"
site_mpi="${TORCH_MPI_BACKEND_SITE_MPI:?set from the site_mpi variant}"
mpi_root="${TORCH_MPI_BACKEND_MPI_ROOT:-}"
source_cpp="${SRC_DIR}/torch/csrc/distributed/c10d/ProcessGroupMPI.cpp"

fail() {
    echo "torch-mpi-backend: $*" >&2
    exit 1
}

[[ -f "$source_cpp" ]] || fail "no ${source_cpp}: SRC_DIR must hold the PyTorch ${torch_version} source"

# The C++ classes cross the boundary between this extension and libtorch, so the source, the
# installed pytorch and the variant must all be one release.
installed="$("$PYTHON" -c 'import torch; print(torch.__version__.split("+")[0])')"
[[ "$installed" == "$torch_version" ]] ||
    fail "the pytorch that ${PYTHON} imports is ${installed}, this variant is for ${torch_version}"
if [[ -f "${SRC_DIR}/version.txt" ]]; then
    # Release branches keep the next development tag in version.txt ("2.6.0a0").
    source_version="$(sed -E 's/(a|rc)[0-9]+$//' "${SRC_DIR}/version.txt")"
    [[ "$source_version" == "$source_version_wanted" ]] ||
        fail "the source in ${SRC_DIR} is PyTorch ${source_version}, this variant compiles ${source_version_wanted}'s file"
fi

# The site MPI's C wrapper knows its include and library flags: the host's Cray MPICH or CUDA-built
# MPICH under site_mpi_root, conda-forge's MPICH or Open MPI in the host prefix.
if [[ -z "${MPICC:-}" ]]; then
    case "$site_mpi" in
        cray-mpich | mpich-cuda)
            [[ -n "$mpi_root" ]] || fail "site_mpi=${site_mpi} needs site_mpi_root (the MPI's install root)"
            MPICC="${mpi_root}/bin/mpicc"
            ;;
        mpich | openmpi) MPICC="${PREFIX}/bin/mpicc" ;;
        *) fail "unknown site_mpi '${site_mpi}' (cray-mpich, mpich-cuda, mpich or openmpi)" ;;
    esac
fi
[[ -x "$MPICC" ]] || fail "no MPI C wrapper at ${MPICC}"
if [[ "$site_mpi" == "openmpi" ]]; then
    read -r -a wrapper_words <<<"$("$MPICC" --showme)"
else
    read -r -a wrapper_words <<<"$("$MPICC" -show)"
fi
mpi_cflags=()
mpi_ldflags=()
mpi_libdirs=()
for word in "${wrapper_words[@]:1}"; do
    case "$word" in
        -I* | -D*) mpi_cflags+=("$word") ;;
        -L*)
            # Keep the MPI's own directory on the runpath: Cray MPICH lives outside any prefix.
            mpi_ldflags+=("$word" "-Wl,-rpath,${word#-L}")
            mpi_libdirs+=("${word#-L}")
            ;;
        -l*)
            # By full path when the wrapper's own directories hold it: torch's extension build puts
            # Python's library directory (e.g. /usr/lib/x86_64-linux-gnu) first on the link line, and a
            # system Open MPI's libmpi.so there would win over a site MPICH's libmpi.so.
            library="${word#-l}"
            for dir in "${mpi_libdirs[@]}"; do
                if [[ -e "${dir}/lib${library}.so" ]]; then
                    word="${dir}/lib${library}.so"
                    break
                fi
            done
            mpi_ldflags+=("$word")
            ;;
        -Wl,* | -pthread) mpi_ldflags+=("$word") ;;
    esac
done
mpi_library_pattern=' (-lmpi|[^ ]*/libmpi)'
[[ " ${mpi_ldflags[*]}" =~ $mpi_library_pattern ]] || fail "${MPICC} names no MPI library: ${wrapper_words[*]}"
export TORCH_MPI_BACKEND_MPI_CFLAGS="${mpi_cflags[*]}"
export TORCH_MPI_BACKEND_MPI_LDFLAGS="${mpi_ldflags[*]}"

# Build in a copy: the recipe directory stays untouched, and the patched source sits next to ours.
build_dir="$(mktemp -d "${SRC_DIR}/torch-mpi-backend-build.XXXXXX")"
cp -R "${RECIPE_DIR}/src/." "$build_dir/"
cp "$source_cpp" "${build_dir}/torch_mpi_backend/ProcessGroupMPI.cpp"
# Recorded so that an import under any other torch fails with a clear message, not a missing symbol.
# SOURCE_VERSION says whose ProcessGroupMPI.cpp it is (2.6.0's for the reconstructed 2.11.0 variant).
"$PYTHON" - "${build_dir}/torch_mpi_backend/_built_against.py" "$source_version_wanted" <<'PY'
import sys

import torch

with open(sys.argv[1], "w") as out:
    out.write('"""The torch this build was compiled against (written by build.sh)."""\n\n')
    out.write(f"TORCH_VERSION = {torch.__version__!r}\n")
    out.write(f"TORCH_GIT_VERSION = {torch.version.git_version!r}\n")
    out.write(f"SOURCE_VERSION = {sys.argv[2]!r}\n")
PY

# torch.utils.cpp_extension compiles both files in parallel with ninja, MAX_JOBS at a time.
export MAX_JOBS="${CPU_COUNT:-1}"
(cd "$build_dir" && "$PYTHON" -m pip install . --no-deps --no-build-isolation --prefix "$PREFIX" -v)

# Fail here, not in a user's job, if the extension cannot load against this torch and MPI.
site_packages="$("$PYTHON" -c 'import sys, sysconfig; print(sysconfig.get_path("platlib", vars={"base": sys.argv[1], "platbase": sys.argv[1]}))' "$PREFIX")"
PYTHONPATH="${site_packages}${PYTHONPATH:+:${PYTHONPATH}}" "$PYTHON" -c \
    'import torch.distributed as dist, torch_mpi_backend; assert dist.Backend.CUDAMPI == "cudampi"; print("torch-mpi-backend: built for", torch_mpi_backend.mpi_library_version().splitlines()[0])'
rm -rf "$build_dir"
