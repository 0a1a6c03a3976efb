"""The bundle's layout: the names both sides share, pack writing them and an install (or unpack.sh) reading them.

A bundle is the layout pixi-pack writes and pixi-unpack reads (matched against pixi-pack 0.7.10,
tag v0.7.10: src/lib.rs, src/pack.rs, src/unpack.rs), an uncompressed tar holding::

    pixi-pack.json                  {"version": "1", "platform": "linux-64"} (format version "1")
    environment.yml                 the packages as NAME=VERSION=BUILD, for conda/micromamba
    channel/<subdir>/*.conda        every package the lock pins, byte for byte
    channel/<subdir>/repodata.json  the lock's records of them (noarch/ always, as conda clients need)

plus channelsmith's own members, which pixi-unpack ignores:

    channelsmith.lock               the packed lock, copied unchanged into the installed prefix
    unpack.sh                       a POSIX installer for nodes without channelsmith or pixi-unpack
    channelsmith-unpack/            what unpack.sh reads: a file list, conda-meta records

unpack.sh lies beside this module (package data): pack copies it into every bundle.
"""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

from rattler import RepoDataRecord

from channelsmith.bundle.anchors import SignatureVerifier

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

BLOCK = 1 << 20


def package_member(record: RepoDataRecord) -> str:
    """Where a bundle holds the package a lock record pins: channel/<subdir>/<file name>."""
    return f"{CHANNEL_NAME}/{record.subdir}/{record.file_name}"


def package_stem(file_name: str) -> str:
    """A package file's name without its .conda or .tar.bz2 suffix."""
    return file_name.removesuffix(".conda").removesuffix(".tar.bz2")


class HashingReader:
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


def unpack_script_path() -> Path:
    """The POSIX unpack.sh that ships inside every bundle, as installed beside this module."""
    return Path(__file__).parent / UNPACK_SCRIPT


def unpack_script() -> bytes:
    """The POSIX unpack.sh that ships inside every bundle."""
    return unpack_script_path().read_bytes()
