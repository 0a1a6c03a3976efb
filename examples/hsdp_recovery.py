"""An HSDP job that loses a rank: the surviving replica trains on alone, and the lost replica comes back
(docs/howto/survive-a-dead-rank.md, "An HSDP job that loses a rank").

Four ranks, FSDP2 on a 2-D mesh ("replicate", "shard") = [[0, 1], [2, 3]]. Start one process per rank with
RANK, WORLD_SIZE=4, MASTER_ADDR, MASTER_PORT (and LOCAL_RANK on GPUs) set, as `srun` does through a
wrapper; not under `torchrun`, whose agent stops every worker when one dies. Rank 0 hosts the store
(env://) and must live. When a rank dies, the other replica moves its shards onto a 1-D mesh of its own
group and trains on; the live rank of the lost replica waits for a replacement, which is this command
with the dead rank's RANK and --replacement (what a scheduler starts). Once both are in, all four leave
the old world, make a new one on the same store, take the surviving replica's state, and train together.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch_peer_watcher
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

REPLICAS = [[0, 1], [2, 3]]
GLOBAL_BATCH = 48  # rows per step whatever the data-parallel size: data rank r of W takes rows r::W
ARRIVED = "rejoin/arrived"  # in the job's store: how many ranks of the lost replica wait to come back
KEEP = []  # store objects that must outlive the world they served


def make_model(width):
    torch.manual_seed(0)  # every rank starts from the same weights
    return torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.ReLU(), torch.nn.Linear(4 * width, width))


def global_batch(step, width):
    """Step ``step``'s rows, drawn from the step alone: a replica alone takes over the other's rows."""
    rows = torch.Generator().manual_seed(step)
    x = torch.randn(GLOBAL_BATCH, width, generator=rows)
    return x, torch.sin(x)


def job_store():
    """A client of the job's store (rank 0's, from MASTER_ADDR:MASTER_PORT): the rejoin's meeting point."""
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)


def hsdp(rank, device, width):
    """The world's four groups, the watcher on them, and the model sharded on the 2-D mesh."""
    mine = {}  # every rank makes all four groups, in one order
    for kind, ranks in [("shard", r) for r in REPLICAS] + [("replicate", list(c)) for c in zip(*REPLICAS)]:
        g = dist.new_group(ranks)
        if rank in ranks:
            mine[kind] = g
    shard_g, repl_g = mine["shard"], mine["replicate"]
    watcher = torch_peer_watcher.start()  # the world: every rank hears of every death
    watcher.watch(shard_g)
    # The replicas' all-reduce is left on any loss: a partner whose own replica lost a rank is stuck there and
    # leaves it. The watcher aborts it together with the lost rank's groups (on gloo it also cuts its sockets).
    watcher.watch(repl_g, leave_on_any_loss=True)
    mesh = DeviceMesh.from_group([repl_g, shard_g], device.type, mesh=torch.tensor(REPLICAS),
                                 mesh_dim_names=("replicate", "shard"))  # fmt: skip
    model = make_model(width).to(device)
    fully_shard(model, mesh=mesh)
    return shard_g, repl_g, watcher, model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def local_state(model, opt):
    """This rank's shards of the parameters and of the momentum (copies)."""
    params = list(model.parameters())
    momentum = [opt.state[p]["momentum_buffer"].to_local().clone() if p in opt.state else torch.zeros_like(p.to_local())
                for p in params]  # fmt: skip
    return [p.to_local().detach().clone() for p in params], momentum


def load_state(model, opt, shards, momentum):
    """Put shards laid out as this model's into its parameters and momentum."""
    with torch.no_grad():
        for p, shard, buf in zip(model.parameters(), shards, momentum):
            p.to_local().copy_(shard)
            opt.state[p]["momentum_buffer"] = torch.zeros_like(p)
            opt.state[p]["momentum_buffer"].to_local().copy_(buf)


def new_world(rank, device, width, arriving):
    """All four ranks: leave the old world (abort, never destroy: it holds the dead rank), make a new one
    of four on the job's store, and build the same HSDP job on it."""
    store = job_store()
    if arriving:
        store.add(ARRIVED, 1)  # the surviving replica takes us back at its next step boundary
    if dist.is_initialized():  # a replacement never joined the old world
        # On rank 0 the old world's store object runs the store's server: keep it, the new world meets there.
        KEEP.append(dist.distributed_c10d._get_default_store())
    # Stop the watcher, abort every group of the old world (NCCL's proxy threads woken: stock NCCL's abort
    # would wait 0.5 s for them).
    torch_peer_watcher.leave_world()
    world = dist.PrefixStore("rejoin/world/", store)  # one new world per job: a second rejoin needs new keys
    if device.type == "cuda":
        dist.init_process_group("nccl", store=world, rank=rank, world_size=4, device_id=device)
    else:
        dist.init_process_group("gloo", store=world, rank=rank, world_size=4)
    return hsdp(rank, device, width)


