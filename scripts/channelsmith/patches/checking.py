"""`patches check`: every patch list the rendered recipes apply, applied to the real upstream tree of its
version; one verdict per (recipe, series, version): verified, failed or unverifiable (with why)."""

from __future__ import annotations

import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from channelsmith.errors import PatchError, SourceError
from channelsmith.patches.applying import HunkFailure, apply_series
from channelsmith.patches.parsing import parse_patch
from channelsmith.patches.series import series_of
from channelsmith.recipes import RenderedOutput, Source, render_recipe, select_recipes
from channelsmith.sources import Obtained, ReleaseSource, SourceFinder, normalize_version

VERIFIED = "verified"
FAILED = "failed"
UNVERIFIABLE = "unverifiable"


def version_key(version: str) -> tuple:
    """Sort key of a version in number order (2.6.0 before 2.11.0)."""
    return tuple((0, int(part), "") if part.isdigit() else (1, 0, part) for part in version.replace("-", ".").split("."))


@dataclass(frozen=True)
class CheckTarget:
    """One upstream source of one recipe at one version, with the patch list the build applies to it."""

    recipe: str
    project: str
    version: str
    release: ReleaseSource
    patches: tuple[Path, ...]
    # The package versions of the recipe built from it (torch-mpi-backend 2.11.0 compiles 2.6.0's source).
    builds: tuple[str, ...] = ()


@dataclass(frozen=True)
class SeriesResult:
    """The verdict for one (recipe, series, version)."""

    recipe: str
    series: str
    version: str
    status: str
    source: str
    patches: int
    failures: tuple[HunkFailure, ...] = ()
    reason: str = ""
    # Non-empty when a patch of the series is marked Reconstructed: (its text).
    reconstructed: str = ""
    # The recipe's package versions built with this patch list (one row per patch list, not per series).
    builds: tuple[str, ...] = ()


def check_targets(root: Path, recipe_names: Iterable[str] = (), versions: Iterable[str] = ()) -> list[CheckTarget]:
    """Every (recipe, upstream source, version) with patches in the rendered plan, de-duplicated.

    ``versions`` narrows to those upstream versions; naming a version no patched source has is a PatchError.
    """
    found: dict[tuple, CheckTarget] = {}
    builds: dict[tuple, set[str]] = {}
    for recipe in select_recipes(root, recipe_names):
        for output in render_recipe(root, recipe).outputs:
            for source in output.sources:
                if not source.patches:
                    continue
                target = _target(root, recipe.name, output, source)
                key = (target.recipe, target.project, target.version, target.patches)
                found.setdefault(key, target)
                builds.setdefault(key, set()).add(output.version)
    targets = [replace(target, builds=tuple(sorted(builds[key], key=version_key))) for key, target in found.items()]
    # Per recipe in the order of its builds, so that the rows of one package version stand together.
    recipes = list(dict.fromkeys(t.recipe for t in targets))
    targets.sort(key=lambda t: (recipes.index(t.recipe), version_key(t.builds[0])))
    wanted = [normalize_version(v) for v in versions]
    if wanted:
        known = sorted({t.version for t in targets})
        unknown = [v for v in wanted if v not in {normalize_version(k) for k in known}]
        if unknown:
            raise PatchError(
                f"no patched source of version {', '.join(unknown)} in the recipes checked",
                hint=f"versions with patches: {', '.join(known) or '(none)'}",
            )
        targets = [t for t in targets if normalize_version(t.version) in wanted]
    return targets


def _target(root: Path, recipe: str, output: RenderedOutput, source: Source) -> CheckTarget:
    refs = {series_of(root, p) for p in source.patches}
    places = {(r.project, r.version) for r in refs if r is not None}
    if len(places) > 1:
        raise PatchError(
            f"recipe {recipe} applies patches of several upstream versions to one source: "
            f"{', '.join(f'{p}/{v}' for p, v in sorted(places))}",
            hint="list only patches/<project>/<version>/... of the version that source downloads",
        )
    project, version = places.pop() if places else (recipe, normalize_version(output.version))
    return CheckTarget(
        recipe=recipe, project=project, version=version,
        release=ReleaseSource(url=source.url, sha256=source.sha256, git=source.git, rev=source.rev),
        patches=source.patches,
    )


