"""Patch series: check them against real upstream source, port them to a new version, compile-check them.

Semantics are the build's, made strict: each patch of a source's rendered ``patches:`` list is applied
in order at the source root with strip level 1, creating and deleting files as the diff says, and with
no fuzz (every context line must match; a hunk may land at an offset). rattler-build applies patches
with its own diff engine (flickzeug) and tolerates up to 2 lines of fuzz and whitespace changes, so a
series that passes here also applies in the build; the reverse is not guaranteed, which is the point.
The applying is done by ``git apply`` on a scratch copy of only the files the series touches.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from channelsmith.errors import PatchError, SourceError
from channelsmith.recipes import RenderedOutput, Source, render_recipe, select_recipes
from channelsmith.sources import (
    Obtained,
    ReleaseSource,
    SourceFinder,
    SourceTree,
    normalize_version,
    wheel_headers,
)

PATCHES_DIR = "patches"
HEADER_KEYS = ("What", "Why", "Upstream", "Versions")
# Optional: Reconstructed: says the patched file is a reconstruction, not the upstream release's file, and
# why; every report of the series carries it. Compiles-Against: the PyTorch release whose headers the
# patched files are compiled against when that is not the source's own (docs/recipes.md).
OPTIONAL_HEADER_KEYS = ("Reconstructed", "Compiles-Against")
HEADER_END = "---"

VERIFIED = "verified"
FAILED = "failed"
UNVERIFIABLE = "unverifiable"


# ---------------------------------------------------------------- parsing


@dataclass(frozen=True)
class PatchHeader:
    """The header every patch starts with (docs/recipes.md)."""

    fields: dict[str, str]
    lines: tuple[str, ...]

    @property
    def versions(self) -> tuple[str, ...]:
        return tuple(v for v in re.split(r"[,\s]+", self.fields.get("Versions", "")) if v)

    @property
    def reconstructed(self) -> str:
        """Why the series is a reconstruction rather than the release's file ("" for an ordinary patch)."""
        return self.fields.get("Reconstructed", "")

    @property
    def compiles_against(self) -> str:
        """The release whose headers the patched files compile against ("" = the source's own)."""
        return self.fields.get("Compiles-Against", "")


@dataclass(frozen=True)
class Hunk:
    """One hunk of a file diff: its header line and the lines it expects to find (context and removed)."""

    number: int
    header: str
    old_start: int
    expected: tuple[str, ...]


@dataclass(frozen=True)
class FileDiff:
    """The diff of one file; a path is None on the /dev/null side (file created or deleted)."""

    old_path: str | None
    new_path: str | None
    hunks: tuple[Hunk, ...]

    @property
    def path(self) -> str:
        return self.new_path or self.old_path or ""


@dataclass(frozen=True)
class PatchFile:
    """A parsed patch file."""

    path: Path
    header: PatchHeader
    files: tuple[FileDiff, ...]

    @property
    def touched(self) -> set[str]:
        return {p for f in self.files for p in (f.old_path, f.new_path) if p}


def _strip1(raw: str) -> str | None:
    """A diff path with strip level 1 applied (None for /dev/null), as the build reads it."""
    raw = raw.split("\t", 1)[0].strip()
    if raw == "/dev/null":
        return None
    if raw.startswith('"') and raw.endswith('"'):
        raw = raw[1:-1]
    parts = raw.split("/", 1)
    return parts[1] if len(parts) == 2 else raw


def parse_header(path: Path, lines: list[str]) -> tuple[PatchHeader, int]:
    """The header of a patch and the index of its first diff line; a malformed header is a PatchError."""
    fields: dict[str, str] = {}
    current: str | None = None
    for index, line in enumerate(lines):
        if line.rstrip("\n") == HEADER_END:
            missing = [k for k in HEADER_KEYS if not fields.get(k)]
            if missing:
                raise PatchError(
                    f"patch {path} has a header without {', '.join(m + ':' for m in missing)}",
                    hint="start the patch with What:, Why:, Upstream: and Versions: lines, then a line '---' "
                    "(see docs/recipes.md)",
                )
            return PatchHeader(fields=fields, lines=tuple(lines[:index])), index + 1
        if line.startswith("diff ") or line.startswith("--- ") or line.startswith("@@"):
            break
        key, sep, value = line.partition(":")
        if sep and key in HEADER_KEYS + OPTIONAL_HEADER_KEYS:
            current = key
            fields[key] = value.strip()
        elif line.startswith("  ") and current:
            fields[current] = f"{fields[current]} {line.strip()}".strip()
        elif line.strip():
            current = None
    raise PatchError(
        f"patch {path} has no header ended by a line '---' before its diff",
        hint="start the patch with What:, Why:, Upstream: and Versions: lines, then a line '---' "
        "(see docs/recipes.md)",
    )


