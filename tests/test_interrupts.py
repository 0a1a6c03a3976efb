"""Ctrl-C: each command says what the interruption left, and it is true.

Every test starts the real `channelsmith` command as a process, waits until it is inside its work (a
download, the channel lock, the acceptance suite's sweep), sends it SIGINT (the process alone, as `kill
-INT` would; a terminal's Ctrl-C reaches its whole process group) and checks the message against the
disk. The waits are real: a local HTTP server that answers a request with part of its body and then
stalls, the channel's own publish lock held by the test.
"""

from __future__ import annotations

import fcntl
import http.server
import json
import os
import signal
import socketserver
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from channelsmith import channel
from test_channel import build_tiny_packages, snapshot
from test_patches import HEADER, git_diff

REPO = Path(__file__).resolve().parents[1]


class StallingServer:
    """Answers every GET with a 200, a long Content-Length and 1 KiB of body, then stalls until stopped."""

    def __init__(self) -> None:
        self.requested = threading.Event()
        self.release = threading.Event()
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                self.send_response(200)
                self.send_header("Content-Length", str(1 << 30))
                self.end_headers()
                self.wfile.write(b"\0" * 1024)
                self.wfile.flush()
                server.requested.set()
                server.release.wait(120)

            def log_message(self, format: str, *args: object) -> None:
                return None

        self.httpd = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def stalling_server() -> Iterator[StallingServer]:
    server = StallingServer()
    yield server
    server.stop()


def start(args: list[str], tmp_path: Path, **env: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "channelsmith", *args],
        env={**os.environ, "TMPDIR": str(tmp_path), **env}, cwd=tmp_path,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def interrupt_after(proc: subprocess.Popen[str], ready, timeout: float = 120,
                    never: str = "the command never reached the point to interrupt") -> tuple[int, str, float]:  # fmt: skip
    """Wait until ``ready()`` (``never``: the failure's message if it is not within ``timeout``), send SIGINT to
    the command: its exit status, its stderr, and the seconds from the signal to its end."""
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, never
        time.sleep(0.05)
    interrupted = time.monotonic()
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, err, time.monotonic() - interrupted


def interrupt_when(proc: subprocess.Popen[str], ready, timeout: float = 120) -> str:
    """Wait until ``ready()``, send SIGINT to the command, and return its stderr (one line per message)."""
    returncode, err, _ = interrupt_after(proc, ready, timeout)
    assert returncode == 130, err
    return " ".join(err.split())


# ---------------------------------------------------------------------------------------------
# patches check / compile-check: interrupted in a release download
# ---------------------------------------------------------------------------------------------


def repo_with_a_local_release(tmp_path: Path, url: str) -> Path:
    """A repository whose one recipe lists one patch for PyTorch 2.6.0 and takes its tarball from ``url``."""
    root = tmp_path / "repo"
    recipe = root / "recipes" / "toy"
    recipe.mkdir(parents=True)
    (root / "conda_build_config.yaml").write_text((REPO / "conda_build_config.yaml").read_text())
    work = tmp_path / "diff"
    for side, text in (("a", "old\n"), ("b", "new\n")):
        (work / side / "version.txt").parent.mkdir(parents=True, exist_ok=True)
        (work / side / "version.txt").write_text(text)
    patch = root / "patches" / "pytorch" / "2.6.0" / "demo" / "0001-demo.patch"
    patch.parent.mkdir(parents=True)
    patch.write_text(HEADER.format(versions="2.6.0") + git_diff(work, "version.txt", "version.txt"))
    (recipe / "recipe.yaml").write_text(
        "context:\n  version: ${{ pytorch_version }}\npackage:\n  name: toy-torch\n  version: ${{ version }}\n"
        "source:\n"
        '  - if: pytorch_version == "2.6.0"\n    then:\n'
        "      # sha256: a test fixture; the download never completes\n"
        f"      url: {url}/pytorch-v2.6.0.tar.gz\n      sha256: {'0' * 64}\n"
        "      patches:\n        - ../../patches/pytorch/2.6.0/demo/0001-demo.patch\n"
        "build:\n  number: 0\n  noarch: generic\nabout:\n  license: MIT\n"
    )
    (recipe / "variants.yaml").write_text('pytorch_version:\n  - "2.6.0"\n')
    return root


