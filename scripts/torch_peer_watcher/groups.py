"""Process groups as the watcher sees them: members (global ranks), backends, and how to abort one.

Stock PyTorch >= 2.6 API only. Aborting is what makes a collective blocked on a dead peer raise in
Python: for NCCL, the backend's ``abort()`` (``ncclCommAbort``) through
``distributed_c10d._abort_process_group``, which also drops the group from PyTorch's bookkeeping;
for the default group, ``ProcessGroup.abort()`` (torch >= 2.7) or its NCCL backend's ``abort()``
(2.6), because ``_abort_process_group`` on the default group would tear down every group, those
without the dead peer too. gloo has no abort (``Backend::abort`` is empty up to 2.13 at least):
the watcher cuts its sockets to the dead peer instead (:mod:`torch_peer_watcher.sockets`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class WatchedGroup:
    """A process group this process belongs to, and what the watcher needs to know about it."""

    group: Any
    name: str
    ranks: frozenset[int]
    backends: tuple[str, ...]
    is_default: bool

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


def describe(group: Any) -> WatchedGroup:
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
    """Abort ``watched``'s communicators so that work blocked in them raises; say what was done."""
    from torch.distributed import distributed_c10d as c10d

    group = watched.group
    nccl = _nccl_backend(group)
    has_abort = hasattr(group, "abort")
    if nccl is None and not has_abort:
        return "no abort API for this backend in this PyTorch"
    if watched.is_default:
        if has_abort:
            group.abort()
        else:
            nccl.abort()
        return "aborted (default group: its own communicators only)"
    if group not in c10d._world.pg_map:
        return "already destroyed"
    c10d._abort_process_group(group)
    return "aborted"
