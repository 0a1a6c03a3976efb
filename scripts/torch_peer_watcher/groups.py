"""Process groups as the watcher sees them: members (global ranks), backends, and how to recover one.

Stock PyTorch >= 2.6 API only. Aborting is what makes a collective blocked on a dead peer raise in
Python: ``ProcessGroup.abort()`` (torch >= 2.7) or the NCCL backend's ``abort()`` (2.6), which
runs ``ncclCommAbort``. The group stays registered, so later ops on it raise the backend's error
too; ``distributed_c10d._abort_process_group`` is not used, since it also drops the group from the
world map and an op issued after it raised ``ValueError`` (issue 20). gloo has no abort
(``Backend::abort`` is empty up to 2.13 at least): the watcher cuts its sockets to the dead peer
instead, and every socket of each gloo group it aborts (:mod:`torch_peer_watcher.sockets`; the
group's sockets are told by the address records gloo leaves in the group's store: :func:`gloo_records`). Shrinking (:func:`shrink`) replaces the abort for
groups watched with ``recovery="shrink"``; it releases the shrunk parent with ``abort()``, never
``destroy_process_group`` (:func:`release_aborted_parent`). Where the shrink fails on some member
(between nodes, NCCL's network transport records the dead peer as ``ncclRemoteError`` in the parent,
and PyTorch's shrink then raises, :func:`shrink`), the members agree through the group's store and
all build the group anew from the store instead (:func:`rebuild`): the same members and ranks, a
new communicator.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from torch_peer_watcher.proxywake import Woken, waking_proxies
from torch_peer_watcher.sockets import cut_group_connections


# What a member's loss does to a watched group (PeerWatcher.watch).
RECOVERIES = ("abort", "shrink")


@dataclass(frozen=True)
class WatchedGroup:
    """A process group this process belongs to, and what the watcher needs to know about it."""

    group: Any
    name: str
    ranks: frozenset[int]
    backends: tuple[str, ...]
    is_default: bool
    recovery: str = "abort"
    # Aborted on the loss of any peer of the job, not only of its members (PeerWatcher.watch).
    leave_on_any_loss: bool = False
    # gloo's address record of every member (its listener's sockaddr), read when watching starts:
    # what tells this group's sockets from other groups' (sockets.cut_group_connections).
    gloo_records: tuple[bytes, ...] = ()

    @property
    def uses_gloo(self) -> bool:
        """True if some device of the group runs on gloo (which only a socket cut can unblock)."""
        return "gloo" in self.backends


def backend_names(description: str) -> tuple[str, ...]:
    """Backend names of ``dist.get_backend()``'s text: 'nccl' or 'cpu:gloo,cuda:nccl' -> names."""
    names = []
    for part in description.split(","):
        name = part.split(":")[-1].strip().lower()
        if name and name not in names:
            names.append(name)
    return tuple(names)


def describe(group: Any, recovery: str = "abort") -> WatchedGroup:
    """The members, backends and name of ``group`` (None: the default group)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    default = c10d._get_default_group()
    group = default if group is None else group
    try:
        name = str(getattr(group, "group_name", "") or id(group))
    except RuntimeError:  # "ProcessGroup name not set": a plug-in that is its own ProcessGroup
        name = str(getattr(c10d._world, "pg_names", {}).get(group) or id(group))
    return WatchedGroup(
        group=group,
        name=name,
        ranks=frozenset(dist.get_process_group_ranks(group)),
        backends=backend_names(str(dist.get_backend(group))),
        is_default=group is default,
        recovery=recovery,
    )


# Where gloo's rendezvous leaves a member's address record, under the group's store in PyTorch's
# bookkeeping (_world.pg_map): PyTorch's backend prefix "cpu/", gloo's per-device prefix, the group
# rank. Read in PyTorch 2.6.0 and 2.13.0. Up to this many gloo devices (GLOO_SOCKET_IFNAME a,b,...).
GLOO_RECORD_KEY = "cpu//{device}/{rank}"
GLOO_MAX_DEVICES = 8


def gloo_records(group: Any) -> tuple[bytes, ...]:
    """The address records gloo published for ``group``'s members, or () where none can be found
    (a PyTorch with another layout, a lazily connected group): then only the sockets to a dead peer
    are cut, as before. Reads the group's store: call it while the store is reachable."""
    try:
        store = _group_store(group)
        size = group.size()
    except (AttributeError, KeyError, TypeError):
        return ()
    records: list[bytes] = []
    for device in range(GLOO_MAX_DEVICES):
        keys = [GLOO_RECORD_KEY.format(device=device, rank=rank) for rank in range(size)]
        try:
            if not store.check(keys):
                break
            multi_get = getattr(store, "multi_get", None)
            values = multi_get(keys) if multi_get is not None else [store.get(key) for key in keys]
        except RuntimeError:  # the store: gone or refusing
            break
        records += [bytes(value) for value in values]
    return tuple(records)


