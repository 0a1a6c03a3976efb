"""Packing a deploy's lock into one bundle, for a node with no network (the layout: layout.py).

Packing fetches every package from the lock's own URLs (file://, http(s):// through py-rattler's
client) or from the package cache, and checks each against the lock's sha256 before a byte of the
bundle is written (fetching.py); the tar is written under a temporary name and renamed into place,
and its sha256 (FILE.tar.sha256, sha256sum's format) and, with a key, its OpenSSH signature
(FILE.tar.sig) into the anchor folder (default: beside it): the anchors a site keeps apart from
the bundle (anchors.py).
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import tarfile
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from rattler import Client, RepoDataRecord

from channelsmith import __version__
from channelsmith.bundle.anchors import check_signing_key, digest_file, sign, signature_file
from channelsmith.bundle.fetching import byte_progress, default_cache_dir, fetch
from channelsmith.bundle.layout import (
    BUNDLE_FORMAT,
    CHANNEL_NAME,
    ENVIRONMENT_NAME,
    METADATA_NAME,
    REPODATA,
    UNPACK_DIR,
    UNPACK_SCRIPT,
    HashingReader,
    package_member,
    unpack_script,
)
from channelsmith.bundle.unpack_inputs import unpack_sh_inputs
from channelsmith.errors import DeployError
from channelsmith.gpu import lock_target, runs_on
from channelsmith.lock import LOCK_NAME, lock_channels, lock_records, remap_lock


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
    # The __cuda_arch its GPU code runs on: every package's cuda-arch range, as one spec (None: no GPU code).
    runs_on: str | None = None


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
    before anything is written. ``channel_map`` (from :func:`channelsmith.lock.parse_channel_map`)
    takes the packages of a channel that moved from its new place; the bundle keeps the lock as given. The
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
        remap_lock(records, lock_channels(lock_file), channel_map, lock_file)
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    client = Client.default_client()
    total = sum(r.size or 0 for r in records)
    files: dict[str, Path] = {}
    packages = []
    stage(f"fetching {len(records)} packages ({total / 1e6:.1f} MB)")
    with byte_progress(show_progress, total, f"fetching {len(records)} packages") as advance:
        for record in records:
            path, source = fetch(record, lock_file, cache_dir, client, advance)
            files[package_member(record)] = path
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
    unpack_inputs, refusal = unpack_sh_inputs(records, files)
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
        runs_on=runs_on(records),
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
                            reader = HashingReader(source)
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
