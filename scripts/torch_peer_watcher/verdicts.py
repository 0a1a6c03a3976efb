"""Which side of a failed link goes on: one verdict per pair, decided once, in the store (issue 52).

A link between two live processes can fail (a cut that heals, a one-way drop, a process that stalls
past the timeout) and each side may then judge the other lost: by silence, at about the same moment
(their heartbeats started together), or one after being told (``L``, ``LOST``). Each side's store
check succeeds once the link is back, so the store check alone let both train on, and a race of
the two ``L`` messages decided which stopped. Now a disputable verdict (:data:`links.SILENT`,
:data:`links.ACCUSED`) stands only if its side wins the pair's key in the store: a ``compare_set``
that only the first writer wins, read by both sides, so exactly one side goes on.

The side that goes on is never the one whose stopping takes the store away: the process that hosts
the store (it holds the store's listening socket; it says so to its peers on their authenticated links,
``S``, not in the store, where anyone can write) claims at once, its peer only after a grace of one
heartbeat interval and a margin, by which time a live host has judged too (the two verdicts come at
most an interval apart).

Issue 68: nothing a stranger can learn or write decides a verdict.
- Every verdict is settled here, "process gone" too: a refused redial is no proof of death (a winner
  that stopped its watcher in its recovery refuses it as well), and the side that judged first has its
  claim in the key already.
- The key's name is made with the job key (an HMAC under the job's secret over the pair's ranks and
  process ids): the ids are public (a listener tells them to anyone who asks), the name is not, so
  nobody but the pair can write the key before the pair does. A key that holds anything but a valid
  claim was therefore written over a claim of the peer (by a process that found the name in the store's
  listing afterwards): the peer judged first, and this side is out. Values are signed with the job key:
  a claim of another job, or of another pair, does not verify.
- A process that its peer declared lost first (an authenticated ``L`` or ``LOST``: :data:`links.ACCUSED`)
  does not claim, unless it hosts the store: the peer judged first, and either wins its claim or is cut
  off from the store. Nothing in the store can make it go on.

The calls go through a store client of the watcher's own, made at start, each in a thread the verdict
waits on for :data:`ANSWER_S` at most: a ``TCPStore`` client waits without end on a store whose process
is stopped. No answer in time reads as "cut off".

- A claim deleted from the store is still seen (the last race a stranger could win): a process that watches the
  store's listing could delete a claim in the moment between the two sides' claims, and the second side
  then found the key empty and won it too. The key, or anything else in the store, cannot tell the second
  side: whoever can delete can also write back what it read there before the first claim. What it cannot
  take back is the store's wake-up of a waiting client. Every process waits, from its start, on its own
  bell: a key named with the job key and its process id (:meth:`Arbiter.listen`). A side that wins the
  pair's key rings the peer's bell, then waits :data:`CLAIM_WINDOW_S` for its own: rung, the peer won
  the key too (it was deleted between the claims) and this side is out. A side whose bell rang before it
  claims is out at once. If both sides stood, each would have rung the other's bell before its own window
  began and heard nothing in it: then each wake-up took longer than the window to reach its process
  (rings ``r0`` and ``r1``, windows ending after ``r0 + W`` and ``r1 + W``: wake-ups later than both
  ends need ``d0 + d1 > 2 W``). So at most one side goes on, and where the store was not touched, exactly one.
  A "process gone" verdict does not wait the window: nothing of the job listens at the peer's address (its
  watcher stopped, or its process ended), so the peer arbitrates no more and no ring of its could come.
"""

from __future__ import annotations

import atexit
import hashlib
import hmac
import os
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from torch_peer_watcher.linkevents import ACCUSED, GONE
from torch_peer_watcher.protocol import PROTOCOL, proof_matches

PREFIX = "torch_peer_watcher_verdict"
# A live store answers a compare_set in milliseconds; one that has not answered in this is stopped or cut off.
ANSWER_S = 1.0
# Beyond one heartbeat interval, how much longer the store's host's peer waits before it claims.
HOST_MARGIN_S = 0.5
# How long a side that won the pair's key waits for its own bell after ringing the peer's: longer than a
# store's wake-up takes to reach a running process (milliseconds; more on a loaded node).
CLAIM_WINDOW_S = 0.25
# A bell waits as long as the job may run: a wait that ended and was made again could miss a ring
# that a stranger deleted in between.
_BELL_WAIT = timedelta(days=365)
# What a bell's owner compares the pair's key with to read it without writing: no claim verifies.
_READ = "read"


