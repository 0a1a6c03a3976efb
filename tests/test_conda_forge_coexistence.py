"""This channel's PyTorch, NCCL and site packages next to conda-forge (issue 41).

No PyTorch or NCCL package can be built here (their builds need conda-forge's CUDA packages), so the
solve tests use *records*: repodata entries whose name, version, build string, build number,
depends and constrains are what py-rattler-build renders from the real recipes, with the run_exports
and exact pins resolved as rattler-build resolves them. Nothing here claims a build. Next to them
sit stand-in records of conda-forge packages, each with the dependencies its feedstock declares at
the commit cited, and the `cuda-arch` metapackage as conda-forge's convention defines it. py-rattler
solves over these channels (strict priority, this channel first) with overridden virtual packages.

A GPU is modelled as the `__cuda_arch` and `__cuda` virtual packages py-rattler 0.28 reports on a
GPU node (VirtualPackage.detect(); tests/test_gpu_target.py covers the deploy on a node without one).
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest
import rattler
from rattler import BuildString, ChannelPriority, GenericVirtualPackage, PackageName, Version

from channelsmith.recipes import render_recipe, select_recipes
from conftest import SITES

REPO = Path(__file__).resolve().parents[1]
# The PyTorch release both GPU flavors build and conda-forge also has, with its torchvision/torchaudio.
TORCH = "2.6.0"
# The CUDA releases the recipes compile with (conda_build_config.yaml).
CUDA_VERSIONS = ("12.4", "12.6", "12.9", "13.0")


def _spec(item: str, variant: dict[str, str]) -> str:
    """A rendered requirement as a match spec (exact pins are resolved from the variant)."""
    if item.startswith("{'pin_subpackage'"):
        name = re.search(r"'name': '([^']+)'", item).group(1)
        version, build = variant[name].split(" ")
        return f"{name} =={version} {build}"
    return item


def _record(output, depends: list[str], constrains: list[str], subdir: str) -> dict:
    record = {
        "name": output.name,
        "version": output.version,
        "build": output.build_string,
        "build_number": int(output.build_string.rsplit("_", 1)[1]),
        "depends": depends,
        "constrains": constrains,
        "subdir": subdir,
    }
    # down_prioritize_variant: N, as rattler-build 0.73 writes it into index.json (checked by a real
    # build in tests/test_site_nccl_solve.py): N features named <name>-p-<i>.
    if output.down_priority:
        record["track_features"] = " ".join(f"{output.name}-p-{i}" for i in range(output.down_priority))
    return record


def _exports(version: str, names: list[str]) -> list[str]:
    """pin_subpackage(name, upper_bound="x.x") as rattler-build writes it into a consumer."""
    major, minor = version.split(".")[:2]
    return [f"{n} >={version},<{major}.{int(minor) + 1}.0a0" for n in names]


def _write_channel(root: Path, records: list[dict]) -> str:
    for subdir in ("linux-64", "noarch"):
        packages = {f"{r['name']}-{r['version']}-{r['build']}.conda": r for r in records if r["subdir"] == subdir}
        (root / subdir).mkdir(parents=True, exist_ok=True)
        (root / subdir / "repodata.json").write_text(
            json.dumps({"info": {"subdir": subdir}, "packages": {}, "packages.conda": packages})
        )
    return root.as_uri()


def _plain(name: str, version: str, depends: list[str] = (), constrains: list[str] = (), build: str = "0",
           subdir: str = "noarch") -> dict:
    number = int(build.rsplit("_", 1)[-1]) if build.rsplit("_", 1)[-1].isdigit() else 0
    return {"name": name, "version": version, "build": build, "build_number": number,
            "depends": list(depends), "constrains": list(constrains), "subdir": subdir}


@pytest.fixture(scope="module")
def ours(tmp_path_factory) -> tuple[str, dict]:
    """This channel: the rendered records of PyTorch 2.6.0 (both flavors), NCCL 2.29.7 (CUDA 12.4, 12.9 and 13.0),
    site-env."""
    records, rendered = [], {}
    for recipe, overrides in (
        ("pytorch-nccl-fault", {"pytorch_version": TORCH, "python": "3.12"}),
        ("pytorch-cray-mpich", {"pytorch_version": TORCH, "python": "3.12"}),
        ("nccl", {"nccl_version": "2.29.7-1"}),
        ("site-env", {}),
    ):
        (found,) = select_recipes(REPO, [recipe])
        for out in render_recipe(REPO, found, overrides).outputs:
            run = [_spec(s, out.variant) for s in out.requirements.get("run", ())]
            subdir = "noarch" if out.noarch else "linux-64"
            records.append(_record(out, run, list(out.requirements.get("run_constraints", ())), subdir))
            rendered.setdefault(out.name, []).append(out)
    # What this channel's environment needs from elsewhere, here so that the solve is about priority.
    return records, rendered


def _conda_forge(site_cuda: str = "126") -> list[dict]:
    """Stand-ins of conda-forge's packages, each with the dependencies its feedstock declares."""
    exports = _exports(TORCH, ["pytorch", "libtorch"])
    return [
        # pytorch-cpu-feedstock recipe/meta.yaml at be1ff5b057bb9ef95a0a8c35a4904d0579badffe (2.6.0,
        # CUDA 12.6, build 0 + 200 for CUDA + 100 for mkl): libtorch (83-84, 182-185), pytorch
        # pinning it exactly (322-356), pytorch-gpu (528-544).
        _plain("libtorch", TORCH, ["__cuda"], ["pytorch-gpu ==2.6.0", "pytorch-cpu ==99999999"],
               build="cuda126_mkl_h9e9ec48_300", subdir="linux-64"),
        _plain("pytorch", TORCH, ["libtorch ==2.6.0 cuda126_mkl_h9e9ec48_300", "__cuda", "triton 3.2.0",
                                  "python", "filelock", "fsspec", "jinja2", "networkx", "optree >=0.13.0",
                                  "setuptools", "sympy >=1.13.1,!=1.13.2", "typing_extensions >=4.10.0"],
               ["pytorch-gpu ==2.6.0", "pytorch-cpu ==99999999"],
               build="cuda126_mkl_py312_h30b5a27_300", subdir="linux-64"),
        _plain("pytorch-gpu", TORCH, ["pytorch 2.6.0 cuda*_mkl*300"], build="cuda126_mkl_h1234567_300"),
        # torchvision-feedstock recipe/recipe.yaml at 353fb14a7c8fdef8b24ad8337666e8e0da5eb792 (0.21.0,
        # CUDA 12.6 only): run `pytorch * [build=cuda126*]`, pillow, numpy, plus the run_exports of its
        # host libtorch and pytorch.
        _plain("torchvision", "0.21.0",
               ["python", f"pytorch * cuda{site_cuda}*", "pillow >=5.3.0,!=8.3.0,!=8.3.1", "numpy >=1.23.5", *exports],
               build=f"cuda{site_cuda}_py312_h7a3b9c1_0", subdir="linux-64"),
        # torchaudio-feedstock recipe/recipe.yaml at 4cdd48bb47aaffffa5943d8ecc07de5ab1b0a0ca (2.6.0):
        # run python, numpy, kaldi, `pytorch * cuda*`, plus its host pytorch's run_exports.
        _plain("torchaudio", TORCH, ["python", "numpy", "kaldi", "pytorch * cuda*", *exports],
               build=f"cuda_{site_cuda}py312h5c2d1e0_0", subdir="linux-64"),
        # What the PyTorch packages need from conda-forge, as empty records.
        *[_plain(n, v) for n, v in (
            ("python", "3.12.0"), ("filelock", "3.16.1"), ("fsspec", "2024.10.0"), ("jinja2", "3.1.4"),
            ("networkx", "3.4.2"), ("optree", "0.13.1"), ("setuptools", "75.8.0"), ("sympy", "1.13.1"),
            ("typing_extensions", "4.12.2"), ("triton", "3.2.0"), ("pillow", "11.1.0"), ("numpy", "2.2.2"),
            ("kaldi", "5.5.1112"), ("torch-peer-watcher", "1.0.0"),
        )],
        # cuda-version, one per CUDA release: X constrains `__cuda >=major(X)` (conda-forge/cuda-version-feedstock
        # recipe/meta.yaml at d548d47).
        *[_plain("cuda-version", v, constrains=[f"__cuda >={v.split('.')[0]}"]) for v in CUDA_VERSIONS],
        # conda-forge's own nccl (nccl-feedstock e73c479: 2.30.4, CUDA 12.9).
        _plain("nccl", "2.30.4.1", ["cuda-version >=12,<13.0a0"], build="h1a2b3c4_1", subdir="linux-64"),
        # The cuda-arch metapackage, one version per compute capability, as conda-incubator's
        # nvidia-virtual-packages README (4936647f) defines it: run_constrained `__cuda_arch {{ version }}`,
        # which py-rattler reads as ==X (MatchSpec("__cuda_arch 8.0").version is "==8.0").
        *[_plain("cuda-arch", cc, constrains=[f"__cuda_arch {cc}"]) for cc in ("8.0", "8.6", "9.0", "10.0", "12.0")],
    ]


