"""How far a package may expand when it is extracted, checked before anything of it is written.

A package archive is small and its files need not be: zstd turns gigabytes of zeros into kilobytes,
and an extraction that trusts the archive runs until the disk is full. A package records what it
holds: its info/paths.json gives each file's ``size_in_bytes``. :func:`check_expansion` streams the
archive's tar members without writing them (py-rattler's PackageArchive decompresses and skips
them) and refuses the package as soon as its files add up to more than that record, and its info/
part to more than :data:`INFO_LIMIT`. So a bomb costs the time to decompress what is recorded,
never the disk. What it returns bounds unpack.sh's extraction too (``tar_bound``: pack writes it
into the bundle's file list). A package may also record honestly more than the disk holds:
:func:`check_room` refuses an install whose packages, as recorded, do not fit where they go.
"""

from __future__ import annotations

import os
import shutil
import struct
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from rattler import PathsJson
from rattler.package_streaming import PackageArchive

from channelsmith.engine import run_rattler
from channelsmith.errors import DiskSpaceError, ExpansionError

# info/ holds metadata (index.json, paths.json, about.json, the recipe, licenses, test files) that no
# record bounds. 64 MiB is a chosen limit, not a measured one: the packages the tests build hold
# 1-27 KiB there, benchmarks/expansion_cost.py's numpy and sympy (6,000 files) 1 MiB; it only has to
# stop a bomb hidden in info/ long before a disk fills.
INFO_LIMIT = 64 << 20
# A package whose paths.json gives no size for any of its files (written by a tool that recorded
# none) is bounded by this many times its archive's size instead: a chosen ratio, far above what
# compression gives real packages (4.7 for the benchmark's numpy and sympy), far below what zeros give.
RATIO_WITHOUT_SIZES = 100
# What a tar stream may hold beside its members' contents: a header block, an extended header (pax
# records or a GNU long name) of at most two blocks plus the names it carries, and the end of the
# archive padded to a 10 KiB record. A bound for unpack.sh, which counts the stream's bytes.
_BLOCK = 512
_END = 20 << 10


@dataclass(frozen=True)
class Expansion:
    """What one package archive expands to, as measured by :func:`check_expansion`."""

    archive: Path
    recorded: int  # what its info/paths.json records for its files (or the ratio's bound, see above)
    files: int  # what its payload's files hold
    info: int  # what its info/ files hold
    tar_bound: int  # the most bytes its payload tar (a .tar.bz2: the whole tar) may decompress to


