"""recipes/torch-mpi-backend as the engine renders it: the mpich-cuda site and the reconstructed variants.

Rendering only (py-rattler-build, offline, about a second); the build itself is tested by
tests/test_torch_mpi_backend.py (CPU, marker `buildsh`) and tests/test_cudampi_gpu.py (marker `gpu`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from channelsmith.patches import parse_patch
from channelsmith.recipes import load_stage0, render_variants, select_recipes, variant_config

REPO = Path(__file__).resolve().parents[1]
RECIPE_DIR = REPO / "recipes" / "torch-mpi-backend"
# The reconstructed variants: the series that adapts 2.6.0's file to each release's header.
COMPAT = {
    "2.11.0": "../../patches/pytorch/2.6.0/torch-2.11-compat/",
    "2.14.1": "../../patches/pytorch/2.6.0/torch-2.14-compat/",
    "2.15.0": "../../patches/pytorch/2.6.0/torch-2.14-compat/",
}


@pytest.fixture(scope="module")
def rendered() -> list[tuple[dict[str, str], dict[str, Any]]]:
    (recipe,) = select_recipes(REPO, ["torch-mpi-backend"])
    variants = render_variants(recipe, load_stage0(recipe), variant_config(REPO, recipe))
    return [({k: str(v) for k, v in r.variant.items()}, r.recipe.to_dict()) for r in variants]


def _pick(rendered, **wanted: str) -> list[dict[str, Any]]:
    return [data for variant, data in rendered if all(variant.get(k) == v for k, v in wanted.items())]


def test_mpich_cuda_site_builds_against_its_own_mpich_root(rendered) -> None:
    outputs = _pick(rendered, site_mpi="mpich-cuda")
    # Every PyTorch version of the recipe, for every Python of the matrix.
    assert len(outputs) == 6 * 3
    for data in outputs:
        build = data["build"]
        assert build["script"]["env"]["TORCH_MPI_BACKEND_SITE_MPI"] == "mpich-cuda"
        assert build["script"]["env"]["TORCH_MPI_BACKEND_MPI_ROOT"] == "/opt/mpich-cuda"
        assert "_mpich_cuda_py" in build["string"]
        # The site's MPICH stays where it is: its runpath is kept, and no MPI package enters the env.
        assert "/opt/mpich-cuda/**" in build["dynamic_linking"]["rpath_allowlist"]
        host = [str(spec) for spec in data["requirements"]["host"]]
        assert not [spec for spec in host if spec.split()[0] in ("mpich", "openmpi")]
        # mpiexec lives outside the environment there, so the two-rank package test is not rendered.
        assert "mpi_smoke.py" not in str(data.get("tests"))


def test_other_sites_keep_no_site_root_on_the_runpath(rendered) -> None:
    for site_mpi in ("mpich", "cray-mpich"):
        for data in _pick(rendered, site_mpi=site_mpi):
            assert data["build"]["dynamic_linking"]["rpath_allowlist"] == ["/opt/cray/**"]
    assert all("mpi_smoke.py" in str(data["tests"]) for data in _pick(rendered, site_mpi="mpich"))


@pytest.mark.parametrize("version", sorted(COMPAT))
def test_reconstructed_variants_compile_2_6_0s_file_with_their_series(rendered, version: str) -> None:
    data = _pick(rendered, pytorch_version=version, site_mpi="mpich-cuda", python="3.12")[0]
    (source,) = data["source"]
    assert source["url"].endswith("/v2.6.0/pytorch-v2.6.0.tar.gz")
    compat = [p for p in source["patches"] if p.startswith(COMPAT[version])]
    assert source["patches"][0].startswith("../../patches/pytorch/2.6.0/cuda-aware-mpi/") and len(compat) == 2
    assert len(source["patches"]) == 3
    assert "torch/csrc/distributed/c10d/ProcessGroupMPI.hpp" in source["filter"]
    for patch in compat:
        header = parse_patch((RECIPE_DIR / patch).resolve()).header
        assert header.reconstructed
        # compile-check compiles the series against this release's wheel headers.
        assert version in header.compiles_against
    assert data["build"]["script"]["env"]["TORCH_MPI_BACKEND_SOURCE_VERSION"] == "2.6.0"
    assert f"pytorch =={version} cuda*" in [str(s) for s in data["requirements"]["host"]]


@pytest.mark.parametrize("version", ["2.3.1", "2.4.0", "2.6.0"])
def test_released_versions_compile_their_own_file(rendered, version: str) -> None:
    for data in _pick(rendered, pytorch_version=version):
        assert data["build"]["script"]["env"]["TORCH_MPI_BACKEND_SOURCE_VERSION"] == version
        (source,) = data["source"]
        assert source["url"].endswith(f"/v{version}/pytorch-v{version}.tar.gz")
        assert not [p for p in source["patches"] if p.startswith(tuple(COMPAT.values()))]
