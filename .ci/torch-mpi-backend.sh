#!/usr/bin/env bash
# Prepare what tests/test_torch_mpi_backend.py needs to build recipes/torch-mpi-backend for real,
# outside the conda engine: Debian's MPICH, the PyTorch 2.6.0 release wheel in its own venv, and
# Debian trixie's PyTorch 2.6.0 source package (the upstream release's files, minus DFSG removals).
# Everything big lives in a cache outside the repository, so a warm run only checks and returns.
#
#   eval "$(bash .ci/torch-mpi-backend.sh)"   prepare (idempotent) and export the variables that
#                                             switch tests/test_torch_mpi_backend.py on
#
# The torch 2.6.0 wheel on PyPI is a CUDA build that pulls in the nvidia-* wheels (about 3 GB);
# it gets a venv of its own so it never meets the CPU torch 2.13.0 the rest of the suite uses.
set -euo pipefail

cache="${CHANNELSMITH_CACHE:-${HOME}/.cache/channelsmith}"
torch_version=2.6.0
debian_version=2.6.0+dfsg-7
venv="${cache}/venv-torch-${torch_version}"
debian_dir="${cache}/debian"
orig_tarball="${debian_dir}/pytorch_${debian_version%-*}.orig.tar.xz"

as_root() {
    if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi
}

log() {
    printf '[torch-mpi-backend env %s] %s\n' "$(date -u +%H:%M:%S)" "$*" >&2
}

# Debian's MPICH is the site MPI of the CI build; dpkg-dev provides `apt-get source`; ninja lets
# torch.utils.cpp_extension compile both files at once; patch applies the recipe's series.
apt_packages=(mpich libmpich-dev xz-utils dpkg-dev g++ ninja-build patch)
missing=()
for pkg in "${apt_packages[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
        missing+=("$pkg")
    fi
done
if [ "${#missing[@]}" -gt 0 ]; then
    log "installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    as_root apt-get update -qq
    as_root apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# PyTorch 2.6.0 lives in trixie; its source needs a deb-src line for that suite.
if [ ! -f "$orig_tarball" ]; then
    if ! grep -rqsE '^(Suites:.*\btrixie\b|deb-src .* trixie )' /etc/apt/sources.list.d/ /etc/apt/sources.list; then
        log "adding a deb-src line for trixie"
        as_root tee /etc/apt/sources.list.d/channelsmith-trixie-src.sources >/dev/null <<'SRC'
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: trixie
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
    fi
    as_root apt-get update -qq
    mkdir -p "$debian_dir"
    log "downloading Debian's pytorch=${debian_version} source package"
    (cd "$debian_dir" && apt-get source --download-only "pytorch=${debian_version}")
fi

# The venv is complete only once torch imports from it; a half-installed one is rebuilt.
if ! "${venv}/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '${torch_version}')" 2>/dev/null; then
    log "creating ${venv} with torch==${torch_version} from PyPI (CUDA build, about 3 GB)"
    rm -rf "$venv"
    python3 -m venv "$venv"
    # setuptools builds the extension; no pip cache: the venv itself is the cache.
    "${venv}/bin/python" -m pip install --no-cache-dir --progress-bar off \
        "torch==${torch_version}" "setuptools>=68" numpy
fi

printf 'export TORCH_MPI_BACKEND_PYTHON=%q\n' "${venv}/bin/python"
printf 'export TORCH_MPI_BACKEND_TORCH_SOURCE=%q\n' "$orig_tarball"
