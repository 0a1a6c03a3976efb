"""One rank per GPU, as on a Derecho node (`mpiprocs=4:ngpus=4`): `mpiexec -n 4 python cuda_allreduce.py`.

Each rank all-reduces CUDA tensors on its own GPU through cudampi (the MPI backend) and checks the sum
exactly on every rank: int64 and float32 (values small enough to be exact), an element count the world
size divides and one it does not (the composed all_reduce pads that one). Every rank prints one line;
exit 1 on a wrong sum, 2 when the node has fewer GPUs than the launcher put ranks on it (nothing is run).
Ranks and local ranks come from the MPI launcher (MPICH/Hydra's PMI_*, Open MPI's OMPI_COMM_WORLD_*, Cray
PALS_*); MASTER_ADDR/MASTER_PORT default to loopback and a fixed port for a one-node job.
"""

import os
import sys
from datetime import timedelta


def _first(names: list[str], default: str) -> int:
    for name in names:
        if os.environ.get(name):
            return int(os.environ[name])
    return int(default)


rank = _first(["PMI_RANK", "OMPI_COMM_WORLD_RANK", "PALS_RANKID"], "0")
world = _first(["PMI_SIZE", "OMPI_COMM_WORLD_SIZE"], "1")
local_rank = _first(["MPI_LOCALRANKID", "PMI_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "PALS_LOCAL_RANKID"], str(rank))
local_size = _first(["MPI_LOCALNRANKS", "PMI_LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"], str(world))

import torch  # noqa: E402  (after the launcher's variables: a bad launch is reported without torch's import time)

gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
if gpus < local_size:
    print(f"cuda_allreduce: rank {rank}: {local_size} ranks on this node but {gpus} GPU(s) visible; "
          "hint: start one rank per GPU (mpiexec -n <GPUs per node>) on a GPU node", file=sys.stderr)  # fmt: skip
    sys.exit(2)

import torch.distributed as dist  # noqa: E402

import torch_mpi_backend  # noqa: E402

os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29533")
torch.cuda.set_device(local_rank)
device = torch.device("cuda", local_rank)
dist.init_process_group(torch_mpi_backend.BACKEND, rank=rank, world_size=world, timeout=timedelta(seconds=120))

wrong = []
# 1 << 22 elements divide by any world size up to 4; 1 << 20 + 3 does not divide by 2 or 4.
for count in (1 << 22, (1 << 20) + 3):
    for dtype in (torch.int64, torch.float32):
        base = torch.arange(count, device=device, dtype=torch.int64) % 1000
        tensor = (base * (rank + 1)).to(dtype)
        dist.all_reduce(tensor)
        torch.cuda.synchronize()
        expected = (base * (world * (world + 1) // 2)).to(dtype)
        if not torch.equal(tensor, expected):
            bad = int((tensor != expected).sum())
            wrong.append(f"{dtype} x {count}: {bad} elements differ")

name = torch.cuda.get_device_name(device)
if wrong:
    print(f"cuda_allreduce: rank {rank}/{world} on cuda:{local_rank} ({name}): WRONG: {'; '.join(wrong)}", flush=True)
else:
    print(f"cuda_allreduce: rank {rank}/{world} on cuda:{local_rank} ({name}): all_reduce exact "
          "(int64, float32; 4194304 and 1048579 elements)", flush=True)  # fmt: skip
dist.destroy_process_group()
sys.exit(1 if wrong else 0)
