"""This process's TCP connections: list their endpoints, and cut those that lead to a given peer.

Why: gloo has no abort. A gloo collective blocked on a peer that is alive but stuck (SIGSTOP, a
hung host) waits for the group's timeout (30 min by default). Shutting down this process's
sockets to that peer makes gloo see a closed connection, so the blocked call raises at once. Each
peer tells the others the local endpoints of its connections (:func:`local_endpoints`); a
survivor cuts its sockets whose remote endpoint is one of the dead peer's
(:func:`cut_connections_to`). Every such socket leads to that peer, so only the groups that
contain it are touched. A survivor can also wait on another survivor, which left the collective
when its own connection to the dead peer broke; gloo's ``abort()`` and ``shutdown()`` close no
connection (PyTorch 2.6 to 2.13), so the watcher cuts every socket of an aborted gloo group too
(:func:`cut_group_connections`, with the group's address records: :func:`groups.gloo_records`).
Linux only (``/proc/self/fd``); elsewhere both return nothing. Where
``/proc/self/fd`` exists but cannot be read (no file descriptor left: EMFILE), both raise OSError
rather than report nothing: an empty endpoint set would tell the peers to cut nothing.
"""

from __future__ import annotations

import errno
import os
import socket
import stat
import struct
import sys
from collections.abc import Callable, Collection, Iterator

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


def cut_connections_to(peer_endpoints: Collection[Endpoint], keep: Collection[Endpoint] = ()) -> int:
    """Shut down (not close: the owner keeps its fd) every socket whose remote end is in ``peer_endpoints``,
    except one with either end in ``keep`` (the store's address: a client's connection to it, or, in the
    process that hosts the store, the server's side of a peer's connection).

    Returns how many were cut; OSError when this process's sockets cannot be listed now.
    """
    wanted, kept = set(peer_endpoints), set(keep)
    return _cut_where(lambda sock: normalize(sock.getpeername()) in wanted
                      and not {normalize(sock.getpeername()), normalize(sock.getsockname())} & kept)  # fmt: skip


def _cut_where(chosen: Callable[[socket.socket], bool]) -> int:
    """Shut down every connected TCP socket of this process that ``chosen`` picks (a socket it cannot
    judge, one closed meanwhile, is left); how many. OSError when the sockets cannot be listed now."""
    cut = 0
    for _fd, sock in _tcp_sockets():
        with sock:
            try:
                if chosen(sock):
                    sock.shutdown(socket.SHUT_RDWR)
                    cut += 1
            except OSError:
                continue
    return cut


def _sockaddr_in(record: bytes, family: int, address: tuple) -> bool:
    """True if ``record`` holds ``address`` (a socket's own getsockname/getpeername form) as a sockaddr.

    gloo's address record of a member holds its listening socket's ``sockaddr_in``/``sockaddr_in6``
    verbatim (family in host order, port and address in network order); nothing else of its layout
    is assumed.
    """
    host, port = address[0], int(address[1])
    head = struct.pack("=H", family) + struct.pack(">H", port)
    if family == socket.AF_INET:
        return head + socket.inet_pton(socket.AF_INET, host) in record
    if family != socket.AF_INET6:
        return False
    packed = socket.inet_pton(socket.AF_INET6, host.split("%", 1)[0])
    at = record.find(head)
    while at >= 0:
        # sockaddr_in6: family, port, a 4-byte flow label, then the address.
        if record[at + 8 : at + 24] == packed:
            return True
        at = record.find(head, at + 1)
    return False


def cut_group_connections(records: Collection[bytes]) -> int:
    """Shut down every socket of one gloo group: those accepted on this process's listener of the
    group or connected to a member's listener of it, as the members' address ``records`` name them
    (:func:`groups.gloo_records`). Every socket of a gloo group is one or the other; no other
    group's socket is (a listener's address is bound once per host).

    Returns how many were cut; OSError when this process's sockets cannot be listed now.
    """
    if not records:
        return 0
    return _cut_where(lambda sock: any(_sockaddr_in(r, sock.family, end) for end in (sock.getsockname(), sock.getpeername())
                                       for r in records))  # fmt: skip


def listens_on(port: int) -> bool:
    """True if this process holds a listening TCP socket on ``port`` (it hosts the server there).

    False where the sockets cannot be listed (no /proc, no file descriptor left).
    """
    try:
        for _fd, sock in _tcp_sockets():
            with sock:
                if sock.getsockname()[1] != port:
                    continue
                try:
                    sock.getpeername()
                except OSError:
                    return True  # bound to the port with no peer: the listener
    except OSError:
        return False
    return False


_PROC_TCP = ("/proc/net/tcp", "/proc/net/tcp6")


def other_end_owner(sock: socket.socket) -> int | None:
    """The Unix user (uid) that owns the other end of ``sock``, a TCP connection, where that end is in this
    host's network namespace (``/proc/net/tcp*`` lists its sockets with their owners); None elsewhere,
    or when it cannot be read.

    A connection accepted but not yet taken by ``accept()`` is listed already, with its listener's owner.
    """
    try:
        mine, theirs = normalize(sock.getsockname()), normalize(sock.getpeername())
    except OSError:
        return None
    for path in _PROC_TCP:
        try:
            with open(path) as table:
                next(table, None)  # the header
                for line in table:
                    fields = line.split()
                    if len(fields) < 8:
                        continue
                    if _proc_endpoint(fields[1]) == theirs and _proc_endpoint(fields[2]) == mine:
                        return int(fields[7])
        except (OSError, ValueError):
            continue
    return None


def _proc_endpoint(text: str) -> Endpoint | None:
    """(host, port) from ``/proc/net/tcp*``'s ``ADDR:PORT`` (the address in 32-bit words of host order)."""
    address, _, port = text.partition(":")
    try:
        raw = bytes.fromhex(address)
        words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4)) if sys.byteorder == "little" else raw
        family = socket.AF_INET if len(words) == 4 else socket.AF_INET6
        return normalize((socket.inet_ntop(family, words), int(port, 16)))
    except (ValueError, OSError):
        return None
