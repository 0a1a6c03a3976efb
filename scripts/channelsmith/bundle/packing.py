"""Air-gapped deploys: pack a deploy's lock into one tar, and install that tar where no network is.

The bundle is the layout pixi-pack writes and pixi-unpack reads (matched against pixi-pack 0.7.10,
tag v0.7.10: src/lib.rs, src/pack.rs, src/unpack.rs), an uncompressed tar holding::

    pixi-pack.json                  {"version": "1", "platform": "linux-64"} (format version "1")
    environment.yml                 the packages as NAME=VERSION=BUILD, for conda/micromamba
    channel/<subdir>/*.conda        every package the lock pins, byte for byte
    channel/<subdir>/repodata.json  the lock's records of them (noarch/ always, as conda clients need)

plus channelsmith's own members, which pixi-unpack ignores:

    channelsmith.lock               the packed lock, copied unchanged into the installed prefix
    unpack.sh                       a POSIX installer for nodes without channelsmith or pixi-unpack
    channelsmith-unpack/            what unpack.sh reads: a file list, conda-meta records

Packing fetches every package from the lock's own URLs (file://, http(s):// through py-rattler's
client) or from the package cache, and checks each against the lock's sha256 before a byte of the
bundle is written; the tar is written under a temporary name and renamed into place, and its sha256
(FILE.tar.sha256, sha256sum's format) and, with a key, its OpenSSH signature (FILE.tar.sig) into the
anchor folder (default: beside it): the anchors a site keeps apart from the bundle (anchors.py).

Installing extracts the members it reads (the packages, the lock, pixi-pack.json) into temporary
files, checks them (platform, the lock, every package against the lock's sha256), and hands py-rattler's installer records whose URLs are the extracted
files: nothing is fetched. The bundle's own lock only shows damage: whoever can change a package can
change that lock too. An outside anchor shows a change: the bundle's sha256 or its signature (both
checked on the very bytes that are extracted), or a trusted lock that every package must match. A failure removes the prefix it
created (or empties the empty directory it was given); a prefix that already holds anything is
refused before anything is written.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import shutil
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

import rattler
from rattler import Client, LockFile, PathsJson, RepoDataRecord, Subdir
from rattler.package_streaming import download_to_writer, extract
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

from channelsmith import __version__
from channelsmith.anchors import (
    NO_ANCHOR,
    SignatureCheck,
    SignatureVerifier,
    check_sha256,
    check_signing_key,
    digest_file,
    refuse_unanchored,
    sign,
    signature_file,
    signer_of,
)
from channelsmith.channel import is_channel, run_rattler
from channelsmith.deploy import (
    LOCK_ENVIRONMENT,
    LOCK_NAME,
    DeployedPackage,
    DeployReport,
    check_lock_gpus,
    check_prefix,
    moved_channel_error,
    prefix_packages,
    remap_lock,
)
from channelsmith.errors import DeployError
from channelsmith.gpu import lock_target
from channelsmith.sources import cache_root

# The pixi-pack release whose layout is matched, and the format version its pixi-unpack accepts.
PIXI_PACK_VERSION_MATCHED = "0.7.10"
BUNDLE_FORMAT = "1"
METADATA_NAME = "pixi-pack.json"
ENVIRONMENT_NAME = "environment.yml"
CHANNEL_NAME = "channel"
REPODATA = "repodata.json"
UNPACK_SCRIPT = "unpack.sh"
UNPACK_DIR = "channelsmith-unpack"
ACTIVATE_NAME = "activate.sh"
# The unpack.sh route's inputs (inside UNPACK_DIR): the file list, conda-meta records. Package
# checksums come from the lock itself.
FILES_NAME = "files.tsv"
META_DIR = "conda-meta"

_BLOCK = 1 << 20


@dataclass(frozen=True)
class BundledPackage:
    """One package in a bundle: what the lock pins and where pack took it from."""

    name: str
    version: str
    build: str
    subdir: str
    file_name: str
    size: int
    sha256: str
    source: str


@dataclass(frozen=True)
class PackReport:
    """What pack wrote: the bundle, the lock it packs, its platform and packages."""

    bundle: Path
    lock_file: Path
    platform: str
    packages: tuple[BundledPackage, ...]
    bytes: int
    sha256: str
    sha256_file: Path
    signature_file: Path | None
    seconds: float
    unpack_sh: bool
    unpack_sh_note: str
    # The GPUs the lock was solved for: its cuda-arch version (None: no GPU code) and site profile.
    cuda_arch: str | None = None
    site_profile: str | None = None


# --------------------------------------------------------------------------------------------
# Reading a lock
# --------------------------------------------------------------------------------------------


def _lock_hint() -> str:
    return f"pass the lock file a deploy wrote (PREFIX/{LOCK_NAME})"


def lock_records(lock_file: Path, platform: str | None = None) -> tuple[str, list[RepoDataRecord]]:
    """The platform and records of a lock file: ``platform`` if given, else its only platform (or this machine's)."""
    lock_file = Path(lock_file)
    if not lock_file.is_file():
        raise DeployError(f"lock file {lock_file} does not exist", hint=_lock_hint())
    try:
        lock = LockFile.from_path(lock_file)
    except Exception as exc:  # ParseCondaLockError
        raise DeployError(f"{lock_file} is not a readable lock file: {_first_line(exc)}", hint=_lock_hint()) from None
    environment = lock.environment(LOCK_ENVIRONMENT)
    if environment is None:
        raise DeployError(f"{lock_file} has no '{LOCK_ENVIRONMENT}' environment", hint=_lock_hint())
    platforms = list(environment.platforms())
    names = [p.name for p in platforms]
    if platform is None:
        platform = names[0] if len(names) == 1 else str(Subdir.current())
    # Records must be read through the lock's own platform objects (py-rattler panics on a new one).
    chosen = next((p for p in platforms if p.name == platform), None)
    records = environment.conda_repodata_records_for_platform(chosen) if chosen is not None else None
    if not records:
        raise DeployError(
            f"{lock_file} holds no packages for the platform {platform} (it has: {', '.join(names) or 'none'})",
            hint="pass --platform with one of the lock's platforms",
        )
    if chosen is not None and environment.pypi_packages_for_platform(chosen):
        raise DeployError(
            f"{lock_file} also pins PyPI packages for {platform}; a bundle carries conda packages only",
            hint="pack a lock channelsmith deploy wrote (conda packages only), or use pixi-pack for PyPI packages",
        )
    return platform, sorted(records, key=lambda r: r.name.normalized)


# --------------------------------------------------------------------------------------------
# Fetching packages
# --------------------------------------------------------------------------------------------


def default_cache_dir() -> Path:
    """Where pack keeps the package archives it downloaded: packages/ in $CHANNELSMITH_CACHE (~/.cache/channelsmith)."""
    return cache_root() / "packages"


def _url_path(url: str) -> Path | None:
    parsed = urlparse(url)
    return Path(unquote(parsed.path)) if parsed.scheme == "file" else None


def _sha256_file(path: Path, advance: Callable[[int], None]) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(_BLOCK), b""):
            digest.update(block)
            advance(len(block))
    return digest.hexdigest()


