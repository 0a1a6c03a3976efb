"""`channelsmith build` checks what the end of the run needs before its first compile (issue 34, points 2-3).

An unreachable channel or source and a full disk are the environment's fault, not the recipe's: exit 3,
naming what does not answer. A channel that cannot be written is refused before anything is built.
Every case is real and local: ports on 127.0.0.1 that nobody listens on, a path below a regular file,
a channel whose earlier build of a package is a sparse file larger than the free space.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import tarfile
import time
from pathlib import Path

import pytest
from channelsmith.build import _failure_hint
from channelsmith.channel import ensure_channel
from channelsmith.cli import main
from servers import file_server, line_server
from test_build import make_repo, snapshot


def closed_port() -> int:
    """A port on 127.0.0.1 that nobody listens on (bound, then released)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def marker_recipe(marker: Path, requirements: str = "") -> str:
    """A recipe whose build script leaves ``marker``: its absence proves that nothing was built."""
    return f"""\
        package:
          name: marker
          version: "1.0"
        build:
          noarch: generic
          script:
            - touch {marker}
        {requirements}
        """


NEEDS_ZLIB = """requirements:
          host:
            - zlib
"""


def test_an_unreachable_channel_is_named_and_exits_3_before_building(repo_root, tmp_path, capsys):
    """The real torch-dist-check recipe with a channel on a closed local port (as conda-forge is from here)."""
    channel_url = f"http://127.0.0.1:{closed_port()}/conda-forge"
    started = time.monotonic()
    code = main(["--root", str(repo_root), "build", "torch-dist-check", "-c", channel_url,
                 "--channel-dir", str(tmp_path / "channel")])  # fmt: skip
    seconds = time.monotonic() - started
    err = " ".join(capsys.readouterr().err.split())
    assert code == 3
    assert f"channel {channel_url} could not be reached" in err
    assert "Connection refused" in err
    assert "Fix the recipe" not in err and "add -c conda-forge" not in err
    assert "FAILED" not in err  # no engine call ran
    assert seconds < 10
    assert not (tmp_path / "channel").exists()


# Accepts one connection (the check before the build), then closes its port: the channel stops
# answering while the build runs.
ONE_CONNECTION = """
import socket
server = socket.socket()
server.bind(("127.0.0.1", 0))
server.listen(1)
print(server.getsockname()[1], flush=True)
connection, _ = server.accept()
connection.close()
server.close()
"""


def test_a_channel_that_stops_answering_during_the_build_is_named_not_the_recipe(tmp_path, capsys):
    with line_server([ONE_CONNECTION]) as port:
        channel_url = f"http://127.0.0.1:{port}/conda-forge"
        root = make_repo(tmp_path, {"marker": marker_recipe(tmp_path / "built", NEEDS_ZLIB)}, config="{}\n")
        code = main(["--root", str(root), "build", "marker", "-c", channel_url,
                     "--channel-dir", str(tmp_path / "channel")])  # fmt: skip
    err = " ".join(capsys.readouterr().err.split())
    assert code == 3
    assert f"build of marker failed: channel {channel_url} could not be reached" in err
    assert "The recipe is not at fault" in err and "Fix the recipe" not in err
    assert not (tmp_path / "channel").exists()


def test_a_channel_below_a_regular_file_is_refused_before_building(tmp_path, capsys):
    """Nobody, root included, can create a folder below a regular file."""
    marker = tmp_path / "built"
    root = make_repo(tmp_path, {"marker": marker_recipe(marker)}, config="{}\n")
    (tmp_path / "a-file").write_text("not a folder\n")
    code = main(["--root", str(root), "build", "marker", "--channel-dir", str(tmp_path / "a-file" / "channel")])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 2
    channel, above = tmp_path / "a-file" / "channel", tmp_path / "a-file"
    assert f"cannot write the channel at {channel}: {above} is not a directory" in err
    assert not marker.exists()  # refused before the build, not after it
    assert "built marker" not in err


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only folder; the case below a file covers root")
def test_a_read_only_channel_is_refused_before_building(tmp_path, site_env_channel_copy, capsys):
    marker = tmp_path / "built"
    root = make_repo(tmp_path, {"marker": marker_recipe(marker)}, config="{}\n")
    before = snapshot(site_env_channel_copy)
    site_env_channel_copy.chmod(0o555)
    try:
        code = main(["--root", str(root), "build", "marker", "--channel-dir", str(site_env_channel_copy)])
    finally:
        site_env_channel_copy.chmod(0o755)
    assert code == 2
    assert "cannot write the channel" in capsys.readouterr().err
    assert not marker.exists()
    assert snapshot(site_env_channel_copy) == before


