"""Bombs the expansion count must not miss: tar members py-rattler's stream does not call files but its
extraction writes as files, zip members beside a .conda's two sections that its extraction unpacks too, and
a bomb that shares a cached package's name, version and build (issue 69).

Each crafted package is a genuine test package (tests/multi_env.py) with 8 MiB of zeros added in one such
place; py-rattler's extraction (what deploy's package cache runs) writes those zeros, so each must be
refused before it runs.
"""

from __future__ import annotations

import io
import shutil
import subprocess
import tarfile
import tempfile
import warnings
import zipfile
from pathlib import Path

import pytest
from channelsmith import expansion
from channelsmith.deploy import deploy
from channelsmith.errors import ChannelError, DeployError, ExpansionError
from rattler.package_streaming import extract
from test_bundle import multi_channel
from test_bundle_bomb import ZEROS, _package, bombed, make_bomb
from test_channel import run_cli

__all__ = ["bombed", "multi_channel"]  # module fixtures, shared with test_bundle.py and test_bundle_bomb.py


def _zstd(data: bytes, *args: str) -> bytes:
    if shutil.which("zstd") is None:
        pytest.skip("zstd is not installed: no way to make a .conda bomb here")
    return subprocess.run(["zstd", "-q", *args], input=data, capture_output=True, check=True).stdout


def _tar_with(tar_bytes: bytes, kind: bytes) -> bytes:
    """An uncompressed tar: ``tar_bytes``'s members and ZEROS zeros more in a member of tar type ``kind``."""
    if kind == tarfile.GNUTYPE_SPARSE:
        return _tar_with_sparse(tar_bytes)
    out = io.BytesIO()
    with tarfile.open(fileobj=io.BytesIO(tar_bytes)) as source, tarfile.open(fileobj=out, mode="w") as tar:
        for member in source.getmembers():
            tar.addfile(member, source.extractfile(member) if member.isfile() else None)
        info = tarfile.TarInfo("share/bomb/zeros.bin")
        info.type, info.size = kind, ZEROS
        tar.addfile(info, io.BytesIO(bytes(ZEROS)))  # tarfile writes the data whatever the type
    return out.getvalue()


def _zeros_tar() -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        info = tarfile.TarInfo("share/bomb/zeros.bin")
        info.size = ZEROS
        tar.addfile(info, io.BytesIO(bytes(ZEROS)))
    return out.getvalue()


def _sparse_entry(name: str, size: int) -> bytes:
    """A GNU sparse member (type 'S', which tarfile reads but does not write) of ``size`` bytes, all a hole
    but its last 512; tar headers and data blocks, without the archive's end."""
    info = tarfile.TarInfo(name)
    info.type, info.size = tarfile.GNUTYPE_SPARSE, 512
    header = bytearray(info.tobuf(format=tarfile.GNU_FORMAT))
    # The old GNU header's sparse map: its first (offset, bytes) pair at 386, the file's real size at 483.
    header[386:410] = b"%011o\0%011o\0" % (size - 512, 512)
    header[483:495] = b"%011o\0" % size
    header[148:156] = b"        "
    header[148:156] = b"%06o\0 " % sum(header)
    return bytes(header) + b"x" * 512


def _tar_with_sparse(tar_bytes: bytes) -> bytes:
    """``tar_bytes``'s members and a sparse one of ZEROS bytes, then the archive's end."""
    out = io.BytesIO()
    with tarfile.open(fileobj=io.BytesIO(tar_bytes)) as source:
        tar = tarfile.open(fileobj=out, mode="w", format=tarfile.GNU_FORMAT)
        for member in source.getmembers():
            tar.addfile(member, source.extractfile(member) if member.isfile() else None)
        members = out.getvalue()[: tar.offset]
    return members + _sparse_entry("share/bomb/sparse.bin", ZEROS) + bytes(1024)