def parse_patch(path: Path) -> PatchFile:
    """Parse a patch file: header, then the files and hunks of its diff."""
    try:
        lines = path.read_text(errors="replace").splitlines(keepends=True)
    except OSError as exc:
        raise PatchError(f"cannot read patch {path}: {exc.strerror}", hint="fix the path in the recipe") from None
    header, start = parse_header(path, lines)
    files: list[FileDiff] = []
    old: str | None = None
    new: str | None = None
    hunks: list[Hunk] = []
    have_file = False
    index = start

    def flush() -> None:
        if have_file:
            files.append(FileDiff(old_path=old, new_path=new, hunks=tuple(hunks)))

    while index < len(lines):
        line = lines[index].rstrip("\n")
        if line.startswith("diff --git "):
            flush()
            match = re.match(r"diff --git (\S+) (\S+)", line)
            old, new = (_strip1(match.group(1)), _strip1(match.group(2))) if match else (None, None)
            hunks, have_file = [], True
        elif line.startswith("--- ") and index + 1 < len(lines) and lines[index + 1].startswith("+++ "):
            if not have_file or hunks:
                flush()
                hunks, have_file = [], True
            old = _strip1(line[4:])
            new = _strip1(lines[index + 1].rstrip("\n")[4:])
            index += 1
        elif line.startswith("new file mode"):
            old = None
        elif line.startswith("deleted file mode"):
            new = None
        elif line.startswith("@@") and have_file:
            match = re.match(r"@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@", line)
            if not match:
                raise PatchError(f"patch {path} has a malformed hunk header: {line!r}")
            old_count = int(match.group(2)) if match.group(2) is not None else 1
            new_count = int(match.group(4)) if match.group(4) is not None else 1
            expected: list[str] = []
            body = index + 1
            while (old_count > 0 or new_count > 0) and body < len(lines):
                text = lines[body].rstrip("\n")
                tag, content = text[:1], text[1:]
                if tag in (" ", ""):
                    expected.append(content)
                    old_count -= 1
                    new_count -= 1
                elif tag == "-":
                    expected.append(content)
                    old_count -= 1
                elif tag == "+":
                    new_count -= 1
                elif tag != "\\":
                    break
                body += 1
            hunks.append(Hunk(len(hunks) + 1, line, int(match.group(1)), tuple(expected)))
            index = body - 1
        index += 1
    flush()
    if not files:
        raise PatchError(f"patch {path} holds no diff after its header", hint="append the diff after the '---' line")
    return PatchFile(path=path, header=header, files=tuple(files))


# ---------------------------------------------------------------- applying


@dataclass(frozen=True)
class HunkFailure:
    """A hunk that did not apply: where, and which expected lines the tree does not have."""

    patch: str
    file: str
    hunk: str
    message: str
    mismatches: tuple[str, ...] = ()


@dataclass
class ApplyResult:
    """What applying a list of patches to a scratch tree did."""

    applied: list[Path] = field(default_factory=list)
    failures: list[HunkFailure] = field(default_factory=list)
    missing: list[tuple[Path, str]] = field(default_factory=list)


def _git_env(scratch: Path) -> dict[str, str]:
    # A scratch tree must never be taken for part of an enclosing repository (paths would shift).
    env = dict(os.environ)
    env["GIT_CEILING_DIRECTORIES"] = str(scratch.parent)
    env.pop("GIT_DIR", None)
    env.pop("GIT_WORK_TREE", None)
    return env


def git_apply(scratch: Path, patch: PatchFile, reject: bool = False) -> tuple[bool, str]:
    """``git apply -p1`` of one patch inside ``scratch``: (applied cleanly, git's messages)."""
    command = ["git", "apply", "-p1", "--verbose", "--whitespace=nowarn"]
    if reject:
        command.append("--reject")
    result = subprocess.run(
        [*command, str(patch.path)], cwd=scratch, capture_output=True, text=True, env=_git_env(scratch)
    )
    return result.returncode == 0, result.stdout + result.stderr


