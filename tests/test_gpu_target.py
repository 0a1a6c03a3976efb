"""`channelsmith deploy` solves for the GPUs the environment will run on, not for the login node (issues 53, 70).

On a node where no GPU answers, py-rattler reports no `__cuda_arch`, and a `cuda-arch` constraint on
an absent virtual package holds: an sm_90-only build would install for an A100 partition. Nor does it
report `__cuda`, which every package with GPU code requires. Here the site profile (site-env-<site>,
built for real from recipes/site-env) declares its compute nodes' `__cuda_arch` and `__cuda`, or
--cuda-arch and --cuda-driver name them (the driver defaults to 12.0), and the deploy solves for them;
a GPU (or CONDA_OVERRIDE_CUDA_ARCH) that disagrees stops it unless --ignore-gpus-here, which it then
says; with neither, a package with GPU code is refused with a hint. A lock, a bundle and verify accept
an environment where every package's `cuda-arch` range admits the GPU there.

The channel: the real site-env packages; packages made from the records the real recipes render
(nccl, and pytorch-nccl-fault's libtorch and pytorch), each an empty package built by
py-rattler-build offline with the record's name, version, build string, run requirements and run
constraints (the exact libtorch pin resolved from the variant, as rattler-build resolves it); empty
stand-ins of the conda-forge packages they require (cuda-version with its feedstock's `__cuda`
constraint, python, triton, ...). No PyTorch or NCCL can be built here. `cuda-arch` is this channel's
own (recipes/cuda-arch, built for real) in a channel of its own, last, as docs/howto/deploy.md tells a site
to publish it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from channelsmith import channel
from channelsmith.build import build
from channelsmith.cli import main
from channelsmith.errors import DeployError, SolveError
from channelsmith.gpu import GpuTarget, SiteGpus, gpu_target, solve_virtual_packages
from channelsmith.recipes import RenderedOutput, render_recipe, select_recipes
from channelsmith.verify import check_prefix_gpus
from rattler.package_streaming import extract
from test_site_nccl_solve import _build, _stand_in

NCCL_RELEASE = "2.29.7-1"
CUDA = "12.9"
TORCH = "2.15.0"
# conda-forge's packages the rendered PyTorch and NCCL records require, as empty noarch stand-ins:
# name, version, run constraints. cuda-version X constrains `__cuda >=major(X)`
# (conda-forge/cuda-version-feedstock recipe/meta.yaml at d548d47).
FORGE = [
    ("cuda-version", "12.9", ["__cuda >=12"]), ("cuda-version", "13.0", ["__cuda >=13"]),
    ("python", "3.12.0", []), ("filelock", "3.18.0", []), ("jinja2", "3.1.6", []), ("fsspec", "2025.3.0", []),
    ("networkx", "3.4.2", []), ("setuptools", "80.9.0", []), ("sympy", "1.14.0", []),
    ("typing_extensions", "4.15.0", []), ("optree", "0.17.0", []), ("triton", "3.9.0", []),
]


@pytest.fixture(autouse=True)
def no_gpu_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test starts as a login node: no GPU answers unless a test overrides it."""
    monkeypatch.setenv("CONDA_OVERRIDE_CUDA_ARCH", "")
    monkeypatch.setenv("CONDA_OVERRIDE_CUDA", "")


def _run(output: RenderedOutput) -> list[str]:
    """The record's run requirements, the exact pin on a sibling (libtorch) resolved from the variant."""
    run = []
    for spec in output.requirements["run"]:
        if spec.startswith("{'pin_subpackage'"):
            name = spec.split("'name': '")[1].split("'")[0]
            version, build_string = output.variant[name].split(" ")
            spec = f"{name} =={version} {build_string}"
        assert not spec.startswith("{"), spec  # nothing else is left unresolved by the render
        run.append(spec)
    return run


def _package(output: RenderedOutput) -> str:
    """An empty package with the rendered record's name, version, build string, number and requirements."""
    return _stand_in(output.name, output.version, output.build_string, _run(output), noarch=bool(output.noarch),
                     down_priority=output.down_priority,
                     constrains=list(output.requirements.get("run_constraints", ())))