def _typed_bomb(package: Path, into: Path, kind: bytes) -> Path:
    """``package`` with ZEROS zeros in a payload member of tar type ``kind``, under the same name in ``into``."""
    into.mkdir(parents=True)
    bomb = into / package.name
    if package.name.endswith(".tar.bz2"):
        tar_bytes = subprocess.run(["bzip2", "-dc", str(package)], capture_output=True, check=True).stdout
        bomb.write_bytes(subprocess.run(["bzip2", "-c"], input=_tar_with(tar_bytes, kind), capture_output=True,
                                        check=True).stdout)  # fmt: skip
        return bomb
    with zipfile.ZipFile(package) as source, zipfile.ZipFile(bomb, "w", zipfile.ZIP_STORED) as out:
        for item in source.infolist():
            data = source.read(item)
            if item.filename.startswith("pkg-"):
                data = _zstd(_tar_with(_zstd(data, "-dc"), kind), "-c")
            out.writestr(zipfile.ZipInfo(item.filename, item.date_time), data)
    return bomb


def _member_bomb(package: Path, into: Path, member: str, *, hidden: bool = False) -> Path:
    """``package`` (a .conda) with one zip member more, ``member`` (STEM: the package's stem), a zstd tar of
    ZEROS zeros; ``hidden``: left out of the zip's central directory (its local header and data stay)."""
    into.mkdir(parents=True)
    bomb = into / package.name
    stem = package.name[: -len(".conda")]
    zeros = _zstd(_zeros_tar(), "-c")
    with zipfile.ZipFile(package) as source, zipfile.ZipFile(bomb, "w", zipfile.ZIP_STORED) as out:
        for item in source.infolist():
            out.writestr(zipfile.ZipInfo(item.filename, item.date_time), source.read(item))
        extra = zipfile.ZipInfo(member.replace("STEM", stem), (2020, 1, 1, 0, 0, 0))
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Duplicate name", UserWarning)  # the second pkg- section, on purpose
            out.writestr(extra, zeros)  # after the genuine members: the stream reads the first pkg- member
        if hidden:
            out.filelist.remove(extra)
    return bomb


def _extracted_bytes(package: Path) -> int:
    """What py-rattler's extraction (the one its package cache runs) writes of ``package``: file bytes."""
    with tempfile.TemporaryDirectory() as into:
        extract(package, into)
        return sum(p.stat().st_size for p in Path(into).rglob("*") if p.is_file() and not p.is_symlink())


KINDS = {"contiguous": tarfile.CONTTYPE, "unknown-type": b"Z", "fifo": tarfile.FIFOTYPE, "char-device": tarfile.CHRTYPE,
         "sparse": tarfile.GNUTYPE_SPARSE}  # fmt: skip
MEMBERS = {"third": ("evil-STEM.tar.zst", False), "second-pkg": ("pkg-STEM.tar.zst", False),
           "in-a-folder": ("x/pkg-STEM.tar.zst", False), "hidden": ("evil-STEM.tar.zst", True)}  # fmt: skip


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fmt", ["conda", "tar.bz2"])
def test_zeros_in_a_member_of_another_tar_type_are_refused(
    kind: str, fmt: str, multi_channel: Path, tmp_path: Path
) -> None:
    """py-rattler's stream calls only type '0' a file; its extraction writes any unknown type as one, and a
    sparse one as a file of its full size (holes where the file system has them: a copy to another fills them)."""
    genuine = _package(multi_channel, {"conda": "libgreet", "tar.bz2": "oldformat"}[fmt])
    bomb = _typed_bomb(genuine, tmp_path / "bomb", KINDS[kind])
    assert _extracted_bytes(bomb) >= ZEROS  # what it would cost (in bytes of its files, holes included)
    with pytest.raises(ExpansionError, match="its files hold more than the .* bytes its info/paths.json records"):
        expansion.check_expansion(bomb)


