"""Obtain upstream source trees: a given directory or tarball, the local source cache, the recipe's
release tarball (checked against its sha256), or Debian's source package of the same upstream version.

Only the files a caller names are ever copied out of a tree (a PyTorch tree is large; a patch series
touches a handful of files), so a tarball is never unpacked whole. Every place that was tried and did
not give a tree is recorded with the reason, so callers can say *why* a version is unverifiable.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.error
import urllib.parse
import urllib.request
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from channelsmith.errors import SourceError

CACHE_ENV = "CHANNELSMITH_CACHE"
OFFLINE_ENV = "CHANNELSMITH_OFFLINE"
DEFAULT_CACHE = Path("~/.cache/channelsmith")

# Seconds to wait for a release host before calling the tarball unreachable: an offline or
# firewalled machine must find out at once, not after a TCP timeout per version.
NETWORK_TIMEOUT = 5.0

# Seconds apt-get may take to download one Debian source package (PyTorch's .orig is ~30 MB).
APT_TIMEOUT = 600

# Debian source package of each upstream project whose Debian packaging keeps the upstream tree.
DEBIAN_SOURCE_PACKAGES = {"pytorch": "pytorch"}

# Tarball suffixes GNU tar reads directly.
# The member list of a tarball, kept beside the files already unpacked from it.
MEMBERS_FILE = "members.json"

TARBALL_SUFFIXES = (".tar.gz", ".tgz", ".tar.xz", ".txz", ".tar.bz2", ".tbz2", ".tar.zst", ".tar")


def cache_root(explicit: str | Path | None = None) -> Path:
    """The source cache: ``explicit``, else $CHANNELSMITH_CACHE, else ~/.cache/channelsmith."""
    chosen = explicit or os.environ.get(CACHE_ENV) or DEFAULT_CACHE
    return Path(chosen).expanduser().resolve()


def offline_requested() -> bool:
    """Whether $CHANNELSMITH_OFFLINE asks never to download release tarballs."""
    return os.environ.get(OFFLINE_ENV, "") not in ("", "0", "false", "no")


def normalize_version(text: str) -> str:
    """The release number in a version string: ``2.6.0a0`` -> ``2.6.0``, ``2.6.0+dfsg`` -> ``2.6.0``."""
    match = re.match(r"\s*v?(\d+(?:\.\d+)*)", text)
    return match.group(1) if match else text.strip()


def sha256_of(path: Path) -> str:
    """The hex sha256 of a file."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@dataclass
