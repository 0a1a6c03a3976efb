"""Deploying from the local channel into a prefix: strict priority, lock files, and bad input.

Everything runs offline against file:// channels: site-env built for real by the shared
``site_env_channel`` fixture, and tiny packages built by py-rattler-build (see test_channel.py).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from channelsmith import channel
from channelsmith.cli import main
from channelsmith.deploy import deploy, deploy_lock, prefix_packages, resolve_channels
from channelsmith.errors import ChannelError, SolveError
from channelsmith.lock import LOCK_NAME
from test_channel import build_tiny_packages, run_cli, snapshot

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return build_tiny_packages(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def tiny_channel(tmp_path: Path, tiny: dict[str, Path]) -> Path:
    """A fresh local channel holding alpha 1.0.0, beta (needs alpha), wants-new-alpha and needs-cuda."""
    channel_dir = tmp_path / "channel"
    channel.publish(channel_dir, [tiny[key] for key in ("alpha", "beta", "wants-new-alpha", "needs-cuda")])
    return channel_dir


def installed(prefix: Path) -> dict[str, str]:
    return {p.name: p.version for p in prefix_packages(prefix)}


def tree(prefix: Path) -> dict[str, bytes]:
    """The files a deploy put in a prefix, except the lock copy and conda's history log."""
    return {
        name: data
        for name, data in snapshot(prefix).items()
        if name not in (LOCK_NAME, "conda-meta/history") and not name.startswith("conda-meta/")
    }


# ---------------------------------------------------------------------------------------------
# site-env-derecho, end to end
# ---------------------------------------------------------------------------------------------