def with_gloo_records(watched: WatchedGroup) -> WatchedGroup:
    """``watched`` with its members' gloo address records (:func:`gloo_records`, read from the store now)
    where the group runs on gloo; as it is otherwise."""
    return dataclasses.replace(watched, gloo_records=gloo_records(watched.group)) if watched.uses_gloo else watched


def _nccl_backend(group: Any) -> Any:
    import torch
    from torch.distributed import distributed_c10d as c10d

    if not c10d.is_nccl_available():
        return None
    try:
        backend = group._get_backend(torch.device("cuda"))
    except RuntimeError:
        return None
    return backend if isinstance(backend, c10d.ProcessGroupNCCL) else None


def abort(watched: WatchedGroup) -> str:
    """Abort ``watched``'s communicators so that work blocked in them raises; say what was done.

    The group stays registered with PyTorch: its next op then reaches the aborted backend and
    raises ``DistBackendError``, like the op that was blocked. ``_abort_process_group`` would also
    drop it from the world map, and an op issued after the abort raised ``ValueError: Process group
    ... is not initialized in the world group map`` instead (issue 20). The application destroys or
    shrinks the group when it recovers.
    """
    group = watched.group
    with _releases_lock:
        releasing = _released.get(id(group))
    if releasing is not None and releasing[0] is group:  # a rebuild already aborts it beside the job
        releasing[1].join()
        return "aborted"
    if hasattr(group, "abort"):
        group.abort()
        return "aborted"
    nccl = _nccl_backend(group)
    if nccl is None:
        return "no abort API for this backend in this PyTorch"
    nccl.abort()
    return "aborted"


@dataclass
class Aborted:
    """What :func:`abort_all` did: the gloo sockets it cut, what failed, and the NCCL proxy threads it woke
    (None when it was not asked to)."""

    sockets_cut: int = 0
    errors: list[str] = field(default_factory=list)
    woken: Woken | None = None


def abort_all(watched_groups: list[WatchedGroup], wake_nccl_proxy: bool | None = False) -> Aborted:
    """Abort every group at once, each in a thread of its own, and wait for all of them.

    On stock NCCL each ``ncclCommAbort`` waits for its proxy threads, which see the abort only when their
    500 ms ``poll()`` times out: one after the other, a survivor in three groups waited 1.5 s before its
    collective raised. One group failing to abort never spares the others. With ``wake_nccl_proxy``, the
    proxy threads the aborts join are woken meanwhile (:mod:`torch_peer_watcher.proxywake`; None: where the
    loaded NCCL is one the waker was proven on).
    """
    with waking_proxies(waker_setting(watched_groups, wake_nccl_proxy)) as woken:
        done = _abort_all(watched_groups)
    done.woken = woken
    return done


def waker_setting(watched_groups: list[WatchedGroup], wake_nccl_proxy: bool | None) -> bool | None:
    """The proxy waker's setting for aborting ``watched_groups``: its default (None) runs it only where one of
    them has an NCCL communicator (a gloo group's abort has no proxy thread to wake)."""
    if wake_nccl_proxy is None and not any("nccl" in w.backends for w in watched_groups):
        return False
    return wake_nccl_proxy