@dataclass(frozen=True)
class Decision:
    """Whose verdict stands (``winner``: a rank), or None when the store did not answer (``why`` says)."""

    winner: int | None
    why: str


class Arbiter:
    """One per watcher: claims and reads the pair keys through a store client of its own.

    ``key`` is the job key (:func:`torch_peer_watcher.protocol.job_key`).
    """

    def __init__(self, host: str, port: int, rank: int, key: bytes, hosts_store: bool) -> None:
        from torch.distributed import TCPStore

        self.rank = rank
        self.hosts_store = hosts_store
        self._key = key
        self._client = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=30))
        # A client of its own for the bell's wait, which blocks it (listen).
        self._bell_client = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=30))
        self._rung = threading.Event()
        self._bell_error: str | None = None
        self._bell: str | None = None
        self.bell_thread: threading.Thread | None = None
        self._closing = False
        # A call that never returned holds the client: later ones would queue behind it.
        self._stuck = False

    def listen(self, own_id: str) -> None:
        """Wait on this process's bell (in a thread, until close()): a peer that wins a claim
        against this process rings it, and the store's wake-up stays seen though the key be deleted."""
        bell = self._bell = self.bell_key(own_id)

        def wait() -> None:
            try:
                self._bell_client.wait([bell], _BELL_WAIT)
            except Exception as exc:  # the store went away: no ring can be heard, so none may be missed
                self._bell_error = f"{type(exc).__name__}: {' '.join(str(exc).split())[:160]}"
            if not self._closing:
                self._rung.set()

        self.bell_thread = threading.Thread(target=wait, name="torch-peer-watcher-bell", daemon=True)
        self.bell_thread.start()
        _listening.add(self)

    def close(self) -> None:
        """End the bell's wait (the watcher stops, the process exits): this process rings its own bell and
        waits for the thread to end. A wait that fails once the interpreter is finalizing (the store's
        process ended first) ends the process with "terminate called without an active exception", and one
        that fails before prints a warning with a C++ stack."""
        if self._closing or self._bell is None or self.bell_thread is None:
            return
        self._closing = True
        self._call(lambda: self._client.set(self._bell, "closed"))
        self.bell_thread.join(ANSWER_S)

    def bell_key(self, process_id: str) -> str:
        """The store key of the bell of the process ``process_id``: named with the job key (the id is public)."""
        name = hmac.new(self._key, f"{PROTOCOL} bell {process_id}".encode(), hashlib.sha256).hexdigest()
        return f"{PREFIX}/bell/{name[:32]}"

    def decide(self, peer: int, ids: tuple[str, str], interval_s: float, kind: str, peer_hosts_store: bool) -> Decision:
        """Whose verdict on the link between this rank and ``peer`` stands. ``ids`` are this process's
        and the peer's (a pair key per pair of processes: a replacement starts a new one); ``kind`` what
        this side's verdict rests on (:mod:`torch_peer_watcher.links`); ``peer_hosts_store``: the peer
        said on its link that it hosts the store."""
        if kind == ACCUSED and not self.hosts_store:
            return Decision(peer, "it told this process so on their authenticated link, and a process declared lost "
                                  "first does not claim (unless it hosts the store)")  # fmt: skip
        if peer_hosts_store and not self.hosts_store:
            # The peer hosts the store: if it lives, its own verdict on this rank lands first.
            time.sleep(interval_s + HOST_MARGIN_S)
        key = self.pair_key(peer, ids)
        rung = self._rung.is_set()
        # A process whose bell rang is out: it only reads the key then, to say who won (a compare_set
        # with a value that is no claim never writes one: TCPStore hands back the expected value of a
        # missing key).
        expected, claim = (_READ, _READ) if rung else ("", self._sign(key, self.rank))
        stored = self._call(lambda: self._client.compare_set(key, expected, claim).decode(errors="replace"))
        if isinstance(stored, Decision):
            return stored
        winner = self._verify(key, stored)
        if winner == peer:
            return Decision(winner, "the store recorded its verdict first")
        if winner == self.rank and not rung:
            return self._ring(peer, ids[1], wait=kind != GONE)
        if winner is None and stored != _READ:
            # Only a claim makes this key exist (nobody else can name it before): the peer's, written over since.
            return Decision(peer, f"the pair's key in the store held no valid claim ({stored[:40]!r}): the key exists "
                                  "only once a side claimed it, so the peer claimed first and another process wrote "
                                  "over it")  # fmt: skip
        return self._rang()

    def _ring(self, peer: int, peer_id: str, wait: bool = True) -> Decision:
        """After this side won the pair's key: ring the peer's bell, then wait CLAIM_WINDOW_S for its own.
        Not ``wait``: the verdict is "process gone" (nothing of this job listens at the peer's address: its
        watcher stopped or its process ended), so the peer no longer arbitrates and no ring of its could come;
        the window would only delay every recovery from a real death."""
        bell = self.bell_key(peer_id)
        rung = self._call(lambda: self._client.set(bell, str(self.rank)))
        if isinstance(rung, Decision):
            return rung
        if not wait:
            return self._rang() if self._rung.is_set() else Decision(self.rank, "the store recorded its verdict first")
        if self._rung.wait(CLAIM_WINDOW_S):
            return self._rang()
        return Decision(self.rank, "the store recorded its verdict first")

    def _rang(self) -> Decision:
        if self._bell_error is not None:
            return Decision(None, f"this process's wait on its bell in the store failed ({self._bell_error})")
        return Decision(None, "a peer won a claim against this process (the store woke this process's bell) "
                              "before its own verdict stood, and the pair's key does not show it: another process "
                              "deleted or changed the claim in the store; this process does not go on")  # fmt: skip

    def pair_key(self, peer: int, ids: tuple[str, str]) -> str:
        """The store key of the pair (this process, the peer's process): named with the job key, so that no
        process without the job's secret can name it before the pair writes it."""
        (lo, lo_id), (hi, hi_id) = sorted(((self.rank, ids[0]), (peer, ids[1])))
        name = hmac.new(self._key, f"{PROTOCOL} pair {lo} {hi} {lo_id} {hi_id}".encode(), hashlib.sha256).hexdigest()
        return f"{PREFIX}/{name[:32]}"

    def _call(self, call: Callable[[], Any]) -> Any:
        """``call()`` in a thread, waited on for ANSWER_S at most: its result, or a Decision(None, why)."""
        if self._stuck:
            return Decision(None, "an earlier call to the store never returned")
        result: list[Any] = []

        def run() -> None:
            try:
                result.append(call())
            except Exception as exc:  # the store's error, reported as its answer
                result.append(Decision(None, f"the store failed: {type(exc).__name__}: {' '.join(str(exc).split())[:160]}"))

        thread = threading.Thread(target=run, name="torch-peer-watcher-verdict", daemon=True)
        thread.start()
        thread.join(ANSWER_S)
        if not result:
            self._stuck = True
            return Decision(None, f"the store did not answer within {ANSWER_S:g} s (its process is stopped, or the "
                                  "store is cut off from this process)")  # fmt: skip
        return result[0]

    def _sign(self, key: str, rank: int) -> str:
        return f"{rank}|{self._mac(key, rank)}"

    def _verify(self, key: str, value: str) -> int | None:
        rank, sep, mac = value.partition("|")
        if not sep or not rank.isdigit() or not proof_matches(self._mac(key, int(rank)), mac.encode()):
            return None
        return int(rank)

    def _mac(self, key: str, rank: int) -> str:
        return hmac.new(self._key, f"{PROTOCOL} verdict {key} {rank}".encode(), hashlib.sha256).hexdigest()


# Every arbiter whose bell is waited on, closed at exit (atexit runs before the interpreter finalizes).
_listening: weakref.WeakSet[Arbiter] = weakref.WeakSet()


@atexit.register
def _close_at_exit() -> None:
    for arbiter in list(_listening):
        arbiter.close()


def _forget_in_child() -> None:
    """A forked child has no bell thread, and its store connections are its parent's: it never writes on them."""
    for arbiter in list(_listening):
        arbiter._closing = True
    _listening.clear()


os.register_at_fork(after_in_child=_forget_in_child)
