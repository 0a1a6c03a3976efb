"""What the link thread (:mod:`torch_peer_watcher.links`) reports: the kinds a verdict rests on, a verdict, and the
callbacks it calls."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch_peer_watcher.sockets import Endpoint

# What a verdict rests on. GONE: the link closed and nothing of this job listens at the peer's address any
# more (its process is gone, or it stopped its watcher: a winner may do so in its recovery). SILENT (no
# heartbeat for the timeout, no answer to a redial by then) and ACCUSED (the peer declared this process
# lost: L on the link, LOST to a redial). Each can be wrong about a live peer, and both sides of a failed
# link may give one: the store decides which stands (torch_peer_watcher.verdicts).
GONE, SILENT, ACCUSED = "gone", "silent", "accused"


@dataclass(frozen=True)
class Verdict:
    """A peer declared lost by the link thread: why, how long it was silent, its last endpoints, what
    the verdict rests on (:data:`GONE`, :data:`SILENT`, :data:`ACCUSED`) and the id of its process."""

    cause: str
    silent_s: float
    endpoints: frozenset[Endpoint]
    kind: str
    peer_id: str


@dataclass
class LinkEvents:
    """What the loop reports, called in the loop thread: must return quickly."""

    on_link: Callable[[int], None]
    on_lost: Callable[[int, Verdict], None]
    on_left: Callable[[int], None]
