"""One TCP connection per peer, and the thread that keeps them: heartbeats out, verdicts in.

The thread (``torch-peer-watcher``) owns every link. It sends a heartbeat to each peer every
interval, reads whatever the peers send, and declares a peer lost when its connection closes
(EOF or reset: the peer process is gone, the kernel closed its sockets) or when nothing arrived
from it for the heartbeat timeout (the peer is alive but stuck: stopped, or its interpreter
cannot run this thread). It never blocks on a peer: sockets are non-blocking, and what the
verdict triggers (aborting process groups) runs elsewhere, through ``on_lost``.

Wire format, one ASCII line per message. A link is authenticated first, in both directions, with
the job's secret (``TORCH_PEER_WATCHER_SECRET``; never in the store) and a fresh nonce from each
side, so that neither side can be impersonated and a recorded handshake cannot be replayed::

    dialer -> listener   HELLO <dialer rank> <dialer nonce>
    listener -> dialer   CHALLENGE <listener nonce> <proof("listener")>
    dialer -> listener   AUTH <proof("dialer")>

where a nonce is 16 random bytes in hex and ``proof(role)`` is HMAC-SHA256 of the secret over
:data:`PROTOCOL`, the role, both ranks and both nonces (hex). The listener takes a HELLO only from a
rank of the job below its own (the lower rank dials, :meth:`PeerWatcher.watch`) that has no
authenticated link yet. Then, on the authenticated link: ``H`` (heartbeat), ``E <json [[host,
port], ...]>`` (the sender's TCP endpoints, when they changed; see :mod:`torch_peer_watcher.sockets`),
``B`` (a clean goodbye: the peer stopped watching, it did not die), ``L`` (sent just before the
sender closes the link over a silence verdict: "I declared you lost"). A peer that reads ``L`` is
alive although its peer heard nothing from it for the timeout (it stalled, or the link lost its
heartbeats): it is the side the job goes on without, and it records the loss as *accused*
(:attr:`LinkLoop.accused_by`) instead of reading the closed link as the sender's death, so that the
two sides of a failed link never both train on.

What a peer sends cannot end the thread: every message is parsed strictly (ASCII digits, bounded
numbers and lines); a connection that fails its handshake is closed; an invalid endpoint list is
ignored (the last valid one is kept); anything unforeseen while handling a message drops that
link (reported as lost) and is logged, and a guard around every event keeps the loop running.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import json
import logging
import queue
import re
import secrets
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch_peer_watcher.sockets import Endpoint, local_endpoints

PROTOCOL = "torch_peer_watcher/2"
# A connection that has not authenticated within this is closed (a real peer needs one round trip).
HELLO_TIMEOUT_S = 5.0
# Connections waiting to authenticate beyond the lower ranks not linked yet; the rest are refused.
MAX_PENDING = 64
_MAX_LINE = 1 << 20
_MAX_HANDSHAKE_LINE = 256
_MAX_ENDPOINTS = 1 << 16
# After accept() failed for want of a file descriptor: the listener rests this long (no busy loop).
_ACCEPT_BACKOFF_S = 0.5
_ACCEPTS_PER_EVENT = 32
_OUT_OF_FDS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
_LOG_EVERY_S = 10.0

_HELLO = re.compile(rb"HELLO (0|[1-9][0-9]{0,8}) ([0-9a-f]{32})")
_CHALLENGE = re.compile(rb"CHALLENGE ([0-9a-f]{32}) ([0-9a-f]{64})")
_AUTH = re.compile(rb"AUTH ([0-9a-f]{64})")

log = logging.getLogger("torch_peer_watcher")


class HandshakeError(ConnectionError):
    """The peer did not prove that it holds the job's secret (or is not the rank it should be)."""


class _Refused(ConnectionError):
    """The listener closed the connection before its challenge (busy, or the rank is linked still)."""


