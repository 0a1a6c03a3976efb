#!/usr/bin/env bash
# Prepare what tests/test_torch_mpi_backend.py and tests/test_torch_mpi_backend_2_14.py need to build
# recipes/torch-mpi-backend for real, outside the conda engine: Debian's MPICH, the PyTorch 2.6.0 and
# 2.14.1 release wheels in venvs of their own, and Debian trixie's PyTorch 2.6.0 source package (the
# upstream release's files, minus DFSG removals; the 2.14.1 variant compiles 2.6.0's file too, through
# the reconstructed torch-2.14-compat series). Everything big lives in a cache outside the repository,
# so a warm run only checks and returns.
#
#   eval "$(bash .ci/torch-mpi-backend.sh)"   prepare (idempotent) and export the variables that
#                                             switch those tests on
#
# The torch wheels on PyPI are CUDA builds that pull in the nvidia-* wheels (about 3 GB each); each
# gets a venv of its own so it never meets the torch (2.15.0) the rest of the suite uses.
set -euo pipefail

# stdout is evaluated by the caller: only the `export` lines at the end go there (through fd 3).
# Everything else, apt-get's and pip's progress included, goes to stderr for people to read.
exec 3>&1 1>&2

cache="${CHANNELSMITH_CACHE:-${HOME}/.cache/channelsmith}"
debian_version=2.6.0+dfsg-7
debian_dir="${cache}/debian"
orig_tarball="${debian_dir}/pytorch_${debian_version%-*}.orig.tar.xz"

log() {
    printf '[torch-mpi-backend env %s] %s\n' "$(date -u +%H:%M:%S)" "$*" >&2
}

# Debian's MPICH is the site MPI of the CI build; dpkg-dev provides `apt-get source`; ninja lets
# torch.utils.cpp_extension compile both files at once; patch applies the recipe's series.
# scripts/install-test-deps.sh installs them and the trixie deb-src line; this script only checks.
missing=()
for pkg in mpich libmpich-dev xz-utils dpkg-dev g++ ninja-build patch; do
    if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
        missing+=("$pkg")
    fi
done
if [ "${#missing[@]}" -gt 0 ]; then
    log "missing Debian packages: ${missing[*]}; run: bash scripts/install-test-deps.sh"
    exit 1
fi

# PyTorch 2.6.0 lives in trixie (its deb-src line comes from scripts/install-test-deps.sh).
if [ ! -f "$orig_tarball" ]; then
    mkdir -p "$debian_dir"
    log "downloading Debian's pytorch=${debian_version} source package"
    if ! (cd "$debian_dir" && apt-get source --download-only "pytorch=${debian_version}"); then
        log "apt-get source failed; run bash scripts/install-test-deps.sh (adds the trixie deb-src line)"
        exit 1
    fi
fi

# A venv per torch release; one is complete only once torch imports from it (a half-installed one is
# rebuilt). The first run that sees it import leaves a mark; later runs read the version from torch's
# metadata beside that mark instead of importing torch again (1.5 s of CPU per venv and run).
prepare_venv() {
    local version="$1"
    local venv="${cache}/venv-torch-${version}"
    local mark="${venv}/.torch-imports"
    if [ -f "$mark" ] && "${venv}/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('torch').split('+')[0] != '${version}')" 2>/dev/null; then
        return
    fi
    rm -f "$mark"
    if ! "${venv}/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '${version}')" 2>/dev/null; then
        log "creating ${venv} with torch==${version} from PyPI (CUDA build, about 3 GB)"
        rm -rf "$venv"
        python3 -m venv "$venv"
        # setuptools builds the extension; no pip cache: the venv itself is the cache.
        "${venv}/bin/python" -m pip install --no-cache-dir --progress-bar off \
            "torch==${version}" "setuptools>=68" numpy
        "${venv}/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '${version}')"
    fi
    touch "$mark"
}
prepare_venv 2.6.0
prepare_venv 2.14.1

printf 'export TORCH_MPI_BACKEND_PYTHON=%q\n' "${cache}/venv-torch-2.6.0/bin/python" >&3
printf 'export TORCH_MPI_BACKEND_PYTHON_2_14=%q\n' "${cache}/venv-torch-2.14.1/bin/python" >&3
printf 'export TORCH_MPI_BACKEND_TORCH_SOURCE=%q\n' "$orig_tarball" >&3