def take_state(repl_g, model, opt, state, step, device):
    """Each replicate pair: the rank that trained on (``state`` not None) sends its shards, momentum and
    step to the one that comes back. Returns the step to go on from."""
    holder = torch.tensor([float(repl_g.rank() if state is not None else -1)], device=device)
    dist.all_reduce(holder, op=dist.ReduceOp.MAX, group=repl_g)
    src = dist.get_global_rank(repl_g, int(holder.item()))
    shards, momentum = state if state is not None else local_state(model, opt)
    at = torch.tensor([float(step)], device=device)
    for t in (*shards, *momentum, at):
        dist.broadcast(t, src=src, group=repl_g)
    load_state(model, opt, shards, momentum)
    return int(at.item())


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40, help="training steps (default 40)")
    p.add_argument("--width", type=int, default=256, help="the model's hidden width (default 256)")
    p.add_argument("--replacement", action="store_true", help="replace the lost rank RANK of a replica")
    p.add_argument("--rejoin-at", type=int, help="a replica alone waits at this step until the other is back")
    p.add_argument("--save", help="write each rank's final parameters here ({rank} is replaced)")
    args = p.parse_args()

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if on_gpu else torch.device("cpu")
    rank = int(os.environ["RANK"])
    if on_gpu:
        torch.cuda.set_device(device)  # current_stream() below is this rank's GPU's
    step, alone = 0, False
    if args.replacement:
        shard_g, repl_g, watcher, model, opt = new_world(rank, device, args.width, arriving=True)
        step = take_state(repl_g, model, opt, None, 0, device)
        print(f"rank {rank}: replacement in at step {step}, four ranks again", flush=True)
    else:
        if on_gpu:
            dist.init_process_group("nccl", device_id=device)
        else:
            dist.init_process_group("gloo")
        shard_g, repl_g, watcher, model, opt = hsdp(rank, device, args.width)
    store = job_store()

    def train_step(step, model, opt, watched, row, rows):
        """One step on rows row::rows; no rank of the replica applies it if any rank failed or heard of a
        loss. Returns the loss and whether the lost replica is back (asked while alone)."""
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
        back = False
        if alone and shard_g.rank() == 0:  # one rank asks the store; the all_reduce tells the other
            back = int(store.add(ARRIVED, 0)) >= 2
            while not back and args.rejoin_at is not None and step >= args.rejoin_at:
                time.sleep(0.05)
                back = int(store.add(ARRIVED, 0)) >= 2
        # `watched`: None (any loss) while the replicas train together; once alone, the replica's own group,
        # since a loss the replica already survived stays recorded and would stop every later step.
        flags = torch.tensor([float(failed or watcher.lost(watched) is not None), float(back)], device=device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=shard_g)  # both ranks of a replica agree
        if flags[0].item():  # on the verdict: the lost peer's groups may still be being aborted, beside this replica
            lost = watcher.wait_for_loss(watched, 2.0, aborted=False)
            if lost is None:
                raise RuntimeError("a rank of this replica failed its step, and no peer of the replica was lost")
            raise torch_peer_watcher.PeerLostError(lost)
        opt.step()
        return value, bool(flags[1].item())

    while step < args.steps:
        try:
            with watcher.guard(shard_g if alone else None):  # an op the loss broke raises PeerLostError
                if alone:
                    loss, back = train_step(step, model, opt, shard_g, shard_g.rank(), shard_g.size())
                else:
                    loss, back = train_step(step, model, opt, None, rank, 4)
            print(f"rank {rank} step {step} alone {alone} loss {loss:.6f}", flush=True)
            step += 1
            if back:  # all four: a new world, and this replica's state to the one that came back
                state = local_state(model, opt)
                shard_g, repl_g, watcher, model, opt = new_world(rank, device, args.width, arriving=False)
                step, alone = take_state(repl_g, model, opt, state, step, device), False
                print(f"rank {rank}: the lost replica is back at step {step}, four ranks again", flush=True)
        except torch_peer_watcher.PeerLostError as exc:
            if alone:
                print(f"rank {rank}: the other replica's rank {exc.loss.rank} lost too, this rank stops", flush=True)
                os._exit(3)  # the world holds the dead rank: skip its destructors
            if exc.loss.rank in dist.get_process_group_ranks(shard_g):  # this replica is lost: wait for a replacement
                print(f"rank {rank}: replica lost (rank {exc.loss.rank}), waiting for a replacement", flush=True)
                shard_g, repl_g, watcher, model, opt = new_world(rank, device, args.width, arriving=True)
                step = take_state(repl_g, model, opt, None, step, device)
                print(f"rank {rank}: back in at step {step}, four ranks again", flush=True)
                continue
            # the surviving replica: the same shards on a 1-D mesh of its shard group (no communication)
            single = make_model(args.width).to(device)
            fully_shard(single, mesh=DeviceMesh.from_group(shard_g, device.type))
            single_opt = torch.optim.SGD(single.parameters(), lr=0.01, momentum=0.9)
            load_state(single, single_opt, *local_state(model, opt))
            model, opt, alone = single, single_opt, True
            print(f"rank {rank} lost rank {exc.loss.rank}: this replica on alone", flush=True)
            # the step that failed is done again (step is not advanced)

    state = {k: v.full_tensor() for k, v in model.state_dict().items()}  # every rank: a collective
    if args.save:
        torch.save(state, args.save.format(rank=rank))
    watcher.stop()
    print(f"rank {rank} done", flush=True)
    os._exit(0)  # after a loss the world still holds the dead rank; its destructor could wait on it


if __name__ == "__main__":
    main()
