"""NCCL trees in `channelsmith patches check`: their version comes from makefiles/version.mk, and a
recipe's NCCL version (2.30.7-1, with its package revision) matches that tree.

The synthetic trees and the toy patch here are written by these tests (a few lines in NCCL's file
layout), never upstream code. The repository's real abort-wakeup series is checked against real NCCL
trees only where the source cache holds them (trees/nccl/<version>/; CI has none: skipped).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from channelsmith.errors import SourceError
from channelsmith.patches import UNVERIFIABLE, VERIFIED, check
from channelsmith.sources import SourceFinder, cache_root, check_version, nccl_make_version, open_given

REPO = Path(__file__).resolve().parents[1]
NCCL_VERSIONS = ("2.21.5-1", "2.29.7-1", "2.30.7-1")

VERSION_MK = """\
##### version
NCCL_MAJOR   := {major}
NCCL_MINOR   := {minor}
NCCL_PATCH   := {patch}
NCCL_SUFFIX  :=
PKG_REVISION := {revision}
"""

PROXY_CC = "int pollTimeoutMs() {\n  return 500;\n}\n"

TOY_PATCH = """\
What: a toy change to a synthetic proxy.cc
Why: proves an NCCL tree is found and checked for a recipe's NCCL version
Upstream: none (test fixture)
Versions: {version}
---
diff --git a/src/proxy.cc b/src/proxy.cc
--- a/src/proxy.cc
+++ b/src/proxy.cc
@@ -1,3 +1,3 @@
 int pollTimeoutMs() {
-  return 500;
+  return -1;
 }
"""


def nccl_tree(where: Path, version: str) -> Path:
    """A directory laid out like an NCCL release: makefiles/version.mk and src/proxy.cc."""
    release, revision = version.split("-")
    major, minor, patch = release.split(".")
    (where / "makefiles").mkdir(parents=True)
    (where / "makefiles" / "version.mk").write_text(
        VERSION_MK.format(major=major, minor=minor, patch=patch, revision=revision))
    (where / "src").mkdir()
    (where / "src" / "proxy.cc").write_text(PROXY_CC)
    return where


def toy_repo(tmp_path: Path, version: str) -> Path:
    """A repository whose one recipe builds NCCL ``version`` from git with one toy patch."""
    root = tmp_path / "repo"
    recipe = root / "recipes" / "toy-nccl"
    recipe.mkdir(parents=True)
    shutil.copy(REPO / "conda_build_config.yaml", root / "conda_build_config.yaml")
    series = root / "patches" / "nccl" / version / "demo"
    series.mkdir(parents=True)
    (series / "0001-toy.patch").write_text(TOY_PATCH.replace("{version}", version))
    (recipe / "recipe.yaml").write_text(
        "context:\n  version: ${{ nccl_version | replace(\"-\", \".\") }}\n"
        "package:\n  name: toy-nccl\n  version: ${{ version }}\n"
        "source:\n"
        "  - git: https://github.com/NVIDIA/nccl.git\n"
        "    rev: 0123456789abcdef0123456789abcdef01234567\n"
        f"    patches:\n      - ../../patches/nccl/{version}/demo/0001-toy.patch\n"
        "build:\n  number: 0\n  noarch: generic\nabout:\n  license: MIT\n"
    )
    (recipe / "variants.yaml").write_text(f'nccl_version:\n  - "{version}"\n')
    return root


def offline_finder(tmp_path: Path, given: Path | None = None) -> SourceFinder:
    cache = tmp_path / "cache"
    cache.mkdir(exist_ok=True)
    tree = open_given(given, "nccl") if given is not None else None
    return SourceFinder(cache, given=tree, offline=True, use_debian=False)


def test_nccl_make_version_reads_the_release_and_package_revision() -> None:
    text = VERSION_MK.format(major=2, minor=30, patch=7, revision=1)
    assert nccl_make_version(text) == "2.30.7-1"
    # An empty NCCL_SUFFIX line just before PKG_REVISION must not swallow it.
    assert nccl_make_version(text.replace("PKG_REVISION := 1", "PKG_REVISION := 2")) == "2.30.7-2"
    assert nccl_make_version("NCCL_MAJOR := 2\n") is None


def test_given_nccl_tree_is_identified_by_its_version_mk(tmp_path: Path) -> None:
    given = open_given(nccl_tree(tmp_path / "nccl", "2.30.7-1"), "pytorch")
    assert (given.project, given.version) == ("nccl", "2.30.7")
    check_version(given, "2.30.7-1")
    with pytest.raises(SourceError, match=r"nccl 2\.30\.7-1 \(makefiles/version\.mk\), not 2\.29\.7-1"):
        check_version(given, "2.29.7-1")


def test_series_for_a_revisioned_nccl_version_is_verified_against_a_given_tree(tmp_path: Path) -> None:
    root = toy_repo(tmp_path, "2.30.7-1")
    [result] = check(root, offline_finder(tmp_path, nccl_tree(tmp_path / "nccl", "2.30.7-1")))
    assert (result.version, result.status) == ("2.30.7-1", VERIFIED)


def test_series_is_verified_from_the_cache_tree_and_unverifiable_without_one(tmp_path: Path) -> None:
    root = toy_repo(tmp_path, "2.30.7-1")
    [missing] = check(root, offline_finder(tmp_path))
    assert missing.status == UNVERIFIABLE and "git is not fetched" in missing.reason
    nccl_tree(tmp_path / "cache" / "trees" / "nccl" / "2.30.7-1", "2.30.7-1")
    [cached] = check(root, offline_finder(tmp_path))
    assert cached.status == VERIFIED


def test_cache_tree_of_another_nccl_version_is_refused(tmp_path: Path) -> None:
    root = toy_repo(tmp_path, "2.30.7-1")
    nccl_tree(tmp_path / "cache" / "trees" / "nccl" / "2.30.7-1", "2.29.7-1")
    with pytest.raises(SourceError, match="not 2.30.7-1"):
        check(root, offline_finder(tmp_path))


@pytest.mark.parametrize("version", NCCL_VERSIONS)
def test_abort_wakeup_series_applies_to_the_real_release_tree(version: str) -> None:
    if not (cache_root() / "trees" / "nccl" / version / "makefiles" / "version.mk").is_file():
        pytest.skip(f"no NCCL {version} tree in the source cache ({cache_root()}/trees/nccl/{version}): "
                    "unpack the release there to check the real series")
    results = [r for r in check(REPO, SourceFinder(cache_root(), offline=True, use_debian=False), ["nccl"], [version])]
    assert [(r.series, r.status) for r in results] == [("nccl/abort-wakeup", VERIFIED)]
