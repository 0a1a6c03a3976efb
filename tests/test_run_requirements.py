"""aws-ofi-nccl's run requirements, read from the rendered recipe, are exactly what its libraries link.

A conda package's run requirements come from its own `run:` list and from the run_exports of what
its build and host requirements name, less what `ignore_run_exports` drops. The recipe is rendered
for every site with channelsmith.recipes (py-rattler-build); what each requirement exports is the
table below, each entry from the package's recipe; what each release links is read in
aws/aws-ofi-nccl at its tag. Every build or host requirement must be in the table, so a new one
cannot slip in without saying what it brings to the run side.
"""

from __future__ import annotations

import pytest

from channelsmith.recipes import load_stage0, render_variants, select_recipes, variant_config

# What each release's plugin library needs at run time, read at the release tag:
#   1.6.0   C only (configure.ac has no AC_PROG_CXX); libcudart.so (m4/check_pkg_cuda.m4 searches
#           cudaPointerGetAttributes in cudart); libfabric.so.1; no hwloc (required from 1.7.0).
#   1.19.2  C++17 (libstdc++); cudart_static (m4/check_pkg_cuda.m4: --enable-cudart-dynamic
#           defaults to no), which reaches the driver through cudaGetDriverEntryPoint, so it needs
#           a driver of its CUDA major and no libcudart.so; libfabric.so.1; libhwloc.
# Both: conda-forge's C runtime (libgcc) and glibc, as every ELF its compilers build.
LINKS = {
    "1.6.0": {"libgcc", "glibc", "libcudart.so", "libfabric.so.1"},
    "1.19.2": {"libgcc", "glibc", "libstdc++", "cuda driver", "libfabric.so.1", "libhwloc"},
}

# What each requirement puts on the run side, by package name (None: nothing):
#   cuda-cudart-dev  run_exports cuda-cudart: libcudart.so (conda-forge/cuda-cudart-feedstock
#                    recipe/meta.yaml at 04d8b19, 12.6.37); cuda-driver-dev exports nothing (same
#                    file: the driver is the system's)
#   libfabric-devel  run_exports libfabric1 >= the first release of its ABI, no upper bound
#                    (conda-forge/libfabric-feedstock recipe/meta.yaml at 056eb1f)
#   libhwloc         its run_export (conda-forge's shared-library convention; not read here)
#   cuda-version     a run requirement pinned with pin_compatible: a driver of that CUDA major
#   gcc/gxx/sysroot  the compilers' and stdlib's run_exports (libgcc, libstdcxx, __glibc)
EXPORTS = {
    "cuda-cudart-dev": "libcudart.so",
    "cuda-driver-dev": None,
    "cuda-version": None,
    "libfabric-devel": "libfabric.so.1",
    "libhwloc": "libhwloc",
    "gcc_linux-64": "libgcc",
    "gxx_linux-64": "libstdc++",
    "sysroot_linux-64": "glibc",
    "autoconf": None,
    "automake": None,
    "libtool": None,
    "pkg-config": None,
    "make": None,
}
PINNED = {"cuda-version": "cuda driver"}


def _name(spec: str) -> str:
    return spec.split()[0]


def run_side(requirements: dict) -> set[str]:
    """What ends up on the run side: run_exports of build and host (less ignored ones) plus `run`."""
    ignored = set((requirements.get("ignore_run_exports") or {}).get("from_package") or [])
    ignored_names = set((requirements.get("ignore_run_exports") or {}).get("by_name") or [])
    provided = set()
    for spec in [*requirements.get("build", []), *requirements.get("host", [])]:
        name = _name(spec)
        assert name in EXPORTS, f"{name}: add what its run_exports bring to EXPORTS"
        if name not in ignored and EXPORTS[name] is not None and name not in ignored_names:
            provided.add(EXPORTS[name])
    for spec in requirements.get("run", []):
        if isinstance(spec, dict) and "pin_compatible" in spec:
            pin = spec["pin_compatible"]
            # A driver of the same CUDA major: lower and upper bound both at the major version.
            assert (pin.get("lower_bound"), pin.get("upper_bound")) == ("x", "x"), pin
            provided.add(PINNED[pin["name"]])
        elif _name(spec).startswith("site-env-"):
            continue  # the site's profile (issue 41), no library: checked by the test
        else:
            raise AssertionError(f"unexpected run requirement {spec}: say in LINKS what needs it")
    return provided


@pytest.fixture(scope="module")
def plugin_outputs(repo_root):
    recipe = select_recipes(repo_root, ["nccl-ofi-plugin"])[0]
    outputs = []
    for rendered in render_variants(recipe, load_stage0(recipe), variant_config(repo_root, recipe)):
        data = rendered.recipe.to_dict()
        if data["package"]["name"] == "aws-ofi-nccl":
            outputs.append((dict(rendered.variant), data["requirements"]))
    return outputs


def test_every_site_and_release_is_rendered(plugin_outputs):
    assert {str(v["aws_ofi_nccl_version"]) for v, _ in plugin_outputs} == set(LINKS)


def test_run_side_is_exactly_what_each_releases_library_links(plugin_outputs):
    for variant, requirements in plugin_outputs:
        version = str(variant["aws_ofi_nccl_version"])
        expected = set(LINKS[version])
        if variant["libfabric_root"] != "conda":
            # The host's libfabric (Cray's), found through the rpath: no package provides it.
            expected.discard("libfabric.so.1")
        assert run_side(requirements) == expected, f"{variant['site']} ({version})"
        assert f"site-env-{variant['site']}" in requirements["run"]


def test_a_statically_linked_cuda_runtime_brings_no_cuda_cudart(plugin_outputs):
    for variant, requirements in plugin_outputs:
        ignored = (requirements.get("ignore_run_exports") or {}).get("from_package") or []
        static = str(variant["aws_ofi_nccl_version"]) != "1.6.0"
        assert ("cuda-cudart-dev" in ignored) == static, variant["site"]


def test_libfabric_is_pinned_below_abi_1_7_for_the_build_only(plugin_outputs):
    """The plugin is built against ABI FABRIC_1.6 (<1.20) so it also loads with Cray's 1.15; at run
    time any later libfabric.so.1 serves it (libfabric keeps its ABI across 1.x and 2.x), so no
    upper bound follows it to the run side."""
    for variant, requirements in plugin_outputs:
        host = {_name(s): s for s in requirements.get("host", [])}
        if variant["libfabric_root"] == "conda":
            assert host["libfabric-devel"] == "libfabric-devel >=1.14,<1.20"
        else:
            assert "libfabric-devel" not in host
        assert not any("libfabric" in str(s) for s in requirements.get("run", []))