def proof(key: bytes, role: str, dialer: int, listener: int, dialer_nonce: str, listener_nonce: str) -> str:
    """HMAC-SHA256 (hex) that ``role`` ("dialer" or "listener") of this link holds ``key``."""
    message = f"{PROTOCOL} {role} {dialer} {listener} {dialer_nonce} {listener_nonce}".encode()
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def parse_endpoints(data: bytes) -> frozenset[Endpoint] | None:
    """The endpoints of an ``E`` message, or None when it is not a valid list of (host, port)."""
    if len(data) > _MAX_LINE:
        return None
    try:
        value = json.loads(data, parse_float=_reject, parse_constant=_reject)
    except (ValueError, RecursionError):
        return None
    if not isinstance(value, list) or len(value) > _MAX_ENDPOINTS:
        return None
    found = set()
    for item in value:
        if not isinstance(item, list) or len(item) != 2:
            return None
        host, port = item
        if not isinstance(host, str) or not 0 < len(host) <= 255 or not host.isascii():
            return None
        if type(port) is not int or not 0 < port < 65536:
            return None
        found.add((host, port))
    return frozenset(found)


def _reject(text: str) -> Any:
    raise ValueError(f"not a port: {text[:20]}")


@dataclass(eq=False)
class Link:
    """The authenticated connection to one peer (global rank) and what it said last."""

    rank: int
    sock: socket.socket
    last_heard: float
    endpoints: frozenset[Endpoint] = frozenset()
    inbox: bytes = b""
    outbox: bytes = b""
    complained: set[str] = field(default_factory=set)


@dataclass(eq=False)
class _Pending:
    """An accepted connection that has not authenticated yet."""

    sock: socket.socket
    since: float
    address: Any
    inbox: bytes = b""
    rank: int | None = None
    nonce: str = ""
    their_nonce: str = ""


@dataclass
class LinkEvents:
    """What the loop reports, called in the loop thread: must return quickly."""

    on_link: Callable[[int], None]
    on_lost: Callable[[int, str, float, frozenset[Endpoint]], None]
    on_left: Callable[[int], None]


