"""Leave the default world after a loss, as ranks that build a new world without the dead rank do (an HSDP replica
that takes a replacement back: examples/hsdp_recovery.py).

``distributed_c10d._abort_process_group()`` aborts every process group (never destroy one that holds a dead rank:
its teardown waits for that rank). On stock NCCL each communicator's abort joins its proxy threads, which see the
abort only when their 500 ms ``poll()`` ends: measured on one H100 with the wheel's NCCL 2.28.9, the HSDP rejoin's
``leave_old`` took 0.52 s against 0.02 s on the channel's NCCL. :func:`leave_world` wakes those threads as the
watcher's own aborts do (:mod:`torch_peer_watcher.proxywake`).
"""

from __future__ import annotations

import os

from torch_peer_watcher import groups as groups_mod
from torch_peer_watcher import watcher as watcher_mod
from torch_peer_watcher.proxywake import Woken, waking_proxies
from torch_peer_watcher.settings import wake_nccl_proxy_from_env


def leave_world() -> Woken | None:
    """Stop this process's watcher (it first waits for the aborts it is making), then abort every process group
    of the default world, NCCL's proxy threads woken where the waker runs: a loaded NCCL release it was proven on,
    or ``TORCH_PEER_WATCHER_WAKE_NCCL_PROXY`` (1 always, 0 never; the running watcher's own setting where one
    runs). Does nothing more where no world is initialized (a replacement that never joined the old one).
    PyTorch 2.6's world abort does nothing without an NCCL backend (it warns so): a gloo world stays initialized.
    Returns what the waker did (None where it did not run); warns of what it could not do. A store object
    the new world meets on (rank 0's server) must be kept by the caller: the abort drops the world's."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    running = watcher_mod.current()
    # Read before anything is stopped (a bad value raises WatcherConfigError with nothing changed); only this one
    # setting: the watcher's other variables are no concern of a process leaving its world.
    asked = running.settings.wake_nccl_proxy if running is not None else wake_nccl_proxy_from_env(os.environ)
    watcher_mod.stop()
    if not dist.is_initialized():
        return None
    try:  # unasked, the waker runs only where some group has an NCCL communicator
        wake = groups_mod.waker_setting([groups_mod.describe(group) for group in list(c10d._world.pg_map)], asked)
    except Exception:  # noqa: BLE001 (a group PyTorch cannot describe must not keep the world from its abort)
        wake = asked  # the waker's own default decides
    with waking_proxies(wake) as woken:
        c10d._abort_process_group()
    groups_mod.warn_of_waker(woken)
    return woken
