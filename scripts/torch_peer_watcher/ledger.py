"""What a :class:`~torch_peer_watcher.watcher.PeerWatcher` knows of its verdicts; every method runs under its lock.

A verdict is one rank's loss as one link saw it, keyed ``(rank, n)`` (``n`` counts this process's verdicts): a
rank's replacement can link and die while the verdict on the rank's first process is still being judged, and each
verdict is then judged, aborted and answered on its own. A rank that links again after a verdict (a replacement,
a healed link), even while the verdict is judged, is no longer lost for ``lost()`` and for groups made since; a
group the loss broke stays lost for ``lost(group)``; and the verdict that put this process on the cut-off side
stands for good, relink or not (a helper's attacks on issue 74's wait, session 30).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable
from typing import Any

from torch_peer_watcher.losses import PeerLoss, detected_only

Key = tuple[int, int]
# What a verdict that stands records: rank, cause, detected_at (time.time()), silent_s.
Stood = tuple[int, str, float, float]


class Ledger:
    def __init__(self) -> None:
        self.detected: dict[int, Stood] = {}  # lost ranks (a relink takes a rank out)
        self.broken: dict[int, Stood] = {}  # id(group) -> the verdict on a member that broke it, for good
        # Verdicts being handled (the store check, the arbitration, the aborts, the callbacks); of them, those that do
        # not stand yet (lost() waits for them; never for the aborts and callbacks, which may ask it).
        self.judging: set[Key] = set()
        self.unjudged: set[Key] = set()
        # id() of the groups a verdict is aborting now: abort() of one waits for the watcher's (a second abort of an
        # NCCL communicator while the first tears it down is not safe on every backend: nccl2's abortNcclComm has no lock).
        self.in_abort: dict[Key, set[int]] = {}
        self.links: dict[int, int] = {}  # rank -> its links made so far
        self.links_at_watch: dict[int, dict[int, int]] = {}  # id(group) -> every rank's links when it was watched
        self.cut_off_by: Stood | None = None
        self._count = itertools.count()

    def verdict(self, rank: int) -> tuple[Key, int]:
        """A verdict on ``rank`` in judging: its key, and the rank's links so far (a later link is a relink)."""
        key = (rank, next(self._count))
        self.judging.add(key)
        self.unjudged.add(key)
        return key, self.links.get(rank, 0)

    def linked(self, rank: int) -> None:
        self.links[rank] = self.links.get(rank, 0) + 1
        if self.cut_off_by is None or self.cut_off_by[0] != rank:
            self.detected.pop(rank, None)

    def stands(self, key: Key, links: int, stood: Stood, broken: Iterable[tuple[int, Any]], cut_off: bool) -> None:
        """The verdict ``key`` stands; ``broken``: (id, watched group) of the groups it breaks (those its rank is a
        member of are recorded); ``cut_off``: it put this process on the cut-off side."""
        rank = key[0]
        if self.links.get(rank, 0) == links or cut_off:  # else the rank linked again meanwhile: not lost
            self.detected[rank] = stood
        for group_id, watched in broken:
            if rank in watched.ranks:
                self.broken[group_id] = stood
        if cut_off and self.cut_off_by is None:
            self.cut_off_by = stood
        self.unjudged.discard(key)

    def done(self, key: Key) -> None:
        self.judging.discard(key)
        self.in_abort.pop(key, None)

    def judging_any(self, ranks: frozenset[int] | None, unjudged_only: bool = False) -> bool:
        return any(ranks is None or rank in ranks for rank, _ in (self.unjudged if unjudged_only else self.judging))

    def watched(self, group_id: int) -> None:
        """A group now watched (or registered) under ``group_id``: not the broken group that had that id before."""
        self.broken.pop(group_id, None)
        self.links_at_watch[group_id] = dict(self.links)

    def breaks(self, key: Key, links: int, group_id: int, watched: Any, cut_off: bool) -> bool:
        """Whether the verdict ``key`` (made when its rank had ``links``) breaks a watched group: one it holds the rank's
        process of then (a group watched after a replacement linked is the replacement's), or one left on any loss."""
        rank = key[0]
        if rank not in watched.ranks:
            return watched.leave_on_any_loss
        return cut_off or self.links_at_watch.get(group_id, {}).get(rank, 0) <= links

    def lost(self, group: Any, ranks: frozenset[int] | None, losses: list[PeerLoss], cut_off: str | None) -> PeerLoss | None:
        """What ``lost(group)`` answers: the verdict that broke ``group``, else a member lost now; a process put on
        the cut-off side has every answer say so (it stops, whichever loss a step reads)."""
        if group is not None and (stood := self.broken.get(id(group))) is not None:
            return _out(_handled(stood, losses) or detected_only(*stood, cut_off), cut_off)
        for rank, stood in self.detected.items():
            if ranks is None or rank in ranks:
                return _out(_handled(stood, losses) or detected_only(*stood, cut_off), cut_off)
        return None

    def handled(self, group: Any, losses: list[PeerLoss], cut_off: str | None) -> PeerLoss | None:
        """What guard() raises for an error in ``group``: the handled loss that broke it (None: the first handled)."""
        if group is None:
            return _out(losses[0], cut_off) if losses else None
        stood = self.broken.get(id(group))
        return _out(_handled(stood, losses), cut_off) if stood is not None else None


def _out(loss: PeerLoss | None, cut_off: str | None) -> PeerLoss | None:
    return dataclasses.replace(loss, cut_off=cut_off) if loss is not None and cut_off and not loss.cut_off else loss


def _handled(stood: Stood, losses: list[PeerLoss]) -> PeerLoss | None:
    return next((x for x in losses if (x.rank, x.detected_at) == (stood[0], stood[2])), None)
