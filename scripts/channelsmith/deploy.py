"""Deploy packages from the local channel into a prefix, and re-create a prefix from a lock file.

py-rattler solves (strict channel priority: the local channel first, then the channels given, and
no default channel) and installs; channelsmith.lock writes and reads the lock file. This module
checks what it is handed before anything is written: the channels (repodata parses, files
present), the prefix (creatable, writable, empty or already an environment) and every package file
about to be installed (size and sha256 as the repodata or lock records them). A mistake raises a
UserError and leaves the prefix and the channels as they were.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import rattler
from rattler import (
    ChannelPriority,
    Gateway,
    GenericVirtualPackage,
    MatchSpec,
    PrefixRecord,
    RepoDataRecord,
    Subdir,
)

from channelsmith.channel import (
    DEFAULT_CHANNEL_DIR,
    ListedPackage,
    channel_url,
    check_channel,
    run_rattler,
    url_path,
    verify_listed,
)
from channelsmith.errors import ChannelError, DeployError, SolveError
from channelsmith.expansion import check_expansions, check_room
from channelsmith.gpu import (
    NO_GPU_HINT,
    SITE_PROFILE_PREFIX,
    GpuTarget,
    check_gpu_code_has_a_target,
    detected_virtual_packages,
    find_profile,
    gpu_disagreement,
    gpu_target,
    lock_target,
    named_profile,
    solve_virtual_packages,
)
from channelsmith.lock import (
    LOCK_FILES_HINT,
    LOCK_NAME,
    check_lock_files,
    read_lock,
    remap_lock,
    write_lock,
)
from channelsmith.private import make_private_folder, resolved, who_else_can_change

# `local::NAME` pins a spec to the local channel (--channel-dir), like `internal::NAME` with conda.
LOCAL_PREFIX = "local::"
SPEC_HINT = (
    "write specs as NAME, NAME ==VERSION, NAME ==VERSION BUILD*, local::NAME (only the local channel) "
    "or CHANNEL_URL::NAME, e.g. 'site-env-derecho' or 'local::pytorch ==2.6.0 *cray_mpich*'"
)


@dataclass(frozen=True)
class DeployedPackage:
    """One package in a deployed prefix (or in a lock file)."""

    name: str
    version: str
    build: str
    subdir: str
    channel: str
    url: str
    sha256: str


@dataclass(frozen=True)
class DeployReport:
    """What a deploy did: the prefix, the packages it now holds, the lock file that re-creates it."""

    prefix: Path
    lock_file: Path
    channels: tuple[str, ...]
    specs: tuple[str, ...]
    packages: tuple[DeployedPackage, ...]
    from_lock: bool
    seconds: float
    # A bundle install's outside anchors, as checked ("signature", "sha256", "lock", joined by "+"; "none"),
    # and the signer's principal; None for installs from a channel or a lock.
    anchor: str | None = None
    signer: str | None = None
    # The GPUs the environment was solved for (None for a lock installed as it was written).
    gpu: GpuTarget | None = None
    # Where the install kept what it checked, when not where it first looked: a TMPDIR, a prefix's folder or a
    # package cache that another user could change was passed over (channelsmith.private), and why.
    notes: tuple[str, ...] = ()


# --------------------------------------------------------------------------------------------
# Channels
# --------------------------------------------------------------------------------------------


def resolve_channels(channel_dir: Path | None, channels: Sequence[str]) -> list[str]:
    """Channel URLs in priority order: the local channel (if any), then each ``-c`` channel.

    Local directories (a path, or a file:// URL) are checked (repodata parses, listed files present
    with their sizes) and turned into file:// URLs. Anything else (``conda-forge``, an https URL) is
    passed to py-rattler as given, which is the only way a deploy reaches the network. With no
    local channel (``channel_dir`` None) the ``-c`` channels alone are solved from.
    """
    urls = []
    if channel_dir is not None:
        check_channel(channel_dir, hashes=False)
        urls.append(channel_url(channel_dir))
    for entry in channels:
        if "://" in entry:
            local = url_path(entry)
            if local is None:
                urls.append(entry.rstrip("/"))
                continue
        elif entry.startswith(("/", ".", "~")) or Path(entry).is_dir():
            # A relative path that does not exist stays a channel name: labels contain slashes
            # (conda-forge/label/mpi-external).
            local = Path(entry).expanduser()
        else:
            urls.append(entry)
            continue
        check_channel(local, hashes=False)
        urls.append(channel_url(local))
    # Naming a channel twice (e.g. -c ./channel) must not change the priority order.
    return list(dict.fromkeys(urls))


def _verify_package_file(record: RepoDataRecord, listed_in: str) -> None:
    """A package about to be installed from a local channel must be the file its record describes."""
    path = url_path(record.url)
    if path is None or record.sha256 is None or record.size is None:
        return
    verify_listed(ListedPackage(path, record.subdir, record.size, record.sha256.hex()), listed_in=listed_in)


# --------------------------------------------------------------------------------------------
# Prefix
# --------------------------------------------------------------------------------------------


def check_prefix(prefix: Path) -> None:
    """DeployError unless ``prefix`` can be created or written, and is empty or an environment already.

    Writes nothing that stays: writability is probed with a temporary file or directory.
    """
    prefix = Path(prefix)
    if prefix.exists():
        if not prefix.is_dir():
            raise DeployError(
                f"prefix {prefix} is a file", hint="pass a --prefix that is a directory or does not exist yet"
            )
        if any(prefix.iterdir()) and not (prefix / "conda-meta").is_dir():
            raise DeployError(
                f"prefix {prefix} is not empty and is not a conda environment (no conda-meta/)",
                hint="pass a new or empty directory, or an environment channelsmith deploy made",
            )
        probe_in = prefix
    else:
        probe_in = prefix.parent
        while not probe_in.exists() and probe_in != probe_in.parent:
            probe_in = probe_in.parent
        if not probe_in.is_dir():
            raise DeployError(
                f"prefix {prefix} cannot be created: {probe_in} is a file, not a directory",
                hint="pass a --prefix whose parent folders are directories you can write to",
            )
    try:
        Path(tempfile.mkdtemp(prefix=".channelsmith-probe-", dir=probe_in)).rmdir()
    except OSError as exc:
        raise DeployError(
            f"prefix {prefix} cannot be written: creating a directory in {probe_in} failed ({exc.strerror or exc})",
            hint="pass a --prefix in a directory you can write to",
        ) from None


def prefix_records(prefix: Path) -> list[PrefixRecord]:
    """The records of the packages installed in a prefix (its conda-meta), with their requirements."""
    meta = Path(prefix) / "conda-meta"
    if not meta.is_dir():
        raise DeployError(f"{prefix} is not a conda environment (no conda-meta/)", hint="pass the prefix of a deploy")
    return [PrefixRecord.from_path(path) for path in sorted(meta.glob("*.json"))]


def prefix_packages(prefix: Path) -> list[DeployedPackage]:
    """The packages installed in a prefix, read from its conda-meta records, sorted by name."""
    return sorted((_deployed(record) for record in prefix_records(prefix)), key=lambda p: p.name)


def _deployed(record: RepoDataRecord) -> DeployedPackage:
    return DeployedPackage(
        name=record.name.normalized,
        version=str(record.version),
        build=str(record.build),
        subdir=record.subdir,
        channel=str(record.channel or "").rstrip("/"),
        url=record.url,
        sha256=record.sha256.hex() if record.sha256 else "",
    )


# --------------------------------------------------------------------------------------------
# Solve, install, lock
# --------------------------------------------------------------------------------------------


def _match_specs(specs: Sequence[str]) -> list[MatchSpec]:
    parsed = []
    for spec in specs:
        try:
            parsed.append(MatchSpec(spec))
        except Exception as exc:  # InvalidMatchSpecError
            raise SolveError(f"invalid package spec {spec!r}: {_first_line(exc)}", hint=SPEC_HINT) from None
    return parsed


def pin_local(spec: str, local_url: str) -> str:
    """``local::NAME ...`` as a spec the solver understands: NAME only from the local channel."""
    return f"{local_url}::{spec[len(LOCAL_PREFIX) :]}" if spec.startswith(LOCAL_PREFIX) else spec


def solve(
    specs: Sequence[str],
    channel_urls: Sequence[str],
    virtual_packages: Sequence[GenericVirtualPackage] | None = None,
    target: GpuTarget | None = None,
) -> list[RepoDataRecord]:
    """Solve ``specs`` against exactly ``channel_urls`` (strict priority, in order) for this machine,
    or for ``virtual_packages`` where given (:func:`channelsmith.gpu.solve_virtual_packages`).

    SolveError carries the solver's own explanation (which spec has no candidates, which packages
    conflict); its hint says which GPUs the solve was for where ``target`` names them.
    """
    match_specs = _match_specs(specs)
    platform = Subdir.current()
    try:
        return run_rattler(
            rattler.solve(
                list(channel_urls),
                match_specs,
                # A fresh gateway per solve: its in-memory repodata cache would hide a publish made since.
                gateway=Gateway(),
                platforms=[platform, Subdir("noarch")],
                virtual_packages=detected_virtual_packages() if virtual_packages is None else list(virtual_packages),
                channel_priority=ChannelPriority.Strict,
            )
        )
    except Exception as exc:  # SolverError, GatewayError, FetchRepoDataError
        if type(exc).__name__ == "SolverError":
            gpus = (
                f"GPUs: {target.summary}; a package whose cuda-arch range leaves __cuda_arch "
                f"{target.cuda_arch} out, or that needs a newer __cuda, has no candidate here"
                if target is not None and target.cuda_arch is not None
                else "a package depending on __cuda or cuda-arch needs a GPU that can run it: " + NO_GPU_HINT
            )
            raise SolveError(
                f"the specs {', '.join(specs)} do not solve against {', '.join(channel_urls)}:\n{str(exc).strip()}",
                hint="check the spelling and versions; channelsmith plan shows what the recipes build; " + gpus,
            ) from None
        raise ChannelError(
            f"cannot read the channels {', '.join(channel_urls)}: {str(exc).strip()}",
            hint="check that each -c channel exists and is reachable",
        ) from None


def check_site_named(specs: Sequence[str], records: Sequence[RepoDataRecord]) -> None:
    """DeployError when a solve brought in a site's builds although no spec names a site profile.

    Every site build requires its ``site-env-<site>``; all but the generic site's carry a
    track_feature (recipes/site-env), so that with no profile named the solver takes generic's
    builds. It still takes another site's where the channels hold no generic build of what was
    asked for, and that build is only right on that site: the user must name the site.
    """
    if any(spec.name is not None and spec.name.normalized.startswith(SITE_PROFILE_PREFIX)
           for spec in _match_specs(specs)):
        return
    profiles = [r for r in records if r.name.normalized.startswith(SITE_PROFILE_PREFIX) and r.track_features]
    if not profiles:
        return
    profile = profiles[0]
    site_builds = sorted(f"{r.name.normalized} {r.version} {r.build}" for r in records if r.track_features and r is not profile)
    channel_url_ = str(profile.channel or "").rstrip("/")
    sites = sorted(
        name.normalized
        for name in run_rattler(Gateway().names([channel_url_], [Subdir.current(), Subdir("noarch")]))
        if name.normalized.startswith(SITE_PROFILE_PREFIX)
    )
    raise DeployError(
        "no spec names a site profile (site-env-<site>), but the solve would install the builds of "
        f"{profile.name.normalized[len(SITE_PROFILE_PREFIX):]} ({', '.join(site_builds) or profile.name.normalized}), "
        "which are right on that site only",
        hint=f"name the site's profile, e.g. add {profile.name.normalized} to the specs; the channel "
        f"{channel_url_} has {', '.join(sites)}",
    )


def solve_target(
    specs: Sequence[str],
    channel_urls: Sequence[str],
    cuda_arch: str | None = None,
    cuda_driver: str | None = None,
    ignore_gpus_here: bool = False,
) -> tuple[GpuTarget, list[GenericVirtualPackage]]:
    """The GPUs a solve of ``specs`` is for, and the virtual packages that say so to the solver.

    The site profile a spec names is read from the first channel holding it (its run constraints on
    __cuda_arch and __cuda); DeployError (exit 2) where --cuda-arch/--cuda-driver or this machine's
    GPU disagrees with what is named (:func:`channelsmith.gpu.gpu_target`).
    """
    detected = detected_virtual_packages()
    profile_name = named_profile(specs)
    profile = find_profile(profile_name, channel_urls) if profile_name else None
    target = gpu_target(detected, profile, cuda_arch, cuda_driver, ignore_gpus_here)
    return target, solve_virtual_packages(detected, target)


def check_lock_gpus(records: Sequence[RepoDataRecord], what: str) -> None:
    """DeployError when a GPU answers here and a package of ``records`` has no code for it (its cuda-arch range)."""
    _, profile = lock_target(records)
    reason = gpu_disagreement(records, what + (f" ({profile})" if profile else ""))
    if reason:
        raise DeployError(
            reason, hint="install it on the nodes it was solved for, or deploy the specs again on (or for) these GPUs"
        )


def shared_package_cache() -> Path:
    """py-rattler's default package cache, the one a deploy shares with pixi and rattler-build: rattler's
    default_cache_dir()/pkgs ($RATTLER_CACHE_DIR, else $XDG_CACHE_HOME or ~/.cache, then rattler/cache)."""
    given = os.environ.get("RATTLER_CACHE_DIR")
    if given:
        root = Path(given)
    else:
        xdg = os.environ.get("XDG_CACHE_HOME", "")
        root = (Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache") / "rattler" / "cache"
    return root / "pkgs"


def _why_not_shared(cache: Path, records: Sequence[RepoDataRecord]) -> str | None:
    """Why the shared package ``cache`` must not be used for ``records``; None when it may.

    py-rattler takes a cached package whose ``.lock`` file beside it records the lock's sha256, and
    links its files (hard links: the very files in the cache). So the cache, every folder above it and
    every cached package the install would take must be this user's or root's and writable by no one
    else: then only this user's own installs, which extract checked bytes, can have written them.
    """
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except (OSError, RuntimeError) as exc:  # RuntimeError: no home directory to expand
        return f"it cannot be made ({getattr(exc, 'strerror', None) or exc})"
    if not os.access(cache, os.W_OK | os.X_OK):
        return "you cannot write it"
    reason = who_else_can_change(cache)
    if reason is not None:
        return reason
    me = os.geteuid()
    for record in records:
        stem = _cache_entry(record)
        for path in _under(cache / stem, cache / f"{stem}.lock"):
            info = os.lstat(path)
            if info.st_uid not in (me, 0):
                return f"its {path} belongs to another user (uid {info.st_uid})"
            if not stat.S_ISLNK(info.st_mode) and info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
                return f"its {path} can be written by others (mode {stat.S_IMODE(info.st_mode):04o})"
    return None


def _cache_entry(record: RepoDataRecord) -> str:
    """The name of the folder py-rattler extracts ``record``'s package into, in its package cache."""
    return f"{record.name.normalized}-{record.version}-{record.build}"


