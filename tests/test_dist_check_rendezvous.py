"""torch_dist_check.harness.rendezvous: a worker group's store port cannot be taken between choice and bind."""

from __future__ import annotations

import errno
import socket
import sys
import threading
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="torch is not installed (bash scripts/install-test-deps.sh installs it)")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

from torch_dist_check.harness.rendezvous import RendezvousError, host_store, join_store, publish_port, wait_for_port  # noqa: E402


def test_the_port_is_bound_when_it_is_published_so_nobody_can_take_it(tmp_path):
    port_file = tmp_path / "world.port"
    store = host_store(port_file, 2, 10)
    port = wait_for_port(port_file, 1)
    assert port == store.port and port > 0
    # The old way (probe a free port, close it, let the store bind it later) left this window open.
    thief = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    with pytest.raises(OSError) as taken:
        thief.bind(("127.0.0.1", port))
    thief.close()
    assert taken.value.errno == errno.EADDRINUSE
    client = join_store(port_file, 2, 10)
    client.set("key", "value")
    assert store.get("key") == b"value"


def test_a_client_started_before_its_host_waits_for_the_port(tmp_path):
    port_file = tmp_path / "fresh.port"
    joined: list[object] = []
    client = threading.Thread(target=lambda: joined.append(join_store(port_file, 2, 10)))
    client.start()
    store = host_store(port_file, 2, 10)
    client.join(15)
    assert joined, "the client did not join"
    joined[0].set("a", "1")  # type: ignore[attr-defined]
    assert store.get("a") == b"1"


def test_a_missing_host_is_a_bounded_error_and_no_partial_file_is_read(tmp_path):
    with pytest.raises(RendezvousError, match="no port in .* after 0 s"):
        wait_for_port(tmp_path / "never.port", 0.05)
    publish_port(tmp_path / "p.port", 4242)
    assert [p.name for p in tmp_path.iterdir()] == ["p.port"]
    assert wait_for_port(tmp_path / "p.port", 0) == 4242
