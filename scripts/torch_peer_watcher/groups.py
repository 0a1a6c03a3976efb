"""Process groups as the watcher sees them: members (global ranks), backends, and how to recover one.

Stock PyTorch >= 2.6 API only. Aborting is what makes a collective blocked on a dead peer raise in
Python: ``ProcessGroup.abort()`` (torch >= 2.7) or the NCCL backend's ``abort()`` (2.6), which
runs ``ncclCommAbort``. The group stays registered, so later ops on it raise the backend's error
too; ``distributed_c10d._abort_process_group`` is not used, since it also drops the group from the
world map and an op issued after it raised ``ValueError`` (issue 20). gloo has no abort
(``Backend::abort`` is empty up to 2.13 at least): the watcher cuts its sockets to the dead peer
instead (:mod:`torch_peer_watcher.sockets`). Shrinking (:func:`shrink`) replaces the abort for
groups watched with ``recovery="shrink"``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


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
    return WatchedGroup(
        group=group,
        name=str(getattr(group, "group_name", "") or id(group)),
        ranks=frozenset(dist.get_process_group_ranks(group)),
        backends=backend_names(str(dist.get_backend(group))),
        is_default=group is default,
        recovery=recovery,
    )


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
    if hasattr(group, "abort"):
        group.abort()
        return "aborted"
    nccl = _nccl_backend(group)
    if nccl is None:
        return "no abort API for this backend in this PyTorch"
    nccl.abort()
    return "aborted"


def shrink_unsupported(group: Any) -> str | None:
    """Why ``shrink_group`` cannot shrink ``group`` in this PyTorch, or None if it can."""
    import torch
    from torch.distributed import distributed_c10d as c10d

    if not hasattr(c10d, "shrink_group") or not hasattr(c10d, "SHRINK_ABORT"):
        return f"PyTorch {torch.__version__} has no torch.distributed.distributed_c10d.shrink_group with SHRINK_ABORT"
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


def shrink(watched: WatchedGroup, lost: list[int]) -> Any:
    """``shrink_group`` of ``watched`` without the ``lost`` global ranks, aborting its pending work.

    ``SHRINK_ABORT`` (NCCL's ``NCCL_SHRINK_ABORT``) ends the work still blocked on the dead peer,
    so the caller does not abort the group first (an aborted NCCL communicator cannot be shrunk).
    """
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    why = shrink_unsupported(watched.group)
    if why is not None:
        raise RuntimeError(f"cannot shrink: {why}")
    group_ranks = [dist.get_group_rank(watched.group, rank) for rank in lost]
    return c10d.shrink_group(group_ranks, group=watched.group, shrink_flags=c10d.SHRINK_ABORT)