def _cached(cache: Path, record: RepoDataRecord) -> bool:
    """Whether py-rattler takes ``record``'s package from ``cache`` as it is, extracting nothing: its folder is
    there and the ``.lock`` file beside it (a revision, 8 bytes, then the sha256 of the archive it was extracted
    from) records ``record``'s sha256. A folder of the same name, version and build from another archive (a
    rebuild, or a bomb named like a cached package) py-rattler extracts again."""
    try:
        written = (cache / f"{_cache_entry(record)}.lock").read_bytes()
    except OSError:
        return False
    sha256 = record.sha256
    return sha256 is not None and written[8:40] == bytes(sha256) and (cache / _cache_entry(record)).is_dir()


def _under(*entries: Path) -> Iterator[Path]:
    """Each of ``entries`` that exists, and everything under those that are folders (symlinks not followed)."""
    for entry in entries:
        if not os.path.lexists(entry):
            continue
        yield entry
        if entry.is_dir() and not entry.is_symlink():
            for top, folders, files in os.walk(entry):
                yield from (Path(top, name) for name in (*folders, *files))


@contextmanager
def package_cache(records: Sequence[RepoDataRecord], beside: Path) -> Iterator[tuple[Path, str | None]]:
    """The package cache an install of ``records`` uses, and a note when it is not the shared one.

    The shared cache (:func:`shared_package_cache`) where :func:`_why_not_shared` finds nothing against
    it; else a private one made for this install (beside the prefix, ``beside``, where no one else can
    change that folder, else in $TMPDIR likewise), removed afterwards. HOME is often read-only on
    compute nodes, and py-rattler's own default would then fail ("failed to acquire global cache lock").
    """
    shared = shared_package_cache()
    reason = _why_not_shared(shared, records)
    if reason is None:
        yield resolved(shared), None
        return
    folder = make_private_folder([("the prefix's folder", beside), ("TMPDIR", Path(tempfile.gettempdir()))],
                                 "the packages being installed")  # fmt: skip
    try:
        yield folder.path, (
            f"the package cache {shared} was not used: {reason}; a private one, {folder.path}, was made for "
            "this install and removed afterwards"
        )
    finally:
        shutil.rmtree(folder.path, ignore_errors=True)


