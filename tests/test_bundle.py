"""Air-gapped deploys: channelsmith pack, deploy --bundle with the network blocked, and unpack.sh.

Two environments are packed: site-env-derecho (the README's main job, from the shared
``site_env_channel``), and the multi-package one of tests/multi_env.py (local recipes with
dependencies between packages, a noarch: python package, a build prefix replaced on install).

Installs from a bundle run in a child process with no network: in a new network namespace
(``unshare --net``), or where namespaces are refused, with every proxy variable pointed at a closed
port. The channel the lock names is deleted before, so nothing could be fetched from it anyway.
"""

from __future__ import annotations

import functools
import io
import json
import os
import pwd
import shlex
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from channelsmith import bundle, channel
from channelsmith.cli import main
from channelsmith.deploy import deploy, prefix_packages
from channelsmith.lock import LOCK_NAME, lock_records
from multi_env import PYTHON, build_multi_packages
from other_user import ATTACKER, as_user, other_user
from rattler import Channel, LockFile, LockPlatform, RepoData, Subdir
from servers import file_server
from test_channel import run_cli, snapshot

# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


@functools.cache
def _namespaces_work() -> bool:
    probe = ["unshare", "--user", "--map-root-user", "--net", "true"]
    return shutil.which("unshare") is not None and subprocess.run(probe, capture_output=True).returncode == 0


