"""A DDP job that loses a rank and trains on (docs/howto/survive-a-dead-rank.md, "A DDP job that loses a rank").

Start one process per rank with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (and LOCAL_RANK on GPUs) set,
as `srun` does through a wrapper or a shell loop does by hand; not under `torchrun`, whose agent stops
every worker when one dies. The rendezvous store lives in rank 0's process (env://), so rank 0 must live.
On GPUs (NCCL) the watcher shrinks the group; on CPU (gloo, which cannot shrink in torch 2.13) it aborts
the group and the survivors build a fresh one on the same store.
"""

import argparse
import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch_peer_watcher
from torch.nn.parallel import DistributedDataParallel as DDP

GLOBAL_BATCH = 48  # rows per step whatever the world size: rank r of W takes rows r::W


def make_model(width):
    torch.manual_seed(0)  # every rank starts from the same weights
    return torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.ReLU(), torch.nn.Linear(4 * width, width))


def global_batch(step, width):
    """Step ``step``'s rows, drawn from the step alone: the survivors share the lost rank's rows."""
    rows = torch.Generator().manual_seed(step)
    x = torch.randn(GLOBAL_BATCH, width, generator=rows)
    return x, torch.sin(x)


def fresh_group(members, device):
    """The survivors' own group on the job's store: not split from the world, which holds the dead rank."""
    rank, size = members.index(dist.get_rank()), len(members)
    store = dist.PrefixStore("fresh/" + "-".join(map(str, members)) + "/", dist.distributed_c10d._get_default_store())
    if device.type == "cuda":
        backend, kind = dist.ProcessGroupNCCL(store, rank, size), dist.ProcessGroup.BackendType.NCCL
    else:
        backend = dist.ProcessGroupGloo(store, rank, size, timedelta(seconds=60))
        kind = dist.ProcessGroup.BackendType.GLOO
    group = dist.ProcessGroup(store, rank, size)
    group._register_backend(device, kind, backend)
    group._set_default_backend(kind)
    return group


def share_state(group, opt, step, device):
    """From the new group's rank 0: the momentum and the step to resume at (DDP broadcasts the parameters).
    A survivor that applied the step the others redo takes the same state as they do."""
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    for p in opt.param_groups[0]["params"]:
        buf = opt.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
        group.broadcast([buf], opts).wait()
    at = torch.tensor([float(step)], device=device)
    group.broadcast([at], opts).wait()
    return int(at.item())


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40, help="training steps (default 40)")
    p.add_argument("--width", type=int, default=256, help="the model's hidden width (default 256)")
    p.add_argument("--save", help="write each rank's final parameters here ({rank} is replaced)")
    args = p.parse_args()

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)  # current_stream() below is this rank's GPU's
        dist.init_process_group("nccl", device_id=device)  # bound: shrink needs it
    else:
        dist.init_process_group("gloo")
    members = list(range(dist.get_world_size()))
    group = dist.new_group(members)
    watcher = torch_peer_watcher.start(watch_world=False)  # only `group` carries the training
    watcher.watch(group, recovery="shrink" if on_gpu else "abort")
    net = make_model(args.width).to(device)
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    ids = [local_rank] if on_gpu else None
    model = DDP(net, process_group=group, device_ids=ids)

    def train_step(step):
        x, y = global_batch(step, args.width)
        x, y = x[group.rank() :: group.size()].to(device), y[group.rank() :: group.size()].to(device)
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()  # DDP's bucket all_reduce, enqueued
        if on_gpu:
            torch.cuda.current_stream().synchronize()  # the gradients' all_reduce has ended ...
        watcher.raise_if_lost(group)  # ... and no member died meanwhile:
        opt.step()  # a gradient an abort cut short never lands here
        return loss.item()

    step = 0
    while step < args.steps:
        try:
            with watcher.guard(group):  # the op's error becomes PeerLostError
                watcher.raise_if_lost(group)
                loss = train_step(step)
            print(f"rank {dist.get_rank()} step {step} world {group.size()} loss {loss:.6f}", flush=True)
            step += 1
        except torch_peer_watcher.PeerLostError as exc:
            members = [m for m in members if m not in exc.ranks]
            group = watcher.shrunk(group, timeout_s=60) if on_gpu else fresh_group(members, device)
            if group is None:
                raise SystemExit(f"the shrink failed: {exc.loss.errors}") from exc
            print(f"rank {dist.get_rank()} lost rank {exc.loss.rank}: on with {group.size()} ranks", flush=True)
            model = DDP(net, process_group=group, device_ids=ids)  # broadcasts from the group's rank 0
            step = share_state(group, opt, step, device)  # the step that failed is done again

    if args.save:
        torch.save(net.state_dict(), args.save.format(rank=dist.get_rank()))
    watcher.stop()
    print(f"rank {dist.get_rank()} done", flush=True)
    # After a loss the world still holds the dead rank; its destructor could wait on it: exit without it.
    os._exit(0)


if __name__ == "__main__":
    main()
