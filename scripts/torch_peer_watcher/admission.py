"""Who may open a link: the listener's side of the handshake (:mod:`torch_peer_watcher.protocol`).

Accepted connections wait here until they authenticate: a HELLO or PROBE from a rank of the job that may
send it, answered with a proof; then (HELLO) the dialer's AUTH, after which the connection becomes a link of
:class:`torch_peer_watcher.links.LinkLoop`. Anything else is refused, counted and logged at a bounded rate,
and the number of connections waiting is bounded, so strangers cannot exhaust the watcher's thread.
The methods run on the link loop's thread, as part of :class:`~torch_peer_watcher.links.LinkLoop`.
"""

from __future__ import annotations

import errno
import logging
import secrets
import selectors
import socket
import time
from dataclasses import dataclass
from typing import Any

from torch_peer_watcher import protocol
from torch_peer_watcher.dialing import ROLES, Dialled
from torch_peer_watcher.protocol import MAX_HANDSHAKE_LINE, Opener, Sealer, address_text, proof
from torch_peer_watcher.sockets import Endpoint

# Connections waiting to authenticate beyond the lower ranks not linked yet; the rest are refused.
MAX_PENDING = 64

# After accept() failed for want of a file descriptor: the listener rests this long (no busy loop).
_ACCEPT_BACKOFF_S = 0.5
_ACCEPTS_PER_EVENT = 32
_OUT_OF_FDS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)

log = logging.getLogger("torch_peer_watcher")


@dataclass(eq=False)
class Pending:
    """An accepted connection that has not authenticated yet."""

    sock: socket.socket
    since: float
    address: Any
    inbox: bytes = b""
    rank: int | None = None
    nonce: str = ""
    their_nonce: str = ""
    their_id: str = ""
    their_listener: Endpoint | None = None