def _failures(scratch: Path, patch: PatchFile, output: str) -> list[HunkFailure]:
    """The hunks git could not apply, each with the expected lines the file lacks."""
    failures: list[HunkFailure] = []
    by_path = {f.path: f for f in patch.files}
    for match in re.finditer(r"^error: patch failed: (.+):(\d+)$", output, flags=re.MULTILINE):
        path, line = match.group(1), int(match.group(2))
        diff = by_path.get(path)
        hunk = next((h for h in diff.hunks if h.old_start == line), None) if diff else None
        if hunk is None:
            failures.append(HunkFailure(patch.path.name, path, f"at line {line}", "does not apply"))
            continue
        target = scratch / path
        text = target.read_text(errors="replace").splitlines() if target.is_file() else []
        failures.append(
            HunkFailure(patch.path.name, path, hunk.header, "context does not match", _mismatches(hunk, text))
        )
    for pattern, message in (
        (r"^error: (.+): No such file or directory$", "file does not exist in the tree"),
        (r"^error: (.+): does not exist in index$", "file does not exist in the tree"),
        (r"^error: (.+): already exists in working directory$", "file to create already exists"),
        (r"^error: (?:corrupt patch|patch fragment without header|.*malformed patch).*$", "corrupt diff"),
    ):
        for match in re.finditer(pattern, output, flags=re.MULTILINE):
            name = match.group(1) if match.groups() else ""
            failures.append(HunkFailure(patch.path.name, name, "", f"{message}: {match.group(0)[7:]}"))
    if not failures:
        last = [l for l in output.splitlines() if l.startswith("error")] or output.splitlines()[-1:]
        failures.append(HunkFailure(patch.path.name, "", "", " ".join(last) or "git apply failed"))
    return failures


def _mismatches(hunk: Hunk, text: list[str]) -> tuple[str, ...]:
    """The hunk's expected lines that differ from the tree where the hunk fits best.

    The best place is the offset most expected lines agree with (nearest to the hunk's stated line on
    a tie); each disagreeing line is shown as ``-expected`` / ``+found`` with its line number.
    """
    positions: dict[str, list[int]] = {}
    for number, line in enumerate(text):
        positions.setdefault(line, []).append(number)
    votes: dict[int, int] = {}
    for offset, line in enumerate(hunk.expected):
        for number in positions.get(line, []):
            votes[number - offset] = votes.get(number - offset, 0) + 1
    stated = hunk.old_start - 1
    start = max(votes, key=lambda p: (votes[p], -abs(p - stated))) if votes else stated
    shown: list[str] = []
    for offset, line in enumerate(hunk.expected):
        where = start + offset
        found = text[where] if 0 <= where < len(text) else None
        if found != line:
            shown.append(f"line {where + 1}: -{line}")
            shown.append(f"line {where + 1}: +{found if found is not None else '(end of file)'}")
    return tuple(shown)


def materialize(tree: SourceTree, patches: Iterable[PatchFile], scratch: Path) -> set[str]:
    """Copy every file the patches touch (and the tree holds) into ``scratch``; returns the paths copied."""
    touched = {p for patch in patches for p in patch.touched}
    return tree.extract(touched, scratch)


def apply_series(tree: SourceTree, patches: list[PatchFile], scratch: Path) -> ApplyResult:
    """Apply ``patches`` in order to a scratch copy of the files they touch; stop at the first that fails.

    A patch that touches a file a partial tree (a wheel's headers) does not hold is recorded in
    ``missing``: that proves nothing either way.
    """
    present = materialize(tree, patches, scratch)
    result = ApplyResult()
    for patch in patches:
        if tree.partial:
            absent = sorted(f.old_path for f in patch.files if f.old_path and f.old_path not in present)
            if absent:
                result.missing.append((patch.path, ", ".join(absent)))
                return result
        ok, output = git_apply(scratch, patch, reject=True)
        if not ok:
            result.failures.extend(_failures(scratch, patch, output))
            return result
        result.applied.append(patch.path)
    return result


# ---------------------------------------------------------------- check


@dataclass(frozen=True)
class SeriesRef:
    """Where a patch lives: patches/<project>/<version>/<series>/."""

    project: str
    version: str
    series: str

    @property
    def name(self) -> str:
        return f"{self.project}/{self.series}"


def series_of(root: Path, patch: Path) -> SeriesRef | None:
    """The series a patch file belongs to, or None when it lives outside patches/<project>/<version>/<series>/."""
    try:
        parts = patch.resolve().relative_to((root / PATCHES_DIR).resolve()).parts
    except ValueError:
        return None
    return SeriesRef(parts[0], parts[1], parts[2]) if len(parts) == 4 else None


@dataclass(frozen=True)
class CheckTarget:
    """One upstream source of one recipe at one version, with the patch list the build applies to it."""

    recipe: str
    project: str
    version: str
    release: ReleaseSource
    patches: tuple[Path, ...]


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