def check_target(root: Path, target: CheckTarget, finder: SourceFinder) -> list[SeriesResult]:
    """Apply one target's patch list to its upstream tree; one result per series in it."""
    for path in target.patches:
        if not path.is_file():
            raise PatchError(f"recipe {target.recipe} lists {path}, which does not exist", hint="fix the path or add the patch")
    parsed = [parse_patch(p) for p in target.patches]
    names = series_names(root, target)
    obtained: Obtained = finder.find(target.project, target.version, target.release)
    tree = obtained.tree
    if tree is None:
        return [_result(target, names, s, UNVERIFIABLE, "", reason=obtained.why_not) for s in _ordered(names)]
    with tempfile.TemporaryDirectory(prefix="channelsmith-check-") as scratch:
        outcome = apply_series(tree, parsed, Path(scratch) / "tree")
    results = []
    for series in _ordered(names):
        mine = [p for p in target.patches if names[p] == series]
        failures = tuple(f for f in outcome.failures if any(p.name == f.patch for p in mine))
        missing = [(p, what) for p, what in outcome.missing if p in mine]
        if failures:
            results.append(_result(target, names, series, FAILED, tree.describe(), failures=failures))
        elif all(p in outcome.applied for p in mine):
            results.append(_result(target, names, series, VERIFIED, tree.describe()))
        elif missing:
            reason = f"{tree.describe()} lacks {missing[0][1]} (needed by {missing[0][0].name})"
            results.append(_result(target, names, series, UNVERIFIABLE, tree.describe(), reason=reason))
        else:
            blocker = (outcome.failures[0].patch if outcome.failures else outcome.missing[0][0].name)
            results.append(
                _result(target, names, series, UNVERIFIABLE, tree.describe(),
                        reason=f"not reached: {blocker}, listed before it, did not apply")
            )
    return results


def series_names(root: Path, target: CheckTarget) -> dict[Path, str]:
    names = {}
    for path in target.patches:
        ref = series_of(root, path)
        names[path] = ref.name if ref else f"{target.recipe}/{path.parent.name}"
    return names


def _ordered(names: Mapping[Path, str]) -> list[str]:
    return list(dict.fromkeys(names.values()))


def _result(target: CheckTarget, names: Mapping[Path, str], series: str, status: str, source: str,
            failures: tuple[HunkFailure, ...] = (), reason: str = "") -> SeriesResult:
    mine = [path for path, name in names.items() if name == series]
    marks = [parse_patch(path).header.reconstructed for path in mine]
    return SeriesResult(target.recipe, series, target.version, status, source, len(mine), failures, reason,
                        reconstructed=next((m for m in marks if m), ""), builds=target.builds)


def check(root: Path, finder: SourceFinder, recipe_names: Iterable[str] = (), versions: Iterable[str] = ()) -> list[SeriesResult]:
    """Check every patched (recipe, source, version) of the plan; results per (recipe, series, version)."""
    targets = check_targets(root, recipe_names, versions)
    given = finder.given
    # NCCL's versions carry a package revision (2.30.7-1) that a tree's make variables and version.txt lack.
    if given is not None and normalize_version(given.version) not in {normalize_version(t.version) for t in targets}:
        raise SourceError(
            f"--source is {given.project} {given.version} (its version file), but the patches checked are for "
            f"{', '.join(sorted({t.version for t in targets})) or 'no version'}",
            hint="pass the tree of a version the recipes patch, or narrow with --version",
        )
    results: list[SeriesResult] = []
    for target in targets:
        results.extend(check_target(root, target, finder))
    return results
