"""`channelsmith lint` finds planted defects and passes the repository's own recipes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from channelsmith.lint import lint, lint_all, patch_header_problems
from channelsmith.recipes import render_recipe, select_recipes
from channelsmith.sources import SourceFinder, cache_root
from test_plan import PATCH, STAGED_RECIPE, make_repo, run_cli

REPO = Path(__file__).resolve().parents[1]

URL_RECIPE = STAGED_RECIPE.replace(
    "      path: ../../src\n",
    "      url: https://example.org/toy-1.0.tar.gz\n"
    "      # sha256: the example.org release page for toy 1.0\n"
    "      sha256: \"0000000000000000000000000000000000000000000000000000000000000000\"\n",
)


def rules(root: Path) -> set[str]:
    return {f.rule for f in lint(root, ["toy"])}


def test_clean_toy_recipe_has_no_findings(tmp_path: Path) -> None:
    assert lint(make_repo(tmp_path, URL_RECIPE), ["toy"]) == []


def test_url_without_sha256_is_found(tmp_path: Path) -> None:
    root = make_repo(tmp_path, "\n".join(
        line for line in URL_RECIPE.splitlines() if "sha256" not in line) + "\n")
    findings = lint(root, ["toy"])
    assert [f.rule for f in findings] == ["sha256"]
    assert "toy-1.0.tar.gz" in findings[0].message and findings[0].line is not None


def test_sha256_without_cited_record_is_found(tmp_path: Path) -> None:
    root = make_repo(tmp_path, URL_RECIPE.replace("      # sha256: the example.org release page for toy 1.0\n", ""))
    assert rules(root) == {"sha256-record"}


def test_unpinned_git_source_is_found(tmp_path: Path) -> None:
    recipe = STAGED_RECIPE.replace("      path: ../../src\n", "      git: https://example.org/toy.git\n      rev: main\n")
    assert rules(make_repo(tmp_path, recipe)) == {"git-pin"}


def test_missing_patch_is_found(tmp_path: Path) -> None:
    root = make_repo(tmp_path)
    (root / "patches" / "toy" / "1.0" / "fix" / "0001-fix.patch").unlink()
    assert "patch-missing" in rules(root)


@pytest.mark.parametrize("drop", ["What:", "Why:", "Upstream:", "Versions:"])
def test_patch_header_field_missing_is_found(tmp_path: Path, drop: str) -> None:
    root = make_repo(tmp_path)
    patch = root / "patches" / "toy" / "1.0" / "fix" / "0001-fix.patch"
    patch.write_text("\n".join(line for line in PATCH.splitlines() if not line.startswith(drop)) + "\n")
    findings = [f for f in lint(root, ["toy"]) if f.rule == "patch-header"]
    assert len(findings) == 1 and drop in findings[0].message


def test_patch_with_no_header_at_all_is_found(tmp_path: Path) -> None:
    bare = tmp_path / "bare.patch"
    bare.write_text("--- a/f\n+++ b/f\n@@ -1 +1 @@\n-a\n+b\n")
    assert patch_header_problems(bare)


def test_recipe_with_only_import_tests_is_found(tmp_path: Path) -> None:
    recipe = STAGED_RECIPE.replace('      - script:\n          - "true"\n', "      - python:\n          imports: [toy]\n")
    assert rules(make_repo(tmp_path, recipe)) == {"tests"}


def test_missing_license_is_found(tmp_path: Path) -> None:
    assert rules(make_repo(tmp_path, STAGED_RECIPE.replace("  license: MIT\n", "  summary: toy\n"))) == {"license"}


def test_shellcheck_failure_is_found(tmp_path: Path) -> None:
    root = make_repo(tmp_path)
    (root / "recipes" / "toy" / "build.sh").write_text("#!/bin/bash\nrm -rf $PREFIX/lib\n")
    findings = [f for f in lint(root, ["toy"]) if f.rule == "shellcheck"]
    assert any("SC2086" in f.message for f in findings)


def test_lint_cli_exit_codes_and_json(tmp_path: Path) -> None:
    root = make_repo(tmp_path)
    clean = run_cli(root, "lint", "--json")
    assert clean.returncode == 0, clean.stdout + clean.stderr
    assert json.loads(clean.stdout) == {"clean": True, "findings": [], "unchecked": []}
    (root / "patches" / "toy" / "1.0" / "fix" / "0001-fix.patch").unlink()
    broken = run_cli(root, "lint", "--json")
    assert broken.returncode == 1
    assert json.loads(broken.stdout)["findings"][0]["rule"] == "patch-missing"
    assert run_cli(root, "lint", "nosuch").returncode == 2


def test_repository_recipes_are_lint_clean() -> None:
    findings = lint(REPO)
    assert findings == [], "\n".join(f"{f.recipe} {f.file}:{f.line} {f.rule}: {f.message}" for f in findings)


# ---------------------------------------------------------------------------------------------
# license_file: each one exists in the source it names (or the recipe folder)
# ---------------------------------------------------------------------------------------------

ONE_VERSION = 'lib_version: ["1.0"]\n'


def with_license_files(recipe: str, *files: str) -> str:
    listed = "".join(f"    - {name}\n" for name in files)
    return recipe.replace("  license: MIT\n", f"  license: MIT\n  license_file:\n{listed}")


def cache_finder(cache: Path) -> SourceFinder:
    return SourceFinder(cache, offline=True, use_debian=False)


def test_license_file_missing_from_a_local_source_is_found(tmp_path: Path) -> None:
    root = make_repo(tmp_path, with_license_files(STAGED_RECIPE, "LICENSE", "NOTICE"), ONE_VERSION)
    (root / "src" / "LICENSE").write_text("MIT\n")
    result = lint_all(root, ["toy"], cache_finder(tmp_path / "cache"))
    # One finding per package of the recipe (libtoy, py-toy): each would ship without it.
    assert {f.message.split(" is in")[0] for f in result.findings} == {
        "libtoy 1.0: license_file NOTICE", "py-toy 1.0: license_file NOTICE"}
    assert {f.rule for f in result.findings} == {"license-file"}
    assert result.unchecked == []
    (root / "src" / "NOTICE").write_text("toy\n")
    assert lint_all(root, ["toy"], cache_finder(tmp_path / "cache")).findings == []


def test_license_file_in_the_recipe_folder_is_accepted(tmp_path: Path) -> None:
    """rattler-build also takes a license_file from the recipe folder (seen: info/licenses/ held it)."""
    root = make_repo(tmp_path, with_license_files(STAGED_RECIPE, "LICENSE"), ONE_VERSION)
    (root / "recipes" / "toy" / "LICENSE").write_text("MIT\n")
    assert lint_all(root, ["toy"], cache_finder(tmp_path / "cache")).findings == []


def test_license_file_of_an_uncached_source_is_reported_not_checked(tmp_path: Path) -> None:
    root = make_repo(tmp_path, with_license_files(URL_RECIPE, "LICENSE"), ONE_VERSION)
    result = lint_all(root, ["toy"], cache_finder(tmp_path / "empty-cache"))
    assert result.findings == []
    assert len(result.unchecked) == 2  # libtoy and py-toy
    for unchecked in result.unchecked:
        assert unchecked.rule == "license-file"
        assert "license_file LICENSE not checked" in unchecked.reason
        assert "not in the source cache" in unchecked.reason and "not downloaded (offline)" in unchecked.reason


def test_license_file_is_checked_in_the_cached_tree_of_the_version(tmp_path: Path) -> None:
    """The cache keeps a patched source under its series' project and version (trees/toy/1.0)."""
    root = make_repo(tmp_path, with_license_files(URL_RECIPE, "LICENSE", "COPYING"), ONE_VERSION)
    tree = tmp_path / "cache" / "trees" / "toy" / "1.0"
    tree.mkdir(parents=True)
    (tree / "LICENSE").write_text("MIT\n")
    result = lint_all(root, ["toy"], cache_finder(tmp_path / "cache"))
    assert result.unchecked == []
    assert {f.message.split(" is in")[0] for f in result.findings} == {
        "libtoy 1.0: license_file COPYING", "py-toy 1.0: license_file COPYING"}


