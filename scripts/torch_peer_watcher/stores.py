"""The rendezvous store as the watcher sees it: the address peers reach this host at (the route to the
store), the store's own endpoints (never cut), and whether the store is still within reach, which decides
the side of a split brain that goes on (:mod:`torch_peer_watcher.watcher`).
"""

from __future__ import annotations

import os
import select
import socket
from typing import Any

from torch_peer_watcher.sockets import Endpoint, normalize

# How long a connection to the store must stay open to count as the store's answer.
STORE_HOLD_S = 0.02


def advertised_host(store: Any) -> str:
    """The address of the interface that reaches the rendezvous store (peers reach it the same way)."""
    target = store_host(store) or os.environ.get("MASTER_ADDR")
    if target:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
                # A UDP connect sends nothing; it only picks the route, hence the local address.
                probe.connect((socket.gethostbyname(target), 9))
                return probe.getsockname()[0]
        except OSError:
            pass
    return socket.gethostbyname(socket.gethostname())


def store_endpoints(store: Any) -> frozenset[Endpoint]:
    """The TCP store's (address, port) pairs as a connection to it shows its remote end (empty: no TCP store)."""
    host, port = store_host(store), store_port(store)
    if not host or not port:
        return frozenset()
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        return frozenset()
    return frozenset(normalize(info[4]) for info in infos)


def store_out_of_reach(store: Any, timeout_s: float, hold: bool = True) -> str | None:
    """Why the TCP store under ``store`` cannot be reached within ``timeout_s`` (a connect to it), or None.

    ``hold``: keep the connection :data:`STORE_HOLD_S` to tell a dying store from a live one; a caller whose next
    step is a request the store must answer (the verdict's claim) need not, since a dying store's established
    connections reset before its listener closes. None too for a store that is not a TCP store (a FileStore,
    a HashStore): nothing to be cut from.
    """
    host, port = store_host(store), store_port(store)
    if not host or not port:
        return None
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as probe:
            # The kernel completes a connect while the store's process is still dying (its listener
            # closes a moment after its other sockets), then resets it: a live store sends nothing first.
            if hold and select.select([probe], [], [], STORE_HOLD_S)[0]:
                return f"the store at {host}:{port} closed the connection at once (its process is gone)"
    except OSError as exc:
        return f"the store at {host}:{port} is out of reach ({exc.strerror or type(exc).__name__})"
    return None


def _store_attr(store: Any, name: str) -> Any:
    """``name`` (host, port) of the first store under ``store``'s wrappers (PrefixStore) that has one."""
    for _ in range(16):
        value = getattr(store, name, None)
        if value:
            return value
        store = getattr(store, "underlying_store", None)
        if store is None:
            return None
    return None


def store_port(store: Any) -> int | None:
    port = _store_attr(store, "port")
    return int(port) if port else None


def store_host(store: Any) -> str | None:
    host = _store_attr(store, "host")
    return str(host) if host else None
