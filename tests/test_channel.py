"""The local channel: creation, checks, publishing under a lock, and surviving a publish killed half-way.

The packages here are real conda packages built by py-rattler-build from tiny recipes (a fraction of
a second each); the publishes that get killed or race each other run in real subprocesses.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from channelsmith import channel
from channelsmith.cli import main
from channelsmith.errors import ChannelError
from rattler_build import Stage0Recipe, ToolConfiguration, VariantConfig

# name -> (version, run requirements, noarch?)
TINY_RECIPES = {
    "alpha": ("1.0.0", [], True),
    "alpha-next": ("1.1.0", [], True),  # built as package "alpha" version 1.1.0
    "beta": ("1.0.0", ["alpha"], True),
    "wants-new-alpha": ("1.0.0", ["alpha >=2"], True),
    "needs-cuda": ("1.0.0", ["__cuda >=12"], True),
    "native-tool": ("1.0.0", [], False),  # a linux-64 package, so publishes touch two subdirs
    "gamma": ("1.0.0", [], True),
    "delta": ("1.0.0", [], True),
}


def _tiny_recipe(key: str) -> str:
    version, run, noarch = TINY_RECIPES[key]
    name = "alpha" if key == "alpha-next" else key
    noarch_line = "  noarch: generic\n" if noarch else ""
    return (
        f'package:\n  name: {name}\n  version: "{version}"\n'
        f"build:\n  number: 0\n{noarch_line}"
        f"  script:\n    - mkdir -p $PREFIX/share/{name}\n"
        f"    - echo {name} {version} > $PREFIX/share/{name}/{name}.txt\n"
        f"requirements:\n  run: {json.dumps(run)}\n"
        f"about:\n  license: Apache-2.0\n  summary: channelsmith test package {name}\n"
    )


def build_tiny_packages(work: Path) -> dict[str, Path]:
    """Build every TINY_RECIPES entry with py-rattler-build, offline; key -> the .conda file."""
    empty = channel.ensure_channel(work / "empty-channel")
    output = work / "output"
    packages = {}
    for key in TINY_RECIPES:
        recipe = Stage0Recipe.from_yaml(_tiny_recipe(key), recipe_dir=work / "recipes" / key)
        results = recipe.run_build(
            variant_config=VariantConfig(),
            tool_config=ToolConfiguration(test_strategy="skip"),
            output_dir=str(output),
            channels=[channel.channel_url(empty)],
            no_include_recipe=True,
        )
        (packages[key],) = [path for result in results for path in result.packages]
    return packages


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return build_tiny_packages(tmp_path_factory.mktemp("tiny"))


def snapshot(directory: Path) -> dict[str, bytes]:
    """Every file under a directory (lock file excluded) with its content, to prove nothing changed."""
    return {
        str(path.relative_to(directory)): path.read_bytes()
        for path in sorted(directory.rglob("*"))
        if path.is_file() and path.name != channel.LOCK_FILE
    }


def assert_repodata_matches_files(channel_dir: Path) -> set[str]:
    """Independently of channelsmith: each subdir's repodata parses and lists only intact files.

    Returns the listed file names (subdir/name).
    """
    listed = set()
    for repodata in channel_dir.glob("*/repodata.json"):
        document = json.loads(repodata.read_text())
        for key in ("packages", "packages.conda"):
            for name, entry in document.get(key, {}).items():
                path = repodata.parent / name
                assert path.is_file(), f"{path} is listed but missing"
                data = path.read_bytes()
                assert len(data) == entry["size"], f"{path} size differs from repodata"
                assert hashlib.sha256(data).hexdigest() == entry["sha256"], f"{path} sha256 differs from repodata"
                listed.add(f"{repodata.parent.name}/{name}")
    return listed


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    """Run the channelsmith CLI in-process; (exit code, stderr with rich's line wrapping undone)."""
    code = main(list(argv))
    return code, " ".join(capsys.readouterr().err.split())


# ---------------------------------------------------------------------------------------------
# Creating and checking
# ---------------------------------------------------------------------------------------------


def test_ensure_channel_creates_an_indexed_empty_channel(tmp_path: Path) -> None:
    channel_dir = channel.ensure_channel(tmp_path / "new" / "channel")
    assert sorted(p.name for p in channel_dir.iterdir()) == ["linux-64", "noarch"]
    report = channel.check_channel(channel_dir)
    assert {s.name for s in report.subdirs} == {"noarch", "linux-64"}
    assert report.packages == 0
    assert report.url == channel_dir.resolve().as_uri()


def test_ensure_channel_turns_an_empty_directory_into_a_channel(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    channel.ensure_channel(tmp_path / "empty")
    assert channel.is_channel(tmp_path / "empty")


def test_ensure_channel_refuses_a_directory_that_is_not_a_channel(tmp_path: Path) -> None:
    folder = tmp_path / "photos"
    folder.mkdir()
    (folder / "cat.jpg").write_bytes(b"not a package")
    with pytest.raises(ChannelError, match="not empty and is not a conda channel"):
        channel.ensure_channel(folder)
    assert sorted(p.name for p in folder.iterdir()) == ["cat.jpg"]


def test_check_channel_reports_unlisted_package_files(tmp_path: Path, tiny: dict[str, Path]) -> None:
    channel_dir = channel.ensure_channel(tmp_path / "channel")
    shutil.copy(tiny["gamma"], channel_dir / "noarch")
    report = channel.check_channel(channel_dir)
    assert report.unlisted == (channel_dir / "noarch" / tiny["gamma"].name,)
    assert report.packages == 0


# ---------------------------------------------------------------------------------------------
# Publishing
# ---------------------------------------------------------------------------------------------


def test_publish_lists_packages_in_their_subdirs(tmp_path: Path, tiny: dict[str, Path]) -> None:
    channel_dir = tmp_path / "channel"
    published = channel.publish(channel_dir, [tiny["alpha"], tiny["native-tool"]])
    assert published == [
        channel_dir / "noarch" / tiny["alpha"].name,
        channel_dir / "linux-64" / tiny["native-tool"].name,
    ]
    assert assert_repodata_matches_files(channel_dir) == {
        f"noarch/{tiny['alpha'].name}",
        f"linux-64/{tiny['native-tool'].name}",
    }
    # Publishing the same file again changes nothing.
    before = snapshot(channel_dir)
    channel.publish(channel_dir, [tiny["alpha"]])
    assert snapshot(channel_dir) == before


def test_publish_refuses_a_changed_file_under_an_existing_name(tmp_path: Path, tiny: dict[str, Path]) -> None:
    channel_dir = tmp_path / "channel"
    channel.publish(channel_dir, [tiny["alpha"]])
    # alpha rebuilt with different content: the build string hashes the variant, not the script,
    # so the file name is the same while the bytes differ.
    recipe = Stage0Recipe.from_yaml(_tiny_recipe("alpha").replace("echo alpha", "echo changed"),
                                   recipe_dir=tmp_path / "recipe")
    results = recipe.run_build(
        variant_config=VariantConfig(),
        tool_config=ToolConfiguration(test_strategy="skip"),
        output_dir=str(tmp_path / "rebuild"),
        channels=[channel.channel_url(channel_dir)],
        no_include_recipe=True,
    )
    rebuilt = results[0].packages[0]
    if rebuilt.name != tiny["alpha"].name:
        pytest.skip("the rebuilt package got a different build string; nothing to compare")
    assert hashlib.sha256(rebuilt.read_bytes()).digest() != hashlib.sha256(tiny["alpha"].read_bytes()).digest()
    before = snapshot(channel_dir)
    with pytest.raises(ChannelError, match="already exists with different content"):
        channel.publish(channel_dir, [rebuilt])
    assert snapshot(channel_dir) == before


def test_publish_of_a_corrupt_archive_names_it_and_writes_nothing(
    tmp_path: Path, tiny: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    channel_dir = tmp_path / "channel"
    channel.publish(channel_dir, [tiny["alpha"]])
    before = snapshot(channel_dir)
    broken = tmp_path / tiny["gamma"].name
    data = bytearray(tiny["gamma"].read_bytes())
    middle = len(data) // 2
    data[middle : middle + 32] = bytes(32)
    broken.write_bytes(bytes(data))
    code, err = run_cli(capsys, "publish", "--channel-dir", str(channel_dir), str(tiny["delta"]), str(broken))
    assert code == 2
    assert "corrupt package file" in err and broken.name in err
    assert "hint:" in err
    assert snapshot(channel_dir) == before  # delta, which was sound, did not land either


def test_publish_into_a_directory_that_is_not_a_channel_fails_untouched(
    tmp_path: Path, tiny: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "todo.txt").write_text("buy milk\n")
    code, err = run_cli(capsys, "publish", "--channel-dir", str(folder), str(tiny["alpha"]))
    assert code == 2
    assert "is not a conda channel" in err and str(folder) in err
    assert "hint:" in err
    assert sorted(p.name for p in folder.iterdir()) == ["todo.txt"]


def test_publish_into_a_channel_with_corrupt_repodata_fails_untouched(
    tmp_path: Path, tiny: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    channel_dir = tmp_path / "channel"
    channel.publish(channel_dir, [tiny["alpha"]])
    (channel_dir / "noarch" / "repodata.json").write_text('{"packages": {"alpha-1.0.0')
    before = snapshot(channel_dir)
    code, err = run_cli(capsys, "publish", "--channel-dir", str(channel_dir), str(tiny["gamma"]))
    assert code == 2
    assert "corrupt repodata" in err and "noarch/repodata.json" in err and "line 1" in err
    assert "--reindex" in err
    assert snapshot(channel_dir) == before


def test_publish_into_a_channel_holding_a_corrupt_package_fails_untouched(
    tmp_path: Path, tiny: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    channel_dir = tmp_path / "channel"
    channel.publish(channel_dir, [tiny["alpha"]])
    listed = channel_dir / "noarch" / tiny["alpha"].name
    data = bytearray(listed.read_bytes())
    data[-40:-20] = bytes(20)  # same size, different bytes: only the sha256 can tell
    listed.write_bytes(bytes(data))
    before = snapshot(channel_dir)
    code, err = run_cli(capsys, "publish", "--channel-dir", str(channel_dir), str(tiny["gamma"]))
    assert code == 2
    assert "corrupt package file" in err and listed.name in err and "sha256" in err
    assert snapshot(channel_dir) == before


def test_publishing_files_the_channel_already_holds_says_nothing_new(
    tmp_path: Path, tiny: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    channel_dir = tmp_path / "channel"
    assert main(["publish", "--channel-dir", str(channel_dir), str(tiny["alpha"])]) == 0
    assert "published into" in capsys.readouterr().out
    before = snapshot(channel_dir)
    assert main(["publish", "--channel-dir", str(channel_dir), str(tiny["alpha"]), str(tiny["beta"])]) == 0
    shown = " ".join(capsys.readouterr().out.split())
    # Only beta is new: the table lists it alone, and alpha is named as already there.
    assert tiny["beta"].name in shown.split("already in the channel")[0]
    assert tiny["alpha"].name not in shown.split("already in the channel")[0]
    assert f"already in the channel with the same content (nothing written): noarch/{tiny['alpha'].name}" in shown
    assert main(["publish", "--json", "--channel-dir", str(channel_dir), str(tiny["alpha"]), str(tiny["beta"])]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["added"] == [] and len(document["unchanged"]) == 2 == len(document["published"])
    assert main(["publish", "--channel-dir", str(channel_dir), str(tiny["alpha"])]) == 0
    shown = " ".join(capsys.readouterr().out.split())
    assert "published into" not in shown and "nothing new to publish into" in shown
    assert {k: v for k, v in snapshot(channel_dir).items() if "beta" not in k and "repodata" not in k} == {
        k: v for k, v in before.items() if "repodata" not in k
    }


def test_reindex_says_what_it_changed_unlike_check(
    tmp_path: Path, tiny: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    channel_dir = tmp_path / "channel"
    channel.publish(channel_dir, [tiny["alpha"]])
    shutil.copy(tiny["gamma"], channel_dir / "noarch")  # a file a killed publish left unindexed
    (channel_dir / "linux-64" / "repodata.json").write_text("garbage")
    assert main(["publish", "--reindex", "--channel-dir", str(channel_dir)]) == 0
    shown = " ".join(capsys.readouterr().out.split())
    assert "re-indexed" in shown and "rebuilt the repodata of 2 subdir(s)" in shown
    assert f"│ noarch │ 2 │ read │ {tiny['gamma'].name} │ - │" in shown
    assert "│ linux-64 │ 0 │ unreadable │ - │ - │" in shown
    assert main(["publish", "--reindex", "--json", "--channel-dir", str(channel_dir)]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["reindexed"]["noarch"] == {"old_index": "read", "added": [], "dropped": []}
    assert main(["publish", "--check", "--channel-dir", str(channel_dir)]) == 0
    assert "re-indexed" not in capsys.readouterr().out


def test_reindex_repairs_corrupt_repodata(
    tmp_path: Path, tiny: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    channel_dir = tmp_path / "channel"
    channel.publish(channel_dir, [tiny["alpha"], tiny["native-tool"]])
    (channel_dir / "noarch" / "repodata.json").write_text("garbage")
    code, _ = run_cli(capsys, "publish", "--reindex", "--channel-dir", str(channel_dir))
    assert code == 0
    assert assert_repodata_matches_files(channel_dir) == {
        f"noarch/{tiny['alpha'].name}",
        f"linux-64/{tiny['native-tool'].name}",
    }


def test_publish_check_json_reports_the_channel(
    tmp_path: Path, tiny: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    channel_dir = tmp_path / "channel"
    code, _ = run_cli(capsys, "publish", "--json", "--channel-dir", str(channel_dir), str(tiny["alpha"]))
    assert code == 0
    assert main(["publish", "--check", "--json", "--channel-dir", str(channel_dir)]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["channel"]["hashes_verified"] is True
    assert {s["name"]: s["packages"] for s in document["channel"]["subdirs"]} == {"linux-64": 0, "noarch": 1}


# ---------------------------------------------------------------------------------------------
# Publishes killed half-way, and publishes at the same time (real subprocesses)
# ---------------------------------------------------------------------------------------------

# Runs channel.publish in its own process. With a kill point it SIGKILLs itself at that point:
# "replace:N:before|after" around the N-th os.replace (package files first, then each subdir's
# repodata.json), "index" right after the scratch index was built, "copy" half-way through writing
# the first package file. With a start time it waits for it, so two publishers start together.
PUBLISHER = textwrap.dedent(
    """
    import os, shutil, signal, sys, time
    from pathlib import Path
    from channelsmith import channel

    kill, start, channel_dir, packages = sys.argv[1], float(sys.argv[2]), Path(sys.argv[3]), sys.argv[4:]

    def die():
        os.kill(os.getpid(), signal.SIGKILL)

    if kill.startswith("replace:"):
        _, nth, when = kill.split(":")
        real_replace, calls = os.replace, []
        def replace(src, dst):
            calls.append(dst)
            if len(calls) == int(nth) and when == "before":
                die()
            real_replace(src, dst)
            if len(calls) == int(nth) and when == "after":
                die()
        os.replace = replace
    elif kill == "index":
        real_index = channel.index_fs
        async def index_then_die(*args, **kwargs):
            await real_index(*args, **kwargs)
            die()
        channel.index_fs = index_then_die
    elif kill == "copy":
        def half_copy(source, sink, length=0):
            data = source.read()
            sink.write(data[: len(data) // 2])
            sink.flush()
            os.fsync(sink.fileno())
            die()
        shutil.copyfileobj = half_copy

    while time.time() < start:
        time.sleep(0.005)
    channel.publish(channel_dir, [Path(p) for p in packages])
    """
)

KILL_POINTS = [
    "copy",
    "replace:1:before",
    "replace:1:after",
    "replace:2:after",
    "index",
    "replace:3:before",  # first repodata.json (linux-64) about to be replaced
    "replace:3:after",  # linux-64 indexed, noarch not yet
    "replace:4:after",  # both replaced, scratch tree not yet removed
]


@pytest.fixture(scope="module")
def publisher(tmp_path_factory: pytest.TempPathFactory) -> Path:
    script = tmp_path_factory.mktemp("publisher") / "publisher.py"
    script.write_text(PUBLISHER)
    return script


def _publisher(
    script: Path, kill: str, channel_dir: Path, packages: list[Path], start: float = 0.0
) -> subprocess.Popen:
    # The child imports the same channelsmith as this process, installed or not.
    package_root = str(Path(channel.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
    return subprocess.Popen(
        [sys.executable, str(script), kill, str(start), str(channel_dir), *map(str, packages)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.parametrize("kill", KILL_POINTS)
def test_publish_killed_half_way_leaves_repodata_matching_files(
    tmp_path: Path, tiny: dict[str, Path], publisher: Path, kill: str
) -> None:
    channel_dir = tmp_path / "channel"
    channel.publish(channel_dir, [tiny["alpha"]])
    new = [tiny["beta"], tiny["native-tool"]]

    proc = _publisher(publisher, kill, channel_dir, new)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL, f"the publisher was not killed at {kill}: {err}"

    # What a reader sees now: repodata that parses and lists only intact files, alpha still there.
    listed = assert_repodata_matches_files(channel_dir)
    assert f"noarch/{tiny['alpha'].name}" in listed
    channel.check_channel(channel_dir)

    # The next publish cleans up what the killed one left and lands everything.
    channel.publish(channel_dir, new)
    assert assert_repodata_matches_files(channel_dir) == {
        f"noarch/{tiny['alpha'].name}",
        f"noarch/{tiny['beta'].name}",
        f"linux-64/{tiny['native-tool'].name}",
    }
    leftovers = [p for p in channel_dir.rglob(".*") if p.name != channel.LOCK_FILE]
    assert leftovers == []
    assert channel.check_channel(channel_dir).unlisted == ()


def test_two_publishes_at_once_both_land_intact(tmp_path: Path, tiny: dict[str, Path], publisher: Path) -> None:
    channel_dir = channel.ensure_channel(tmp_path / "channel")
    for round_ in range(2):
        start = time.time() + 1.5  # both interpreters are up and waiting by then
        first = _publisher(
            publisher,
            "none",
            channel_dir,
            [tiny["alpha"], tiny["gamma"]] if round_ == 0 else [tiny["alpha-next"]],
            start,
        )
        second = _publisher(
            publisher,
            "none",
            channel_dir,
            [tiny["beta"], tiny["native-tool"]] if round_ == 0 else [tiny["delta"]],
            start,
        )
        for proc in (first, second):
            _, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err
    assert assert_repodata_matches_files(channel_dir) == {
        f"noarch/{tiny['alpha'].name}",
        f"noarch/{tiny['alpha-next'].name}",
        f"noarch/{tiny['gamma'].name}",
        f"noarch/{tiny['beta'].name}",
        f"noarch/{tiny['delta'].name}",
        f"linux-64/{tiny['native-tool'].name}",
    }
    assert channel.check_channel(channel_dir).unlisted == ()


def test_a_publish_waits_for_the_channel_lock(tmp_path: Path, tiny: dict[str, Path], publisher: Path) -> None:
    channel_dir = tmp_path / "channel"
    channel.publish(channel_dir, [tiny["alpha"]])
    before = (channel_dir / "noarch" / "repodata.json").read_bytes()
    with channel.channel_lock(channel_dir):
        proc = _publisher(publisher, "none", channel_dir, [tiny["gamma"]])
        time.sleep(2.0)
        assert proc.poll() is None, "the publisher did not wait for the lock"
        assert (channel_dir / "noarch" / "repodata.json").read_bytes() == before
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert f"noarch/{tiny['gamma'].name}" in assert_repodata_matches_files(channel_dir)


def test_the_publisher_script_really_publishes(tmp_path: Path, tiny: dict[str, Path], publisher: Path) -> None:
    """Guards the kill tests: without a kill point the same script exits 0 and the package lands."""
    channel_dir = tmp_path / "channel"
    proc = _publisher(publisher, "none", channel_dir, [tiny["gamma"]])
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert assert_repodata_matches_files(channel_dir) == {f"noarch/{tiny['gamma'].name}"}
