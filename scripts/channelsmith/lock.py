"""The lock file a deploy writes: reading and writing it, and pointing it at channels that moved.

A lock (rattler's format, ``PREFIX/channelsmith.lock``) pins every package of an environment by URL
and sha256, with the channels it was solved from. ``deploy`` writes it and installs from it
(``deploy --lock``); the bundle packs the packages it pins and installs from the copy it carries.
Both read it here, and both take ``--channel-map OLD=NEW`` for a local channel that moved since
the lock was written (:func:`parse_channel_map`, :func:`remap_lock`): the lock names each package
file by its full path.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from rattler import LockChannel, LockFile, LockPlatform, RepoDataRecord, Subdir

from channelsmith.channel import channel_url, check_channel, is_channel, url_path
from channelsmith.errors import DeployError

LOCK_NAME = "channelsmith.lock"
LOCK_ENVIRONMENT = "default"
LOCK_FILES_HINT = (
    "a lock installs exactly the package files it pins (sha256): put back the very files it was written from, "
    "pass --channel-map OLD=NEW to take them from a channel that holds them, or deploy the specs again without "
    "--lock to solve afresh"
)


# --------------------------------------------------------------------------------------------
# Writing and reading
# --------------------------------------------------------------------------------------------


def write_lock(records: Sequence[RepoDataRecord], channel_urls: Sequence[str], lock_file: Path) -> Path:
    """Write a rattler lock file listing exactly ``records`` for this platform (atomically)."""
    platform = LockPlatform(str(Subdir.current()))
    lock = LockFile([platform])
    lock.set_channels(LOCK_ENVIRONMENT, [LockChannel(url) for url in channel_urls])
    for record in records:
        lock.add_conda_package(LOCK_ENVIRONMENT, platform, record)
    lock_file = Path(lock_file)
    try:
        lock_file.parent.mkdir(parents=True, exist_ok=True)
        fd, part = tempfile.mkstemp(prefix=f".{lock_file.name}.", dir=lock_file.parent)
        os.close(fd)
        lock.to_path(part)
        os.chmod(part, 0o644)
        os.replace(part, lock_file)
    except OSError as exc:
        raise DeployError(
            f"cannot write the lock file {lock_file}: {exc.strerror or exc}", hint="pass a writable --lock-out"
        ) from None
    return lock_file


def read_lock(lock_file: Path) -> tuple[list[RepoDataRecord], list[str]]:
    """The records and channel URLs a lock file holds for this platform (what ``deploy --lock`` installs)."""
    lock_file = Path(lock_file)
    if lock_file.is_dir():
        inside = lock_file / LOCK_NAME
        raise DeployError(
            f"lock file {lock_file} is a directory",
            hint=f"pass the lock file itself: --lock {inside}"
            if inside.is_file()
            else "pass the lock file a deploy wrote (PREFIX/channelsmith.lock)",
        )
    if not lock_file.exists():
        raise DeployError(
            f"lock file {lock_file} does not exist", hint="pass the lock file a deploy wrote (PREFIX/channelsmith.lock)"
        )
    try:
        lock = LockFile.from_path(lock_file)
    except Exception as exc:  # ParseCondaLockError
        raise DeployError(
            f"{lock_file} is not a readable lock file: {_first_line(exc)}", hint="pass the lock file a deploy wrote"
        ) from None
    environment = lock.environment(LOCK_ENVIRONMENT)
    if environment is None:
        raise DeployError(
            f"{lock_file} has no '{LOCK_ENVIRONMENT}' environment", hint="pass the lock file a deploy wrote"
        )
    current = str(Subdir.current())
    # Records must be read through the lock's own platform objects (py-rattler panics on a new one).
    platform = next((p for p in environment.platforms() if p.name == current), None)
    records = environment.conda_repodata_records_for_platform(platform) if platform is not None else None
    if not records:
        raise DeployError(
            f"{lock_file} holds no packages for this machine's platform ({current})",
            hint="deploy from a lock written on the same platform",
        )
    return list(records), [str(channel) for channel in environment.channels()]


def _lock_hint() -> str:
    return f"pass the lock file a deploy wrote (PREFIX/{LOCK_NAME})"


def lock_records(lock_file: Path, platform: str | None = None) -> tuple[str, list[RepoDataRecord]]:
    """The platform and records of a lock file (what a bundle packs): ``platform`` if given, else its only
    platform (or this machine's); sorted by name. Conda packages only: a lock pinning PyPI packages too
    is refused."""
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


def lock_channels(lock_file: Path) -> list[str]:
    """The channel URLs a lock file was solved from, in priority order (a file :func:`lock_records` read)."""
    environment = LockFile.from_path(lock_file).environment(LOCK_ENVIRONMENT)
    return [str(channel) for channel in environment.channels()] if environment is not None else []


# --------------------------------------------------------------------------------------------
# Channels that moved
# --------------------------------------------------------------------------------------------


def parse_channel_map(entries: Sequence[str]) -> dict[str, str]:
    """``OLD=NEW`` entries (paths or URLs of channels) as {old channel URL: new channel URL}.

    OLD is where the lock file says a channel was (a path that may no longer exist, or a URL); NEW is
    where it is now: a local one must be a channel (checked here), anything else is passed on as given.
    """
    mapping = {}
    for entry in entries:
        old, sep, new = entry.partition("=")
        if not sep or not old or not new:
            raise DeployError(
                f"--channel-map {entry!r} is not OLD=NEW",
                hint="write it as --channel-map /old/path/channel=/new/path/channel",
            )
        mapping[_as_channel_url(old)] = _as_channel_url(new, check=True)
    return mapping


def _as_channel_url(given: str, check: bool = False) -> str:
    if "://" in given:
        local = url_path(given)
        if local is None:
            return given.rstrip("/")
    else:
        local = Path(given).expanduser()
    if check:
        check_channel(local, hashes=False)
    return channel_url(local)


def remap_lock(
    records: Sequence[RepoDataRecord], urls: Sequence[str], channel_map: Mapping[str, str], lock_file: Path
) -> list[str]:
    """Point the records and channels of a lock at the channels' new places (``records`` are changed).

    The package files stay pinned by the lock's sha256, which every file from a local channel is
    checked against before it is installed or packed. DeployError for an OLD the lock does not name.
    """
    for old in channel_map:
        if old not in urls:
            raise DeployError(
                f"--channel-map {old}=...: the lock file {lock_file} names no such channel",
                hint=f"its channels are: {', '.join(urls)}",
            )
    for record in records:
        for old, new in channel_map.items():
            if record.url.startswith(old + "/"):
                record.url = new + record.url[len(old) :]
                record.channel = new + "/"
    return [channel_map.get(url, url) for url in urls]


def moved_channel_error(lock_file: Path, channel_dir: Path) -> DeployError:
    """The error for a lock whose local channel is not where the lock says: the way out is --channel-map."""
    return DeployError(
        f"the lock file {lock_file} installs from the channel {channel_dir}, which is not there "
        f"(no {channel_dir / 'noarch' / 'repodata.json'})",
        hint=f"a lock file names the channel by its path: if the channel moved, pass "
        f"--channel-map {channel_dir}=NEW_DIR (the files there are checked against the lock's sha256); "
        f"or put the channel back at {channel_dir}",
    )


def check_lock_files(records: Sequence[RepoDataRecord], lock_file: Path) -> None:
    """DeployError when a package file a lock pins in a local channel is not there, saying why.

    A lock names each file by its full path: a channel that moved makes every one of them missing,
    and the way out is to say where it went, not to repair the channel.
    """
    for record in records:
        path = url_path(record.url)
        if path is None or path.exists():
            continue
        channel_dir = path.parent.parent
        if not is_channel(channel_dir):
            raise moved_channel_error(lock_file, channel_dir)
        raise DeployError(
            f"{path}, which the lock file {lock_file} pins, is missing from the channel {channel_dir}",
            hint=LOCK_FILES_HINT,
        )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
