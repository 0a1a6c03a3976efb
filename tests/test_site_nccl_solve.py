"""A channel holding several sites' NCCL builds gives each site's environment its own site's NCCL.

nccl and aws-ofi-nccl are compiled per site (GPU architectures, libfabric), but nothing a PyTorch
requires at run time names the site: a bare `nccl`, or the run_export `nccl >=V,<3.0a0`. The
site-env-<site> package every flavor requires constrains both to its own site's builds (issue 33).
With no profile named, the generic site's builds are taken on purpose: every other site's carry a
track_feature (issue 41), and `channelsmith deploy` refuses a site build nobody named.

The channel is real and indexed by channelsmith's own publish: the site-env packages built for real
from recipes/site-env (``site_env_packages``), plus stand-ins of nccl and aws-ofi-nccl (empty
packages built by py-rattler-build, offline) whose names, versions, build strings and build numbers
are those the real recipes render for each site; py-rattler solves against it.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
from channelsmith import channel
from channelsmith.cli import main
from channelsmith.deploy import solve
from channelsmith.errors import SolveError
from channelsmith.recipes import RenderedOutput, render_recipe, select_recipes
from rattler_build import Stage0Recipe, ToolConfiguration, VariantConfig

from conftest import SITES

# One NCCL release every site builds: the stand-ins share version and build number, and differ
# only in the site of their build string, as the real builds of one channel do.
NCCL_RELEASE = "2.29.7-1"


def _outputs(repo_root: Path, recipe: str, package: str, **overrides: str) -> dict[str, RenderedOutput]:
    """Site -> the output ``package`` as the real ``recipe`` renders it."""
    (found,) = select_recipes(repo_root, [recipe])
    outputs = render_recipe(repo_root, found, overrides).outputs
    return {o.variant["site"]: o for o in outputs if o.name == package}


def _stand_in(name: str, version: str, string: str, run: list[str], noarch: bool, down_priority: int = 0,
              constrains: list[str] = ()) -> str:
    noarch_line = "  noarch: generic\n" if noarch else ""
    number = string.rsplit("_", 1)[-1]
    # The engine turns down_prioritize_variant into the package's track_features, as for the real recipes.
    return (
        f'package:\n  name: {name}\n  version: "{version}"\n'
        f'build:\n  number: {number}\n  string: "{string}"\n{noarch_line}'
        f"  variant:\n    down_prioritize_variant: {down_priority}\n"
        f"  script:\n    - mkdir -p $PREFIX/share/{name}\n"
        f"    - echo {string} > $PREFIX/share/{name}/build.txt\n"
        f"requirements:\n  run: {json.dumps(run)}\n  run_constraints: {json.dumps(list(constrains))}\n"
        f"about:\n  license: Apache-2.0\n  summary: channelsmith test stand-in for {name} {string}\n"
    )


def _build(recipes: list[str], work: Path) -> list[Path]:
    empty = channel.ensure_channel(work / "empty-channel")
    packages = []
    for text in recipes:
        results = Stage0Recipe.from_yaml(text, recipe_dir=tempfile.mkdtemp(prefix="recipe-", dir=work)).run_build(
            variant_config=VariantConfig(),
            tool_config=ToolConfiguration(test_strategy="skip"),
            output_dir=str(work / "output"),
            channels=[channel.channel_url(empty)],
            no_include_recipe=True,
        )
        packages.extend(path for result in results for path in result.packages)
    return packages


@pytest.fixture(scope="module")
def outputs(repo_root: Path) -> dict[str, dict[str, RenderedOutput]]:
    """Package -> site -> rendered output, from the real nccl and nccl-ofi-plugin recipes."""
    return {
        "nccl": _outputs(repo_root, "nccl", "nccl", nccl_version=NCCL_RELEASE),
        "aws-ofi-nccl": _outputs(repo_root, "nccl-ofi-plugin", "aws-ofi-nccl"),
    }


@pytest.fixture(scope="module")
def rendered(outputs: dict[str, dict[str, RenderedOutput]]) -> dict[str, dict[str, tuple[str, str]]]:
    """Package -> site -> (version, build string)."""
    return {package: {site: (o.version, o.build_string) for site, o in sites.items()} for package, sites in outputs.items()}


@pytest.fixture(scope="module")
def site_packages(
    outputs: dict[str, dict[str, RenderedOutput]],
    site_env_packages: dict[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str | None, list[Path]]:
    """Site -> its site-env, nccl and aws-ofi-nccl files (None -> the PyTorch stand-in of no site)."""
    work = tmp_path_factory.mktemp("site-builds")
    by_site: dict[str | None, list[Path]] = {}
    for sites in outputs.values():
        for site, o in sites.items():
            # The site's profile, which the real recipe requires too (its other run requirements,
            # cuda-arch and the CUDA runtime, are not in this channel).
            assert f"site-env-{site}" in o.requirements["run"]
            recipe = _stand_in(o.name, o.version, o.build_string, [f"site-env-{site}"], noarch=False,
                               down_priority=o.down_priority)
            by_site.setdefault(site, []).extend(_build([recipe], work))
    for name, path in site_env_packages.items():
        by_site.setdefault(name.removeprefix("site-env-"), []).append(path)
    # What a PyTorch flavor asks of NCCL at run time: the run_export's major pin, no site.
    by_site[None] = _build([_stand_in("pytorch", "2.6.0", "cray_mpich_0", ["nccl >=2.21.5.1,<3.0a0"], noarch=True)], work)
    return by_site


@pytest.fixture(scope="module")
def two_site_channel(site_packages: dict[str | None, list[Path]], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An indexed channel: every site's site-env, nccl and aws-ofi-nccl, and a PyTorch stand-in."""
    channel_dir = tmp_path_factory.mktemp("two-sites") / "channel"
    channel.publish(channel_dir, [path for paths in site_packages.values() for path in paths])
    return channel_dir