def check_targets(root: Path, recipe_names: Iterable[str] = (), versions: Iterable[str] = ()) -> list[CheckTarget]:
    """Every (recipe, upstream source, version) with patches in the rendered plan, de-duplicated.

    ``versions`` narrows to those upstream versions; naming a version no patched source has is a PatchError.
    """
    targets: list[CheckTarget] = []
    seen: set[tuple] = set()
    for recipe in select_recipes(root, recipe_names):
        for output in render_recipe(root, recipe).outputs:
            for source in output.sources:
                if not source.patches:
                    continue
                target = _target(root, recipe.name, output, source)
                key = (target.recipe, target.project, target.version, target.patches)
                if key not in seen:
                    seen.add(key)
                    targets.append(target)
    wanted = [normalize_version(v) for v in versions]
    if wanted:
        known = sorted({t.version for t in targets})
        unknown = [v for v in wanted if v not in known]
        if unknown:
            raise PatchError(
                f"no patched source of version {', '.join(unknown)} in the recipes checked",
                hint=f"versions with patches: {', '.join(known) or '(none)'}",
            )
        targets = [t for t in targets if t.version in wanted]
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
    names = _series_names(root, target)
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


def _series_names(root: Path, target: CheckTarget) -> dict[Path, str]:
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
                        reconstructed=next((m for m in marks if m), ""))


def check(root: Path, finder: SourceFinder, recipe_names: Iterable[str] = (), versions: Iterable[str] = ()) -> list[SeriesResult]:
    """Check every patched (recipe, source, version) of the plan; results per (recipe, series, version)."""
    targets = check_targets(root, recipe_names, versions)
    given = finder.given
    if given is not None and normalize_version(given.version) not in {t.version for t in targets}:
        raise SourceError(
            f"--source is {given.project} {given.version} (version.txt), but the patches checked are for "
            f"{', '.join(sorted({t.version for t in targets})) or 'no version'}",
            hint="pass the tree of a version the recipes patch, or narrow with --version",
        )
    results: list[SeriesResult] = []
    for target in targets:
        results.extend(check_target(root, target, finder))
    return results


# ---------------------------------------------------------------- port


@dataclass(frozen=True)
class PortedPatch:
    """One patch of a ported series: where it was written (None when hunks need a human), and those hunks."""

    name: str
    written: str | None
    rejected: tuple[HunkFailure, ...]
    rejects_file: str | None


@dataclass(frozen=True)
class PortResult:
    """What `patches port` did."""

    series: str
    from_version: str
    to_version: str
    source: str
    target_dir: str
    patches: tuple[PortedPatch, ...]
    report_dir: str
    recipe_block: str

    @property
    def clean(self) -> bool:
        return all(not p.rejected for p in self.patches)


def series_dir(root: Path, series: str, version: str) -> Path:
    """patches/<project>/<version>/<series>/ for a SERIES written ``project/series``."""
    project, _, name = series.partition("/")
    if not project or not name or "/" in name:
        raise PatchError(f"malformed series {series!r}", hint="write it as PROJECT/SERIES, e.g. pytorch/nccl-fault")
    return root / PATCHES_DIR / project / version / name


def known_versions(root: Path, series: str) -> list[str]:
    """The versions that have a folder for ``series``."""
    project, _, name = series.partition("/")
    base = root / PATCHES_DIR / project
    return sorted(p.name for p in base.iterdir() if (p / name).is_dir()) if base.is_dir() else []


def series_patches(root: Path, series: str, version: str) -> list[Path]:
    """The patch files of a series at a version, in order; an unknown series or version is a PatchError."""
    folder = series_dir(root, series, version)
    patches = sorted(folder.glob("*.patch")) if folder.is_dir() else []
    if not patches:
        versions = known_versions(root, series)
        raise PatchError(
            f"no series {series} at version {version} ({folder.relative_to(root)} has no patches)",
            hint=f"versions of {series}: {', '.join(versions)}" if versions
            else f"series under {PATCHES_DIR}/: {', '.join(all_series(root)) or '(none)'}",
        )
    return patches


def all_series(root: Path) -> list[str]:
    """Every PROJECT/SERIES name under patches/."""
    base = root / PATCHES_DIR
    names = {f"{p.parts[-3]}/{p.parts[-1]}" for p in base.glob("*/*/*") if p.is_dir()} if base.is_dir() else set()
    return sorted(names)