def test_lint_cli_lists_unchecked_license_files_and_still_exits_0(tmp_path: Path) -> None:
    root = make_repo(tmp_path, with_license_files(URL_RECIPE, "LICENSE"), ONE_VERSION)
    env_cache = tmp_path / "empty-cache"
    shown = subprocess.run(
        [sys.executable, "-m", "channelsmith", "--root", str(root), "lint", "--json"],
        capture_output=True, text=True, check=False, env={**os.environ, "CHANNELSMITH_CACHE": str(env_cache)},
    )
    assert shown.returncode == 0, shown.stderr
    document = json.loads(shown.stdout)
    assert document["clean"] is True and document["findings"] == []
    assert {u["rule"] for u in document["unchecked"]} == {"license-file"}


@pytest.mark.parametrize("version", ["2.21.5-1", "2.29.7-1", "2.30.7-1"])
def test_nccl_license_files_exist_in_the_real_release_trees(version: str) -> None:
    tree = cache_root() / "trees" / "nccl" / version
    if not (tree / "LICENSE.txt").is_file():
        pytest.skip(f"no NCCL {version} tree in the source cache ({tree}): put the release tree there to check")
    result = lint_all(REPO, ["nccl"], cache_finder(cache_root()))
    assert result.findings == []
    assert not [u for u in result.unchecked if f"nccl {version} source" in u.reason]
    # The SPDX expression follows the release's own LICENSE.txt: Apache-2.0 from 2.29 on, BSD-3-Clause
    # throughout, and NVTX's Apache-2.0 WITH LLVM-exception for the headers compiled in.
    (recipe,) = select_recipes(REPO, ["nccl"])
    output = render_recipe(REPO, recipe, {"nccl_version": version}).outputs[0]
    terms = set(output.license.split(" AND "))
    assert ("Apache-2.0" in terms) == ("Apache License" in (tree / "LICENSE.txt").read_text())
    assert "BSD-3-Clause" in terms
    nvtx = (tree / "src" / "include" / "nvtx3" / "nvToolsExt.h").read_text()
    nvtx_spdx = "SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception" in nvtx
    assert ("Apache-2.0 WITH LLVM-exception" in terms) == nvtx_spdx
    assert ("ThirdPartyNotices.txt" in output.license_files) == (tree / "ThirdPartyNotices.txt").is_file()


