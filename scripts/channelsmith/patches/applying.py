"""Applying a patch list to a scratch copy of an upstream tree, and saying which hunks did not apply and why.

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
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from channelsmith.patches.parsing import Hunk, PatchFile
from channelsmith.sources import SourceTree

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


def git_env(scratch: Path) -> dict[str, str]:
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
        [*command, str(patch.path)], cwd=scratch, capture_output=True, text=True, env=git_env(scratch)
    )
    return result.returncode == 0, result.stdout + result.stderr


def hunk_failures(scratch: Path, patch: PatchFile, output: str) -> list[HunkFailure]:
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
            result.failures.extend(hunk_failures(scratch, patch, output))
            return result
        result.applied.append(patch.path)
    return result