def retarget_header(header: PatchHeader, version: str) -> str:
    """The header text with its Versions: line (and continuations) replaced by ``version``."""
    out: list[str] = []
    skipping = False
    for line in header.lines:
        if line.startswith("Versions:"):
            out.append(f"Versions: {version}\n")
            skipping = True
            continue
        if skipping and line.startswith("  "):
            continue
        skipping = False
        out.append(line)
    return "".join(out) + HEADER_END + "\n"


def _git_diff(base: Path, old: str | None, new: str | None) -> str:
    """A git-style diff (a/ b/ prefixes) of one file between ``base/a`` and ``base/b``."""
    left = f"a/{old}" if old else "/dev/null"
    right = f"b/{new}" if new else "/dev/null"
    result = subprocess.run(
        ["git", "-c", "core.quotepath=false", "diff", "--no-index", "--no-color", "--no-ext-diff",
         "--src-prefix=", "--dst-prefix=", "--", left, right],
        cwd=base, capture_output=True, text=True, env=_git_env(base),
    )
    if result.returncode not in (0, 1):
        raise PatchError(f"git diff failed for {old or new}: {result.stderr.strip()}")
    # Blob ids of scratch copies mean nothing to a reader or to the build; the series carry none.
    return "".join(line for line in result.stdout.splitlines(keepends=True) if not line.startswith("index "))


def _file_diff(pair: Path, diff: FileDiff) -> str:
    """The regenerated diff of one file of a patch ('' when neither side exists in the new tree)."""
    old = diff.old_path if diff.old_path and (pair / "a" / diff.old_path).is_file() else None
    new = diff.new_path if diff.new_path and (pair / "b" / diff.new_path).is_file() else None
    return _git_diff(pair, old, new) if old or new else ""


def port(
    root: Path,
    series: str,
    from_version: str,
    to_version: str,
    finder: SourceFinder,
    report_dir: Path,
    force: bool = False,
    release: ReleaseSource | None = None,
) -> PortResult:
    """Apply ``series`` at ``from_version`` to the ``to_version`` tree and write the regenerated series.

    Writes patches/<project>/<to_version>/<series>/ (nothing else in the repository) with every patch
    that ported whole; a patch with hunks that do not apply is reported instead, and its partial diff and
    git's .rej files go under ``report_dir``.
    """
    sources = series_patches(root, series, from_version)
    parsed = [parse_patch(p) for p in sources]
    target_dir = series_dir(root, series, to_version)
    if target_dir.exists() and any(target_dir.iterdir()) and not force:
        raise PatchError(
            f"{target_dir.relative_to(root)} already exists",
            hint="pass --force to replace its patches, or remove it first",
        )
    project = series.partition("/")[0]
    obtained = finder.find(project, to_version, release)
    if obtained.tree is None:
        raise SourceError(
            f"no {project} {to_version} source tree to port onto: {obtained.why_not}",
            hint="pass one with --source DIR|TARBALL",
        )
    tree = obtained.tree
    report_dir.mkdir(parents=True, exist_ok=True)
    ported: list[PortedPatch] = []
    with tempfile.TemporaryDirectory(prefix="channelsmith-port-") as scratch_name:
        scratch = Path(scratch_name)
        work = scratch / "work"
        materialize(tree, parsed, work)
        work.mkdir(parents=True, exist_ok=True)
        staged = scratch / "out"
        staged.mkdir()
        for patch in parsed:
            pair = scratch / "pair"
            shutil.rmtree(pair, ignore_errors=True)
            (pair / "a").mkdir(parents=True)
            for rel in patch.touched:
                if (work / rel).is_file():
                    (pair / "a" / rel).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(work / rel, pair / "a" / rel)
            ok, output = git_apply(work, patch, reject=True)
            rejected = () if ok else tuple(_failures(work, patch, output))
            shutil.copytree(work, pair / "b", ignore=shutil.ignore_patterns("*.rej"))
            diff = "".join(_file_diff(pair, f) for f in patch.files)
            text = retarget_header(patch.header, to_version) + diff
            rejects_file = None
            if rejected:
                rejects = sorted(work.rglob("*.rej"))
                rejects_file = report_dir / f"{patch.path.name}.rej"
                rejects_file.write_text("".join(r.read_text(errors="replace") + "\n" for r in rejects) or output)
                for r in rejects:
                    r.unlink()
                # A patch missing hunks must not pass for a finished one: it stays out of the repository.
                (report_dir / f"{patch.path.name}.partial").write_text(text)
            else:
                (staged / patch.path.name).write_text(text)
            ported.append(
                PortedPatch(
                    name=patch.path.name,
                    written=None if rejected else str((target_dir / patch.path.name).relative_to(root)),
                    rejected=rejected,
                    rejects_file=str(rejects_file) if rejects_file else None,
                )
            )
        _install_series(staged, target_dir)
    return PortResult(
        series=series, from_version=from_version, to_version=to_version, source=tree.describe(),
        target_dir=str(target_dir.relative_to(root)), patches=tuple(ported), report_dir=str(report_dir),
        recipe_block=recipe_block(root, series, from_version, to_version, [p.name for p in ported]),
    )