def test_deploy_site_env_derecho_into_a_temporary_prefix(
    site_env_channel: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prefix = tmp_path / "env"
    code = main(
        ["deploy", "site-env-derecho", "--prefix", str(prefix), "--channel-dir", str(site_env_channel), "--json"]
    )
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    # Only the local channel was consulted: no default channel, nothing over the network.
    assert report["channels"] == [site_env_channel.resolve().as_uri()]
    assert [p["name"] for p in report["packages"]] == ["site-env-derecho"]
    assert installed(prefix) == {"site-env-derecho": report["packages"][0]["version"]}
    assert (prefix / LOCK_NAME).is_file()
    activate = prefix / "etc" / "conda" / "activate.d" / "site-env-derecho.sh"
    assert activate.is_file()
    shown = subprocess.run(
        ["bash", "-c", f'CONDA_PREFIX="{prefix}"; source "{activate}"; echo "$NCCL_SOCKET_IFNAME"'],
        capture_output=True,
        text=True,
        check=True,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert shown.stdout.strip() == "hsn"


def test_lock_round_trip_gives_the_same_packages(site_env_channel: Path, tmp_path: Path) -> None:
    first = deploy(["site-env-derecho"], prefix=tmp_path / "first", channel_dir=site_env_channel)
    second = deploy_lock(first.lock_file, prefix=tmp_path / "second")
    assert second.from_lock
    key = [(p.name, p.version, p.build, p.sha256) for p in prefix_packages(tmp_path / "first")]
    assert key == [(p.name, p.version, p.build, p.sha256) for p in prefix_packages(tmp_path / "second")]
    assert all(sha for *_, sha in key)
    assert tree(tmp_path / "first") == tree(tmp_path / "second")
    assert (tmp_path / "second" / LOCK_NAME).is_file()


# ---------------------------------------------------------------------------------------------
# Solving: strict priority, locks that do not solve, virtual packages, re-deploys
# ---------------------------------------------------------------------------------------------


def test_deploy_from_a_lock_installs_the_locked_versions_not_the_newest(
    tiny_channel: Path, tiny: dict[str, Path], tmp_path: Path
) -> None:
    locked = deploy(["beta"], prefix=tmp_path / "locked", channel_dir=tiny_channel)
    assert installed(tmp_path / "locked") == {"alpha": "1.0.0", "beta": "1.0.0"}
    channel.publish(tiny_channel, [tiny["alpha-next"]])

    deploy(["beta"], prefix=tmp_path / "fresh", channel_dir=tiny_channel)
    assert installed(tmp_path / "fresh") == {"alpha": "1.1.0", "beta": "1.0.0"}

    deploy_lock(locked.lock_file, prefix=tmp_path / "again")
    assert installed(tmp_path / "again") == {"alpha": "1.0.0", "beta": "1.0.0"}


def test_the_local_channel_wins_under_strict_priority(
    tiny_channel: Path, tiny: dict[str, Path], tmp_path: Path
) -> None:
    upstream = tmp_path / "upstream"
    channel.publish(upstream, [tiny["alpha-next"], tiny["gamma"]])
    local_url, upstream_url = tiny_channel.resolve().as_uri(), upstream.resolve().as_uri()
    report = deploy(["alpha", "gamma"], prefix=tmp_path / "env", channel_dir=tiny_channel, channels=[str(upstream)])
    by_name = {p.name: (p.version, p.channel) for p in report.packages}
    # alpha exists locally, so the newer alpha upstream is not taken; gamma only exists upstream.
    assert by_name == {"alpha": ("1.0.0", local_url), "gamma": ("1.0.0", upstream_url)}

    # py-rattler 0.28 still takes a lower channel's build when a spec asks for what the local channel
    # lacks (conda's strict mode would refuse) ...
    report = deploy(["alpha >=1.1"], prefix=tmp_path / "env2", channel_dir=tiny_channel, channels=[str(upstream)])
    assert [(p.version, p.channel) for p in report.packages] == [("1.1.0", upstream_url)]
    # ... so `local::` pins a spec to the local channel.
    with pytest.raises(SolveError, match="not in requested channel"):
        deploy(["local::alpha >=1.1"], prefix=tmp_path / "env3", channel_dir=tiny_channel, channels=[str(upstream)])
    assert not (tmp_path / "env3").exists()
    report = deploy(["local::alpha"], prefix=tmp_path / "env4", channel_dir=tiny_channel, channels=[str(upstream)])
    assert [(p.version, p.channel) for p in report.packages] == [("1.0.0", local_url)]


def test_cuda_packages_follow_conda_override_cuda(
    tiny_channel: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CONDA_OVERRIDE_CUDA", "")  # no CUDA, whatever this machine has
    with pytest.raises(SolveError, match="__cuda"):
        deploy(["needs-cuda"], prefix=tmp_path / "no-gpu", channel_dir=tiny_channel)
    monkeypatch.setenv("CONDA_OVERRIDE_CUDA", "12.9")
    deploy(["needs-cuda"], prefix=tmp_path / "gpu", channel_dir=tiny_channel)
    assert installed(tmp_path / "gpu") == {"needs-cuda": "1.0.0"}


def test_a_redeploy_leaves_exactly_the_solved_packages(tiny_channel: Path, tmp_path: Path) -> None:
    prefix = tmp_path / "env"
    deploy(["beta"], prefix=prefix, channel_dir=tiny_channel)
    assert installed(prefix) == {"alpha": "1.0.0", "beta": "1.0.0"}
    deploy(["alpha"], prefix=prefix, channel_dir=tiny_channel)
    assert installed(prefix) == {"alpha": "1.0.0"}
    assert not (prefix / "share" / "beta").exists()


# ---------------------------------------------------------------------------------------------
# Bad input: exit 2, a message saying what and where, a hint, and nothing changed
# ---------------------------------------------------------------------------------------------


def test_deploy_from_a_directory_that_is_not_a_channel(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "downloads"
    folder.mkdir()
    (folder / "readme.txt").write_text("hello\n")
    prefix = tmp_path / "env"
    code, err = run_cli(capsys, "deploy", "alpha", "--prefix", str(prefix), "--channel-dir", str(folder))
    assert code == 2
    assert f"{folder} is not a conda channel" in err and "hint:" in err
    assert not prefix.exists()
    assert sorted(p.name for p in folder.iterdir()) == ["readme.txt"]


def test_deploy_from_a_missing_channel(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run_cli(
        capsys, "deploy", "alpha", "--prefix", str(tmp_path / "env"), "--channel-dir", str(tmp_path / "nope")
    )
    assert code == 2
    assert "does not exist" in err and "hint:" in err
    assert not (tmp_path / "env").exists()


def test_deploy_from_a_channel_with_corrupt_repodata(
    tiny_channel: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tiny_channel / "noarch" / "repodata.json").write_text('{"packages": [1, 2')
    before = snapshot(tiny_channel)
    prefix = tmp_path / "env"
    code, err = run_cli(capsys, "deploy", "alpha", "--prefix", str(prefix), "--channel-dir", str(tiny_channel))
    assert code == 2
    assert "corrupt repodata" in err and str(tiny_channel / "noarch" / "repodata.json") in err
    assert "--reindex" in err
    assert not prefix.exists()
    assert snapshot(tiny_channel) == before


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_deploy_of_a_corrupt_package_file_in_the_channel(
    tiny_channel: Path, tiny: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], damage: str
) -> None:
    victim = tiny_channel / "noarch" / tiny["alpha"].name
    data = bytearray(victim.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0xFF
    else:
        del data[len(data) // 2 :]
    victim.write_bytes(bytes(data))
    before = snapshot(tiny_channel)
    prefix = tmp_path / "env"
    code, err = run_cli(capsys, "deploy", "beta", "--prefix", str(prefix), "--channel-dir", str(tiny_channel))
    assert code == 2
    assert "corrupt package file" in err and str(victim) in err
    assert ("sha256" in err) if damage == "flip" else ("bytes" in err)
    assert "hint:" in err
    assert not prefix.exists()
    assert snapshot(tiny_channel) == before


def test_an_unsolvable_spec_names_the_conflict(
    tiny_channel: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prefix = tmp_path / "env"
    code, err = run_cli(
        capsys, "deploy", "wants-new-alpha", "--prefix", str(prefix), "--channel-dir", str(tiny_channel)
    )
    assert code == 2
    assert "do not solve" in err
    assert "alpha >=2" in err  # the solver's own explanation of the conflict
    assert "hint:" in err
    assert not prefix.exists()


def test_an_invalid_spec_is_a_user_error(
    tiny_channel: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = run_cli(
        capsys, "deploy", "alpha >=>1", "--prefix", str(tmp_path / "env"), "--channel-dir", str(tiny_channel)
    )
    assert code == 2
    assert "invalid package spec 'alpha >=>1'" in err and "hint:" in err
    assert not (tmp_path / "env").exists()


def _blocked_prefixes(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    # Tests may run as root, for whom chmod blocks nothing: use paths no one can create.
    regular_file = tmp_path / "a-file"
    regular_file.write_text("in the way\n")
    not_an_env = tmp_path / "project"
    not_an_env.mkdir()
    (not_an_env / "main.c").write_text("int main(void) { return 0; }\n")
    return {
        "under-a-file": (regular_file / "env", "is a file, not a directory"),
        "is-a-file": (regular_file, "is a file"),
        "in-proc": (Path("/proc/channelsmith-test/env"), "cannot be written"),
        "not-an-environment": (not_an_env, "is not empty and is not a conda environment"),
    }


@pytest.mark.parametrize("case", ["under-a-file", "is-a-file", "in-proc", "not-an-environment"])
def test_a_prefix_that_cannot_be_written(
    tiny_channel: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    prefix, message = _blocked_prefixes(tmp_path)[case]
    before = snapshot(tmp_path)
    code, err = run_cli(capsys, "deploy", "alpha", "--prefix", str(prefix), "--channel-dir", str(tiny_channel))
    assert code == 2
    assert message in err and str(prefix) in err and "hint:" in err
    assert snapshot(tmp_path) == before  # neither the prefix nor the channel changed


def test_a_lock_whose_package_changed_is_refused(
    tiny_channel: Path, tiny: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lock = deploy(["alpha"], prefix=tmp_path / "first", channel_dir=tiny_channel).lock_file
    victim = tiny_channel / "noarch" / tiny["alpha"].name
    data = bytearray(victim.read_bytes())
    data[-30] ^= 0xFF
    victim.write_bytes(bytes(data))
    code, err = run_cli(capsys, "deploy", "--lock", str(lock), "--prefix", str(tmp_path / "second"))
    assert code == 2
    assert "corrupt package file" in err and f"the lock file {lock}" in err
    assert not (tmp_path / "second").exists()


@pytest.mark.parametrize(
    "content", [None, "packages: [unclosed\n", "version: 7\nplatforms: []\nenvironments: {}\npackages: []\n"]
)
def test_a_missing_or_broken_lock_file(tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str | None) -> None:
    lock = tmp_path / "env.lock"
    if content is not None:
        lock.write_text(content)
    code, err = run_cli(capsys, "deploy", "--lock", str(lock), "--prefix", str(tmp_path / "env"))
    assert code == 2
    assert str(lock) in err and "hint:" in err
    assert not (tmp_path / "env").exists()


def test_lock_and_specs_together_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run_cli(
        capsys, "deploy", "alpha", "--lock", str(tmp_path / "x.lock"), "--prefix", str(tmp_path / "env")
    )
    assert code == 2
    assert "--lock" in err and "hint:" in err


def test_named_channels_are_passed_on_and_local_ones_checked(
    tiny_channel: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(tiny_channel, copy)
    named = ["conda-forge", "conda-forge/label/mpi-external", "https://example.org/ch/"]
    urls = resolve_channels(tiny_channel, [str(copy), copy.resolve().as_uri(), *named])
    assert urls == [
        tiny_channel.resolve().as_uri(),
        copy.resolve().as_uri(),
        "conda-forge",
        "conda-forge/label/mpi-external",
        "https://example.org/ch",
    ]
    with pytest.raises(ChannelError, match="does not exist"):
        resolve_channels(tiny_channel, [str(tmp_path / "missing")])
    # The local channel is a directory even when its relative name looks like a channel name.
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ChannelError, match="channel directory channel-here does not exist"):
        resolve_channels(Path("channel-here"), [])


# ---------------------------------------------------------------------------------------------
# A cluster deploys from a shared channel: no ./channel needed
# ---------------------------------------------------------------------------------------------


def test_deploy_from_a_shared_channel_needs_no_local_channel_directory(
    site_env_channel: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The cluster's working directory has no ./channel; the packages live in a shared directory.
    workdir = tmp_path / "login-node"
    workdir.mkdir()
    monkeypatch.chdir(workdir)
    code = main(["deploy", "site-env-derecho", "--prefix", "env", "-c", str(site_env_channel), "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["channels"] == [site_env_channel.resolve().as_uri()]
    assert installed(workdir / "env") == {"site-env-derecho": report["packages"][0]["version"]}
    assert not (workdir / "channel").exists()


def test_an_existing_dot_channel_is_still_searched_first_by_default(
    tiny_channel: Path, site_env_channel: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    monkeypatch.chdir(tiny_channel.parent)  # holds ./channel
    code = main(["deploy", "site-env-derecho", "--prefix", str(tmp_path / "env"), "-c", str(site_env_channel), "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["channels"] == [tiny_channel.resolve().as_uri(), site_env_channel.resolve().as_uri()]


def test_no_local_channel_and_no_c_channel_is_a_user_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    code, err = run_cli(capsys, "deploy", "site-env-derecho", "--prefix", "env")
    assert code == 2
    assert "no channel to deploy from" in err and "-c CHANNEL" in err
    assert not (tmp_path / "env").exists()


def test_local_pin_without_a_local_channel_is_a_user_error(
    site_env_channel: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    code, err = run_cli(capsys, "deploy", "local::site-env-derecho", "--prefix", "env", "-c", str(site_env_channel))
    assert code == 2
    assert "no local channel" in err and "--channel-dir" in err
    assert not (tmp_path / "env").exists()


def test_an_explicit_channel_dir_that_does_not_exist_is_still_an_error(
    site_env_channel: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, err = run_cli(
        capsys, "deploy", "site-env-derecho", "--prefix", str(tmp_path / "env"),
        "--channel-dir", str(tmp_path / "nope"), "-c", str(site_env_channel),
    )  # fmt: skip
    assert code == 2
    assert "does not exist" in err
    assert not (tmp_path / "env").exists()


# ---------------------------------------------------------------------------------------------
# Locks whose channel moved (--channel-map), and a prefix given for the lock file
# ---------------------------------------------------------------------------------------------


def test_a_lock_whose_channel_moved_says_so_and_channel_map_deploys_it(
    tiny_channel: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first = deploy(["beta"], prefix=tmp_path / "first", channel_dir=tiny_channel)
    moved = tmp_path / "moved" / "channel"
    moved.parent.mkdir()
    shutil.move(tiny_channel, moved)

    code, err = run_cli(capsys, "deploy", "--lock", str(first.lock_file), "--prefix", str(tmp_path / "second"))
    assert code == 2
    assert f"installs from the channel {tiny_channel.resolve()}, which is not there" in err
    assert f"--channel-map {tiny_channel.resolve()}=NEW_DIR" in err
    assert "rebuild the index" not in err and not (tmp_path / "second").exists()

    code, err = run_cli(
        capsys, "deploy", "--lock", str(first.lock_file), "--prefix", str(tmp_path / "second"),
        "--channel-map", f"{tiny_channel}={moved}",
    )  # fmt: skip
    assert code == 0, err
    assert installed(tmp_path / "second") == installed(tmp_path / "first")
    assert tree(tmp_path / "second") == tree(tmp_path / "first")
    # The new lock records where the packages are now: it deploys without a map.
    new_lock = (tmp_path / "second" / LOCK_NAME).read_text()
    assert moved.resolve().as_uri() in new_lock and f"{tiny_channel.resolve().as_uri()}/" not in new_lock
    deploy_lock(tmp_path / "second" / LOCK_NAME, prefix=tmp_path / "third")
    assert installed(tmp_path / "third") == installed(tmp_path / "first")


def test_a_channel_map_keeps_the_lock_s_sha256_and_its_channels(
    tiny_channel: Path, tiny: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lock = deploy(["alpha"], prefix=tmp_path / "first", channel_dir=tiny_channel).lock_file
    other = tmp_path / "other"
    shutil.copytree(tiny_channel, other)
    victim = other / "noarch" / tiny["alpha"].name  # same name and size in the other channel, other bytes
    data = bytearray(victim.read_bytes())
    data[-30] ^= 0xFF
    victim.write_bytes(bytes(data))
    code, err = run_cli(
        capsys, "deploy", "--lock", str(lock), "--prefix", str(tmp_path / "second"), "--channel-map",
        f"{tiny_channel}={other}",
    )  # fmt: skip
    assert code == 2 and "corrupt package file" in err and "pins" in err and "rebuild the index" not in err
    code, err = run_cli(
        capsys, "deploy", "--lock", str(lock), "--prefix", str(tmp_path / "second"), "--channel-map",
        f"{tmp_path / 'nowhere'}={other}",
    )  # fmt: skip
    assert code == 2 and "names no such channel" in err and tiny_channel.resolve().as_uri() in err
    assert not (tmp_path / "second").exists()


def test_a_prefix_given_as_the_lock_file_names_the_lock_inside_it(
    tiny_channel: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    deploy(["alpha"], prefix=tmp_path / "env", channel_dir=tiny_channel)
    code, err = run_cli(capsys, "deploy", "--lock", str(tmp_path / "env"), "--prefix", str(tmp_path / "again"))
    assert code == 2
    assert f"lock file {tmp_path / 'env'} is a directory" in err and "does not exist" not in err
    assert f"--lock {tmp_path / 'env' / LOCK_NAME}" in err


def test_the_quick_start_of_docs_deploy_runs_as_written(tmp_path: Path) -> None:
    """examples/publish_and_deploy.sh, the first block of docs/howto/deploy.md, run with bash in an empty folder
    (channelsmith pointed at this repository, which a user's folder inside the checkout finds by itself)."""
    script = "\n".join([
        f'channelsmith() {{ "{sys.executable}" -m channelsmith --root "{REPO_ROOT}" "$@"; }}',
        "export -f channelsmith",
        f'bash "{REPO_ROOT / "examples" / "publish_and_deploy.sh"}"',
    ])  # fmt: skip
    done = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert installed(tmp_path / "env2") == installed(tmp_path / "env") == {"site-env-derecho": "1.0.0"}
    # The lock after its channel moved (docs/howto/deploy.md, "Lock files"): taken from the new place, recorded there.
    assert installed(tmp_path / "env3") == {"site-env-derecho": "1.0.0"} and not (tmp_path / "channel").exists()
    assert str(tmp_path / "moved") in (tmp_path / "env3" / LOCK_NAME).read_text()


def test_a_package_in_the_users_own_cache_is_linked_without_a_new_hash(
    site_env_channel: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What docs/howto/deploy.md says of the shared cache: a cached package is not hashed again against the lock; the
    check made is who could have written it (the user alone, here). A file changed inside the user's own cache,
    to another size even, is what the next deploy installs. Should py-rattler start checking, this fails and
    that sentence must change."""
    monkeypatch.setenv("RATTLER_CACHE_DIR", str(tmp_path / "cache"))
    first = deploy(["site-env-derecho"], prefix=tmp_path / "first", channel_dir=site_env_channel)
    (cached,) = (tmp_path / "cache" / "pkgs").glob("site-env-derecho-*/etc/conda/activate.d/site-env-derecho.sh")
    changed = b"# changed inside the cache\n" + cached.read_bytes()
    cached.unlink()  # a new file: the first prefix keeps its hard link to the genuine one
    cached.write_bytes(changed)
    deploy_lock(first.lock_file, prefix=tmp_path / "second")
    assert (tmp_path / "second" / "etc" / "conda" / "activate.d" / "site-env-derecho.sh").read_bytes() == changed
    assert (tmp_path / "first" / "etc" / "conda" / "activate.d" / "site-env-derecho.sh").read_bytes() != changed