def offline(
    argv: list[str], *, path: str | None = None, home: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` with no network: a new network namespace, else every proxy pointed at a closed port.

    ``home``: HOME for the child, with no XDG_CACHE_HOME (so ~/.cache is under it).
    """
    env = dict(os.environ)
    if path is not None:
        env["PATH"] = path
    if home is not None:
        env["HOME"] = str(home)
        env.pop("XDG_CACHE_HOME", None)
    if _namespaces_work():
        argv = [shutil.which("unshare"), "--user", "--map-root-user", "--net", *argv]  # found before PATH changes
    else:
        nowhere = "http://127.0.0.1:9"
        env.update(
            {k: nowhere for k in ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY")}
        )
        env["no_proxy"] = env["NO_PROXY"] = ""
    return subprocess.run(argv, capture_output=True, text=True, env=env)


def channelsmith(*args: str) -> list[str]:
    return [sys.executable, "-m", "channelsmith", *args]


def files_of(prefix: Path) -> dict[str, bytes]:
    """What an install put in a prefix, outside its package records, the lock and activate.sh.

    py-rattler 0.28 also writes a CACHEDIR.TAG into the prefix on every install; it is no package's file.
    """
    skip = (LOCK_NAME, bundle.ACTIVATE_NAME, "CACHEDIR.TAG")
    return {
        name: data for name, data in snapshot(prefix).items() if name not in skip and not name.startswith("conda-meta/")
    }


def unlisted(prefix: Path) -> set[str]:
    """Files in a prefix that no package record lists, beside conda-meta/, the lock and activate.sh."""
    listed = {LOCK_NAME, bundle.ACTIVATE_NAME}
    for meta in (prefix / "conda-meta").glob("*.json"):
        listed.update(json.loads(meta.read_text())["files"])
    present = {
        str(p.relative_to(prefix)) for p in prefix.rglob("*") if (p.is_file() or p.is_symlink()) and not p.is_dir()
    }
    return {name for name in present if name not in listed and not name.startswith("conda-meta/")}


def relocated(prefix: Path, to: Path) -> dict[str, bytes]:
    """files_of(prefix) as an install into ``to`` has them: the prefix written into text files changes."""
    return {k: v.replace(str(prefix).encode(), str(to).encode()) for k, v in files_of(prefix).items()}


def links_of(prefix: Path) -> dict[str, str]:
    return {str(p.relative_to(prefix)): os.readlink(p) for p in prefix.rglob("*") if p.is_symlink()}


def pinned(prefix: Path) -> list[tuple[str, str, str, str]]:
    return [(p.name, p.version, p.build, p.sha256) for p in prefix_packages(prefix)]


def lock_pins(lock_file: Path) -> list[tuple[str, str, str, str]]:
    _platform, records = lock_records(lock_file)
    return sorted((r.name.normalized, str(r.version), str(r.build), r.sha256.hex()) for r in records)


def activated(prefix: Path, command: str) -> str:
    """stdout of ``command`` run by sh after sourcing PREFIX/activate.sh, with a bare PATH."""
    done = subprocess.run(
        ["sh", "-c", f'. "{prefix}/activate.sh" && {command}'],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def assert_failed_cleanly(done: subprocess.CompletedProcess[str], message: str) -> None:
    err = " ".join(done.stderr.split())
    assert done.returncode == 2, done.stderr
    assert message in err, err
    assert "hint:" in err, err


# ---------------------------------------------------------------------------------------------
# Fixtures: two deployed environments and their bundles
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def multi_channel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("multi")
    channel_dir = work / "channel"
    channel.publish(channel_dir, build_multi_packages(work))
    return channel_dir


def _deploy_and_pack(work: Path, source: Path, *specs: str, cli: bool = False) -> tuple[Path, Path]:
    """Deploy ``specs`` from a copy of ``source``, pack its lock, delete the copy; (prefix, bundle)."""
    copy = work / "channel"
    shutil.copytree(source, copy)
    prefix = work / "deployed"
    deploy(list(specs), prefix=prefix, channel_dir=copy)
    tar = work / "env.tar"
    lock = prefix / LOCK_NAME
    if cli:
        packed = subprocess.run(
            channelsmith("pack", "--lock", str(lock), "-o", str(tar), "--cache-dir", str(work / "cache"), "--json"),
            capture_output=True,
            text=True,
            check=True,
        )
        report = json.loads(packed.stdout)  # stdout is the JSON report alone
        assert report["bundle"] == str(tar) and report["unpack_sh"]
        assert sorted(p["name"] for p in report["packages"]) == [name for name, *_ in lock_pins(lock)]
    else:
        bundle.pack(lock, tar, cache_dir=work / "cache")
    shutil.rmtree(copy)  # the air gap: the channel the lock names is gone
    return prefix, tar


@pytest.fixture(scope="module")
def derecho(tmp_path_factory: pytest.TempPathFactory, site_env_channel: Path) -> tuple[Path, Path]:
    return _deploy_and_pack(tmp_path_factory.mktemp("derecho"), site_env_channel, "site-env-derecho", cli=True)


@pytest.fixture(scope="module")
def multi(tmp_path_factory: pytest.TempPathFactory, multi_channel: Path) -> tuple[Path, Path]:
    return _deploy_and_pack(tmp_path_factory.mktemp("multi-env"), multi_channel, "greet-py", "oldformat")


# ---------------------------------------------------------------------------------------------
# The bundle: pixi-pack's layout
# ---------------------------------------------------------------------------------------------


def test_the_bundle_has_pixi_packs_layout_and_the_lock_unchanged(multi: tuple[Path, Path], tmp_path: Path) -> None:
    deployed, tar = multi
    with tarfile.open(tar, mode="r:") as archive:  # "r:" refuses a compressed tar: the outer tar is plain
        names = archive.getnames()
        archive.extractall(tmp_path, filter="data") if hasattr(tarfile, "data_filter") else archive.extractall(tmp_path)
    # pixi-pack 0.7.10 src/lib.rs: PixiPackMetadata {version: "1", platform}; src/pack.rs: channel/, environment.yml.
    metadata = json.loads((tmp_path / "pixi-pack.json").read_text())
    assert metadata["version"] == "1" and metadata["platform"] == str(Subdir.current())
    assert (tmp_path / LOCK_NAME).read_bytes() == (deployed / LOCK_NAME).read_bytes()
    locked = {r.file_name: r.sha256.hex() for r in lock_records(deployed / LOCK_NAME)[1]}
    # pixi-unpack reads every folder of channel/ through its repodata.json: read it with rattler's parser.
    listed = {}
    for subdir in sorted(p.name for p in (tmp_path / "channel").iterdir()):
        repodata = RepoData.from_path(tmp_path / "channel" / subdir / "repodata.json")
        for record in repodata.into_repo_data(Channel(channel.channel_url(tmp_path / "channel"))):
            listed[record.file_name] = record.sha256.hex()
            assert channel.sha256_of(tmp_path / "channel" / subdir / record.file_name) == record.sha256.hex()
    assert listed == locked
    assert {"channel/noarch/repodata.json", "unpack.sh", "environment.yml"} <= set(names)
    environment = (tmp_path / "environment.yml").read_text()
    assert environment.startswith("channels:\n  - ./channel\n  - nodefaults\ndependencies:\n")
    specs = {f"  - {name}={version}={build}" for name, version, build, _ in lock_pins(deployed / LOCK_NAME)}
    assert set(environment.splitlines()[4:]) == specs


def test_packing_the_same_lock_twice_gives_the_same_bytes(multi_channel: Path, tmp_path: Path) -> None:
    report = deploy(["libgreet"], prefix=tmp_path / "env", channel_dir=multi_channel)
    first = bundle.pack(report.lock_file, tmp_path / "first.tar", cache_dir=tmp_path / "cache")
    second = bundle.pack(report.lock_file, tmp_path / "second.tar", cache_dir=tmp_path / "cache")
    assert [p.source for p in first.packages] == ["channel"]
    assert first.bundle.read_bytes() == second.bundle.read_bytes()


REPOSITORY = Path(__file__).resolve().parents[1]


def _wheel_tools_missing() -> str:
    """Why a wheel of channelsmith cannot be built and installed here offline, or "" when it can."""
    if subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True).returncode != 0:
        return "pip is not installed in this Python (python3 -m ensurepip)"
    # setuptools >= 70.1 builds wheels on its own (no `wheel` package), with no index to fetch from.
    probe = "import setuptools, sys; sys.exit(tuple(map(int, setuptools.__version__.split('.')[:2])) < (70, 1))"
    if subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode != 0:
        return "setuptools >= 70.1 is not installed in this Python (pip install 'setuptools>=70.1')"
    return ""


def test_an_installed_channelsmith_ships_unpack_sh_and_packs_it_into_the_bundle(
    multi_channel: Path, tmp_path: Path
) -> None:
    """unpack.sh is package data of channelsmith.bundle: the wheel built from the checkout holds it, and
    channelsmith installed from that wheel (not the checkout) writes it into every bundle, executable."""
    missing = _wheel_tools_missing()
    if missing:
        pytest.skip(missing)
    source = tmp_path / "source"  # the build writes build/ and *.egg-info beside pyproject.toml: a copy
    shutil.copytree(REPOSITORY / "scripts", source / "scripts", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPOSITORY / name, source / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    wheels = tmp_path / "wheels"
    built = subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(wheels), str(source)],
        capture_output=True,
        text=True,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = wheels.glob("channelsmith-*.whl")
    script = (REPOSITORY / "scripts" / "channelsmith" / "bundle" / bundle.UNPACK_SCRIPT).read_bytes()
    with zipfile.ZipFile(wheel) as archive:
        assert archive.read(f"channelsmith/bundle/{bundle.UNPACK_SCRIPT}") == script
    site = tmp_path / "site"
    installed = subprocess.run(
        [*pip, "install", "--no-deps", "--no-index", "--target", str(site), str(wheel)], capture_output=True, text=True
    )
    assert installed.returncode == 0, installed.stdout + installed.stderr
    # The installed copy alone: PYTHONPATH names it instead of the checkout, and the cwd holds no channelsmith.
    env = {**os.environ, "PYTHONPATH": str(site)}
    where = subprocess.run(
        [sys.executable, "-c", "import channelsmith.bundle as b; print(b.__file__)"],
        cwd=tmp_path, env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert Path(where.stdout.strip()).is_relative_to(site), where.stdout
    report = deploy(["libgreet"], prefix=tmp_path / "env", channel_dir=multi_channel)
    tar = tmp_path / "env.tar"
    packed = subprocess.run(
        [sys.executable, "-m", "channelsmith", "pack", "--lock", str(report.lock_file), "-o", str(tar),
         "--cache-dir", str(tmp_path / "cache")],
        cwd=tmp_path, env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert packed.returncode == 0, packed.stderr
    with tarfile.open(tar, mode="r:") as archive:
        member = archive.getmember(bundle.UNPACK_SCRIPT)
        assert member.mode == 0o755
        assert archive.extractfile(member).read() == script


# ---------------------------------------------------------------------------------------------
# Installing with no network: deploy --bundle, and unpack.sh without channelsmith
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("env", ["derecho", "multi"])
def test_deploy_bundle_with_no_network_matches_a_normal_deploy(
    env: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    deployed, tar = request.getfixturevalue(env)
    prefix = tmp_path / "env"
    # HOME cannot be written (as on many compute nodes): under a file, so not even root can make ~/.cache there.
    (tmp_path / "a-file").write_text("")
    home = tmp_path / "a-file" / "home"
    done = offline(channelsmith("deploy", "--bundle", str(tar), "--prefix", str(prefix), "--json"), home=home)
    assert done.returncode == 0, done.stderr
    # Nothing beside the lock's files (no CACHEDIR.TAG), and no package cache left beside the prefix.
    assert unlisted(prefix) == set()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "env"]
    report = json.loads(done.stdout)
    assert report["from_lock"] and report["prefix"] == str(prefix)
    # Exactly the lock's packages (names, builds, sha256), the same files, the same lock bytes.
    assert pinned(prefix) == pinned(deployed) == lock_pins(deployed / LOCK_NAME)
    assert files_of(prefix) == relocated(deployed, prefix)
    assert links_of(prefix) == links_of(deployed)
    assert (prefix / LOCK_NAME).read_bytes() == (deployed / LOCK_NAME).read_bytes()
    # The records still name the lock's URLs, not the scratch copies the install read.
    assert [p.url for p in prefix_packages(prefix)] == [p.url for p in prefix_packages(deployed)]


def test_site_activation_runs_from_activate_sh(
    derecho: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _deployed, tar = derecho
    prefix = tmp_path / "env"
    assert main(["deploy", "--bundle", str(tar), "--prefix", str(prefix)]) == 0
    assert f"activate it with: . {prefix}/activate.sh" in " ".join(capsys.readouterr().out.split())
    assert activated(prefix, 'echo "$CONDA_PREFIX $NCCL_SOCKET_IFNAME"') == f"{prefix} hsn"


def test_the_noarch_python_package_runs_after_a_bundle_install(multi: tuple[Path, Path], tmp_path: Path) -> None:
    _deployed, tar = multi
    prefix = tmp_path / "env"
    bundle.install_bundle(tar, prefix=prefix)
    assert (prefix / "lib" / f"python{PYTHON}" / "site-packages" / "greet_py" / "__init__.py").is_file()
    assert activated(prefix, "greet-py && greet && echo $GREET_HOME") == (
        f"greet-py says hi\nhello from {prefix}\n{prefix}/share/libgreet"
    )


def _libgreet(channel_dir: Path) -> Path:
    (found,) = (channel_dir / str(Subdir.current())).glob("libgreet-*.conda")
    return found


def _skip_without_unpack_tools() -> None:
    """Skip, naming them, when a program unpack.sh runs is missing."""
    missing = [tool for tool in ("unzip", "zstd", "sha256sum", "tar") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"unpack.sh needs {', '.join(missing)} (scripts/install-test-deps.sh installs them)")


def _extract_with_tar(tar: Path, into: Path) -> Path:
    into.mkdir()
    subprocess.run(["tar", "-xf", str(tar), "-C", str(into)], check=True)
    return into


@pytest.mark.parametrize("env", ["derecho", "multi"])
def test_unpack_sh_installs_without_channelsmith(env: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    _skip_without_unpack_tools()
    deployed, tar = request.getfixturevalue(env)
    extracted = _extract_with_tar(tar, tmp_path / "bundle")
    prefix = tmp_path / "env"
    # A bare PATH: no channelsmith, no conda, no venv python.
    done = offline(["sh", str(extracted / "unpack.sh"), str(prefix)], path="/usr/bin:/bin")
    assert done.returncode == 0, done.stderr
    assert pinned(prefix) == pinned(deployed)
    # Text files carry their own prefix, as rattler wrote the deployed one's.
    assert files_of(prefix) == relocated(deployed, prefix)
    assert links_of(prefix) == links_of(deployed)
    assert (prefix / LOCK_NAME).read_bytes() == (deployed / LOCK_NAME).read_bytes()
    assert (prefix / "activate.sh").read_text() == bundle.activate_script(prefix)
    if env == "derecho":
        assert activated(prefix, "echo $NCCL_SOCKET_IFNAME") == "hsn"
    else:
        assert activated(prefix, "greet-py") == "greet-py says hi"


def test_pack_takes_packages_over_http_and_from_its_cache(
    multi_channel: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    served = tmp_path / "served"
    shutil.copytree(multi_channel, served)
    with file_server(served) as url:
        report = deploy(["libgreet"], prefix=tmp_path / "env", channel_dir=None, channels=[url])
        first = bundle.pack(report.lock_file, tmp_path / "first.tar", cache_dir=tmp_path / "cache")
        # Changed in the channel, not in the cache: refused, and nothing of it cached.
        package = _libgreet(served)
        data = bytearray(package.read_bytes())
        data[len(data) // 2] ^= 0xFF
        package.write_bytes(bytes(data))
        changed = run_cli(
            capsys, "pack", "--lock", str(report.lock_file), "-o", str(tmp_path / "changed.tar"),
            "--cache-dir", str(tmp_path / "fresh-cache"),
        )  # fmt: skip
        # Gone from the channel and not in the cache: an HTTP 404, said as such.
        package.unlink()
        code, err = run_cli(
            capsys, "pack", "--lock", str(report.lock_file), "-o", str(tmp_path / "gone.tar"),
            "--cache-dir", str(tmp_path / "fresh-cache"),
        )  # fmt: skip
    assert [p.source for p in first.packages] == ["download"]
    assert changed[0] == 2 and "the downloaded file's sha256 differs" in changed[1] and "hint:" in changed[1]
    assert not (tmp_path / "changed.tar").exists()
    assert not [p for p in (tmp_path / "fresh-cache").rglob("*") if p.is_file()]
    assert code == 2 and f"cannot download {url}/" in err and "404" in err and "hint:" in err
    assert not (tmp_path / "gone.tar").exists()
    # The server is gone too: the cache holds the checked package.
    second = bundle.pack(report.lock_file, tmp_path / "second.tar", cache_dir=tmp_path / "cache")
    assert [p.source for p in second.packages] == ["cache"]
    assert second.bundle.read_bytes() == first.bundle.read_bytes()


# ---------------------------------------------------------------------------------------------
# Bad input: exit 2, a message and a hint, no bundle or prefix left half-made, nothing else changed
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def multi_lock(multi_channel: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A private copy of the multi channel, and the lock of greet-py deployed from it."""
    copy = tmp_path / "channel"
    shutil.copytree(multi_channel, copy)
    return copy, deploy(["greet-py"], prefix=tmp_path / "deployed", channel_dir=copy).lock_file


@pytest.mark.parametrize("damage", ["gone", "changed"])
def test_pack_refuses_a_lock_whose_package_is_gone_or_changed(
    multi_lock: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], damage: str
) -> None:
    copy, lock = multi_lock
    package = _libgreet(copy)
    if damage == "gone":
        package.unlink()
        message = f"{package.name} is gone from its channel"
    else:
        data = bytearray(package.read_bytes())
        data[len(data) // 2] ^= 0xFF
        package.write_bytes(bytes(data))
        message = "does not match the lock: its sha256 differs"
    out = tmp_path / "out"
    out.mkdir()
    code, err = run_cli(
        capsys, "pack", "--lock", str(lock), "-o", str(out / "env.tar"), "--cache-dir", str(tmp_path / "cache")
    )
    assert code == 2 and message in err and "hint:" in err
    assert list(out.iterdir()) == []  # no bundle, not even a partial one


def _member(tar: Path, part: str) -> tarfile.TarInfo:
    """The one member of ``tar`` whose name holds ``part``."""
    with tarfile.open(tar, mode="r:") as archive:
        (member,) = [m for m in archive.getmembers() if part in m.name]
    return member


def _tamper(tar: Path, into: Path, part: str) -> Path:
    """A copy of ``tar`` with one byte flipped in the middle of the member whose name holds ``part``."""
    member = _member(tar, part)
    data = bytearray(tar.read_bytes())
    data[member.offset_data + member.size // 2] ^= 0xFF
    into.write_bytes(bytes(data))
    return into


def test_a_bundle_with_a_tampered_package_is_refused(multi: tuple[Path, Path], tmp_path: Path) -> None:
    _deployed, tar = multi
    tampered = _tamper(tar, tmp_path / "tampered.tar", f"channel/{Subdir.current()}/libgreet-")
    prefix = tmp_path / "env"
    done = offline(channelsmith("deploy", "--bundle", str(tampered), "--prefix", str(prefix)))
    assert_failed_cleanly(done, "whose sha256 differs from the one its lock records")
    assert not prefix.exists()
    extracted = _extract_with_tar(tampered, tmp_path / "bundle")
    done = offline(["sh", str(extracted / "unpack.sh"), str(prefix)], path="/usr/bin:/bin")
    assert_failed_cleanly(done, f"the package {_libgreet(extracted / 'channel').name} in {extracted} differs")
    assert not prefix.exists()


@pytest.mark.parametrize("cut", ["inside-a-package", "before-the-metadata", "inside-the-last-member"])
def test_a_truncated_bundle_is_refused(
    multi: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], cut: str
) -> None:
    _deployed, tar = multi
    if cut == "inside-a-package":
        package = _member(tar, f"channel/{Subdir.current()}/libgreet-")
        size = package.offset_data + package.size // 2
    elif cut == "before-the-metadata":
        size = _member(tar, bundle.METADATA_NAME).offset  # its header and everything after are gone
    else:
        last = _member(tar, bundle.UNPACK_SCRIPT)
        size = last.offset_data + last.size // 2
    truncated = tmp_path / "truncated.tar"
    truncated.write_bytes(tar.read_bytes()[:size])
    (tmp_path / "empty").mkdir()
    for prefix in (tmp_path / "env", tmp_path / "empty"):
        code, err = run_cli(capsys, "deploy", "--bundle", str(truncated), "--prefix", str(prefix))
        assert code == 2 and "is not a usable bundle" in err and "truncated" in err and "hint:" in err
    assert not (tmp_path / "env").exists()
    assert list((tmp_path / "empty").iterdir()) == []


def test_a_bundle_for_another_platform_is_refused(
    site_env_channel: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    other = "osx-arm64" if str(Subdir.current()) != "osx-arm64" else "linux-64"
    deployed = deploy(["site-env-derecho"], prefix=tmp_path / "deployed", channel_dir=site_env_channel)
    _platform, records = lock_records(deployed.lock_file)
    platform = LockPlatform(other)
    lock = LockFile([platform])
    for record in records:
        lock.add_conda_package("default", platform, record)
    lock.to_path(tmp_path / "other.lock")
    report = bundle.pack(tmp_path / "other.lock", tmp_path / "other.tar", cache_dir=tmp_path / "cache")
    assert report.platform == other
    prefix = tmp_path / "env"
    code, err = run_cli(capsys, "deploy", "--bundle", str(report.bundle), "--prefix", str(prefix))
    assert code == 2 and f"is a bundle for {other}, and this machine is {Subdir.current()}" in err and "hint:" in err
    assert not prefix.exists()
    extracted = _extract_with_tar(report.bundle, tmp_path / "bundle")
    done = offline(["sh", str(extracted / "unpack.sh"), str(prefix)], path="/usr/bin:/bin")
    assert_failed_cleanly(done, f"this bundle is for {other}")
    assert not prefix.exists()


def test_a_prefix_holding_another_environment_is_left_alone(
    derecho: tuple[Path, Path], multi_channel: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _deployed, tar = derecho
    prefix = tmp_path / "env"
    deploy(["libgreet"], prefix=prefix, channel_dir=multi_channel)
    before = snapshot(prefix)
    code, err = run_cli(capsys, "deploy", "--bundle", str(tar), "--prefix", str(prefix))
    assert code == 2 and f"prefix {prefix} already holds an environment (libgreet 1.0.0)" in err and "hint:" in err
    assert snapshot(prefix) == before
    extracted = _extract_with_tar(tar, tmp_path / "bundle")
    done = offline(["sh", str(extracted / "unpack.sh"), str(prefix)], path="/usr/bin:/bin")
    assert_failed_cleanly(done, "already holds an environment")
    assert snapshot(prefix) == before


FULL_DISK = r"""
set -u
mount -t tmpfs -o size=512k channelsmith-test "$SMALL" || exit 77
mkdir "$SMALL/empty"
"$PYTHON" -m channelsmith deploy --bundle "$BUNDLE" --prefix "$SMALL/new/env" 2>"$SMALL.new.err"; echo "new=$?"
"$PYTHON" -m channelsmith deploy --bundle "$BUNDLE" --prefix "$SMALL/empty" 2>"$SMALL.empty.err"; echo "empty=$?"
"$PYTHON" -m channelsmith pack --lock "$LOCK" -o "$SMALL/env.tar" --cache-dir "$CACHE" 2>"$SMALL.pack.err"
echo "pack=$?"
sh "$EXTRACTED/unpack.sh" "$SMALL/sh" 2>"$SMALL.sh.err"; echo "sh=$?"
echo "left=$(ls -A "$SMALL" | tr '\n' ' ')"
echo "in-empty=$(ls -A "$SMALL/empty" | tr '\n' ' ')"
"""


def test_a_full_disk_leaves_no_prefix_and_no_bundle(multi_channel: Path, tmp_path: Path) -> None:
    # A 512 KiB tmpfs, mounted in a mount namespace of the test's own (root in a user namespace may mount tmpfs).
    if shutil.which("unshare") is None:
        pytest.skip("unshare (util-linux) is not installed: no namespace to mount a small tmpfs in")
    deployed = deploy(["greet-py", "bigdata"], prefix=tmp_path / "deployed", channel_dir=multi_channel)
    tar = bundle.pack(deployed.lock_file, tmp_path / "env.tar", cache_dir=tmp_path / "cache").bundle
    extracted = _extract_with_tar(tar, tmp_path / "bundle")
    small = tmp_path / "small"
    small.mkdir()
    env = dict(
        os.environ,
        SMALL=str(small),
        PYTHON=sys.executable,
        BUNDLE=str(tar),
        LOCK=str(deployed.lock_file),
        CACHE=str(tmp_path / "cache"),
        EXTRACTED=str(extracted),
    )
    done = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", FULL_DISK],
        capture_output=True,
        text=True,
        env=env,
    )
    if done.returncode == 77 or (done.returncode != 0 and "unshare" in done.stderr):
        pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.strip()}")
    results = dict(line.split("=", 1) for line in done.stdout.splitlines())
    errors = {
        name: " ".join(Path(f"{small}.{name}.err").read_text().split()) for name in ("new", "empty", "pack", "sh")
    }
    assert results["new"] == results["empty"] == results["pack"] == results["sh"] == "2", (results, errors)
    for name in ("new", "empty"):
        assert "No space left on device" in errors[name] and "hint: free space" in errors[name], errors[name]
    assert "No space left on device" in errors["pack"] and "hint: free space" in errors["pack"], errors["pack"]
    assert "hint: check free space" in errors["sh"], errors["sh"]
    # Nothing half-made on the full disk: the empty prefix is still there and still empty.
    assert results["left"].split() == ["empty"] and results["in-empty"] == ""


def test_pack_refuses_a_lock_with_pypi_packages(
    multi_lock: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _copy, lock = multi_lock
    wheel = "https://example.invalid/six-1.17.0-py2.py3-none-any.whl"
    platform_list = f"      {Subdir.current()}:\n"
    text = lock.read_text()
    assert platform_list in text
    text = text.replace(platform_list, f"{platform_list}      - pypi: {wheel}\n", 1)
    text += f"- pypi: {wheel}\n  name: six\n  version: 1.17.0\n"
    (tmp_path / "pypi.lock").write_text(text)
    code, err = run_cli(capsys, "pack", "--lock", str(tmp_path / "pypi.lock"), "-o", str(tmp_path / "env.tar"))
    assert code == 2 and "also pins PyPI packages" in err and "hint:" in err
    assert not (tmp_path / "env.tar").exists()


def test_unpack_sh_refuses_a_bundle_that_needs_binary_prefix_replacement(multi_channel: Path, tmp_path: Path) -> None:
    deployed = deploy(["binprefix"], prefix=tmp_path / "deployed", channel_dir=multi_channel)
    report = bundle.pack(deployed.lock_file, tmp_path / "env.tar", cache_dir=tmp_path / "cache")
    assert (
        not report.unpack_sh and "needs binary prefix replacement in share/binprefix/data.bin" in report.unpack_sh_note
    )
    extracted = _extract_with_tar(report.bundle, tmp_path / "bundle")
    done = offline(["sh", str(extracted / "unpack.sh"), str(tmp_path / "sh")], path="/usr/bin:/bin")
    assert_failed_cleanly(done, "needs binary prefix replacement, which unpack.sh does not do")
    assert not (tmp_path / "sh").exists()
    # channelsmith installs it: py-rattler pads the new prefix into the binary file.
    bundle.install_bundle(report.bundle, prefix=tmp_path / "env")
    data = (tmp_path / "env" / "share" / "binprefix" / "data.bin").read_bytes()
    assert data.startswith(f"prefix={tmp_path / 'env'}\0".encode())


def test_unpack_sh_passes_shellcheck_as_a_posix_script() -> None:
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck)")
    script = bundle.unpack_script_path()
    done = subprocess.run(["shellcheck", "--shell=sh", str(script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout


def test_unpack_sh_names_a_missing_tool_before_writing(derecho: tuple[Path, Path], tmp_path: Path) -> None:
    _deployed, tar = derecho
    extracted = _extract_with_tar(tar, tmp_path / "bundle")
    tools = tmp_path / "bin"  # every tool unpack.sh needs, but zstd
    tools.mkdir()
    for tool in ("cat", "chmod", "cp", "df", "dirname", "grep", "head", "id", "ls", "mkdir", "mktemp", "rm", "sed",
                 "uname", "wc", "tar", "unzip"):  # fmt: skip
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed")
        (tools / tool).symlink_to(shutil.which(tool))
    (tools / "sha256sum").symlink_to(shutil.which("sha256sum"))
    done = offline(["/bin/sh", str(extracted / "unpack.sh"), str(tmp_path / "env")], path=str(tools))
    assert_failed_cleanly(done, "unpack.sh needs zstd, which is not on PATH")
    assert not (tmp_path / "env").exists()


def test_pack_shows_a_progress_bar_on_a_terminal(multi_lock: tuple[Path, Path], tmp_path: Path) -> None:
    _copy, lock = multi_lock
    # TTY_COMPATIBLE=1 makes rich treat the pipe as a terminal, as a user's shell would be.
    env = dict(os.environ, TTY_COMPATIBLE="1")
    argv = channelsmith(
        "pack", "--lock", str(lock), "-o", str(tmp_path / "env.tar"), "--cache-dir", str(tmp_path / "c")
    )
    done = subprocess.run(argv, capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    size = sum(r.size for r in lock_records(lock)[1])
    assert f"fetching {len(lock_pins(lock))} packages" in done.stderr
    assert f"{size / 1000:.1f}/{size / 1000:.1f} kB" in done.stderr  # the bar ends full, in bytes
    assert "fetching" not in done.stdout and "packed" in done.stdout


# ---------------------------------------------------------------------------------------------
# Anchors from outside the bundle: its sha256 (FILE.tar.sha256), or a trusted lock
# ---------------------------------------------------------------------------------------------


def test_pack_prints_its_stages_and_writes_the_bundles_sha256_beside_it(
    multi_lock: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _copy, lock = multi_lock
    (tmp_path / "out").mkdir()
    tar = tmp_path / "out" / "env.tar"
    code = main(["pack", "--lock", str(lock), "-o", str(tar), "--cache-dir", str(tmp_path / "cache"), "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    digest = channel.sha256_of(tar)
    report = json.loads(captured.out)
    assert report["sha256"] == digest and report["sha256_file"] == f"{tar}.sha256"
    assert (tmp_path / "out" / "env.tar.sha256").read_text() == f"{digest}  env.tar\n"  # sha256sum's format
    if shutil.which("sha256sum"):
        subprocess.run(["sha256sum", "-c", "env.tar.sha256"], cwd=tmp_path / "out", check=True, capture_output=True)
    # Not a terminal: one line per stage on stderr, as the other commands write to a log.
    stages = [line.split(" (at ")[0] for line in captured.err.splitlines() if line.startswith("pack: ")]
    assert stages == [
        f"pack: reading the lock {lock}",
        "pack: fetching 3 packages (0.0 MB)",
        "pack: reading the packages' file lists (for unpack.sh)",
        f"pack: writing {tar} and its sha256",
    ]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["env.tar", "env.tar.sha256"]  # no temporary files


FORGED_GREETING = 'printf \'#!/bin/sh\\necho "forged"\\n\' > $PREFIX/bin/greet'


@pytest.fixture(scope="module")
def forged(tmp_path_factory: pytest.TempPathFactory, multi_channel: Path) -> dict[str, Path | str]:
    """A genuine bundle of greet-py (its lock, its sha256), and a forged one: libgreet rebuilt with other
    contents under the same name, published, deployed and packed, so that every record inside the forged
    bundle (its lock, repodata, unpack.sh's file list and records) matches the forged package."""
    from multi_env import MULTI_RECIPES, build_packages

    work = tmp_path_factory.mktemp("forged")
    genuine_channel = work / "genuine-channel"
    shutil.copytree(multi_channel, genuine_channel)
    genuine = deploy(["greet-py"], prefix=work / "genuine", channel_dir=genuine_channel)
    genuine_tar = bundle.pack(genuine.lock_file, work / "genuine.tar", cache_dir=work / "cache")
    recipe = MULTI_RECIPES["libgreet"]
    original = """printf '#!/bin/sh\\necho "hello from %s"\\n' "$PREFIX" > $PREFIX/bin/greet"""
    assert original in recipe
    (forged_libgreet,) = build_packages(recipe.replace(original, FORGED_GREETING), work)
    assert forged_libgreet.name == _libgreet(multi_channel).name  # the same file name, other bytes
    others = [p for p in multi_channel.rglob("*") if p.suffix in (".conda", ".bz2") and "libgreet" not in p.name]
    forged_channel = work / "forged-channel"
    channel.publish(forged_channel, [forged_libgreet, *others])
    forged_env = deploy(["greet-py"], prefix=work / "forged", channel_dir=forged_channel)
    forged_tar = bundle.pack(forged_env.lock_file, work / "forged.tar", cache_dir=work / "cache")
    # libgreet alone, genuine and forged: one package each, the quickest installs for the swap race.
    small = {}
    for name, source in (("genuine", genuine_channel), ("forged", forged_channel)):
        lock = deploy(["libgreet"], prefix=work / f"{name}-small", channel_dir=source).lock_file
        small[name] = bundle.pack(lock, work / f"{name}-small.tar", cache_dir=work / "cache")
    return {
        "genuine_small": small["genuine"].bundle,
        "forged_small": small["forged"].bundle,
        "small_sha256": small["genuine"].sha256,
        "genuine": genuine_tar.bundle,
        "lock": genuine.lock_file,
        "sha256": genuine_tar.sha256,
        "forged": forged_tar.bundle,
        "libgreet": forged_libgreet.name,
    }


def test_a_forged_bundle_installs_on_its_own_records_but_not_against_an_outside_anchor(
    forged: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Its own records vouch for the forged package: with no anchor, it installs (the reason for anchors).
    assert main(["deploy", "--bundle", str(forged["forged"]), "--prefix", str(tmp_path / "unanchored")]) == 0
    assert "shows damage, not a change: pass --sha256 HEX" in " ".join(capsys.readouterr().out.split())
    assert activated(tmp_path / "unanchored", "greet") == "forged"
    prefix = tmp_path / "a" / "b" / "env"
    for anchor, message in (
        (["--sha256", forged["sha256"]], f"not the {forged['sha256']} given with --sha256"),
        (["--lock", str(forged["lock"])], f"lock differs from the trusted lock {forged['lock']}: {forged['libgreet']}"),
    ):
        code, err = run_cli(capsys, "deploy", "--bundle", str(forged["forged"]), "--prefix", str(prefix), *anchor)
        assert code == 2 and message in err and "hint: do not install this bundle" in err, err
        assert not (tmp_path / "a").exists()  # nothing left, not even the parents the install would make
    # The genuine bundle passes both anchors, and the prefix gets the trusted lock.
    code, err = run_cli(
        capsys, "deploy", "--bundle", str(forged["genuine"]), "--prefix", str(prefix),
        "--sha256", forged["sha256"].upper(), "--lock", str(forged["lock"]),
    )  # fmt: skip
    assert code == 0, err
    assert (prefix / LOCK_NAME).read_bytes() == forged["lock"].read_bytes()
    assert activated(prefix, "greet") == f"hello from {prefix}"


def test_a_trusted_lock_names_the_package_that_differs(
    forged: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The forged package under the genuine lock (an attacker who left the lock alone): named, with both digests."""
    swapped = tmp_path / "swapped.tar"
    with tarfile.open(forged["genuine"]) as genuine, tarfile.open(forged["forged"]) as fake:
        with tarfile.open(swapped, "w") as out:
            for member in genuine.getmembers():
                source = fake if member.name.endswith(forged["libgreet"]) else genuine
                info = source.getmember(member.name)
                out.addfile(info, source.extractfile(info) if info.isfile() else None)
    prefix = tmp_path / "env"
    code, err = run_cli(
        capsys, "deploy", "--bundle", str(swapped), "--prefix", str(prefix), "--lock", str(forged["lock"])
    )
    assert code == 2, err
    assert f"holds a {forged['libgreet']} whose sha256 (" in err and f"the trusted lock {forged['lock']} records" in err
    assert not prefix.exists()


def test_unpack_sh_checks_the_bundle_against_its_sha256_first(forged: dict, tmp_path: Path) -> None:
    _skip_without_unpack_tools()
    extracted = _extract_with_tar(forged["forged"], tmp_path / "bundle")
    prefix = tmp_path / "a" / "b" / "env"
    argv = ["sh", str(extracted / "unpack.sh"), "--bundle", str(forged["forged"]), "--sha256", forged["sha256"]]
    done = offline([*argv, str(prefix)], path="/usr/bin:/bin")
    assert_failed_cleanly(done, f"has the sha256 {channel.sha256_of(forged['forged'])}, not the {forged['sha256']}")
    assert not (tmp_path / "a").exists()
    # The genuine bundle's digest with the forged tree's unpack.sh (the same script) and the genuine tar: installed
    # from the checked tar, not from the forged tree beside the script.
    argv = ["sh", str(extracted / "unpack.sh"), "--bundle", str(forged["genuine"]), "--sha256", forged["sha256"]]
    done = offline([*argv, str(prefix)], path="/usr/bin:/bin")
    assert done.returncode == 0, done.stderr
    assert activated(prefix, "greet") == f"hello from {prefix}"


# ---------------------------------------------------------------------------------------------
# Defects a new user met (issue 44)
# ---------------------------------------------------------------------------------------------


def test_unpack_sh_into_a_prefix_with_a_space_writes_entry_points_that_run(
    multi: tuple[Path, Path], tmp_path: Path
) -> None:
    _skip_without_unpack_tools()
    _deployed, tar = multi
    extracted = _extract_with_tar(tar, tmp_path / "bundle")
    prefix = tmp_path / "with space" / "env"
    done = offline(["sh", str(extracted / "unpack.sh"), str(prefix)], path="/usr/bin:/bin")
    assert done.returncode == 0, done.stderr
    assert "no --bundle/--sha256 given" in done.stderr
    # As deploy --bundle writes it (rattler's /bin/sh exec form): the kernel cannot take a shebang with a space.
    bundle.install_bundle(tar, prefix=tmp_path / "with space" / "by-deploy")
    by_deploy = (tmp_path / "with space" / "by-deploy" / "bin" / "greet-py").read_text()
    assert (prefix / "bin" / "greet-py").read_text() == by_deploy.replace("by-deploy", "env")
    assert activated(prefix, "greet-py") == "greet-py says hi"




def test_unpack_sh_names_the_package_and_leaves_no_parent_folder_behind(
    multi: tuple[Path, Path], tmp_path: Path
) -> None:
    _skip_without_unpack_tools()
    _deployed, tar = multi
    extracted = _extract_with_tar(tar, tmp_path / "bundle")
    (package,) = (extracted / "channel" / str(Subdir.current())).glob("libgreet-*.conda")
    original = channel.sha256_of(package)
    package.write_bytes(package.read_bytes()[: package.stat().st_size // 2])  # no zip directory: unzip fails
    prefix = tmp_path / "a" / "b" / "env"
    done = offline(["sh", str(extracted / "unpack.sh"), str(prefix)], path="/usr/bin:/bin")
    assert_failed_cleanly(done, f"the package {package.name} in {extracted} differs from the sha256 its lock records")
    assert not (tmp_path / "a").exists()
    # Corrupt with the lock rewritten to match: it fails while installing, and takes the folders it made with it.
    lock = extracted / LOCK_NAME
    lock.write_text(lock.read_text().replace(original, channel.sha256_of(package)))
    done = offline(["sh", str(extracted / "unpack.sh"), str(prefix)], path="/usr/bin:/bin")
    assert_failed_cleanly(done, f"cannot unpack the package {package.name}")
    # Said as a damaged or changed package, not as a full disk.
    assert "changed together with that lock: do not use this bundle" in " ".join(done.stderr.split())
    assert "check free space" not in done.stderr
    assert f"nothing was installed; {tmp_path / 'a'}, which it had made, was removed" in done.stderr
    assert not (tmp_path / "a").exists()


def test_a_symlink_in_a_bundle_is_called_a_symlink(
    multi: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _deployed, tar = multi
    linked = tmp_path / "linked.tar"
    with tarfile.open(tar) as source, tarfile.open(linked, "w") as out:
        for member in source.getmembers():
            if member.name.startswith(f"channel/{Subdir.current()}"):
                continue
            out.addfile(member, source.extractfile(member) if member.isfile() else None)
        link = tarfile.TarInfo(f"channel/{Subdir.current()}")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc"
        out.addfile(link)
    prefix = tmp_path / "env"
    code, err = run_cli(capsys, "deploy", "--bundle", str(linked), "--prefix", str(prefix))
    assert code == 2 and f"it holds 'channel/{Subdir.current()}', a symbolic link (to '/etc')" in err and "hint:" in err
    argv = ["sh", str(bundle.unpack_script_path()), "--bundle", str(linked)]
    done = offline([*argv, "--sha256", channel.sha256_of(linked), str(prefix)], path="/usr/bin:/bin")
    assert_failed_cleanly(done, "holds a member that is neither a file nor a folder (a symlink")
    # Extracted by hand, the symlink is a folder's stand-in: unpack.sh says so instead of reading through it.
    extracted = _extract_with_tar(tar, tmp_path / "bundle")
    subdir = extracted / "channel" / str(Subdir.current())
    subdir.rename(tmp_path / "elsewhere")
    subdir.symlink_to(tmp_path / "elsewhere")
    done = offline(["sh", str(extracted / "unpack.sh"), str(prefix)], path="/usr/bin:/bin")
    assert_failed_cleanly(done, f"{subdir} is a symlink")
    assert not prefix.exists()


def test_pack_checks_its_output_before_it_fetches_anything(
    multi_lock: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    copy, lock = multi_lock
    shutil.rmtree(copy)  # a fetch would fail: the -o must be refused first
    out = tmp_path / "missing_dir" / "h.tar"
    code, err = run_cli(capsys, "pack", "--lock", str(lock), "-o", str(out), "--cache-dir", str(tmp_path / "cache"))
    assert code == 2 and f"cannot write {out}: the folder {out.parent} does not exist" in err, err
    assert "hint: create it first" in err and not (tmp_path / "cache").exists()


def test_pack_takes_a_channel_map_for_a_channel_that_moved(
    multi_lock: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    copy, lock = multi_lock
    moved = copy.rename(tmp_path / "moved")
    argv = ["pack", "--lock", str(lock), "-o", str(tmp_path / "env.tar"), "--cache-dir", str(tmp_path / "cache")]
    code, err = run_cli(capsys, *argv)
    assert code == 2 and f"installs from the channel {copy}, which is not there" in err, err
    assert f"if the channel moved, pass --channel-map {copy}=NEW_DIR" in err
    assert main([*argv, "--channel-map", f"{copy}={moved}", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [p["source"] for p in report["packages"]] == ["channel"] * 3
    assert bundle.install_bundle(tmp_path / "env.tar", prefix=tmp_path / "env", sha256=report["sha256"]).packages


def test_deploy_bundle_into_a_folder_holding_a_users_file_says_what_it_takes(
    multi: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _deployed, tar = multi
    prefix = tmp_path / "mine"
    prefix.mkdir()
    (prefix / "notes.txt").write_text("mine\n")
    code, err = run_cli(capsys, "deploy", "--bundle", str(tar), "--prefix", str(prefix))
    assert code == 2 and f"prefix {prefix} is not empty (it holds notes.txt)" in err
    assert "hint: pass a --prefix that does not exist yet or is an empty directory" in err
    assert "an environment channelsmith deploy made" not in err
    assert [p.name for p in prefix.iterdir()] == ["notes.txt"]
    code, err = run_cli(capsys, "deploy", "--bundle", str(tar), "--prefix", str(tmp_path / "env"), "--sha256", "abc")
    assert code == 2 and "--sha256 'abc' is not a sha256 (64 hex digits)" in err and "hint:" in err
    code, err = run_cli(capsys, "deploy", "site-env-derecho", "--prefix", str(tmp_path / "env"), "--sha256", "0" * 64)
    assert code == 2 and "--sha256 is the digest of a bundle; it takes --bundle" in err and "hint:" in err
    assert not (tmp_path / "env").exists()


# ---------------------------------------------------------------------------------------------
# Checked before anything from the bundle runs, on one read, against anchors kept apart (issue 51)
# ---------------------------------------------------------------------------------------------

PRINCIPAL = "builder@site.example"


def _keypair(folder: Path, comment: str) -> Path:
    folder.mkdir(parents=True)
    key = folder / "key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(key)], check=True)
    return key


@pytest.fixture(scope="module")
def signed(tmp_path_factory: pytest.TempPathFactory, forged: dict) -> dict[str, Path | str]:
    """The genuine greet-py bundle packed with --sign into an anchor folder, the site's signers file (one
    principal), and an intruder's key, which the signers file does not list."""
    if shutil.which("ssh-keygen") is None:
        pytest.skip("ssh-keygen (OpenSSH's client tools) is not installed: no signatures to make or check")
    work = tmp_path_factory.mktemp("signed")
    key = _keypair(work / "builder", PRINCIPAL)
    signers = work / "allowed_signers"
    signers.write_text(f"{PRINCIPAL} {' '.join(Path(f'{key}.pub').read_text().split()[:2])}\n")
    (work / "out").mkdir()
    tar = work / "out" / "env.tar"
    argv = ["pack", "--lock", str(forged["lock"]), "-o", str(tar), "--cache-dir", str(work / "cache")]
    assert main([*argv, "--anchor-dir", str(work / "anchors"), "--sign", str(key)]) == 0
    return {
        "bundle": tar,
        "anchors": work / "anchors",
        "signers": signers,
        "intruder": _keypair(work / "intruder", "intruder@elsewhere"),
        "key": key,
    }


def test_pack_writes_its_anchors_where_told_and_says_they_travel_apart(
    multi_lock: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if shutil.which("ssh-keygen") is None:
        pytest.skip("ssh-keygen (OpenSSH's client tools) is not installed")
    _copy, lock = multi_lock
    key = _keypair(tmp_path / "builder", PRINCIPAL)
    (tmp_path / "out").mkdir()
    tar = tmp_path / "out" / "env.tar"
    argv = ["pack", "--lock", str(lock), "-o", str(tar), "--cache-dir", str(tmp_path / "cache")]
    assert main([*argv, "--anchor-dir", str(tmp_path / "anchors"), "--sign", str(key)]) == 0
    said = " ".join(capsys.readouterr().out.split())
    assert "must travel to the site by another path than the bundle" in said
    assert "must reach the site by another path than the bundle" in said  # the signers file
    assert "ssh-keygen -Y verify" in said and said.index("ssh-keygen -Y verify") < said.index("tar -xf")  # check first
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["env.tar"]  # nothing travels with it by accident
    assert sorted(p.name for p in (tmp_path / "anchors").iterdir()) == ["env.tar.sha256", "env.tar.sig"]
    assert (tmp_path / "anchors" / "env.tar.sha256").read_text() == f"{channel.sha256_of(tar)}  env.tar\n"
    signers = tmp_path / "allowed_signers"
    signers.write_text(f"{PRINCIPAL} {' '.join(Path(f'{key}.pub').read_text().split()[:2])}\n")
    verify = ["ssh-keygen", "-Y", "verify", "-f", str(signers), "-I", PRINCIPAL, "-n", "channelsmith-bundle"]
    with open(tar, "rb") as data:  # OpenSSH alone checks it, as a site without channelsmith would
        signature = str(tmp_path / "anchors" / "env.tar.sig")
        subprocess.run([*verify, "-s", signature], stdin=data, check=True, capture_output=True)
    # Without --anchor-dir the digest lies beside the bundle, and the output says so; a stale signature goes.
    assert main([*argv]) == 0
    said = " ".join(capsys.readouterr().out.split())
    assert "it lies beside the bundle, pass --anchor-dir DIR" in said
    assert "sha256sum -c" in said and said.index("sha256sum -c") < said.index("tar -xf")
    # A key that cannot be read is refused before anything is fetched or written, the anchor folder included.
    other = [*argv[:3], "-o", str(tmp_path / "other.tar"), "--anchor-dir", str(tmp_path / "new-anchors")]
    code, err = run_cli(capsys, *other, "--sign", str(tmp_path / "no-key"))
    assert code == 2 and f"--sign {tmp_path / 'no-key'} is no readable key file" in err and "hint:" in err
    assert not (tmp_path / "other.tar").exists() and not (tmp_path / "new-anchors").exists()
    # A file that is no key fails only when signing, after the bundle was written: no bundle, no anchor folder.
    (tmp_path / "not-a-key").write_text("not a key\n")
    code, err = run_cli(capsys, *other, "--sign", str(tmp_path / "not-a-key"))
    assert code == 2 and f"ssh-keygen could not sign with {tmp_path / 'not-a-key'}" in err and "hint:" in err, err
    assert not (tmp_path / "other.tar").exists() and not (tmp_path / "new-anchors").exists()


def _unpack_sh(*args: str) -> subprocess.CompletedProcess[str]:
    """The checked-in unpack.sh (the one every bundle carries), run with a bare PATH."""
    return _unpack_sh_at(bundle.unpack_script_path(), *args)


def _unpack_sh_at(script: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["sh", str(script), *args], capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"})


def test_a_signed_bundle_installs_under_the_signers_file_and_json_names_the_anchor(
    signed: dict, forged: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _skip_without_unpack_tools()
    tar, sig, signers = signed["bundle"], signed["anchors"] / "env.tar.sig", signed["signers"]
    anchored = ["--allowed-signers", str(signers), "--signature", str(sig)]
    assert main(["deploy", "--bundle", str(tar), "--prefix", str(tmp_path / "d-sig"), *anchored, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["anchor"], report["signer"]) == ("signature", PRINCIPAL)
    assert activated(tmp_path / "d-sig", "greet") == f"hello from {tmp_path / 'd-sig'}"
    done = _unpack_sh("--bundle", str(tar), *anchored, "--json", str(tmp_path / "u-sig"))
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {
        "prefix": str(tmp_path / "u-sig"), "packages": 3, "anchor": "signature", "signer": PRINCIPAL
    }  # fmt: skip
    # Each route records what it checked: both anchors, the digest alone, or none.
    digest = forged["sha256"]
    for args, anchor in ((["--sha256", digest, *anchored], "signature+sha256"), (["--sha256", digest], "sha256")):
        assert main(["deploy", "--bundle", str(tar), "--prefix", str(tmp_path / f"d-{anchor}"), *args, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["anchor"] == anchor
        done = _unpack_sh("--bundle", str(tar), *args, "--json", str(tmp_path / f"u-{anchor}"))
        assert done.returncode == 0 and json.loads(done.stdout)["anchor"] == anchor, done.stderr
    assert main(["deploy", "--bundle", str(tar), "--prefix", str(tmp_path / "d-none"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["anchor"] == "none"
    extracted = _extract_with_tar(tar, tmp_path / "bundle")
    done = subprocess.run(
        ["sh", str(extracted / "unpack.sh"), "--json", str(tmp_path / "u-none")], capture_output=True, text=True
    )
    assert done.returncode == 0 and json.loads(done.stdout)["anchor"] == "none", done.stderr


def _sign(data: Path, key: Path, into: Path, namespace: str = "channelsmith-bundle") -> Path:
    subprocess.run(["ssh-keygen", "-q", "-Y", "sign", "-f", str(key), "-n", namespace, str(data)], check=True)
    return Path(f"{data}.sig").rename(into)


@pytest.mark.parametrize("case", ["unsigned", "signed-by-an-intruder", "another-bundles-signature", "other-namespace"])
def test_an_unsigned_or_wrongly_signed_bundle_is_refused_under_a_signers_file(
    signed: dict, forged: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    _skip_without_unpack_tools()
    tar = tmp_path / "env.tar"
    sig = tmp_path / "env.tar.sig"
    if case == "unsigned":
        shutil.copy(signed["bundle"], tar)
        message = f"{tar} is unsigned: its signature {sig} does not exist"
    elif case == "signed-by-an-intruder":
        shutil.copy(forged["forged"], tar)
        _sign(tar, signed["intruder"], sig)
        message = f"signature {sig} is by no key that {signed['signers']} lists"
    elif case == "another-bundles-signature":  # the forged bundle beside the genuine one's signature
        shutil.copy(forged["forged"], tar)
        shutil.copy(signed["anchors"] / "env.tar.sig", sig)
        message = f"{tar} does not match its signature {sig} by {PRINCIPAL}"
    else:  # the site's own key, but a signature made for another purpose
        shutil.copy(forged["forged"], tar)
        _sign(tar, signed["key"], sig, namespace="file")
        message = f"{tar} does not match its signature {sig} by {PRINCIPAL}"
    before = sorted(p.name for p in tmp_path.iterdir())
    prefix = tmp_path / "a" / "env"
    code, err = run_cli(
        capsys, "deploy", "--bundle", str(tar), "--prefix", str(prefix), "--allowed-signers", str(signed["signers"])
    )
    assert code == 2 and message in err and "hint: do not install" in err, err
    done = _unpack_sh("--bundle", str(tar), "--allowed-signers", str(signed["signers"]), str(prefix))
    assert_failed_cleanly(done, message)
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing in or beside the prefix


def test_require_anchor_refuses_an_unanchored_bundle_on_both_routes(
    multi: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _skip_without_unpack_tools()
    _deployed, tar = multi
    extracted = _extract_with_tar(tar, tmp_path / "bundle")
    prefix = tmp_path / "env"
    monkeypatch.setenv("CHANNELSMITH_REQUIRE_ANCHOR", "1")
    code, err = run_cli(capsys, "deploy", "--bundle", str(tar), "--prefix", str(prefix))
    assert code == 2 and "comes with no outside anchor, and CHANNELSMITH_REQUIRE_ANCHOR=1 refuses" in err, err
    assert "hint: pass --sha256 HEX" in err
    done = subprocess.run(
        ["sh", str(extracted / "unpack.sh"), str(prefix)],
        capture_output=True, text=True, env={"PATH": "/usr/bin:/bin", "CHANNELSMITH_REQUIRE_ANCHOR": "1"},
    )  # fmt: skip
    assert_failed_cleanly(done, "no outside anchor given, and CHANNELSMITH_REQUIRE_ANCHOR=1 refuses")
    assert not prefix.exists()
    monkeypatch.setenv("CHANNELSMITH_REQUIRE_ANCHOR", "yes")
    code, err = run_cli(capsys, "deploy", "--bundle", str(tar), "--prefix", str(prefix))
    assert code == 2 and "CHANNELSMITH_REQUIRE_ANCHOR='yes' is neither 1 nor 0" in err, err
    # With an anchor, the setting lets it through.
    monkeypatch.setenv("CHANNELSMITH_REQUIRE_ANCHOR", "1")
    digest = channel.sha256_of(tar)
    code, err = run_cli(capsys, "deploy", "--bundle", str(tar), "--prefix", str(prefix), "--sha256", digest)
    assert code == 0, err


EXAMPLES = Path(__file__).parent.parent / "examples"


def _documented(anchor: str) -> list[str]:
    """docs/howto/air-gap.md's step 3' for ``anchor``: the example script it shows (tests/test_examples.py checks
    that the block equals the file), run with sh as the docs say."""
    # Named whole: examples/check_docs.py counts an example as run by the tests when a test module names its file.
    script = {"sha256": "examples/airgap_check_sha256.sh", "signature": "examples/airgap_check_signature.sh"}[anchor]
    return ["sh", str(EXAMPLES.parent / script)]


def _edited_unpack_sh(forged: Path, into: Path) -> Path:
    """The forged bundle with an unpack.sh that skips every check of the bundle file (its first lines drop
    --bundle and the anchors), all else as packed: what issue 51 installed with the genuine digest given."""
    with tarfile.open(forged) as source, tarfile.open(into, "w") as out:
        for member in source.getmembers():
            data = source.extractfile(member).read() if member.isfile() else None
            if member.name == bundle.UNPACK_SCRIPT:
                data = data.replace(b"\nset -eu\n", b'\nset -eu\nfor a; do prefix=$a; done; set -- "$prefix"\n', 1)
                member.size = len(data)
            out.addfile(member, io.BytesIO(data) if data is not None else None)
    return into


@pytest.mark.parametrize("anchor", ["sha256", "signature"])
def test_the_documented_flow_installs_the_genuine_bundle_and_refuses_an_edited_unpack_sh(
    signed: dict, forged: dict, tmp_path: Path, anchor: str
) -> None:
    _skip_without_unpack_tools()
    block = _documented(anchor)
    env = {
        "PATH": "/usr/bin:/bin", "ANCHORS": str(signed["anchors"]), "HEX": forged["sha256"],
        "SIGNERS": str(signed["signers"]), "PRINCIPAL": PRINCIPAL,
    }  # fmt: skip
    here = tmp_path / "genuine"
    here.mkdir()
    shutil.copy(signed["bundle"], here / "env.tar")
    ok = {**env, "PREFIX": str(tmp_path / "ok")}
    done = subprocess.run(block, cwd=here, capture_output=True, text=True, env=ok)
    assert done.returncode == 0, done.stderr
    assert activated(tmp_path / "ok", "greet") == f"hello from {tmp_path / 'ok'}"
    # The edited script alone installs the forged package when run (as issue 51 found) ...
    here = tmp_path / "edited"
    here.mkdir()
    edited = _edited_unpack_sh(forged["forged"], here / "env.tar")
    extracted = _extract_with_tar(edited, tmp_path / "bundle")
    argv = ["sh", str(extracted / "unpack.sh"), "--bundle", str(edited), "--sha256", forged["sha256"]]
    ran = subprocess.run([*argv, str(tmp_path / "r")], capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"})
    assert ran.returncode == 0 and activated(tmp_path / "r", "greet") == "forged", ran.stderr
    # ... and the documented flow never runs it: the site's check refuses the bundle first, exit 2.
    prefix = tmp_path / "refused" / "env"
    refused = {**env, "PREFIX": str(prefix)}
    done = subprocess.run(block, cwd=here, capture_output=True, text=True, env=refused)
    assert done.returncode == 2, done.stderr
    assert not (tmp_path / "refused").exists()
    assert sorted(p.name for p in here.iterdir()) == ["env.tar"]
    if anchor == "signature":  # the genuine bundle with no signature where the site looks: refused too
        unsigned = {**refused, "ANCHORS": str(tmp_path / "nothing-here")}
        here = tmp_path / "unsigned"
        here.mkdir()
        shutil.copy(signed["bundle"], here / "env.tar")
        done = subprocess.run(block, cwd=here, capture_output=True, text=True, env=unsigned)
        assert done.returncode == 2, done.stderr
        assert not (tmp_path / "refused").exists()


# A swap each millisecond: an install takes tens of milliseconds, so the bundle still changes many times
# during each one. Measured with today's unpack.sh made to hash, list and extract the bundle by name
# (three reads, no private copy): it installed the forged one in 12-19 of 100 installs at this pace,
# 17-20 swapping flat out. Flat out, the swapper also held a whole CPU for the test's length, which the
# rest of the run on two cores waited for. INSTALLS per route: at 12 in 100, sixty installs without the
# forged one would pass that unpack.sh in 0.05 % of runs (0.88**60); a hundred cost 15 s of the run's wall
# time per route on the 2-core CI machine, sixty 9 s.
INSTALLS = 60
SWAPPER = """
import os, sys, time
genuine, forged, target, stop = sys.argv[1:]
spare = target + ".next"
while not os.path.exists(stop):
    for source in (genuine, forged):
        os.link(source, spare)
        os.replace(spare, target)  # atomic: a reader opens the one or the other, whole
        time.sleep(0.001)
"""


@pytest.mark.parametrize("route", ["unpack.sh", "documented"])
def test_no_swapped_bytes_are_installed(forged: dict, tmp_path: Path, route: str) -> None:
    """Another process swaps the bundle between a genuine and a forged one by atomic rename during INSTALLS
    installs, by unpack.sh itself and by docs/howto/air-gap.md's step 3' as written. unpack.sh copies it once and
    checks, lists and extracts that copy, so each install takes the genuine package or is refused, never
    the forged one (the unpack.sh of e67071f took it in 28 of 100)."""
    _skip_without_unpack_tools()
    target, stop = tmp_path / "env.tar", tmp_path / "stop"
    shutil.copy(forged["genuine_small"], target)
    anchors = tmp_path / "anchors"
    anchors.mkdir()
    (anchors / "env.tar.sha256").write_text(f"{forged['small_sha256']}  env.tar\n")
    block = _documented("sha256")
    bundles = [str(forged["genuine_small"]), str(forged["forged_small"])]
    swapper = subprocess.Popen([sys.executable, "-c", SWAPPER, *bundles, str(target), str(stop)])
    outcomes = {"genuine": 0, "refused": 0, "forged": 0}
    try:
        for run in range(INSTALLS):
            prefix = tmp_path / f"env{run}"
            if route == "unpack.sh":
                done = _unpack_sh("--bundle", str(target), "--sha256", forged["small_sha256"], str(prefix))
            else:
                env = {"PATH": "/usr/bin:/bin", "ANCHORS": str(anchors), "HEX": forged["small_sha256"]}
                env["PREFIX"] = str(prefix)
                done = subprocess.run(block, cwd=tmp_path, capture_output=True, text=True, env=env)
            if done.returncode == 2:
                outcomes["refused"] += 1
                assert not prefix.exists()
                continue
            assert done.returncode == 0, done.stderr
            outcomes["forged" if "forged" in (prefix / "bin" / "greet").read_text() else "genuine"] += 1
            shutil.rmtree(prefix)
    finally:
        stop.touch()
        swapper.wait(timeout=10)
    assert outcomes["forged"] == 0, outcomes
    assert outcomes["genuine"] > 0 and outcomes["refused"] > 0, outcomes  # the swap did land both ways
    assert sorted(p.name for p in tmp_path.iterdir()) == ["anchors", "env.tar", "stop"]


def test_a_digest_in_any_case_or_padded_with_blanks_is_taken_by_both_routes(forged: dict, tmp_path: Path) -> None:
    _skip_without_unpack_tools()
    padded = f"  {forged['sha256'].upper()} "
    assert bundle.install_bundle(forged["genuine"], prefix=tmp_path / "d", sha256=padded).anchor == "sha256"
    done = _unpack_sh("--bundle", str(forged["genuine"]), "--sha256", padded, str(tmp_path / "u"))
    assert done.returncode == 0, done.stderr


def test_an_unquoted_digest_file_is_said_to_be_one(
    forged: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--sha256 $(cat env.tar.sha256)` unquoted splits into the digest and the bundle's name; quoted, it is
    the whole line. Both routes say what was wrong instead of 'takes no specs' or 'two prefixes given'."""
    _skip_without_unpack_tools()
    tar, digest = forged["genuine"], forged["sha256"]
    prefix = tmp_path / "env"
    code, err = run_cli(capsys, "deploy", "--bundle", str(tar), "--sha256", digest, tar.name, "--prefix", str(prefix))
    assert code == 2 and f"is followed by '{tar.name}', the second word of FILE.tar.sha256" in err, err
    assert "hint: pass its first word only" in err
    done = _unpack_sh("--bundle", str(tar), "--sha256", digest, tar.name, str(prefix))
    assert_failed_cleanly(done, f"is followed by '{tar.name}', the second word of FILE.tar.sha256")
    line = f"{digest}  {tar.name}"
    code, err = run_cli(capsys, "deploy", "--bundle", str(tar), "--sha256", line, "--prefix", str(prefix))
    assert code == 2 and "is a whole line of FILE.tar.sha256, not the digest alone" in err, err
    done = _unpack_sh("--bundle", str(tar), "--sha256", line, str(prefix))
    assert_failed_cleanly(done, "is a whole line of FILE.tar.sha256, not the digest alone")
    assert not prefix.exists()


def test_a_duplicate_member_is_refused_and_leaves_nothing_in_tmpdir(
    multi: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _deployed, tar = multi
    doubled = tmp_path / "doubled.tar"
    with tarfile.open(tar) as source, tarfile.open(doubled, "w") as out:
        for member in source.getmembers():
            out.addfile(member, source.extractfile(member) if member.isfile() else None)
        lock = source.getmember(LOCK_NAME)
        out.addfile(lock, source.extractfile(lock))
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))
    monkeypatch.setattr(tempfile, "tempdir", None)  # TMPDIR is read again
    code, err = run_cli(capsys, "deploy", "--bundle", str(doubled), "--prefix", str(tmp_path / "env"))
    assert code == 2 and f"it holds '{LOCK_NAME}' twice" in err and "hint:" in err, err
    assert list(scratch.iterdir()) == []
    assert not (tmp_path / "env").exists()


def test_unpack_sh_extracted_alone_asks_for_the_tar_it_came_from(multi: tuple[Path, Path], tmp_path: Path) -> None:
    """Step 3' extracts unpack.sh alone from the checked copy; run without --bundle it says what it needs."""
    _skip_without_unpack_tools()
    _deployed, tar = multi
    subprocess.run(["tar", "-xf", str(tar), "unpack.sh"], cwd=tmp_path, check=True)
    done = _unpack_sh_at(tmp_path / "unpack.sh", str(tmp_path / "env"))
    assert_failed_cleanly(done, f"{tmp_path} is not an extracted channelsmith bundle")
    assert "hint: pass the checked tar it came from: sh unpack.sh --bundle FILE.tar" in " ".join(done.stderr.split())
    assert not (tmp_path / "env").exists()


def test_signature_options_out_of_place_are_refused_on_both_routes(
    multi: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _skip_without_unpack_tools()
    _deployed, tar = multi
    prefix = tmp_path / "env"
    sig = str(tmp_path / "env.tar.sig")
    code, err = run_cli(capsys, "deploy", "--bundle", str(tar), "--prefix", str(prefix), "--signature", sig)
    assert code == 2 and "--signature is checked against a signers file; it takes --allowed-signers" in err, err
    code, err = run_cli(capsys, "deploy", "greet-py", "--prefix", str(prefix), "--allowed-signers", sig)
    assert code == 2 and "--allowed-signers and --signature check a bundle's signature; they take --bundle" in err
    missing = str(tmp_path / "no-signers")
    code, err = run_cli(capsys, "deploy", "--bundle", str(tar), "--prefix", str(prefix), "--allowed-signers", missing)
    assert code == 2 and f"--allowed-signers {missing} does not exist" in err and "hint:" in err, err
    done = _unpack_sh("--bundle", str(tar), "--sha256", channel.sha256_of(tar), "--signature", sig, str(prefix))
    assert_failed_cleanly(done, "--signature is checked against a signers file; it takes --allowed-signers")
    done = _unpack_sh("--allowed-signers", missing, str(prefix))
    assert_failed_cleanly(done, "--sha256 and --allowed-signers need --bundle FILE.tar")
    done = _unpack_sh("--bundle", str(tar), "--allowed-signers", missing, str(prefix))
    assert_failed_cleanly(done, f"--allowed-signers {missing} does not exist")
    assert not prefix.exists()


def test_the_air_gap_example_scripts_pack_on_one_side_and_install_on_the_other(multi_channel: Path, tmp_path: Path) -> None:
    """README's and docs/howto/air-gap.md's steps 1 and 3 as the files they show (examples/airgap_pack.sh,
    examples/airgap_install.sh), run with bash as a user would, the channel moved away between them."""
    if shutil.which("channelsmith") is None:
        pytest.skip("the channelsmith command is not on PATH (pip install -e .)")
    copy = tmp_path / "channel"
    shutil.copytree(multi_channel, copy)
    login = tmp_path / "login"
    login.mkdir()
    env = {**os.environ, "ENV": str(tmp_path / "deployed")}
    argv = ["bash", str(EXAMPLES / "airgap_pack.sh"), "greet-py", "--channel-dir", str(copy)]
    packed = subprocess.run(argv, cwd=login, env=env, capture_output=True, text=True)
    assert packed.returncode == 0, packed.stderr
    digest = (login / "anchors" / "env.tar.sha256").read_text().split()[0]
    assert digest in packed.stdout + packed.stderr  # pack prints what is to be carried apart
    shutil.rmtree(copy)  # the air gap: the channel the lock names is gone
    node = tmp_path / "node"
    node.mkdir()
    shutil.copy(login / "env.tar", node / "env.tar")
    prefix = tmp_path / "scratch" / "env"
    install = ["bash", str(EXAMPLES / "airgap_install.sh"), "env.tar"]
    refused = subprocess.run(install, cwd=node, env={**os.environ, "HEX": "0" * 64, "PREFIX": str(prefix)},
                             capture_output=True, text=True)  # fmt: skip
    assert refused.returncode == 2 and "sha256" in refused.stderr, refused.stderr
    assert not prefix.exists()
    done = subprocess.run(install, cwd=node, env={**os.environ, "HEX": digest, "PREFIX": str(prefix)},
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert activated(prefix, "greet") == f"hello from {prefix}"


# ---------------------------------------------------------------------------------------------
# Another user on the same node (issue 69): a TMPDIR and a package cache that user can write
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def attacker() -> Iterator[pwd.struct_passwd]:
    with other_user() as user:
        yield user


@pytest.fixture
def shared(attacker: pwd.struct_passwd) -> Iterator[Path]:
    """A folder under /tmp the attacker can reach (root's, 0755) holding ``tmp``: a TMPDIR anyone can write,
    mode 0777 without the sticky bit."""
    top = Path(tempfile.mkdtemp(prefix="channelsmith-shared-", dir="/tmp"))
    top.chmod(0o755)
    (top / "tmp").mkdir()
    (top / "tmp").chmod(0o777)
    yield top
    shutil.rmtree(top)


def _evil_bundle(forged: Path, into: Path) -> Path:
    """The forged bundle whose unpack.sh only leaves a mark in the prefix: what runs if the site's check is
    passed by one copy and the script runs another's."""
    with tarfile.open(forged) as source, tarfile.open(into, "w") as out:
        for member in source.getmembers():
            data = source.extractfile(member).read() if member.isfile() else None
            if member.name == bundle.UNPACK_SCRIPT:
                data = b'for a; do prefix=$a; done\nmkdir -p "$prefix" && echo forged >"$prefix/ran"\n'
                member.size = len(data)
            out.addfile(member, io.BytesIO(data) if data is not None else None)
    into.chmod(0o644)
    return into


def _cli_said(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    """Run the CLI in-process; (exit code, stdout and stderr with rich's line wrapping undone)."""
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, " ".join((captured.out + captured.err).split())


def _step(user: pwd.struct_passwd, *args: str) -> None:
    subprocess.run(as_user(user, *args), check=True, capture_output=True)


def _wrapped_path(folder: Path, attack: str, user: pwd.struct_passwd, forged_bundle: Path) -> str:
    """A PATH whose mktemp, sha256sum and ssh-keygen run the attacker's steps at the worst moment, every time: the
    folder mktemp -d made (``attack`` "site": the step 3' script's; "unpack": unpack.sh's) is stolen at once, and
    a forged bundle is put over env.tar in it right after sha256sum or ssh-keygen checked the copy there."""
    folder.mkdir()
    program = forged_bundle.parent / "attacker.py"  # where the attacker can read it
    program.write_text(ATTACKER)
    program.chmod(0o644)
    run_as = shlex.join(as_user(user)[:-2] + [str(program)])  # as_user's argv with the program as a file
    template = "channelsmith-unpack" if attack == "unpack" else ""
    (folder / "mktemp").write_text(
        f'#!/bin/sh\nmade=$(/usr/bin/mktemp "$@") || exit\n'
        f'case "$*" in *-d*{template}*) {run_as} steal "$made" ;; esac\necho "$made"\n'
    )
    for tool in ("sha256sum", "ssh-keygen"):
        (folder / tool).write_text(
            f'#!/bin/sh\n/usr/bin/{tool} "$@" || exit\n'
            f'if [ -f env.tar ] && [ "$(stat -c %u .)" != "$(id -u)" ]; then\n'
            f'    {run_as} swap {shlex.quote(str(forged_bundle))} "$PWD/env.tar"\nfi\n'
        )
    for tool in folder.iterdir():
        tool.chmod(0o755)
    return f"{folder}:/usr/bin:/bin"


@pytest.mark.parametrize("route", ["sha256", "signature"])
def test_step_3_scripts_install_nothing_forged_when_another_user_swaps_their_folder(
    signed: dict, forged: dict, shared: Path, attacker: pwd.struct_passwd, tmp_path: Path, route: str
) -> None:
    """Another user renames away the folder the step 3' script made in a TMPDIR anyone can write, puts their own
    in its place, and after the check renames a forged bundle over the copy in it: the script stays in the folder
    it made and checks that it is its own, so it refuses (exit 2) instead of running the forged unpack.sh."""
    _skip_without_unpack_tools()
    forged_bundle = _evil_bundle(forged["forged"], shared / "forged.tar")
    path = _wrapped_path(tmp_path / "bin", "site", attacker, forged_bundle)
    here = tmp_path / "node"
    here.mkdir()
    shutil.copy(signed["bundle"], here / "env.tar")
    env = {
        "PATH": path, "TMPDIR": str(shared / "tmp"), "ANCHORS": str(signed["anchors"]),
        "HEX": forged["sha256"], "SIGNERS": str(signed["signers"]), "PRINCIPAL": PRINCIPAL,
        "PREFIX": str(tmp_path / "env"),
    }  # fmt: skip
    done = subprocess.run(_documented(route), cwd=here, capture_output=True, text=True, env=env)
    assert done.returncode == 2, done.stderr
    assert "is not yours alone: set TMPDIR" in done.stderr
    assert not (tmp_path / "env").exists()
    # Without the attacker the same script installs the genuine bundle from that TMPDIR.
    env["PATH"] = "/usr/bin:/bin"
    done = subprocess.run(_documented(route), cwd=here, capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    assert activated(tmp_path / "env", "greet") == f"hello from {tmp_path / 'env'}"


def test_unpack_sh_refuses_a_scratch_folder_another_user_swapped(
    forged: dict, shared: Path, attacker: pwd.struct_passwd, tmp_path: Path
) -> None:
    _skip_without_unpack_tools()
    forged_bundle = _evil_bundle(forged["forged"], shared / "forged.tar")
    path = _wrapped_path(tmp_path / "bin", "unpack", attacker, forged_bundle)
    argv = ["sh", str(bundle.unpack_script_path()), "--bundle", str(forged["genuine"]), "--sha256", forged["sha256"]]
    env = {"PATH": path, "TMPDIR": str(shared / "tmp")}
    done = subprocess.run([*argv, str(tmp_path / "env")], capture_output=True, text=True, env=env)
    assert_failed_cleanly(done, "is not a folder of yours alone")
    assert "another user can write" in done.stderr and "hint: point TMPDIR at a folder only you can write" in done.stderr
    assert not (tmp_path / "env").exists()


def test_deploy_bundle_keeps_its_checked_copy_where_no_other_user_can_change_it(
    forged: dict, shared: Path, attacker: pwd.struct_passwd, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """With a TMPDIR anyone can write, deploy --bundle extracts beside the prefix when no one else can change that
    folder (TMPDIR is left alone, so a live swapper there finds nothing), in TMPDIR when only that one is private
    (and says so), and refuses, naming both, when neither is."""
    monkeypatch.setenv("TMPDIR", str(shared / "tmp"))
    monkeypatch.setattr(tempfile, "tempdir", None)  # TMPDIR is read again
    stop = shared / "stop"
    package = shared / forged["libgreet"]
    with tarfile.open(forged["forged_small"]) as tar:
        (member,) = [m for m in tar.getmembers() if m.name.endswith(forged["libgreet"])]
        package.write_bytes(tar.extractfile(member).read())
    package.chmod(0o644)
    swapper = subprocess.Popen(as_user(attacker, "live", str(shared / "tmp"), str(shared / "x"), str(package), str(stop)))
    try:
        prefix = tmp_path / "env"
        report = bundle.install_bundle(forged["genuine_small"], prefix=prefix, sha256=forged["small_sha256"])
        assert report.notes == ()
        assert activated(prefix, "greet") == f"hello from {prefix}"
    finally:
        stop.touch()
        swapper.wait(timeout=10)
    assert list((shared / "tmp").iterdir()) == []  # nothing of the install's went there
    # The prefix's folder writable by anyone: TMPDIR private (a folder of tmp_path) takes the scratch, and it says so.
    open_parent = shared / "projects"
    open_parent.mkdir()
    open_parent.chmod(0o777)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)
    argv = ["deploy", "--bundle", str(forged["genuine_small"]), "--sha256", forged["small_sha256"]]
    code, said = _cli_said(capsys, *argv, "--prefix", str(open_parent / "env"))
    assert code == 0, said
    assert f"not to the prefix's folder {open_parent} ({open_parent} can be written by its group and others" in said
    # Both writable by anyone: refused, naming both, before anything is written.
    monkeypatch.setenv("TMPDIR", str(shared / "tmp"))
    monkeypatch.setattr(tempfile, "tempdir", None)
    code, err = run_cli(capsys, *argv, "--prefix", str(open_parent / "env2"))
    assert code == 2, err
    assert "no folder to keep the bundle's checked packages in that only you can change" in err
    assert f"TMPDIR {shared / 'tmp'} ({shared / 'tmp'} can be written by its group and others (mode 0777, not sticky)" in err
    assert "hint: point TMPDIR at a folder only you can write" in err
    assert not (open_parent / "env2").exists()


def _poisoned_cache(root: Path, forged: dict, attacker: pwd.struct_passwd) -> Path:
    """A shared package cache the attacker's group can write (root's, 0775), in which the attacker planted the
    forged libgreet's files under the genuine one's name, with a .lock naming the genuine sha256."""
    from rattler.package_streaming import extract

    cache = root / "rattler"
    pkgs = cache / "pkgs"
    pkgs.mkdir(parents=True)
    os.chown(pkgs, 0, attacker.pw_gid)
    pkgs.chmod(0o775)
    cache.chmod(0o755)
    with tarfile.open(forged["forged_small"]) as tar:
        (member,) = [m for m in tar.getmembers() if m.name.endswith(forged["libgreet"])]
        archive = root / forged["libgreet"]
        archive.write_bytes(tar.extractfile(member).read())
    tree = root / "forged-tree"
    extract(archive, tree)
    for path in (tree, *tree.rglob("*")):
        path.chmod(0o755 if path.is_dir() else 0o644)
    (_platform, records) = lock_records(forged["lock"])
    (genuine,) = [r for r in records if r.name.normalized == "libgreet"]
    stem = f"libgreet-{genuine.version}-{genuine.build}"
    _step(attacker, "plant", str(tree), str(pkgs), stem, genuine.sha256.hex())
    assert (pkgs / stem / "bin" / "greet").stat().st_uid == attacker.pw_uid
    return cache


@pytest.mark.parametrize("route", ["deploy --lock", "bundle --sha256", "bundle --allowed-signers"])
def test_a_package_cache_another_user_can_write_installs_nothing_they_planted(
    forged: dict, signed: dict, multi_channel: Path, shared: Path, attacker: pwd.struct_passwd, tmp_path: Path,
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, route: str,
) -> None:  # fmt: skip
    """The forged libgreet's files planted in a group-writable shared cache under the genuine name, with the
    genuine sha256 in its .lock: py-rattler would link them. A bundle install never reads a shared cache; a deploy
    passes one over that others can write, and says so."""
    cache = _poisoned_cache(shared, forged, attacker)
    monkeypatch.setenv("RATTLER_CACHE_DIR", str(cache))
    prefix = tmp_path / "env"
    if route == "deploy --lock":
        # The genuine lock of greet-py, from the genuine channel where the lock says it is.
        code, said = _cli_said(capsys, "deploy", "--lock", str(forged["lock"]), "--prefix", str(prefix))
        assert code == 0, said
        assert f"the package cache {cache / 'pkgs'} was not used: {cache / 'pkgs'} can be written by its group" in said
    elif route == "bundle --sha256":
        assert bundle.install_bundle(forged["genuine"], prefix=prefix, sha256=forged["sha256"]).anchor == "sha256"
    else:
        sig = signed["anchors"] / "env.tar.sig"
        report = bundle.install_bundle(signed["bundle"], prefix=prefix, allowed_signers=signed["signers"], signature=sig)
        assert report.signer == PRINCIPAL
    assert f'echo "hello from {prefix}"' in (prefix / "bin" / "greet").read_text()  # the genuine script
    assert os.stat(prefix / "bin" / "greet").st_uid == 0  # no file of the attacker's is linked in


def test_a_private_shared_cache_is_used_and_an_entry_of_another_users_is_not(
    forged: dict, shared: Path, attacker: pwd.struct_passwd, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """A cache only this user can write is a deploy's (warm, as before); one holding a package of another user's
    (planted while the cache was open to them) is passed over for an install that would take that package."""
    monkeypatch.setenv("RATTLER_CACHE_DIR", str(tmp_path / "cache"))
    code, said = _cli_said(capsys, "deploy", "--lock", str(forged["lock"]), "--prefix", str(tmp_path / "warm"))
    assert code == 0 and "was not used" not in said, said
    assert any((tmp_path / "cache" / "pkgs").glob("libgreet-*"))  # the shared cache was filled
    cache = _poisoned_cache(shared, forged, attacker)
    (cache / "pkgs").chmod(0o755)  # closed again, with the planted package still in it
    monkeypatch.setenv("RATTLER_CACHE_DIR", str(cache))
    code, said = _cli_said(capsys, "deploy", "--lock", str(forged["lock"]), "--prefix", str(tmp_path / "env"))
    assert code == 0, said
    assert f"was not used: its {cache / 'pkgs'}/libgreet-" in said and f"belongs to another user (uid {attacker.pw_uid})" in said
    env = tmp_path / "env"
    assert f'echo "hello from {env}"' in (env / "bin" / "greet").read_text()


# The campaign of issue 69's "done when": RUNS installs by each route of the README while the attacker swaps
# flat out in a TMPDIR anyone can write and has poisoned a group-writable package cache.
RUNS = int(os.environ.get("CHANNELSMITH_ATTACK_RUNS", "20"))


@pytest.mark.heavy
@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "route", ["sha256 script", "signature script", "deploy --bundle --sha256", "deploy --bundle --allowed-signers",
              "deploy --lock"],
)  # fmt: skip
def test_every_route_installs_genuine_bytes_or_refuses_under_a_live_swapper_and_a_poisoned_cache(
    signed: dict, forged: dict, shared: Path, attacker: pwd.struct_passwd, tmp_path: Path, route: str
) -> None:
    _skip_without_unpack_tools()
    if shutil.which("channelsmith") is None:
        pytest.skip("the channelsmith command is not on PATH (pip install -e .)")
    cache = _poisoned_cache(shared, forged, attacker)
    evil = _evil_bundle(forged["forged"], shared / "evil.tar")
    package = shared / "package.conda"
    package.write_bytes((cache.parent / forged["libgreet"]).read_bytes())
    package.chmod(0o644)
    here = tmp_path / "node"
    here.mkdir()
    shutil.copy(signed["bundle"], here / "env.tar")
    sig = str(signed["anchors"] / "env.tar.sig")
    env = {
        **os.environ, "TMPDIR": str(shared / "tmp"), "RATTLER_CACHE_DIR": str(cache), "ANCHORS": str(signed["anchors"]),
        "HEX": forged["sha256"], "SIGNERS": str(signed["signers"]), "PRINCIPAL": PRINCIPAL,
    }  # fmt: skip
    commands = {
        "sha256 script": _documented("sha256"),
        "signature script": _documented("signature"),
        "deploy --bundle --sha256": ["channelsmith", "deploy", "--bundle", "env.tar", "--sha256", forged["sha256"]],
        "deploy --bundle --allowed-signers": ["channelsmith", "deploy", "--bundle", "env.tar", "--allowed-signers",
                                              str(signed["signers"]), "--signature", sig],  # fmt: skip
        "deploy --lock": ["channelsmith", "deploy", "--lock", str(forged["lock"])],
    }
    stop = shared / "stop"
    swapper = subprocess.Popen(
        as_user(attacker, "live", str(shared / "tmp"), str(evil), str(package), str(stop)), stdout=subprocess.PIPE, text=True
    )
    outcomes: dict[str, int] = {"genuine": 0, "refused": 0, "forged": 0}
    seconds = []
    try:
        for run in range(RUNS):
            prefix = tmp_path / f"env{run}"
            argv = commands[route]
            argv = [*argv, "--prefix", str(prefix)] if argv[0] == "channelsmith" else argv
            started = time.perf_counter()
            done = subprocess.run(argv, cwd=here, capture_output=True, text=True, env={**env, "PREFIX": str(prefix)})
            elapsed = time.perf_counter() - started
            greet = prefix / "bin" / "greet"
            if done.returncode == 2 and not prefix.exists():
                outcomes["refused"] += 1
            elif (done.returncode == 0 and greet.is_file() and f'hello from {prefix}"' in greet.read_text()
                  and not (prefix / "ran").exists() and greet.stat().st_uid == 0):  # fmt: skip
                outcomes["genuine"] += 1
                seconds.append(elapsed)
            else:
                outcomes["forged"] += 1
            shutil.rmtree(prefix, ignore_errors=True)
    finally:
        stop.touch()
        attacks, _ = swapper.communicate(timeout=10)
    print(f"{route}: {outcomes} in {RUNS} runs; attacker did {attacks.strip()}; genuine installs "
          f"{statistics.median(seconds) if seconds else float('nan'):.3f} s median")  # fmt: skip
    assert outcomes["forged"] == 0, outcomes
    assert outcomes["genuine"] + outcomes["refused"] == RUNS


def _with_extra_member(tar: Path, into: Path, name: str, data: bytes) -> Path:
    with tarfile.open(tar) as source, tarfile.open(into, "w") as out:
        for member in source.getmembers():
            out.addfile(member, source.extractfile(member) if member.isfile() else None)
        info = tarfile.TarInfo(name)
        info.size = len(data)
        out.addfile(info, io.BytesIO(data))
    return into


def test_an_anchored_bundle_with_an_absolute_member_is_refused_by_unpack_sh_too(forged: dict, tmp_path: Path) -> None:
    """GNU tar strips a leading / and would extract it; unpack.sh refuses it, as deploy --bundle does, even when
    the anchor given is the bundle's own digest (a signer's or packer's mistake, or worse)."""
    _skip_without_unpack_tools()
    tar = _with_extra_member(forged["genuine_small"], tmp_path / "abs.tar", "/tmp/channelsmith-absolute-member", b"x")
    done = _unpack_sh("--bundle", str(tar), "--sha256", channel.sha256_of(tar), str(tmp_path / "env"))
    assert_failed_cleanly(done, f"{tar} holds /tmp/channelsmith-absolute-member, a path outside the bundle")
    assert not (tmp_path / "env").exists() and not Path("/tmp/channelsmith-absolute-member").exists()


def test_deploy_bundle_refuses_a_package_its_lock_does_not_pin(
    forged: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """unpack.sh refuses a bundle holding a package its lock does not pin; deploy --bundle ignored it silently."""
    _skip_without_unpack_tools()
    subdir = str(Subdir.current())
    extra = f"channel/{subdir}/extra-1.0.0-0.conda"
    tar = _with_extra_member(forged["genuine_small"], tmp_path / "extra.tar", extra, b"not pinned")
    digest = channel.sha256_of(tar)
    code, err = run_cli(capsys, "deploy", "--bundle", str(tar), "--sha256", digest, "--prefix", str(tmp_path / "env"))
    assert code == 2 and f"it holds {extra}, which its lock channelsmith.lock does not pin" in err and "hint:" in err
    assert not (tmp_path / "env").exists()


def test_an_expired_signing_key_is_said_to_be_expired_on_both_routes(
    signed: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _skip_without_unpack_tools()
    line = signed["signers"].read_text()
    expired = tmp_path / "allowed_signers"
    expired.write_text(line.replace(f"{PRINCIPAL} ", f'{PRINCIPAL} valid-before="20200101" ', 1))
    sig = str(signed["anchors"] / "env.tar.sig")
    argv = ["--bundle", str(signed["bundle"]), "--allowed-signers", str(expired), "--signature", sig]
    code, err = run_cli(capsys, "deploy", *argv, "--prefix", str(tmp_path / "env"))
    assert code == 2 and "key has expired" in err and "hint: do not install this bundle" in err, err
    done = _unpack_sh(*argv, str(tmp_path / "env"))
    assert_failed_cleanly(done, "key has expired")
    assert not (tmp_path / "env").exists()