def _install_series(staged: Path, target_dir: Path) -> None:
    """Move the regenerated patches into place at once; old *.patch files there are replaced."""
    target_dir.mkdir(parents=True, exist_ok=True)
    for old in target_dir.glob("*.patch"):
        old.unlink()
    for new in sorted(staged.iterdir()):
        shutil.move(str(new), target_dir / new.name)


def recipe_block(root: Path, series: str, from_version: str, to_version: str, names: list[str]) -> str:
    """The ``if:`` source block to add to recipe.yaml for the ported series (printed, never written).

    It is the block of a recipe that lists the series at ``from_version``, with the version replaced;
    the sha256 is left for the user to fill in from a public record (never guessed).
    """
    project, _, name = series.partition("/")
    old_dir = f"patches/{project}/{from_version}/{name}/"
    for recipe_file in sorted((root / "recipes").glob("*/recipe.yaml")):
        lines = recipe_file.read_text().splitlines()
        for index, line in enumerate(lines):
            if old_dir not in line:
                continue
            start = next((i for i in range(index, -1, -1) if lines[i].lstrip().startswith("- if:")), None)
            if start is None:
                continue
            return _rewrite_block(lines, start, recipe_file, root, from_version, to_version, old_dir, names)
    rel = f"../../patches/{project}/{to_version}/{name}"
    listed = "\n".join(f"        - {rel}/{n}" for n in names)
    return (
        f"  - if: {project}_version == \"{to_version}\"\n    then:\n"
        f"      # sha256 of the {to_version} release tarball: copy it from a public record and name it here\n"
        f"      url: <release tarball of {project} {to_version}>\n      sha256: <from a public record>\n"
        f"      patches:\n{listed}"
    )


def _rewrite_block(lines: list[str], start: int, recipe_file: Path, root: Path, from_version: str,
                   to_version: str, old_dir: str, names: list[str]) -> str:
    indent = len(lines[start]) - len(lines[start].lstrip())
    end = start + 1
    while end < len(lines) and (not lines[end].strip() or len(lines[end]) - len(lines[end].lstrip()) > indent):
        end += 1
    out: list[str] = [f"# for {recipe_file.relative_to(root)}, beside its {from_version} block:"]
    patch_indent = None
    for line in lines[start:end]:
        stripped = line.strip()
        if old_dir in line:
            patch_indent = line[: len(line) - len(line.lstrip())]
            continue
        if stripped.startswith("sha256:"):
            pad = line[: len(line) - len(stripped)]
            out.append(f"{pad}# sha256 of the {to_version} release: copy it from a public record and name it here")
            out.append(f"{pad}sha256: <from a public record>")
            continue
        if stripped.startswith("#"):
            # The old block's comments name the record of the old checksum: they do not hold for the new one.
            continue
        out.append(line.replace(from_version, to_version))
        if stripped == "patches:" and patch_indent is None:
            patch_indent = line[: len(line) - len(stripped)] + "  "
            new_dir = old_dir.replace(f"/{from_version}/", f"/{to_version}/")
            out.extend(f"{patch_indent}- ../../{new_dir}{n}" for n in names)
    return "\n".join(out)


# ---------------------------------------------------------------- compile check

COMPILED = "compiled"
SKIPPED = "skipped"

# What the real PyTorch build defines for the distributed and CUDA units (torch/CMakeLists.txt,
# caffe2/CMakeLists.txt): every backend a series touches is switched on, as in these recipes' builds.
BUILD_DEFINES = (
    "USE_DISTRIBUTED", "USE_C10D", "USE_C10D_MPI", "USE_C10D_NCCL", "USE_CUDA", "USE_NCCL",
    "USE_RPC", "TORCH_CUDA_BUILD_MAIN_LIB", "BUILD_CAFFE2_OPS",
)
CXX_FLAGS = ("-std=c++17", "-fsyntax-only", "-fPIC", "-w", "-D_GLIBCXX_USE_CXX11_ABI=1")
SOURCE_SUFFIXES = (".cpp", ".cc", ".cxx")
HEADER_SUFFIXES = (".h", ".hpp", ".cuh")