@pytest.fixture(scope="module")
def nccl_builds(repo_root: Path) -> dict[str, RenderedOutput]:
    """Site -> the real nccl recipe's CUDA 12.9 output for that site ("generic-13.0": generic's CUDA 13.0 one)."""
    (found,) = select_recipes(repo_root, ["nccl"])
    outputs = render_recipe(repo_root, found, {"nccl_version": NCCL_RELEASE}).outputs
    builds = {o.variant["site"]: o for o in outputs if o.name == "nccl" and o.variant["cuda_compiler_version"] == CUDA}
    builds["generic-13.0"] = next(o for o in outputs if o.variant["site"] == "generic"
                                  and o.variant["cuda_compiler_version"] == "13.0")
    return builds


@pytest.fixture(scope="module")
def torch_builds(repo_root: Path) -> dict[tuple[str, str, str], RenderedOutput]:
    """(package, site, CUDA) -> pytorch-nccl-fault's libtorch or pytorch record, PyTorch 2.15.0, Python 3.12:
    generic's for CUDA 12.9 and 13.0, Derecho's (sm_80 SASS only) for 12.9."""
    (found,) = select_recipes(repo_root, ["pytorch-nccl-fault"])
    outputs = render_recipe(repo_root, found, {"pytorch_version": TORCH, "python": "3.12"}).outputs
    wanted = {("generic", "12.9"), ("generic", "13.0"), ("derecho", "12.9")}
    return {(o.name, o.variant["site"], o.variant["cuda_compiler_version"]): o for o in outputs
            if o.name in ("libtorch", "pytorch") and (o.variant["site"], o.variant["cuda_compiler_version"]) in wanted}


@pytest.fixture(scope="module")
def channels(nccl_builds, torch_builds, site_env_packages, repo_root, tmp_path_factory) -> tuple[Path, Path]:
    """(site channel, this channel's cuda-arch channel)."""
    work = tmp_path_factory.mktemp("gpu-target")
    recipes = [_package(o) for o in [*nccl_builds.values(), *torch_builds.values()]]
    recipes += [_stand_in(name, version, "0", [], noarch=True, constrains=constrains)
                for name, version, constrains in FORGE]
    site = work / "site"
    channel.publish(site, [*_build(recipes, work), *site_env_packages.values()])
    cuda_arch = work / "cuda-arch"
    for capability in ("8.0", "9.0", "10.0"):
        build(repo_root, ["cuda-arch"], cuda_arch, overrides={"cuda_arch_version": capability})
    return site, cuda_arch


def _deploy(channels, tmp_path, *args: str) -> tuple[int, Path]:
    site, cuda_arch = channels
    prefix = tmp_path / "env"
    code = main(["deploy", *args, "--prefix", str(prefix), "--channel-dir", str(site), "-c", str(cuda_arch), "--json"])
    return code, prefix


def test_on_a_login_node_derechos_gpu_package_is_solved_for_its_a100s(nccl_builds, channels, tmp_path, capsys) -> None:
    code, prefix = _deploy(channels, tmp_path, "nccl", "site-env-derecho")
    out = capsys.readouterr().out
    assert code == 0
    report = json.loads(out)
    assert report["gpu"]["source"] == "profile" and report["gpu"]["profile"] == "site-env-derecho"
    gpu = report["gpu"]
    assert (gpu["cuda_arch"], gpu["cuda"], gpu["detected_cuda_arch"]) == ("8.0", "12.4", None)
    assert "solved for the compute nodes of site-env-derecho (__cuda_arch 8.0" in report["gpu"]["summary"]
    packages = {p["name"]: p for p in report["packages"]}
    assert packages["nccl"]["build"] == nccl_builds["derecho"].build_string
    # the cuda-arch installed is the capability solved for: sm_80 SASS, on A100s
    assert packages["cuda-arch"]["version"] == "8.0"
    assert (prefix / "share" / "nccl" / "build.txt").read_text().strip() == nccl_builds["derecho"].build_string