def warn_of_waker(woken: Woken | None) -> None:
    """Warn, at the line that called the caller, of what the proxy waker could not do around an abort no loss records
    (``PeerWatcher.abort(group)``, ``leave_world()``)."""
    for error in woken.errors if woken else []:
        warnings.warn(f"torch_peer_watcher: waking NCCL's proxy threads: {error}", stacklevel=3)


def _abort_all(watched_groups: list[WatchedGroup]) -> Aborted:
    done = Aborted()
    lock = threading.Lock()

    def abort_one(watched: WatchedGroup) -> None:
        cut, errors = 0, []
        if watched.gloo_records:
            # gloo's abort closes nothing: a member blocked on another survivor (which left this
            # collective when its own connection to the dead rank broke) waited for the group's timeout.
            try:
                cut = cut_group_connections(watched.gloo_records)
            except OSError as exc:
                errors.append(f"{watched.name}: cutting its gloo sockets: {exc.strerror or exc}")
        try:
            abort(watched)
        except Exception as exc:
            errors.append(f"{watched.name}: {type(exc).__name__}: {exc}")
        with lock:
            done.sockets_cut += cut
            done.errors += errors

    threads = [threading.Thread(target=abort_one, args=(w,), name=f"torch-peer-watcher-abort-{w.name}", daemon=True)
               for w in watched_groups[1:]]  # fmt: skip
    for thread in threads:
        thread.start()
    if watched_groups:
        abort_one(watched_groups[0])  # the first in this thread: one group, no thread
    for thread in threads:
        thread.join()
    return done


def abort_unsupported(watched: WatchedGroup) -> str | None:
    """Why the watcher cannot end the work blocked in ``watched`` on a dead peer, or None if it can.

    It can for gloo (it cuts the group's sockets) and NCCL, legacy or PyTorch 2.15's ``nccl2`` (their
    ``abort()`` aborts the communicators; docs/explain/peer-watcher.md, "nccl2 at 2.15.0"). Any other backend
    counts only where its Python class overrides ``abort``: c10d's ``Backend::abort()`` does nothing
    (Backend.hpp, 2.13.0 and 2.15.0), so a group of a backend without its own abort would stay blocked until
    its timeout, watched or not.
    """
    import torch

    others = [name for name in watched.backends if name != "gloo" and "nccl" not in name]
    if not others:
        return None
    group = watched.group
    backends = []
    for device_type in getattr(group, "_device_types", None) or []:
        try:
            backends.append(group._get_backend(torch.device(device_type)))
        except RuntimeError:  # "No backend type associated with device type ..."
            continue
    # A plug-in whose creator returned a ProcessGroup subclass is its own backend.
    for backend in backends or [group]:
        kind = type(backend)
        if any("abort" in vars(k) for k in kind.__mro__ if not k.__module__.startswith("torch")):
            continue
        return (
            f"its {'/'.join(others)} backend ({kind.__module__}.{kind.__qualname__}) "
            "has no abort() of its own, so the watcher cannot end work blocked on a dead peer (c10d's "
            "Backend.abort() does nothing): watch gloo or NCCL groups, or give the backend an abort() that "
            "makes its blocked work raise"
        )
    return None


def shrink_unsupported(group: Any) -> str | None:
    """Why ``shrink_group`` cannot shrink ``group`` in this PyTorch, or None if it can."""
    import torch
    from torch.distributed import distributed_c10d as c10d

    if not hasattr(c10d, "shrink_group") or not hasattr(c10d, "SHRINK_ABORT"):
        return f"PyTorch {torch.__version__} has no torch.distributed.distributed_c10d.shrink_group with SHRINK_ABORT"
    seam = shrink_seam_missing()
    if seam is not None:
        # Its shrink_group would destroy the aborted parent, which can hang (release_aborted_parent).
        return seam
    names = backend_names(str(c10d.get_backend(group)))
    device = torch.device("cuda" if "nccl" in names else "cpu")
    if device.type == "cuda" and getattr(group, "bound_device_id", None) is None:
        # shrink_group registers the new backend on the parent's bound device, or on the CPU when it
        # has none (distributed_c10d._create_shrunk_process_group, 2.11 to 2.14.1): the shrunk group
        # then has no CUDA backend ("No backend type associated with device type cuda").
        return (
            "the group is not bound to a GPU, so shrink_group would give the shrunk group no CUDA backend; "
            "make the world with init_process_group(..., device_id=torch.device('cuda', local_rank))"
        )
    try:
        supported = bool(group._get_backend(device).supports_shrinking)
    except RuntimeError as exc:
        return f"no {device.type} backend to shrink: {exc}"
    if not supported:
        return f"the {'/'.join(names)} backend of PyTorch {torch.__version__} does not support shrink_group (supports_shrinking is False)"
    return None


