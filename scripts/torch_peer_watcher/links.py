"""One TCP connection per peer, and the thread that keeps them: heartbeats out, verdicts in.

The thread (``torch-peer-watcher``) owns every link. It sends a heartbeat to each peer every
interval, reads whatever the peers send, and declares a peer lost when nothing arrived from it for
the heartbeat timeout (the peer is alive but stuck: stopped, or its interpreter cannot run this
thread), or when its link closed (EOF or reset) and a redial confirms that the peer is gone. It
never blocks on a peer: sockets are non-blocking, a redial runs in a short thread of its own, and
what a verdict triggers (aborting process groups) runs elsewhere, through ``on_lost``.

The wire format (:mod:`torch_peer_watcher.protocol`): a handshake that authenticates both sides
with the job's secret (``TORCH_PEER_WATCHER_SECRET``; never in the store) and binds the link to
the address the dialer dialled, then one line per message, each with a MAC under the link's keys. The
listener's side of the handshake (who may open a link) is :mod:`torch_peer_watcher.admission`.
The listener takes a HELLO only from a rank of the job below its own (the lower rank dials,
:meth:`PeerWatcher.watch`); of a rank that has an authenticated link, only from the same process,
proven (it makes its link anew). On the link: ``H`` (heartbeat),
``E <json [[host, port], ...]>`` (the sender's TCP endpoints, when they changed; see
:mod:`torch_peer_watcher.sockets`), ``B`` (a clean goodbye: the peer stopped watching, it did not
die), ``S`` (the sender hosts the job's store: sent first on every link, so that its peer learns it
from the sender itself, not from the store, where anyone can write; it says nothing of the sender's
liveness, so it does not count as heard), ``L`` (sent just before the sender closes the link over a
silence verdict: "I declared you lost"). A peer that reads ``L`` is alive although its peer heard nothing from it for the timeout
(it stalled, or the link lost its heartbeats): it records the loss as *accused*
(:attr:`LinkLoop.accused_by`, kind :data:`ACCUSED`), and the store decides which side goes on, so
that the two sides of a failed link never both train on.

A link that closes, or carries a message whose MAC fails (something between the ranks wrote to it),
is not a verdict. The lower rank dials the peer's listener again (HELLO), the higher rank asks the
lower rank's listener whether it lives (PROBE): a live peer answers with a proof and the link is
made again; a refused connect (nothing listens: the process is gone, or it stopped its watcher) is
the verdict, in a millisecond, and so is a listener of another Unix user at the peer's address (a
process that took the dead peer's freed port: :func:`torch_peer_watcher.sockets.other_end_owner`); a
peer that does not answer by its heartbeat deadline is lost as a silent one is; a peer that answers
LOST declared this process lost first. Every verdict is settled in the store, where the peer may
have judged first (:mod:`torch_peer_watcher.verdicts`). A link that ends before it carried a
message (its listener refused the AUTH: another process of that rank holds the link) keeps the
peer's silence running, and each such redial waits twice as long as the last (from 40 ms to 1 s).
A peer silent past half its timeout is asked the same way on new connections until its deadline: one
that answers gets its link made anew (its old connection was held back by TCP's backed-off
retransmissions after a cut that healed), with no verdict.

What a peer sends cannot end the thread: every message is parsed strictly (ASCII digits, bounded
numbers and lines); a connection that fails its handshake is closed; an invalid endpoint list is
ignored (the last valid one is kept); anything unforeseen while handling a message ends that link
(then confirmed by a redial) and is logged, and a guard around every event keeps the loop running.
"""

from __future__ import annotations

import json
import logging
import queue
import secrets
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch_peer_watcher.admission import MAX_PENDING, Admission, Pending
from torch_peer_watcher.dialing import Dialled, Dialer, HandshakeError, Refused, dial
from torch_peer_watcher.linkevents import ACCUSED, GONE, SILENT, LinkEvents, Verdict
from torch_peer_watcher.protocol import MAX_LINE, Opener, Sealer, address_text, job_key, parse_endpoints, proof
from torch_peer_watcher.sockets import Endpoint, local_endpoints