@pytest.fixture(scope="module")
def no_generic_channel(site_packages: dict[str | None, list[Path]], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same channel without the generic site's builds and profile."""
    channel_dir = tmp_path_factory.mktemp("no-generic") / "channel"
    channel.publish(channel_dir, [path for site, paths in site_packages.items() if site != "generic" for path in paths])
    return channel_dir


def test_the_channel_holds_every_sites_nccl_at_one_version_and_build_number(rendered, two_site_channel) -> None:
    repodata = json.loads((two_site_channel / "linux-64" / "repodata.json").read_text())
    listed = [*repodata.get("packages", {}).values(), *repodata.get("packages.conda", {}).values()]
    nccl = sorted((p["name"], p["version"], p["build"]) for p in listed if p["name"] == "nccl")
    assert len(nccl) == len(SITES)
    assert len({(version, build.rsplit("_", 1)[-1]) for _, version, build in nccl}) == 1
    assert {build.split("_cuda")[0] for _, _, build in nccl} == {site.replace("-", "_") for site in SITES}


@pytest.mark.parametrize("site", SITES)
def test_a_site_profile_gets_its_own_sites_nccl_and_plugin(rendered, two_site_channel, site: str) -> None:
    records = solve(["pytorch", "aws-ofi-nccl", f"site-env-{site}"], [channel.channel_url(two_site_channel)])
    chosen = {r.name.normalized: (str(r.version), str(r.build)) for r in records}
    assert chosen["nccl"] == rendered["nccl"][site]
    # Derecho's plugin is 1.6.0 while other sites build 1.19.2: unconstrained, the solver would take
    # the newer plugin of another site, linked to a libfabric Derecho does not have.
    assert chosen["aws-ofi-nccl"] == rendered["aws-ofi-nccl"][site]


def test_an_explicit_other_sites_nccl_conflicts_with_the_site_profile(two_site_channel) -> None:
    with pytest.raises(SolveError) as caught:
        solve(["nccl * gpu_cluster_*", "site-env-derecho"], [channel.channel_url(two_site_channel)])
    assert "nccl" in caught.value.message


def test_channelsmith_deploy_installs_the_sites_own_nccl(rendered, two_site_channel, tmp_path, capsys) -> None:
    prefix = tmp_path / "env"
    code = main(["deploy", "pytorch", "site-env-derecho", "--prefix", str(prefix),
                 "--channel-dir", str(two_site_channel), "--json"])
    assert code == 0
    packages = {p["name"]: p for p in json.loads(capsys.readouterr().out)["packages"]}
    assert packages["nccl"]["build"] == rendered["nccl"]["derecho"][1]
    installed = (prefix / "share" / "nccl" / "build.txt").read_text().strip()
    assert installed == rendered["nccl"]["derecho"][1]


def test_with_no_profile_named_the_generic_sites_nccl_is_chosen(rendered, two_site_channel) -> None:
    """Every other site's nccl carries a track_feature: the solver takes generic's on purpose."""
    for specs in (["nccl"], ["pytorch"], [f"nccl =={NCCL_RELEASE.replace('-', '.')}"]):
        records = solve(specs, [channel.channel_url(two_site_channel)])
        chosen = {r.name.normalized: (str(r.version), str(r.build)) for r in records}
        assert chosen["nccl"] == rendered["nccl"]["generic"], specs
        assert "site-env-generic" in chosen, specs
    nccl = {str(r.build): list(r.track_features) for r in solve(["nccl", "site-env-gpu-cluster"],
                                                                 [channel.channel_url(two_site_channel)])}
    assert nccl[rendered["nccl"]["gpu-cluster"][1]] == ["nccl-p-0"]


def test_channelsmith_deploy_nccl_alone_installs_the_generic_sites_build(rendered, two_site_channel, tmp_path,
                                                                          capsys) -> None:
    """The case of issue 41: `channelsmith deploy nccl` got whichever site the tie-break chose."""
    prefix = tmp_path / "env"
    code = main(["deploy", "nccl", "--prefix", str(prefix), "--channel-dir", str(two_site_channel), "--json"])
    assert code == 0
    packages = {p["name"]: p for p in json.loads(capsys.readouterr().out)["packages"]}
    assert packages["nccl"]["build"] == rendered["nccl"]["generic"][1]
    assert set(packages) == {"nccl", "site-env-generic"}


def test_channelsmith_deploy_refuses_a_site_build_no_profile_names(rendered, no_generic_channel, tmp_path,
                                                                   capsys) -> None:
    prefix = tmp_path / "env"
    code = main(["deploy", "nccl", "--prefix", str(prefix), "--channel-dir", str(no_generic_channel)])
    assert code == 2
    err = capsys.readouterr().err
    assert "no spec names a site profile" in err
    chosen_site = next(s for s in SITES if s != "generic" and f"site-env-{s} to the specs" in err)
    assert rendered["nccl"][chosen_site][1] in err
    # the hint lists the profiles the channel has
    assert all(f"site-env-{s}" in err for s in SITES if s != "generic") and "site-env-generic" not in err
    assert not prefix.exists()
    # named, the same site's build installs
    code = main(["deploy", "nccl", f"site-env-{chosen_site}", "--prefix", str(prefix),
                 "--channel-dir", str(no_generic_channel)])
    assert code == 0
    assert (prefix / "share" / "nccl" / "build.txt").read_text().strip() == rendered["nccl"][chosen_site][1]
