"""docs/howto/mpi-without-a-rebuild.md: a process group over the cudampi backend (torch-mpi-backend), one all_reduce.

Run under an MPI launcher: ``mpiexec -n 2 python examples/torch_mpi_backend_init.py``. The ranks come from
MPI; torch's env:// rendezvous still wants RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT, which this example
takes from MPICH's and Open MPI's variables where they are not set (127.0.0.1:29500 on one node).
"""
# needs: mpiexec

import os

for name, mpi in (("RANK", ("PMI_RANK", "OMPI_COMM_WORLD_RANK")), ("WORLD_SIZE", ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE"))):
    os.environ.setdefault(name, next((os.environ[v] for v in mpi if v in os.environ), "0" if name == "RANK" else "1"))
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29500")

import torch
import torch.distributed as dist
import torch_mpi_backend            # registers the backend "cudampi" for cpu and cuda

dist.init_process_group("cudampi")  # under mpiexec / srun, with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set
# or per device: dist.init_process_group("cpu:gloo,cuda:cudampi")
t = torch.full((4,), float(dist.get_rank() + 1))
dist.all_reduce(t)
expected = dist.get_world_size() * (dist.get_world_size() + 1) / 2
print(f"rank {dist.get_rank()} of {dist.get_world_size()} on {dist.get_backend()}: all_reduce {t[0].item():g}", flush=True)
assert torch.all(t == expected), (t, expected)
dist.destroy_process_group()