class SourceTree:
    """An upstream tree of one version: a directory, a tarball, or the headers of a release wheel.

    ``kind`` says where it came from (shown to users: ``directory``, ``cache``, ``release tarball``,
    ``debian``, ``wheel headers``); ``partial`` trees hold only some upstream files (a wheel's headers),
    so a file missing from them proves nothing. ``unpacked`` is a cache folder for files already taken
    out of a tarball (a verified tarball never changes, and unpacking xz costs seconds each time).
    """

    project: str
    version: str
    kind: str
    location: Path
    detail: str
    partial: bool = False
    unpacked: Path | None = None
    _members: dict[str, str] | None = field(default=None, repr=False)

    def members(self) -> dict[str, str]:
        """Every file of the tree: source-relative path -> path inside the container."""
        if self._members is None:
            listing = self.unpacked / MEMBERS_FILE if self.unpacked else None
            if listing is not None and listing.is_file():
                self._members = json.loads(listing.read_text())
            else:
                self._members = _list_members(self.location, self.kind)
                if listing is not None:
                    listing.parent.mkdir(parents=True, exist_ok=True)
                    _write_atomically(listing, json.dumps(self._members))
        return self._members

    def has(self, path: str) -> bool:
        """Whether the tree holds ``path`` (relative to the source root)."""
        return path in self.members()

    def read_text(self, path: str) -> str | None:
        """The text of one file, or None when the tree does not hold it."""
        with tempfile.TemporaryDirectory(prefix="channelsmith-read-") as scratch:
            self.extract([path], Path(scratch))
            target = Path(scratch) / path
            return target.read_text(errors="replace") if target.is_file() else None

    def extract(self, paths: Iterable[str], dest: Path) -> set[str]:
        """Copy the named files (those the tree holds) under ``dest``; returns the paths copied."""
        members = self.members()
        wanted = sorted({p for p in paths if p in members})
        if not wanted:
            return set()
        dest.mkdir(parents=True, exist_ok=True)
        if self.location.is_dir():
            for rel in wanted:
                target = dest / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(self.location / members[rel], target)
        elif self.kind == "wheel headers":
            with zipfile.ZipFile(self.location) as wheel:
                for rel in wanted:
                    target = dest / rel
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(wheel.read(members[rel]))
        elif self.unpacked is not None:
            files = self.unpacked / "files"
            absent = [rel for rel in wanted if not (files / rel).is_file()]
            if absent:
                # Unpack into a fresh folder, then move each file in: a stopped run leaves no half file.
                files.mkdir(parents=True, exist_ok=True)
                with tempfile.TemporaryDirectory(dir=self.unpacked) as fresh:
                    _tar_extract(self.location, [members[rel] for rel in absent], Path(fresh))
                    for rel in absent:
                        (files / rel).parent.mkdir(parents=True, exist_ok=True)
                        os.replace(Path(fresh) / rel, files / rel)
            for rel in wanted:
                target = dest / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(files / rel, target)
        else:
            _tar_extract(self.location, [members[rel] for rel in wanted], dest)
        return set(wanted)

    def describe(self) -> str:
        """One line naming the source kind and where the tree is."""
        return f"{self.kind}: {self.detail}"


def _list_members(location: Path, kind: str) -> dict[str, str]:
    if location.is_dir():
        return {
            str(PurePosixPath(p.relative_to(location))): str(p.relative_to(location))
            for p in location.rglob("*")
            if p.is_file() or p.is_symlink()
        }
    if kind == "wheel headers":
        return _wheel_header_members(location)
    listing = subprocess.run(["tar", "-tf", str(location)], capture_output=True, text=True)
    if listing.returncode != 0:
        raise SourceError(
            f"cannot read tarball {location}: {listing.stderr.strip()}",
            hint="pass a .tar.gz/.tar.xz/.tar.bz2 upstream release tarball",
        )
    members: dict[str, str] = {}
    for name in listing.stdout.splitlines():
        if name.endswith("/"):
            continue
        parts = PurePosixPath(name).parts
        if len(parts) > 1:
            members[str(PurePosixPath(*parts[1:]))] = name
    return members


def _write_atomically(path: Path, text: str) -> None:
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".part") as part:
        part.write(text)
    os.replace(part.name, path)


def _tar_extract(tarball: Path, names: list[str], dest: Path) -> None:
    """One tar pass that extracts ``names`` with the top folder stripped (as the build unpacks it)."""
    with tempfile.NamedTemporaryFile("w", suffix=".list") as listing:
        listing.write("\n".join(names) + "\n")
        listing.flush()
        result = subprocess.run(
            ["tar", "-xf", str(tarball), "-C", str(dest), "--strip-components=1", "--no-same-owner",
             "--verbatim-files-from", "-T", listing.name],
            capture_output=True,
            text=True,
        )
    if result.returncode != 0:
        raise SourceError(f"cannot extract from {tarball}: {result.stderr.strip()}")


# Where a release wheel keeps each upstream header folder (torch/include/<x> <- source path).
WHEEL_INCLUDE_ROOTS = (
    ("torch/include/torch/csrc/", "torch/csrc/"),
    ("torch/include/ATen/", "aten/src/ATen/"),
    ("torch/include/c10/", "c10/"),
    ("torch/include/caffe2/", "caffe2/"),
)


def _wheel_header_members(wheel: Path) -> dict[str, str]:
    members: dict[str, str] = {}
    with zipfile.ZipFile(wheel) as archive:
        for name in archive.namelist():
            for inside, source in WHEEL_INCLUDE_ROOTS:
                if name.startswith(inside) and not name.endswith("/"):
                    members[source + name[len(inside):]] = name
    return members


