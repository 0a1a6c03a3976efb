"""A conda channel in a local directory: create, check, publish into, re-index.

py-rattler does the indexing (``rattler.index.index_fs``) and reads the package archives; this
module only decides *when* files move so that a reader never sees a half-written channel:

- every package file reaches the channel under a temporary name and is renamed into place after
  an fsync, so a file with a final name is always complete;
- the index is rebuilt in a scratch tree inside the channel (hard links to the package files plus a
  copy of the current repodata), then each subdir's ``repodata.json`` is renamed over the old one.
  A process killed at any point leaves repodata that lists only files that exist, intact;
- publishers hold an exclusive ``flock`` on a lock file inside the channel, so two publishes at once
  run one after the other and both land.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from rattler import IndexJson
from rattler.index import index_fs
from rattler.package_streaming import extract

from channelsmith.engine import run_rattler
from channelsmith.errors import ChannelError, DiskSpaceError
from channelsmith.expansion import check_expansion

# Where the local channel lives unless a command is told otherwise (relative to the working directory).
DEFAULT_CHANNEL_DIR = Path("channel")

REPODATA = "repodata.json"
LOCK_FILE = ".channelsmith.lock"
# Subdirs a new channel starts with: noarch is required by every conda client; linux-64 is where
# the compiled packages of this repository go, and clients query it on every solve.
INITIAL_SUBDIRS = ("noarch", "linux-64")
PACKAGE_SUFFIXES = (".conda", ".tar.bz2")
# Repodata variants other tools may have written next to repodata.json; publish only writes
# repodata.json, so these would go stale and are removed before it is replaced.
STALE_REPODATA = ("repodata.json.zst", "repodata.json.bz2", "repodata_shards.msgpack.zst", "current_repodata.json")
_SCRATCH_PREFIX = ".channelsmith-index-"
_PART_PREFIX = ".channelsmith-part-"
_PROBE_PREFIX = ".channelsmith-probe-"

# --------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SubdirReport:
    """One subdir of a checked channel."""

    name: str
    packages: int


@dataclass(frozen=True)
class ChannelReport:
    """What :func:`check_channel` found: a channel whose repodata matches its files."""

    path: Path
    url: str
    subdirs: tuple[SubdirReport, ...]
    unlisted: tuple[Path, ...]
    hashes_verified: bool

    @property
    def packages(self) -> int:
        return sum(subdir.packages for subdir in self.subdirs)


@dataclass(frozen=True)
class ListedPackage:
    """One package file as the channel's repodata describes it."""

    path: Path
    subdir: str
    size: int
    sha256: str


@dataclass(frozen=True)
class PublishResult:
    """What a publish did: every package's path in the channel, and which of them it added to the index."""

    targets: tuple[Path, ...]
    added: tuple[Path, ...]

    @property
    def unchanged(self) -> tuple[Path, ...]:
        """Packages the channel already listed with the same content (nothing was written for them)."""
        return tuple(target for target in self.targets if target not in self.added)


@dataclass(frozen=True)
class PackageFile:
    """A package archive that passed validation and may be published."""

    path: Path
    subdir: str
    file_name: str
    size: int
    sha256: str


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------


def channel_url(path: Path) -> str:
    """The ``file://`` URL of a channel directory."""
    return Path(path).resolve().as_uri()


def url_path(url: str) -> Path | None:
    """The local path of a ``file://`` URL (a channel's, or a package's in one), else None."""
    parsed = urlparse(url)
    if parsed.scheme != "file":
        return None
    return Path(unquote(parsed.path))


def is_channel(path: Path) -> bool:
    """Whether ``path`` holds an indexed channel (conda clients require ``noarch/repodata.json``)."""
    return (Path(path) / "noarch" / REPODATA).is_file()