class _HashingWriter:
    """A file writer that hashes what passes through and reports progress (for py-rattler's download)."""

    def __init__(self, handle: io.BufferedWriter, advance: Callable[[int], None]) -> None:
        self.handle = handle
        self.digest = hashlib.sha256()
        self.advance = advance

    def write(self, data: bytes) -> int:
        self.digest.update(data)
        self.advance(len(data))
        return self.handle.write(data)


def _changed_hint(record: RepoDataRecord) -> str:
    return (
        f"the channel no longer holds the package the lock pins ({record.file_name}): publish that exact file "
        "again, or deploy afresh (channelsmith deploy SPEC --prefix DIR) and pack the new lock"
    )


def _fetch(
    record: RepoDataRecord, lock_file: Path, cache_dir: Path, client: Client, advance: Callable[[int], None]
) -> tuple[Path, str]:
    """A local file holding exactly the package ``record`` pins, and where it came from (cache or URL)."""
    expected = record.sha256.hex() if record.sha256 else None
    if expected is None:
        raise DeployError(
            f"the lock gives no sha256 for {record.file_name}",
            hint="pack only locks channelsmith deploy wrote: they record every package's sha256",
        )
    cached = cache_dir / record.subdir / record.file_name
    if cached.is_file() and cached.stat().st_size == record.size and _sha256_file(cached, advance) == expected:
        return cached, "cache"
    local = _url_path(record.url)
    if local is not None:
        if not local.is_file():
            if not is_channel(local.parent.parent):  # the whole channel moved: say so, as deploy --lock does
                raise moved_channel_error(lock_file, local.parent.parent)
            raise DeployError(
                f"{record.file_name} is gone from its channel: {local} does not exist", hint=_changed_hint(record)
            )
        if _sha256_file(local, advance) != expected:
            raise DeployError(
                f"{local} does not match the lock: its sha256 differs from the one the lock records",
                hint=_changed_hint(record),
            )
        return local, "channel"
    return _download(record, cached, expected, client, advance), "download"


def _download(
    record: RepoDataRecord, cached: Path, expected: str, client: Client, advance: Callable[[int], None]
) -> Path:
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        fd, part = tempfile.mkstemp(prefix=f".{record.file_name}.", dir=cached.parent)
    except OSError as exc:
        raise DeployError(
            f"cannot write the package cache {cached.parent}: {exc.strerror or exc}",
            hint="pass a writable --cache-dir",
        ) from None
    try:
        with os.fdopen(fd, "wb") as handle:
            writer = _HashingWriter(handle, advance)
            try:
                run_rattler(download_to_writer(client, record.url, writer))
            except Exception as exc:  # rattler's download errors (HTTP status, connection)
                raise DeployError(
                    f"cannot download {record.url}: {_first_line(exc)}",
                    hint="check that the channel is reachable from here and still holds the file; "
                    "pack on a node that reaches the channel",
                ) from None
        if writer.digest.hexdigest() != expected:
            raise DeployError(
                f"{record.url} does not match the lock: the downloaded file's sha256 differs",
                hint=_changed_hint(record),
            )
        os.replace(part, cached)
    except OSError as exc:
        raise DeployError(
            f"cannot write the package cache {cached.parent}: {exc.strerror or exc}",
            hint="free space there, or pass another --cache-dir",
        ) from None
    finally:
        Path(part).unlink(missing_ok=True)
    return cached