@pytest.mark.parametrize("action", ["check", "compile-check"])
def test_an_interrupted_patch_check_changed_nothing_and_leaves_no_usable_half_download(
    tmp_path: Path, stalling_server: StallingServer, action: str
) -> None:
    root = repo_with_a_local_release(tmp_path, stalling_server.url)
    before = snapshot(root)
    cache = tmp_path / "cache"
    proc = start(["--root", str(root), "patches", action, "toy", "--cache-dir", str(cache)], tmp_path,
                 CHANNELSMITH_OFFLINE="")  # fmt: skip
    err = interrupt_when(proc, stalling_server.requested.is_set)
    assert "nothing was published" not in err
    assert "interrupted; nothing in the repository was changed" in err
    assert "a download cut short in the source cache is not used" in err
    assert snapshot(root) == before
    # The cut download kept its temporary name: no later run takes it for the release tarball.
    tarballs = sorted(p.name for p in (cache / "tarballs").iterdir())
    assert "pytorch-v2.6.0.tar.gz" not in tarballs and all(name.endswith(".part") for name in tarballs)
    assert not list(tmp_path.glob("channelsmith-*")), "a temporary folder was left behind"


# ---------------------------------------------------------------------------------------------
# publish: interrupted while waiting for the channel lock; deploy: interrupted in the solve
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return build_tiny_packages(tmp_path_factory.mktemp("tiny"))


def test_an_interrupted_publish_says_which_packages_the_index_lists(tmp_path: Path, tiny: dict[str, Path]) -> None:
    channel_dir = tmp_path / "channel"
    channel.publish(channel_dir, [tiny["alpha"]])
    before = snapshot(channel_dir)
    with open(channel_dir / channel.LOCK_FILE, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another publish holds the channel
        proc = start(["publish", str(tiny["alpha"]), str(tiny["beta"]), "--channel-dir", str(channel_dir)], tmp_path)
        # It has validated both archives and waits for the lock (two validations take well under 10 s).
        time.sleep(10)
        err = interrupt_when(proc, lambda: True)
    assert "interrupted; 1 of the 2 packages are in the channel's index" in err
    assert f"(not: {tiny['beta'].name}; publish them again)" in err
    assert snapshot(channel_dir) == before


def test_an_interrupted_deploy_says_nothing_was_installed(
    tmp_path: Path, stalling_server: StallingServer
) -> None:
    prefix = tmp_path / "env"
    proc = start(["deploy", "alpha", "--prefix", str(prefix), "-c", f"{stalling_server.url}/remote"], tmp_path)
    err = interrupt_when(proc, stalling_server.requested.is_set)
    assert f"interrupted; nothing was installed ({prefix} was not created)" in err
    assert not prefix.exists()


# ---------------------------------------------------------------------------------------------
# verify: interrupted in the acceptance suite's sweep
# ---------------------------------------------------------------------------------------------


def _processes_with(marker: str) -> list[int]:
    """PIDs of live processes whose environment holds ``marker`` (the command and everything it started)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker.encode() in environ.split(b"\0") and state != "Z":
            found.append(int(entry.name))
    return found


def test_an_interrupted_verify_stops_the_suite_and_its_ranks(tmp_path: Path) -> None:
    pytest.importorskip("torch", reason="torch is not installed (bash scripts/install-test-deps.sh installs it)")
    from test_verify import make_prefix

    prefix = make_prefix(tmp_path / "env", with_torch=True)
    marker = f"CHANNELSMITH_TEST_MARK={tmp_path}"
    proc = start(["verify", "--prefix", str(prefix), "--backends", "gloo", "--", "--checks", "bandwidth",
                  "--max-bytes", "1G"], tmp_path, CHANNELSMITH_TEST_MARK=str(tmp_path))  # fmt: skip

    def sweeping() -> bool:
        reports = list(tmp_path.glob("channelsmith-verify-*/report.json"))
        try:
            return bool(reports) and json.loads(reports[0].read_text())["incomplete_stage"] == "bandwidth/gloo/cpu"
        except (OSError, ValueError):
            return False

    err = interrupt_when(proc, sweeping)
    assert "nothing was published" not in err
    assert "interrupted; the acceptance suite was stopped (its ranks too) and gave no verdict" in err
    deadline = time.monotonic() + 10
    while _processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _processes_with(marker) == [], "ranks of the suite outlived the interrupted verify"
    assert not list(tmp_path.glob("channelsmith-verify-*")), "the suite's temporary folder was left behind"


def test_an_interrupted_pack_says_whether_a_bundle_is_there(tmp_path: Path) -> None:
    import argparse

    from channelsmith.cli.pack import interrupted

    out = tmp_path / "env.tar"
    assert "no bundle was written" in interrupted(argparse.Namespace(output=str(out)))
    out.write_bytes(b"an earlier bundle")
    assert f"{out} is as it was" in interrupted(argparse.Namespace(output=str(out)))