# NCCL states its version in make variables (NCCL_MAJOR := 2, ...), not in a version.txt.
NCCL_VERSION_FILE = "makefiles/version.mk"
NCCL_VERSION_PARTS = ("NCCL_MAJOR", "NCCL_MINOR", "NCCL_PATCH")


def stated_version(tree: SourceTree) -> tuple[str, str] | None:
    """The file a tree states its version in and that version, raw: ``version.txt`` (PyTorch and most
    projects), else NCCL's ``makefiles/version.mk`` (``2.30.7-1``); None when it has neither."""
    if tree.partial:
        return None
    text = tree.read_text("version.txt")
    if text:
        return "version.txt", text.strip()
    text = tree.read_text(NCCL_VERSION_FILE)
    if text:
        found = nccl_make_version(text)
        if found:
            return NCCL_VERSION_FILE, found
    return None


def nccl_make_version(text: str) -> str | None:
    """``MAJOR.MINOR.PATCH-PKG_REVISION`` from the text of NCCL's makefiles/version.mk, or None."""
    values = dict(re.findall(r"^[ \t]*(NCCL_\w+|PKG_REVISION)[ \t]*:?=[ \t]*(\S*)", text, flags=re.M))
    if not all(values.get(part, "").isdigit() for part in NCCL_VERSION_PARTS):
        return None
    release = ".".join(values[part] for part in NCCL_VERSION_PARTS)
    revision = values.get("PKG_REVISION", "")
    return f"{release}-{revision}" if revision else release


def tree_version(tree: SourceTree) -> str | None:
    """The version a tree says it is (see :func:`stated_version`), normalized, or None when it says none."""
    found = stated_version(tree)
    return normalize_version(found[1]) if found else None


def check_version(tree: SourceTree, expected: str) -> None:
    """Refuse a tree whose version file names another version than ``expected``."""
    found = stated_version(tree)
    if found is not None and normalize_version(found[1]) != normalize_version(expected):
        raise SourceError(
            f"{tree.location} is {tree.project} {found[1]} ({found[0]}), not {expected}",
            hint=f"pass the {expected} source tree, or check version {found[1]} instead",
        )


def open_given(path: Path, project: str) -> SourceTree:
    """A tree the user named with --source: a directory or a tarball; its version comes from version.txt."""
    path = path.expanduser().resolve()
    if path.is_dir():
        kind, detail = "directory", str(path)
    elif path.is_file() and path.name.endswith(TARBALL_SUFFIXES):
        kind, detail = "tarball", str(path)
    else:
        raise SourceError(
            f"--source {path} is neither a directory nor a tarball",
            hint="pass an unpacked upstream tree or its release tarball (.tar.gz, .tar.xz, ...)",
        )
    tree = SourceTree(project=project, version="", kind=kind, location=path, detail=detail)
    stated = stated_version(tree)
    tree.version = normalize_version(stated[1]) if stated else ""
    if stated and stated[0] == NCCL_VERSION_FILE:
        tree.project = "nccl"
    if not tree.version:
        raise SourceError(
            f"--source {path} has no version.txt (nor NCCL's {NCCL_VERSION_FILE}), so its version cannot be told",
            hint=f"pass the top folder of the upstream tree (the one holding version.txt or {NCCL_VERSION_FILE})",
        )
    return tree


@dataclass(frozen=True)
class ReleaseSource:
    """What the recipe says about one upstream version: its release tarball and checksum."""

    url: str | None
    sha256: str | None
    git: str | None = None
    rev: str | None = None


@dataclass
class Obtained:
    """The result of looking for one (project, version): a tree, and why every earlier place gave none."""

    tree: SourceTree | None
    attempts: list[str] = field(default_factory=list)

    @property
    def why_not(self) -> str:
        return "; ".join(self.attempts) or "no source was tried"


