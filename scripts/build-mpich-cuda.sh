#!/usr/bin/env bash
# Build MPICH (>= 4.0) with CUDA support over libfabric: the MPI of a `site_mpi=mpich-cuda` site, and
# the CUDA-aware MPI that torch-mpi-backend's patched cudaAwareMpiCheck() recognises through
# MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA). docs/howto/mpi-without-a-rebuild.md ("A CUDA-aware MPICH") has
# the route this was tried on: MPICH v4.3.2 with its yaksa, json-c and hwloc submodules, autogen.sh
# run beforehand, Debian's libfabric 1.17 and hwloc 2.9, CUDA 13.0.
#
#   bash scripts/build-mpich-cuda.sh --source DIR|TARBALL --prefix DIR --cuda DIR \
#        --libfabric DIR --hwloc DIR [--jobs N] [--print-configure]
#
#   --source           an MPICH source tree on which ./autogen.sh has run (it has ./configure), or a
#                      .tar.gz/.tar.xz of one (one top folder); a tarball is unpacked next to --prefix
#   --prefix           where MPICH is installed (must not exist yet, or be empty)
#   --cuda             the CUDA toolkit root (include/cuda_runtime_api.h)
#   --libfabric        a libfabric root: include/rdma/fabric.h and libfabric.so under lib, lib64
#                      or lib/<multiarch> (an unpacked Debian package's usr/ works)
#   --hwloc            an hwloc (>= 2.0) root, found the same way (include/hwloc.h, libhwloc.so)
#   --jobs             parallel make jobs (default: the number of processors)
#   --print-configure  print the configure command line on stdout and stop (nothing is built)
#
# Bad arguments: a message on stderr and exit 2, nothing written. Progress goes to stderr.
set -euo pipefail

usage_error() {
    printf 'build-mpich-cuda: %s\n' "$1" >&2
    printf '  hint: %s\n' "${2:-run with --help for the options}" >&2
    exit 2
}

log() {
    printf '[build-mpich-cuda %s] %s\n' "$(date -u +%H:%M:%S)" "$*" >&2
}

source_arg=""
prefix=""
cuda=""
libfabric=""
hwloc=""
jobs="$(nproc)"
print_only=0

while [[ $# -gt 0 ]]; do
    case "$1" in
        -h | --help)
            sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0" >&2
            exit 0
            ;;
        --print-configure)
            print_only=1
            shift
            continue
            ;;
        --source | --prefix | --cuda | --libfabric | --hwloc | --jobs)
            [[ $# -ge 2 && -n "$2" && "$2" != --* ]] || usage_error "$1 needs a value"
            case "$1" in
                --source) source_arg="$2" ;;
                --prefix) prefix="$2" ;;
                --cuda) cuda="$2" ;;
                --libfabric) libfabric="$2" ;;
                --hwloc) hwloc="$2" ;;
                --jobs) jobs="$2" ;;
            esac
            shift 2
            ;;
        *) usage_error "unknown argument '$1'" ;;
    esac
done

for required in source_arg:--source prefix:--prefix cuda:--cuda libfabric:--libfabric hwloc:--hwloc; do
    variable="${required%%:*}"
    [[ -n "${!variable}" ]] || usage_error "${required#*:} is required" \
        "give --source, --prefix, --cuda, --libfabric and --hwloc"
done
[[ "$jobs" =~ ^[1-9][0-9]*$ ]] || usage_error "--jobs must be a positive integer, not '${jobs}'"

# A library root may keep its libraries in lib, lib64 or a multiarch folder (Debian's usr/).
lib_dir_of() {
    local root="$1" name="$2" dir
    for dir in "${root}/lib" "${root}/lib64" "${root}/lib/$(uname -m)-linux-gnu"; do
        if compgen -G "${dir}/${name}.so*" >/dev/null; then
            printf '%s\n' "$dir"
            return 0
        fi
    done
    return 1
}

[[ -f "${cuda}/include/cuda_runtime_api.h" ]] ||
    usage_error "--cuda ${cuda} has no include/cuda_runtime_api.h" "give the CUDA toolkit root, e.g. /usr/local/cuda"
[[ -f "${libfabric}/include/rdma/fabric.h" ]] ||
    usage_error "--libfabric ${libfabric} has no include/rdma/fabric.h" "give a libfabric root with its headers (libfabric-dev)"
libfabric_lib="$(lib_dir_of "$libfabric" libfabric)" ||
    usage_error "--libfabric ${libfabric} has no libfabric.so under lib, lib64 or lib/$(uname -m)-linux-gnu"
[[ -f "${hwloc}/include/hwloc.h" ]] ||
    usage_error "--hwloc ${hwloc} has no include/hwloc.h" "give an hwloc >= 2.0 root with its headers (libhwloc-dev)"
