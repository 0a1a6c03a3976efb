"""The dialing side of the handshake: a HELLO that makes a link, or a PROBE that asks whether a peer lives.

Blocking calls with a timeout, made from the thread that needs the answer (``watch()`` for a first
link, a redial thread for a link that ended), never from the link thread. The wire format is in
:mod:`torch_peer_watcher.protocol`; the listening side is in :mod:`torch_peer_watcher.links`.
"""

from __future__ import annotations

import os
import secrets
import socket
import time
import warnings
from dataclasses import dataclass
from typing import Any

from torch_peer_watcher import protocol
from torch_peer_watcher.losses import WatcherError
from torch_peer_watcher.protocol import MAX_HANDSHAKE_LINE, Opener, Sealer, address_text, proof
from torch_peer_watcher.settings import SECRET_ENV, SECRET_FILE_ENV
from torch_peer_watcher.sockets import Endpoint, other_end_owner

# What each answer's proof is made for (its role in protocol.proof).
ROLES = {b"CHALLENGE": "listener", b"ALIVE": "alive", b"LOST": "lost"}


class HandshakeError(ConnectionError):
    """The peer did not prove that it holds the job's secret (or is not the rank it should be).

    ``not_the_peer`` says why the process that answered cannot be the peer at all (it belongs to
    another Unix user), where that is known before any answer; else empty.
    """

    def __init__(self, message: str, not_the_peer: str = "") -> None:
        super().__init__(message)
        self.not_the_peer = not_the_peer


class Refused(ConnectionError):
    """The listener closed the connection before its answer (busy, or the rank is linked still)."""


@dataclass(frozen=True)
class Dialer:
    """Who dials: this process's rank, its id on the wire, its own listener (``host|port``), the job's key."""

    rank: int
    id: str
    listens: str
    key: bytes


@dataclass(eq=False)
class Dialled:
    """A listener's answer: a link (CHALLENGE; the socket and its keys), or its word on this process."""

    word: bytes
    peer_id: str
    sock: socket.socket | None = None
    already_read: bytes = b""
    sealer: Sealer | None = None
    opener: Opener | None = None


def dial(me: Dialer, rank: int, address: Endpoint, probe: bool, timeout_s: float, check_owner: bool = False) -> Dialled:
    """Dial ``rank``'s listener at ``address``: HELLO (a link), or PROBE (does it live?).

    Raises :class:`HandshakeError` when the answer does not prove the secret for this address, or, with
    ``check_owner`` (a redial after a link closed), when the process that accepted belongs to another Unix
    user (without waiting for an answer: one that took a dead peer's freed port holds the connection and
    never answers; the check reads the host's socket table, so a job's first links skip it), :class:`Refused` when the listener
    closed before answering, OSError (refused, unreachable, timeout) when it cannot be reached.
    """
    sock = socket.create_connection(address, timeout=timeout_s)
    try:
        owner = other_end_owner(sock) if check_owner else None
        if owner is not None and owner != os.getuid():
            # Every rank of a job on a node runs as its user: a process of another user is no rank of it.
            why = f"a process of another user (uid {owner}) listens at rank {rank}'s watcher address"
            raise HandshakeError(f"{why} ({address[0]}:{address[1]}): it is not rank {rank}", not_the_peer=why)
        nonce = secrets.token_hex(16)
        if probe:
            sock.sendall(f"PROBE {me.rank} {nonce} {me.id}\n".encode())
        else:
            sock.sendall(f"HELLO {me.rank} {nonce} {me.id} {me.listens}\n".encode())
        line, already_read = _read_line(sock)
        match = protocol.ANSWER.fullmatch(line)
        wanted = (b"ALIVE", b"LOST") if probe else (b"CHALLENGE", b"LOST")
        dialled = address_text(address)
        listens = "" if probe else me.listens
        if match is not None and match[1] in wanted:
            nonces, ids = (nonce, match[2].decode()), (me.id, match[3].decode())
            expected = proof(me.key, ROLES[match[1]], me.rank, rank, nonces, ids, dialled, listens)
        if match is None or match[1] not in wanted or not protocol.proof_matches(expected, match[4]):
            raise HandshakeError(
                f"the watcher at {address[0]}:{address[1]} did not prove that it is rank {rank} of this job at that "
                "address: do all ranks have the same TORCH_PEER_WATCHER_SECRET (or none)? Or the address is not "
                f"rank {rank}'s any more, or something relays it"
            )
        if match[1] != b"CHALLENGE":
            sock.close()
            return Dialled(match[1], ids[1])
        sock.sendall(f"AUTH {proof(me.key, 'dialer', me.rank, rank, nonces, ids, dialled, listens)}\n".encode())
        out, into = protocol.link_keys(me.key, me.rank, rank, nonces, dialled)
    except BaseException:
        sock.close()
        raise
    return Dialled(b"CHALLENGE", ids[1], sock, already_read, Sealer(out), Opener(into))


