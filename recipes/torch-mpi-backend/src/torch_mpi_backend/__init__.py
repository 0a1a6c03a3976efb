"""PyTorch's own MPI process group, compiled out of tree for a stock PyTorch, as the backend ``cudampi``.

Importing this module registers the backend with ``torch.distributed`` for CPU and CUDA tensors::

    import torch.distributed as dist
    import torch_mpi_backend  # noqa: F401  (registers "cudampi")

    dist.init_process_group("cudampi")  # under mpiexec/srun, with RANK/WORLD_SIZE/MASTER_ADDR set

The code that moves the data is PyTorch's ``ProcessGroupMPI.cpp`` of exactly the installed version,
with the channel's cuda-aware-mpi series: CUDA tensors go straight to MPI where the MPI says it can
take them (Open MPI built with CUDA, MPICH with GPU support, Cray MPICH with
``MPICH_GPU_SUPPORT_ENABLED=1``); otherwise they raise "CUDA tensor detected and the MPI used doesn't
have CUDA-aware MPI support". ``torch.distributed.is_mpi_available()`` keeps describing the built-in
``mpi`` backend, so it stays False.
"""

from __future__ import annotations

import atexit
from typing import Any

import torch  # loads libtorch before the extension that links it
import torch.distributed as dist

BACKEND = "cudampi"
DEVICES = ("cpu", "cuda")

if dist.is_mpi_available():
    # A PyTorch built with MPI already carries c10d::ProcessGroupMPI; a second copy of the same C++
    # class in one process is undefined behaviour, and the built-in backend does the same job.
    raise ImportError(
        f"torch {torch.__version__} has the MPI backend built in: use "
        'torch.distributed.init_process_group("mpi") instead of torch_mpi_backend'
    )

# SOURCE_VERSION: the PyTorch release whose ProcessGroupMPI.cpp this build compiled (for torch 2.11.0:
# 2.6.0's file with the reconstructed torch-2.11-compat series; docs/howto/mpi-without-a-rebuild.md).
from torch_mpi_backend._built_against import SOURCE_VERSION, TORCH_GIT_VERSION, TORCH_VERSION  # noqa: E402

if torch.version.git_version != TORCH_GIT_VERSION:
    # The C++ ABI of c10d and ATen changes between releases; loading _C anyway fails with an
    # undefined symbol at best and corrupts memory at worst.
    raise ImportError(
        f"torch_mpi_backend was compiled against torch {TORCH_VERSION} ({TORCH_GIT_VERSION}), "
        f"but torch {torch.__version__} ({torch.version.git_version}) is installed: install the "
        "torch-mpi-backend build made for this torch, or rebuild it against this one"
    )

# composed_collectives(): which all_reduce calls a group created now composes from
# MPI's all-to-all and all-gather (CUDAMPI_COMPOSED: "cuda", the default, "all", "none" or "auto",
# which composes CUDA tensors of more than composed_above() bytes, CUDAMPI_COMPOSED_ABOVE;
# docs/records/2026-11-25-cudampi-one-h100.md, "The fix").
# profile_records(): with CUDAMPI_PROFILE=1 when a group was created, one dict per all_reduce of
# it: path ("composed" or "mpi_allreduce"), device, bytes, ranks, total_s and its phases (name,
# start_s, wall_s, device_s); profile_reset() drops them (docs/howto/mpi-without-a-rebuild.md, "Where a call's
# time goes").
from torch_mpi_backend._C import (  # noqa: E402
    composed_above,
    composed_collectives,
    create_backend,
    drain,
    mpi_library_version,
    profile_records,
    profile_reset,
)

# Every group's worker finishes its queue while the interpreter is whole (register.cpp, drainAll: a group
# destroyed during the interpreter's teardown could end the process with std::terminate).
atexit.register(drain)

__all__ = [
    "BACKEND",
    "DEVICES",
    "SOURCE_VERSION",
    "composed_above",
    "composed_collectives",
    "create_backend",
    "mpi_library_version",
    "profile_records",
    "profile_reset",
]


def _create(options: Any, _backend_options: Any) -> Any:
    """The creator torch.distributed calls for each group that uses ``cudampi`` (extended API)."""
    ranks = sorted(options.global_ranks_in_group)
    # No ranks means the default group. A group of every rank is the world too: it may start MPI,
    # which only a call that every process makes can do.
    whole_world = not ranks or ranks == list(range(dist.get_world_size()))
    return create_backend(ranks, options.group_rank, options.group_size, whole_world)


if not hasattr(dist.Backend, BACKEND.upper()):
    dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=list(DEVICES))
