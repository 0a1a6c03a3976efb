"""A worker group's store without a port race: the host binds port 0 and publishes the port it got.

Choosing a free port first and binding it later (a probe socket closed, then ``TCPStore`` on that
port) leaves a window in which another process takes it: 2 of about 25 peer-loss runs on a busy node
failed with ``EADDRINUSE`` on the port the suite had picked (issue 20). Here the store's own listening
socket is the one that picked the port, so nothing can come between choice and bind; the port then
reaches the other processes through a file that appears atomically (written aside, then renamed).
With ``--nodes`` the host's node address goes into the file too (the store listens on every address
of its node; the others connect from their own nodes).
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from torch_dist_check.nodes.namespaces import NODE_ADDR_ENV


class RendezvousError(RuntimeError):
    """The host's port file did not appear in time."""


def publish_port(port_file: Path, port: int, host: str = "127.0.0.1") -> None:
    """Write ``port`` and the ``host`` to reach it at to ``port_file`` so that a reader never sees a partial file."""
    partial = port_file.with_name(port_file.name + f".{os.getpid()}.partial")
    partial.write_text(f"{port} {host}\n")
    os.replace(partial, port_file)


def wait_for_port(port_file: Path, timeout_s: float, poll_s: float = 0.005) -> int:
    """The port published in ``port_file``, waiting up to ``timeout_s`` for it to appear."""
    return wait_for_address(port_file, timeout_s, poll_s)[1]


def wait_for_address(port_file: Path, timeout_s: float, poll_s: float = 0.005) -> tuple[str, int]:
    """The (host, port) published in ``port_file``, waiting up to ``timeout_s`` for it to appear."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            port, host = port_file.read_text().split()
            return host, int(port)
        except FileNotFoundError:
            if time.monotonic() > deadline:
                raise RendezvousError(f"no port in {port_file} after {timeout_s:.0f} s (did its host start?)") from None
            time.sleep(poll_s)


def host_store(port_file: Path, world_size: int, timeout_s: float) -> Any:
    """A master ``TCPStore`` on the port the kernel gave it; its port and address are published.

    The address is this node's (``--nodes``), else 127.0.0.1.
    """
    import torch.distributed as dist

    host = os.environ.get(NODE_ADDR_ENV) or "127.0.0.1"
    store = dist.TCPStore(host, 0, world_size, is_master=True, timeout=timedelta(seconds=timeout_s),
                          wait_for_workers=False)  # fmt: skip
    publish_port(port_file, int(store.port), host)
    return store


def join_store(port_file: Path, world_size: int, timeout_s: float) -> Any:
    """A client of the store whose host publishes its port in ``port_file``."""
    import torch.distributed as dist

    host, port = wait_for_address(port_file, timeout_s)
    return dist.TCPStore(host, port, world_size, is_master=False, timeout=timedelta(seconds=timeout_s))
