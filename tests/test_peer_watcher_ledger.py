"""What lost(), raise_if_lost() and wait_for_loss() answer while verdicts are judged, aborted and ranks link again
(torch_peer_watcher.ledger), on PeerWatcher objects with only what those read: no links, no store. The real
handler (``_on_lost`` -> ``_handle_loss`` -> ``_settle_loss``) runs; the store probe is replaced where a test
decides when a verdict stands. The real 2-rank jobs of the same promises are in test_peer_watcher_verdicts.py.

The promises: a step on a group that a loss broke never reads None from ``lost(group)`` once the verdict is made
(before it stands, it waits), whether the rank links again before, during or after the judging; a rank that
linked again is not lost for ``lost()`` and for groups watched since; a process put on the cut-off side stays out.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

from torch_peer_watcher import groups as groups_mod  # noqa: E402
from torch_peer_watcher import watcher as watcher_mod  # noqa: E402
from torch_peer_watcher.ledger import Ledger  # noqa: E402
from torch_peer_watcher.linkevents import Verdict  # noqa: E402
from torch_peer_watcher.losses import PartitionedError, PeerLoss, PeerLostError  # noqa: E402

GONE = Verdict("rank 1 closed its connection (process gone)", 0.0, frozenset(), "gone", "id")


class Group:
    """A process group of no backend: its abort does nothing."""

    def abort(self) -> None:
        pass


def _bare_watcher(group: object, members: frozenset[int]) -> Any:
    """A PeerWatcher with only what lost() and a loss's handling read (no links, no store)."""
    watcher = watcher_mod.PeerWatcher.__new__(watcher_mod.PeerWatcher)
    watcher._cond, watcher._losses, watcher._cut_off, watcher._ledger = threading.Condition(), [], None, Ledger()
    watcher._members = {id(group): members}
    watcher._callbacks, watcher._arbiter, watcher._links, watcher._root_store, watcher._shrunk = [], None, None, None, {}
    watcher._groups = {}
    watcher.settings = type("Settings", (), {"wake_nccl_proxy": False})()
    return watcher


def _watch(watcher: Any, group: object, name: str, ranks: set[int], recovery: str = "abort") -> None:
    """What watch() records of a group (its members and how it recovers)."""
    watcher._groups[id(group)] = groups_mod.WatchedGroup(group, name, frozenset(ranks), ("custom",), False, recovery)
    watcher._members[id(group)] = frozenset(ranks)
    watcher._ledger.watched(id(group))


def _gated_probes(monkeypatch: pytest.MonkeyPatch) -> list[threading.Event]:
    """The store probe of the n-th verdict judged waits for gates[n] (set by the test): when each verdict stands."""
    gates = [threading.Event() for _ in range(4)]
    calls = iter(gates)
    lock = threading.Lock()

    def probe(*_: Any, **__: Any) -> None:
        with lock:
            gate = next(calls)
        assert gate.wait(30), "a gate was never opened"

    monkeypatch.setattr(watcher_mod, "store_out_of_reach", probe)
    return gates


def _probes_by_rank(monkeypatch: pytest.MonkeyPatch, answers: dict[int, str | None]) -> dict[int, threading.Event]:
    """The store probe of a verdict on rank r (its handler thread is named after r) waits for gates[r], then answers
    answers[r]: None (the store reached), or why this process is out."""
    gates = {rank: threading.Event() for rank in answers}

    def probe(*_: Any, **__: Any) -> str | None:
        rank = int(threading.current_thread().name.rsplit("-", 1)[1])
        assert gates[rank].wait(30), "a gate was never opened"
        return answers[rank]

    monkeypatch.setattr(watcher_mod, "store_out_of_reach", probe)
    return gates


def _stand(watcher: Any, gates: dict[int, threading.Event], rank: int) -> None:
    """Let the verdict on ``rank`` stand, and wait until it is handled."""
    handled = len(watcher._losses)
    gates[rank].set()
    _until(f"rank {rank}'s verdict handled", lambda: len(watcher._losses) > handled)


def _asked_in_a_thread(ask: Any) -> tuple[threading.Thread, list[Any]]:
    answer: list[Any] = []
    thread = threading.Thread(target=lambda: answer.append(ask()), daemon=True)
    thread.start()
    return thread, answer