@contextmanager
def _progress(show: bool, total: int, what: str) -> Iterator[Callable[[int], None]]:
    if not show:
        yield lambda _n: None
        return
    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TimeRemainingColumn())
    # On stderr: stdout carries the --json report.
    with Progress(*columns, console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task(what, total=total)
        yield lambda n: progress.advance(task, n)


# --------------------------------------------------------------------------------------------
# Writing a bundle
# --------------------------------------------------------------------------------------------


def _repodata_entry(record: RepoDataRecord) -> dict:
    entry = json.loads(record.to_json())
    for key in ("fn", "url", "channel"):
        entry.pop(key, None)
    return entry


def _repodata(records: Sequence[RepoDataRecord], subdirs: Sequence[str]) -> dict[str, bytes]:
    """subdir -> repodata.json bytes listing the lock's records (as pixi-pack writes them, repodata v2)."""
    documents = {}
    for subdir in subdirs:
        conda, tar_bz2 = {}, {}
        for record in records:
            if record.subdir == subdir:
                target = conda if record.file_name.endswith(".conda") else tar_bz2
                target[record.file_name] = _repodata_entry(record)
        document = {"info": {"subdir": subdir}, "packages": tar_bz2, "packages.conda": conda, "repodata_version": 2}
        documents[subdir] = json.dumps(document, indent=2, sort_keys=True).encode()
    return documents


def _environment_yml(records: Sequence[RepoDataRecord]) -> bytes:
    lines = ["channels:", f"  - ./{CHANNEL_NAME}", "  - nodefaults", "dependencies:"]
    lines += [f"  - {r.name.normalized}={r.version}={r.build}" for r in records]
    return ("\n".join(lines) + "\n").encode()


def _unpack_inputs(records: Sequence[RepoDataRecord], files: dict[str, Path]) -> tuple[dict[str, bytes], str]:
    """What unpack.sh reads (name under UNPACK_DIR -> bytes), and why it cannot install, if it cannot.

    The file list maps each package's files to where they go in the prefix (noarch: python packages
    move into the lock's python's site-packages, their entry points become scripts), so unpack.sh only
    copies, replaces text prefixes and writes records.
    """
    python = next((r for r in records if r.name.normalized == "python"), None)
    site_packages = None
    if python is not None:
        major_minor = ".".join(str(python.version).split(".")[:2])
        site_packages = python.python_site_packages_path or f"lib/python{major_minor}/site-packages"
    lines = []
    metas: dict[str, bytes] = {}
    refusal = ""
    for record in records:
        archive = f"{CHANNEL_NAME}/{record.subdir}/{record.file_name}"
        stem = _stem(record.file_name)
        lines.append(f"P\t{archive}\t{stem}")
        noarch_python = record.noarch.python
        if noarch_python and site_packages is None:
            refusal = refusal or f"{record.name.normalized} is a noarch: python package but the lock has no python"
        paths = PathsJson.from_package_archive(files[archive])
        installed = []
        for entry in paths.paths:
            source = str(entry.relative_path)
            target = source
            if noarch_python and site_packages is not None:
                if source.startswith("site-packages/"):
                    target = site_packages + source[len("site-packages") :]
                elif source.startswith("python-scripts/"):
                    target = "bin" + source[len("python-scripts") :]
            if any(c in source + target for c in "\t\n"):
                refusal = refusal or f"{record.file_name} holds a path with a tab or newline: {source!r}"
            kind = "D" if entry.path_type.directory else "F"
            placeholder = entry.prefix_placeholder
            if placeholder is not None:
                kind = "T" if placeholder.file_mode.text else "B"
                if kind == "B":
                    refusal = refusal or f"{record.file_name} needs binary prefix replacement in {source}"
                lines.append(f"{kind}\t{source}\t{target}\t{placeholder.placeholder}")
            else:
                lines.append(f"{kind}\t{source}\t{target}")
            installed.append(
                (target, "directory" if kind == "D" else "softlink" if entry.path_type.softlink else "hardlink")
            )
        if noarch_python and site_packages is not None:
            for name, module, function in _entry_points(files[archive]):
                python_bin = f"bin/python{major_minor}"
                lines.append(f"E\tbin/{name}\t{python_bin}\t{module}\t{function}")
                installed.append((f"bin/{name}", "unix_python_entry_point"))
        meta = json.loads(record.to_json())
        meta["files"] = [target for target, kind in installed if kind != "directory"]
        meta["paths_data"] = {"paths_version": 1, "paths": [{"_path": t, "path_type": k} for t, k in installed]}
        meta["requested_specs"] = []
        metas[f"{META_DIR}/{stem}.json"] = json.dumps(meta, indent=2).encode()
    inputs = {FILES_NAME: ("\n".join(lines) + "\n").encode()}
    inputs.update(metas)
    return inputs, refusal


def _entry_points(archive: Path) -> list[tuple[str, str, str]]:
    """(script name, module, function) of each entry point a noarch: python package's info/link.json declares."""
    with tempfile.TemporaryDirectory(prefix="channelsmith-link-") as scratch:
        extract(archive, scratch)
        link = Path(scratch) / "info" / "link.json"
        document = json.loads(link.read_text()) if link.is_file() else {}
    points = []
    for spec in document.get("noarch", {}).get("entry_points", []):
        name, _, target = (part.strip() for part in spec.partition("="))
        module, _, function = (part.strip() for part in target.partition(":"))
        points.append((name, module, function))
    return points


def _tar_info(name: str, size: int, mode: int = 0o644) -> tarfile.TarInfo:
    # Deterministic headers, as pixi-pack writes them: same content, same bundle bytes.
    info = tarfile.TarInfo(name)
    info.size = size
    info.mode = mode
    info.mtime = 0
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def _add_dir(tar: tarfile.TarFile, name: str) -> None:
    info = _tar_info(name, 0, 0o755)
    info.type = tarfile.DIRTYPE
    tar.addfile(info)


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes, mode: int = 0o644) -> None:
    tar.addfile(_tar_info(name, len(data), mode), io.BytesIO(data))


class _HashingReader:
    """Reads a file and hashes it on the way (and feeds ``also``, a signature check, the same bytes)."""

    def __init__(self, handle: io.BufferedReader, also: SignatureVerifier | None = None) -> None:
        self.handle = handle
        self.digest = hashlib.sha256()
        self.also = also

    def read(self, size: int = -1) -> bytes:
        data = self.handle.read(size)
        self.digest.update(data)
        if self.also is not None:
            self.also.update(data)
        return data


def unpack_script() -> bytes:
    """The POSIX unpack.sh that ships inside every bundle."""
    return (Path(__file__).parent / UNPACK_SCRIPT).read_bytes()