# A connection that has not authenticated within this is closed (a real peer needs one round trip).
HELLO_TIMEOUT_S = 5.0
_LOG_EVERY_S = 10.0
# A redial that found the listener busy (its old link not ended yet) tries again after this, doubling.
_REDIAL_PAUSE_S = 0.02
# The longest wait before a redial after links that ended before they carried a message.
_MAX_BACKOFF_S = 1.0

log = logging.getLogger("torch_peer_watcher")

__all__ = ["ACCUSED", "GONE", "HELLO_TIMEOUT_S", "MAX_PENDING", "SILENT", "HandshakeError", "Link", "LinkEvents", "LinkLoop",
           "Verdict", "parse_endpoints", "proof"]


@dataclass(eq=False)
class Link:
    """The authenticated connection to one peer (global rank) and what it said last.

    ``address`` is the peer's listener (where a redial goes); ``peer_id`` names the peer's process.
    """

    rank: int
    sock: socket.socket
    last_heard: float
    address: Endpoint
    peer_id: str
    sealer: Sealer
    opener: Opener
    endpoints: frozenset[Endpoint] = frozenset()
    inbox: bytes = b""
    outbox: bytes = b""
    complained: set[str] = field(default_factory=set)
    # The last_heard of the silence a probe on a fresh connection was sent for (one probe per silence).
    probed_for: float | None = None
    # True once a message on it passed its MAC. A link made by a redial keeps the silence it was
    # made in (silent_since) until then: a link that ends at once does not restart the peer's clock.
    carried: bool = False
    silent_since: float | None = None


@dataclass(eq=False)
class _Confirming:
    """A peer whose link ended, while a redial finds out whether it lives (no verdict yet)."""

    rank: int
    cause: str
    last_heard: float
    deadline: float
    address: Endpoint
    peer_id: str
    endpoints: frozenset[Endpoint]
    # The peer's listener answered ALIVE: this side waits for the peer's own redial until the deadline.
    answered: bool = False