# How long the members of a shrunk group wait for each other's word on their shrink (agree_on_shrink), and how
# often they look.
AGREE_TIMEOUT_S = 30.0
AGREE_POLL_S = 0.005
# Under the group's store: each member's word on its shrink, and the rebuilt group's rendezvous.
AGREE_KEY = "torch_peer_watcher/shrink/{name}/{lost}/{rank}"
REBUILD_PREFIX = "torch_peer_watcher/rebuild/{name}/{lost}/"
# shrink_group's steps, called one by one so that the members can agree between the backend's
# shrink and the new group's registration (2.10.0 to 2.14.1: distributed_c10d.shrink_group's body).
_SHRINK_STEPS = ("_prepare_shrink_target_group", "_validate_shrink_backend_requirements",
                 "_validate_and_process_excluded_ranks", "_finalize_shrunk_group", "_extract_group_metadata")  # fmt: skip


# Why an NCCL group is rebuilt rather than shrunk (shrink), as PeerLoss.rebuilt says it.
NCCL_REBUILT = "NCCL groups are rebuilt from the store: a member's ncclCommShrink can wait for good on another's that failed"


@dataclass(frozen=True)
class Shrunk:
    """What :func:`shrink` made: the new group, and why it was rebuilt rather than shrunk (None if shrunk)."""

    group: Any
    rebuilt_because: str | None = None


def shrink(watched: WatchedGroup, lost: list[int], agree_timeout_s: float = AGREE_TIMEOUT_S,
           wake_nccl_proxy: bool | None = False) -> Shrunk:  # fmt: skip
    """``shrink_group`` of ``watched`` without the ``lost`` global ranks, aborting its pending work.
    ``wake_nccl_proxy``: the parent's release wakes its proxy threads (:func:`release_in_background`).

    ``SHRINK_ABORT`` (NCCL's ``NCCL_SHRINK_ABORT``) ends the work still blocked on the dead peer,
    so the caller does not abort the group first (an aborted NCCL communicator cannot be shrunk).
    The parent is then released with ``abort()``, not destroyed (:func:`aborting_shrinks`).

    The backend's shrink can fail on one member and succeed on another: between nodes, NCCL's
    network transport records the dead peer as ``ncclRemoteError`` in the parent, and PyTorch's
    ``NCCLComm::shrink`` raises when it finds that error, in ``ncclCommShrink``'s result or in its
    wait on the parent afterwards (``waitReady``, 2.11.0), whichever moment the transport noticed.
    So every member says through the group's store whether its shrink worked; unless all did, all
    drop what they shrank and build the group anew from the store (:func:`rebuild`). Raises if
    neither works; the caller then aborts the group.

    An NCCL group is always rebuilt, never shrunk by its backend: ``ncclCommShrink`` is collective over the
    parent, and where one member's parent holds the error its shrink fails at once while another member's
    waits in the shrink's bootstrap for it, for good, before it can say anything (on one H100 with the ranks
    joined through NCCL's network, PyTorch 2.11.0 and NCCL 2.28.9: 7 of 16 train-shrink runs and 3 of 16 runs
    of the DDP example hung so, the survivor rebuilding while its partner sat in ``ncclCommShrink``). A
    ``SHRINK_ABORT`` child shares nothing with its parent, so the rebuilt group costs what the shrink did: a
    new communicator's setup.
    """
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    why = shrink_unsupported(watched.group)
    if why is not None:
        raise RuntimeError(f"cannot shrink: {why}")
    wake_nccl_proxy = waker_setting([watched], wake_nccl_proxy)  # unasked, never around a gloo group's release
    group_ranks = [dist.get_group_rank(watched.group, rank) for rank in lost]
    if "nccl" in watched.backends and not any(getattr(c10d, step, None) is None for step in _SHRINK_STEPS):
        return Shrunk(rebuild(watched, lost, wake_nccl_proxy=wake_nccl_proxy), NCCL_REBUILT)
    if any(getattr(c10d, step, None) is None for step in _SHRINK_STEPS):
        with aborting_shrinks(wake_nccl_proxy):  # no steps to agree between: stock shrink_group, as before
            return Shrunk(c10d.shrink_group(group_ranks, group=watched.group, shrink_flags=c10d.SHRINK_ABORT))
    info = c10d._prepare_shrink_target_group(watched.group)
    backend_impl = c10d._validate_shrink_backend_requirements(info)
    excluded = c10d._validate_and_process_excluded_ranks(group_ranks, info)
    failure = None
    try:
        backend = backend_impl.shrink(sorted(excluded), c10d.SHRINK_ABORT, None)
    except Exception as exc:  # agreed on below: every member then rebuilds
        backend, failure = None, f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
    others_failed = agree_on_shrink(watched, excluded, failure, agree_timeout_s)
    if failure is None and not others_failed:
        info["pg_options_override"] = None
        with aborting_shrinks(wake_nccl_proxy):
            return Shrunk(c10d._finalize_shrunk_group(info, excluded, backend))
    if backend is not None:
        try:
            backend.abort()
        except Exception:  # noqa: S110 - it is dropped either way
            pass
    because = f"the shrink failed here: {failure}" if failure else f"the shrink failed on {others_failed}"
    return Shrunk(rebuild(watched, lost, info=info, excluded=excluded, wake_nccl_proxy=wake_nccl_proxy), because)


