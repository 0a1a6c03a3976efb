"""PeerWatcher: notices a dead or stuck peer and aborts exactly the process groups that contain it.

Lifecycle: :func:`start` after ``init_process_group`` (every rank), :meth:`PeerWatcher.watch` for
each group (every member, like ``new_group``), :meth:`PeerWatcher.stop` before
``destroy_process_group``. Addresses are exchanged through the group's store (keys under
``torch_peer_watcher/``); the connections and heartbeats live in :mod:`torch_peer_watcher.links`.

When a peer is lost, a short-lived thread aborts the groups that contain it (so their blocked
collectives raise), leaves every other group alone, records a :class:`PeerLoss` and calls the
user's callbacks. The blocked collective raises PyTorch's own error; :meth:`PeerWatcher.guard`
turns it into :class:`PeerLostError`, which names the peer and the cause. A group watched with
``recovery="shrink"`` is not aborted but replaced by a group of the survivors: on NCCL every member
builds it anew from the store (``PeerLoss.rebuilt``; NCCL's own shrink could wait for good on a member
whose shrink failed), elsewhere ``shrink_group`` with ``SHRINK_ABORT``, which also ends the blocked
work, with the same rebuild where a member's shrink fails. The survivors go on in
:meth:`PeerWatcher.shrunk` without a new rendezvous.

Split brain: a cut link looks, from each side, like a dead peer. So before any verdict takes effect, the
watcher checks that it still reaches the rendezvous store (a TCP connect, at most :data:`STORE_PROBE_S`). The
side that reaches the store goes on as above. A process that does not is the one cut off: it aborts the lost
peer's groups (never shrinks them), and :meth:`PeerWatcher.guard` and :meth:`PeerWatcher.raise_if_lost` raise
:class:`PartitionedError`, not :class:`PeerLostError`, so that a recovery written for a dead peer does not run there.
Two live processes whose link failed both reach the store: every verdict (silence, being told
``L``/``LOST``, and "process gone" too: a refused redial may be a winner that stopped its watcher,
:mod:`torch_peer_watcher.links`) stands only if its side wins the pair's key in the store
(:mod:`torch_peer_watcher.verdicts`; the store's host first), and the other side is out
(:class:`PartitionedError`), instead of reading the close as its peer's death.

With a secret set, a watcher that cannot set up (no store connection of its own, a peer it cannot
link to) raises :class:`WatcherError`: a job that shares its node with strangers never trains unwatched.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from torch_peer_watcher import groups as groups_mod
from torch_peer_watcher import protocol, settles, streams, watchdog
from torch_peer_watcher.dialing import signed_address
from torch_peer_watcher.linkevents import LinkEvents, Verdict
from torch_peer_watcher.links import HandshakeError, LinkLoop
from torch_peer_watcher.ledger import Ledger
from torch_peer_watcher.losses import PartitionedError, PeerLoss, PeerLostError, WatcherError, unhandled
from torch_peer_watcher.ncclgroups import close_leaked_groups
from torch_peer_watcher.proxywake import waking_proxies
from torch_peer_watcher.settings import CONNECT_TIMEOUT_ENV, SECRET_ENV, SECRET_FILE_ENV, WatcherSettings
from torch_peer_watcher.sockets import Endpoint, cut_connections_to, cut_group_connections, listens_on
from torch_peer_watcher.stores import advertised_host, store_endpoints, store_host, store_out_of_reach, store_port
from torch_peer_watcher.verdicts import Arbiter

STORE_PREFIX = "torch_peer_watcher"
NO_SECRET_WARNING = (
    f"torch_peer_watcher: neither {SECRET_ENV} nor {SECRET_FILE_ENV} is set, so the links are not "
    "authenticated: any process that can reach this rank's watcher port (another user's, on a shared node) "
    "can pose as a peer that has not connected yet and then make this rank declare it lost, cut its "
    "sockets or abort its groups. Export a secret in the job script (docs/howto/survive-a-dead-rank.md, \"Setting the secret\")"
)
# How long the store check before a verdict may take: a connect within a cluster's network (the
# kernel answers it, however busy the store) takes milliseconds; a cut link never answers.
STORE_PROBE_S = 0.4
# While it waits for its lower ranks to dial, a rank checks this often that the store still holds its own
# signed address (anyone can overwrite a key of the store) and writes it again if not.
REPUBLISH_S = 0.5
# Why this process is out when its peer's verdict on it stands (verdicts: the store recorded it first).
_ACCUSED = (
    "rank {rank} declared this rank lost first: their link failed, not a process (this rank is alive, yet its "
    "heartbeats did not reach rank {rank} within the timeout), so the job goes on without this rank ({why})"
)
# Said to a process that is out and hosts the job's store: the others need the store to rebuild.
_HOSTS_STORE = (
    "; this process hosts the job's store: keep it running (do not exit) until the others have rebuilt their groups"
)


class PeerWatcher:
    """One per process: the links to its peers and the groups it watches."""

    def __init__(self, store: Any, rank: int, settings: WatcherSettings | None = None, world_size: int | None = None) -> None:
        from torch.distributed import PrefixStore

        self.settings = settings or WatcherSettings.from_env()
        self.rank = rank
        # Global ranks of the job are 0..world_size-1: a HELLO from any other is refused.
        self.world_size = world_size
        self.store = PrefixStore(STORE_PREFIX, store)
        self._root_store = store
        self._groups: dict[int, groups_mod.WatchedGroup] = {}
        self._members: dict[int, frozenset[int]] = {}
        self._ledger = Ledger()  # the verdicts: lost ranks, broken groups, what is judged and aborted now
        self._losses: list[PeerLoss] = []
        self._callbacks: list[Callable[[PeerLoss], None]] = []
        # id(original group) -> the group shrink_group made of its survivors.
        self._shrunk: dict[int, Any] = {}
        self._cond = threading.Condition()
        self._links: LinkLoop | None = None
        self._stopped = False
        # Set once a verdict found the store out of reach: this process is on the cut-off side for good.
        self._cut_off: str | None = None
        self._store_endpoints: frozenset[Endpoint] = frozenset()
        self._arbiter: Arbiter | None = None
        # What names this job (protocol.job_binding): every signed value and proof is bound to it.
        self.job = ""

    # --- setup ----------------------------------------------------------------------------------

    def start(self) -> PeerWatcher:
        """Listen, publish this rank's address in the store, start the thread.

        The store holds nothing else: it has no authentication, any process that reaches it can read
        and write it, so the address carries a MAC under the job key (the secret and this job's
        binding: :func:`torch_peer_watcher.protocol.job_key`) and a dialer takes only one signed for
        this job. The links authenticate with the job key too; without a secret, this warns.
        """
        host = self.settings.host or advertised_host(self._root_store)
        if self.world_size is None:
            import torch.distributed as dist

            self.world_size = dist.get_world_size()
        if self.settings.secret is None:
            warnings.warn(NO_SECRET_WARNING, stacklevel=2)
        self._store_endpoints = store_endpoints(self._root_store)
        store_at = (store_host(self._root_store), store_port(self._root_store))
        self.job = protocol.job_binding(*store_at, os.environ)
        hosts_store = bool(store_at[1]) and listens_on(store_at[1])
        self._arbiter = self._make_arbiter(hosts_store)
        self._links = LinkLoop(
            self.rank,
            self.world_size,
            self.settings.secret,
            host,
            self.settings.interval_s,
            self.settings.timeout_s,
            LinkEvents(on_link=self._on_link, on_lost=self._on_lost, on_left=self._on_left),
            publish_endpoints=self._publish_endpoints,
            job=self.job,
            hosts_store=hosts_store,
        )
        if self._arbiter is not None:
            self._arbiter.listen(self._links.id)
        self._publish_address()
        self._links.start()
        return self

    def watch(self, group: Any = None, recovery: str = "abort", leave_on_any_loss: bool = False) -> None:
        """Watch ``group`` (None: the default group). Every member calls it, as with ``new_group``.

        ``recovery`` is what a member's loss does to the group: ``abort`` (its communicators; its
        ops raise until the application destroys it) or ``shrink`` (the group without the lost rank:
        on NCCL built anew from the store on every member, elsewhere ``shrink_group`` with ``SHRINK_ABORT``,
        :func:`torch_peer_watcher.groups.shrink`; :meth:`shrunk` hands back the new group; every survivor
        must watch the group with ``shrink``, as either is collective).
        ``leave_on_any_loss``: abort the group on the loss of any peer of the job, member or not,
        together with the lost peer's groups: for a group whose live members leave it when another
        group loses a rank (HSDP's replicate group, whose partner is stuck in its own replica's
        collective and rebuilds with it); an abort after the loss (:meth:`abort` in an
        :meth:`on_peer_lost` callback) would wait for the other aborts first. Returns once a
        link to every other member exists. Raises :class:`PeerLostError` if a member was already
        lost, :class:`WatcherError` if a member did not connect in time, if no address the store gave for a
        higher member took the link (naming the last cause), if PyTorch's NCCL watchdog would end the process
        when a peer dies (:func:`torch_peer_watcher.watchdog.refusal`), or if the group's backend has no abort
        it can use (:func:`torch_peer_watcher.groups.abort_unsupported`), ``ValueError``
        for an unknown ``recovery``.
        """
        if recovery not in groups_mod.RECOVERIES:
            raise ValueError(f"recovery must be one of {', '.join(groups_mod.RECOVERIES)}, not {recovery!r}")
        links = self._require_links()
        watched = dataclasses.replace(groups_mod.describe(group, recovery), leave_on_any_loss=leave_on_any_loss)
        if self.rank not in watched.ranks:
            return
        if "nccl" in watched.backends and (why := watchdog.refusal()) is not None:
            raise WatcherError(f"rank {self.rank} cannot watch group {watched.name}: {why}")
        if (why := groups_mod.abort_unsupported(watched)) is not None:
            raise WatcherError(f"rank {self.rank} cannot watch group {watched.name}: {why}")
        watched = groups_mod.with_gloo_records(watched)
        key = id(watched.group)
        with self._cond:
            self._groups[key] = watched
            self._members[key] = watched.ranks
            self._ledger.watched(key)
        peers = sorted(watched.ranks - {self.rank})
        for peer in peers:
            if links.is_lost(peer):
                raise PeerLostError(self._loss_for(peer) or unhandled(peer))
            if peer > self.rank and not links.has_link(peer) and not links.is_confirming(peer):
                # The lower rank connects: one link per pair, whichever group came first (a link being
                # redialled comes back by itself).
                self._link_to(links, peer)
        deadline = time.monotonic() + self.settings.connect_timeout_s
        republish_at = time.monotonic() + REPUBLISH_S
        while not all(links.has_link(p) or links.is_lost(p) for p in peers):
            left = deadline - time.monotonic()
            if left <= 0:
                missing = [p for p in peers if not links.has_link(p)]
                raise WatcherError(
                    f"ranks {missing} did not connect to the watcher of rank {self.rank} within "
                    f"{self.settings.connect_timeout_s:.0f} s; every member must call watch() on the group "
                    f"(raise {CONNECT_TIMEOUT_ENV} if they start late)"
                )
            if time.monotonic() >= republish_at and any(p < self.rank and not links.has_link(p) for p in peers):
                # A lower rank that read a forged address waits for a signed one: give it ours again.
                # Outside the lock: a store call can take a while, and the link thread takes the lock.
                self._publish_address(only_if_changed=True)
                republish_at = time.monotonic() + REPUBLISH_S
            with self._cond:
                self._cond.wait(min(left, 0.1))
        if watched.uses_gloo:
            # gloo connected its pairs when the group was made: tell the peers those endpoints.
            links.endpoints_changed()

    def forget(self, group: Any = None) -> None:
        """Stop watching ``group`` (before destroying it): its peers' deaths no longer abort it."""
        with self._cond:
            for key, watched in list(self._groups.items()):
                if watched.group is group or (group is None and watched.is_default):
                    del self._groups[key]

    def abort(self, group: Any = None) -> int:
        """Abort ``group`` now, as a member's loss would, and stop watching it: its communicators,
        and on gloo every socket of the group (gloo's own ``abort()`` closes none), so that the
        members blocked in it raise instead of waiting for the group's timeout. For a group the
        application leaves although none of its members died (an HSDP replicate group whose partner
        is stuck in its own replica's collective). Returns how many sockets were cut. Raises what the
        backend's abort raises; warns of what the NCCL proxy waker could not do.
        """
        with self._cond:
            known = [key for key, w in self._groups.items() if w.group is group or (group is None and w.is_default)]
            watched = self._groups.pop(known[0]) if known else None
        if watched is None:
            watched = groups_mod.with_gloo_records(groups_mod.describe(group))
        with self._cond:  # the watcher is aborting it after a loss (raise_if_lost() answered meanwhile): after that abort
            while any(id(watched.group) in ids for ids in self._ledger.in_abort.values()):
                self._cond.wait()
        cut = cut_group_connections(watched.gloo_records)
        with waking_proxies(groups_mod.waker_setting([watched], self.settings.wake_nccl_proxy)) as woken:
            groups_mod.abort(watched)
        groups_mod.warn_of_waker(woken)  # no loss records them here
        return cut

    def on_peer_lost(self, callback: Callable[[PeerLoss], None]) -> None:
        """Call ``callback(loss)`` after each loss, once its groups are aborted (in a watcher thread)."""
        with self._cond:
            self._callbacks.append(callback)

    def stop(self) -> None:
        """Say goodbye to every peer (they do not abort anything) and end the thread; first wait (at most 60 s) for
        the losses being handled: what follows (``_abort_process_group``, a new world) must not run beside their aborts.
        From a callback (a loss handler's thread), for the other verdicts' judging and aborts only: their callbacks
        may be waiting in a stop() of their own."""
        if self._links is not None and not self._stopped:
            if not settles.in_handler():
                settles.wait_for_settles(settles.SETTLE_EXIT_WAIT_S)
            else:  # this handler's own verdict stands and its aborts ended before its callbacks
                deadline = time.monotonic() + settles.SETTLE_EXIT_WAIT_S
                with self._cond:
                    while (self._ledger.unjudged or self._ledger.in_abort) and time.monotonic() < deadline:
                        self._cond.wait(deadline - time.monotonic())
            self._stopped = True
            self._links.stop(goodbye=True)
            if self._arbiter is not None:
                self._arbiter.close()
            settles.collect_at_exit()

    # --- what the user asks --------------------------------------------------------------------

    def losses(self) -> list[PeerLoss]:
        """Every loss handled so far, in order."""
        with self._cond:
            return list(self._losses)

    def lost(self, group: Any = None) -> PeerLoss | None:
        """The loss that broke ``group`` (None: any group), if a member was lost (its verdict stands; its groups'
        aborts may still run: then ``groups`` is empty and ``abort_s`` 0). A verdict on a member that is still being
        judged is waited for: PyTorch's watchdog can abort the communicator first, and a step's synchronize then
        returns from the aborted all-reduce as if it had ended (issue 74). A rank that links again is not lost, but
        for the groups its loss broke."""
        with self._cond:
            while True:
                ranks = self._group_ranks(group)
                found = self._ledger.lost(group, ranks, self._losses, self._cut_off)
                if found is not None or not self._ledger.judging_any(ranks, unjudged_only=True):
                    return found
                self._cond.wait()

    def wait_for_loss(self, group: Any = None, timeout_s: float | None = None, aborted: bool = True) -> PeerLoss | None:
        """Wait until a member of ``group`` is lost and its groups are aborted; None on timeout. ``aborted=False``:
        only until its verdict stands (what :meth:`lost` answers), while the aborts may still run: a survivor that
        goes on with groups the loss did not break need not wait for them (on stock NCCL 0.1 s and more)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while True:
                ranks = self._group_ranks(group)
                # Not aborted: what lost() answers (a rank that relinked is lost only for the groups its loss broke).
                found = self._ledger.lost(group, ranks, self._losses, self._cut_off) if not aborted else next((x for x in self._losses if ranks is None or x.rank in ranks), None)
                if found is not None:
                    return found
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self._cond.wait(left)

    def shrunk(self, group: Any, timeout_s: float | None = None) -> Any | None:
        """The group that replaced ``group`` (watched with ``recovery="shrink"``) after a loss.

        Waits until the shrink is done; None on timeout or if the shrink failed (the loss's
        ``errors`` say why; the group was aborted instead).
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while True:
                if id(group) in self._shrunk:
                    return self._shrunk[id(group)]
                ranks = self._group_ranks(group)
                if any(loss.rank in (ranks or ()) for loss in self._losses):
                    return None
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self._cond.wait(left)

    def raise_if_lost(self, group: Any = None) -> None:
        """Raise :class:`PeerLostError` if a member of ``group`` was lost."""
        loss = self.lost(group)
        if loss is not None:
            raise PartitionedError(loss) if loss.cut_off else PeerLostError(loss)

    def synchronize(self, group: Any = None, stream: Any = None) -> None:
        """A step's end: wait for ``stream``'s work (the current CUDA stream's), raise on a loss without waiting for
        the aborted collective's kernel; not what the examples use (:mod:`torch_peer_watcher.streams` says why)."""
        streams.synchronize(self, group, stream)

    @contextmanager
    def guard(self, group: Any = None, grace_s: float = 1.0) -> Iterator[None]:
        """Turn an error raised inside into :class:`PeerLostError` when a member of ``group`` was lost.

        The collective may fail a moment before the watcher's verdict (both see the same closed
        connection): the error waits up to ``grace_s`` for it, then propagates unchanged. On a loss
        it also closes the NCCL group that a failed send or recv left open in this thread
        (:mod:`torch_peer_watcher.ncclgroups`), so that the thread can create a new group.
        """
        try:
            yield
        except (PeerLostError, PartitionedError):
            raise
        except Exception as exc:
            # The handled loss names the aborted groups; a verdict still being handled is the fallback.
            loss = self._loss_once_judged(group, grace_s) or self.lost(group)
            if loss is None:
                raise
            if loss.cut_off:
                close_leaked_groups()
                raise PartitionedError(loss) from exc
            raise PeerLostError(loss, nccl_groups_closed=close_leaked_groups()) from exc

    def _loss_once_judged(self, group: Any, grace_s: float) -> PeerLoss | None:
        """A handled loss of ``group``, waited for ``grace_s``, and longer while a verdict on one of its
        members is still being judged: the arbitration can take an interval and more (verdicts)."""
        deadline = time.monotonic() + grace_s
        with self._cond:
            while True:
                ranks = self._group_ranks(group)
                if (loss := self._ledger.handled(group, self._losses, self._cut_off)) is not None:
                    return loss
                judging = self._ledger.judging_any(ranks)
                left = deadline - time.monotonic()
                if left <= 0 and not judging:
                    return None
                self._cond.wait(left if left > 0 else 0.05)

    # --- events from the link thread ----------------------------------------------------------

    def _on_link(self, rank: int) -> None:
        with self._cond:
            self._ledger.linked(rank)
            self._cond.notify_all()

    def _on_left(self, rank: int) -> None:
        with self._cond:
            self._cond.notify_all()

    def _on_lost(self, rank: int, verdict: Verdict) -> None:
        with self._cond:
            key, links = self._ledger.verdict(rank)
        # The store check, the arbitration and the abort take time (ncclCommAbort: seconds): never in the
        # heartbeat thread. The interpreter's exit waits for it (torch_peer_watcher.settles).
        detected_at = time.time()
        thread = threading.Thread(target=self._handle_loss, args=(key, links, verdict, detected_at),
                                  name=f"torch-peer-watcher-abort-{rank}", daemon=True)  # fmt: skip
        settles.track(thread)
        try:
            thread.start()
        except BaseException:  # no thread (none left to start): the verdict is not judged, so no side may go on
            settles.untrack(thread)
            self._unjudgeable(key, verdict, detected_at)
            raise

    def _unjudgeable(self, key: tuple[int, int], verdict: Verdict, detected_at: float) -> None:
        """Fail closed where a verdict could not be judged: this process stops as the cut-off side does."""
        with self._cond:
            if key in self._ledger.unjudged:
                self._cut_off = self._cut_off or f"the verdict on rank {key[0]} could not be judged (the watcher's error above)"
                self._ledger.stands(key, -1, (key[0], verdict.cause, detected_at, verdict.silent_s), self._groups.items(), True)
                self._ledger.done(key)
                self._cond.notify_all()

    def _handle_loss(self, key: tuple[int, int], links: int, verdict: Verdict, detected_at: float) -> None:
        try:
            self._settle_loss(key, links, verdict, detected_at)
        finally:
            self._unjudgeable(key, verdict, detected_at)  # where the judging raised
            with self._cond:
                self._ledger.done(key)  # also where the handling failed: abort() must not wait forever
                self._cond.notify_all()
            settles.untrack(threading.current_thread())

    def _settle_loss(self, key: tuple[int, int], links: int, verdict: Verdict, detected_at: float) -> None:
        rank = key[0]
        started = time.monotonic()
        cause, silent_s, endpoints = verdict.cause, verdict.silent_s, verdict.endpoints
        # Which side of a cut this process is on, before anything sees the verdict (lost() and guard()). Where the
        # arbiter settles it, the store answers its claim or this process is out: the probe need not hold 0.02 s.
        arbitrated = self._arbiter is not None and self._links is not None
        cut_off = (self._cut_off or store_out_of_reach(self._root_store, STORE_PROBE_S, hold=not arbitrated)
                   or (self._arbitrate(rank, verdict) if arbitrated else None))  # fmt: skip
        judged_s = time.monotonic() - started
        with self._cond:  # one step: once lost() answers, an abort() of these groups waits for the watcher's
            cut_off = self._cut_off = self._cut_off or cut_off  # a verdict judged beside this one may have put it out
            affected = [(gid, w) for gid, w in self._groups.items() if self._ledger.breaks(key, links, gid, w, bool(cut_off))]
            self._ledger.stands(key, links, (rank, cause, detected_at, silent_s), affected, bool(cut_off))
            for gid, _ in affected:
                del self._groups[gid]
            self._ledger.in_abort[key] = {id(w.group) for _, w in affected}
            self._cond.notify_all()
        errors = []
        cut = 0
        shrunk: list[str] = []
        rebuilt: list[str] = []
        to_abort: list[groups_mod.WatchedGroup] = []
        if endpoints and any(w.uses_gloo for _, w in affected):
            try:
                # The store's connections are not the peer's to take, at either end: the lost peer's
                # endpoints include the store's port where it hosts the store, and, where this process
                # hosts it, the peer's connection to it (a false verdict would cut the job's store).
                cut = cut_connections_to(endpoints, keep=self._store_endpoints)
            except OSError as exc:  # no fd left to list them: reported; the aborts below still run
                errors.append(f"cutting the gloo sockets to rank {rank}: {exc.strerror or exc}")
        # Shrinks first, one by one (collective: every survivor shrinks its groups in this order), non-default
        # groups before the default one; then every other group's abort at once (groups.abort_all).
        for gid, watched in sorted(affected, key=lambda kw: kw[1].is_default):
            if watched.recovery == "shrink" and not cut_off and rank in watched.ranks:
                try:
                    made = groups_mod.shrink(watched, [rank], wake_nccl_proxy=self.settings.wake_nccl_proxy)
                except Exception as exc:  # reported; the group is aborted instead, so its ops still raise
                    errors.append(f"{watched.name}: shrink: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}")
                else:
                    replacement = made.group
                    if made.rebuilt_because:
                        rebuilt.append(f"{watched.name}: {made.rebuilt_because}")
                    with self._cond:
                        self._shrunk[gid] = replacement
                        survivors = groups_mod.describe(replacement, "shrink")
                        self._groups[id(replacement)] = survivors
                        self._ledger.watched(id(replacement))
                        self._members[id(replacement)] = survivors.ranks
                    shrunk.append(watched.name)
                    continue
            to_abort.append(watched)
        aborted = groups_mod.abort_all(to_abort, wake_nccl_proxy=self.settings.wake_nccl_proxy)
        cut += aborted.sockets_cut
        errors += aborted.errors
        woken = aborted.woken
        if woken is not None:
            errors += [f"waking NCCL's proxy threads: {e}" for e in woken.errors]
        loss = PeerLoss(
            rank=rank,
            cause=cause,
            detected_at=detected_at,
            silent_s=round(silent_s, 3),
            groups=tuple(w.name for _, w in affected),
            abort_s=round(time.monotonic() - started, 3),
            sockets_cut=cut,
            errors=tuple(errors),
            shrunk=tuple(shrunk),
            cut_off=cut_off,
            rebuilt=tuple(rebuilt),
            proxy_wakes=tuple(f"{kind}:{tid} x{n}" for (kind, tid), n in woken.pokes.items()) if woken else (),
            judged_s=round(judged_s, 3),
        )
        with self._cond:
            self._losses.append(loss)
            self._ledger.in_abort.pop(key, None)
            callbacks = list(self._callbacks)
            self._cond.notify_all()
        for callback in callbacks:
            try:
                callback(loss)
            except Exception as exc:  # the user's callback must not kill the watcher
                warnings.warn(f"torch_peer_watcher: callback {callback!r} raised {type(exc).__name__}: {exc}", stacklevel=1)

    # --- helpers ------------------------------------------------------------------------------

    def _require_links(self) -> LinkLoop:
        if self._links is None or self._stopped:
            raise WatcherError("the watcher is not running: call start() first (after init_process_group)")
        return self._links

    def _publish_address(self, only_if_changed: bool = False) -> None:
        """Write this rank's listener address to the store, signed with the job key."""
        assert self._links is not None
        key = f"addr/{self.rank}"
        value = protocol.sign_address(self._key(), self.rank, self._links.address, self.job)
        if only_if_changed:
            # check() first: get() of a key another process deleted would wait for the store's timeout.
            if self.store.check([key]) and self.store.get(key).decode(errors="replace") == value:
                return
            warnings.warn(f"torch_peer_watcher: rank {self.rank}'s address in the store was rewritten by another "
                          "process; writing it again", stacklevel=3)  # fmt: skip
        self.store.set(key, value)

    def _link_to(self, links: LinkLoop, peer: int) -> None:
        """Link to ``peer`` at its signed address; until the connect timeout, an address that does not take
        the link (dead, refused, no proof: a value an earlier job at this store signed, replayed) is passed
        over for the next one the store holds (the peer writes its own again). Raises :class:`WatcherError`
        naming the last cause when no link is made in time."""
        deadline = time.monotonic() + self.settings.connect_timeout_s
        tried: set[Endpoint] = set()
        cause = ""
        while True:
            try:
                address = signed_address(self.store, self._key(), self.job, (self.rank, peer), deadline,
                                         self.settings.connect_timeout_s, skip=tried)  # fmt: skip
            except WatcherError:
                if not cause:
                    raise
                raise WatcherError(
                    f"rank {self.rank} could not link to rank {peer} within {self.settings.connect_timeout_s:.0f} s: "
                    f"{cause}; the store gave no other address for rank {peer} signed for this job (rank {peer} is "
                    f"gone, or another process keeps writing an address of an earlier job with the same secret to "
                    f"torch_peer_watcher/addr/{peer})"
                ) from None
            try:
                links.connect(peer, address, max(0.1, deadline - time.monotonic()))
                return
            except HandshakeError as exc:
                if "declared this process lost" in str(exc):
                    raise WatcherError(str(exc)) from None
                cause = str(exc)
            except OSError as exc:
                cause = f"rank {peer}'s watcher at {address[0]}:{address[1]} cannot be reached ({exc.strerror or exc})"
            tried.add(address)
            warnings.warn(f"torch_peer_watcher: rank {self.rank}: {cause}; waiting for another address of rank {peer}",
                          stacklevel=3)  # fmt: skip

    def _key(self) -> bytes:
        return protocol.job_key(self.settings.secret, self.job)

    def _group_ranks(self, group: Any) -> frozenset[int] | None:
        if group is None:
            return None
        return self._members.get(id(group), frozenset())

    def _loss_for(self, rank: int) -> PeerLoss | None:
        for loss in reversed(self._losses):
            if loss.rank == rank:
                return loss
        return None

    def _make_arbiter(self, hosts_store: bool) -> Arbiter | None:
        """The store client that decides disputed verdicts (None without a TCP store: every verdict stands).

        Raises :class:`WatcherError` when it cannot be made and a secret is set: on a shared node (why a
        secret is set) two live sides that both go on are what a stranger would aim for."""
        host, port = store_host(self._root_store), store_port(self._root_store)
        if not host or not port:
            return None
        try:
            return Arbiter(host, port, self.rank, self._key(), hosts_store=hosts_store)
        except Exception as exc:
            if self.settings.secret is not None:
                raise WatcherError(f"rank {self.rank} cannot open its own connection to the store at {host}:{port} "
                                   f"({type(exc).__name__}: {exc}), which settles disputed verdicts") from None  # fmt: skip
            # Without a secret the watcher still works; two live sides of a failed link may both go on.
            warnings.warn(f"torch_peer_watcher: rank {self.rank} cannot open its own connection to the store at "
                          f"{host}:{port} ({type(exc).__name__}: {exc}): a link that fails between two live ranks "
                          "may leave both training", stacklevel=3)  # fmt: skip
            return None

    def _arbitrate(self, rank: int, verdict: Verdict) -> str | None:
        """Why this process is out after its verdict on ``rank`` (the peer's stands, or the store did not
        answer), or None (this verdict stands); only where the arbiter and the links exist. Every verdict is
        settled: a refused redial ("process gone") may be a peer that won and stopped its watcher."""
        assert self._arbiter is not None and self._links is not None
        decision = self._arbiter.decide(rank, (self._links.id, verdict.peer_id), self.settings.interval_s, verdict.kind,
                                        self._links.hosts_the_store(verdict.peer_id))  # fmt: skip
        if decision.winner == self.rank:
            return None
        if decision.winner is None:
            why = f"no verdict could be settled: {decision.why}"
        else:
            why = _ACCUSED.format(rank=rank, why=decision.why)
        return why + (_HOSTS_STORE if self._arbiter.hosts_store else "")

    def _publish_endpoints(self) -> bool:
        with self._cond:
            return any(w.uses_gloo for w in self._groups.values())

    def _after_fork_in_child(self) -> None:
        if self._links is not None:
            self._links.close_in_child()
        self._stopped = True