def test_a_disk_without_room_for_the_planned_packages_is_refused_before_building(tmp_path, capsys):
    """The channel's earlier build of the package (a sparse file) is larger than the free space."""
    channel = ensure_channel(tmp_path / "channel")
    earlier = channel / "noarch" / "marker-0.9-0.conda"
    size = shutil.disk_usage(channel).free + (1 << 30)
    try:
        with open(earlier, "wb") as handle:
            handle.truncate(size)
    except OSError as exc:
        pytest.skip(f"this file system takes no sparse file of {size} bytes ({exc.strerror})")
    repodata_file = channel / "noarch" / "repodata.json"
    repodata = json.loads(repodata_file.read_text())
    repodata["packages.conda"][earlier.name] = {
        "name": "marker", "version": "0.9", "build": "0", "build_number": 0, "depends": [], "subdir": "noarch",
        "noarch": "generic", "size": size, "sha256": "0" * 64,
    }  # fmt: skip
    repodata_file.write_text(json.dumps(repodata))
    marker = tmp_path / "built"
    root = make_repo(tmp_path, {"marker": marker_recipe(marker)}, config="{}\n")
    code = main(["--root", str(root), "build", "marker", "--channel-dir", str(channel)])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 3
    assert "free; the 1 planned package(s) need about" in err and "earlier builds in the channel" in err
    assert not marker.exists()


def test_a_source_neither_cached_nor_reachable_is_named_and_exits_3_before_building(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("CHANNELSMITH_CACHE", str(tmp_path / "cache"))
    url = f"http://127.0.0.1:{closed_port()}/toy-1.0.tar.gz"
    root = make_repo(tmp_path, {"from-url": f"""\
        package:
          name: from-url
          version: "1.0"
        source:
          url: {url}
          sha256: {"0" * 64}
        build:
          noarch: generic
          script:
            - true
        """}, config="{}\n")  # fmt: skip
    code = main(["--root", str(root), "build", "from-url", "--channel-dir", str(tmp_path / "channel")])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 3
    assert f"the source {url} of from-url is not in the source cache and could not be reached" in err
    assert "FAILED" not in err
    assert not (tmp_path / "channel").exists()


def test_a_cached_source_builds_while_its_server_is_down(tmp_path, monkeypatch):
    served = tmp_path / "served"
    (served / "toy-1.0").mkdir(parents=True)
    (served / "toy-1.0" / "hello.txt").write_text("hello from upstream\n")
    tarball = served / "toy-1.0.tar.gz"
    with tarfile.open(tarball, "w:gz") as archive:
        archive.add(served / "toy-1.0", arcname="toy-1.0")
    log = tmp_path / "requests.log"
    with file_server(served, log) as base:
        url = f"{base}/toy-1.0.tar.gz"
        monkeypatch.setenv("CHANNELSMITH_CACHE", str(tmp_path / "cache"))
        root = make_repo(tmp_path, {"from-url": f"""\
            package:
              name: from-url
              version: "1.0"
            source:
              url: {url}
              sha256: {hashlib.sha256(tarball.read_bytes()).hexdigest()}
            build:
              noarch: generic
              script:
                - mkdir -p "$PREFIX/share" && cp hello.txt "$PREFIX/share/"
            """}, config="{}\n")  # fmt: skip
        assert main(["--root", str(root), "build", "from-url", "--channel-dir", str(tmp_path / "one")]) == 0
    assert main(["--root", str(root), "build", "from-url", "--channel-dir", str(tmp_path / "two")]) == 0
    assert list((tmp_path / "two" / "noarch").glob("from-url-1.0-*.conda"))


def test_the_hint_suggests_conda_forge_only_when_it_was_not_given():
    """A resolve failure against channels that answer: the hint names them, and asks for -c conda-forge
    only when it is missing (the issue's hint asked for it although it was given)."""
    given = _failure_hint("PyRattlerBuildError: Failed to resolve dependencies", ["conda-forge"])
    assert "-c channels (conda-forge)" in given and "add -c conda-forge" not in given
    missing = _failure_hint("PyRattlerBuildError: Failed to resolve dependencies", ["file:///srv/internal"])
    assert "add -c conda-forge" in missing