def _lost_key(excluded: set[int] | list[int]) -> str:
    return "-".join(str(r) for r in sorted(excluded))


def _group_store(group: Any) -> Any:
    """``group``'s store, as PyTorch's bookkeeping holds it (``_world.pg_map``); KeyError if it is not there."""
    from torch.distributed import distributed_c10d as c10d

    return c10d._world.pg_map[group][1]


def agree_on_shrink(watched: WatchedGroup, excluded: set[int], failure: str | None, timeout_s: float) -> str:
    """Say through the group's store whether this member's shrink worked (``failure`` None), and hear
    the other members: '' if all worked, else which failed ('group rank 1: ...'; 'no word from group
    rank 2 within 30 s' for a member that never answered)."""
    store = _group_store(watched.group)
    me = watched.group.rank()
    members = [r for r in range(watched.group.size()) if r not in excluded]
    keys = {r: AGREE_KEY.format(name=watched.name, lost=_lost_key(excluded), rank=r) for r in members}
    store.set(keys[me], "ok" if failure is None else f"failed: {failure}")
    others = [r for r in members if r != me]
    # Polled, not store.wait(): the group's store connection is PyTorch's too, and a wait holds it for its whole
    # timeout, so the NCCL watchdog's own store calls (its dump signal on a failed collective) waited behind it.
    deadline = time.monotonic() + timeout_s
    missing = list(others)
    while missing:
        missing = [r for r in missing if not store.check([keys[r]])]
        if missing and time.monotonic() >= deadline:  # a member stuck in its shrink, or gone
            return f"no word from group rank {', '.join(map(str, missing))} within {timeout_s:g} s"
        if missing:
            time.sleep(AGREE_POLL_S)
    words = {r: store.get(keys[r]).decode(errors="replace") for r in others}
    return "; ".join(f"group rank {r}: {w[len('failed: '):]}" for r, w in words.items() if w != "ok")


