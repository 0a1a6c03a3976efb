"""One TCP connection per peer, and the thread that keeps them: heartbeats out, verdicts in.

The thread (``torch-peer-watcher``) owns every link. It sends a heartbeat to each peer every
interval, reads whatever the peers send, and declares a peer lost when its connection closes
(EOF or reset: the peer process is gone, the kernel closed its sockets) or when nothing arrived
from it for the heartbeat timeout (the peer is alive but stuck: stopped, or its interpreter
cannot run this thread). It never blocks on a peer: sockets are non-blocking, and what the
verdict triggers (aborting process groups) runs elsewhere, through ``on_lost``.

Wire format, one line per message: ``HELLO <rank> <token>`` (the connecting side, once),
``H`` (heartbeat), ``E <json [[host, port], ...]>`` (the sender's TCP endpoints, when they
changed; see :mod:`torch_peer_watcher.sockets`), ``B`` (a clean goodbye: the peer stopped watching,
it did not die).
"""

from __future__ import annotations

import json
import queue
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from torch_peer_watcher.sockets import Endpoint, local_endpoints

_MAX_LINE = 1 << 20


@dataclass
class Link:
    """The connection to one peer (global rank) and what it said last."""

    rank: int
    sock: socket.socket
    last_heard: float
    endpoints: frozenset[Endpoint] = frozenset()
    inbox: bytes = b""
    outbox: bytes = b""


@dataclass
class _Pending:
    """An accepted connection that has not said HELLO yet."""

    sock: socket.socket
    since: float
    inbox: bytes = b""


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
        token: str,
        host: str,
        interval_s: float,
        timeout_s: float,
        events: LinkEvents,
        publish_endpoints: Callable[[], bool],
    ) -> None:
        self.rank = rank
        self.token = token
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.events = events
        self.publish_endpoints = publish_endpoints
        self.listener = socket.create_server((host, 0), backlog=128)
        self.listener.setblocking(False)
        self.address: Endpoint = (host, self.listener.getsockname()[1])
        self.links: dict[int, Link] = {}
        self.lost: set[int] = set()
        self._pending: list[_Pending] = []
        self._commands: queue.Queue = queue.Queue()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self.listener, selectors.EVENT_READ, "listener")
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._stopping = False
        self._sent_endpoints: frozenset[Endpoint] | None = None
        self._lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, name="torch-peer-watcher", daemon=True)

    # --- called from other threads ---------------------------------------------------------------

    def start(self) -> None:
        """Start the thread."""
        self.thread.start()

    def connect(self, rank: int, address: Endpoint, timeout_s: float) -> None:
        """Open the link to ``rank`` (this side connects) and hand it to the thread."""
        sock = socket.create_connection(address, timeout=timeout_s)
        sock.sendall(f"HELLO {self.rank} {self.token}\n".encode())
        self._command(("add", rank, sock))

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
            # Wake for the next heartbeat or the first peer's silence deadline, whichever comes first:
            # judged only at heartbeats, a silence would be seen up to one interval late.
            wake = min(next_beat, self._first_deadline())
            for key, mask in self._selector.select(timeout=max(0.0, wake - time.monotonic())):
                if key.data == "listener":
                    self._accept()
                elif key.data == "wake":
                    self._drain_commands()
                elif isinstance(key.data, _Pending):
                    self._read_pending(key.data)
                elif isinstance(key.data, Link):
                    if mask & selectors.EVENT_READ:
                        self._read(key.data)
                    if mask & selectors.EVENT_WRITE and key.data.rank in self.links:
                        self._flush(key.data)
                if self._stopping:
                    break
            now = time.monotonic()
            if not self._stopping:
                self._judge_silence(now)
            if not self._stopping and now >= next_beat:
                next_beat = now + self.interval_s
                self._beat(now)
        self._close_all()

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
                self._lose(link, f"no heartbeat from rank {link.rank} for {silent:.1f} s (stuck or stopped)", silent)

    def _accept(self) -> None:
        try:
            sock, _ = self.listener.accept()
        except OSError:
            return
        sock.setblocking(False)
        pending = _Pending(sock, time.monotonic())
        self._pending.append(pending)
        self._selector.register(sock, selectors.EVENT_READ, pending)

    def _read_pending(self, pending: _Pending) -> None:
        try:
            data = pending.sock.recv(4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        pending.inbox += data
        if b"\n" not in pending.inbox:
            if not data or len(pending.inbox) > 256:
                self._drop_pending(pending)
            return
        line, rest = pending.inbox.split(b"\n", 1)
        parts = line.decode(errors="replace").split()
        self._pending.remove(pending)
        self._selector.unregister(pending.sock)
        if len(parts) != 3 or parts[0] != "HELLO" or parts[2] != self.token or not parts[1].isdigit():
            pending.sock.close()
            return
        self._add(int(parts[1]), pending.sock, rest)

    def _drop_pending(self, pending: _Pending) -> None:
        self._pending.remove(pending)
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
                self._add(command[1], command[2], b"")
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
        if len(link.inbox) > _MAX_LINE:
            self._lose(link, f"rank {link.rank} sent garbage")
            return
        self._parse(link)

    def _parse(self, link: Link) -> None:
        while b"\n" in link.inbox and link.rank in self.links:
            line, link.inbox = link.inbox.split(b"\n", 1)
            if line == b"B":
                self._forget(link)
                self.events.on_left(link.rank)
                return
            if line.startswith(b"E "):
                try:
                    link.endpoints = frozenset((str(h), int(p)) for h, p in json.loads(line[2:]))
                except (ValueError, TypeError):
                    continue

    def _beat(self, now: float) -> None:
        message = b"H\n"
        if self.publish_endpoints():
            current = local_endpoints()
            if current != self._sent_endpoints:
                self._sent_endpoints = current
                message += b"E " + json.dumps(sorted(current)).encode() + b"\n"
        for link in list(self.links.values()):
            self._say(link, message)
            self._flush(link)
        for pending in list(self._pending):
            if now - pending.since > 60:
                self._drop_pending(pending)

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
            self.links.pop(link.rank, None)
        try:
            self._selector.unregister(link.sock)
        except (KeyError, ValueError):
            pass
        link.sock.close()

    def _lose(self, link: Link, cause: str, silent_s: float = 0.0) -> None:
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