def _padded(size: int) -> int:
    return -(-size // _BLOCK) * _BLOCK


def _entry_bound(name: str, size: int, link: str | None) -> int:
    names = len(name.encode()) + len((link or "").encode())
    return _BLOCK + _padded(size) + 2 * _BLOCK + _padded(2 * names + 256)


def _recorded(paths: PathsJson, archive: Path) -> int:
    # rattler-build leaves out the size of an empty file (py-rattler reads it as None); a paths.json with no
    # size at all comes from a tool that recorded none.
    sizes = [entry.size_in_bytes for entry in paths.paths if not entry.path_type.directory]
    if sizes and all(size is None for size in sizes):
        return RATIO_WITHOUT_SIZES * archive.stat().st_size
    return sum(size or 0 for size in sizes)


def _zip_names(archive: Path) -> list[tuple[int, str]]:
    """Each member of a zip, as its local headers give it (offset, name): read one after the other from the
    start, as py-rattler's extraction reads them, whatever the zip's directory at its end lists."""
    members = []
    with open(archive, "rb") as file:
        while True:
            offset = file.tell()
            header = file.read(30)
            if len(header) < 30 or header[:4] != b"PK\x03\x04":
                return members
            (flags,) = struct.unpack("<H", header[6:8])
            (size,) = struct.unpack("<I", header[18:22])  # compressed; .conda members are stored
            name_size, extra_size = struct.unpack("<HH", header[26:30])
            raw, extra = file.read(name_size), file.read(extra_size)
            if flags & 0x08:  # its size follows its data, where only decompressing it finds it
                raise ValueError(f"its zip member {raw.decode('utf-8', 'replace')} gives its size after its data")
            if size == 0xFFFFFFFF:  # zip64: the sizes are in an extra field, uncompressed first
                at = 0
                while at + 4 <= len(extra):
                    kind, length = struct.unpack("<HH", extra[at : at + 4])
                    if kind == 1:
                        size = struct.unpack("<Q", extra[at + 12 : at + 20])[0]
                    at += 4 + length
            members.append((offset, raw.decode("utf-8" if flags & 0x800 else "cp437")))
            file.seek(size, os.SEEK_CUR)


def _check_zip_members(archive: Path, name: str) -> None:
    """ExpansionError unless ``archive`` (a .conda) holds exactly one pkg- and one info- section beside its other
    members, the same in its local headers as in its directory.

    py-rattler's stream (the count below) reads the first pkg- and info- members its directory lists; its
    extraction unpacks every member whose name ends with .tar.zst, in the order of their local headers, listed
    or not. Any other such member would be extracted without being counted.
    """
    with zipfile.ZipFile(archive) as opened:
        listed = [(info.header_offset, info.filename) for info in opened.infolist()]
    read = _zip_names(archive)
    if read != listed:
        differ = sorted({member for _at, member in read} ^ {member for _at, member in listed})
        raise _uncounted(name, "zip members that its directory does not list as they are stored "
                               f"({', '.join(differ or [member for _at, member in read])})")  # fmt: skip
    others = [member for _at, member in listed if member.replace("\\", "/").rstrip("/").endswith(".tar.zst")]
    for section in ("pkg-", "info-"):  # the first of each (at the top) is what the stream reads; it refuses none
        first = next((m for m in others if m.startswith(section) and not set("/\\") & set(m)), None)
        if first is not None:
            others.remove(first)
    if others:
        raise _uncounted(name, f"{', '.join(others)} beside its one info- and one pkg- section")


# The hint of a package refused as a bomb or as holding members the count cannot see.
NOT_INSTALLED = "do not install it: rebuild the package (or take it again from a good channel), then deploy or pack again"


def _uncounted(name: str, what: str) -> ExpansionError:
    return ExpansionError(
        f"the package {name} holds {what}, which its extraction would unpack without counting it: nothing of "
        "it was extracted (a crafted package, or one damaged before it was hashed)",
        hint=NOT_INSTALLED,
    )


def _bomb(name: str, what: str) -> ExpansionError:
    return ExpansionError(
        f"the package {name} expands past what it records: {what}; nothing of it was extracted "
        "(a decompression bomb, or a package damaged before it was hashed)",
        hint=NOT_INSTALLED,
    )


async def _measure(archive: Path, name: str) -> Expansion:
    try:
        if archive.name.endswith(".conda"):
            _check_zip_members(archive, name)
        package = await PackageArchive.from_path(archive)
        info = 0
        bound = 0
        paths_json: bytes | None = None
        async for entry in package.stream("info"):
            info += entry.size
            bound += _entry_bound(entry.name, entry.size, entry.link_target)
            if info > INFO_LIMIT:
                raise _bomb(name, f"its info/ files hold more than {INFO_LIMIT} bytes, the most a package's "
                                     "metadata may hold")  # fmt: skip
            if entry.name == "info/paths.json" and entry.is_file:
                paths_json = await entry.read()
        if paths_json is None:
            raise ExpansionError(
                f"the package {name} holds no info/paths.json, which records its files",
                hint="rebuild the package with rattler-build or conda-build, or take it again from a good channel",
            )
        recorded = _recorded(PathsJson.from_str(paths_json.decode()), archive)
        files = 0
        if not name.endswith(".tar.bz2"):
            bound = 0  # a .conda's payload is a tar of its own, without info/
        async for entry in package.stream("pkg"):
            # Not is_file alone: the extraction (the tar crate) writes every type it does not know, a contiguous
            # file ('7'), a device or fifo, as a regular file; only links write no data.
            if not entry.is_link:
                files += entry.size
            bound += _entry_bound(entry.name, entry.size, entry.link_target)
            if files > recorded:
                raise _bomb(name, f"its files hold more than the {recorded} bytes its info/paths.json records "
                                     f"(stopped at {files} bytes, in {entry.name})")  # fmt: skip
    except ExpansionError:
        raise
    except Exception as exc:  # py-rattler raises OSError or its own exception types, per failure kind
        raise _unreadable(archive, exc) from None
    return Expansion(archive, recorded, files, info, bound + _END)


def _unreadable(archive: Path, exc: BaseException) -> ExpansionError:
    text = str(exc).strip()
    why = text.splitlines()[0] if text else type(exc).__name__
    return ExpansionError(
        f"corrupt package file: {archive} cannot be read as a conda package ({why})",
        hint="rebuild the package, or copy it again from a good source",
    )


def check_expansion(archive: Path, name: str | None = None) -> Expansion:
    """What ``archive`` expands to; ExpansionError (exit 2) if it holds more than it records, or is unreadable.

    Nothing is written: the members are decompressed and counted, and the count stops at the record.
    ``name``: the package's file name in messages, where ``archive`` is a copy under another name.
    """
    return run_rattler(_measure(Path(archive), name or Path(archive).name))


def check_expansions(archives: Mapping[str, Path]) -> list[Expansion]:
    """:func:`check_expansion` of each archive (package file name -> its path), all in one event loop."""

    async def measure_all() -> list[Expansion]:
        return [await _measure(Path(path), name) for name, path in archives.items()]

    return run_rattler(measure_all())


def _existing(path: Path) -> Path:
    while not path.exists():
        path = path.parent
    return path


def _mib(count: int) -> str:
    return f"{count / (1 << 20):.1f} MiB"


def check_room(expansions: Sequence[Expansion], cache: Path, prefix: Path) -> None:
    """DiskSpaceError (exit 3) unless the packages fit where py-rattler extracts them (``cache``: their files and
    info/, as measured) and, where the prefix is on another file system, where it then copies their files.

    On one file system the prefix takes hard links to the cache's files, and needs no room of its own but for
    the files whose build prefix is replaced (left out: a few text files, next to a bomb's gigabytes).
    """
    unpacked = sum(e.recorded + e.info for e in expansions)
    needs = [(_existing(cache), unpacked)]
    beside = _existing(prefix)
    if os.stat(beside).st_dev != os.stat(needs[0][0]).st_dev:
        needs.append((beside, sum(e.recorded for e in expansions)))
    for folder, needed in needs:
        free = shutil.disk_usage(folder).free
        if needed > free:
            raise DiskSpaceError(
                f"the packages to install expand to {_mib(needed)} (as their info/paths.json records), and "
                f"{folder} has {_mib(free)} free: nothing was extracted",
                hint=f"free space there (df -h {folder}), or install into a prefix on a larger file system",
            )
