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

Not covered: a process that watches the store's listing can delete a claim in the moment between the
two sides' claims; the second then finds the key empty and claims it too (both go on). That needs two
verdicts on the same link (a cut both ways, or a stall of both) and a stranger that times the deletion;
docs/explain/peer-watcher.md, "Security", says so.
"""

from __future__ import annotations

import hashlib
import hmac
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from torch_peer_watcher.linkevents import ACCUSED
from torch_peer_watcher.protocol import PROTOCOL, proof_matches

PREFIX = "torch_peer_watcher_verdict"
# A live store answers a compare_set in milliseconds; one that has not answered in this is stopped or cut off.
ANSWER_S = 1.0
# Beyond one heartbeat interval, how much longer the store's host's peer waits before it claims.
HOST_MARGIN_S = 0.5


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
        # A call that never returned holds the client: later ones would queue behind it.
        self._stuck = False

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
        claim = self._sign(key, self.rank)
        stored = self._call(lambda: self._client.compare_set(key, "", claim).decode(errors="replace"))
        if isinstance(stored, Decision):
            return stored
        winner = self._verify(key, stored)
        if winner in (self.rank, peer):
            return Decision(winner, "the store recorded its verdict first")
        # Only a claim makes this key exist (nobody else can name it before): one of the peer's, written over since.
        return Decision(peer, f"the pair's key in the store held no valid claim ({stored[:40]!r}): the key exists only "
                              "once a side claimed it, so the peer claimed first and another process wrote over it")  # fmt: skip

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
