"""This process's TCP connections: list their endpoints, and cut those that lead to a given peer.

Why: gloo has no abort. A gloo collective blocked on a peer that is alive but stuck (SIGSTOP, a
hung host) waits for the group's timeout (30 min by default). Shutting down this process's
sockets to that peer makes gloo see a closed connection, so the blocked call raises at once. Each
peer tells the others the local endpoints of its connections (:func:`local_endpoints`); a
survivor cuts its sockets whose remote endpoint is one of the dead peer's
(:func:`cut_connections_to`). Every such socket leads to that peer, so only the groups that
contain it are touched. Linux only (``/proc/self/fd``); elsewhere both return nothing. Where
``/proc/self/fd`` exists but cannot be read (no file descriptor left: EMFILE), both raise OSError
rather than report nothing: an empty endpoint set would tell the peers to cut nothing.
"""

from __future__ import annotations

import errno
import os
import socket
import stat
from collections.abc import Collection, Iterator

Endpoint = tuple[str, int]

_FD_DIR = "/proc/self/fd"


def normalize(address: tuple) -> Endpoint:
    """(host, port) with IPv4-mapped IPv6 addresses written as IPv4, so both sides compare equal."""
    host, port = address[0], int(address[1])
    if host.startswith("::ffff:") and "." in host:
        host = host[len("::ffff:") :]
    return host, port


def _tcp_sockets() -> Iterator[tuple[int, socket.socket]]:
    """(fd, a duplicate socket object) for every connected TCP socket of this process; caller closes.

    Raises OSError when the descriptors cannot be listed or duplicated for want of a free one.
    """
    try:
        names = os.listdir(_FD_DIR)
    except FileNotFoundError:
        return
    for name in names:
        fd = int(name)
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            dup = socket.socket(fileno=os.dup(fd))
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE):
                raise
            # Closed since the listing, or not a socket any more.
            continue
        if dup.family in (socket.AF_INET, socket.AF_INET6) and dup.type == socket.SOCK_STREAM:
            yield fd, dup
        else:
            dup.close()


def local_endpoints() -> frozenset[Endpoint]:
    """The local (host, port) of every connected TCP socket of this process (OSError: cannot tell now)."""
    found = set()
    for _fd, sock in _tcp_sockets():
        with sock:
            try:
                sock.getpeername()
                found.add(normalize(sock.getsockname()))
            except OSError:
                continue
    return frozenset(found)


def cut_connections_to(peer_endpoints: Collection[Endpoint]) -> int:
    """Shut down (not close: the owner keeps its fd) every socket whose remote end is in ``peer_endpoints``.

    Returns how many were cut; OSError when this process's sockets cannot be listed now.
    """
    wanted = set(peer_endpoints)
    cut = 0
    for _fd, sock in _tcp_sockets():
        with sock:
            try:
                if normalize(sock.getpeername()) in wanted:
                    sock.shutdown(socket.SHUT_RDWR)
                    cut += 1
            except OSError:
                continue
    return cut