@pytest.mark.parametrize("member", MEMBERS)
def test_zeros_in_a_zip_member_beside_the_two_sections_are_refused(
    member: str, multi_channel: Path, tmp_path: Path
) -> None:
    """py-rattler's extraction unpacks every member whose name ends with .tar.zst, listed in the zip's directory
    or not; its stream reads the first pkg- and info- members the directory lists."""
    name, hidden = MEMBERS[member]
    bomb = _member_bomb(_package(multi_channel, "libgreet"), tmp_path / "bomb", name, hidden=hidden)
    assert _extracted_bytes(bomb) >= ZEROS
    with pytest.raises(ExpansionError, match=f"the package {bomb.name} holds .*: nothing of it was extracted"):
        expansion.check_expansion(bomb)


def test_genuine_packages_pass_the_member_checks(multi_channel: Path) -> None:
    packages = [p for p in multi_channel.rglob("*") if p.name.endswith((".conda", ".tar.bz2"))]
    for package in packages:
        measured = expansion.check_expansion(package)
        assert measured.files <= measured.recorded, package.name


def test_deploy_lock_checks_a_bomb_named_as_a_cached_package(
    bombed: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cache holds the genuine package under the bomb's name, version and build: py-rattler finds its sha256
    differs from the lock's, and extracts the bomb in its place; so the bomb is counted first all the same."""
    monkeypatch.setenv("RATTLER_CACHE_DIR", str(tmp_path / "cache"))
    deploy([bombed["name"]], prefix=tmp_path / "genuine", channel_dir=bombed["genuine"].parent.parent)
    (cached,) = list((tmp_path / "cache" / "pkgs").glob(f"{bombed['name']}-*.lock"))
    code, err = run_cli(capsys, "deploy", "--lock", str(bombed["lock"]), "--prefix", str(tmp_path / "env"))
    folder = cached.with_suffix("")
    assert not any(p.stat().st_size >= ZEROS for p in folder.rglob("*") if p.is_file()), "the bomb was extracted"
    assert code == 2 and f"the package {bombed['bomb'].name} expands past what it records" in err, err


def test_deploy_lock_installs_what_it_counted_when_another_user_swaps_the_channels_package(
    multi_channel: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A channel folder another user can write (mode 0777 here): they rename a bomb over the package after deploy
    hashed and counted it, before py-rattler reads it again (the race won every time: the swap runs right after
    the count). The deploy installs the genuine bytes, or refuses; the bomb is never extracted."""
    from channelsmith import deploy as deploying

    source = tmp_path / "channel"
    shutil.copytree(multi_channel, source)
    genuine = _package(source, "libgreet")
    bomb = make_bomb(genuine, tmp_path / "bomb")
    lock = deploy(["libgreet"], prefix=tmp_path / "first", channel_dir=source).lock_file
    genuine.parent.chmod(0o777)
    monkeypatch.setenv("RATTLER_CACHE_DIR", str(tmp_path / "cache"))
    counted = deploying.check_expansions

    def count_then_swap(archives: dict[str, Path]) -> list[expansion.Expansion]:
        measured = counted(archives)
        shutil.copyfile(bomb, tmp_path / "swap")
        (tmp_path / "swap").replace(genuine)
        return measured

    monkeypatch.setattr(deploying, "check_expansions", count_then_swap)
    try:
        report = deploying.deploy_lock(lock, prefix=tmp_path / "env")
    except (ExpansionError, DeployError, ChannelError) as refused:  # a refusal is as good as genuine bytes
        report, said = None, str(refused)
    assert genuine.read_bytes() == bomb.read_bytes()  # the swap happened
    extracted = [p for p in (tmp_path / "cache").rglob("*") if p.is_file() and p.stat().st_size >= ZEROS]
    assert not extracted, report or said
    if report is not None:
        installed = tmp_path / "env" / "share" / "libgreet" / "greeting.txt"
        assert installed.read_text() == "greeting\n" and not (tmp_path / "env" / "share" / "bomb").exists()
        assert any("could be swapped by another user" in note for note in report.notes), report.notes
        (meta,) = (tmp_path / "env" / "conda-meta").glob("libgreet-*.json")
        assert f'"url": "{genuine.as_uri()}"' in meta.read_text()  # the channel's, not the deleted copy's
