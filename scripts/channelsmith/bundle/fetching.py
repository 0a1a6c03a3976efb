"""Fetching the packages a lock pins for pack: from the package cache, the lock's own URL, or a download.

Every package is checked against the lock's sha256 before pack writes a byte of the bundle: a file
in a local channel is hashed where it lies, a download is hashed as it arrives and only then moved
into the package cache.
"""

from __future__ import annotations

import hashlib
import io
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from rattler import Client, RepoDataRecord
from rattler.package_streaming import download_to_writer
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

from channelsmith.bundle.layout import BLOCK
from channelsmith.channel import is_channel, run_rattler, url_path
from channelsmith.errors import DeployError
from channelsmith.lock import moved_channel_error
from channelsmith.sources import cache_root


def default_cache_dir(cache: str | Path | None = None) -> Path:
    """Where pack keeps the package archives it downloaded: packages/ in channelsmith's cache (``cache``, the
    --cache-dir every command shares, else $CHANNELSMITH_CACHE, else ~/.cache/channelsmith)."""
    return cache_root(cache) / "packages"


def _sha256_file(path: Path, advance: Callable[[int], None]) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(BLOCK), b""):
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


def fetch(
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
    local = url_path(record.url)
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
def byte_progress(show: bool, total: int, what: str) -> Iterator[Callable[[int], None]]:
    """A callback that advances a byte progress bar on stderr (with ``show``; else one that does nothing)."""
    if not show:
        yield lambda _n: None
        return
    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TimeRemainingColumn())
    # On stderr: stdout carries the --json report.
    with Progress(*columns, console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task(what, total=total)
        yield lambda n: progress.advance(task, n)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
