"""The peer watcher's minimal use (docs/howto/survive-a-dead-rank.md, "The peer watcher").

Start one process per rank with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (and LOCAL_RANK on GPUs) set.
Every rank all-reduces in a loop; when a peer of the group dies, the all-reduce raises PeerLostError
within about a second instead of waiting out the group's timeout.
"""

import os

import torch
import torch.distributed as dist
import torch_peer_watcher as tpw

on_gpu = torch.cuda.is_available()
device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if on_gpu else torch.device("cpu")
dist.init_process_group("nccl" if on_gpu else "gloo")
watcher = tpw.start()  # every rank, after init_process_group; watches the default group
group = dist.new_group([0, 1])
watcher.watch(group)  # every member of the group, like new_group
watcher.on_peer_lost(lambda loss: print(f"rank {dist.get_rank()}: {loss}", flush=True))  # rank, cause, timings
t = torch.ones(1024, device=device)
try:
    with watcher.guard(group):  # the backend's error becomes PeerLostError (loss attached)
        for i in range(int(os.environ.get("ALL_REDUCES", "1000000"))):
            dist.all_reduce(t, group=group)
            t.fill_(1.0)
            if i % 100 == 0:
                print(f"rank {dist.get_rank()} all_reduce {i}", flush=True)
except tpw.PeerLostError as exc:
    # the group is aborted: a job would build a new one here (examples/ddp_recovery.py)
    print(f"rank {dist.get_rank()} PeerLostError: {exc}", flush=True)
    os._exit(3)  # the world holds the dead rank: its destructor could wait on it
rank = dist.get_rank()
watcher.stop()  # says goodbye: the peers abort nothing
dist.destroy_process_group()
print(f"rank {rank} done", flush=True)
