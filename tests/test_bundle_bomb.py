"""Decompression bombs: a package that holds more than its info/paths.json records is refused, having
written nothing, on every route that extracts one (issue 69).

The bomb is a genuine test package (tests/multi_env.py) with 8 MiB of zeros added as a file its
paths.json does not list: a few KiB more of archive. Bundles holding it are made by replacing the
genuine package inside a genuine bundle and its sha256, md5 and size in the bundle's lock, and are
anchored by their own sha256: what a packer who packed a bomb, or a channel that served one, hands on.
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
from channelsmith import bundle, channel, expansion
from channelsmith.deploy import deploy
from channelsmith.errors import ExpansionError
from channelsmith.lock import LOCK_NAME, lock_records
from test_bundle import _skip_without_unpack_tools, assert_failed_cleanly, multi_channel
from test_channel import run_cli

__all__ = ["multi_channel"]  # the module fixture, shared with test_bundle.py

ZEROS = 8 << 20
BOMB_FILE = "share/bomb/zeros.bin"


def _with_member(tar_bytes: bytes, name: str, size: int) -> bytes:
    """An uncompressed tar: ``tar_bytes``'s members and one more, ``name``, of ``size`` zeros."""
    out = io.BytesIO()
    with tarfile.open(fileobj=io.BytesIO(tar_bytes)) as source, tarfile.open(fileobj=out, mode="w") as tar:
        for member in source.getmembers():
            tar.addfile(member, source.extractfile(member) if member.isfile() else None)
        info = tarfile.TarInfo(name)
        info.size = size
        tar.addfile(info, io.BytesIO(bytes(size)))
    return out.getvalue()


def _zstd(data: bytes, *args: str) -> bytes:
    return subprocess.run(["zstd", "-q", *args], input=data, capture_output=True, check=True).stdout


def make_bomb(package: Path, into: Path, *, section: str = "pkg", name: str = BOMB_FILE, size: int = ZEROS) -> Path:
    """``package`` (a .conda or .tar.bz2) with ``size`` zeros more in ``section``, in a file its paths.json
    does not list; written under the same file name in ``into``."""
    into.mkdir(parents=True, exist_ok=True)
    bomb = into / package.name
    if package.name.endswith(".tar.bz2"):
        with tarfile.open(package, "r:bz2") as source, tarfile.open(bomb, "w:bz2") as tar:
            for member in source.getmembers():
                tar.addfile(member, source.extractfile(member) if member.isfile() else None)
            info = tarfile.TarInfo(name)
            info.size = size
            tar.addfile(info, io.BytesIO(bytes(size)))
        return bomb
    if shutil.which("zstd") is None:
        pytest.skip("zstd is not installed: no way to make a .conda bomb here")
    with zipfile.ZipFile(package) as source, zipfile.ZipFile(bomb, "w", zipfile.ZIP_STORED) as out:
        for item in source.infolist():
            data = source.read(item)
            if item.filename.startswith(f"{section}-"):
                data = _zstd(_with_member(_zstd(data, "-dc"), name, size), "-c")
            out.writestr(zipfile.ZipInfo(item.filename, item.date_time), data)  # stored, no stale extra fields
    return bomb


def _digests(path: Path) -> tuple[str, str, int]:
    data = path.read_bytes()
    return hashlib.sha256(data).hexdigest(), hashlib.md5(data).hexdigest(), len(data)


def _repinned(text: str, genuine: Path, bomb: Path) -> str:
    """A lock's (or repodata's) text with the genuine package's sha256, md5 and size replaced by the bomb's."""
    (old_sha, old_md5, old_size), (new_sha, new_md5, new_size) = _digests(genuine), _digests(bomb)
    assert old_sha in text
    text = text.replace(old_sha, new_sha).replace(old_md5, new_md5)
    block = text.index(new_sha)
    size_at = text.index(f"size: {old_size}\n", block)
    return text[:size_at] + f"size: {new_size}\n" + text[size_at + len(f"size: {old_size}\n") :]


def bomb_bundle(genuine_tar: Path, genuine: Path, bomb: Path, into: Path) -> tuple[Path, str]:
    """``genuine_tar`` with ``bomb`` in place of the package ``genuine`` and its lock pinning the bomb;
    (the bundle, its sha256)."""
    with tarfile.open(genuine_tar) as source, tarfile.open(into, "w") as out:
        for member in source.getmembers():
            data = source.extractfile(member).read() if member.isfile() else None
            if member.name.endswith(f"/{genuine.name}"):
                data = bomb.read_bytes()
            elif member.name == LOCK_NAME:
                data = _repinned(data.decode(), genuine, bomb).encode()
            if data is not None:
                member.size = len(data)
            out.addfile(member, io.BytesIO(data) if data is not None else None)
    return into, channel.sha256_of(into)


