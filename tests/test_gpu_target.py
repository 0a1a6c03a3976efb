"""`channelsmith deploy` solves for the GPUs the environment will run on, not for the login node (issue 53).

On a node where no GPU answers, py-rattler reports no `__cuda_arch`, and a `cuda-arch` constraint on
an absent virtual package holds: an sm_90-only build would install for an A100 partition. Here the
site profile (site-env-<site>, built for real from recipes/site-env) declares its compute nodes'
`__cuda_arch` and `__cuda`, and the deploy solves for them; a GPU (or CONDA_OVERRIDE_CUDA_ARCH, or
--cuda-arch) that disagrees stops it; with neither, a package with GPU code is refused with a hint.

The channel: the real site-env packages; stand-ins of each site's nccl (empty packages built by
py-rattler-build, offline) with the name, version, build string and run requirements the real
nccl recipe renders for that site (pin_compatible resolved as rattler-build resolves it); a
stand-in of conda-forge's cuda-version. `cuda-arch` is this channel's own (recipes/cuda-arch, built
for real) in a channel of its own, last, as docs/deploy.md tells a site to publish it.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from channelsmith import channel
from channelsmith.build import build
from channelsmith.cli import main
from channelsmith.errors import SolveError
from channelsmith.recipes import render_recipe, select_recipes
from channelsmith.verify import check_prefix_gpus
from rattler.package_streaming import extract
from test_site_nccl_solve import _build, _stand_in

NCCL_RELEASE = "2.29.7-1"
CUDA = "12.9"


@pytest.fixture(autouse=True)
def no_gpu_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test starts as a login node: no GPU answers unless a test overrides it."""
    monkeypatch.setenv("CONDA_OVERRIDE_CUDA_ARCH", "")
    monkeypatch.setenv("CONDA_OVERRIDE_CUDA", "")


def _nccl_run(output) -> list[str]:
    major = int(CUDA.split(".")[0])
    return [f"cuda-version >={CUDA},<{major + 1}.0a0" if s.startswith("{'pin_compatible'") else s
            for s in output.requirements["run"]]


@pytest.fixture(scope="module")
def nccl_builds(repo_root: Path) -> dict[str, object]:
    """Site -> the real nccl recipe's CUDA 12.9 output for that site."""
    (found,) = select_recipes(repo_root, ["nccl"])
    outputs = render_recipe(repo_root, found, {"nccl_version": NCCL_RELEASE, "cuda_compiler_version": CUDA}).outputs
    return {o.variant["site"]: o for o in outputs if o.name == "nccl"}


@pytest.fixture(scope="module")
def channels(nccl_builds, site_env_packages, repo_root, tmp_path_factory) -> tuple[Path, Path]:
    """(site channel, this channel's cuda-arch channel)."""
    work = tmp_path_factory.mktemp("gpu-target")
    recipes = [_stand_in("nccl", o.version, o.build_string, _nccl_run(o), noarch=False, down_priority=o.down_priority)
               for o in nccl_builds.values()]
    recipes.append(_stand_in("cuda-version", CUDA, "0", [], noarch=True))
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


@pytest.mark.parametrize("how", ["option", "override"])
def test_naming_the_gpus_installs_it(channels, tmp_path, capsys, monkeypatch, how) -> None:
    monkeypatch.setenv("CONDA_OVERRIDE_CUDA", "12.9")
    if how == "override":
        monkeypatch.setenv("CONDA_OVERRIDE_CUDA_ARCH", "8.0")
        code, _ = _deploy(channels, tmp_path, "nccl")
    else:
        code, _ = _deploy(channels, tmp_path, "nccl", "--cuda-arch", "8.0")
    report = json.loads(capsys.readouterr().out)
    assert code == 0
    assert (report["gpu"]["source"], report["gpu"]["cuda_arch"]) == (how, "8.0")
    assert {p["name"]: p["version"] for p in report["packages"]}["cuda-arch"] == "8.0"


def test_the_docs_override_line_agrees_with_derechos_profile(channels, tmp_path, capsys, monkeypatch, repo_root) -> None:
    """examples/derecho_gpus.sh (docs/deploy.md), sourced as a site's install script would: its values are the
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
    # where no GPU answers, verify says what the prefix was solved for (and runs the suite)
    assert check_prefix_gpus(prefix) == "solved for __cuda_arch 8.0 (site-env-derecho)"
    _overridden_h100(monkeypatch)
    assert main(["verify", "--prefix", str(prefix)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "report __cuda_arch 9.0" in err and "(site-env-derecho) was solved for __cuda_arch 8.0" in err


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