_current: PeerWatcher | None = None
_current_lock = threading.Lock()


def start(store: Any = None, settings: WatcherSettings | None = None, watch_world: bool = True) -> PeerWatcher:
    """Start this process's watcher on the default group's store (every rank calls it).

    A watcher already running for another store (an earlier default group) is stopped first.
    ``watch_world`` also watches the default group.
    """
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    global _current
    if not dist.is_initialized():
        raise WatcherError("torch.distributed is not initialized: call init_process_group() before start()")
    store = store if store is not None else c10d._get_default_store()
    with _current_lock:
        if _current is not None:
            if _current._root_store is store and not _current._stopped:
                return _current
            _current.stop()
        _current = PeerWatcher(store, dist.get_rank(), settings, dist.get_world_size()).start()
        watcher = _current
    if watch_world:
        watcher.watch(None)
    return watcher


def current() -> PeerWatcher | None:
    """The running watcher of this process, if any."""
    return _current if _current is not None and not _current._stopped else None


def stop() -> None:
    """Stop this process's watcher, if one runs. Its wait for the losses being handled runs outside the lock: a
    callback of theirs may call stop() (or leave_world()) too, and finds no watcher left to stop."""
    global _current
    with _current_lock:
        watcher, _current = _current, None
    if watcher is not None:
        watcher.stop()


def _after_fork_in_child() -> None:
    global _current
    settles.after_fork_in_child()
    if _current is not None:
        _current._after_fork_in_child()
        _current = None


os.register_at_fork(after_in_child=_after_fork_in_child)