def _package(channel_dir: Path, name: str) -> Path:
    (found,) = [p for p in channel_dir.rglob(f"{name}-*") if p.name.endswith((".conda", ".tar.bz2"))]
    return found


@pytest.fixture(scope="module", params=["conda", "tar.bz2"])
def bombed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, multi_channel: Path) -> dict:
    """A genuine one-package environment (libgreet, a .conda; oldformat, a .tar.bz2), its bundle, the bomb
    made of its package, a bundle and a lock pinning the bomb, and a channel holding it."""
    name = {"conda": "libgreet", "tar.bz2": "oldformat"}[request.param]
    work = tmp_path_factory.mktemp(f"bomb-{request.param}")
    genuine_channel = work / "channel"
    shutil.copytree(multi_channel, genuine_channel)
    genuine = _package(genuine_channel, name)
    lock = deploy([name], prefix=work / "genuine", channel_dir=genuine_channel).lock_file
    packed = bundle.pack(lock, work / "genuine.tar", cache_dir=work / "cache")
    bomb = make_bomb(genuine, work / "bomb")
    tar, digest = bomb_bundle(packed.bundle, genuine, bomb, work / "bomb.tar")
    # A channel where the bomb lies in the genuine package's place, and a lock pinning it there.
    bombed_channel = work / "bombed-channel"
    shutil.copytree(genuine_channel, bombed_channel)
    shutil.copyfile(bomb, _package(bombed_channel, name))
    bombed_lock = work / "bombed.lock"
    moved = lock.read_text().replace(str(genuine_channel), str(bombed_channel))
    bombed_lock.write_text(_repinned(moved, genuine, bomb))
    return {"name": name, "genuine": genuine, "bomb": bomb, "tar": tar, "sha256": digest, "lock": bombed_lock,
            "recorded": expansion.check_expansion(genuine).recorded}  # fmt: skip


def test_the_bomb_is_small_and_expands_far_past_its_record(bombed: dict) -> None:
    """The crafted bomb is what the tests below refuse: a few KiB more archive, 8 MiB more files, pinned by
    its own sha256 (so that the refusals below are by size, not by digest)."""
    _platform, records = lock_records(bombed["lock"])
    (record,) = [r for r in records if r.name.normalized == bombed["name"]]
    assert record.sha256.hex() == _digests(bombed["bomb"])[0]
    grown = bombed["bomb"].stat().st_size - bombed["genuine"].stat().st_size
    assert grown < 64 << 10, grown
    with pytest.raises(ExpansionError) as refused:
        expansion.check_expansion(bombed["bomb"])
    said = str(refused.value)
    assert f"the package {bombed['bomb'].name} expands past what it records" in said, said
    assert f"its files hold more than the {bombed['recorded']} bytes its info/paths.json records" in said, said
    assert "a decompression bomb" in said and "nothing of it was extracted" in said, said