def _until(what: str, condition: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not {what} within {timeout} s"
        time.sleep(0.005)


def test_lost_waits_for_the_judging_only_never_for_the_aborts_and_callbacks_of_a_rank_that_came_back():
    """A helper's attack on issue 74's wait: rank 0's loss handled (its aborts or its callbacks still running), rank 0
    then linked again (a replacement took it over), and a callback asking lost(): lost() waited for the handler it ran
    in, forever. It waits for a verdict still being judged only."""
    group = object()
    watcher = _bare_watcher(group, frozenset({0, 1}))
    watcher._ledger.judging.add((0, 0))  # handled: judged, its aborts and callbacks running; relinked (not detected)
    assert watcher.lost(group) is None and watcher.lost() is None


def test_a_rank_that_links_again_is_not_lost_for_new_groups_and_stays_lost_for_the_groups_its_loss_broke(monkeypatch):
    """A helper's attack (G3): rank 1 declared lost, then linked again (a replacement, a healed link) while the store
    check and the arbitration ran. Its verdict stood after the relink, so lost() named rank 1 lost with no end, and a
    survivor asking it of a new group with the replacement saw that group broken. Now lost() answers for the rank as a
    relink after the verdict does (not lost: lost() and a new group's lost() are None), and for a group the loss broke
    (aborted) as it did: that loss, relink or not, before and after the verdict (a step whose all-reduce was aborted
    must never see None). Fails without the change: lost() answers rank 1's loss; and without the broken groups'
    record, the old group's lost() answers None after a relink."""
    for relink_while_judged in (True, False):
        old, new = Group(), Group()
        watcher = _bare_watcher(old, frozenset({0, 1}))
        _watch(watcher, old, "old", {0, 1})
        watcher._members[id(new)] = frozenset({0, 1})

        def probe(*_: Any, relink: bool = relink_while_judged, watcher: Any = watcher, **__: Any) -> None:
            if relink:
                watcher._on_link(1)

        monkeypatch.setattr(watcher_mod, "store_out_of_reach", probe)
        key, links = watcher._ledger.verdict(1)
        watcher._handle_loss(key, links, GONE, 12.5)
        assert [(x.rank, x.groups) for x in watcher._losses] == [(1, ("old",))]  # judged and handled: its group went
        if not relink_while_judged:
            assert watcher.lost().rank == 1 and watcher.lost(new).rank == 1  # no relink yet: rank 1 is lost
            watcher._on_link(1)
        assert watcher.lost() is None and watcher.lost(new) is None
        assert watcher.lost(old) is watcher._losses[0] and watcher.wait_for_loss(old, 0, aborted=False) is watcher._losses[0]


def test_two_verdicts_on_one_rank_are_judged_each_on_its_own_and_a_later_replacement_is_not_lost(monkeypatch):
    """A helper's attack (A1): rank 1 died, its replacement linked and died too while the first verdict was judged,
    and a second replacement linked. Keyed by rank, the first verdict to stand ended the judging of both (lost() then
    answered None while the second was judged) and took the relink mark from the other, so once both stood rank 1
    was lost for good although its second replacement was alive. Keyed by verdict: lost() waits for the second, and
    after both it answers the live replacement not lost, in either order of standing."""
    for first_to_stand in (0, 1):
        gates = _gated_probes(monkeypatch)
        old, new = Group(), Group()
        watcher = _bare_watcher(old, frozenset({0, 1}))
        _watch(watcher, old, "old", {0, 1})
        watcher._on_lost(1, GONE)  # the first process of rank 1
        watcher._on_link(1)  # its replacement ...
        watcher._on_lost(1, GONE)  # ... dies too
        watcher._on_link(1)  # the second replacement, alive
        gates[first_to_stand].set()
        _until("the first verdict stood", lambda: len(watcher._ledger.unjudged) == 1)
        asked, answer = _asked_in_a_thread(watcher.lost)
        asked.join(0.3)
        assert asked.is_alive(), f"lost() answered {answer} while a verdict on rank 1 was still judged"
        gates[1 - first_to_stand].set()
        asked.join(10)
        _until("both verdicts handled", lambda: not watcher._ledger.judging)
        assert answer == [None] and watcher.lost() is None, answer
        _watch(watcher, new, "new", {0, 1})
        assert watcher.lost(new) is None and watcher.lost(old).rank == 1


def test_a_process_put_out_stays_out_when_the_rank_it_lost_links_again(monkeypatch):
    """A helper's attack (A3): a verdict that could not be judged puts this process on the cut-off side (it must stop);
    the rank then linked again, and lost() of every group answered None again, so the process trained on, applying
    what the watchdog's abort left. The same for a verdict whose arbitration put this process out and a link that
    healed. Now the verdict that put the process out stands for good, relink or not."""

    def judging_raises(*_: Any, **__: Any) -> None:
        raise OSError("the store probe failed")

    def arbitration_puts_this_process_out(*_: Any, **__: Any) -> str:
        return "rank 1 declared this rank lost first"

    for judging in (judging_raises, arbitration_puts_this_process_out):
        group = Group()
        watcher = _bare_watcher(group, frozenset({0, 1}))
        _watch(watcher, group, "g", {0, 1})
        monkeypatch.setattr(watcher_mod, "store_out_of_reach", judging)
        key, links = watcher._ledger.verdict(1)
        if judging is judging_raises:
            with pytest.raises(OSError):
                watcher._handle_loss(key, links, GONE, 3.0)
        else:
            watcher._handle_loss(key, links, GONE, 3.0)
        watcher._on_link(1)  # a replacement, or the link healed
        for asked in (group, None):
            with pytest.raises(PartitionedError):
                watcher.raise_if_lost(asked)


def test_a_verdict_beside_the_one_that_put_the_process_out_neither_lets_it_in_again_nor_answers_a_plain_loss(monkeypatch):
    """A helper's attack (session 30, B and A): verdicts on ranks 1 and 2 judged at once. (B) Rank 2's put this process
    out (the store out of reach), then rank 1's stood with the store reached and wrote the cut-off back to None: the
    process shrank a group as if it were in, and raise_if_lost() stopped raising PartitionedError. (A) Rank 2's stood
    first with the store reached, then rank 1's put the process out: lost() and the groups rank 2's loss broke still
    answered rank 2's plain loss, so a step raised PeerLostError and went on. Out is out: every answer says so."""
    for out_first in (True, False):
        g1, g2, g12 = Group(), Group(), Group()
        watcher = _bare_watcher(g12, frozenset({0, 1, 2}))
        _watch(watcher, g1, "g1", {0, 1}, recovery="shrink")
        _watch(watcher, g2, "g2", {0, 2})
        _watch(watcher, g12, "g12", {0, 1, 2})
        answers = {2: "store out of reach", 1: None} if out_first else {2: None, 1: "store out of reach"}
        gates = _probes_by_rank(monkeypatch, answers)
        watcher._on_lost(2, GONE)
        watcher._on_lost(1, GONE)
        _stand(watcher, gates, 2)
        _stand(watcher, gates, 1)
        assert watcher._cut_off == "store out of reach" and not watcher._shrunk, (watcher._cut_off, watcher._shrunk)
        for asked in (None, g1, g2, g12):
            with pytest.raises(PartitionedError):
                watcher.raise_if_lost(asked)
            with pytest.raises(PartitionedError), watcher.guard(asked, grace_s=0):
                raise RuntimeError("the collective's own error")


def test_a_group_watched_after_the_replacement_linked_is_not_broken_by_the_verdict_on_its_predecessor(monkeypatch):
    """A helper's attack (session 30, C): a verdict on rank 1 made, rank 1's replacement linked, a group with the
    replacement watched, then the verdict stood: it aborted the new group too (with a live replacement) and lost() of
    it answered the old loss for good. A verdict breaks the groups watched while its rank's process was the one lost."""
    old, new = Group(), Group()
    watcher = _bare_watcher(old, frozenset({0, 1}))
    _watch(watcher, old, "old", {0, 1})
    gates = _probes_by_rank(monkeypatch, {1: None})
    watcher._on_lost(1, GONE)
    watcher._on_link(1)  # the replacement
    _watch(watcher, new, "new", {0, 1})
    _stand(watcher, gates, 1)
    assert watcher._losses[0].groups == ("old",), watcher._losses
    assert watcher.lost(new) is None and watcher.lost(old).rank == 1 and id(new) in watcher._groups
    with pytest.raises(RuntimeError, match="own error"), watcher.guard(new, grace_s=0):
        raise RuntimeError("the collective's own error")  # not the predecessor's PeerLostError


def test_a_group_the_shrink_registers_under_a_broken_groups_id_is_not_that_group(monkeypatch):
    """A helper's attack (A4): a group a loss broke was freed and the shrink's replacement of another group took its
    id (the shrink registers its replacement without watch(), which forgot the broken record): lost() of the
    replacement answered the old loss of a rank not among its members, and every step on it would have raised."""
    old, shrinking, replacement = Group(), Group(), Group()
    watcher = _bare_watcher(old, frozenset({0, 1}))
    _watch(watcher, old, "old", {0, 1})
    _watch(watcher, shrinking, "s", {0, 2}, recovery="shrink")
    monkeypatch.setattr(watcher_mod, "store_out_of_reach", lambda *_, **__: None)
    key, links = watcher._ledger.verdict(1)
    watcher._handle_loss(key, links, GONE, 1.0)  # breaks old
    watcher._ledger.broken[id(replacement)] = watcher._ledger.broken.pop(id(old))  # old freed: its id now replacement's

    def shrink(watched: Any, ranks: list[int], wake_nccl_proxy: Any = None) -> Any:
        return type("Made", (), {"group": replacement, "rebuilt_because": None})()

    def describe(group: Any, recovery: str = "abort") -> groups_mod.WatchedGroup:
        return groups_mod.WatchedGroup(group, "s-shrunk", frozenset({0}), ("custom",), False, recovery)

    monkeypatch.setattr(groups_mod, "shrink", shrink)
    monkeypatch.setattr(groups_mod, "describe", describe)
    key, links = watcher._ledger.verdict(2)
    watcher._handle_loss(key, links, Verdict("rank 2 closed its connection", 0.0, frozenset(), "gone", "id"), 2.0)
    assert watcher._shrunk[id(shrinking)] is replacement
    assert watcher.lost(replacement) is None


def test_a_verdict_that_cannot_be_judged_puts_the_process_out_instead_of_leaving_lost_waiting(monkeypatch):
    """Its handler thread could not start (no thread left), or its judging raised: lost() waited forever, or answered
    nothing while the peer was gone (no side's claim settled). The process now stops as the cut-off side does."""
    group = object()
    watcher = _bare_watcher(group, frozenset({0, 1}))

    def no_thread(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", no_thread)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        watcher._on_lost(1, GONE)
    monkeypatch.undo()
    loss = watcher.lost(group)
    assert loss is not None and loss.rank == 1 and "could not be judged" in loss.cut_off, loss
    with pytest.raises(PartitionedError):
        watcher.raise_if_lost(group)
    assert not watcher._ledger.judging and not watcher._ledger.unjudged

    watcher = _bare_watcher(group, frozenset({0, 1}))

    def judging_raises(*_: Any) -> None:
        raise OSError("the store probe failed")

    watcher._settle_loss = judging_raises
    key, links = watcher._ledger.verdict(1)
    with pytest.raises(OSError):
        watcher._handle_loss(key, links, GONE, 0.0)
    assert watcher.lost(group).cut_off and not watcher._ledger.judging and not watcher._ledger.unjudged


def test_a_rank_that_came_back_is_no_longer_lost_to_the_verdicts_wait_nor_to_the_steps_wait():
    """A verdict on rank 2, handled, then a link from rank 2 again (links: a redial that got through, or a replacement
    that took the rank over): lost() answers None. wait_for_loss(aborted=False), which synchronize() wakes on, answered
    the old loss, so every later synchronize() of a group holding rank 2 stopped waiting for its stream at once."""
    group = object()  # a group the loss did not break (made since, with the rank that came back)
    watcher = _bare_watcher(group, frozenset({0, 1, 2}))
    watcher._ledger.detected[2] = (2, "process gone", time.time(), 0.0)
    watcher._losses.append(PeerLoss(2, "process gone", time.time(), 0.0, ("g",), 0.1, 0, ()))
    assert watcher.wait_for_loss(group, 0, aborted=False).rank == 2
    with pytest.raises(PeerLostError):
        watcher.synchronize(group)
    watcher._on_link(2)
    assert watcher.lost(group) is None and watcher.wait_for_loss(group, 0, aborted=False) is None
    assert watcher.wait_for_loss(group, 0).rank == 2  # the handled loss stays recorded
    watcher.synchronize(group)  # no CUDA work here: it returns
