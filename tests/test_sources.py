"""Obtaining upstream trees: the cache, release tarballs (sha256), Debian's source packages, version.txt."""

from __future__ import annotations

import hashlib
import os
import subprocess
import tarfile
import threading
import time
from pathlib import Path

import pytest

from channelsmith.errors import SourceError
from channelsmith.sources import (
    DebianSources,
    ReleaseSource,
    SourceFinder,
    check_version,
    normalize_version,
    open_given,
    upstream_part,
)


def make_tarball(tmp_path: Path, version_txt: str, files: dict[str, str]) -> Path:
    """A release-style tarball: everything under one top folder, as GitHub's release tarballs are."""
    top = tmp_path / "src" / "pytorch-vX"
    for rel, text in {"version.txt": version_txt, **files}.items():
        (top / rel).parent.mkdir(parents=True, exist_ok=True)
        (top / rel).write_text(text)
    tarball = tmp_path / "pytorch-v2.6.0.tar.gz"
    with tarfile.open(tarball, "w:gz") as archive:
        archive.add(top, arcname="pytorch-v2.6.0")
    return tarball


def test_versions_are_normalized() -> None:
    assert normalize_version("2.6.0a0\n") == "2.6.0"
    assert normalize_version("v2.4.0") == "2.4.0"
    assert upstream_part("2.6.0+dfsg-7") == "2.6.0"
    assert upstream_part("1:2.14.1+dfsg-1") == "2.14.1"
    assert upstream_part("0.0~git20230113.6481e8b-1") == "0.0"


def test_cached_tarball_with_matching_sha256_is_used_and_unpacks_only_what_is_asked(tmp_path: Path) -> None:
    tarball = make_tarball(tmp_path, "2.6.0a0\n", {"torch/a.cpp": "a\n", "torch/b.cpp": "b\n"})
    cache = tmp_path / "cache"
    (cache / "tarballs").mkdir(parents=True)
    cached = cache / "tarballs" / tarball.name
    cached.write_bytes(tarball.read_bytes())
    sha = hashlib.sha256(tarball.read_bytes()).hexdigest()
    url = f"https://example.invalid/{tarball.name}"
    found = SourceFinder(cache, offline=True).find("pytorch", "2.6.0", ReleaseSource(url, sha))
    assert found.tree is not None and found.tree.kind == "cache"
    assert found.tree.extract(["torch/a.cpp", "torch/missing.cpp"], tmp_path / "out") == {"torch/a.cpp"}
    assert (tmp_path / "out" / "torch" / "a.cpp").read_text() == "a\n"
    assert not (tmp_path / "out" / "torch" / "b.cpp").exists()


def test_cached_tarball_with_wrong_sha256_is_refused(tmp_path: Path) -> None:
    tarball = make_tarball(tmp_path, "2.6.0\n", {})
    (tmp_path / "cache" / "tarballs").mkdir(parents=True)
    (tmp_path / "cache" / "tarballs" / tarball.name).write_bytes(tarball.read_bytes())
    finder = SourceFinder(tmp_path / "cache", offline=True)
    with pytest.raises(SourceError, match="refusing it"):
        finder.find("pytorch", "2.6.0", ReleaseSource(f"https://example.invalid/{tarball.name}", "1" * 64))


def test_cached_tree_of_the_wrong_version_is_refused(tmp_path: Path) -> None:
    tree = tmp_path / "cache" / "trees" / "pytorch" / "2.6.0"
    tree.mkdir(parents=True)
    (tree / "version.txt").write_text("2.5.1\n")
    with pytest.raises(SourceError, match="2.5.1"):
        SourceFinder(tmp_path / "cache", offline=True, use_debian=False).find("pytorch", "2.6.0")


def test_given_tarball_version_comes_from_version_txt(tmp_path: Path) -> None:
    given = open_given(make_tarball(tmp_path, "2.4.0a0\n", {}), "pytorch")
    assert given.version == "2.4.0"
    with pytest.raises(SourceError, match="not 2.6.0"):
        check_version(given, "2.6.0")


def test_given_directory_without_version_txt_is_refused(tmp_path: Path) -> None:
    (tmp_path / "tree").mkdir()
    with pytest.raises(SourceError, match="version.txt"):
        open_given(tmp_path / "tree", "pytorch")


def test_unreachable_release_host_is_reported_quickly(tmp_path: Path) -> None:
    finder = SourceFinder(tmp_path / "cache", use_debian=False, network_timeout=3)
    started = time.monotonic()
    found = finder.find("pytorch", "2.6.0", ReleaseSource("https://release.invalid/pytorch-v2.6.0.tar.gz", "2" * 64))
    assert found.tree is None
    assert "release tarball unreachable: release.invalid" in found.why_not
    assert time.monotonic() - started < 10


def _debian_lists(version_prefix: str) -> bool:
    listing = subprocess.run(["apt-cache", "showsrc", "pytorch"], capture_output=True, text=True)
    return f"Version: {version_prefix}" in listing.stdout


@pytest.mark.skipif(not _debian_lists("2.14.1"), reason="apt's deb-src index does not list pytorch 2.14.1")
def test_debian_version_listed_but_not_served_is_detected(tmp_path: Path) -> None:
    found = DebianSources(tmp_path / "debian").orig_tarball("pytorch", "2.14.1")
    assert found.tarball is None
    assert "does not serve its files (404" in found.why_not


@pytest.mark.skipif(not _debian_lists("2.6.0"), reason="apt's deb-src index does not list pytorch 2.6.0")
def test_debian_index_without_the_version_says_which_it_has(tmp_path: Path) -> None:
    found = DebianSources(tmp_path / "debian").orig_tarball("pytorch", "2.4.0")
    assert found.tarball is None
    assert "2.6.0+dfsg" in found.why_not and "not 2.4.0" in found.why_not


APT_GET_STUB = """#!/usr/bin/env bash
# Stands in for `apt-get source --download-only`: writes the .orig in two steps, then the .dsc.
set -euo pipefail
echo run >> "$STUB_LOG"
printf 'half' > demo_1.0.orig.tar.xz
sleep 1
printf 'half and the rest' > demo_1.0.orig.tar.xz
sum="$(sha256sum demo_1.0.orig.tar.xz | cut -d' ' -f1)"
printf 'Version: 1.0-1\\nChecksums-Sha256:\\n %s 17 demo_1.0.orig.tar.xz\\n' "$sum" > demo_1.0-1.dsc
"""


def test_two_processes_needing_one_debian_source_download_it_once(tmp_path: Path, monkeypatch) -> None:
    """Two checks (or two parallel test workers) on one cache: the second waits for the first's
    download instead of running apt-get over the files it is writing."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    (stubs / "apt-get").write_text(APT_GET_STUB)
    (stubs / "apt-cache").write_text("#!/usr/bin/env bash\necho 'Version: 1.0-1'\n")
    for stub in stubs.iterdir():
        stub.chmod(0o755)
    monkeypatch.setenv("PATH", f"{stubs}:{os.environ['PATH']}")
    monkeypatch.setenv("STUB_LOG", str(tmp_path / "runs"))
    found = []
    threads = [
        threading.Thread(target=lambda: found.append(DebianSources(tmp_path / "debian").orig_tarball("demo", "1.0")))
        for _ in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert (tmp_path / "runs").read_text().split() == ["run"]
    assert [f.tarball for f in found] == [tmp_path / "debian" / "demo_1.0.orig.tar.xz"] * 2
