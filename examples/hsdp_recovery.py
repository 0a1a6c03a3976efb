"""An HSDP job that loses a rank: the surviving replica trains on alone (docs/pytorch-nccl-fault.md,
"An HSDP job that loses a rank").

Four ranks, FSDP2 on a 2-D mesh ("replicate", "shard") = [[0, 1], [2, 3]]: replica A = ranks 0, 1, replica
B = ranks 2, 3. Start one process per rank with RANK, WORLD_SIZE=4, MASTER_ADDR, MASTER_PORT (and
LOCAL_RANK on GPUs) set, as `srun` does through a wrapper; not under `torchrun`, whose agent stops every
worker when one dies. When a rank of replica B dies, replica A moves its shards onto a 1-D mesh of its
own group and trains on; the live rank of replica B stops (exit 3). Rank 0 hosts the store (env://).
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch_peer_watcher
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

REPLICAS = [[0, 1], [2, 3]]
GLOBAL_BATCH = 48  # rows per step whatever the data-parallel size: data rank r of W takes rows r::W


def make_model(width):
    torch.manual_seed(0)  # every rank starts from the same weights
    return torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.ReLU(), torch.nn.Linear(4 * width, width))


def global_batch(step, width):
    """Step ``step``'s rows, drawn from the step alone: replica A takes over replica B's rows."""
    rows = torch.Generator().manual_seed(step)
    x = torch.randn(GLOBAL_BATCH, width, generator=rows)
    return x, torch.sin(x)


def groups(rank):
    """This rank's shard group (its replica) and replicate group; every rank makes all four, in one order."""
    mine = {}
    for kind, ranks in [("shard", r) for r in REPLICAS] + [("replicate", list(c)) for c in zip(*REPLICAS)]:
        g = dist.new_group(ranks)
        if rank in ranks:
            mine[kind] = g
    return mine["shard"], mine["replicate"]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--save", help="write each survivor's final parameters here ({rank} is replaced)")
    args = p.parse_args()

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)  # current_stream() below is this rank's GPU's
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    shard_g, repl_g = groups(rank)
    watcher = torch_peer_watcher.start()  # the world: every rank hears of every death
    watcher.watch(shard_g)
    watcher.watch(repl_g)
    partners = set(dist.get_process_group_ranks(repl_g))

    def leave_replicate(loss):  # leave the replicas' all-reduce on any loss
        if loss.rank not in partners:  # (the watcher aborted it already if it held the dead rank)
            watcher.abort(repl_g)  # on gloo this also cuts the group's sockets

    watcher.on_peer_lost(leave_replicate)
    mesh = DeviceMesh.from_group([repl_g, shard_g], device.type, mesh=torch.tensor(REPLICAS),
                                 mesh_dim_names=("replicate", "shard"))  # fmt: skip
    model = make_model(args.width).to(device)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def train_step(step, model, opt, watched, row, rows):
        """One step on rows row::rows; no rank of the replica applies it if any rank failed or heard of a loss."""
        try:
            x, y = global_batch(step, args.width)
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.mse_loss(model(x[row::rows].to(device)), y[row::rows].to(device))
            loss.backward()
            if on_gpu:
                torch.cuda.current_stream().synchronize()
            value, failed = loss.item(), False
        except Exception:
            value, failed = float("nan"), True
        # `watched`: None (any loss) while the replicas train together; once alone, the replica's own group,
        # since a loss the replica already survived stays recorded and would stop every later step.
        flag = torch.tensor([float(failed or watcher.lost(watched) is not None)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=shard_g)  # both ranks of a replica agree
        if flag.item():
            raise torch_peer_watcher.PeerLostError(watcher.wait_for_loss(None, 2.0))
        opt.step()
        return value

    step, alone = 0, False
    while step < args.steps:
        try:
            with watcher.guard(shard_g if alone else None):  # an op the loss broke raises PeerLostError
                if alone:
                    loss = train_step(step, model, opt, shard_g, shard_g.rank(), shard_g.size())
                else:
                    loss = train_step(step, model, opt, None, rank, dist.get_world_size())
            print(f"rank {rank} step {step} alone {alone} loss {loss:.6f}", flush=True)
            step += 1
        except torch_peer_watcher.PeerLostError as exc:
            if alone or exc.loss.rank in dist.get_process_group_ranks(shard_g):
                print(f"rank {rank}: replica lost (rank {exc.loss.rank}), this rank stops", flush=True)
                os._exit(3)  # the world holds the dead rank: skip its destructors
            # the surviving replica: the same shards on a 1-D mesh of its shard group (no communication)
            single = make_model(args.width).to(device)
            fully_shard(single, mesh=DeviceMesh.from_group(shard_g, device.type))
            single_opt = torch.optim.SGD(single.parameters(), lr=0.01, momentum=0.9)
            for new, old in zip(single.parameters(), model.parameters()):
                new.to_local().detach().copy_(old.to_local())
                if old in opt.state:  # and the optimizer's momentum the same way
                    buf = torch.zeros_like(new)
                    buf.to_local().copy_(opt.state[old]["momentum_buffer"].to_local())
                    single_opt.state[new]["momentum_buffer"] = buf
            model, opt, alone = single, single_opt, True
            print(f"rank {rank} lost rank {exc.loss.rank}: replica A on alone", flush=True)
            # the step that failed is done again (step is not advanced)

    if args.save:
        torch.save({k: v.full_tensor() for k, v in model.state_dict().items()}, args.save.format(rank=rank))
    watcher.stop()
    print(f"rank {rank} done", flush=True)
    os._exit(0)  # after a loss the world still holds the dead rank; its destructor could wait on it


if __name__ == "__main__":
    main()
