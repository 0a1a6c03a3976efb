"""Package test, one rank of `mpiexec -n 2 python tests/mpi_smoke.py`: exact collectives over cudampi.

torch.distributed's ranks come from the MPI launcher's variables (MPICH/Hydra's PMI_RANK, Open MPI's
OMPI_COMM_WORLD_RANK); the backend itself refuses to start if they disagree with MPI's own ranks.
"""

import os
from datetime import timedelta

import torch
import torch.distributed as dist

import torch_mpi_backend

rank = int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
world = int(os.environ.get("PMI_SIZE", os.environ.get("OMPI_COMM_WORLD_SIZE", "1")))
# A fixed port on loopback: the package test runs on one node, ranks rendezvous there.
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29531")
dist.init_process_group(torch_mpi_backend.BACKEND, rank=rank, world_size=world, timeout=timedelta(seconds=120))

mine = torch.arange(1000, dtype=torch.int64) * (rank + 1)
total = mine.clone()
dist.all_reduce(total)
assert torch.equal(total, torch.arange(1000, dtype=torch.int64) * (world * (world + 1) // 2)), total[:4]

gathered = [torch.empty_like(mine) for _ in range(world)]
dist.all_gather(gathered, mine)
for peer, got in enumerate(gathered):
    assert torch.equal(got, torch.arange(1000, dtype=torch.int64) * (peer + 1)), (peer, got[:4])

# The two flat-tensor collectives the registration module adds to PyTorch's MPI process group.
flat = torch.empty(1000 * world, dtype=torch.int64)
dist.all_gather_into_tensor(flat, mine)
assert torch.equal(flat, torch.cat([torch.arange(1000, dtype=torch.int64) * (p + 1) for p in range(world)])), flat[:4]
block = torch.empty(1000, dtype=torch.int64)
dist.reduce_scatter_tensor(block, flat)
assert torch.equal(block, flat[rank * 1000 : (rank + 1) * 1000] * world), block[:4]

value = torch.full((17,), float(rank), dtype=torch.float64)
dist.broadcast(value, src=world - 1)
assert torch.equal(value, torch.full((17,), float(world - 1), dtype=torch.float64)), value

dist.barrier()
if rank == 0:
    print(f"cudampi: all_reduce, all_gather(_into_tensor), reduce_scatter_tensor, broadcast exact on {world} ranks over {torch_mpi_backend.mpi_library_version().splitlines()[0]}")
dist.destroy_process_group()