def rebuild(watched: WatchedGroup, lost: list[int], info: dict[str, Any] | None = None, excluded: set[int] | None = None,
            wake_nccl_proxy: bool | None = False) -> Any:  # fmt: skip
    """``watched`` without the ``lost`` global ranks, built anew: a backend of the survivors made from the
    group's store (each member keeps its order), registered as ``shrink_group`` registers its result;
    the parent is released with ``abort()``. Every surviving member must call it.

    It needs no help from the parent's communicator, so it works where a shrink cannot (a parent in
    error); it costs a new communicator's setup (NCCL's init, gloo's connections). The parent's abort
    starts first, beside that setup: the survivors' work blocked on the dead rank ends at once.
    """
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    group = watched.group
    wake_nccl_proxy = waker_setting([watched], wake_nccl_proxy)  # unasked, never around a gloo group's release
    if "nccl" in watched.backends:
        release_in_background(group, wake_nccl_proxy)
    if info is None:
        info = c10d._prepare_shrink_target_group(group)
    if excluded is None:
        excluded = c10d._validate_and_process_excluded_ranks([dist.get_group_rank(group, r) for r in lost], info)
    survivors = [r for r in range(group.size()) if r not in excluded]
    rank, size = survivors.index(group.rank()), len(survivors)
    store = dist.PrefixStore(REBUILD_PREFIX.format(name=watched.name, lost=_lost_key(excluded)), _group_store(group))
    device = getattr(group, "bound_device_id", None)
    if device is None:
        device = torch.device("cuda" if "nccl" in watched.backends else "cpu")
    timeout = _timeout_of(group, device)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        if _runs_nccl2(group):
            # PyTorch 2.15.0's default "nccl": the rebuilt group runs on the backend the parent ran on (nccl2
            # takes the legacy Options and its device: nccl2/ProcessGroupNCCL.hpp:126, _create_nccl2_process_group).
            backend = dist.ProcessGroupNCCL2(store, rank, size, options, device)
        else:
            backend = dist.ProcessGroupNCCL(store, rank, size, options)
        connect = getattr(backend, "eager_connect_single_device", None)
        if connect is not None:  # the communicator now, so that a failure shows here and not in the job's first op
            connect(device)
    else:
        backend = dist.ProcessGroupGloo(store, rank, size, timeout)
    info["pg_options_override"] = None
    with aborting_shrinks(wake_nccl_proxy):
        return c10d._finalize_shrunk_group(info, excluded, backend)


def _timeout_of(group: Any, device: Any) -> timedelta:
    """``group``'s collective timeout on ``device`` (its backend's options), which the group made in its place keeps;
    PyTorch's default for the backend where the options do not say."""
    from torch.distributed import distributed_c10d as c10d

    try:
        timeout = group._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):
        timeout = None
    if isinstance(timeout, timedelta) and timeout.total_seconds() > 0:
        return timeout
    return c10d._get_default_timeout(c10d.Backend.NCCL if device.type == "cuda" else c10d.Backend.GLOO)


def _runs_nccl2(group: Any) -> bool:
    """True if ``group``'s CUDA backend is PyTorch 2.15's ``nccl2`` (``ProcessGroupNCCL2``), not the legacy one."""
    import torch
    import torch.distributed as dist

    nccl2 = getattr(dist, "ProcessGroupNCCL2", None)
    if nccl2 is None:
        return False
    try:
        return isinstance(group._get_backend(torch.device("cuda")), nccl2)
    except RuntimeError:
        return False


