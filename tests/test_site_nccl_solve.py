"""A channel holding several sites' NCCL builds gives each site's environment its own site's NCCL.

nccl and aws-ofi-nccl are compiled per site (GPU architectures, libfabric), but nothing a PyTorch
requires at run time names the site: a bare `nccl`, or the run_export `nccl >=V,<3.0a0`. The
site-env-<site> package every flavor requires constrains both to its own site's builds (issue 33).

The channel is real and indexed by channelsmith's own publish: the site-env packages built for real
from recipes/site-env (``site_env_packages``), plus stand-ins of nccl and aws-ofi-nccl (empty
packages built by py-rattler-build, offline) whose names, versions, build strings and build numbers
are those the real recipes render for each site; py-rattler solves against it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from channelsmith import channel
from channelsmith.cli import main
from channelsmith.deploy import solve
from channelsmith.errors import SolveError
from channelsmith.recipes import render_recipe, select_recipes
from rattler_build import Stage0Recipe, ToolConfiguration, VariantConfig

from conftest import SITES

# One NCCL release every site builds: the stand-ins share version and build number, and differ
# only in the site of their build string, as the real builds of one channel do.
NCCL_RELEASE = "2.29.7-1"


def _rendered(repo_root: Path, recipe: str, package: str, **overrides: str) -> dict[str, tuple[str, str]]:
    """Site -> (version, build string) of ``package`` as the real ``recipe`` renders it."""
    (found,) = select_recipes(repo_root, [recipe])
    outputs = render_recipe(repo_root, found, overrides).outputs
    return {o.variant["site"]: (o.version, o.build_string) for o in outputs if o.name == package}


def _stand_in(name: str, version: str, string: str, run: list[str], noarch: bool) -> str:
    noarch_line = "  noarch: generic\n" if noarch else ""
    number = string.rsplit("_", 1)[-1]
    return (
        f'package:\n  name: {name}\n  version: "{version}"\n'
        f'build:\n  number: {number}\n  string: "{string}"\n{noarch_line}'
        f"  script:\n    - mkdir -p $PREFIX/share/{name}\n"
        f"    - echo {string} > $PREFIX/share/{name}/build.txt\n"
        f"requirements:\n  run: {json.dumps(run)}\n"
        f"about:\n  license: Apache-2.0\n  summary: channelsmith test stand-in for {name} {string}\n"
    )


def _build(recipes: list[str], work: Path) -> list[Path]:
    empty = channel.ensure_channel(work / "empty-channel")
    packages = []
    for text in recipes:
        results = Stage0Recipe.from_yaml(text).run_build(
            variant_config=VariantConfig(),
            tool_config=ToolConfiguration(test_strategy="skip"),
            output_dir=str(work / "output"),
            channels=[channel.channel_url(empty)],
            no_include_recipe=True,
        )
        packages.extend(path for result in results for path in result.packages)
    return packages


@pytest.fixture(scope="module")
def rendered(repo_root: Path) -> dict[str, dict[str, tuple[str, str]]]:
    """Package -> site -> (version, build string), from the real nccl and nccl-ofi-plugin recipes."""
    return {
        "nccl": _rendered(repo_root, "nccl", "nccl", nccl_version=NCCL_RELEASE),
        "aws-ofi-nccl": _rendered(repo_root, "nccl-ofi-plugin", "aws-ofi-nccl"),
    }


@pytest.fixture(scope="module")
def two_site_channel(
    rendered: dict[str, dict[str, tuple[str, str]]],
    site_env_packages: dict[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> Path:
    """An indexed channel: every site's site-env, nccl and aws-ofi-nccl, and a PyTorch stand-in."""
    work = tmp_path_factory.mktemp("two-sites")
    recipes = [
        _stand_in(package, version, string, [], noarch=False)
        for package, sites in rendered.items()
        for version, string in sites.values()
    ]
    # What a PyTorch flavor asks of NCCL at run time: the run_export's major pin, no site.
    recipes.append(_stand_in("pytorch", "2.6.0", "cray_mpich_0", ["nccl >=2.21.5.1,<3.0a0"], noarch=True))
    channel_dir = work / "channel"
    channel.publish(channel_dir, [*_build(recipes, work), *site_env_packages.values()])
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