# The NCCL each PyTorch release was built and tested with (its CUDA 12 wheel's nvidia-nccl-cu12 pin).
NCCL_FOR_TORCH = {"2.2": "2.19.3", "2.3": "2.20.5", "2.4": "2.20.5", "2.5": "2.21.5", "2.6": "2.21.5"}
DEFAULT_NCCL = "2.21.5"

# Headers CMake generates in a CUDA build; the CPU-only wheels lack them. Their content is what
# PyTorch's cmake writes for a shared-library build.
GENERATED_HEADERS = {"c10/cuda/impl/cuda_cmake_macros.h": "#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n"}

# Source-tree folders that hold headers under another include root than the tree's top.
TREE_INCLUDE_ROOTS = ("", "aten/src/", "torch/csrc/api/include/")

MAX_HEADER_ROUNDS = 60


@dataclass(frozen=True)
class UnitResult:
    """One patched translation unit (or a unit including one patched header) and how it compiled."""

    recipe: str
    series: str
    version: str
    unit: str
    status: str
    detail: str
    log: str = ""


@dataclass(frozen=True)
class Toolchain:
    """Where the compile check finds its headers."""

    torch_include: Path
    nccl_include: Path | None
    cuda_include: Path | None
    mpi_flags: tuple[str, ...]


def _unpack_wheel(wheel: Path, prefix: str, cache: Path) -> Path:
    """Unpack the ``prefix`` folder of a wheel once into the cache; returns where ``prefix`` lies."""
    target = cache / "unpacked" / wheel.name
    done = target / ".complete"
    if not done.is_file():
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(target, [n for n in archive.namelist() if n.startswith(prefix)])
        done.write_text(wheel.name)
    return target / prefix


def _nccl_wheel(cache: Path, version: str) -> Path | None:
    nccl = NCCL_FOR_TORCH.get(".".join(version.split(".")[:2]), DEFAULT_NCCL)
    folder = cache / "wheels"
    found = sorted(folder.glob(f"nvidia_nccl_cu12-{nccl}-*.whl")) if folder.is_dir() else []
    if not found:
        folder.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--platform",
             "manylinux2014_x86_64", "--python-version", "3.11", "-d", str(folder), f"nvidia-nccl-cu12=={nccl}"],
            capture_output=True, text=True,
        )
        found = sorted(folder.glob(f"nvidia_nccl_cu12-{nccl}-*.whl"))
    return found[0] if found else None


def toolchain(cache: Path, version: str) -> Toolchain:
    """The headers for compiling PyTorch ``version`` units: its release wheel's torch/include, NCCL, CUDA, MPI."""
    torch_wheel = wheel_headers(cache, version).location
    nccl_wheel = _nccl_wheel(cache, version)
    nvcc = shutil.which("nvcc")
    cuda_candidates = [Path("/usr/local/cuda/include")]
    if nvcc:
        cuda_candidates.append(Path(nvcc).resolve().parent.parent / "include")
    cuda = next((c for c in cuda_candidates if (c / "cuda_runtime_api.h").is_file()), None)
    mpi = subprocess.run(["pkg-config", "--cflags", "mpich"], capture_output=True, text=True)
    if mpi.returncode != 0:
        mpi = subprocess.run(["pkg-config", "--cflags", "ompi"], capture_output=True, text=True)
    return Toolchain(
        torch_include=_unpack_wheel(torch_wheel, "torch/include/", cache),
        nccl_include=_unpack_wheel(nccl_wheel, "nvidia/nccl/include/", cache) if nccl_wheel else None,
        cuda_include=cuda,
        mpi_flags=tuple(mpi.stdout.split()) if mpi.returncode == 0 else (),
    )


class MissingHeader(Exception):
    """A header neither the upstream tree nor the toolchain here provides (e.g. cusparse.h)."""


