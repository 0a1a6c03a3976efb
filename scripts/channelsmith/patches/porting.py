"""`patches port`: a series rebased onto another version's tree, regenerated as clean diffs, with the
recipe's ``if:`` block to add printed (never written)."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from channelsmith.errors import PatchError, SourceError
from channelsmith.patches.applying import HunkFailure, git_apply, git_env, hunk_failures, materialize
from channelsmith.patches.parsing import HEADER_END, FileDiff, PatchHeader, parse_patch
from channelsmith.patches.series import series_dir, series_patches
from channelsmith.sources import ReleaseSource, SourceFinder

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
        cwd=base, capture_output=True, text=True, env=git_env(base),
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
            rejected = () if ok else tuple(hunk_failures(work, patch, output))
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