def _solve(channels: list[str], specs: list[str], cuda_arch: str | None = "9.0") -> dict[str, rattler.RepoDataRecord]:
    virtual = [GenericVirtualPackage(PackageName("__unix"), Version("0"), BuildString("0")),
               GenericVirtualPackage(PackageName("__linux"), Version("6.1"), BuildString("0")),
               GenericVirtualPackage(PackageName("__glibc"), Version("2.28"), BuildString("0")),
               # the driver of the H100 host the docker-host and gpu-cluster profiles declare (13.0)
               GenericVirtualPackage(PackageName("__cuda"), Version("13.0"), BuildString("0"))]
    if cuda_arch:
        virtual.append(GenericVirtualPackage(PackageName("__cuda_arch"), Version(cuda_arch), BuildString("0")))
    records = asyncio.run(
        rattler.solve(channels, specs, gateway=rattler.Gateway(), platforms=["linux-64", "noarch"],
                      virtual_packages=virtual, channel_priority=ChannelPriority.Strict)
    )
    return {r.name.normalized: r for r in records}


@pytest.fixture(scope="module")
def channels(ours, tmp_path_factory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("coexist")
    return _write_channel(root / "internal", ours[0]), _write_channel(root / "conda-forge", _conda_forge())


def test_pytorch_torchvision_torchaudio_give_one_libtorch_ours_and_triton(channels, ours) -> None:
    """`conda install -c internal -c conda-forge pytorch torchvision torchaudio` with a site profile."""
    internal, forge = channels
    got = _solve([internal, forge], ["pytorch", "torchvision", "torchaudio", "site-env-generic"])
    assert got["libtorch"].channel.endswith("internal/") or "internal" in str(got["libtorch"].url)
    assert str(got["libtorch"].build).startswith("cuda126_ncclft_generic_")
    assert str(got["pytorch"].build).startswith("cuda126_ncclft_generic_py312_")
    assert str(got["triton"].version) == "3.2.0"
    assert "torchvision" in got and "torchaudio" in got
    # strict priority: conda-forge's nccl is hidden behind this channel's; the CUDA 12.6 PyTorch gets the 12.4 build
    assert str(got["nccl"].build).startswith("generic_cuda124_abortwake_")
    assert str(got["cuda-version"].version) == "12.6"


def test_without_the_libtorch_split_conda_forges_libtorch_joins_the_environment(channels, ours, tmp_path) -> None:
    """The failure issue 41 describes, modelled: a pytorch with its libraries inside and no libtorch output."""
    internal_records = [dict(r) for r in ours[0] if r["name"] != "libtorch"]
    for r in internal_records:
        r["depends"] = [d for d in r["depends"] if not d.startswith("libtorch ")]
    internal = _write_channel(tmp_path / "old", internal_records)
    got = _solve([internal, channels[1]], ["pytorch", "torchvision", "site-env-generic"])
    assert "h9e9ec48" in str(got["libtorch"].build)  # conda-forge's: a second libtorch in the process


def test_a_gpu_without_code_is_a_solver_error(channels) -> None:
    internal, forge = channels
    # Derecho's build has sm_80 SASS only: an H100 (9.0) has no code for it.
    with pytest.raises(Exception, match="cuda-arch|__cuda_arch|libtorch"):
        _solve([internal, forge], ["pytorch", "site-env-derecho"], cuda_arch="9.0")
    # on an A100 it installs; generic's 9.0+PTX runs on a Blackwell (10.0) too
    assert "libtorch" in _solve([internal, forge], ["pytorch", "site-env-derecho"], cuda_arch="8.0")
    assert "libtorch" in _solve([internal, forge], ["pytorch", "site-env-generic"], cuda_arch="10.0")
    # the site's NCCL alone follows the same rule
    with pytest.raises(Exception, match="cuda-arch|__cuda_arch|nccl"):
        _solve([internal, forge], ["nccl", "site-env-gpu-cluster"], cuda_arch="8.0")


def test_two_site_profiles_cannot_share_an_environment(channels) -> None:
    with pytest.raises(Exception, match="site-env"):
        _solve([channels[0]], ["site-env-derecho", "site-env-generic"], cuda_arch=None)


@pytest.mark.parametrize("package", ["nccl", "libtorch", "pytorch", "pytorch-gpu"])
def test_with_no_profile_named_the_generic_sites_build_is_chosen(channels, package) -> None:
    """Every other site's build carries a track_feature. (Here the tie-break alone happens to pick
    generic too; tests/test_site_nccl_solve.py has a channel where it picked gpu-cluster's.)"""
    got = _solve([channels[0], channels[1]], [package])
    build = str(got[package].build)
    site = build.split("_cuda")[0] if package == "nccl" else build.split("_")[2]
    assert site == "generic", build
    assert [n for n in got if n.startswith("site-env-")] == ["site-env-generic"]


@pytest.mark.parametrize("site", [s for s in SITES if s != "generic"])
def test_a_named_profile_still_gets_its_sites_builds(channels, site) -> None:
    arch = {"derecho": "8.0"}.get(site, "9.0")
    got = _solve([channels[0], channels[1]], ["pytorch", "nccl", f"site-env-{site}"], cuda_arch=arch)
    tag = site.replace("-", "_")
    assert str(got["nccl"].build).startswith(f"{tag}_cuda"), got["nccl"].build
    assert f"_{tag}_" in str(got["libtorch"].build) and f"_{tag}_py312_" in str(got["pytorch"].build)


@pytest.mark.parametrize("recipe", ["nccl", "nccl-ofi-plugin", "site-env", "pytorch-nccl-fault",
                                    "pytorch-cray-mpich", "pytorch-switchml"])
def test_every_site_build_but_generics_is_down_prioritised(recipe) -> None:
    (found,) = select_recipes(REPO, [recipe])
    overrides = {"python": "3.8" if recipe == "pytorch-switchml" else "3.12"} if recipe.startswith("pytorch") else {}
    outputs = render_recipe(REPO, found, overrides).outputs
    assert outputs
    for out in outputs:
        assert out.down_priority == (0 if out.variant["site"] == "generic" else 1), (out.name, out.build_string)


def test_every_site_of_the_matrix_is_excluded_by_the_other_profiles() -> None:
    text = (REPO / "recipes" / "site-env" / "recipe.yaml").read_text()
    for site in SITES:
        assert f'- if: site != "{site}"\n      then: site-env-{site} <0.0a0' in text


def test_cuda_arch_range_follows_each_sites_arch_list() -> None:
    """SASS runs on its own major only, PTX also on later ones."""
    import yaml

    for path in (REPO / "conda_build_config.yaml", REPO / "recipes" / "pytorch-switchml" / "variants.yaml"):
        config = yaml.safe_load(path.read_text())
        for archs, spec in zip(config["cuda_arch_list"], config["cuda_arch_range"], strict=True):
            entries = archs.split(";")
            low = min(float(e.replace("+PTX", "")) for e in entries)
            if "+PTX" in archs:
                assert spec == f">={low:.1f}", (path, archs, spec)
            else:
                high = max(int(float(e)) for e in entries) + 1
                assert spec == f">={low:.1f},<{high}.0a0", (path, archs, spec)


# The triton each release's Linux wheel pins (Requires-Dist in its METADATA on PyPI), at Python 3.11: exactly
# where the wheel does, as a compatible range where it gives one (2.15.0: `triton~=3.9.0`, issue 70).
TRITON = {"2.2.1": "triton ==2.2.0", "2.3.1": "triton ==2.3.1", "2.4.0": "triton ==3.0.0",
          "2.6.0": "triton ==3.2.0", "2.15.0": "triton >=3.9.0,<3.10.0a0"}


@pytest.mark.parametrize("recipe", ["pytorch-nccl-fault", "pytorch-cray-mpich"])
def test_render_triton_pins_and_the_exact_libtorch(recipe) -> None:
    (found,) = select_recipes(REPO, [recipe])
    outputs = render_recipe(REPO, found, {"python": "3.11"}).outputs
    libtorch = {(o.version, o.variant["site"], o.variant["cuda_compiler_version"]): o for o in outputs if o.name == "libtorch"}
    pytorch = [o for o in outputs if o.name == "pytorch"]
    assert pytorch and len(libtorch) == len(pytorch)
    for out in pytorch:
        run = out.requirements["run"]
        assert [s for s in run if s.startswith("triton")] == [TRITON[out.version]], out.version
        assert {"optree", "setuptools", "sympy"} <= {s.split(" ")[0] for s in run}
        # pytorch pins this very libtorch build (same version, site and CUDA), as conda-forge does exactly
        own = libtorch[(out.version, out.variant["site"], out.variant["cuda_compiler_version"])]
        assert out.variant["libtorch"] == f"{own.version} {own.build_string}"
        assert any("'pin_subpackage'" in s and "'exact': True" in s for s in run)
        assert own.requirements["run"][1].startswith("cuda-arch ")
    text = (REPO / "recipes" / recipe / "recipe.yaml").read_text()
    assert text.count('pin_subpackage("libtorch", upper_bound="x.x")') == 2  # libtorch's and pytorch's run_exports
    assert 'pin_subpackage("pytorch", upper_bound="x.x")' in text
    assert "pip_check: true" in text and "pip_check: false" not in text


def _our_cuda_arch(tmp_path: Path) -> str:
    """This channel's cuda-arch (recipes/cuda-arch), one record per version as the recipe renders it, in a
    channel of its own, as docs/howto/deploy.md tells a site to publish it (after conda-forge)."""
    (found,) = select_recipes(REPO, ["cuda-arch"])
    records = [dict(_plain(o.name, o.version, constrains=list(o.requirements["run_constraints"]),
                           build=o.build_string), build_number=0) for o in render_recipe(REPO, found, {}).outputs]
    assert {tuple(r["constrains"]) for r in records if r["version"] == "8.0"} == {("__cuda_arch ==8.0",)}
    return _write_channel(tmp_path / "cuda-arch", records)


def test_cuda_arch_is_conda_forges_where_the_mirror_has_it_and_ours_where_it_does_not(channels, ours, tmp_path) -> None:
    internal, forge = channels
    fallback = _our_cuda_arch(tmp_path)
    specs = ["pytorch", "site-env-derecho"]
    got = _solve([internal, forge, fallback], specs, cuda_arch="8.0")
    assert "conda-forge" in str(got["cuda-arch"].url) and str(got["cuda-arch"].version) == "8.0"
    # a mirror without conda-forge's cuda-arch (issue 53, 2: "cuda-arch >=8.0, no candidates")
    bare = _write_channel(tmp_path / "mirror", [r for r in _conda_forge() if r["name"] != "cuda-arch"])
    with pytest.raises(Exception, match="cuda-arch"):
        _solve([internal, bare], specs, cuda_arch="8.0")
    got = _solve([internal, bare, fallback], specs, cuda_arch="8.0")
    assert "cuda-arch/" in str(got["cuda-arch"].url) and str(got["cuda-arch"].version) == "8.0"
    # ours keeps the guard: Derecho's sm_80 build is still refused on an H100
    with pytest.raises(Exception, match="cuda-arch|__cuda_arch|libtorch"):
        _solve([internal, bare, fallback], specs, cuda_arch="9.0")


def test_a_mixed_a100_h100_node_reports_80_and_refuses_the_sm90_only_builds(channels) -> None:
    """The reference's warning: __cuda_arch is the LOWEST capability of the node's GPUs."""
    internal, forge = channels
    mixed = "8.0"
    # gpu-cluster's and docker-host's builds (sm_90 SASS only) have no code for the A100
    for site in ("gpu-cluster", "docker-host"):
        with pytest.raises(Exception, match="cuda-arch|__cuda_arch|libtorch|site-env"):
            _solve([internal, forge], ["pytorch", f"nccl * {site.replace('-', '_')}_cuda*"], cuda_arch=mixed)
    # generic's build (sm_80 SASS + sm_90 SASS and PTX) runs on both GPUs and installs
    assert "libtorch" in _solve([internal, forge], ["pytorch", "site-env-generic"], cuda_arch=mixed)
    # Derecho's (sm_80 SASS only, upper bound <9.0) installs too: the upper bound cannot see the H100
    # behind the A100. Derecho's nodes hold A100s only (docs/reference/recipes.md, "What each site build carries").
    assert "libtorch" in _solve([internal, forge], ["pytorch", "site-env-derecho"], cuda_arch=mixed)


@pytest.fixture(scope="module")
def every_cuda(tmp_path_factory) -> tuple[list[dict], dict[tuple[str, str], object]]:
    """This channel's generic records for every CUDA: pytorch-nccl-fault's libtorch and pytorch of each release
    (Python 3.11), every NCCL release and CUDA, site-env; and (version, CUDA) -> the rendered pytorch."""
    records, pytorch = [], {}
    for recipe, overrides in (("pytorch-nccl-fault", {"python": "3.11", "site": "generic"}),
                              ("nccl", {"site": "generic"}), ("site-env", {"site": "generic"})):
        (found,) = select_recipes(REPO, [recipe])
        for out in render_recipe(REPO, found, overrides).outputs:
            if out.name in ("pytorch-gpu", "pytorch-nccl-fault"):
                continue
            run = [_spec(s, out.variant) for s in out.requirements.get("run", ())]
            assert not any(s.startswith("{") for s in run), run  # every requirement rendered, none resolved here
            records.append(_record(out, run, list(out.requirements.get("run_constraints", ())),
                                   "noarch" if out.noarch else "linux-64"))
            if out.name == "pytorch":
                pytorch[(out.version, out.variant["cuda_compiler_version"])] = out
    forge = [_plain(n, v) for n, v in (
        ("python", "3.11.0"), ("filelock", "3.18.0"), ("jinja2", "3.1.6"), ("fsspec", "2025.3.0"),
        ("networkx", "3.4.2"), ("setuptools", "80.9.0"), ("sympy", "1.13.1"), ("sympy", "1.14.0"),
        ("typing_extensions", "4.15.0"), ("optree", "0.17.0"), ("torch-peer-watcher", "1.0.0"),
        *[("triton", v) for v in ("2.2.0", "2.3.1", "3.2.0", "3.9.0")])]
    forge += [_plain("cuda-version", v, constrains=[f"__cuda >={v.split('.')[0]}"]) for v in CUDA_VERSIONS]
    forge += [_plain("cuda-arch", "9.0", constrains=["__cuda_arch 9.0"])]
    return records + forge, pytorch


@pytest.mark.parametrize("torch, cuda, nccl_cuda", [("2.2.1", "12.4", "12.4"), ("2.3.1", "12.4", "12.4"),
                                                     ("2.6.0", "12.6", "12.4"), ("2.15.0", "12.9", "12.9"),
                                                     ("2.15.0", "13.0", "13.0")])
def test_each_pytorch_gets_the_nccl_of_its_cuda(every_cuda, tmp_path, torch, cuda, nccl_cuda) -> None:
    """Issue 70, 5: the rendered libtorch and pytorch pin the cuda-version of their CUDA minor, so a 12.4 or
    12.6 PyTorch gets the 12.4 NCCL build, a 12.9 one the 12.9 build (docs/reference/recipes.md), and CUDA 13 its own."""
    records, pytorch = every_cuda
    out = pytorch[(torch, cuda)]
    major, minor = cuda.split(".")
    assert f"cuda-version >={cuda},<{major}.{int(minor) + 1}.0a0" in out.requirements["run"]
    specs = [f"pytorch =={torch} {out.build_string}", "site-env-generic"]
    got = _solve([_write_channel(tmp_path / "pinned", records)], specs)
    assert str(got["cuda-version"].version) == cuda
    assert f"_cuda{nccl_cuda.replace('.', '')}_" in str(got["nccl"].build), got["nccl"].build
    # Without the pin (the records before issue 70), a CUDA 12 PyTorch got the 12.9 build (905) whatever its CUDA.
    unpinned = [dict(r, depends=[d for d in r["depends"] if not d.startswith("cuda-version")])
                if r["name"] in ("libtorch", "pytorch") else r for r in records]
    got = _solve([_write_channel(tmp_path / "unpinned", unpinned)], specs)
    assert "_cuda129_" in str(got["nccl"].build) or nccl_cuda == "13.0", got["nccl"].build


@pytest.mark.parametrize("available, solves", [(["3.9.0"], "3.9.0"), (["3.9.2"], "3.9.2"), (["3.9.0", "3.9.2"], "3.9.2"),
                                               (["3.10.0"], None), (["3.8.1"], None)])
def test_pytorch_2_15_takes_any_triton_3_9(every_cuda, tmp_path, available, solves) -> None:
    """Issue 70, 6: the rendered 2.15.0 record asks what its wheel asks (`triton~=3.9.0`): a channel holding
    only a later 3.9 patch release serves it, 3.10 and 3.8 do not."""
    records, pytorch = every_cuda
    out = pytorch[("2.15.0", "12.9")]
    records = [r for r in records if r["name"] != "triton"] + [_plain("triton", v) for v in available]
    channel = _write_channel(tmp_path / "c", records)
    specs = [f"pytorch ==2.15.0 {out.build_string}", "site-env-generic"]
    if solves is None:
        with pytest.raises(Exception, match="triton"):
            _solve([channel], specs)
    else:
        assert str(_solve([channel], specs)["triton"].version) == solves
