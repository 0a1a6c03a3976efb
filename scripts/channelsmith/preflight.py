"""What the end of a build needs, checked before its first compile.

A PyTorch build takes hours: finding at its end that the channel cannot be written, or after its
first minutes of retries that a channel does not answer, wastes them. :func:`check_ready` checks in
seconds, and leaves nothing behind:

- the channel directory can be written (:func:`channelsmith.channel.check_writable`);
- the file systems of the channel and of the build's work directory have room for the packages
  planned, estimated from the largest earlier build of each package the channel holds (a package
  the channel has never held has no estimate, and adds nothing);
- every ``-c`` channel answers, when a planned package needs packages from channels;
- every upstream source is in the source cache, or its server answers.

"Answers" means that a TCP connection to the server (or to the proxy the environment names for it)
opens within a few seconds: fast, and the same test whatever the server then says. The scheduler is
checked by :func:`channelsmith.slurm.check_cluster`, before any batch job is submitted.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import urllib.parse
import urllib.request
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rattler import Channel

from channelsmith import channel
from channelsmith.errors import DiskSpaceError, UnreachableError
from channelsmith.recipes import RenderedOutput
from channelsmith.sources import NETWORK_TIMEOUT

# Where py-rattler-build 0.73 records each entry of its source cache: one JSON file per download,
# with the URL, the checksum and the file it keeps (read from the files it writes; not a documented
# format, so an unreadable record only means "not cached").
ENGINE_CACHE_RECORDS = ".metadata"

_DEFAULT_PORTS = {"http": 80, "https": 443}


def check_ready(
    channel_dir: Path,
    extra_channels: Sequence[str],
    outputs: Iterable[RenderedOutput],
    work_dir: Path,
    source_cache: Path,
) -> None:
    """Raise the UserError that the end of building ``outputs`` into ``channel_dir`` would meet.

    ``outputs`` are the packages to build (not those the channel already holds); ``work_dir`` is
    where the engine writes them first. ChannelError when the channel cannot be written (exit 2);
    DiskSpaceError or UnreachableError (exit 3) for a full disk, a channel or a source server that
    does not answer.
    """
    outputs = list(outputs)
    channel.check_writable(channel_dir)
    check_room(channel_dir, outputs, work_dir)
    if any(o.needs_channels for o in outputs):
        unreachable = unreachable_channels(extra_channels)
        if unreachable:
            raise UnreachableError(
                "\n".join(f"channel {name} could not be reached: {why}" for name, why in unreachable),
                hint="nothing was built. A planned package needs packages from it: build on a machine that "
                "reaches it, set HTTPS_PROXY where the network has a proxy, or pass a copy of the channel "
                "with -c (a URL or a local directory)",
            )
    check_sources(outputs, source_cache)


def unreachable_channels(channels: Iterable[str]) -> list[tuple[str, str]]:
    """(channel as given, why) for every http(s) channel whose server does not answer.

    A channel name (``conda-forge``) is turned into its URL by py-rattler, as the engine does.
    Local channels (paths, file:// URLs) are not checked here.
    """
    urls = {}
    for given in channels:
        url = Channel(given).base_url
        if urllib.parse.urlsplit(url).scheme in _DEFAULT_PORTS:
            urls[given] = url
    failures = _unanswered(urls.values())
    shown = {given: given if "://" in given else f"{given} ({url})" for given, url in urls.items()}
    return [(shown[given], failures[url]) for given, url in urls.items() if url in failures]


def check_sources(outputs: Iterable[RenderedOutput], source_cache: Path) -> None:
    """UnreachableError unless every url/git source of ``outputs`` is cached or its server answers."""
    cached = cached_sources(source_cache)
    needed: dict[str, str] = {}
    for output in outputs:
        for source in output.sources:
            url = source.url or source.git
            if url and url not in cached and urllib.parse.urlsplit(url).scheme in _DEFAULT_PORTS:
                needed.setdefault(url, output.recipe)
    failures = _unanswered(needed)
    if failures:
        raise UnreachableError(
            "\n".join(
                f"the source {url} of {needed[url]} is not in the source cache and could not be reached: {why}"
                for url, why in failures.items()
            ),
            hint=f"nothing was built. Build once where the server answers (the source is then kept in "
            f"{source_cache}), or copy that folder from a machine that has it (CHANNELSMITH_CACHE names "
            "the cache)",
        )


def cached_sources(source_cache: Path) -> set[str]:
    """The URLs whose download the engine's source cache holds."""
    found = set()
    records = source_cache / ENGINE_CACHE_RECORDS
    for record in sorted(records.glob("*.json")) if records.is_dir() else ():
        try:
            entry = json.loads(record.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        kept = [entry.get(key) for key in ("cache_path", "extracted_path") if isinstance(entry.get(key), str)]
        if isinstance(entry.get("url"), str) and any((source_cache / k).exists() for k in kept):
            found.add(entry["url"])
    return found


def check_room(channel_dir: Path, outputs: Sequence[RenderedOutput], work_dir: Path) -> None:
    """DiskSpaceError when the channel's or the work directory's file system lacks room for ``outputs``.

    Each package is estimated at the size of the largest package of its name the channel lists (an
    earlier build); the engine writes it into ``work_dir`` first, and publish copies it into the channel.
    """
    estimate = sum(_earlier_sizes(channel_dir).get(o.name, 0) for o in outputs)
    if not estimate:
        return
    needed: dict[int, tuple[Path, int]] = {}
    for place in (_existing(work_dir), _existing(channel_dir)):
        device = os.stat(place).st_dev
        where, total = needed.get(device, (place, 0))
        needed[device] = (where, total + estimate)
    for where, total in needed.values():
        free = shutil.disk_usage(where).free
        if free < total:
            raise DiskSpaceError(
                f"{where} has {_size(free)} free; the {len(outputs)} planned package(s) need about {_size(total)} "
                "there (their earlier builds in the channel)",
                hint="nothing was built. Free space there, or point TMPDIR (the work directory) or "
                "--channel-dir at a file system with room",
            )


def _earlier_sizes(channel_dir: Path) -> dict[str, int]:
    """Package name -> size of its largest file the channel lists."""
    sizes: dict[str, int] = {}
    if not channel.is_channel(channel_dir):
        return sizes
    for subdir in channel.channel_subdirs(channel_dir):
        if (channel_dir / subdir / channel.REPODATA).is_file():
            for listed in channel.listed_packages(channel_dir, subdir):
                name = listed.path.name.removesuffix(".conda").removesuffix(".tar.bz2").rsplit("-", 2)[0]
                sizes[name] = max(sizes.get(name, 0), listed.size)
    return sizes


def _existing(path: Path) -> Path:
    """``path``, or the nearest folder above it that exists."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _size(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024:
            return f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} TiB"


def _unanswered(urls: Iterable[str]) -> dict[str, str]:
    """URL -> why, for every URL whose server (or proxy) does not accept a connection; checked at once."""
    urls = sorted(set(urls))
    if not urls:
        return {}
    with ThreadPoolExecutor(max_workers=min(8, len(urls))) as pool:
        answers = dict(zip(urls, pool.map(_connect_error, urls)))
    return {url: why for url, why in answers.items() if why is not None}


def _connect_error(url: str) -> str | None:
    """None when a TCP connection to the URL's server, or to its proxy, opens; else why not."""
    parts = urllib.parse.urlsplit(url)
    host, port = parts.hostname or "", parts.port or _DEFAULT_PORTS[parts.scheme]
    proxy = urllib.request.getproxies().get(parts.scheme)
    if proxy and not urllib.request.proxy_bypass(host):
        proxied = urllib.parse.urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        host, port = proxied.hostname or "", proxied.port or _DEFAULT_PORTS.get(proxied.scheme, 80)
    try:
        with socket.create_connection((host, port), timeout=NETWORK_TIMEOUT):
            return None
    except TimeoutError:
        return f"no answer from {host}:{port} within {NETWORK_TIMEOUT:g} s"
    except OSError as exc:
        return f"{host}:{port}: {exc.strerror or exc}"