hwloc_lib="$(lib_dir_of "$hwloc" libhwloc)" ||
    usage_error "--hwloc ${hwloc} has no libhwloc.so under lib, lib64 or lib/$(uname -m)-linux-gnu"
if [[ -d "$source_arg" ]]; then
    [[ -x "${source_arg}/configure" ]] ||
        usage_error "--source ${source_arg} has no ./configure" \
            "run ./autogen.sh -without-ucx -without-ofi -without-test -without-fortran -yaksa-depth=1 in it first"
elif [[ -f "$source_arg" ]]; then
    case "$source_arg" in
        *.tar.gz | *.tgz | *.tar.xz) ;;
        *) usage_error "--source ${source_arg} is neither a folder nor a .tar.gz/.tar.xz" ;;
    esac
else
    usage_error "--source ${source_arg} does not exist"
fi
if [[ -e "$prefix" ]] && [[ ! -d "$prefix" || -n "$(ls -A "$prefix")" ]]; then
    usage_error "--prefix ${prefix} exists and is not an empty folder" "name a new folder"
fi

# ch4:ofi is MPICH's libfabric device (what Cray MPICH is built on); the external hwloc and
# libfabric keep the build to MPICH's own code; no Fortran bindings are needed by PyTorch.
configure_args=(
    --prefix="$(realpath -m "$prefix")"
    --with-device=ch4:ofi
    --with-libfabric-include="${libfabric}/include" --with-libfabric-lib="$libfabric_lib"
    --with-hwloc-include="${hwloc}/include" --with-hwloc-lib="$hwloc_lib"
    --with-cuda="$cuda"
    --disable-fortran
    # The run path lets mpicc-built programs and torch-mpi-backend find libfabric and hwloc.
    "LDFLAGS=-Wl,-rpath,${libfabric_lib} -Wl,-rpath,${hwloc_lib}"
)

if [[ "$print_only" -eq 1 ]]; then
    printf '%q ' ./configure "${configure_args[@]}"
    printf '\n'
    exit 0
fi

# MPICH 4.3.2's first probe for libfabric (src/mpid/ch4/subconfigure.m4, which decides between the
# external and the embedded libfabric) compiles without the --with-libfabric-include path, so a
# libfabric outside the compiler's default paths was taken as missing and configure went on to build
# the embedded one, absent from the tree ("No rule to make target 'all'" in modules/libfabric). gcc's
# CPATH and LIBRARY_PATH put the roots (and Debian's multiarch include folder, where hwloc keeps its
# autogen/config.h) on every compile and link.
multiarch_includes=""
for root in "$libfabric" "$hwloc"; do
    multiarch_includes+="${root}/include:"
    [[ ! -d "${root}/include/$(uname -m)-linux-gnu" ]] || multiarch_includes+="${root}/include/$(uname -m)-linux-gnu:"
done
export CPATH="${multiarch_includes%:}${CPATH:+:${CPATH}}"
export LIBRARY_PATH="${libfabric_lib}:${hwloc_lib}${LIBRARY_PATH:+:${LIBRARY_PATH}}"

started=$SECONDS
if [[ -d "$source_arg" ]]; then
    src="$source_arg"
else
    unpack_dir="$(realpath -m "$prefix").src"
    [[ ! -e "$unpack_dir" ]] || usage_error "${unpack_dir} (where the tarball is unpacked) exists already"
    mkdir -p "$unpack_dir"
    log "unpacking ${source_arg} into ${unpack_dir}"
    tar -xf "$source_arg" -C "$unpack_dir"
    tops=("$unpack_dir"/*)
    [[ ${#tops[@]} -eq 1 && -x "${tops[0]}/configure" ]] ||
        { log "the tarball does not hold one folder with ./configure"; exit 1; }
    src="${tops[0]}"
fi

log "configure: ${configure_args[*]}"
(cd "$src" && ./configure "${configure_args[@]}" >&2)
# The embedded libfabric is not in an autogen'ed tree without -with-ofi; stop here, not 90 s into make.
if grep -q "ch4:ofi (embedded libfabric)" "${src}/config.log" 2>/dev/null ||
    grep -q "CH4 OFI Netmod:  Using an embedded libfabric" "${src}/config.log" 2>/dev/null; then
    log "configure did not take the libfabric of --libfabric ${libfabric} (see ${src}/config.log, 'checking for rdma/fabric.h')"
    exit 1
fi
log "make -j ${jobs}"
make -C "$src" -j "$jobs" >&2
make -C "$src" install >&2

# An MPICH built with CUDA records it in its configure line and links libcudart (through yaksa).
version_text="$("${prefix}/bin/mpichversion")"
[[ "$version_text" == *"--with-cuda"* ]] || { log "mpichversion names no --with-cuda"; exit 1; }
log "installed $(printf '%s\n' "$version_text" | head -n 1) with CUDA in $((SECONDS - started)) s"
printf '%s\n' "$(realpath "$prefix")"