@pytest.mark.parametrize("version", ["1.6.0", "1.19.2"])
def test_aws_ofi_nccl_ships_its_notice_and_every_bundled_license(version: str) -> None:
    tree = cache_root() / "trees" / "aws-ofi-nccl" / version
    if not (tree / "LICENSE").is_file():
        pytest.skip(f"no aws-ofi-nccl {version} tree in the source cache ({tree}): put the release tree there to check")
    result = lint_all(REPO, ["nccl-ofi-plugin"], cache_finder(cache_root()))
    assert result.findings == []
    assert not [u for u in result.unchecked if f"aws-ofi-nccl {version} source" in u.reason]
    (recipe,) = select_recipes(REPO, ["nccl-ofi-plugin"])
    outputs = render_recipe(REPO, recipe).outputs
    (output,) = {o.name: o for o in outputs if o.version == version and o.name == "aws-ofi-nccl"}.values()
    bundled = {str(p.relative_to(tree)) for p in tree.glob("3rd-party/*/LICENSE*")}
    assert {"LICENSE", "NOTICE", *bundled} <= set(output.license_files)


def test_license_file_dropped_by_the_source_filter_is_found_without_reading_the_source(tmp_path: Path) -> None:
    """rattler-build's `filter:` keeps only the listed files: a license file outside it never arrives."""
    filtered = URL_RECIPE.replace(
        '      sha256: "0000000000000000000000000000000000000000000000000000000000000000"\n',
        '      sha256: "0000000000000000000000000000000000000000000000000000000000000000"\n'
        "      filter:\n        - src/*.c\n        - COPYING\n",
    )
    root = make_repo(tmp_path, with_license_files(filtered, "LICENSE", "COPYING"), ONE_VERSION)
    result = lint_all(root, ["toy"], cache_finder(tmp_path / "empty-cache"))
    assert {f.message.split(" is in")[0] for f in result.findings} == {
        "libtoy 1.0: license_file LICENSE", "py-toy 1.0: license_file LICENSE"}
    assert {u.reason.split(" not checked")[0] for u in result.unchecked} == {
        "libtoy 1.0: license_file COPYING", "py-toy 1.0: license_file COPYING"}


def test_a_cached_tree_of_another_version_is_not_read_and_says_so(tmp_path: Path) -> None:
    root = make_repo(tmp_path, with_license_files(URL_RECIPE, "LICENSE"), ONE_VERSION)
    tree = tmp_path / "cache" / "trees" / "toy" / "1.0"
    tree.mkdir(parents=True)
    (tree / "version.txt").write_text("2.0\n")
    (tree / "LICENSE").write_text("MIT\n")
    result = lint_all(root, ["toy"], cache_finder(tmp_path / "cache"))
    assert result.findings == []
    assert result.unchecked and all("toy 2.0 (version.txt), not 1.0" in u.reason for u in result.unchecked)