def release_aborted_parent(group: Any, wake_nccl_proxy: bool | None = False) -> None:
    """Release the parent of an abortive shrink: drop it from PyTorch's group maps, then ``abort()`` it
    in a thread of its own (:func:`wait_for_releases`).

    Stock ``shrink_group`` destroys the parent (``_finalize_shrunk_group`` ->
    ``_cleanup_original_group`` -> ``destroy_process_group``), on 2.10.0, 2.11.0 and 2.13.0 alike.
    After ``NCCL_SHRINK_ABORT`` that destroy waits for the dead rank: NCCL clears the parent's abort
    flag again, so a kernel enqueued meanwhile waits on the dead peer and ``ncclCommFinalize`` waits
    for it (a DDP job hung 3 of 3 times on stock NCCL 2.30.7 with two ranks on one GPU), and NCCL >=
    2.31.2 adds an untimed barrier to the destroy (pytorch#194679). NCCL's contract is that a
    communicator some rank aborted is released with abort on every rank; pytorch PR #194775 does this.

    The abort runs beside the job, not before the shrunk group is handed over (issue 55): on stock NCCL
    ``ncclCommAbort`` joins the parent's proxy threads, which see the abort only when their 500 ms
    ``poll()`` times out, so a survivor that waited for it started training again up to 0.5 s later.
    The shrunk group shares nothing with the parent (``NCCL_SHRINK_ABORT`` turns resource sharing off),
    and NCCL's group state is per thread, so the abort can overlap the job's next collectives.
    """
    from torch.distributed import distributed_c10d as c10d

    c10d._cleanup_process_group_global_state(group)
    # destroy_process_group also drops a "ptd:" group from the "" tag's list; the cleanup above does
    # not (2.13.0), and a lookup by ranks under the "" tag could hand back the aborted group.
    for pgs in c10d._world.tags_to_pg.values():
        while group in pgs:
            pgs.remove(group)
    release_in_background(group, wake_nccl_proxy)


# The parents being aborted beside the job (release_in_background), and the errors their aborts raised.
_releases: list[threading.Thread] = []
_release_errors: list[str] = []
# What the releases' proxy wakers poked, per (kind, thread id): two releases at once each run a waker, and both
# may poke the same joined thread; it is listed once (released_wakes()).
_release_pokes: dict[tuple[str, int], int] = {}
_releases_lock = threading.Lock()
_release_exit_registered = False
# id(group) -> (group, its release thread): each group is released once.
_released: dict[int, tuple[Any, threading.Thread]] = {}
# How long the interpreter's exit waits for releases still running (an abort left running while the
# interpreter tears down can end the process with a C++ terminate).
RELEASE_EXIT_WAIT_S = 60.0


def release_in_background(group: Any, wake_nccl_proxy: bool | None = False) -> threading.Thread:
    """``group.abort()`` in a daemon thread; the interpreter's exit waits for it (up to
    ``RELEASE_EXIT_WAIT_S``), as does :func:`wait_for_releases`. The job's own thread runs meanwhile: on
    stock NCCL 2.30.7 the survivors' first step came 0.34-0.40 s after the death in 6 of 6 runs, while
    the abort they no longer wait for takes up to 0.5 s (docs/records/2026-11-28-hsdp-rejoin-four-h100.md, issue 55).

    Yet the job can wait for it. Over NCCL's network on one H100 (NCCL 2.28.9, 11 + 11 train-shrink runs) the
    verdict and the rebuilt group were ready 0.12 s after the death, but the survivor's blocked step raised only
    0.33 s (PyTorch's settings) and 0.59 s (the flavor's) after it, median: near the parent's 0.5 s abort (what
    it waits on was not traced; docs/records/2026-12-06-peer-loss-net-one-h100.md, run G). With
    ``wake_nccl_proxy`` (None: :func:`torch_peer_watcher.proxywake.by_default`) the abort's proxy threads are
    woken as :func:`abort_all` wakes them; what they got is in :func:`released_wakes`."""

    def run() -> None:
        errors: list[str] = []
        # A waker that cannot start (no fd or thread left) says so in woken.errors and the abort runs all the same.
        with waking_proxies(wake_nccl_proxy) as woken:
            try:
                group.abort()
            except Exception as exc:  # recorded: the group is out of every map, nothing else can act on it
                errors.append(f"{type(exc).__name__}: {exc}")
        with _releases_lock:
            _release_errors.extend(errors)
            if woken is not None:  # what it poked even where the abort raised
                for key, n in woken.pokes.items():
                    _release_pokes[key] = _release_pokes.get(key, 0) + n
                _release_errors.extend(f"waking NCCL's proxy threads: {e}" for e in woken.errors)

    global _release_exit_registered
    with _releases_lock:
        earlier = _released.get(id(group))
        if earlier is not None and earlier[0] is group:  # once: a rebuild starts it before the group is replaced
            return earlier[1]
        thread = threading.Thread(target=run, name="torch_peer_watcher-release", daemon=True)
        _released[id(group)] = (group, thread)
        if not _release_exit_registered:
            _release_exit_registered = True
            atexit.register(wait_for_releases, RELEASE_EXIT_WAIT_S)
        _releases[:] = [t for t in _releases if t.is_alive()]
        _releases.append(thread)
    thread.start()
    return thread


