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
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from channelsmith import bundle, channel
from channelsmith.cli import main
from channelsmith.deploy import LOCK_NAME, deploy, prefix_packages
from multi_env import PYTHON, build_multi_packages
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
    _platform, records = bundle.lock_records(lock_file)
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
    locked = {r.file_name: r.sha256.hex() for r in bundle.lock_records(deployed / LOCK_NAME)[1]}
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
    _platform, records = bundle.lock_records(deployed.lock_file)
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
    script = Path(bundle.__file__).parent / bundle.UNPACK_SCRIPT
    done = subprocess.run(["shellcheck", "--shell=sh", str(script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout


def test_unpack_sh_names_a_missing_tool_before_writing(derecho: tuple[Path, Path], tmp_path: Path) -> None:
    _deployed, tar = derecho
    extracted = _extract_with_tar(tar, tmp_path / "bundle")
    tools = tmp_path / "bin"  # every tool unpack.sh needs, but zstd
    tools.mkdir()
    for tool in ("cat", "chmod", "cp", "dirname", "grep", "mkdir", "mktemp", "rm", "sed", "uname", "tar", "unzip"):
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
    size = sum(r.size for r in bundle.lock_records(lock)[1])
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
    from multi_env import MULTI_RECIPES
    from rattler_build import Stage0Recipe, ToolConfiguration, VariantConfig

    work = tmp_path_factory.mktemp("forged")
    genuine_channel = work / "genuine-channel"
    shutil.copytree(multi_channel, genuine_channel)
    genuine = deploy(["greet-py"], prefix=work / "genuine", channel_dir=genuine_channel)
    genuine_tar = bundle.pack(genuine.lock_file, work / "genuine.tar", cache_dir=work / "cache")
    recipe = MULTI_RECIPES["libgreet"]
    original = """printf '#!/bin/sh\\necho "hello from %s"\\n' "$PREFIX" > $PREFIX/bin/greet"""
    assert original in recipe
    results = Stage0Recipe.from_yaml(recipe.replace(original, FORGED_GREETING)).run_build(
        variant_config=VariantConfig(),
        tool_config=ToolConfiguration(test_strategy="skip"),
        output_dir=str(work / "output"),
        channels=[channel.channel_url(channel.ensure_channel(work / "empty"))],
        no_include_recipe=True,
    )
    (forged_libgreet,) = [Path(p) for r in results for p in r.packages]
    assert forged_libgreet.name == _libgreet(multi_channel).name  # the same file name, other bytes
    others = [p for p in multi_channel.rglob("*") if p.suffix in (".conda", ".bz2") and "libgreet" not in p.name]
    forged_channel = work / "forged-channel"
    channel.publish(forged_channel, [forged_libgreet, *others])
    forged_env = deploy(["greet-py"], prefix=work / "forged", channel_dir=forged_channel)
    forged_tar = bundle.pack(forged_env.lock_file, work / "forged.tar", cache_dir=work / "cache")
    return {
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
    assert done.returncode == 2, done.stderr
    assert f"installing into {prefix} failed" in done.stderr and "nothing was left there" in done.stderr
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
    argv = ["sh", str(Path(bundle.__file__).parent / bundle.UNPACK_SCRIPT), "--bundle", str(linked)]
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