def _check_output(output: Path, option: str = "-o") -> None:
    """DeployError unless ``output`` can be written (``option`` names where it came from): checked before
    any package is fetched."""
    if output.is_dir():
        raise DeployError(f"{output} is a directory", hint="pass -o FILE.tar")
    folder = output.parent
    if not folder.is_dir():
        what = "is not a folder" if folder.exists() else "does not exist"
        raise DeployError(
            f"cannot write {output}: the folder {folder} {what}",
            hint=f"create it first (mkdir -p {folder}), or pass an {option} in an existing folder",
        )
    try:
        fd, probe = tempfile.mkstemp(prefix=f".{output.name}.", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise DeployError(
            f"cannot write {output}: {exc.strerror or exc}", hint=f"pass an {option} in a directory you can write to"
        ) from None


def _check_anchor_dir(anchor_dir: Path, output: Path) -> None:
    """DeployError unless the anchors can be written into ``anchor_dir``: an existing folder, or a missing
    one in an existing folder (made once the bundle is written)."""
    if anchor_dir.exists() and not anchor_dir.is_dir():
        raise DeployError(f"--anchor-dir {anchor_dir} is a file", hint="pass a folder (a missing one is made)")
    _check_output(digest_file(output, anchor_dir if anchor_dir.is_dir() else anchor_dir.parent), "--anchor-dir")


def _lock_channels(lock_file: Path) -> list[str]:
    environment = LockFile.from_path(lock_file).environment(LOCK_ENVIRONMENT)
    return [str(channel) for channel in environment.channels()] if environment is not None else []


def pack(
    lock_file: Path,
    output: Path,
    *,
    platform: str | None = None,
    cache_dir: Path | None = None,
    channel_map: Mapping[str, str] | None = None,
    anchor_dir: Path | None = None,
    sign_key: Path | None = None,
    show_progress: bool = False,
    stage: Callable[[str], None] | None = None,
) -> PackReport:
    """Write a bundle (pixi-pack layout, uncompressed tar) holding every package ``lock_file`` pins.

    Each package comes from the package cache or the lock's own URL and must match the lock's sha256
    before anything is written. ``channel_map`` (from deploy's ``parse_channel_map``) takes the
    packages of a channel that moved from its new place; the bundle keeps the lock as given. The
    bundle appears at ``output`` complete or not at all, and its sha256 in FILE.tar.sha256 in
    ``anchor_dir`` (default: beside it); with ``sign_key`` (an OpenSSH key), its signature in
    FILE.tar.sig there too. ``stage`` is called with each stage as it starts (for a log line).
    """
    stage = stage or (lambda _name: None)
    start = time.perf_counter()
    lock_file = Path(lock_file)
    output = Path(output)
    stage(f"reading the lock {lock_file}")
    platform, records = lock_records(lock_file, platform)
    lock_bytes = lock_file.read_bytes()
    _check_output(output)
    if anchor_dir is not None:
        anchor_dir = Path(anchor_dir)
        _check_anchor_dir(anchor_dir, output)
    if sign_key is not None:
        check_signing_key(Path(sign_key))
    if channel_map:
        remap_lock(records, _lock_channels(lock_file), channel_map, lock_file)
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    client = Client.default_client()
    total = sum(r.size or 0 for r in records)
    files: dict[str, Path] = {}
    packages = []
    stage(f"fetching {len(records)} packages ({total / 1e6:.1f} MB)")
    with _progress(show_progress, total, f"fetching {len(records)} packages") as advance:
        for record in records:
            path, source = _fetch(record, lock_file, cache_dir, client, advance)
            files[f"{CHANNEL_NAME}/{record.subdir}/{record.file_name}"] = path
            packages.append(
                BundledPackage(
                    record.name.normalized,
                    str(record.version),
                    str(record.build),
                    record.subdir,
                    record.file_name,
                    record.size or path.stat().st_size,
                    record.sha256.hex(),
                    source,
                )
            )
    stage("reading the packages' file lists (for unpack.sh)")
    unpack_inputs, refusal = _unpack_inputs(records, files)
    subdirs = sorted({r.subdir for r in records} | {"noarch"})
    metadata = {"version": BUNDLE_FORMAT, "platform": platform, "channelsmith-version": __version__}
    members: dict[str, bytes | Path] = {
        METADATA_NAME: json.dumps(metadata, indent=2).encode(),
        ENVIRONMENT_NAME: _environment_yml(records),
        LOCK_NAME: lock_bytes,
        UNPACK_SCRIPT: unpack_script(),
    }
    for subdir, data in _repodata(records, subdirs).items():
        members[f"{CHANNEL_NAME}/{subdir}/{REPODATA}"] = data
    members.update(files)
    members.update({f"{UNPACK_DIR}/{name}": data for name, data in unpack_inputs.items()})
    expected = {name: p.sha256 for name, p in zip(files, packages)}
    stage(f"writing {output} and its sha256" + (" and signature" if sign_key is not None else ""))
    anchors = (digest_file(output, anchor_dir), signature_file(output, anchor_dir))
    digest = _write_tar(output, members, expected, anchors, Path(sign_key) if sign_key is not None else None)
    return PackReport(
        bundle=output,
        lock_file=lock_file,
        platform=platform,
        packages=tuple(packages),
        bytes=output.stat().st_size,
        sha256=digest,
        sha256_file=anchors[0],
        signature_file=anchors[1] if sign_key is not None else None,
        seconds=time.perf_counter() - start,
        unpack_sh=not refusal,
        unpack_sh_note=refusal,
        cuda_arch=lock_target(records)[0],
        site_profile=lock_target(records)[1],
    )


class _HashingSink:
    """The bundle's file as tarfile writes it, hashed on the way: the digest is of the bytes written."""

    def __init__(self, handle: io.BufferedWriter) -> None:
        self.handle = handle
        self.digest = hashlib.sha256()
        self.written = 0

    def write(self, data: bytes) -> int:
        self.digest.update(data)
        self.written += len(data)
        return self.handle.write(data)

    def tell(self) -> int:
        return self.written


def _write_tar(
    output: Path,
    members: dict[str, bytes | Path],
    expected: dict[str, str],
    anchors: tuple[Path, Path],
    sign_key: Path | None,
) -> str:
    """:func:`_write_files`, making the anchors' folder first if it is missing (and removing it again
    if the bundle could not be written)."""
    folder = anchors[0].parent
    made = not folder.exists()
    if made:
        try:
            folder.mkdir()
        except OSError as exc:
            raise DeployError(
                f"cannot make the anchor folder {folder}: {exc.strerror or exc}",
                hint="pass an --anchor-dir you can write to",
            ) from None
    try:
        return _write_files(output, members, expected, anchors, sign_key)
    except BaseException:
        if made:
            folder.rmdir()  # empty: every temporary file in it was removed
        raise


def _write_files(
    output: Path,
    members: dict[str, bytes | Path],
    expected: dict[str, str],
    anchors: tuple[Path, Path],
    sign_key: Path | None,
) -> str:
    """Write the members (sorted, with their parent folders) to ``output`` through a temporary file,
    its sha256 to ``anchors[0]`` likewise, and with ``sign_key`` its signature to ``anchors[1]``
    (without, an old signature there is removed: it would be another bundle's); the bundle's sha256.

    The signature is made over the temporary file before it is renamed (mode 0600 until then, so
    only its owner could change it). The old anchors go before the new bundle is renamed into place,
    so an anchor beside a bundle is never another bundle's; a crash between the renames leaves a
    bundle with none.
    """
    sums, signature = anchors
    parts: list[str] = []
    try:
        fd, part = tempfile.mkstemp(prefix=f".{output.name}.", dir=output.parent)
        parts.append(part)
        sums_fd, sums_part = tempfile.mkstemp(prefix=f".{sums.name}.", dir=sums.parent)
        parts.append(sums_part)
        os.close(sums_fd)
    except OSError as exc:
        for path in parts:
            Path(path).unlink(missing_ok=True)
        raise DeployError(
            f"cannot write {output}: {exc.strerror or exc}", hint="pass an -o in a directory you can write to"
        ) from None
    try:
        with os.fdopen(fd, "wb") as handle:
            sink = _HashingSink(handle)
            with tarfile.open(fileobj=sink, mode="w", format=tarfile.PAX_FORMAT) as tar:
                folders: set[str] = set()
                for name in sorted(members):
                    parts_of_name = name.split("/")[:-1]
                    for depth in range(1, len(parts_of_name) + 1):
                        folder = "/".join(parts_of_name[:depth])
                        if folder not in folders:
                            folders.add(folder)
                            _add_dir(tar, folder)
                    content = members[name]
                    if isinstance(content, Path):
                        with open(content, "rb") as source:
                            reader = _HashingReader(source)
                            tar.addfile(_tar_info(name, content.stat().st_size), reader)
                        if reader.digest.hexdigest() != expected[name]:
                            raise DeployError(
                                f"{content} changed while it was being packed: its sha256 no longer matches the lock",
                                hint="pack again once nothing writes to the channel",
                            )
                    else:
                        _add_bytes(tar, name, content, 0o755 if name == UNPACK_SCRIPT else 0o644)
            handle.flush()
            os.fsync(handle.fileno())
        digest = sink.digest.hexdigest()
        _write_synced(sums_part, f"{digest}  {output.name}\n".encode())
        renames = [(part, output), (sums_part, sums)]
        if sign_key is not None:
            signed = sign(Path(part), sign_key)
            sig_fd, sig_part = tempfile.mkstemp(prefix=f".{signature.name}.", dir=signature.parent)
            parts.append(sig_part)
            os.close(sig_fd)
            _write_synced(sig_part, signed)
            renames.append((sig_part, signature))
        for path, _target in renames:
            os.chmod(path, 0o644)
        for target in (sums, signature):
            target.unlink(missing_ok=True)
        for path, target in renames:
            os.replace(path, target)
    except OSError as exc:
        hint = (
            "free space there, or pass an -o on another filesystem"
            if exc.errno == errno.ENOSPC
            else "pass a writable -o"
        )
        raise DeployError(f"cannot write {output}: {exc.strerror or exc}", hint=hint) from None
    finally:
        for path in parts:
            Path(path).unlink(missing_ok=True)
    return digest


def _write_synced(path: str, data: bytes) -> None:
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


# --------------------------------------------------------------------------------------------
# Installing a bundle
# --------------------------------------------------------------------------------------------


def _bundle_error(bundle: Path, what: str) -> DeployError:
    return DeployError(
        f"{bundle} is not a usable bundle: {what}",
        hint="copy the bundle again (compare its sha256 with the packing node's), or pack it again "
        "with channelsmith pack --lock LOCK -o FILE.tar",
    )


def _wanted(name: str) -> bool:
    """Whether an install reads this bundle member: the packages, the lock, pixi-pack.json."""
    if name in (METADATA_NAME, LOCK_NAME):
        return True
    return name.startswith(f"{CHANNEL_NAME}/") and name.endswith((".conda", ".tar.bz2"))


def _member_kind(member: tarfile.TarInfo) -> str:
    if member.issym():
        return f"a symbolic link (to {member.linkname!r})"
    if member.islnk():
        return f"a hard link (to {member.linkname!r})"
    return "a device, FIFO or other special file"


@contextmanager
def _extracted(
    bundle: Path, verifier: SignatureVerifier | None = None
) -> Iterator[tuple[dict[str, tuple[Path, str]], str]]:
    """What an install reads from a bundle, checking every member: (member name -> (temporary file,
    sha256), the sha256 of the whole bundle file).

    The tar is read once, front to back (tarfile's stream mode), and the bundle's sha256 is taken
    from those same bytes, which also feed ``verifier`` (ssh-keygen -Y verify): what is checked
    against an outside anchor is what was extracted. A member named twice is refused (tar would
    take the last, and the first copy's temporary file would be lost).
    Each member is a file of its own in $TMPDIR, removed afterwards: no scratch folder, since on some
    filesystems a mkdir/rmdir pair costs milliseconds (4 ms measured on the CI disk), a sixth of a
    small install.
    """
    _check_bundle_file(bundle)
    files: dict[str, tuple[Path, str]] = {}
    try:
        try:
            with open(bundle, "rb") as raw:
                reader = _HashingReader(raw, verifier)
                with tarfile.open(fileobj=reader, mode="r|") as tar:
                    for member in tar:
                        name = member.name
                        if name.startswith("/") or ".." in name.split("/"):
                            raise _bundle_error(bundle, f"it holds {name!r}, a path outside the bundle")
                        if not (member.isfile() or member.isdir()):
                            kind = _member_kind(member)
                            raise _bundle_error(
                                bundle, f"it holds {name!r}, {kind}; a bundle holds only files and folders"
                            )
                        if not (member.isfile() and _wanted(name)):
                            continue
                        if name in files:
                            raise _bundle_error(bundle, f"it holds {name!r} twice; a bundle names each member once")
                        fd, part = tempfile.mkstemp(prefix="channelsmith-bundle-", suffix=f"-{Path(name).name}")
                        files[name] = (Path(part), "")
                        source = tar.extractfile(member)
                        digest = hashlib.sha256()
                        with os.fdopen(fd, "wb") as sink:
                            while block := source.read(_BLOCK):
                                digest.update(block)
                                sink.write(block)
                        files[name] = (Path(part), digest.hexdigest())
                # The end-of-archive blocks and any padding after them belong to the file's sha256 too.
                while reader.read(_BLOCK):
                    pass
                whole = reader.digest.hexdigest()
        except (tarfile.TarError, EOFError) as exc:
            raise _bundle_error(bundle, f"it is truncated or not a tar ({_first_line(exc)})") from None
        except OSError as exc:
            raise DeployError(
                f"cannot extract {bundle} into {tempfile.gettempdir()}: {exc.strerror or exc}",
                hint="free space in the temporary directory (or point TMPDIR at a larger one), then try again",
            ) from None
        yield files, whole
    finally:
        for path, _digest in files.values():
            path.unlink(missing_ok=True)
        if verifier is not None:
            verifier.abandon()


def _check_bundle_file(bundle: Path) -> None:
    """DeployError unless ``bundle`` is a file."""
    if bundle.is_dir():
        raise DeployError(
            f"bundle {bundle} is a folder",
            hint="pass the bundle file itself (FILE.tar); unpack.sh is the route for an extracted one",
        )
    if not bundle.is_file():
        raise DeployError(f"bundle {bundle} does not exist", hint="pass the file channelsmith pack wrote")


@dataclass(frozen=True)
class TrustedLock:
    """A lock kept apart from the bundle: every package installed must be one it pins, byte for byte."""

    path: Path
    records: tuple[RepoDataRecord, ...]


def read_trusted_lock(lock_file: Path) -> TrustedLock:
    """The trusted lock's records for this machine's platform (DeployError if it has none)."""
    _platform, records = lock_records(Path(lock_file), str(Subdir.current()))
    return TrustedLock(Path(lock_file), tuple(records))


def _anchor_hint(what: str) -> str:
    return (
        f"do not install this bundle: it is not the one {what} vouches for. Copy it again from the packing "
        "node (or pack again there) and check it against the same anchor"
    )


def _check_against_trusted(bundle: Path, records: Sequence[RepoDataRecord], trusted: TrustedLock) -> None:
    """DeployError naming each package where the bundle's lock and the trusted one differ."""
    ours = {r.file_name: r.sha256.hex() for r in records}
    theirs = {r.file_name: r.sha256.hex() for r in trusted.records}
    differences = [f"{name} (not in {trusted.path})" for name in sorted(ours.keys() - theirs.keys())]
    differences += [f"{name} (missing from the bundle)" for name in sorted(theirs.keys() - ours.keys())]
    differences += [
        f"{name} (another sha256)" for name in sorted(ours.keys() & theirs.keys()) if ours[name] != theirs[name]
    ]
    if differences:
        raise DeployError(
            f"{bundle}'s lock differs from the trusted lock {trusted.path}: {', '.join(differences)}",
            hint=_anchor_hint(f"the lock {trusted.path}"),
        )


def _bundled_records(
    bundle: Path, files: dict[str, tuple[Path, str]], trusted: TrustedLock | None = None
) -> tuple[list[tuple[RepoDataRecord, str]], bytes]:
    """The lock's records pointed at the extracted files, each with its URL in the lock, and the lock's bytes.

    Checks the bundle first: its platform, its lock, and every package file against the lock's
    sha256. With a ``trusted`` lock, the bundle's lock must pin exactly its packages, each package
    must match the trusted lock's sha256, and the trusted lock's records and bytes are the ones used.
    """
    try:
        metadata = json.loads(files[METADATA_NAME][0].read_text())
    except (KeyError, OSError, ValueError):
        raise _bundle_error(bundle, f"{METADATA_NAME} is missing or not JSON (truncated?)") from None
    if metadata.get("version") != BUNDLE_FORMAT:
        raise _bundle_error(bundle, f"its format version is {metadata.get('version')!r}, not {BUNDLE_FORMAT!r}")
    current = str(Subdir.current())
    if metadata.get("platform") != current:
        raise DeployError(
            f"{bundle} is a bundle for {metadata.get('platform')}, and this machine is {current}",
            hint=f"pack a lock written on {current}: deploy there (or on a {current} login node) and "
            f"channelsmith pack --lock PREFIX/{LOCK_NAME} --platform {current}",
        )
    if LOCK_NAME not in files:
        raise _bundle_error(bundle, f"it holds no {LOCK_NAME} (truncated?)")
    lock_file = files[LOCK_NAME][0]
    _platform, records = lock_records(lock_file, current)
    if trusted is not None:
        _check_against_trusted(bundle, records, trusted)
        records = list(trusted.records)
    pointed = []
    for record in records:
        name = f"{CHANNEL_NAME}/{record.subdir}/{record.file_name}"
        if name not in files:
            raise _bundle_error(bundle, f"{name} is missing (truncated?)")
        path, digest = files[name]
        if digest != record.sha256.hex():
            if trusted is not None:
                raise DeployError(
                    f"{bundle} holds a {record.file_name} whose sha256 ({digest}) differs from the one the "
                    f"trusted lock {trusted.path} records ({record.sha256.hex()})",
                    hint=_anchor_hint(f"the lock {trusted.path}"),
                )
            raise DeployError(
                f"{bundle} holds a {record.file_name} whose sha256 differs from the one its lock records: "
                "the bundle was damaged or changed after packing",
                hint="copy the bundle again from the packing node, or pack it again there",
            )
        pointed.append((RepoDataRecord(record, record.file_name, path.as_uri(), record.channel or ""), record.url))
    return pointed, (trusted.path if trusted is not None else lock_file).read_bytes()


def _stem(file_name: str) -> str:
    return file_name.removesuffix(".conda").removesuffix(".tar.bz2")


def _restore_urls(prefix: Path, urls: dict[str, str]) -> None:
    """Point the prefix's conda-meta records at the lock's URLs instead of the deleted scratch copies.

    A plain JSON edit of one key: PrefixRecord.write_to_path takes ~8 ms a record (it syncs), which
    was most of the difference to a local deploy.
    """
    for stem, url in urls.items():
        meta = prefix / "conda-meta" / f"{stem}.json"
        document = json.loads(meta.read_text(encoding="utf-8"))
        document["url"] = url
        meta.write_text(json.dumps(document, indent=2, ensure_ascii=False), encoding="utf-8")


def activate_script(prefix: Path) -> str:
    """A POSIX activate.sh for ``prefix``: CONDA_PREFIX, PATH, then every etc/conda/activate.d/*.sh.

    Written here rather than by rattler.shell, whose script bakes in the installing shell's whole PATH.
    """
    quoted = "'" + str(prefix).replace("'", "'\\''") + "'"
    return (
        "# Activate the environment in this prefix: . PREFIX/activate.sh (what conda activate also runs).\n"
        f"CONDA_PREFIX={quoted}\n"
        "export CONDA_PREFIX\n"
        'PATH="$CONDA_PREFIX/bin${PATH:+:$PATH}"\n'
        "export PATH\n"
        'for _channelsmith_script in "$CONDA_PREFIX"/etc/conda/activate.d/*.sh; do\n'
        '    if [ -f "$_channelsmith_script" ]; then . "$_channelsmith_script"; fi\n'
        "done\n"
        "unset _channelsmith_script\n"
    )


def _refuse_used_prefix(prefix: Path) -> bool:
    """Whether ``prefix`` exists (it must then be an empty directory); DeployError if it holds anything."""
    if not prefix.exists():
        return False
    if prefix.is_dir() and not any(prefix.iterdir()):
        return True
    if (prefix / "conda-meta").is_dir():
        held = ", ".join(f"{p.name} {p.version}" for p in prefix_packages(prefix)[:5]) or "no packages"
        raise DeployError(
            f"prefix {prefix} already holds an environment ({held})",
            hint="a bundle installs into a new or empty directory: pass another --prefix, or remove this one first",
        )
    if not prefix.is_dir():
        check_prefix(prefix)  # a file: its own message
    held = ", ".join(sorted(entry.name for entry in prefix.iterdir())[:3])
    raise DeployError(
        f"prefix {prefix} is not empty (it holds {held}) and a bundle installs only into a new or empty directory",
        hint="pass a --prefix that does not exist yet or is an empty directory, or empty this one first",
    )


def _shared_package_cache() -> Path | None:
    """py-rattler's default package cache (rattler's default_cache_dir()/pkgs: $RATTLER_CACHE_DIR, else
    $XDG_CACHE_HOME or ~/.cache, then rattler/cache), the one deploy uses, when it can be written; else None.

    rattler checks a cached package against the record's sha256 and extracts it again when they differ
    (seen here: a forged package under a genuine one's name was installed from its own bytes), so a
    shared cache installs the very package that was checked.
    """
    given = os.environ.get("RATTLER_CACHE_DIR")
    if given:
        root = Path(given)
    else:
        xdg = os.environ.get("XDG_CACHE_HOME", "")
        root = (Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache") / "rattler" / "cache"
    folder = root / "pkgs"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".channelsmith-probe-", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except (OSError, RuntimeError):  # RuntimeError: no home directory to expand
        return None
    return folder


@contextmanager
def _package_cache(beside: Path) -> Iterator[Path]:
    """The package cache an install uses: the shared one (warm after a deploy) when it can be written;
    else one of its own, removed afterwards, in ``beside`` (the prefix's parent: the prefix's
    filesystem, so py-rattler hard-links its files instead of copying them), else in $TMPDIR.

    HOME is often read-only on compute nodes: py-rattler's own default would then fail the install
    ("failed to acquire global cache lock").
    """
    shared = _shared_package_cache()
    if shared is not None:
        yield shared
        return
    try:
        folder = Path(tempfile.mkdtemp(prefix=".channelsmith-pkgs-", dir=beside))
    except OSError:
        try:
            folder = Path(tempfile.mkdtemp(prefix="channelsmith-pkgs-"))
        except OSError as exc:
            raise DeployError(
                f"cannot create a package cache in {beside} or {tempfile.gettempdir()}: {exc.strerror or exc}",
                hint="point TMPDIR at a writable directory with free space, then install again",
            ) from None
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _drop_cache_tag(prefix: Path) -> None:
    """Remove the CACHEDIR.TAG py-rattler 0.28 writes into every prefix it installs into, unless a package
    installed it: the prefix holds what the lock lists, and a backup tool would skip a tagged prefix."""
    tag = prefix / "CACHEDIR.TAG"
    if not tag.is_file():
        return
    for meta in (prefix / "conda-meta").glob("*.json"):
        if "CACHEDIR.TAG" in json.loads(meta.read_text(encoding="utf-8")).get("files", []):
            return
    tag.unlink()


def _clear(path: Path, existed: bool) -> None:
    """Undo a failed install: remove what it created (``path``), or empty the empty directory it was given.

    py-rattler 0.28's linking tasks can outlive the failed install's future and write a few more files
    (after one pass, 2 of 8 runs of tests/test_bundle.py found bin/, etc/ ... back on the full disk;
    0 of 10 with this loop), so the clearing repeats until the path has stayed clear for two checks
    0.1 s apart (at most 5 s).
    """

    def clear_once() -> None:
        if not existed:
            shutil.rmtree(path, ignore_errors=True)
            return
        for entry in list(path.iterdir()):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)

    def is_clear() -> bool:
        return not any(path.iterdir()) if existed else not path.exists()

    deadline = time.monotonic() + 5
    quiet = 0
    while quiet < 2 and time.monotonic() < deadline:
        clear_once()
        time.sleep(0.1)
        quiet = quiet + 1 if is_clear() else 0


def install_bundle(
    bundle: Path,
    *,
    prefix: Path,
    sha256: str | None = None,
    trusted_lock: Path | None = None,
    allowed_signers: Path | None = None,
    signature: Path | None = None,
    show_progress: bool = False,
) -> DeployReport:
    """Install exactly the packages of a bundle's lock into a new or empty ``prefix``, with no network.

    ``sha256`` (the digest pack printed), ``allowed_signers`` (the site's signers file, with the
    bundle's ``signature``, default FILE.tar.sig beside it) and ``trusted_lock`` (a lock kept apart
    from the bundle) are anchors from outside it: the bundle file must have that sha256, be signed
    by a key the signers file lists, and every package must be one the trusted lock pins, with its
    sha256; any failing is refused before anything is written into the prefix. With none of them
    and CHANNELSMITH_REQUIRE_ANCHOR=1, the bundle is refused. The report's ``anchor`` says which
    were checked (``none`` when none was).

    Writes the bundle's lock (the trusted one, when given) to PREFIX/channelsmith.lock and a
    PREFIX/activate.sh. py-rattler's package cache is the shared one where it can be written, else
    a temporary one beside the prefix (HOME is often read-only on compute nodes). On any failure the
    prefix is removed (or emptied, if it was an empty directory before).
    """
    start = time.perf_counter()
    bundle = Path(bundle)
    prefix = Path(prefix).absolute()
    expected = check_sha256(sha256) if sha256 is not None else None
    trusted = read_trusted_lock(trusted_lock) if trusted_lock is not None else None
    if signature is not None and allowed_signers is None:
        raise DeployError(
            "--signature is checked against a signers file; it takes --allowed-signers",
            hint="pass --allowed-signers FILE (the site's signers file) too",
        )
    anchors = [name for name, given in (("signature", allowed_signers), ("sha256", sha256), ("lock", trusted_lock))
               if given is not None]  # fmt: skip
    if not anchors:
        refuse_unanchored(bundle)
    existed = _refuse_used_prefix(prefix)
    check_prefix(prefix)
    _check_bundle_file(bundle)  # a missing bundle is said before its missing signature is
    signer = verifier = None
    if allowed_signers is not None:
        # Who signed is found from the signature and the signers file alone, before the bundle is read.
        check = SignatureCheck(Path(allowed_signers), Path(signature) if signature else signature_file(bundle))
        signer = signer_of(check, bundle)
        verifier = SignatureVerifier(check, signer)
    # What a failed install removes: the prefix, or its first missing parent that the install creates.
    created = prefix
    while not created.parent.exists():
        created = created.parent
    with _extracted(bundle, verifier) as (files, whole):
        if verifier is not None:
            verifier.finish(bundle)
        if expected is not None and whole != expected:
            raise DeployError(
                f"{bundle} has the sha256 {whole}, not the {expected} given with --sha256: it is not the "
                "bundle that was packed (damaged or changed on the way)",
                hint=_anchor_hint("the digest"),
            )
        pointed, lock_bytes = _bundled_records(bundle, files, trusted)
        check_lock_gpus([record for record, _url in pointed], f"the bundle {bundle}")
        with _package_cache((prefix if existed else created).parent) as cache_dir:
            try:
                prefix.mkdir(parents=True, exist_ok=True)
                records = [record for record, _url in pointed]
                run_rattler(
                    rattler.install(
                        records, prefix, cache_dir=cache_dir, show_progress=show_progress, execute_link_scripts=False
                    )
                )
                _drop_cache_tag(prefix)
                _restore_urls(prefix, {_stem(record.file_name): url for record, url in pointed})
                (prefix / LOCK_NAME).write_bytes(lock_bytes)
                (prefix / ACTIVATE_NAME).write_text(activate_script(prefix))
            except BaseException as exc:
                _clear(prefix if existed else created, existed)
                if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                    raise
                full = isinstance(exc, OSError) and exc.errno == errno.ENOSPC or "No space left" in str(exc)
                raise DeployError(
                    f"installing {bundle} into {prefix} failed: {_first_and_last_line(exc)}; the prefix was "
                    + ("emptied" if existed else "removed"),
                    hint="free space on the prefix's filesystem (df -h), then install again"
                    if full
                    else f"check that you can write to {created if not existed else prefix} and to the package "
                    f"cache {cache_dir}, then install again",
                ) from None
    installed = tuple(
        DeployedPackage(
            r.name.normalized,
            str(r.version),
            str(r.build),
            r.subdir,
            str(r.channel or "").rstrip("/"),
            url,
            r.sha256.hex(),
        )
        for r, url in pointed
    )
    return DeployReport(
        prefix=prefix,
        lock_file=prefix / LOCK_NAME,
        channels=(),
        specs=(),
        packages=installed,
        from_lock=True,
        seconds=time.perf_counter() - start,
        anchor="+".join(anchors) or NO_ANCHOR,
        signer=signer,
    )


def _first_and_last_line(exc: BaseException) -> str:
    # rattler's errors say what failed on the first line and the cause (e.g. ENOSPC) on the last.
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if len(lines) > 1:
        return f"{lines[0]} ({lines[-1]})"
    return _first_line(exc)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
