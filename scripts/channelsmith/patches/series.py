"""Where series live: ``patches/<project>/<version>/<series>/NNNN-*.patch``, named PROJECT/SERIES."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from channelsmith.errors import PatchError

PATCHES_DIR = "patches"


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