def _compile_unit(unit: Path, patched: Path, extra: Path, tree: SourceTree, tools: Toolchain) -> tuple[bool, str]:
    """-fsyntax-only of one unit; headers the wheel lacks are taken from the upstream tree as they are asked for."""
    generated = extra.parent / "generated"
    for rel, text in GENERATED_HEADERS.items():
        (generated / rel).parent.mkdir(parents=True, exist_ok=True)
        (generated / rel).write_text(text)
    includes = [patched, patched / "aten/src", extra, extra / "aten/src", extra / "torch/csrc/api/include",
                tools.torch_include, tools.torch_include / "torch/csrc/api/include", generated]
    includes += [p for p in (tools.nccl_include, tools.cuda_include) if p is not None]
    command = ["g++", *CXX_FLAGS, *(f"-D{d}" for d in BUILD_DEFINES), *tools.mpi_flags,
               *(f"-I{p}" for p in includes), str(unit)]
    output = ""
    for _round in range(MAX_HEADER_ROUNDS):
        result = subprocess.run(command, capture_output=True, text=True)
        output = result.stderr
        if result.returncode == 0:
            return True, output
        missing = re.search(r"fatal error: (\S+): No such file or directory", output)
        if not missing:
            return False, output
        header = missing.group(1)
        candidates = [root + header for root in TREE_INCLUDE_ROOTS if tree.has(root + header)]
        if not candidates:
            raise MissingHeader(header)
        tree.extract(candidates[:1], extra)
    return False, output


def compile_check(
    root: Path, finder: SourceFinder, cache: Path, recipe_names: Iterable[str] = (), versions: Iterable[str] = ()
) -> list[UnitResult]:
    """Compile every unit the PyTorch series touch, patched, against the matching release headers."""
    results: list[UnitResult] = []
    # Recipes that share a version and a patch list share the verdict: each unit compiles once (~30 s).
    verdicts: dict[tuple, UnitResult] = {}
    for target in check_targets(root, recipe_names, versions):
        if target.project != "pytorch":
            continue
        names = _series_names(root, target)
        parsed = [parse_patch(p) for p in target.patches]
        obtained = finder.find(target.project, target.version, target.release)

        if obtained.tree is None or obtained.tree.partial:
            results.extend(_skipped(target, names, parsed, f"no upstream tree: {obtained.why_not}"))
            continue
        # A reconstructed series may adapt one release's files to another release's headers.
        headers = next((p.header.compiles_against for p in parsed if p.header.compiles_against), target.version)
        tools = toolchain(cache, headers)
        with tempfile.TemporaryDirectory(prefix="channelsmith-compile-") as scratch_name:
            scratch = Path(scratch_name)
            outcome = apply_series(obtained.tree, parsed, scratch / "tree")
            if outcome.failures or outcome.missing:
                results.extend(_skipped(target, names, parsed, "the series does not apply; run `channelsmith patches check`"))
                continue
            done: set[str] = set()
            for patch in parsed:
                for path in sorted(patch.touched - done):
                    done.add(path)
                    key = (target.version, tuple(p.read_bytes() for p in target.patches), path)
                    if key not in verdicts:
                        verdicts[key] = _unit_result(target, names[patch.path], path, scratch, obtained.tree, tools,
                                                     headers)
                    shared = verdicts[key]
                    results.append(UnitResult(target.recipe, names[patch.path], target.version, path,
                                              shared.status, shared.detail, shared.log))
    return results


def _skipped(target: CheckTarget, names: Mapping[Path, str], parsed: list[PatchFile], detail: str) -> list[UnitResult]:
    return [
        UnitResult(target.recipe, names[patch.path], target.version, path, SKIPPED, detail)
        for patch in parsed
        for path in sorted(patch.touched)
    ]


def _unit_result(target: CheckTarget, series: str, path: str, scratch: Path, tree: SourceTree,
                 tools: Toolchain, headers: str) -> UnitResult:
    patched = scratch / "tree"
    if path.endswith(SOURCE_SUFFIXES):
        unit = patched / path
    elif path.endswith(HEADER_SUFFIXES):
        unit = scratch / "units" / (path.replace("/", "_") + ".cpp")
        unit.parent.mkdir(parents=True, exist_ok=True)
        unit.write_text(f'#include "{patched / path}"\n')
    else:
        return UnitResult(target.recipe, series, target.version, path, SKIPPED, "not C++ (no unit to compile)")
    if not (patched / path).is_file():
        return UnitResult(target.recipe, series, target.version, path, SKIPPED, "deleted by the series")
    try:
        ok, log = _compile_unit(unit, patched, scratch / "extra", tree, tools)
    except MissingHeader as missing:
        return UnitResult(target.recipe, series, target.version, path, SKIPPED,
                          f"needs {missing}, which neither the upstream tree nor the headers here provide")
    if ok:
        kind = "unit" if path.endswith(SOURCE_SUFFIXES) else "header, through a unit including it"
        return UnitResult(target.recipe, series, target.version, path, COMPILED, f"{kind}; torch {headers} headers")
    first = next((line for line in log.splitlines() if "error" in line), log.strip()[:200])
    return UnitResult(target.recipe, series, target.version, path, FAILED, first, log)
