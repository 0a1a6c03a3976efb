"""What a verdict leaves the user: the record of a lost peer (:class:`PeerLoss`) and the errors a watched
collective raises (:class:`PeerLostError` for a dead or stuck peer, :class:`PartitionedError` on the side
that is cut off), and :class:`WatcherError` when the watcher cannot set up. Raised by :mod:`torch_peer_watcher.watcher`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class PeerLoss:
    """A peer the watcher declared lost, and what it did about it.

    ``detected_at`` is ``time.time()`` at the verdict; ``silent_s`` how long the peer had been
    silent (0 for a closed connection); ``groups`` the names of the groups aborted or shrunk;
    ``abort_s`` how long that took; ``errors`` what went wrong (empty if nothing); ``shrunk`` the
    names of the groups replaced by a shrunk group (:meth:`PeerWatcher.shrunk`); ``rebuilt`` those of
    them that were built anew from the store because a member's shrink failed, each with why
    (``"name: the shrink failed on group rank 1: ..."``). ``proxy_wakes``: the NCCL proxy threads the aborts
    joined that the watcher woke, as "service:TID" or "uds:TID" with the pokes each got (empty when
    ``TORCH_PEER_WATCHER_WAKE_NCCL_PROXY`` is off; :mod:`torch_peer_watcher.proxywake`). ``judged_s``: the
    first part of ``abort_s``, the store check and the arbitration that settled which side is cut off.
    """

    rank: int
    cause: str
    detected_at: float
    silent_s: float
    groups: tuple[str, ...]
    abort_s: float
    sockets_cut: int
    errors: tuple[str, ...]
    shrunk: tuple[str, ...] = ()
    # Why this process is the side cut off (it could not reach the store), or None.
    cut_off: str | None = None
    rebuilt: tuple[str, ...] = ()
    proxy_wakes: tuple[str, ...] = ()
    judged_s: float = 0.0


def detected_only(rank: int, cause: str, detected_at: float, silent_s: float, cut_off: str | None) -> PeerLoss:
    """A loss whose groups are still being aborted."""
    return PeerLoss(rank, cause, detected_at, round(silent_s, 3), (), 0.0, 0, (), cut_off=cut_off)


def unhandled(rank: int) -> PeerLoss:
    """A peer lost before the group was watched."""
    return PeerLoss(rank, "lost before this group was watched", time.time(), 0.0, (), 0.0, 0, ())


class PeerLostError(RuntimeError):
    """A collective failed because a peer of its group died or got stuck."""

    def __init__(self, loss: PeerLoss, nccl_groups_closed: int = 0) -> None:
        self.loss = loss
        # NCCL groups a failed send/recv had left open in the raising thread, closed by guard().
        self.nccl_groups_closed = nccl_groups_closed
        groups = ", ".join(loss.groups) or "none"
        super().__init__(f"peer rank {loss.rank} lost: {loss.cause}; aborted groups: {groups}")

    @property
    def ranks(self) -> tuple[int, ...]:
        """The lost global ranks (what ``shrink_group`` excludes, as group ranks)."""
        return (self.loss.rank,)


class PartitionedError(RuntimeError):
    """This process is cut off: a peer fell silent and the rendezvous store is out of reach too, or
    the peer declared this process lost first (its heartbeats stopped reaching the peer: a stalled
    process or a lossy link).

    The other side trains on; this side must stop, and write nothing to shared state (checkpoints,
    the store). Not a :class:`PeerLostError`: recovery code must not catch it.
    """

    def __init__(self, loss: PeerLoss) -> None:
        self.loss = loss
        super().__init__(
            f"cut off from the job: peer rank {loss.rank} lost ({loss.cause}) and {loss.cut_off}; "
            "the side that keeps the store trains on, this one must stop"
        )


class WatcherError(RuntimeError):
    """The watcher could not set up its connections (a peer never connected, no store)."""