def sha256_of(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _not_a_channel_hint() -> str:
    return (
        "point --channel-dir at a channel (a directory holding noarch/repodata.json); "
        "channelsmith build or publish starts one in a new or empty directory"
    )


def _reindex_hint(channel_dir: Path) -> str:
    return f"rebuild the index from the package files: channelsmith publish --reindex --channel-dir {channel_dir}"


def channel_subdirs(channel_dir: Path) -> list[str]:
    """Subdirs of a channel: folders that hold a repodata.json or package files (never dot-folders)."""
    names = []
    for entry in sorted(Path(channel_dir).iterdir()):
        if entry.name.startswith(".") or not entry.is_dir():
            continue
        if (entry / REPODATA).is_file() or any(_package_files(entry)):
            names.append(entry.name)
    return names


def _package_files(subdir: Path) -> Iterator[Path]:
    for entry in sorted(subdir.iterdir()):
        if entry.name.startswith(".") or not entry.is_file():
            continue
        if entry.name.endswith(PACKAGE_SUFFIXES):
            yield entry


def read_repodata(repodata_file: Path) -> dict[str, Any]:
    """Parse one subdir's repodata.json; ChannelError (naming file, line, column) if it is corrupt."""
    channel_dir = repodata_file.parent.parent
    try:
        document = json.loads(repodata_file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ChannelError(
            f"corrupt repodata: {repodata_file} is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})",
            hint=_reindex_hint(channel_dir),
        ) from None
    except UnicodeDecodeError:
        raise ChannelError(
            f"corrupt repodata: {repodata_file} is not UTF-8 text", hint=_reindex_hint(channel_dir)
        ) from None
    except OSError as exc:
        raise ChannelError(
            f"cannot read {repodata_file}: {exc.strerror}", hint="check the file's permissions"
        ) from None
    if not isinstance(document, dict) or not all(
        isinstance(document.get(key, {}), dict) for key in ("packages", "packages.conda")
    ):
        raise ChannelError(
            f"corrupt repodata: {repodata_file} does not hold a repodata object with 'packages' maps",
            hint=_reindex_hint(channel_dir),
        )
    return document


def listed_packages(channel_dir: Path, subdir: str) -> list[ListedPackage]:
    """Every package file the subdir's repodata lists, with the size and sha256 it records."""
    repodata_file = Path(channel_dir) / subdir / REPODATA
    document = read_repodata(repodata_file)
    listed = []
    for key in ("packages", "packages.conda"):
        for file_name, entry in document.get(key, {}).items():
            if (
                not isinstance(entry, dict)
                or not isinstance(entry.get("size"), int)
                or not isinstance(entry.get("sha256"), str)
                or "/" in file_name
            ):
                raise ChannelError(
                    f"corrupt repodata: {repodata_file} entry {file_name!r} lacks a size or sha256",
                    hint=_reindex_hint(Path(channel_dir)),
                )
            listed.append(ListedPackage(Path(channel_dir) / subdir / file_name, subdir, entry["size"], entry["sha256"]))
    return listed


def verify_listed(package: ListedPackage, *, hashes: bool = True, listed_in: str | None = None) -> None:
    """ChannelError unless the file exists with the size (and sha256) its record gives.

    ``listed_in`` names where the record comes from in messages (default: the subdir's repodata.json).
    """
    channel_dir = package.path.parent.parent
    source = listed_in or f"{package.subdir}/{REPODATA}"
    hint = (
        f"remove {package.path} or put back a good copy of it, then "
        f"rebuild the index: channelsmith publish --reindex --channel-dir {channel_dir}"
    )
    try:
        size = package.path.stat().st_size
    except FileNotFoundError:
        raise ChannelError(f"{package.path} is listed in {source} but missing", hint=hint) from None
    if size != package.size:
        raise ChannelError(
            f"corrupt package file: {package.path} has {size} bytes, {source} says {package.size}",
            hint=hint,
        )
    if hashes and sha256_of(package.path) != package.sha256:
        raise ChannelError(
            f"corrupt package file: the sha256 of {package.path} differs from the one in {source}",
            hint=hint,
        )


def check_channel(path: Path, *, hashes: bool = True) -> ChannelReport:
    """Check that ``path`` is a channel whose repodata matches its files.

    Every subdir's repodata.json must parse, and every file it lists must exist with the recorded
    size and (unless ``hashes`` is false) sha256. Package files the repodata does not list are
    reported, not rejected: a publish that was killed after copying leaves them, and the next publish
    indexes them. Raises ChannelError saying what is wrong, which file, and what to do.
    """
    channel_dir = Path(path)
    if not channel_dir.exists():
        raise ChannelError(
            f"channel directory {channel_dir} does not exist",
            hint="build or publish into it first (both create it), or pass the right --channel-dir",
        )
    if not channel_dir.is_dir():
        raise ChannelError(f"{channel_dir} is a file, not a channel directory", hint=_not_a_channel_hint())
    if not is_channel(channel_dir):
        what = "is empty" if not any(channel_dir.iterdir()) else "has no noarch/repodata.json"
        raise ChannelError(f"{channel_dir} is not a conda channel: it {what}", hint=_not_a_channel_hint())
    subdirs = []
    unlisted: list[Path] = []
    for subdir in channel_subdirs(channel_dir):
        if not (channel_dir / subdir / REPODATA).is_file():
            unlisted.extend(_package_files(channel_dir / subdir))
            continue
        listed = listed_packages(channel_dir, subdir)
        for package in listed:
            verify_listed(package, hashes=hashes)
        names = {package.path.name for package in listed}
        unlisted.extend(p for p in _package_files(channel_dir / subdir) if p.name not in names)
        subdirs.append(SubdirReport(subdir, len(listed)))
    return ChannelReport(
        path=channel_dir,
        url=channel_url(channel_dir),
        subdirs=tuple(subdirs),
        unlisted=tuple(unlisted),
        hashes_verified=hashes,
    )


def validate_package(path: Path) -> PackageFile:
    """Read a package archive end to end; ChannelError naming it if it is not a sound conda package.

    The archive is extracted into a throw-away directory (py-rattler checks every member while
    streaming), then its info/index.json gives the subdir it belongs to.
    """
    path = Path(path)
    if not path.name.endswith(PACKAGE_SUFFIXES):
        raise ChannelError(
            f"{path} is not a conda package (expected a .conda or .tar.bz2 file)",
            hint="pass the package files a build wrote, e.g. DIR/noarch/NAME-VERSION-BUILD.conda",
        )
    if not path.is_file():
        raise ChannelError(f"package file {path} does not exist", hint="check the path")
    check_expansion(path)  # a bomb is refused before the extraction below writes anything
    with tempfile.TemporaryDirectory(prefix="channelsmith-validate-") as scratch:
        try:
            sha256, _md5 = extract(path, scratch)
            index = IndexJson.from_package_directory(scratch)
        except Exception as exc:  # py-rattler raises OSError or its own ExtractError per failure kind
            raise ChannelError(
                f"corrupt package file: {path} cannot be read as a conda package ({_first_line(exc)})",
                hint="rebuild the package, or copy it again from a good source",
            ) from None
    stem = path.name.removesuffix(".conda").removesuffix(".tar.bz2")
    expected = f"{index.name.normalized}-{index.version}-{index.build}"
    if stem != expected:
        raise ChannelError(
            f"{path} is named differently from the package inside it ({expected})",
            hint="publish the file under the name the build gave it",
        )
    return PackageFile(path, index.subdir or "noarch", path.name, path.stat().st_size, sha256.hex())


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------


def _mode(directory: bool) -> int:
    # Temporary files and directories are created private (0600/0700); what lands in the channel
    # gets the permissions a plain mkdir/open would give under the caller's umask.
    mask = os.umask(0)
    os.umask(mask)
    return (0o777 if directory else 0o666) & ~mask


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _cannot_write(path: Path, exc: OSError) -> ChannelError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return DiskSpaceError(
            f"cannot write the channel at {path}: {exc.strerror or exc}",
            hint="free space (or quota) on that file system, or pass another --channel-dir",
        )
    return ChannelError(
        f"cannot write the channel at {path}: {exc.strerror or exc}",
        hint="pass a --channel-dir you can write to",
    )


def check_writable(path: Path) -> None:
    """Raise ChannelError unless a publish could write the channel at ``path``; leaves nothing behind.

    Asks the file system itself rather than the permission bits (which say nothing for root, a
    read-only mount or an ACL): a file is created and removed in the channel and each of its subdirs,
    or, for a channel that does not exist yet, in the nearest existing folder above it, where publish
    would create it.
    """
    channel_dir = Path(path).absolute()
    if channel_dir.exists() and not channel_dir.is_dir():
        raise ChannelError(f"{channel_dir} is a file, not a channel directory", hint=_not_a_channel_hint())
    if channel_dir.is_dir():
        places = [channel_dir] + [channel_dir / subdir for subdir in channel_subdirs(channel_dir)]
    else:
        above = channel_dir.parent
        while not above.exists() and above != above.parent:
            above = above.parent
        if not above.is_dir():
            raise _cannot_write(channel_dir, NotADirectoryError(errno.ENOTDIR, f"{above} is not a directory"))
        places = [above]
    for place in places:
        try:
            fd, probe = tempfile.mkstemp(prefix=_PROBE_PREFIX, dir=place)
        except OSError as exc:
            raise _cannot_write(channel_dir, exc) from None
        os.close(fd)
        os.unlink(probe)


def ensure_channel(path: Path) -> Path:
    """Return ``path`` as a channel, creating an empty indexed one if it is absent or empty.

    The new channel is built in a sibling temporary directory and renamed into place, so a
    half-created channel is never visible. A non-empty directory that is not a channel is an
    error (ChannelError): channelsmith never writes into a folder it did not make.
    """
    channel_dir = Path(path)
    if channel_dir.exists() and not channel_dir.is_dir():
        raise ChannelError(f"{channel_dir} is a file, not a channel directory", hint=_not_a_channel_hint())
    if channel_dir.is_dir() and any(channel_dir.iterdir()):
        if is_channel(channel_dir):
            return channel_dir
        raise ChannelError(
            f"{channel_dir} is not empty and is not a conda channel (no noarch/repodata.json)",
            hint=_not_a_channel_hint(),
        )
    try:
        channel_dir.parent.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=f".{channel_dir.name}.new-", dir=channel_dir.parent))
    except OSError as exc:
        raise _cannot_write(channel_dir, exc) from None
    try:
        for subdir in INITIAL_SUBDIRS:
            (scratch / subdir).mkdir(mode=_mode(directory=True))
        run_rattler(index_fs(scratch, write_zst=False, write_shards=False))
        # index_fs leaves its (empty) work folder behind; it is no part of the channel.
        shutil.rmtree(scratch / ".tmp", ignore_errors=True)
        os.chmod(scratch, _mode(directory=True))
        for subdir in INITIAL_SUBDIRS:
            _fsync_file(scratch / subdir / REPODATA)
            _fsync_dir(scratch / subdir)
        try:
            # rename(2) replaces an empty directory atomically, so an existing empty folder works too.
            os.rename(scratch, channel_dir)
        except OSError as exc:
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST) and is_channel(channel_dir):
                return channel_dir  # another process created it meanwhile
            raise
        _fsync_dir(channel_dir.parent)
    except OSError as exc:
        raise _cannot_write(channel_dir, exc) from None
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return channel_dir


