"""docs/reference/switchml.md, "torch-switchml": a process group over the switchml backend, one all_reduce.

One process per rank with RANK and WORLD_SIZE (default: one rank), MASTER_ADDR and MASTER_PORT (default
127.0.0.1:29500) set; switchml.cfg in the working folder (without it: a warning, and gloo does everything).
"""
# needs: switchml

import os

import torch

rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
where = f"{os.environ.get('MASTER_ADDR', '127.0.0.1')}:{os.environ.get('MASTER_PORT', '29500')}"
import torch.distributed as dist, torch_switchml
dist.init_process_group("switchml", rank=rank, world_size=world_size, init_method=f"tcp://{where}")
t = torch.ones(16)
dist.all_reduce(t)
print(f"rank {rank}: all_reduce {t[0].item():g}, SwitchML in use: "
      f"{torch_switchml.uses_switchml(dist.group.WORLD._get_backend(torch.device('cpu')))}", flush=True)
assert torch.all(t == world_size)
dist.destroy_process_group()