class SourceFinder:
    """Finds upstream trees in order: --source, the cache, the release tarball, Debian's source package."""

    def __init__(
        self,
        cache: Path,
        given: SourceTree | None = None,
        offline: bool = False,
        network_timeout: float = NETWORK_TIMEOUT,
        use_debian: bool = True,
    ) -> None:
        self.cache = cache
        self.given = given
        self.offline = offline
        self.network_timeout = network_timeout
        self.use_debian = use_debian
        self._unreachable_hosts: dict[str, str] = {}
        self._found: dict[tuple[str, str], Obtained] = {}

    def find(self, project: str, version: str, release: ReleaseSource | None = None) -> Obtained:
        """The first tree of ``project`` at ``version``; a tree of the wrong version is refused (SourceError)."""
        key = (project, version)
        if key not in self._found:
            self._found[key] = self._find(project, version, release or ReleaseSource(None, None))
        return self._found[key]

    def _find(self, project: str, version: str, release: ReleaseSource) -> Obtained:
        result = Obtained(tree=None)
        if self.given is not None and normalize_version(self.given.version) == normalize_version(version):
            result.tree = self.given
            return result
        for step in (self._from_cache, self._from_release, self._from_debian):
            tree = step(project, version, release, result.attempts)
            if tree is not None:
                check_version(tree, version)
                result.tree = tree
                return result
        return result

    def _from_cache(self, project: str, version: str, release: ReleaseSource, attempts: list[str]) -> SourceTree | None:
        unpacked = self.cache / "trees" / project / version
        if unpacked.is_dir():
            return SourceTree(project, version, "cache", unpacked, str(unpacked))
        if release.url:
            cached = self.cache / "tarballs" / _url_name(release.url)
            if cached.is_file():
                _verify_sha256(cached, release.sha256)
                return SourceTree(project, version, "cache", cached, f"{cached} (sha256 verified)",
                                  unpacked=self._unpacked(cached))
        attempts.append(f"not in the source cache ({self.cache})")
        return None

    def _from_release(self, project: str, version: str, release: ReleaseSource, attempts: list[str]) -> SourceTree | None:
        if not release.url and release.git:
            attempts.append(f"the recipe's source is git {release.git} @ {release.rev or 'HEAD'} (git is not fetched)")
            return None
        if not release.url:
            attempts.append("the recipe names no release tarball for this version")
            return None
        if not release.sha256:
            attempts.append(f"release tarball {release.url} has no sha256 in the recipe to check it against")
            return None
        if self.offline:
            attempts.append("release tarball not downloaded (offline)")
            return None
        host = urllib.parse.urlsplit(release.url).netloc
        if host in self._unreachable_hosts:
            attempts.append(f"release tarball unreachable: {self._unreachable_hosts[host]}")
            return None
        target = self.cache / "tarballs" / _url_name(release.url)
        try:
            _download(release.url, target, self.network_timeout)
        except (urllib.error.URLError, OSError, TimeoutError) as exc:
            reason = f"{host}: {getattr(exc, 'reason', exc)}"
            self._unreachable_hosts[host] = reason
            attempts.append(f"release tarball unreachable: {reason}")
            return None
        _verify_sha256(target, release.sha256)
        return SourceTree(project, version, "release tarball", target, f"{release.url} (sha256 verified)",
                          unpacked=self._unpacked(target))

    def _from_debian(self, project: str, version: str, release: ReleaseSource, attempts: list[str]) -> SourceTree | None:
        package = DEBIAN_SOURCE_PACKAGES.get(project)
        if package is None:
            attempts.append(f"Debian has no source package of {project} here")
            return None
        if not self.use_debian:
            attempts.append(f"Debian's {package} source package not consulted")
            return None
        debian = DebianSources(self.cache / "debian")
        found = debian.orig_tarball(package, version)
        if found.tarball is None:
            attempts.append(found.why_not)
            return None
        return SourceTree(
            project, version, "debian", found.tarball,
            f"Debian {package} {found.debian_version} ({found.tarball.name})",
            unpacked=self._unpacked(found.tarball),
        )

    def _unpacked(self, tarball: Path) -> Path:
        """Where files taken out of a verified tarball are kept (named by its name and size)."""
        return self.cache / "unpacked" / f"{tarball.name}-{tarball.stat().st_size}"