def test_deploy_bundle_refuses_a_bomb_and_leaves_nothing(
    bombed: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir(mode=0o700)
    prefix = tmp_path / "a" / "env"
    code, err = run_cli(capsys, "deploy", "--bundle", str(bombed["tar"]), "--sha256", bombed["sha256"],
                        "--prefix", str(prefix))  # fmt: skip
    assert code == 2, err
    assert f"the package {bombed['bomb'].name} expands past what it records" in err, err
    assert f"more than the {bombed['recorded']} bytes its info/paths.json records" in err, err
    assert "hint: do not install it" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tmp"] and not any((tmp_path / "tmp").iterdir())


def test_unpack_sh_refuses_a_bomb_before_writing_anything(bombed: dict, tmp_path: Path) -> None:
    _skip_without_unpack_tools()
    with tarfile.open(bombed["tar"]) as tar:
        # Read, not extract(filter=...): Debian 12's Python 3.11.2 has no extraction filters.
        (tmp_path / "unpack.sh").write_bytes(tar.extractfile("unpack.sh").read())
    (tmp_path / "unpack.sh").chmod(0o755)
    scratch = tmp_path / "tmp"
    scratch.mkdir(mode=0o700)
    prefix = tmp_path / "a" / "env"
    done = subprocess.run(
        ["sh", str(tmp_path / "unpack.sh"), "--bundle", str(bombed["tar"]), "--sha256", bombed["sha256"], str(prefix)],
        capture_output=True, text=True, env={"PATH": "/usr/bin:/bin", "TMPDIR": str(scratch)},
    )  # fmt: skip
    assert_failed_cleanly(done, f"the package {bombed['bomb'].name} expands past what it records: its payload "
                                "decompresses to more than")  # fmt: skip
    assert "(counted without writing it); nothing was installed (a decompression bomb" in " ".join(done.stderr.split())
    assert not (tmp_path / "a").exists() and not any(scratch.iterdir())


def test_the_bound_unpack_sh_counts_against_holds_every_genuine_package(multi_channel: Path) -> None:
    """pack's bound for unpack.sh is at least what each genuine payload tar decompresses to, and far below 8 MiB."""
    packages = [p for p in multi_channel.rglob("*") if p.name.endswith((".conda", ".tar.bz2"))]
    assert any(p.name.endswith(".tar.bz2") for p in packages) and any(p.name.endswith(".conda") for p in packages)
    if shutil.which("zstd") is None:
        pytest.skip("zstd is not installed: the payload tars of .conda packages cannot be measured")
    for package in packages:
        measured = expansion.check_expansion(package)
        if package.name.endswith(".tar.bz2"):
            payload = len(subprocess.run(["bzip2", "-dc", str(package)], capture_output=True, check=True).stdout)
        else:
            with zipfile.ZipFile(package) as archive:
                (member,) = [n for n in archive.namelist() if n.startswith("pkg-")]
                payload = len(_zstd(archive.read(member), "-dc"))
        assert measured.files <= measured.recorded, package.name  # a symlink's recorded size is its target's
        assert payload <= measured.tar_bound < payload + (1 << 20) < ZEROS, (package.name, payload, measured)


def test_pack_refuses_a_lock_pinning_a_bomb(bombed: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "out").mkdir()
    code, err = run_cli(capsys, "pack", "--lock", str(bombed["lock"]), "-o", str(tmp_path / "out" / "env.tar"),
                        "--cache-dir", str(tmp_path / "cache"))  # fmt: skip
    assert code == 2 and f"the package {bombed['bomb'].name} expands past what it records" in err, err
    assert not any((tmp_path / "out").iterdir())


def test_deploy_lock_refuses_a_bomb_in_a_local_channel_before_extracting_it(
    bombed: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RATTLER_CACHE_DIR", str(tmp_path / "cache"))  # cold: py-rattler would extract it
    prefix = tmp_path / "env"
    code, err = run_cli(capsys, "deploy", "--lock", str(bombed["lock"]), "--prefix", str(prefix))
    assert code == 2 and f"the package {bombed['bomb'].name} expands past what it records" in err, err
    assert not list(tmp_path.glob(f"cache/pkgs/{bombed['name']}-*"))  # py-rattler extracted nothing of it
    assert not prefix.exists() or not any(prefix.iterdir())


def test_publish_refuses_a_bomb(bombed: dict, tmp_path: Path) -> None:
    with pytest.raises(ExpansionError, match="expands past what it records"):
        channel.publish(tmp_path / "channel", [bombed["bomb"]])
    assert not list((tmp_path / "channel").rglob(bombed["bomb"].name))


def test_a_bomb_in_info_is_refused_at_the_info_limit(
    multi_channel: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """info/ has no record: its files are bounded by INFO_LIMIT (lowered here, so that the bomb stays small)."""
    monkeypatch.setattr(expansion, "INFO_LIMIT", 1 << 20)
    bomb = make_bomb(_package(multi_channel, "libgreet"), tmp_path, section="info", name="info/zeros.bin", size=2 << 20)
    with pytest.raises(ExpansionError, match=r"its info/ files hold more than 1048576 bytes"):
        expansion.check_expansion(bomb)



# An honest bomb: 8 MiB of zeros its paths.json records, a few KiB of archive; installed on a 4 MiB tmpfs,
# mounted in a mount namespace of the test's own (as test_bundle.py's full-disk test does).
ZEROS_RECIPE = """
package: {name: zeros, version: "1.0.0"}
build:
  number: 0
  noarch: generic
  script:
    - mkdir -p $PREFIX/share/zeros
    - head -c 8388608 /dev/zero > $PREFIX/share/zeros/zeros.bin
about: {license: Apache-2.0, summary: channelsmith test package zeros}
"""

SMALL_DISK = r"""
set -u
mount -t tmpfs -o size=4m channelsmith-test "$SMALL" || exit 77
mkdir -m 700 "$SMALL/tmp" "$SMALL/cache"
"$PYTHON" -m channelsmith deploy --bundle "$BUNDLE" --sha256 "$HEX" --prefix "$SMALL/bundle-env" 2>"$ERR/bundle"
echo "bundle=$?"
export RATTLER_CACHE_DIR="$SMALL/cache"
"$PYTHON" -m channelsmith deploy --lock "$LOCK" --prefix "$SMALL/lock-env" 2>"$ERR/lock"
echo "lock=$?"
TMPDIR="$SMALL/tmp" sh "$UNPACK" --bundle "$BUNDLE" --sha256 "$HEX" "$SMALL/sh-env" 2>"$ERR/sh"
echo "sh=$?"
echo "left=$(ls -A "$SMALL" | tr '\n' ' ')"
echo "cached=$(find "$SMALL/cache" "$SMALL/tmp" -mindepth 1 ! -path "$SMALL/cache/pkgs" | tr '\n' ' ')"
"""


def _build(recipe: str, work: Path) -> Path:
    """The one package py-rattler-build makes of ``recipe``, offline."""
    from multi_env import build_packages

    (package,) = build_packages(recipe, work)
    return package


EMPTY_FILE_RECIPE = """
package: {name: with-empty, version: "1.0.0"}
build:
  number: 0
  noarch: generic
  script:
    - mkdir -p $PREFIX/share/with-empty
    - touch $PREFIX/share/with-empty/empty
    - echo hello > $PREFIX/share/with-empty/hello
about: {license: Apache-2.0, summary: channelsmith test package with an empty file}
"""


def test_an_empty_file_is_recorded_as_empty_and_a_bomb_in_its_place_refused(tmp_path: Path) -> None:
    """rattler-build leaves out an empty file's size: it counts as 0 (not as a paths.json without sizes, which
    would be bounded by 100 times the archive's size), so zeros written over that file's name are refused."""
    package = _build(EMPTY_FILE_RECIPE, tmp_path)
    measured = expansion.check_expansion(package)
    assert measured.recorded == measured.files == len(b"hello\n"), measured
    bomb = make_bomb(package, tmp_path / "bomb", name="share/with-empty/empty", size=1 << 20)
    with pytest.raises(ExpansionError, match=r"more than the 6 bytes its info/paths.json records .* in share/with-emp"):
        expansion.check_expansion(bomb)


def test_packages_that_record_more_than_the_disk_holds_are_refused_before_extraction(tmp_path: Path) -> None:
    if shutil.which("unshare") is None:
        pytest.skip("unshare (util-linux) is not installed: no namespace to mount a small tmpfs in")
    _skip_without_unpack_tools()
    package = _build(ZEROS_RECIPE, tmp_path)
    assert package.stat().st_size < 64 << 10 and expansion.check_expansion(package).recorded == ZEROS
    channel.publish(tmp_path / "channel", [package])
    lock = deploy(["zeros"], prefix=tmp_path / "deployed", channel_dir=tmp_path / "channel").lock_file
    packed = bundle.pack(lock, tmp_path / "env.tar", cache_dir=tmp_path / "cache")
    with tarfile.open(packed.bundle) as tar:
        # Read, not extract(filter=...): Debian 12's Python 3.11.2 has no extraction filters.
        (tmp_path / "unpack.sh").write_bytes(tar.extractfile("unpack.sh").read())
    (tmp_path / "unpack.sh").chmod(0o755)
    small, errors = tmp_path / "small", tmp_path / "errors"
    small.mkdir()
    errors.mkdir()
    env = {**os.environ, "SMALL": str(small), "ERR": str(errors), "PYTHON": sys.executable,
           "BUNDLE": str(packed.bundle), "HEX": packed.sha256, "LOCK": str(lock),
           "UNPACK": str(tmp_path / "unpack.sh")}  # fmt: skip
    done = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", SMALL_DISK],
                          capture_output=True, text=True, env=env)  # fmt: skip
    if done.returncode == 77 or (done.returncode != 0 and "unshare" in done.stderr):
        pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.strip()}")
    results_ = dict(line.split("=", 1) for line in done.stdout.splitlines())
    said = {name: " ".join((errors / name).read_text().split()) for name in ("bundle", "lock", "sh")}
    assert (results_["bundle"], results_["lock"], results_["sh"]) == ("3", "3", "2"), (results_, said)
    for route in ("bundle", "lock"):
        assert "the packages to install expand to 8.0 MiB (as their info/paths.json records)" in said[route], said
        assert "MiB free: nothing was extracted" in said[route] and "hint: free space there" in said[route], said
    assert "the packages need " in said["sh"] and "as their info/paths.json records them" in said["sh"], said
    assert "KiB free: nothing was installed" in said["sh"], said
    assert "hint: check free space" in said["sh"], said
    # No prefix, no scratch folder, nothing in the cache.
    assert results_["left"].split() == ["cache", "tmp"] and results_["cached"] == "", results_