def _read_line(sock: socket.socket) -> tuple[bytes, bytes]:
    """One handshake line from a blocking socket, and what came after it. Raises Refused on a close."""
    inbox = b""
    while b"\n" not in inbox:
        try:
            data = sock.recv(MAX_HANDSHAKE_LINE)
        except ConnectionResetError:
            data = b""
        if not data:
            raise Refused("it closed the connection before its answer")
        inbox += data
        if len(inbox) > MAX_HANDSHAKE_LINE:
            break
    line, _, rest = inbox.partition(b"\n")
    return line, rest


def signed_address(store: Any, key: bytes, job: str, ranks: tuple[int, int], deadline: float, timeout_s: float,
                   skip: set[Endpoint] = frozenset()) -> Endpoint:  # type: ignore[assignment]  # fmt: skip
    """``ranks`` = (this rank, the peer): the peer's address that its watcher published in ``store`` (the watcher's
    prefix store), signed with ``key`` for ``job``; bounded by ``deadline`` (the connect timeout, ``timeout_s``
    from its start), not the store's (30 min). A value that is not signed (another process wrote it: anyone
    can write the store), one signed for another job, and an address in ``skip`` (it failed already)
    are passed over: the next one is read, until the deadline."""
    from datetime import timedelta

    rank, peer = ranks
    name = f"addr/{peer}"
    passed = 0
    why = ""
    while True:
        left = deadline - time.monotonic()
        try:
            store.wait([name], timedelta(seconds=max(0.001, left)))
            value = store.get(name).decode(errors="replace")
        except RuntimeError as exc:
            raise WatcherError(
                f"rank {peer} published no watcher address within {timeout_s:.0f} s "
                f"({' '.join(str(exc).split())[:120]}); does it run the watcher (TORCH_PEER_WATCHER=1 or start())?"
            ) from None
        address, why = protocol.verify_address(key, peer, value, job)
        if address is not None and address not in skip:
            return address
        passed += 1
        if passed == 1 and address is None:
            said = ("is signed for another job (another store, or another launcher's job id: a value replayed "
                    "from a job with the same secret)" if why == "another job" else
                    "is not signed with this job's secret (another process wrote it to the store, or the ranks "
                    "have different secrets)")  # fmt: skip
            warnings.warn(f"torch_peer_watcher: rank {rank} read an address for rank {peer} that {said}; "
                          f"waiting for rank {peer}'s own", stacklevel=3)  # fmt: skip
        if time.monotonic() + 0.05 >= deadline:
            what = "signed for this job" if why == "another job" else "signed with this job's secret"
            raise WatcherError(
                f"the store held no address for rank {peer} {what} within "
                f"{timeout_s:.0f} s ({passed} reads, the last {value[:80]!r}"
                + (", signed for another job" if why == "another job" else "")
                + f"): another process keeps rewriting the key torch_peer_watcher/addr/{peer}, or the ranks have "
                f"different {SECRET_ENV} (or {SECRET_FILE_ENV}), or different stores or launcher job ids "
                f"({', '.join(protocol.RUN_ID_ENVS)})"
            )
        time.sleep(0.05)
