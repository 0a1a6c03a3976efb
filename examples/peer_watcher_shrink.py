"""Recovery without a new rendezvous: shrink (docs/howto/survive-a-dead-rank.md, "The peer watcher").

Start one process per rank with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (and LOCAL_RANK on GPUs) set;
NCCL where CUDA is visible, else gloo. Every rank all-reduces ones in a group of all ranks, watched with
``recovery="shrink"``. When a rank dies the survivors raise PeerLostError, take the group the watcher's
shrink made and train on in it (STEPS all-reduces in all, then exit 0); a cut-off rank exits 3. Where the
backend cannot shrink (gloo) the group is aborted instead: the survivors say why and exit 4.
"""

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch_peer_watcher as tpw

on_gpu = torch.cuda.is_available()
device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if on_gpu else torch.device("cpu")
dist.init_process_group("nccl" if on_gpu else "gloo")
rank, steps = dist.get_rank(), int(os.environ.get("STEPS", "1000000"))
watcher = tpw.start()
group = dist.new_group(list(range(dist.get_world_size())))
t = torch.ones(1024, device=device)
step = 0


def one_step() -> bool:
    """One all_reduce of ones in ``group``; whether there are steps left."""
    global step
    t.fill_(1.0)
    dist.all_reduce(t, group=group)
    assert t[0].item() == dist.get_world_size(group), (t[0].item(), dist.get_world_size(group))
    if step % 100 == 0:
        print(f"rank {rank} step {step} group of {dist.get_world_size(group)}", flush=True)
    step += 1
    return step < steps


watcher.watch(group, recovery="shrink")   # every member
training = True
try:
    with watcher.guard(group):
        while training:
            watcher.raise_if_lost(group)  # a verdict between two steps stops before the next op
            dist.all_reduce(t, group=group)
            training = one_step()
except tpw.PartitionedError:              # cut off: the other side has the store and goes on
    sys.exit(3)                           # write nothing shared
except tpw.PeerLostError as exc:          # exc.ranks: the lost global ranks
    group = watcher.shrunk(group, timeout_s=60)   # the survivors' group (None: the shrink failed)
    if group is None:
        print(f"rank {rank} lost {list(exc.ranks)}: no shrink, the group is aborted: {exc.loss.errors}", flush=True)
        # The store lives in rank 0's process: a survivor still judging the loss without it would take itself
        # for the cut-off side. Rank 0 leaves once the others have stopped too.
        store = dist.distributed_c10d._get_default_store()
        store.set(f"stopped/{rank}", "1")
        if rank == 0:
            survivors = [r for r in range(dist.get_world_size()) if r not in exc.ranks]
            store.wait([f"stopped/{r}" for r in survivors], timedelta(seconds=60))
        os._exit(4)  # the world holds the dead rank: its destructor could wait on it
    print(f"rank {rank} lost {list(exc.ranks)}: on in a group of {dist.get_world_size(group)}", flush=True)


def train_step() -> None:
    """The rest of the steps, in the survivors' group."""
    while one_step():
        watcher.raise_if_lost(group)


def recover() -> None:
    """A second loss: this example stops (a job would shrink again, or build a fresh group)."""
    print(f"rank {rank}: another rank lost", flush=True)
    os._exit(5)


try:
    with watcher.guard(group):
        train_step()
except tpw.PartitionedError:              # cut off: the other side has the store and goes on
    sys.exit(3)                           # write nothing shared
except tpw.PeerLostError:
    recover()                             # the store's side: shrink, or a fresh group
print(f"rank {rank} done at step {step}", flush=True)
os._exit(0)  # the world still holds the dead rank (a shrunk job): its destructor could wait on it