def _swappable(path: Path) -> str | None:
    """Why a user other than this one (and root) could rename another file over the package file ``path``, or
    write into it; None when none can."""
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        return f"{path} is a symlink"
    if info.st_uid not in (os.geteuid(), 0):
        return f"{path} belongs to another user (uid {info.st_uid})"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{path} can be written by others (mode {stat.S_IMODE(info.st_mode):04o})"
    return who_else_can_change(path.parent)


def restore_urls(prefix: Path, urls: Mapping[str, str]) -> None:
    """Point the prefix's conda-meta records (package stem, NAME-VERSION-BUILD -> URL) back at the URLs the lock
    gives, where py-rattler installed from copies.

    A plain JSON edit of one key: PrefixRecord.write_to_path takes ~8 ms a record (it syncs).
    """
    for stem, url in urls.items():
        meta = prefix / "conda-meta" / f"{stem}.json"
        document = json.loads(meta.read_text(encoding="utf-8"))
        document["url"] = url
        meta.write_text(json.dumps(document, indent=2, ensure_ascii=False), encoding="utf-8")


@contextmanager
def _checked_copies(records: list[RepoDataRecord], beside: Path) -> Iterator[tuple[list[RepoDataRecord], str | None]]:
    """``records``, those whose local package file another user could swap pointed at a copy in a private folder
    (removed afterwards), and a note saying so.

    Hashed, counted and then read again by py-rattler where it lies, such a file could be another by the
    time py-rattler reads it: the bytes checked would not be the bytes installed. The copy is what is checked.
    """
    swappable = {}
    for index, record in enumerate(records):
        path = url_path(record.url)
        reason = _swappable(path) if path is not None and path.exists() else None
        if reason is not None:
            swappable[index] = (path, reason)
    if not swappable:
        yield records, None
        return
    folder = make_private_folder([("the prefix's folder", beside), ("TMPDIR", Path(tempfile.gettempdir()))],
                                 "copies of the channel's packages to check")  # fmt: skip
    try:
        copied = list(records)
        for index, (path, _reason) in swappable.items():
            copy = folder.path / records[index].file_name
            shutil.copyfile(path, copy)
            copied[index] = RepoDataRecord(records[index], records[index].file_name, copy.as_uri(),
                                           records[index].channel or "")  # fmt: skip
        first = next(iter(swappable.values()))[1]
        yield copied, (
            f"{len(swappable)} package file(s) of the channel could be swapped by another user ({first}): each was "
            f"copied into {folder.path}, checked there and installed from there"
        )
    finally:
        shutil.rmtree(folder.path, ignore_errors=True)


