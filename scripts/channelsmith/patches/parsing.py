"""Patch files: the header every patch starts with (docs/reference/recipes.md), then the files and hunks of its diff.

Diff paths are read with strip level 1, as the build reads them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from channelsmith.errors import PatchError

HEADER_KEYS = ("What", "Why", "Upstream", "Versions")
# Optional: Reconstructed: says the patched file is a reconstruction, not the upstream release's file, and
# why; every report of the series carries it. Compiles-Against: the PyTorch release whose headers the
# patched files are compiled against when that is not the source's own (docs/reference/recipes.md).
OPTIONAL_HEADER_KEYS = ("Reconstructed", "Compiles-Against")
HEADER_END = "---"


@dataclass(frozen=True)
class PatchHeader:
    """The header every patch starts with (docs/reference/recipes.md)."""

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
    def compiles_against(self) -> tuple[str, ...]:
        """The releases whose headers the patched files compile against (empty = the source's own).

        One series may stand in for several releases that share the header it targets (torch-2.14-compat:
        2.14.1 and 2.15.0), so the field is a list, separated by spaces or commas like Versions:.
        """
        return tuple(v for v in re.split(r"[,\s]+", self.fields.get("Compiles-Against", "")) if v)


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
                    "(see docs/reference/recipes.md)",
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
        "(see docs/reference/recipes.md)",
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