class LinkLoop(Admission):
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
        job: str = "",
        hosts_store: bool = False,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        # Every proof and MAC is made with the job key: another job's processes, same secret or not, prove nothing here.
        self._key = job_key(secret, job)
        self.hosts_store = hosts_store
        # Names this process on the wire: a redial from a process declared lost is told so (LOST).
        self.id = secrets.token_hex(16)
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.events = events
        self.publish_endpoints = publish_endpoints
        self.listener = socket.create_server((host, 0), backlog=128)
        self.listener.setblocking(False)
        self.address: Endpoint = (host, self.listener.getsockname()[1])
        self._address_text = address_text(self.address)
        self.links: dict[int, Link] = {}
        self.lost: set[int] = set()
        # The process id of each rank declared lost: its redial is answered LOST, a replacement's is not.
        self._lost_ids: dict[int, str] = {}
        # Ranks that declared this one lost (an L on their link, or LOST to a redial) before it declared them lost.
        self.accused_by: set[int] = set()
        # The ids of the peer processes that said, on their authenticated link, that they host the job's store.
        self.store_hosts: set[str] = set()
        # Per rank: how many links in a row ended before they carried a message (the redial's back-off).
        self._quick_failures: dict[int, int] = {}
        self._confirming: dict[int, _Confirming] = {}
        self._pending: set[Pending] = set()
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
        or the rank's previous link not ended yet) is asked again until ``timeout_s``. Raises
        :class:`HandshakeError` when the listener does not prove the secret for this address, or
        declared this process lost (retrying would not help), OSError when it cannot be reached.
        """
        deadline = time.monotonic() + timeout_s
        delay = 0.05
        while True:
            left = deadline - time.monotonic()
            try:
                dialled = self._dial(rank, address, probe=False, timeout_s=max(0.1, min(HELLO_TIMEOUT_S, left)))
                break
            except (Refused, TimeoutError) as exc:
                if time.monotonic() + delay >= deadline:
                    raise ConnectionError(f"rank {rank}'s watcher at {address[0]}:{address[1]} did not let this rank link: {exc}") from None
                time.sleep(delay)
                delay = min(2 * delay, 1.0)
        if dialled.word == b"LOST":
            raise HandshakeError(f"rank {rank} declared this process lost earlier: it is out of the job")
        self._command(("add", rank, dialled, address, None))

    def _dial(self, rank: int, address: Endpoint, probe: bool, timeout_s: float, check_owner: bool = False) -> Dialled:
        """Dial ``rank``'s listener at ``address``: HELLO (a link), or PROBE (does it live?). Blocks."""
        me = Dialer(self.rank, self.id, self._address_text, self._key)
        return dial(me, rank, address, probe=probe, timeout_s=timeout_s, check_owner=check_owner)

    def has_link(self, rank: int) -> bool:
        """True once a live link to ``rank`` exists."""
        with self._lock:
            return rank in self.links

    def is_lost(self, rank: int) -> bool:
        """True once ``rank`` was declared lost (and no replacement connected since)."""
        with self._lock:
            return rank in self.lost

    def is_confirming(self, rank: int) -> bool:
        """True while ``rank``'s link has ended and a redial finds out whether it lives."""
        with self._lock:
            return rank in self._confirming

    def hosts_the_store(self, peer_id: str) -> bool:
        """True if the peer process ``peer_id`` said on its link that it hosts the job's store (``S``)."""
        with self._lock:
            return peer_id in self.store_hosts

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
        elif isinstance(data, Pending):
            self._read_pending(data)
        elif isinstance(data, Link):
            if mask & selectors.EVENT_READ:
                self._read(data)
            if mask & selectors.EVENT_WRITE and self.links.get(data.rank) is data:
                self._flush(data)

    def _event_failed(self, data: Any, exc: Exception) -> None:
        what = f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
        if isinstance(data, Pending):
            self._refuse(data, f"handling it failed ({what})")
        elif isinstance(data, Link):
            self._link_failed(data, f"the watcher could not handle what rank {data.rank} sent ({what})", attack=True)
        else:
            self._log(str(data), "torch_peer_watcher: rank %d: %s event failed: %s", self.rank, data, what)
            if data == "listener":
                self._pause_accepting()

    def _first_deadline(self) -> float:
        """When the first peer's silence would reach the heartbeat timeout, or a confirmed live peer's
        redial is due (inf: neither)."""
        deadlines = [c.deadline for c in self._confirming.values() if c.answered]
        if self.timeout_s:
            deadlines += [link.last_heard + self.timeout_s for link in self.links.values()]
            deadlines += [link.last_heard + self._probe_after_s() for link in self.links.values() if link.probed_for != link.last_heard]
        return min(deadlines, default=float("inf"))

    def _probe_after_s(self) -> float:
        """How long a peer may be silent before a fresh connection asks whether it lives: one late
        heartbeat is not enough, half the timeout leaves the probe the other half."""
        return max(1.5 * self.interval_s, self.timeout_s / 2)

    def _judge_silence(self, now: float) -> None:
        """Declare lost every peer silent for longer than the heartbeat timeout, and every peer that
        answered a probe but did not link again by its deadline."""
        for confirming in list(self._confirming.values()):
            if confirming.answered and now >= confirming.deadline:
                self._declare(confirming, f"{confirming.cause}; rank {confirming.rank} answered a probe but did not link "
                              "again within its heartbeat deadline (its redials do not get through)", SILENT,
                              now - confirming.last_heard)  # fmt: skip
        if not self.timeout_s:
            return
        for link in list(self.links.values()):
            silent = now - link.last_heard
            if self._probe_after_s() < silent <= self.timeout_s and link.probed_for != link.last_heard:
                link.probed_for = link.last_heard
                threading.Thread(target=self._probe_silent, args=(link, link.last_heard + self.timeout_s),
                                 name=f"torch-peer-watcher-probe-{link.rank}", daemon=True).start()  # fmt: skip
            if silent > self.timeout_s:
                # What arrived while this thread could not run (its own process stalled) counts first:
                # a heartbeat, or the peer's own verdict on this rank.
                self._read(link)
                if self.links.get(link.rank) is not link:
                    continue
                silent = now - link.last_heard if link.last_heard <= now else 0.0
                if silent > self.timeout_s:
                    self._lose(link, f"no heartbeat from rank {link.rank} for {silent:.1f} s (stuck or stopped)", SILENT, silent, accuse=True)

    def _log(self, topic: str, message: str, *args: Any) -> None:
        """A warning, at most one per topic every few seconds (a flood must not flood the log)."""
        now = time.monotonic()
        if now >= self._next_log.get(topic, 0.0):
            self._next_log[topic] = now + _LOG_EVERY_S
            log.warning(message, *args)

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
                self._add(command[1], command[2], command[3], command[4])
            elif command[0] == "confirmed":
                self._confirmed(command[1], command[2], command[3])
            elif command[0] == "answered":
                self._answered(command[1])
            elif command[0] == "endpoints":
                self._sent_endpoints = None
            elif command[0] == "stop":
                if command[1]:
                    for link in list(self.links.values()):
                        self._send(link, b"B")
                        self._flush(link)
                self._stopping = True
                return

    def _add(self, rank: int, dialled: Dialled, address: Endpoint, silent_since: float | None = None) -> None:
        assert dialled.sock is not None and dialled.sealer is not None and dialled.opener is not None
        old = self.links.get(rank)
        if old is not None or self._stopping:
            # A second link from a rank we still hear: keep the first, it has the history.
            dialled.sock.close()
            return
        dialled.sock.setblocking(False)
        link = Link(rank, dialled.sock, time.monotonic(), address, dialled.peer_id, dialled.sealer, dialled.opener,
                    silent_since=silent_since)  # fmt: skip
        with self._lock:
            self.links[rank] = link
            # A redial that got through: the peer lives. Or a replacement process took the rank over: a new peer.
            self._confirming.pop(rank, None)
            self.lost.discard(rank)
            self._lost_ids.pop(rank, None)
            self.accused_by.discard(rank)
        self._selector.register(dialled.sock, selectors.EVENT_READ, link)
        self._sent_endpoints = None
        if self.hosts_store:
            self._send(link, b"S")
            self._flush(link)
        self.events.on_link(rank)
        if dialled.already_read:
            link.inbox = dialled.already_read
            self._parse(link)

    def _read(self, link: Link) -> None:
        try:
            data = link.sock.recv(65536)
        except BlockingIOError:
            return
        except OSError as exc:
            # A reset is a close too (the peer's kernel had unread data of ours when it closed the socket).
            self._link_failed(link, f"rank {link.rank} closed its connection ({exc.strerror or exc})")
            return
        if not data:
            self._link_failed(link, f"rank {link.rank} closed its connection")
            return
        link.inbox += data
        self._parse(link)
        if self.links.get(link.rank) is link and len(link.inbox) > MAX_LINE:
            self._link_failed(link, f"rank {link.rank}'s link carried a line longer than {MAX_LINE} bytes", attack=True)

    def _parse(self, link: Link) -> None:
        arrived = time.monotonic()
        while self.links.get(link.rank) is link:
            line, newline, rest = link.inbox.partition(b"\n")
            if not newline:
                return
            link.inbox = rest
            body = link.opener.open(line)
            if body is None:
                self._link_failed(link, f"a message on rank {link.rank}'s link failed its MAC ({line[:40]!r})", attack=True)
                return
            if body != b"S":
                # Heard: every authenticated message but S, which the peer sends once as the link is made
                # (a peer stalled since would seem to have spoken when this thread reads it, later).
                link.last_heard = arrived
            if not link.carried:
                link.carried = True
                self._quick_failures.pop(link.rank, None)
            try:
                self._message(link, body)
            except Exception as exc:  # one message must not end the thread: that link goes (and is redialled)
                what = f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
                self._link_failed(link, f"the watcher could not handle a message of rank {link.rank} ({what})", attack=True)
                return

    def _message(self, link: Link, body: bytes) -> None:
        if body == b"H":
            return
        if body == b"L":
            with self._lock:
                self.accused_by.add(link.rank)
            self._lose(link, f"rank {link.rank} declared this rank lost (it heard nothing from this rank for its heartbeat timeout)", ACCUSED)
            return
        if body == b"B":
            self._forget(link)
            self.events.on_left(link.rank)
            return
        if body == b"S":
            with self._lock:
                self.store_hosts.add(link.peer_id)
            return
        if body.startswith(b"E "):
            endpoints = parse_endpoints(body[2:])
            if endpoints is not None:
                link.endpoints = endpoints
                return
            why = "an invalid endpoint list; the last valid one is kept"
        else:
            why = "a message this watcher does not know; ignored"
        if why not in link.complained:  # once per kind and link: a peer cannot flood the log
            link.complained.add(why)
            log.warning("torch_peer_watcher: rank %d got from rank %d %s: %r", self.rank, link.rank, why, body[:80])

    def _beat(self, now: float) -> None:
        endpoints = None
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
                endpoints = b"E " + json.dumps(sorted(current)).encode()
        for link in list(self.links.values()):
            self._send(link, b"H")
            if endpoints is not None:
                self._send(link, endpoints)
            self._flush(link)
        for pending in list(self._pending):
            if now - pending.since > HELLO_TIMEOUT_S:
                self._refuse(pending, f"did not authenticate within {HELLO_TIMEOUT_S:.0f} s")

    def _send(self, link: Link, body: bytes) -> None:
        """Queue ``body`` as the link's next message. A peer that does not read (stopped) must not grow
        our memory without bound: past the cap nothing is queued, and nothing is numbered either, so
        the messages that are sent stay in sequence."""
        if len(link.outbox) < MAX_LINE:
            link.outbox += link.sealer.seal(body)

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

    def _lose(self, link: Link, cause: str, kind: str, silent_s: float = 0.0, accuse: bool = False) -> None:
        """The verdict on a linked peer: it is lost (silence, or it declared this rank lost: ``L``)."""
        if self.links.get(link.rank) is not link:
            return
        if accuse:
            # Best effort, before the close: the kernel still delivers it (a link that merely lost our
            # heartbeats carries it; a cut or dead one does not, and then nothing reads it).
            self._send(link, b"L")
            self._flush(link)
        self._forget(link)
        self._record_loss(link.rank, Verdict(cause, silent_s, link.endpoints, kind, link.peer_id))

    def _record_loss(self, rank: int, verdict: Verdict) -> None:
        with self._lock:
            self.lost.add(rank)
            self._lost_ids[rank] = verdict.peer_id
        self.events.on_lost(rank, verdict)

    def _link_failed(self, link: Link, cause: str, attack: bool = False) -> None:
        """``link`` ended without a verdict (closed, reset, or a message that failed its MAC or could not
        be handled): end it, and redial to find out whether the peer lives."""
        if self.links.get(link.rank) is not link:
            return
        if attack:
            log.warning("torch_peer_watcher: rank %d ends its link to rank %d: %s. Something other than rank %d wrote to "
                        "the link (an attack) or the watcher has a bug; not a verdict on rank %d: redialing it",
                        self.rank, link.rank, cause, link.rank, link.rank)  # fmt: skip
        else:
            log.info("torch_peer_watcher: rank %d: %s; redialing", self.rank, cause)
        self._forget(link)
        now = time.monotonic()
        last_heard = link.last_heard
        if not link.carried:
            # It ended before it carried a message (its listener refused our AUTH, or something ends each new
            # link): the peer's silence goes on from before, and the next redial waits longer.
            self._quick_failures[link.rank] = self._quick_failures.get(link.rank, 0) + 1
            if link.silent_since is not None:
                last_heard = link.silent_since
        # A peer that does not answer is judged as a silent one: by its heartbeat deadline.
        deadline = last_heard + self.timeout_s if self.timeout_s else now + HELLO_TIMEOUT_S
        confirming = _Confirming(link.rank, cause, last_heard, max(deadline, now + _REDIAL_PAUSE_S), link.address,
                                 link.peer_id, link.endpoints)  # fmt: skip
        with self._lock:
            self._confirming[link.rank] = confirming
        threading.Thread(target=self._redial, args=(confirming,), name=f"torch-peer-watcher-redial-{link.rank}", daemon=True).start()

    def _redial(self, confirming: _Confirming) -> None:
        """In its own thread: the lower rank of the link dials again, the higher one probes; the outcome
        goes to the loop thread."""
        probe = confirming.rank < self.rank
        pause = _REDIAL_PAUSE_S
        failures = self._quick_failures.get(confirming.rank, 0)
        if failures:
            time.sleep(max(0.0, min(_REDIAL_PAUSE_S * 2**failures, _MAX_BACKOFF_S, confirming.deadline - time.monotonic())))
        while True:
            left = confirming.deadline - time.monotonic()
            if left <= 0:
                outcome: tuple[str, Any] = ("silent", f"{confirming.cause} and did not answer a redial by its heartbeat deadline (stuck or gone)")
                break
            try:
                outcome = ("answer", self._dial(confirming.rank, confirming.address, probe=probe,
                                                timeout_s=min(left, HELLO_TIMEOUT_S), check_owner=True))  # fmt: skip
                break
            except ConnectionRefusedError:
                outcome = (GONE, f"{confirming.cause} (process gone)")
                break
            except HandshakeError as exc:
                outcome = (GONE, f"{confirming.cause}; {exc.not_the_peer or 'another process answers at its watcher address'} (process gone)")
                break
            except OSError:  # busy (its old link not ended yet), unreachable for now, or no answer yet: again
                time.sleep(min(pause, max(0.0, confirming.deadline - time.monotonic())))
                pause = min(2 * pause, 0.5)
        self._command(("confirmed", confirming, outcome[0], outcome[1]))

    def _probe_silent(self, link: Link, deadline: float) -> None:
        """In its own thread: ask a silent peer's listener on fresh connections, until its silence deadline,
        whether it lives. An established connection whose packets were lost in a cut keeps retrying on
        TCP's backed-off timer (0.2 s, then 0.4, 0.8, ...) after the path is back; a new connection does
        not wait on that timer. A peer that answers ALIVE is reported to the loop thread."""
        while (left := deadline - time.monotonic()) > 0:
            try:
                # Short connects: a SYN lost in the cut is not retried for a second; a new connect is.
                answer = self._dial(link.rank, link.address, probe=True, timeout_s=min(0.25, left))
            except OSError:
                time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
                continue
            if answer.word == b"ALIVE":
                self._command(("answered", link))
            return

    def _answered(self, link: Link) -> None:
        """A silent peer answered a probe on a fresh connection: its link is made anew, no verdict."""
        if self.links.get(link.rank) is not link:
            return
        silent = time.monotonic() - link.last_heard
        if silent <= self._probe_after_s():
            return  # heard again meanwhile on the link itself
        self._link_failed(link, f"no heartbeat from rank {link.rank} for {silent:.1f} s, yet it answered on a new "
                                "connection: the link's own connection is held back (TCP retransmitting after a cut), "
                                "so the link is made anew")  # fmt: skip

    def _confirmed(self, confirming: _Confirming, kind: str, detail: Any) -> None:
        """The redial's outcome, in the loop thread."""
        current = self._confirming.get(confirming.rank) is confirming
        if kind == "answer" and detail.sock is not None and (not current or self._stopping):
            detail.sock.close()
        if not current or self._stopping:
            return
        if kind == GONE:
            self._declare(confirming, detail, GONE, 0.0)
        elif kind == SILENT:
            self._declare(confirming, detail, SILENT, time.monotonic() - confirming.last_heard)
        elif detail.word == b"CHALLENGE":
            self._add(confirming.rank, detail, confirming.address, confirming.last_heard)
        elif detail.word == b"LOST":
            with self._lock:
                self.accused_by.add(confirming.rank)
            self._declare(confirming, f"rank {confirming.rank} declared this rank lost (it answered a redial so)", ACCUSED, 0.0)
        else:  # ALIVE: the lower rank lives and dials again itself
            confirming.answered = True

    def _declare(self, confirming: _Confirming, cause: str, kind: str, silent_s: float) -> None:
        with self._lock:
            self._confirming.pop(confirming.rank, None)
        self._record_loss(confirming.rank, Verdict(cause, silent_s, confirming.endpoints, kind, confirming.peer_id))

    def _close_all(self) -> None:
        for link in list(self.links.values()):
            self._forget(link)
        for pending in list(self._pending):
            self._drop_pending(pending)
        self._selector.close()
        for sock in (self.listener, self._wake_r, self._wake_w):
            sock.close()