def _install(
    records: list[RepoDataRecord], prefix: Path, listed_in: str | None, show_progress: bool
) -> tuple[str, ...]:
    """Install ``records`` into ``prefix`` (each local package file checked first); notes on the cache used."""
    beside = prefix.parent
    while not beside.exists():
        beside = beside.parent
    with _checked_copies(records, beside) as (checked, copies_note):
        notes = _install_checked(checked, prefix, listed_in, show_progress, beside)
        restore_urls(prefix, {_cache_entry(new): old.url for new, old in zip(checked, records) if new.url != old.url})
    return (*notes, *([copies_note] if copies_note else []))


def _install_checked(
    records: list[RepoDataRecord], prefix: Path, listed_in: str | None, show_progress: bool, beside: Path
) -> tuple[str, ...]:
    for record in records:
        _verify_package_file(record, listed_in or f"{record.subdir}/repodata.json")
    with package_cache(records, beside) as (cache_dir, note):
        # The local packages py-rattler is about to extract (none cached yet): each is refused, before any
        # is extracted, if it holds more than its info/paths.json records, and all if they record more
        # than the disk has free. A package from an http(s) channel py-rattler extracts as it downloads,
        # bounded by the disk alone.
        cold = {path.name: path for record in records if (path := url_path(record.url)) is not None
                and not _cached(cache_dir, record)}  # fmt: skip
        check_room(check_expansions(cold), cache_dir, prefix)
        try:
            run_rattler(
                rattler.install(
                    records,
                    prefix,
                    cache_dir=cache_dir,
                    show_progress=show_progress,
                    execute_link_scripts=False,
                )
            )
        except Exception as exc:  # InstallerError, LinkError, TransactionError, IoError
            raise DeployError(
                f"installing into {prefix} failed: {str(exc).strip()}",
                hint="check free space and permissions of the prefix, then deploy again",
            ) from None
    return (note,) if note else ()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def deploy(
    specs: Sequence[str],
    *,
    prefix: Path,
    channel_dir: Path | None = DEFAULT_CHANNEL_DIR,
    channels: Sequence[str] = (),
    lock_out: Path | None = None,
    show_progress: bool = False,
    cuda_arch: str | None = None,
    cuda_driver: str | None = None,
    ignore_gpus_here: bool = False,
) -> DeployReport:
    """Solve ``specs`` (local channel first, strict priority), install them into ``prefix``, write a lock.

    The solve is for the GPUs :func:`solve_target` names: ``cuda_arch`` (--cuda-arch) where given,
    else this machine's where one answers, else the compute nodes of the site profile a spec names;
    with none of them, a package with GPU code is refused. Its `__cuda`: ``cuda_driver``
    (--cuda-driver), else this machine's, else the profile's, else the default driver. A GPU here
    that disagrees with what is named stops the deploy unless ``ignore_gpus_here``.

    ``channel_dir`` None means no local channel: the ``channels`` alone (a shared directory, a URL)
    are solved from, in order, and ``local::`` specs are refused.

    A solve that brings in a site's builds although no spec names its profile is refused
    (:func:`check_site_named`). The prefix ends up holding exactly the solved packages. The lock file (default
    ``PREFIX/channelsmith.lock``) lists them with URLs and sha256, so :func:`deploy_lock` re-creates
    the same environment without solving.
    """
    start = time.perf_counter()
    prefix = Path(prefix).absolute()
    if not specs:
        raise SolveError("no package specs given", hint=SPEC_HINT)
    check_prefix(prefix)
    if channel_dir is None:
        if not channels:
            raise DeployError(
                "no channel to deploy from: no local channel and no -c channel",
                hint=f"build or publish into ./{DEFAULT_CHANNEL_DIR} first, or pass -c CHANNEL (a shared channel "
                "directory or URL), or --channel-dir DIR",
            )
        pinned = [spec for spec in specs if spec.startswith(LOCAL_PREFIX)]
        if pinned:
            raise DeployError(
                f"{pinned[0]!r} pins a package to the local channel, but there is no local channel",
                hint="pass --channel-dir DIR, or write CHANNEL_URL::NAME for one of the -c channels",
            )
    urls = resolve_channels(None if channel_dir is None else Path(channel_dir), channels)
    solved_specs = [pin_local(spec, urls[0]) for spec in specs]
    target, virtual = solve_target(solved_specs, urls, cuda_arch, cuda_driver, ignore_gpus_here)
    records = solve(solved_specs, urls, virtual, target)
    check_site_named(solved_specs, records)
    check_gpu_code_has_a_target(records, target)
    notes = _install(records, prefix, None, show_progress)
    lock_file = write_lock(records, urls, lock_out or prefix / LOCK_NAME)
    return DeployReport(
        prefix=prefix,
        lock_file=lock_file,
        channels=tuple(urls),
        specs=tuple(specs),
        packages=tuple(sorted((_deployed(r) for r in records), key=lambda p: p.name)),
        from_lock=False,
        seconds=time.perf_counter() - start,
        gpu=target,
        notes=notes,
    )