class LinkLoop:
    """The listener, the links and their thread."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        secret: str | None,
        host: str,
        interval_s: float,
        timeout_s: float,
        events: LinkEvents,
        publish_endpoints: Callable[[], bool],
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self._key = secret.encode() if secret else b""
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.events = events
        self.publish_endpoints = publish_endpoints
        self.listener = socket.create_server((host, 0), backlog=128)
        self.listener.setblocking(False)
        self.address: Endpoint = (host, self.listener.getsockname()[1])
        self.links: dict[int, Link] = {}
        self.lost: set[int] = set()
        # Ranks that declared this one lost (an L on their link) before it declared them lost.
        self.accused_by: set[int] = set()
        self._pending: set[_Pending] = set()
        self._commands: queue.Queue = queue.Queue()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self.listener, selectors.EVENT_READ, "listener")
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._accept_paused_until: float | None = None
        self._stopping = False
        self._sent_endpoints: frozenset[Endpoint] | None = None
        self._lock = threading.Lock()
        self._refused = 0
        self._next_log: dict[str, float] = {}
        self.thread = threading.Thread(target=self._run, name="torch-peer-watcher", daemon=True)

    # --- called from other threads ---------------------------------------------------------------

    def start(self) -> None:
        """Start the thread."""
        self.thread.start()

    def connect(self, rank: int, address: Endpoint, timeout_s: float) -> None:
        """Open the link to ``rank`` (this side dials), authenticate it and hand it to the thread.

        A listener that closes the connection before its challenge (too many connections waiting,
        or the rank's previous link not declared lost yet) is asked again until ``timeout_s``.
        Raises :class:`HandshakeError` when the listener does not prove the secret (retrying would
        not help), OSError when it cannot be reached.
        """
        deadline = time.monotonic() + timeout_s
        delay = 0.05
        while True:
            left = deadline - time.monotonic()
            try:
                sock, already_read = self._handshake(rank, address, max(0.1, min(HELLO_TIMEOUT_S, left)))
                break
            except (_Refused, TimeoutError) as exc:
                if time.monotonic() + delay >= deadline:
                    raise ConnectionError(f"rank {rank}'s watcher at {address[0]}:{address[1]} did not let this rank link: {exc}") from None
                time.sleep(delay)
                delay = min(2 * delay, 1.0)
        self._command(("add", rank, sock, already_read))

    def _handshake(self, rank: int, address: Endpoint, timeout_s: float) -> tuple[socket.socket, bytes]:
        sock = socket.create_connection(address, timeout=timeout_s)
        try:
            nonce = secrets.token_hex(16)
            sock.sendall(f"HELLO {self.rank} {nonce}\n".encode())
            inbox = b""
            while b"\n" not in inbox:
                try:
                    data = sock.recv(_MAX_HANDSHAKE_LINE)
                except ConnectionResetError:
                    data = b""
                if not data:
                    raise _Refused("it closed the connection before its challenge")
                inbox += data
                if len(inbox) > _MAX_HANDSHAKE_LINE:
                    break
            line, _, already_read = inbox.partition(b"\n")
            match = _CHALLENGE.fullmatch(line)
            if match is None or not hmac.compare_digest(
                match[2].decode(), proof(self._key, "listener", self.rank, rank, nonce, match[1].decode())
            ):
                raise HandshakeError(
                    f"the watcher at {address[0]}:{address[1]} did not prove that it is rank {rank} of this job: "
                    "do all ranks have the same TORCH_PEER_WATCHER_SECRET (or none)? Or the address in the store "
                    f"is not rank {rank}'s any more"
                )
            sock.sendall(f"AUTH {proof(self._key, 'dialer', self.rank, rank, nonce, match[1].decode())}\n".encode())
        except BaseException:
            sock.close()
            raise
        return sock, already_read

    def has_link(self, rank: int) -> bool:
        """True once a live link to ``rank`` exists."""
        with self._lock:
            return rank in self.links

    def is_lost(self, rank: int) -> bool:
        """True once ``rank`` was declared lost (and no replacement connected since)."""
        with self._lock:
            return rank in self.lost

    def endpoints_changed(self) -> None:
        """Ask the thread to send this process's endpoints again (new connections may exist)."""
        self._command(("endpoints",))

    def stop(self, goodbye: bool) -> None:
        """Say goodbye to every peer (if ``goodbye``), close everything and end the thread."""
        self._command(("stop", goodbye))
        if self.thread.is_alive() and threading.current_thread() is not self.thread:
            self.thread.join(timeout=5)

    def close_in_child(self) -> None:
        """After fork, in the child: drop this process's copies of the sockets without a word.

        The child must not keep the parent's connections open: a peer sees the parent's death as
        EOF only once every copy of the socket is closed.
        """
        for link in list(self.links.values()):
            link.sock.close()
        for pending in self._pending:
            pending.sock.close()
        for sock in (self.listener, self._wake_r, self._wake_w):
            sock.close()
        self.links.clear()

    def _command(self, command: tuple) -> None:
        self._commands.put(command)
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass

    # --- the thread ---------------------------------------------------------------------------------

    def _run(self) -> None:
        next_beat = time.monotonic()
        while not self._stopping:
            # Wake for the next heartbeat, the first peer's silence deadline (judged only at heartbeats, a
            # silence would be seen up to one interval late) or the end of an accept pause, whichever comes first.
            wake_at = min(next_beat, self._first_deadline())
            if self._accept_paused_until is not None:
                wake_at = min(wake_at, self._accept_paused_until)
            for key, mask in self._selector.select(timeout=max(0.0, wake_at - time.monotonic())):
                try:
                    self._event(key.data, mask)
                except Exception as exc:  # nothing a peer sends may end this thread
                    self._event_failed(key.data, exc)
                if self._stopping:
                    break
            now = time.monotonic()
            if self._accept_paused_until is not None and now >= self._accept_paused_until and not self._stopping:
                self._accept_paused_until = None
                self._selector.register(self.listener, selectors.EVENT_READ, "listener")
            if not self._stopping:
                self._judge_silence(now)
            if not self._stopping and now >= next_beat:
                next_beat = now + self.interval_s
                try:
                    self._beat(now)
                except Exception as exc:  # a heartbeat round that failed must not end the next ones
                    self._log("beat", "torch_peer_watcher: rank %d: heartbeat round failed: %s: %s", self.rank, type(exc).__name__, exc)
        self._close_all()

    def _event(self, data: Any, mask: int) -> None:
        if data == "listener":
            self._accept()
        elif data == "wake":
            self._drain_commands()
        elif isinstance(data, _Pending):
            self._read_pending(data)
        elif isinstance(data, Link):
            if mask & selectors.EVENT_READ:
                self._read(data)
            if mask & selectors.EVENT_WRITE and self.links.get(data.rank) is data:
                self._flush(data)

    def _event_failed(self, data: Any, exc: Exception) -> None:
        what = f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
        if isinstance(data, _Pending):
            self._refuse(data, f"handling it failed ({what})")
        elif isinstance(data, Link):
            log.warning("torch_peer_watcher: rank %d drops its link to rank %d: %s", self.rank, data.rank, what)
            self._lose(data, f"the watcher could not handle what rank {data.rank} sent ({what})")
        else:
            self._log(str(data), "torch_peer_watcher: rank %d: %s event failed: %s", self.rank, data, what)
            if data == "listener":
                self._pause_accepting()

    def _first_deadline(self) -> float:
        """When the first peer's silence would reach the heartbeat timeout (inf: no timeout, no peer)."""
        if not self.timeout_s or not self.links:
            return float("inf")
        return min(link.last_heard for link in self.links.values()) + self.timeout_s

    def _judge_silence(self, now: float) -> None:
        """Declare lost every peer silent for longer than the heartbeat timeout."""
        if not self.timeout_s:
            return
        for link in list(self.links.values()):
            silent = now - link.last_heard
            if silent > self.timeout_s:
                # What arrived while this thread could not run (its own process stalled) counts first:
                # a heartbeat, or the peer's own verdict on this rank.
                self._read(link)
                if self.links.get(link.rank) is not link:
                    continue
                silent = now - link.last_heard if link.last_heard <= now else 0.0
                if silent > self.timeout_s:
                    self._lose(link, f"no heartbeat from rank {link.rank} for {silent:.1f} s (stuck or stopped)", silent, accuse=True)

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
            pending = _Pending(sock, time.monotonic(), address)
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

    def _read_pending(self, pending: _Pending) -> None:
        try:
            data = pending.sock.recv(_MAX_HANDSHAKE_LINE)
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
                if len(pending.inbox) > _MAX_HANDSHAKE_LINE:
                    self._refuse(pending, "a handshake line too long")
                return
            pending.inbox = rest
            if pending.rank is None:
                self._hello(pending, line)
            else:
                self._auth(pending, line)

    def _hello(self, pending: _Pending, line: bytes) -> None:
        match = _HELLO.fullmatch(line)
        if match is None:
            self._refuse(pending, "no valid HELLO")
            return
        rank = int(match[1])
        why = self._unexpected(rank)
        if why:
            self._refuse(pending, why)
            return
        pending.rank, pending.their_nonce, pending.nonce = rank, match[2].decode(), secrets.token_hex(16)
        reply = f"CHALLENGE {pending.nonce} {proof(self._key, 'listener', rank, self.rank, pending.their_nonce, pending.nonce)}\n"
        try:
            sent = pending.sock.send(reply.encode())
        except OSError:
            sent = 0
        if sent != len(reply):
            self._refuse(pending, "the challenge could not be sent")

    def _auth(self, pending: _Pending, line: bytes) -> None:
        assert pending.rank is not None
        match = _AUTH.fullmatch(line)
        expected = proof(self._key, "dialer", pending.rank, self.rank, pending.their_nonce, pending.nonce)
        if match is None or not hmac.compare_digest(match[1].decode(), expected):
            self._refuse(pending, f"claimed rank {pending.rank} without the job's secret")
            return
        # Another connection may have authenticated as the same rank meanwhile: the first one stays.
        why = self._unexpected(pending.rank)
        if why:
            self._refuse(pending, why)
            return
        self._pending.discard(pending)
        self._selector.unregister(pending.sock)
        self._add(pending.rank, pending.sock, pending.inbox)

    def _unexpected(self, rank: int) -> str | None:
        """Why a HELLO from ``rank`` is refused, or None."""
        if rank >= self.world_size:
            return f"claimed rank {rank}, not in this job (world size {self.world_size})"
        if rank == self.rank:
            return f"claimed this rank ({rank})"
        if rank > self.rank:
            return f"claimed rank {rank}, which does not dial rank {self.rank} (the lower rank dials)"
        if rank in self.links:
            return f"claimed rank {rank}, which has an authenticated link already"
        return None

    def _refuse(self, pending: _Pending, why: str) -> None:
        self._drop_pending(pending)
        self._note_refused(pending.address, why)

    def _note_refused(self, address: Any, why: str) -> None:
        self._refused += 1
        self._log("refused", "torch_peer_watcher: rank %d refused a connection from %s: %s (%d refused so far)",
                  self.rank, address, why, self._refused)  # fmt: skip

    def _log(self, topic: str, message: str, *args: Any) -> None:
        """A warning, at most one per topic every few seconds (a flood must not flood the log)."""
        now = time.monotonic()
        if now >= self._next_log.get(topic, 0.0):
            self._next_log[topic] = now + _LOG_EVERY_S
            log.warning(message, *args)

    def _drop_pending(self, pending: _Pending) -> None:
        if pending in self._pending:
            self._pending.discard(pending)
            self._selector.unregister(pending.sock)
        pending.sock.close()

    def _drain_commands(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                command[2].setblocking(False)
                self._add(command[1], command[2], command[3])
            elif command[0] == "endpoints":
                self._sent_endpoints = None
            elif command[0] == "stop":
                if command[1]:
                    for link in list(self.links.values()):
                        self._say(link, b"B\n")
                        self._flush(link)
                self._stopping = True
                return

    def _add(self, rank: int, sock: socket.socket, already_read: bytes) -> None:
        old = self.links.get(rank)
        if old is not None:
            # A second link from a rank we still hear: keep the first, it has the history.
            sock.close()
            return
        link = Link(rank, sock, time.monotonic())
        with self._lock:
            self.links[rank] = link
            # A replacement process took the rank over: it is a new peer.
            self.lost.discard(rank)
            self.accused_by.discard(rank)
        self._selector.register(sock, selectors.EVENT_READ, link)
        self._sent_endpoints = None
        self.events.on_link(rank)
        if already_read:
            link.inbox = already_read
            self._parse(link)

    def _read(self, link: Link) -> None:
        try:
            data = link.sock.recv(65536)
        except BlockingIOError:
            return
        except OSError as exc:
            self._lose(link, f"connection to rank {link.rank} failed ({exc.strerror or exc})")
            return
        if not data:
            self._lose(link, f"rank {link.rank} closed its connection (process gone)")
            return
        link.last_heard = time.monotonic()
        link.inbox += data
        self._parse(link)
        if self.links.get(link.rank) is link and len(link.inbox) > _MAX_LINE:
            self._lose(link, f"rank {link.rank} sent a line longer than {_MAX_LINE} bytes")

    def _parse(self, link: Link) -> None:
        while self.links.get(link.rank) is link:
            line, newline, rest = link.inbox.partition(b"\n")
            if not newline:
                return
            link.inbox = rest
            try:
                self._message(link, line)
            except Exception as exc:  # one message must not end the thread: that link goes
                what = f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
                log.warning("torch_peer_watcher: rank %d drops its link to rank %d: %s", self.rank, link.rank, what)
                self._lose(link, f"the watcher could not handle a message of rank {link.rank} ({what})")
                return

    def _message(self, link: Link, line: bytes) -> None:
        if line in (b"H", b""):  # b"": the line break that precedes an L (_lose)
            return
        if line == b"L":
            with self._lock:
                self.accused_by.add(link.rank)
            self._lose(link, f"rank {link.rank} declared this rank lost (it heard nothing from this rank for its heartbeat timeout)")
            return
        if line == b"B":
            self._forget(link)
            self.events.on_left(link.rank)
            return
        if line.startswith(b"E "):
            endpoints = parse_endpoints(line[2:])
            if endpoints is not None:
                link.endpoints = endpoints
                return
            why = "an invalid endpoint list; the last valid one is kept"
        else:
            why = "a message this watcher does not know; ignored"
        if why not in link.complained:  # once per kind and link: a peer cannot flood the log
            link.complained.add(why)
            log.warning("torch_peer_watcher: rank %d got from rank %d %s: %r", self.rank, link.rank, why, line[:80])

    def _beat(self, now: float) -> None:
        message = b"H\n"
        if self.publish_endpoints():
            try:
                current: frozenset[Endpoint] | None = local_endpoints()
            except OSError as exc:
                # Never an empty set for a read error: the peers would cut nothing. They keep the last.
                current = None
                self._log("endpoints", "torch_peer_watcher: rank %d cannot list its sockets (%s); its peers keep the "
                          "endpoints it sent last", self.rank, exc.strerror or exc)  # fmt: skip
            if current is not None and current != self._sent_endpoints:
                self._sent_endpoints = current
                message += b"E " + json.dumps(sorted(current)).encode() + b"\n"
        for link in list(self.links.values()):
            self._say(link, message)
            self._flush(link)
        for pending in list(self._pending):
            if now - pending.since > HELLO_TIMEOUT_S:
                self._refuse(pending, f"did not authenticate within {HELLO_TIMEOUT_S:.0f} s")

    def _say(self, link: Link, data: bytes) -> None:
        # A peer that does not read (stopped) must not grow our memory without bound.
        if len(link.outbox) < _MAX_LINE:
            link.outbox += data

    def _flush(self, link: Link) -> None:
        if link.outbox:
            try:
                sent = link.sock.send(link.outbox)
                link.outbox = link.outbox[sent:]
            except BlockingIOError:
                pass
            except OSError:
                # The read side reports the failure with its cause.
                return
        wanted = selectors.EVENT_READ | (selectors.EVENT_WRITE if link.outbox else 0)
        try:
            self._selector.modify(link.sock, wanted, link)
        except (KeyError, ValueError):
            pass

    def _forget(self, link: Link) -> None:
        with self._lock:
            if self.links.get(link.rank) is link:
                del self.links[link.rank]
        try:
            self._selector.unregister(link.sock)
        except (KeyError, ValueError):
            pass
        link.sock.close()

    def _lose(self, link: Link, cause: str, silent_s: float = 0.0, accuse: bool = False) -> None:
        if self.links.get(link.rank) is not link:
            return
        if accuse:
            # Best effort, before the close: the kernel still delivers it (a link that merely lost our
            # heartbeats carries it; a cut or dead one does not, and then nothing reads it). The line
            # break first ends any line the outbox left half-sent.
            try:
                link.sock.send(b"\nL\n")
            except OSError:
                pass
        self._forget(link)
        with self._lock:
            self.lost.add(link.rank)
        self.events.on_lost(link.rank, cause, silent_s, link.endpoints)

    def _close_all(self) -> None:
        for link in list(self.links.values()):
            self._forget(link)
        for pending in list(self._pending):
            self._drop_pending(pending)
        self._selector.close()
        for sock in (self.listener, self._wake_r, self._wake_w):
            sock.close()