@contextmanager
def channel_lock(channel_dir: Path) -> Iterator[None]:
    """Hold the channel's exclusive publish lock (``flock`` on a file inside the channel)."""
    try:
        fd = os.open(Path(channel_dir) / LOCK_FILE, os.O_RDWR | os.O_CREAT, _mode(directory=False))
    except OSError as exc:
        raise _cannot_write(Path(channel_dir), exc) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _clear_leftovers(channel_dir: Path) -> None:
    """Remove what a killed publish left behind; only called with the lock held, so nobody owns them."""
    for entry in channel_dir.iterdir():
        if entry.name.startswith(_SCRATCH_PREFIX) and entry.is_dir():
            shutil.rmtree(entry)
        elif entry.is_dir() and not entry.name.startswith("."):
            for part in entry.glob(f"{_PART_PREFIX}*"):
                part.unlink()


def _copy_into(package: PackageFile, target: Path) -> None:
    """Copy a package to ``target`` through a temporary name, fsynced, then renamed into place."""
    target.parent.mkdir(mode=_mode(directory=True), exist_ok=True)
    fd, part = tempfile.mkstemp(prefix=_PART_PREFIX, dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as sink, open(package.path, "rb") as source:
            shutil.copyfileobj(source, sink, 1 << 20)
            sink.flush()
            os.fsync(sink.fileno())
        os.chmod(part, _mode(directory=False))
        os.replace(part, target)
    except BaseException:
        Path(part).unlink(missing_ok=True)
        raise
    _fsync_dir(target.parent)


def _reindex_locked(channel_dir: Path, *, force: bool) -> None:
    """Rebuild the index in a scratch tree and rename each repodata.json into place. Lock held."""
    scratch = Path(tempfile.mkdtemp(prefix=_SCRATCH_PREFIX, dir=channel_dir))
    try:
        subdirs = sorted(set(channel_subdirs(channel_dir)) | {"noarch"})
        for subdir in subdirs:
            (scratch / subdir).mkdir()
            for package in _package_files(channel_dir / subdir):
                try:
                    os.link(package, scratch / subdir / package.name)
                except OSError:
                    shutil.copy2(package, scratch / subdir / package.name)
            current = channel_dir / subdir / REPODATA
            if not force and current.is_file():
                # index_fs reads only the packages the current repodata does not list yet.
                shutil.copy2(current, scratch / subdir / REPODATA)
        run_rattler(index_fs(scratch, write_zst=False, write_shards=False, force=force))
        for subdir in subdirs:
            fresh = scratch / subdir / REPODATA
            _fsync_file(fresh)
            os.chmod(fresh, _mode(directory=False))
            for stale in STALE_REPODATA:
                (channel_dir / subdir / stale).unlink(missing_ok=True)
            shutil.rmtree(channel_dir / subdir / "shards", ignore_errors=True)
            (channel_dir / subdir).mkdir(mode=_mode(directory=True), exist_ok=True)
            os.replace(fresh, channel_dir / subdir / REPODATA)
            _fsync_dir(channel_dir / subdir)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _unlisted_validated(channel_dir: Path) -> None:
    """Unlisted package files are about to be indexed: each must be a sound package first."""
    for unlisted in check_channel(channel_dir, hashes=False).unlisted:
        validate_package(unlisted)


def publish(channel_dir: Path, packages: Sequence[Path]) -> list[Path]:
    """Publish package archives into a channel (created if absent) and re-index it; returns their paths there.

    :func:`publish_files` does the work and also says which files were new to the channel.
    """
    return list(publish_files(channel_dir, packages).targets)


def publish_files(channel_dir: Path, packages: Sequence[Path]) -> PublishResult:
    """Publish package archives into a channel (created if absent) and re-index it.

    Every archive is validated before anything is written: a corrupt one raises ChannelError naming
    it and leaves the channel as it was. Then, under the channel's exclusive lock, the channel is
    checked, each package is copied into its subdir (temp file, fsync, rename) and the index is
    rebuilt atomically. Publishing a file the channel already holds with the same content is a no-op;
    the same file name with different content is refused (a package file name is immutable).
    """
    channel_dir = Path(channel_dir)
    validated: dict[tuple[str, str], PackageFile] = {}
    for path in packages:
        package = validate_package(Path(path))
        key = (package.subdir, package.file_name)
        earlier = validated.get(key)
        if earlier is not None and earlier.sha256 != package.sha256:
            raise ChannelError(
                f"{earlier.path} and {package.path} are both {package.file_name} but differ",
                hint="publish only one of them",
            )
        validated[key] = package
    ensure_channel(channel_dir)
    targets = []
    with channel_lock(channel_dir):
        try:
            _clear_leftovers(channel_dir)
        except OSError as exc:
            raise _cannot_write(channel_dir, exc) from None
        unlisted = check_channel(channel_dir).unlisted
        _unlisted_validated(channel_dir)
        to_copy = []
        for package in validated.values():
            target = channel_dir / package.subdir / package.file_name
            if target.exists():
                if sha256_of(target) != package.sha256:
                    raise ChannelError(
                        f"{target} already exists with different content than {package.path}",
                        hint="a package file name must never change content: "
                        "bump the recipe's build number and build again",
                    )
            else:
                to_copy.append((package, target))
            targets.append(target)
        try:
            for package, target in to_copy:
                _copy_into(package, target)
            _reindex_locked(channel_dir, force=False)
        except OSError as exc:
            raise _cannot_write(channel_dir, exc) from None
    # A file a killed publish copied but did not index is added to the index now, as a copied one is.
    added = {target for _, target in to_copy} | set(unlisted)
    return PublishResult(tuple(targets), tuple(target for target in targets if target in added))


def reindex(channel_dir: Path) -> ChannelReport:
    """Rebuild a channel's index from the package files it holds (repairs corrupt or stale repodata).

    Every package file is validated first; a corrupt one raises ChannelError naming it. The channel
    directory must already exist and be a channel or hold subdirs with package files.
    """
    channel_dir = Path(channel_dir)
    if not channel_dir.is_dir():
        raise ChannelError(f"channel directory {channel_dir} does not exist", hint="pass the right --channel-dir")
    if not is_channel(channel_dir) and not channel_subdirs(channel_dir):
        raise ChannelError(
            f"{channel_dir} is not a conda channel: no noarch/repodata.json and no package files in subdirs",
            hint=_not_a_channel_hint(),
        )
    with channel_lock(channel_dir):
        try:
            _clear_leftovers(channel_dir)
            for subdir in channel_subdirs(channel_dir):
                for package_file in _package_files(channel_dir / subdir):
                    validate_package(package_file)
            _reindex_locked(channel_dir, force=True)
        except OSError as exc:
            raise _cannot_write(channel_dir, exc) from None
    return check_channel(channel_dir)