def deploy_lock(
    lock_file: Path,
    *,
    prefix: Path,
    lock_out: Path | None = None,
    show_progress: bool = False,
    channel_map: Mapping[str, str] | None = None,
) -> DeployReport:
    """Install exactly the packages a lock file lists into ``prefix``, without solving.

    ``channel_map`` (from :func:`channelsmith.lock.parse_channel_map`) takes the packages of a channel
    that moved from its new place. Every package file from a local channel must still match the lock's sha256. A copy
    of the lock, with the new places, is written to ``lock_out`` (default ``PREFIX/channelsmith.lock``).
    """
    start = time.perf_counter()
    prefix = Path(prefix).absolute()
    records, urls = read_lock(lock_file)
    if channel_map:
        urls = remap_lock(records, urls, channel_map, Path(lock_file))
    check_lock_files(records, Path(lock_file))
    check_lock_gpus(records, f"the lock file {lock_file}")
    check_prefix(prefix)
    try:
        notes = _install(records, prefix, f"the lock file {lock_file}", show_progress)
    except ChannelError as exc:  # a pinned file changed: repairing the channel's index would not help
        raise ChannelError(exc.message, hint=LOCK_FILES_HINT) from None
    target = lock_out or prefix / LOCK_NAME
    same = Path(lock_file).resolve() == Path(target).resolve()
    written = target if same and not channel_map else write_lock(records, urls, target)
    return DeployReport(
        prefix=prefix,
        lock_file=Path(written),
        channels=tuple(urls),
        specs=(),
        packages=tuple(sorted((_deployed(r) for r in records), key=lambda p: p.name)),
        from_lock=True,
        seconds=time.perf_counter() - start,
        notes=notes,
    )
