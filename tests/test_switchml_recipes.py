"""The SwitchML recipes render as designed, and their recipe checks discriminate.

Offline and fast: switchml-client and pytorch-switchml render for every variant with the toolchain
of PyTorch 1.7.1's era; the pytorch-switchml recipe checks fail on a stock PyTorch where they must
(no SwitchML linked, no warning without a config) and pass where gloo is unchanged.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import suite_process

from channelsmith.recipes import RenderedOutput, render_recipe, select_recipes

REPO = Path(__file__).resolve().parents[1]
CHECKS = REPO / "recipes" / "pytorch-switchml" / "tests" / "switchml_gloo_checks.py"
SITES = {"derecho", "docker-host", "generic", "gpu-cluster"}


def _outputs(name: str) -> list[RenderedOutput]:
    (recipe,) = select_recipes(REPO, [name])
    return render_recipe(REPO, recipe).outputs


@pytest.fixture(scope="module")
def torch_outputs() -> list[RenderedOutput]:
    return _outputs("pytorch-switchml")


def test_switchml_client_has_a_dummy_and_an_rdma_package() -> None:
    outputs = _outputs("switchml-client")
    assert sorted(o.variant["switchml_backend"] for o in outputs) == ["dummy", "rdma"]
    for output in outputs:
        assert output.name == "switchml-client"
        assert output.build_string.startswith(output.variant["switchml_backend"] + "_h")
        assert [p.name for p in output.patches] == [
            "0001-build-with-glog-0.6-and-0.7.patch",
            "0002-rdma-huge-page-size-without-libhugetlbfs.patch",
            "0003-finish-job-under-context-lock.patch",
        ]
        git_sources = {s.git: s.rev for s in output.sources if s.git}
        assert git_sources == {
            "https://github.com/p4lang/p4app-switchML.git": "b5c74a04fa66faa82acab154a4e21c8f76d913f2",
            "https://github.com/vectorclass/version2.git": "ff7450acfad9d3a7c6825d92cfb782a42ccfa71f",
        }
    rdma = next(o for o in outputs if o.variant["switchml_backend"] == "rdma")
    assert {"rdma-core", "libgrpc", "libprotobuf"} <= {s.split()[0] for s in rdma.requirements["host"]}


def test_pytorch_switchml_pins_the_toolchain_of_its_era(torch_outputs: list[RenderedOutput]) -> None:
    torch = [o for o in torch_outputs if o.name == "pytorch"]
    assert len(torch) == 2 * len(SITES)  # 2 switchml backends x the sites, one Python
    for output in torch:
        variant = output.variant
        assert output.version == "1.7.1"
        assert (variant["python"], variant["cuda_compiler_version"], variant["cxx_compiler_version"]) == ("3.8", "11.0", "9")
        assert variant["cuda_compiler"] == "nvcc"
        host = output.requirements["host"]
        for spec in ("cmake >=3.13,<4", "setuptools <70", "numpy >=1.19,<2", "nccl >=2.7,<3"):
            assert spec in output.requirements["build"] + host, spec
        assert f"switchml-client * {variant['switchml_backend']}_*" in host
        assert output.build_string.startswith(f"switchml_{variant['switchml_backend']}_cuda110_")
        assert [p.name for p in output.patches] == [
            "0001-c10d-cmake-link-switchml-client.patch",
            "0002-gloo-cuda-allreduce-through-switchml.patch",
        ]
        assert {s.git: s.rev for s in output.sources if s.git} == {
            "https://github.com/pytorch/pytorch.git": "57bffc3a8e4fee0cce31e1ff1f662ccf7b16db57"}
    # CUDA 11.0 cannot compile sm_90: Hopper sites get sm_80 code plus PTX.
    assert {o.variant["site"]: o.variant["cuda_arch_list"] for o in torch} == {
        "derecho": "8.0", "docker-host": "8.0+PTX", "generic": "8.0+PTX", "gpu-cluster": "8.0+PTX"}


def test_each_backend_and_site_compiles_libtorch_once(torch_outputs: list[RenderedOutput]) -> None:
    torch = [o for o in torch_outputs if o.name == "pytorch"]
    keys = {(o.variant["switchml_backend"], o.variant["site"]): o.staging[0].key for o in torch}
    assert set(keys) == {(b, s) for b in ("dummy", "rdma") for s in SITES}
    assert len(set(keys.values())) == len(keys)


def test_metapackage_selects_the_flavor_backend_and_site(torch_outputs: list[RenderedOutput]) -> None:
    metas = [o for o in torch_outputs if o.name == "pytorch-switchml"]
    assert len(metas) == 2 * len(SITES)
    for meta in metas:
        backend, site = meta.variant["switchml_backend"], meta.variant["site"]
        assert meta.noarch == "generic"
        assert f"pytorch ==1.7.1 switchml_{backend}_cuda110_{site.replace('-', '_')}_*" in meta.requirements["run"]


def test_torch_switchml_builds_per_python_and_backend_and_pins_its_torch_exactly() -> None:
    outputs = _outputs("torch-switchml")
    combos = {(o.variant["python"], o.variant["switchml_backend"]) for o in outputs}
    assert combos == {(py, b) for py in ("3.10", "3.11", "3.12") for b in ("dummy", "rdma")}
    for output in outputs:
        backend = output.variant["switchml_backend"]
        assert output.build_string.startswith(f"torch2130_{backend}_py")
        assert "pytorch ==2.13.0" in output.requirements["host"]
        assert f"switchml-client * {backend}_*" in output.requirements["run"]
        # resolved by the engine at build time to the host pytorch's exact version and build string
        assert "{'pin_compatible': {'name': 'pytorch', 'exact': True}}" in output.requirements["run"]
        assert [s.path for s in output.sources] == ["src"]


def _run_check(check: str, prefix: Path) -> subprocess.CompletedProcess[str]:
    # The checks read switchml-client's template from sys.prefix; point it at a fake prefix. Forked from this
    # test process's fork server, which imported this torch once (`linked` imports it; the other checks start
    # their torch.distributed child as an interpreter of its own, as the recipe's test does). Those children
    # stay interpreters (a torch import each, `no-config` and `groups`): the script starts them itself, as it
    # does in the recipe's test environment, and `groups` proves that the child's process ends cleanly, its
    # interpreter's finalization included, which a child of the fork server (ended by os._exit) would skip.
    code = (f"import sys, runpy; sys.prefix = {str(prefix)!r}; sys.argv = ['checks', {check!r}]; "
            f"runpy.run_path({str(CHECKS)!r}, run_name='__main__')")
    return suite_process.run_argv([sys.executable, "-c", code], dict(os.environ), timeout=300)


@pytest.fixture
def template_prefix(tmp_path: Path) -> Path:
    """A prefix with a switchml.cfg template shaped like switchml-client's (general + dummy sections)."""
    share = tmp_path / "share" / "switchml"
    share.mkdir(parents=True)
    (share / "switchml.cfg").write_text(
        "[general]\nrank = 0\nnum_workers = 1\nnum_worker_threads = 4\nbackend = dummy\n"
        "[backend.dummy]\nbandwidth = 100000.0\nprocess_packets = true\n"
    )
    return tmp_path


def test_recipe_checks_reject_a_stock_pytorch_and_accept_gloo_paths(template_prefix: Path) -> None:
    """On a PyTorch without SwitchML: `linked` and `no-config` fail; `groups` (CPU on gloo) passes."""
    pytest.importorskip("torch", reason="torch is not installed (bash scripts/install-test-deps.sh installs it)")
    linked = _run_check("linked", template_prefix)
    assert linked.returncode == 1 and "SwitchML is not linked" in linked.stdout
    no_config = _run_check("no-config", template_prefix)
    assert no_config.returncode == 1 and "the SwitchML warning was not printed" in no_config.stdout
    groups = _run_check("groups", template_prefix)
    assert groups.returncode == 0, groups.stdout + groups.stderr
    assert "groups: OK" in groups.stdout