def _url_name(url: str) -> str:
    return PurePosixPath(urllib.parse.urlsplit(url).path).name


def _verify_sha256(path: Path, expected: str | None) -> None:
    if not expected:
        return
    actual = sha256_of(path)
    if actual != expected.lower():
        raise SourceError(
            f"{path} has sha256 {actual}, but the recipe says {expected}: refusing it",
            hint="the tarball is corrupt or not the release the recipe names; delete it and download it again",
        )


def _download(url: str, target: Path, timeout: float) -> None:
    """Download into a temporary file beside ``target`` and move it in place when complete."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 (https release URLs)
        with tempfile.NamedTemporaryFile(dir=target.parent, delete=False, suffix=".part") as part:
            shutil.copyfileobj(response, part)
    os.replace(part.name, target)


@dataclass(frozen=True)
class DebianOrig:
    """Debian's .orig tarball for one upstream version, or why there is none."""

    tarball: Path | None
    debian_version: str | None
    why_not: str = ""


class DebianSources:
    """Debian source packages, downloaded with ``apt-get source --download-only`` into one folder."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def listed_versions(self, package: str) -> list[str]:
        """The versions of ``package`` that apt's deb-src index lists."""
        result = subprocess.run(
            ["apt-cache", "showsrc", package], capture_output=True, text=True, check=False
        )
        return re.findall(r"^Version: (\S+)$", result.stdout, flags=re.MULTILINE)

    def orig_tarball(self, package: str, version: str) -> DebianOrig:
        """The .orig tarball of the Debian version whose upstream part is ``version`` (downloaded if needed)."""
        cached = self._cached(package, version)
        if cached is not None:
            return cached
        if shutil.which("apt-get") is None:
            return DebianOrig(None, None, "no apt-get on this machine to fetch Debian's source package")
        listed = self.listed_versions(package)
        matching = [v for v in listed if upstream_part(v) == version]
        if not matching:
            shown = ", ".join(listed) if listed else "none (no deb-src line, or run apt-get update)"
            return DebianOrig(None, None, f"Debian's source index lists {package} {shown}; not {version}")
        debian_version = matching[-1]
        self.folder.mkdir(parents=True, exist_ok=True)
        # One download at a time per cache: apt-get writes the files in place, and a second process
        # (another check, a parallel test worker) would read or overwrite them half-written.
        with open(self.folder / ".download.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            cached = self._cached(package, version)
            if cached is not None:
                return cached
            download = subprocess.run(
                ["apt-get", "source", "--download-only", "-q", f"{package}={debian_version}"],
                cwd=self.folder, capture_output=True, text=True, timeout=APT_TIMEOUT,
            )
            if download.returncode != 0:
                output = download.stdout + download.stderr
                if "404" in output:
                    return DebianOrig(
                        None, debian_version,
                        f"Debian lists {package} {debian_version} but does not serve its files (404 Not Found)",
                    )
                last = [line for line in output.splitlines() if line.startswith("E:")] or output.splitlines()[-1:]
                return DebianOrig(None, debian_version, f"apt-get source {package}={debian_version} failed: {' '.join(last)}")
            cached = self._cached(package, version)
            return cached or DebianOrig(None, debian_version, f"apt-get source {package}={debian_version} left no .orig tarball")

    def _cached(self, package: str, version: str) -> DebianOrig | None:
        """A downloaded .dsc of that upstream version whose .orig tarball is present and matches its checksum."""
        for dsc in sorted(self.folder.glob(f"{package}_*.dsc")):
            fields = parse_dsc(dsc)
            debian_version = fields.get("version", "")
            if upstream_part(debian_version) != version:
                continue
            for name, checksum in fields["sha256"].items():
                if ".orig." in name and (self.folder / name).is_file():
                    tarball = self.folder / name
                    if sha256_of(tarball) != checksum:
                        raise SourceError(
                            f"{tarball} does not match the sha256 in {dsc.name}: refusing it",
                            hint=f"delete {tarball} and run the command again to download it anew",
                        )
                    return DebianOrig(tarball, debian_version)
        return None


def upstream_part(debian_version: str) -> str:
    """The upstream release in a Debian version: ``1:2.6.0+dfsg-7`` -> ``2.6.0``."""
    without_epoch = debian_version.split(":", 1)[-1]
    without_revision = without_epoch.rsplit("-", 1)[0] if "-" in without_epoch else without_epoch
    return normalize_version(re.split(r"[+~]", without_revision)[0])


def parse_dsc(dsc: Path) -> dict:
    """The Version and the Checksums-Sha256 file list of a Debian .dsc file."""
    fields: dict = {"sha256": {}}
    section = None
    for line in dsc.read_text(errors="replace").splitlines():
        if line.startswith("Version:"):
            fields["version"] = line.split(":", 1)[1].strip()
        if line.startswith("Checksums-Sha256:"):
            section = "sha256"
            continue
        if section == "sha256":
            if line.startswith(" "):
                checksum, _size, name = line.split()
                fields["sha256"][name] = checksum
            else:
                section = None
    return fields


# macOS arm64 wheels: up to 2.11 tagged macosx_11_0, from 2.12 on macosx_14_0 (seen on PyPI: 2.14.1 and
# 2.15.0 have only macosx_14_0_arm64 wheels). pip picks whichever the release has. They are the smallest
# wheels that carry the release's source headers (for reading and porting patches to header files).
HEADER_WHEEL_PLATFORMS = ("macosx_14_0_arm64", "macosx_11_0_arm64")
# The Linux x86-64 (CUDA) wheels: manylinux1 up to 2.6, manylinux_2_28 after (2.11.0 to 2.15.0 seen). Their
# generated headers are those of the build the recipes make, which the macOS ones are not (docs/howto/newer-pytorch.md).
LINUX_WHEEL_PLATFORMS = ("manylinux_2_28_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")


def wheel_headers(
    cache: Path, version: str, platforms: tuple[str, ...] = HEADER_WHEEL_PLATFORMS, python: str = "3.11"
) -> SourceTree:
    """The headers of the PyTorch ``version`` release wheel (downloaded once into the cache with pip).

    macOS arm64 wheels are the smallest that carry ``torch/include`` (about 66 MB for 2.6.0, 139 MB for
    2.15.0, against several hundred MB for the Linux CUDA wheel); the headers are the same source files.
    """
    folder = cache / "wheels"
    wheel = cached_wheel(folder, "torch", version, platforms)
    if wheel is None:
        folder.mkdir(parents=True, exist_ok=True)
        platform_options = [word for platform in platforms for word in ("--platform", platform)]
        # The exact release is asked for, to read its headers: a pip constraints file of this machine
        # (e.g. a cap on the torch that may be installed) is about installs, not this download.
        env = dict(os.environ, PIP_CONSTRAINT=os.devnull)
        result = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", *platform_options,
             "--python-version", python, "-d", str(folder), f"torch=={version}"],
            capture_output=True, text=True, env=env,
        )
        wheel = cached_wheel(folder, "torch", version, platforms)
        if result.returncode != 0 or wheel is None:
            raise SourceError(
                f"pip could not download the torch {version} wheel for {' or '.join(platforms)}: "
                f"{(result.stderr.strip().splitlines() or ['no output'])[-1]}",
                hint="check that PyPI is reachable and that this torch version exists",
            )
    return SourceTree("pytorch", version, "wheel headers", wheel, wheel.name, partial=True)


def cached_wheel(folder: Path, name: str, version: str, platforms: tuple[str, ...]) -> Path | None:
    """A wheel of ``name`` ``version`` in ``folder`` for one of ``platforms`` (its file name's platform tag)."""
    found = sorted(folder.glob(f"{name}-{version}-*.whl")) if folder.is_dir() else []
    return next((wheel for wheel in found if wheel.stem.rsplit("-", 1)[-1] in platforms), None)