def _reset_releases_in_child() -> None:
    """A forked child has none of its parent's release threads; a fork while one held the lock left it held."""
    global _releases_lock
    _releases_lock = threading.Lock()
    _releases.clear()


os.register_at_fork(after_in_child=_reset_releases_in_child)


def released_wakes() -> list[str]:
    """The proxy threads the background releases woke so far, as "service:TID xN" (:func:`release_in_background`)."""
    with _releases_lock:
        return [f"{kind}:{tid} x{n}" for (kind, tid), n in _release_pokes.items()]


def wait_for_releases(timeout_s: float | None = None) -> list[str]:
    """Wait until every parent released in the background is aborted (at most ``timeout_s`` in all);
    returns the errors their aborts raised, and the names of those still running after the wait."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    with _releases_lock:
        running = list(_releases)
    for thread in running:
        thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
    with _releases_lock:
        _releases[:] = [t for t in _releases if t.is_alive()]
        left = [f"{t.name} still running" for t in _releases]
        return [*_release_errors, *left]


_shrink_scope = threading.local()
_seam_lock = threading.Lock()


def shrink_seam_missing() -> str | None:
    """Why this PyTorch's ``shrink_group`` cannot be made to abort its parent, or None if it can.

    The seam is ``distributed_c10d._cleanup_original_group(target_pg, is_default_group)``, which
    ``_finalize_shrunk_group`` calls by its module-level name (2.10.0, 2.11.0, 2.13.0).
    """
    import torch
    from torch.distributed import distributed_c10d as c10d

    finalize = getattr(c10d, "_finalize_shrunk_group", None)
    if getattr(c10d, "_cleanup_original_group", None) is None or finalize is None \
            or "_cleanup_original_group" not in finalize.__code__.co_names \
            or not hasattr(c10d, "_cleanup_process_group_global_state"):  # fmt: skip
        return f"PyTorch {torch.__version__}'s shrink_group has no _finalize_shrunk_group -> _cleanup_original_group step"
    return None


@contextmanager
def aborting_shrinks(wake_nccl_proxy: bool | None = False) -> Iterator[None]:
    """Inside, a ``shrink_group`` called by this thread aborts its parent instead of destroying it (waking the
    abort's proxy threads with ``wake_nccl_proxy``: :func:`release_in_background`).

    Installs (once per process) a wrapper around ``distributed_c10d._cleanup_original_group`` that
    calls :func:`release_aborted_parent` for the watcher's own shrinks (this thread, inside this
    block) and PyTorch's original for every other caller. Raises ``RuntimeError`` where the seam is
    missing (:func:`shrink_seam_missing`): shrinking there could hang in the parent's destroy.
    """
    from torch.distributed import distributed_c10d as c10d

    why = shrink_seam_missing()
    if why is not None:
        raise RuntimeError(f"cannot shrink without destroying the parent: {why}")
    with _seam_lock:
        current = c10d._cleanup_original_group
        if not getattr(current, "_torch_peer_watcher", False):
            original = current

            def cleanup_original_group(target_pg: Any, *args: Any, **kwargs: Any) -> None:
                if getattr(_shrink_scope, "active", False):
                    release_aborted_parent(target_pg, getattr(_shrink_scope, "wake", False))
                else:
                    original(target_pg, *args, **kwargs)

            cleanup_original_group._torch_peer_watcher = True  # type: ignore[attr-defined]
            c10d._cleanup_original_group = cleanup_original_group
    outer = (getattr(_shrink_scope, "active", False), getattr(_shrink_scope, "wake", False))
    _shrink_scope.active, _shrink_scope.wake = True, wake_nccl_proxy
    try:
        yield
    finally:  # a nested scope hands the outer one back its own (its shrinks still abort their parents)
        _shrink_scope.active, _shrink_scope.wake = outer
