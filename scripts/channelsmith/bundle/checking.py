"""Reading a bundle for an install, and checking it before anything inside it is used.

The members an install reads (the packages, the lock, pixi-pack.json) are extracted into a private
folder (channelsmith.private: no one else can write it or rename it or a folder above it) on one
read of the tar, front to back, which also gives the bundle's sha256 and feeds a signature check
(anchors.py): what is checked is what was extracted, and what was extracted is what py-rattler
later opens by its path there. Then the bundle itself: its
platform, its lock, every package against the lock's sha256. The bundle's own lock only shows
damage: whoever can change a package can change that lock too. A trusted lock kept apart from the
bundle shows a change: every package must be one it pins, with its sha256.
"""

from __future__ import annotations

import hashlib
import json
import os
import tarfile
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from rattler import RepoDataRecord, Subdir

from channelsmith.bundle.anchors import SignatureVerifier
from channelsmith.bundle.layout import (
    BLOCK,
    BUNDLE_FORMAT,
    CHANNEL_NAME,
    METADATA_NAME,
    HashingReader,
    package_member,
)
from channelsmith.errors import DeployError
from channelsmith.lock import LOCK_NAME, lock_records


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
def extracted(
    bundle: Path, into: Path, verifier: SignatureVerifier | None = None
) -> Iterator[tuple[dict[str, tuple[Path, str]], str]]:
    """What an install reads from a bundle, checking every member: (member name -> (file in ``into``,
    sha256), the sha256 of the whole bundle file).

    The tar is read once, front to back (tarfile's stream mode), and the bundle's sha256 is taken
    from those same bytes, which also feed ``verifier`` (ssh-keygen -Y verify): what is checked
    against an outside anchor is what was extracted. A member named twice is refused (tar would
    take the last, and the first copy's temporary file would be lost).
    Each member is a file of its own in ``into``, a folder only this user can change
    (:func:`channelsmith.private.make_private_folder`), removed afterwards.
    """
    check_bundle_file(bundle)
    files: dict[str, tuple[Path, str]] = {}
    try:
        try:
            with open(bundle, "rb") as raw:
                reader = HashingReader(raw, verifier)
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
                        fd, part = tempfile.mkstemp(prefix="member-", suffix=f"-{Path(name).name}", dir=into)
                        files[name] = (Path(part), "")
                        source = tar.extractfile(member)
                        digest = hashlib.sha256()
                        with os.fdopen(fd, "wb") as sink:
                            while block := source.read(BLOCK):
                                digest.update(block)
                                sink.write(block)
                        files[name] = (Path(part), digest.hexdigest())
                # The end-of-archive blocks and any padding after them belong to the file's sha256 too.
                while reader.read(BLOCK):
                    pass
                whole = reader.digest.hexdigest()
        except (tarfile.TarError, EOFError) as exc:
            raise _bundle_error(bundle, f"it is truncated or not a tar ({_first_line(exc)})") from None
        except OSError as exc:
            raise DeployError(
                f"cannot extract {bundle} into {into}: {exc.strerror or exc}",
                hint=f"free space in {into.parent} (or point TMPDIR at a larger folder only you can write), "
                "then try again",
            ) from None
        yield files, whole
    finally:
        for path, _digest in files.values():
            path.unlink(missing_ok=True)
        if verifier is not None:
            verifier.abandon()


def check_bundle_file(bundle: Path) -> None:
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


def anchor_hint(what: str) -> str:
    """The hint of a refusal by an outside anchor (``what`` names it): do not install, copy the bundle again."""
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
            hint=anchor_hint(f"the lock {trusted.path}"),
        )


def bundled_records(
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
    # Every package in the bundle is one the lock pins (as unpack.sh requires): one it does not pin would
    # be ignored silently, and a bundle that differs from what pack writes is not the bundle that was packed.
    pinned = {package_member(record) for record in records}
    unpinned = sorted(name for name in files if name.startswith(f"{CHANNEL_NAME}/") and name not in pinned)
    if unpinned:
        which = f"the trusted lock {trusted.path}" if trusted is not None else f"its lock {LOCK_NAME}"
        raise _bundle_error(
            bundle, f"it holds {', '.join(unpinned)}, which {which} does not pin; pack writes exactly the lock's packages"
        )
    pointed = []
    for record in records:
        name = package_member(record)
        if name not in files:
            raise _bundle_error(bundle, f"{name} is missing (truncated?)")
        path, digest = files[name]
        if digest != record.sha256.hex():
            if trusted is not None:
                raise DeployError(
                    f"{bundle} holds a {record.file_name} whose sha256 ({digest}) differs from the one the "
                    f"trusted lock {trusted.path} records ({record.sha256.hex()})",
                    hint=anchor_hint(f"the lock {trusted.path}"),
                )
            raise DeployError(
                f"{bundle} holds a {record.file_name} whose sha256 differs from the one its lock records: "
                "the bundle was damaged or changed after packing",
                hint="copy the bundle again from the packing node, or pack it again there",
            )
        pointed.append((RepoDataRecord(record, record.file_name, path.as_uri(), record.channel or ""), record.url))
    return pointed, (trusted.path if trusted is not None else lock_file).read_bytes()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
