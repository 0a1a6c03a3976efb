"""`channelsmith lint` finds planted defects and passes the repository's own recipes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from channelsmith.lint import lint, patch_header_problems
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
    assert json.loads(clean.stdout) == {"clean": True, "findings": []}
    (root / "patches" / "toy" / "1.0" / "fix" / "0001-fix.patch").unlink()
    broken = run_cli(root, "lint", "--json")
    assert broken.returncode == 1
    assert json.loads(broken.stdout)["findings"][0]["rule"] == "patch-missing"
    assert run_cli(root, "lint", "nosuch").returncode == 2


def test_repository_recipes_are_lint_clean() -> None:
    findings = lint(REPO)
    assert findings == [], "\n".join(f"{f.recipe} {f.file}:{f.line} {f.rule}: {f.message}" for f in findings)