class Admission:
    """The accepting half of :class:`~torch_peer_watcher.links.LinkLoop` (which sets these attributes)."""

    rank: int
    world_size: int
    id: str
    listener: socket.socket
    links: dict[int, Any]
    _selector: selectors.BaseSelector
    _pending: set[Pending]
    _accept_paused_until: float | None
    _refused: int
    _lost_ids: dict[int, str]
    _key: bytes
    _address_text: str

    def _accept(self) -> None:
        for _ in range(_ACCEPTS_PER_EVENT):
            try:
                sock, address = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in _OUT_OF_FDS:
                    self._log("accept", "torch_peer_watcher: rank %d cannot accept connections (%s); retrying in %.1f s",
                              self.rank, exc.strerror or exc, _ACCEPT_BACKOFF_S)  # fmt: skip
                    self._pause_accepting()
                    return
                # That one connection failed (ECONNABORTED): the next may be fine.
                continue
            if len(self._pending) >= self._pending_cap():
                sock.close()
                self._note_refused(address, "too many connections waiting to authenticate")
                continue
            sock.setblocking(False)
            pending = Pending(sock, time.monotonic(), address)
            self._pending.add(pending)
            self._selector.register(sock, selectors.EVENT_READ, pending)

    def _pause_accepting(self) -> None:
        """Stop watching the listener a moment: a readable listener that cannot be accepted would spin."""
        if self._accept_paused_until is None:
            self._selector.unregister(self.listener)
        self._accept_paused_until = time.monotonic() + _ACCEPT_BACKOFF_S

    def _pending_cap(self) -> int:
        lower_linked = sum(1 for r in self.links if r < self.rank)
        return MAX_PENDING + self.rank - lower_linked

    def _read_pending(self, pending: Pending) -> None:
        try:
            data = pending.sock.recv(MAX_HANDSHAKE_LINE)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._refuse(pending, "closed before it authenticated")
            return
        pending.inbox += data
        while pending in self._pending:
            line, newline, rest = pending.inbox.partition(b"\n")
            if not newline:
                if len(pending.inbox) > MAX_HANDSHAKE_LINE:
                    self._refuse(pending, "a handshake line too long")
                return
            pending.inbox = rest
            if pending.rank is None:
                self._hello(pending, line)
            else:
                self._auth(pending, line)

    def _hello(self, pending: Pending, line: bytes) -> None:
        hello, probe = protocol.HELLO.fullmatch(line), protocol.PROBE.fullmatch(line)
        match = hello or probe
        if match is None or (hello is not None and int(hello[5]) > 65535):
            self._refuse(pending, "no valid HELLO or PROBE")
            return
        rank = int(match[1])
        why = self._unexpected(rank) if hello else self._unexpected_probe(rank)
        if why:
            self._refuse(pending, why)
            return
        pending.rank, pending.their_nonce, pending.their_id = rank, match[2].decode(), match[3].decode()
        pending.nonce = secrets.token_hex(16)
        listens = ""
        if hello is not None:
            pending.their_listener = (hello[4].decode(), int(hello[5]))
            listens = address_text(pending.their_listener)
        # A redial from the very process this rank declared lost is told so; a replacement (another id) is not.
        word = b"LOST" if self._lost_ids.get(rank) == pending.their_id else (b"ALIVE" if probe else b"CHALLENGE")
        nonces, ids = (pending.their_nonce, pending.nonce), (pending.their_id, self.id)
        reply = f"{word.decode()} {pending.nonce} {self.id} {proof(self._key, ROLES[word], rank, self.rank, nonces, ids, self._address_text, listens)}\n"
        try:
            sent = pending.sock.send(reply.encode())
        except OSError:
            sent = 0
        if sent != len(reply):
            self._refuse(pending, "the answer could not be sent")
        elif word != b"CHALLENGE":
            self._drop_pending(pending)

    def _auth(self, pending: Pending, line: bytes) -> None:
        assert pending.rank is not None and pending.their_listener is not None
        match = protocol.AUTH.fullmatch(line)
        nonces, ids = (pending.their_nonce, pending.nonce), (pending.their_id, self.id)
        listens = address_text(pending.their_listener)
        expected = proof(self._key, "dialer", pending.rank, self.rank, nonces, ids, self._address_text, listens)
        if match is None or not protocol.proof_matches(expected, match[1]):
            self._refuse(pending, f"claimed rank {pending.rank} without the job's secret, or dialled another address")
            return
        old = self.links.get(pending.rank)
        if old is not None and old.peer_id != pending.their_id:
            # Another process authenticated as the same rank meanwhile: the first one stays.
            self._refuse(pending, f"claimed rank {pending.rank}, which has an authenticated link from another process")
            return
        if old is not None:
            # The same process, proven, makes its link anew (it found its old connection held back, or
            # closed it): the old connection goes quietly, no verdict.
            log.info("torch_peer_watcher: rank %d: rank %d made its link anew", self.rank, pending.rank)
            self._forget(old)
        self._pending.discard(pending)
        self._selector.unregister(pending.sock)
        into, out = protocol.link_keys(self._key, pending.rank, self.rank, nonces, self._address_text)
        dialled = Dialled(b"CHALLENGE", pending.their_id, pending.sock, pending.inbox, Sealer(out), Opener(into))
        self._add(pending.rank, dialled, pending.their_listener)

    def _unexpected(self, rank: int) -> str | None:
        """Why a HELLO from ``rank`` is refused, or None."""
        if rank >= self.world_size:
            return f"claimed rank {rank}, not in this job (world size {self.world_size})"
        if rank == self.rank:
            return f"claimed this rank ({rank})"
        if rank > self.rank:
            return f"claimed rank {rank}, which does not dial rank {self.rank} (the lower rank dials)"
        # A rank that has a link may dial again: AUTH decides (the same process remakes it; another is refused).
        return None

    def _unexpected_probe(self, rank: int) -> str | None:
        """Why a PROBE from ``rank`` is refused, or None (any other rank of the job may ask)."""
        if rank >= self.world_size:
            return f"probed as rank {rank}, not in this job (world size {self.world_size})"
        if rank == self.rank:
            return f"probed as this rank ({rank})"
        return None

    def _refuse(self, pending: Pending, why: str) -> None:
        self._drop_pending(pending)
        self._note_refused(pending.address, why)

    def _note_refused(self, address: Any, why: str) -> None:
        self._refused += 1
        self._log("refused", "torch_peer_watcher: rank %d refused a connection from %s: %s (%d refused so far)",
                  self.rank, address, why, self._refused)  # fmt: skip

    def _drop_pending(self, pending: Pending) -> None:
        if pending in self._pending:
            self._pending.discard(pending)
            self._selector.unregister(pending.sock)
        pending.sock.close()
