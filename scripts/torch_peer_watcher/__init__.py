"""torch_peer_watcher: notice a dead or stuck torch.distributed peer in milliseconds and abort exactly
the process groups that contain it, so their blocked collectives raise in Python.

    import torch.distributed as dist, torch_peer_watcher as tpw
    dist.init_process_group("nccl")
    watcher = tpw.start()                      # every rank; watches the default group
    group = dist.new_group([0, 1]); watcher.watch(group)   # every member
    watcher.on_peer_lost(lambda loss: print(loss))
    with watcher.guard(group):                 # PyTorch's error becomes PeerLostError
        dist.all_reduce(t, group=group)
    # Caught a DistBackendError without guard()? Before this thread creates a new group:
    tpw.close_leaked_groups()                  # what a failed send/recv left open (ncclgroups)
    watcher.stop(); dist.destroy_process_group()
    # Or, after a loss, to build a new world without the dead rank: stop, abort every group (proxies woken)
    tpw.leave_world()

``TORCH_PEER_WATCHER=1`` does all of this by itself (see :mod:`torch_peer_watcher.autostart`).
Stock PyTorch >= 2.6; importing this package does not import torch. Import it before
``init_process_group``: every process group made after the import is made under the settings of
PyTorch's NCCL watchdog that let a process outlive a peer (:mod:`torch_peer_watcher.watchdog`).
docs/explain/peer-watcher.md ("The peer watcher") gives the limits.
"""

import importlib
from typing import Any

from torch_peer_watcher import watchdog as _watchdog

_watchdog.install()

# Loaded on first use (PEP 562): the .pth auto-start hook imports this package at every Python start
# in an environment with TORCH_PEER_WATCHER=1, and needs none of it until init_process_group.
_EXPORTS = {
    "PeerLoss": "losses",
    "PeerLostError": "losses",
    "PartitionedError": "losses",
    "PeerWatcher": "watcher",
    "WatcherError": "losses",
    "current": "watcher",
    "start": "watcher",
    "stop": "watcher",
    "WatcherConfigError": "settings",
    "WatcherSettings": "settings",
    "close_leaked_groups": "ncclgroups",
    "leave_world": "world",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'torch_peer_watcher' has no attribute {name!r}")
    return getattr(importlib.import_module(f"torch_peer_watcher.{_EXPORTS[name]}"), name)