def test_the_human_output_says_which_gpus_the_solve_was_for(channels, tmp_path, capsys) -> None:
    site, cuda_arch = channels
    code = main(["deploy", "nccl", "site-env-derecho", "--prefix", str(tmp_path / "env"), "--channel-dir", str(site),
                 "-c", str(cuda_arch)])
    assert code == 0
    out = " ".join(capsys.readouterr().out.split())
    said = "GPUs: no GPU answers here: solved for the compute nodes of site-env-derecho (__cuda_arch 8.0, __cuda 12.4)"
    assert said in out


def test_without_gpus_named_a_gpu_package_is_refused_with_the_hint(channels, tmp_path, capsys) -> None:
    """generic's profile declares no GPUs: its nccl must not install unchecked."""
    code, prefix = _deploy(channels, tmp_path, "nccl")
    err = " ".join(capsys.readouterr().err.split())
    assert code == 2
    assert "no GPU answers here and no GPUs are named, but nccl has GPU code" in err
    assert "--cuda-arch 8.0" in err and "CONDA_OVERRIDE_CUDA_ARCH=8.0" in err
    assert not prefix.exists()


def test_the_override_pair_names_the_gpus(channels, tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("CONDA_OVERRIDE_CUDA", "12.9")
    monkeypatch.setenv("CONDA_OVERRIDE_CUDA_ARCH", "8.0")
    code, _ = _deploy(channels, tmp_path, "pytorch")
    report = json.loads(capsys.readouterr().out)
    assert code == 0
    gpu = report["gpu"]
    assert (gpu["source"], gpu["cuda_arch"], gpu["cuda"], gpu["cuda_source"]) == ("override", "8.0", "12.9", "override")
    assert {p["name"]: p["version"] for p in report["packages"]}["cuda-arch"] == "8.0"


@pytest.mark.parametrize("profile", [[], ["site-env-generic"]])
def test_cuda_arch_alone_installs_a_pytorch_where_no_gpu_answers(channels, torch_builds, tmp_path, capsys,
                                                                 profile) -> None:
    """Issue 70, 1: no GPU, no CONDA_OVERRIDE_CUDA, no profile or one that declares no driver (generic):
    the rendered libtorch and pytorch require `__cuda`, which the default driver (12.0) satisfies."""
    code, prefix = _deploy(channels, tmp_path, "pytorch", *profile, "--cuda-arch", "8.0")
    captured = capsys.readouterr()
    assert code == 0, captured.err
    report = json.loads(captured.out)
    gpu = report["gpu"]
    assert (gpu["cuda_arch"], gpu["source"], gpu["cuda"], gpu["cuda_source"]) == ("8.0", "option", "12.0", "default")
    assert gpu["summary"].startswith("solved for --cuda-arch 8.0 (__cuda_arch 8.0, __cuda 12.0, the default")
    packages = {p["name"]: p for p in report["packages"]}
    for name in ("libtorch", "pytorch"):
        assert packages[name]["build"] == torch_builds[(name, "generic", "12.9")].build_string
    assert "__cuda" in torch_builds[("libtorch", "generic", "12.9")].requirements["run"]
    # the default driver is a CUDA 12 one: the CUDA 12.9 build, its cuda-version and its NCCL
    assert (packages["cuda-version"]["version"], packages["cuda-arch"]["version"]) == ("12.9", "8.0")
    assert packages["nccl"]["build"].startswith("generic_cuda129_")
    assert (prefix / "share" / "pytorch" / "build.txt").is_file()


def test_the_gpus_line_says_the_default_driver_and_how_to_name_the_nodes_one(channels, tmp_path, capsys) -> None:
    site, cuda_arch = channels
    code = main(["deploy", "pytorch", "site-env-generic", "--cuda-arch", "8.0", "--prefix", str(tmp_path / "env"),
                 "--channel-dir", str(site), "-c", str(cuda_arch)])
    assert code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "GPUs: solved for --cuda-arch 8.0 (__cuda_arch 8.0, __cuda 12.0, the default" in out
    assert "pass --cuda-driver X.Y" in out


def test_cuda_driver_names_the_nodes_driver_and_only_a_cuda_13_one_takes_cuda_13_builds(channels, torch_builds,
                                                                                        nccl_builds, tmp_path,
                                                                                        capsys) -> None:
    # the default driver (12.0): conda-forge's cuda-version 13.0 constrains __cuda >=13
    code, prefix = _deploy(channels, tmp_path, "pytorch * cuda130*", "--cuda-arch", "9.0")
    err = " ".join(capsys.readouterr().err.split())
    assert code == 2 and "cuda-version" in err and "GPUs: solved for --cuda-arch 9.0" in err
    assert "--cuda-arch 8.0 (the lowest" not in err  # the hint does not ask for what was given
    assert not prefix.exists()
    code, prefix = _deploy(channels, tmp_path / "13", "pytorch * cuda130*", "--cuda-arch", "9.0", "--cuda-driver", "13.0")
    report = json.loads(capsys.readouterr().out)
    assert code == 0
    assert (report["gpu"]["cuda"], report["gpu"]["cuda_source"]) == ("13.0", "option")
    assert "__cuda 13.0 from --cuda-driver" in report["gpu"]["summary"]
    packages = {p["name"]: p for p in report["packages"]}
    assert packages["pytorch"]["build"] == torch_builds[("pytorch", "generic", "13.0")].build_string
    assert packages["nccl"]["build"] == nccl_builds["generic-13.0"].build_string


def test_a_driver_older_than_the_profiles_or_not_a_version_is_refused(channels, tmp_path, capsys) -> None:
    code, prefix = _deploy(channels, tmp_path, "pytorch", "site-env-derecho", "--cuda-driver", "12.0")
    err = " ".join(capsys.readouterr().err.split())
    assert code == 2 and "--cuda-driver 12.0 is older than the 12.4 the site profile site-env-derecho declares" in err
    assert not prefix.exists()
    code, prefix = _deploy(channels, tmp_path, "pytorch", "--cuda-arch", "8.0", "--cuda-driver", "12")
    err = " ".join(capsys.readouterr().err.split())
    assert code == 2 and "--cuda-driver '12' is not MAJOR.MINOR" in err and "nvidia-smi" in err
    assert not prefix.exists()


@pytest.mark.parametrize("profile", [[], ["site-env-derecho"]])
def test_a_gpu_here_that_disagrees_with_cuda_arch_stops_the_deploy(channels, tmp_path, capsys, monkeypatch,
                                                                   profile) -> None:
    """Issue 70, 2: an H100 answers (9.0), --cuda-arch says 8.0 (as Derecho's profile does): exit 2, nothing written."""
    _overridden_h100(monkeypatch)
    code, prefix = _deploy(channels, tmp_path, "pytorch", *profile, "--cuda-arch", "8.0")
    err = " ".join(capsys.readouterr().err.split())
    assert code == 2
    assert "CONDA_OVERRIDE_CUDA_ARCH=9.0 disagrees with --cuda-arch 8.0" in err and "--ignore-gpus-here" in err
    assert not prefix.exists()


def test_ignore_gpus_here_solves_for_the_named_gpus_and_says_so(channels, torch_builds, tmp_path, capsys,
                                                               monkeypatch) -> None:
    _overridden_h100(monkeypatch)
    code, prefix = _deploy(channels, tmp_path, "pytorch", "site-env-derecho", "--cuda-arch", "8.0",
                           "--ignore-gpus-here")
    report = json.loads(capsys.readouterr().out)
    assert code == 0
    gpu = report["gpu"]
    assert gpu["ignored_gpus_here"] is True
    assert (gpu["cuda_arch"], gpu["cuda"], gpu["cuda_source"]) == ("8.0", "12.4", "profile")
    assert (gpu["detected_cuda_arch"], gpu["detected_cuda"]) == ("9.0", "13.0")
    assert "set aside (--ignore-gpus-here): the environment may not run here" in gpu["summary"]
    packages = {p["name"]: p for p in report["packages"]}
    assert packages["libtorch"]["build"] == torch_builds[("libtorch", "derecho", "12.9")].build_string
    assert packages["cuda-arch"]["version"] == "8.0"
    # the human output says it too
    site, cuda_arch = channels
    code = main(["deploy", "pytorch", "site-env-derecho", "--ignore-gpus-here", "--prefix", str(tmp_path / "again"),
                 "--channel-dir", str(site), "-c", str(cuda_arch)])
    assert code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "GPUs: solved for the compute nodes of site-env-derecho (__cuda_arch 8.0, __cuda 12.4); this machine's " \
           "GPUs (__cuda_arch 9.0, __cuda 13.0) disagree and were set aside" in out
    # where the GPU here agrees, nothing is set aside
    monkeypatch.setenv("CONDA_OVERRIDE_CUDA_ARCH", "8.0")
    code, _ = _deploy(channels, tmp_path / "agrees", "pytorch", "site-env-derecho", "--ignore-gpus-here")
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["gpu"]["ignored_gpus_here"] is False and report["gpu"]["source"] == "override"


def test_capabilities_compare_as_versions(channels, tmp_path, capsys, monkeypatch) -> None:
    """Issue 70, 3: --cuda-arch 8.00 is Derecho's 8.0, and the 8.0 a GPU here reports."""
    code, _ = _deploy(channels, tmp_path, "pytorch", "site-env-derecho", "--cuda-arch", "8.00")
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["gpu"]["cuda_arch"] == "8.0"
    monkeypatch.setenv("CONDA_OVERRIDE_CUDA_ARCH", "8.0")
    monkeypatch.setenv("CONDA_OVERRIDE_CUDA", "12.4")
    code, _ = _deploy(channels, tmp_path / "gpu", "pytorch", "site-env-derecho", "--cuda-arch", "08.00")
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and (report["gpu"]["cuda_arch"], report["gpu"]["detected_cuda_arch"]) == ("8.0", "8.0")


def test_gpu_target_compares_versions_not_strings() -> None:
    derecho = SiteGpus("site-env-derecho", "8.0", "12.4")
    here = solve_virtual_packages([], GpuTarget("8.0", "12.4", "option", None, None, ""))
    assert gpu_target(here, derecho, "8.00").cuda_arch == "8.0"
    assert gpu_target(here, derecho, cuda_driver="12.4").cuda == "12.4"
    with pytest.raises(DeployError, match="disagrees with --cuda-arch 9.0"):
        gpu_target(here, None, "9.00")


def test_the_docs_override_line_agrees_with_derechos_profile(channels, tmp_path, capsys, monkeypatch, repo_root) -> None:
    """examples/derecho_gpus.sh (docs/howto/deploy.md), sourced as a site's install script would: its values are the
    ones site-env-derecho declares, so a deploy naming the profile takes them and agrees."""
    script = repo_root / "examples" / "derecho_gpus.sh"
    shown = subprocess.run(["bash", "-c", f'. "{script}" && env -0'], env={"PATH": "/usr/bin:/bin"}, check=True,
                           capture_output=True, text=True).stdout  # fmt: skip
    exported = dict(line.split("=", 1) for line in shown.split("\0") if line.startswith("CONDA_OVERRIDE_"))
    assert set(exported) == {"CONDA_OVERRIDE_CUDA", "CONDA_OVERRIDE_CUDA_ARCH"}
    for name, value in exported.items():
        monkeypatch.setenv(name, value)
    code, _ = _deploy(channels, tmp_path, "nccl", "site-env-derecho")
    report = json.loads(capsys.readouterr().out)
    assert code == 0
    gpu = report["gpu"]
    assert (gpu["source"], gpu["cuda_arch"], gpu["cuda"]) == ("override", "8.0", "12.4"), gpu
    assert {p["name"]: p["version"] for p in report["packages"]}["cuda-arch"] == "8.0"


@pytest.mark.parametrize("how", ["option", "override"])
def test_gpus_that_disagree_with_the_profile_stop_the_deploy(channels, tmp_path, capsys, monkeypatch, how) -> None:
    """An H100 (9.0) where the profile says A100 (8.0): exit 2, naming both, nothing written."""
    if how == "override":
        monkeypatch.setenv("CONDA_OVERRIDE_CUDA_ARCH", "9.0")
        monkeypatch.setenv("CONDA_OVERRIDE_CUDA", "12.9")
        code, prefix = _deploy(channels, tmp_path, "nccl", "site-env-derecho")
    else:
        code, prefix = _deploy(channels, tmp_path, "nccl", "site-env-derecho", "--cuda-arch", "9.0")
    err = " ".join(capsys.readouterr().err.split())
    assert code == 2
    assert "9.0" in err and "disagrees with the site profile site-env-derecho" in err and "__cuda_arch 8.0" in err
    assert not prefix.exists()


def test_an_sm90_only_build_is_refused_on_a_mixed_a100_h100_node(channels, tmp_path, capsys, monkeypatch) -> None:
    """A node with an A100 and an H100 reports 8.0: gpu-cluster's sm_90 build has no code for the A100."""
    monkeypatch.setenv("CONDA_OVERRIDE_CUDA_ARCH", "8.0")
    monkeypatch.setenv("CONDA_OVERRIDE_CUDA", "13.0")
    # named by its profile: the profile (9.0) and the node (8.0) disagree
    code, _ = _deploy(channels, tmp_path, "nccl", "site-env-gpu-cluster")
    assert code == 2 and "disagrees with the site profile site-env-gpu-cluster" in capsys.readouterr().err
    # named by its build string: the solver itself finds no cuda-arch for it
    code, prefix = _deploy(channels, tmp_path, "nccl * gpu_cluster_cuda*")
    err = capsys.readouterr().err
    assert code == 2 and "cuda-arch" in err
    assert not prefix.exists()


def test_a_bad_cuda_arch_says_what_to_write(channels, tmp_path, capsys) -> None:
    code, _ = _deploy(channels, tmp_path, "nccl", "--cuda-arch", "sm_80")
    assert code == 2 and "write MAJOR.MINOR" in capsys.readouterr().err


def test_the_arch_override_alone_is_not_silently_dropped(channels, tmp_path, capsys, monkeypatch) -> None:
    """py-rattler 0.28 reports __cuda_arch only with __cuda: CONDA_OVERRIDE_CUDA_ARCH alone would do nothing."""
    monkeypatch.setenv("CONDA_OVERRIDE_CUDA_ARCH", "8.0")
    monkeypatch.delenv("CONDA_OVERRIDE_CUDA")
    code, prefix = _deploy(channels, tmp_path, "nccl", "site-env-derecho")
    err = " ".join(capsys.readouterr().err.split())
    assert code == 2 and "set CONDA_OVERRIDE_CUDA=12.x" in err
    assert not prefix.exists()


def test_a_lock_solved_for_a100s_is_refused_on_an_h100(channels, tmp_path, capsys, monkeypatch) -> None:
    code, prefix = _deploy(channels, tmp_path, "nccl", "site-env-derecho")
    assert code == 0
    capsys.readouterr()
    monkeypatch.setenv("CONDA_OVERRIDE_CUDA_ARCH", "9.0")
    monkeypatch.setenv("CONDA_OVERRIDE_CUDA", "12.9")
    again = tmp_path / "again"
    code = main(["deploy", "--lock", str(prefix / "channelsmith.lock"), "--prefix", str(again)])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 2 and "report __cuda_arch 9.0" in err and "solved for __cuda_arch 8.0" in err
    assert "does not run on them: nccl (cuda-arch >=8.0,<9.0a0)" in err  # Derecho's sm_80 SASS only
    assert not again.exists()


def _overridden_h100(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONDA_OVERRIDE_CUDA_ARCH", "9.0")
    monkeypatch.setenv("CONDA_OVERRIDE_CUDA", "13.0")


def test_pack_says_which_gpus_the_bundle_is_for_and_its_install_refuses_other_gpus(channels, tmp_path, capsys,
                                                                                  monkeypatch) -> None:
    code, prefix = _deploy(channels, tmp_path, "nccl", "site-env-derecho")
    assert code == 0
    capsys.readouterr()
    bundle = tmp_path / "env.tar"
    assert main(["pack", "--lock", str(prefix / "channelsmith.lock"), "-o", str(bundle), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["cuda_arch"], report["site_profile"]) == ("8.0", "site-env-derecho")
    assert main(["pack", "--lock", str(prefix / "channelsmith.lock"), "-o", str(tmp_path / "again.tar")]) == 0
    assert "GPUs: solved for __cuda_arch 8.0 (site-env-derecho)" in " ".join(capsys.readouterr().out.split())
    # on an H100 the bundle is refused before anything is written
    _overridden_h100(monkeypatch)
    target = tmp_path / "h100-env"
    assert main(["deploy", "--bundle", str(bundle), "--prefix", str(target)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"but the bundle {bundle} (site-env-derecho) was solved for __cuda_arch 8.0" in err
    assert not target.exists()


def test_verify_refuses_an_environment_solved_for_other_gpus(channels, tmp_path, capsys, monkeypatch) -> None:
    code, prefix = _deploy(channels, tmp_path, "nccl", "site-env-derecho")
    assert code == 0
    capsys.readouterr()
    # where no GPU answers, verify says what the prefix was solved for and runs on (and runs the suite)
    said = "solved for __cuda_arch 8.0 (site-env-derecho); its GPU code runs where __cuda_arch is >=8.0,<9.0a0"
    assert check_prefix_gpus(prefix) == said
    _overridden_h100(monkeypatch)
    assert main(["verify", "--prefix", str(prefix)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "report __cuda_arch 9.0" in err and "(site-env-derecho) was solved for __cuda_arch 8.0" in err


def test_one_environment_for_two_gpu_generations_is_accepted_on_both(channels, torch_builds, tmp_path, capsys,
                                                                    monkeypatch, repo_root) -> None:
    """Issue 70, 4: generic's builds (cuda-arch >=8.0: sm_80 + sm_90 SASS and PTX), solved for the A100
    partition (8.0) by the docs' example, are accepted on the H100 partition (9.0) by deploy --lock,
    deploy --bundle and verify; Derecho's (sm_80 SASS only, <9.0) are still refused there."""
    site, cuda_arch = channels
    prefix = tmp_path / "env"
    env = {**os.environ, "CHANNELS": f"-c {site} -c {cuda_arch}", "PREFIX": str(prefix)}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    shown = subprocess.run(["bash", str(repo_root / "examples/two_gpu_generations.sh")], cwd=repo_root, env=env,
                           capture_output=True, text=True)  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    said = " ".join(shown.stdout.split())
    assert "GPUs: solved for --cuda-arch 8.0 (__cuda_arch 8.0, __cuda 12.4 from --cuda-driver)" in said
    lock = prefix / "channelsmith.lock"
    bundle = tmp_path / "env.tar"
    assert main(["pack", "--lock", str(lock), "-o", str(bundle), "--json"]) == 0
    packed = json.loads(capsys.readouterr().out)
    assert (packed["cuda_arch"], packed["runs_on"]) == ("8.0", ">=8.0")
    code, derecho = _deploy(channels, tmp_path / "derecho", "pytorch", "site-env-derecho")
    assert code == 0
    capsys.readouterr()
    _overridden_h100(monkeypatch)
    assert main(["deploy", "--lock", str(lock), "--prefix", str(tmp_path / "h100-lock")]) == 0
    assert main(["deploy", "--bundle", str(bundle), "--prefix", str(tmp_path / "h100-bundle")]) == 0
    assert check_prefix_gpus(prefix) == ("solved for __cuda_arch 8.0 (site-env-generic); its GPU code runs where "
                                         "__cuda_arch is >=8.0")
    capsys.readouterr()
    assert main(["deploy", "--lock", str(derecho / "channelsmith.lock"), "--prefix", str(tmp_path / "no")]) == 2
    err = " ".join(capsys.readouterr().err.split())
    ranges = [f"{name} (cuda-arch >=8.0,<9.0a0)" for name in ("libtorch", "nccl", "pytorch")]
    assert f"does not run on them: {', '.join(ranges)}" in err
    assert not (tmp_path / "no").exists()
    with pytest.raises(Exception, match="does not run on them"):
        check_prefix_gpus(derecho)


def test_our_cuda_arch_is_built_the_reference_way(channels, tmp_path) -> None:
    """Version X: run_constrained `__cuda_arch X` (exactly X) and run_exports `cuda-arch >=X` (the
    nvidia-virtual-packages README at 4936647f), noarch and empty."""
    _, cuda_arch = channels
    for capability in ("8.0", "9.0"):
        (package,) = (cuda_arch / "noarch").glob(f"cuda-arch-{capability}-*.conda")
        extract(package, tmp_path / capability)
        index = json.loads((tmp_path / capability / "info" / "index.json").read_text())
        exports = json.loads((tmp_path / capability / "info" / "run_exports.json").read_text())
        assert (index["noarch"], index["constrains"], index["depends"]) == ("generic", [f"__cuda_arch =={capability}"], [])
        assert exports == {"weak": [f"cuda-arch >={capability}"]}


@pytest.mark.parametrize("node, installs", [
    ("8.0", {"sass80", "sass80_sass90_ptx90"}),  # an A100, or a node with an A100 and an H100
    ("9.0", {"sass90", "sass80_sass90_ptx90"}),  # an H100
    ("10.0", {"sass80_sass90_ptx90"}),  # a B200: PTX only
    # no __cuda_arch (a login node): every build installs, which is why deploy never solves so for GPU code
    (None, {"sass80", "sass90", "sass80_sass90_ptx90"}),
])
def test_the_guard_follows_the_reference_semantics(channels, tmp_path, node, installs) -> None:
    """Over this channel's cuda-arch: a package requiring `cuda-arch R` installs where the node's
    lowest capability satisfies R. SASS-only builds carry an upper bound, builds with PTX none."""
    from channelsmith.deploy import solve
    from channelsmith.gpu import GpuTarget, detected_virtual_packages, solve_virtual_packages

    _, cuda_arch = channels
    packages = {"sass80": ">=8.0,<9.0a0", "sass90": ">=9.0,<10.0a0", "sass80_sass90_ptx90": ">=8.0"}
    work = tmp_path / "guard"
    built = _build([_stand_in(name, "1.0", "0", [f"cuda-arch {spec}"], noarch=True) for name, spec in packages.items()],
                   work)
    channel.publish(work / "channel", built)
    urls = [channel.channel_url(work / "channel"), channel.channel_url(cuda_arch)]
    virtual = solve_virtual_packages(detected_virtual_packages(), GpuTarget(node, "13.0", "option", None, None, ""))
    solvable = set()
    for name in packages:
        try:
            records = solve([name], urls, virtual)
        except SolveError:  # no cuda-arch for this node
            continue
        solvable.add(name)
        if node is not None:
            assert {str(r.version) for r in records if r.name.normalized == "cuda-arch"} == {node}
    assert solvable == installs


@pytest.mark.parametrize("option", [["--cuda-driver", "12.4"], ["--ignore-gpus-here"]])
def test_a_lock_or_bundle_install_takes_no_gpu_options(tmp_path, capsys, option) -> None:
    """A lock or a bundle installs what it lists; what it runs on is checked against the GPU here."""
    for source in (["--lock", str(tmp_path / "env.lock")], ["--bundle", str(tmp_path / "env.tar")]):
        assert main(["deploy", *source, *option, "--prefix", str(tmp_path / "env")]) == 2
        err = " ".join(capsys.readouterr().err.split())
        assert "--cuda-driver or --ignore-gpus-here" in err and option[0] in err
        assert not (tmp_path / "env").exists()
