"""SwitchML in-network aggregation as a ``torch.distributed`` backend for a stock PyTorch 2.x.

Importing this module registers the backend ``switchml`` for CPU and CUDA tensors::

    import torch.distributed as dist
    import torch_switchml  # noqa: F401  (registers "switchml")

    dist.init_process_group("switchml", rank=rank, world_size=world_size, init_method=...)

An allreduce with ``ReduceOp.SUM`` of one dense float32 or int32 tensor per process runs on
SwitchML, configured by the first of /etc/switchml.cfg, ./switchml.cfg and ./switchml-<hostname>.cfg
(its ``rank`` and ``num_workers`` must match the PyTorch rank and world size). Every other
collective, op or dtype runs on a gloo backend created for the same group. Without a configuration
file the group warns once and runs everything on gloo. This is the out-of-tree counterpart of the
pytorch-switchml build (PyTorch 1.7.1 with a patched ProcessGroupGloo): no PyTorch rebuild.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch  # loads libtorch before the extension that links it
import torch.distributed as dist

from torch_switchml._built_against import TORCH_GIT_VERSION, TORCH_VERSION

if torch.version.git_version != TORCH_GIT_VERSION:
    # c10d's C++ classes have no stable ABI across releases: loading _C against another torch fails
    # with an undefined symbol at best and corrupts memory at worst.
    raise ImportError(
        f"torch_switchml was compiled against torch {TORCH_VERSION} ({TORCH_GIT_VERSION}), but "
        f"torch {torch.__version__} ({torch.version.git_version}) is installed: install the "
        "torch-switchml build made for this torch, or rebuild it against this one"
    )

from torch_switchml._C import config_file, create_backend, uses_switchml  # noqa: E402

BACKEND = "switchml"
DEVICES = ("cpu", "cuda")

__all__ = ["BACKEND", "DEVICES", "config_file", "uses_switchml"]


def _create(store: Any, rank: int, size: int, timeout: timedelta) -> Any:
    """The creator torch.distributed calls for each group on ``switchml``."""
    gloo = dist.ProcessGroupGloo(store, rank, size, timeout)
    return create_backend(gloo, rank, size)


if not hasattr(dist.Backend, BACKEND.upper()):
    dist.Backend.register_backend(BACKEND, _create, devices=list(DEVICES))
