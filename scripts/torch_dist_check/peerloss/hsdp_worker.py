"""One process of the peer-loss ``train-hsdp`` case: an FSDP2 HSDP job loses a rank, trains on, and heals.

Four ranks train the ``train`` case's MLP (:mod:`torch_dist_check.peerloss.train_worker`) with ``fully_shard`` on
a 2-D DeviceMesh ("replicate", "shard") = [[0, 1], [2, 3]]: replica A = ranks 0, 1 (``survivor``,
``peer``), replica B = ranks 2, 3 (``partner``, ``victim``). The mesh is built from groups the job
makes itself (``DeviceMesh.from_group``): shard groups {0, 1}, {2, 3} and replicate groups {0, 2},
{1, 3}, each watched by torch_peer_watcher. The victim SIGKILLs itself at ``--kill-step`` in
``--kill-phase``; then:

- **Replica A trains on alone.** The watcher aborts the groups that contain the dead rank, and
  every rank leaves its replicate group on any loss (``watch(..., leave_on_any_loss=True)``: rank 0's
  partner in {0, 2} is alive but stuck in its own replica's collective; on gloo the watcher's abort
  cuts the group's sockets, where gloo's own closes nothing). Replica A's shard group never contained the dead
  rank, so nothing is shrunk: each survivor moves its local shards (parameters and momentum) into
  a ``fully_shard`` of a fresh model on a 1-D mesh of that group (the same dim-0 split, no
  communication) and redoes the interrupted step on rows ``r::2``.
- **Replica B comes back.** The partner and a ``replacement`` (a process started before the fault,
  idle until the partner reports the loss: the spare a scheduler would start) join a fresh store;
  at the next step boundary replica A sees them, and all four leave the old world
  (``_abort_process_group``), ``init_process_group`` a new world of 4, build the same 2-D mesh on
  it, and the survivors broadcast their shards and momentum over the new replicate groups (the
  backend's own collective; no file). Then they train together.

A step never applies a gradient that a dead peer cut short: each replica agrees over its shard
group, before ``opt.step()``, whether any rank saw an error or a verdict (an all_reduce MAX), so
both ranks of a replica skip or apply the same steps. Every step's global batch is 48 rows drawn
from the step number; data-parallel rank r of W takes rows ``r::W``. At the end every rank replays
the whole run in one process from the seed (:func:`replay`), with the same per-rank gradients
combined as HSDP combines them (fp32, pairs, factors 1/2: exact), and marks whether its parameters
are bitwise equal to it. Needs PyTorch >= 2.6 for ``fully_shard`` as a public API and
``DeviceMesh.from_group`` with a list of groups; checked on 2.13.0.

Marker lines as in :mod:`torch_dist_check.peerloss.worker`; the launcher (:mod:`torch_dist_check.peerloss.hsdp`) judges.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from torch_dist_check.checks.fault_worker import mark, stacks_on_request
from torch_dist_check.harness.rendezvous import host_store, join_store
from torch_dist_check.peerloss.train_worker import LEARNING_RATE, LOSS_RTOL, MOMENTUM, PHASES, global_batch, make_model, mark_loss, shard
from torch_dist_check.peerloss.worker import _device, probe_context

ROLES = {"survivor": 0, "peer": 1, "partner": 2, "victim": 3}
REPLICAS = ([0, 1], [2, 3])  # the mesh: row = replica (shard group), column = replicate group
# Rank 0 can wait in the replicate all_reduce on the partner, who is stuck in its own replica's
# collective. Every survivor leaves its replicate group on any loss (leave_on_any_loss: on gloo, whose own
# abort closes nothing, that cuts the group's sockets). The short timeout is only a safety net.
GLOO_REPLICATE_TIMEOUT_S = 5.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The worker's arguments (the launcher sets them; not meant for people)."""
    p = argparse.ArgumentParser(prog="python -m torch_dist_check.peerloss.hsdp_worker")
    p.add_argument("--role", choices=(*ROLES, "replacement"), required=True)
    p.add_argument("--backend", choices=("nccl", "gloo"), required=True)
    p.add_argument("--rendezvous-dir", type=Path, required=True)
    p.add_argument("--device", type=int, default=0)
    p.add_argument("--kill-step", type=int, default=5)
    p.add_argument("--kill-phase", choices=PHASES, default="backward")
    p.add_argument("--steps-after", type=int, default=3)
    p.add_argument("--max-alone-steps", type=int, default=100)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--pg-timeout", type=float, default=300.0)
    p.add_argument("--recover-timeout", type=float, default=60.0)
    return p.parse_args(argv)


# --- the arithmetic both the job and its replay do --------------------------------------------------


def optimizer(params: Any) -> Any:
    """SGD with momentum, one tensor at a time: the same elementwise kernels on shards and on whole tensors."""
    import torch

    return torch.optim.SGD(params, lr=LEARNING_RATE, momentum=MOMENTUM, foreach=False)


def full_digest(model: Any) -> str:
    """sha256 of every parameter, whole (a DTensor is gathered within its replica): equal digests are bitwise-equal models."""
    h = hashlib.sha256()
    for p in model.parameters():
        whole = p.full_tensor() if hasattr(p, "full_tensor") else p
        h.update(whole.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def replay(width: int, seed: int, device: Any, worlds: list[int]) -> tuple[Any, list[list[float]], dict[int, str]]:
    """Train the model in one process through ``len(worlds)`` steps, step s with ``worlds[s]`` data-parallel
    ranks (4: two replicas of two, 2: one replica of two), combining the per-rank gradients as HSDP does:
    the average of each replica's pair, then of the replicas. Returns the model, each step's per-rank
    losses and the digest after each step."""
    import torch

    model = make_model(width, seed, device)
    params = list(model.parameters())
    opt = optimizer(params)
    losses, digests = [], {}
    for step, world in enumerate(worlds):
        batch = global_batch(step, width, seed, device)
        grads, mine = [], []
        for r in range(world):
            model.zero_grad(set_to_none=True)
            x, y = shard(batch, r, world)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            mine.append(loss.item())
            grads.append([p.grad.clone() for p in params])
        for i, p in enumerate(params):
            pairs = [(grads[r][i] + grads[r + 1][i]) * 0.5 for r in range(0, world, 2)]
            p.grad = pairs[0] if len(pairs) == 1 else (pairs[0] + pairs[1]) * 0.5
        opt.step()
        losses.append(mine)
        digests[step] = full_digest(model)
    return model, losses, digests


# --- the job -------------------------------------------------------------------------------------------


class Job:
    """This rank's groups, FSDP model, optimizer and watcher in one topology (old world, alone, new world)."""

    def __init__(self, args: argparse.Namespace, device: Any, rank: int, replica: Any, replicate: Any | None,
                 data_rank: int, data_world: int, watcher: Any, watched: Any) -> None:  # fmt: skip
        import torch
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        self.args, self.device, self.rank, self.watcher, self.watched = args, device, rank, watcher, watched
        self.replica, self.replicate = replica, replicate
        self.data_rank, self.data_world = data_rank, data_world
        if replicate is None:
            mesh = DeviceMesh.from_group(replica, device.type)
        else:
            mesh = DeviceMesh.from_group([replicate, replica], device.type, mesh=torch.tensor(REPLICAS),
                                         mesh_dim_names=("replicate", "shard"))  # fmt: skip
        self.model = make_model(args.width, args.seed, device)
        fully_shard(self.model, mesh=mesh)
        self.opt = optimizer(self.model.parameters())

    def locals(self) -> tuple[list[Any], list[Any]]:
        """This rank's shards of the parameters and of the momentum (copies)."""
        params = list(self.model.parameters())
        momentum = [self.opt.state[p]["momentum_buffer"] for p in params] if self.opt.state else []
        return [p.to_local().detach().clone() for p in params], [b.to_local().clone() for b in momentum]

    def load(self, params: list[Any], momentum: list[Any]) -> None:
        """Put shards laid out as this job's into its parameters and momentum."""
        import torch

        with torch.no_grad():
            for p, local in zip(self.model.parameters(), params):
                p.to_local().copy_(local)
            for p, local in zip(self.model.parameters(), momentum):
                buf = torch.zeros_like(p)
                buf.to_local().copy_(local)
                self.opt.state[p]["momentum_buffer"] = buf

    def step(self, step: int, join_ready: Any = None) -> tuple[float, bool]:
        """One step on this rank's rows; (its loss before the update, whether the replica joins the healed world next).

        Raises PeerLostError (or the step's error) when a rank of the replica failed or saw a verdict:
        then no rank of the replica applied the step.
        """
        import torch
        import torch.distributed as dist
        from torch_peer_watcher import PeerLostError

        failed: BaseException | None = None
        value = math.nan
        try:
            x, y = shard(global_batch(step, self.args.width, self.args.seed, self.device), self.data_rank, self.data_world)
            self.opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.mse_loss(self.model(x), y)
            loss.backward()
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
            value = loss.item()
        except Exception as exc:  # decided below, with the other rank of the replica
            failed = exc
        lost = failed is not None or self.watcher.lost(self.watched) is not None
        flags = torch.tensor([float(lost), float(bool(join_ready and join_ready()))], device=self.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.replica)
        if flags[0].item():
            loss_record = self.watcher.wait_for_loss(self.watched, 2.0, aborted=False)  # the verdict; the aborts run on
            if loss_record is not None:
                raise PeerLostError(loss_record) from failed
            raise failed if failed is not None else RuntimeError("the other rank of the replica failed its step")
        self.opt.step()
        return value, bool(flags[1].item())


def old_world(args: argparse.Namespace, device: Any, rank: int) -> Job:
    """The 4-rank world, its four groups, the watcher on all of them and the HSDP job."""
    import torch.distributed as dist
    import torch_peer_watcher

    port_file = args.rendezvous_dir / "world.port"
    store = host_store(port_file, 4, args.pg_timeout) if rank == 0 else join_store(port_file, 4, args.pg_timeout)
    bound = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(args.backend, store=store, rank=rank, world_size=4,
                            timeout=timedelta(seconds=args.pg_timeout), **bound)  # fmt: skip
    replica, replicate = make_groups(args, rank)
    watcher = torch_peer_watcher.start()  # the world: every rank learns of every death
    watcher.watch(replica)
    # The partner of a replicate group may be alive but stuck in its replica's collective: every rank leaves
    # its replicate group on any loss, aborted with the lost rank's groups (on gloo its sockets cut too).
    watcher.watch(replicate, leave_on_any_loss=args.role != "victim")
    watcher.on_peer_lost(mark_loss)
    return Job(args, device, rank, replica, replicate, rank, 4, watcher, None)


def make_groups(args: argparse.Namespace, rank: int) -> tuple[Any, Any]:
    """This rank's shard group (its replica) and replicate group; every rank makes all four, in one order."""
    import torch.distributed as dist

    short = timedelta(seconds=GLOO_REPLICATE_TIMEOUT_S if args.backend == "gloo" else args.pg_timeout)
    mine = {}
    for kind, ranks in [("replica", r) for r in REPLICAS] + [("replicate", list(c)) for c in zip(*REPLICAS)]:
        group = dist.new_group(ranks, timeout=short if kind == "replicate" else timedelta(seconds=args.pg_timeout))
        if rank in ranks:
            mine[kind] = group
    return mine["replica"], mine["replicate"]


def new_world(args: argparse.Namespace, device: Any, rank: int, fresh_store: Any) -> Job:
    """Leave the old world (abort, never destroy: it holds the dead rank) and build the 4-rank job anew."""
    import torch.distributed as dist
    import torch_peer_watcher

    torch_peer_watcher.leave_world()  # the watcher stopped, every group aborted (NCCL's proxy threads woken)
    mark("J_LEFT")
    bound = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(args.backend, store=dist.PrefixStore("world/", fresh_store), rank=rank, world_size=4,
                            timeout=timedelta(seconds=args.pg_timeout), **bound)  # fmt: skip
    mark("J_WORLD")
    replica, replicate = make_groups(args, rank)
    mark("J_GROUPS")
    watcher = torch_peer_watcher.start()
    for group in (replica, replicate):
        watcher.watch(group)
    mark("J_WATCH")
    job = Job(args, device, rank, replica, replicate, rank, 4, watcher, None)
    mark("J_FSDP")
    return job


def receive_shards(job: Job, params: list[Any] | None, momentum: list[Any] | None) -> None:
    """Each replicate group's survivor (replica A) broadcasts its shards and momentum to its replica-B rank."""
    import torch
    import torch.distributed as dist

    survivor = dist.get_global_rank(job.replicate, 0)
    if params is None:
        params = [p.to_local().detach().clone() for p in job.model.parameters()]
        momentum = [torch.zeros_like(t) for t in params]
    assert momentum is not None
    # One broadcast of one flat buffer (all fp32): a collective per tensor cost a launch and a wait each.
    tensors = [*params, *momentum]
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.broadcast(flat, src=survivor, group=job.replicate)
    if dist.get_rank() != survivor:
        for t, part in zip(tensors, flat.split([t.numel() for t in tensors])):
            t.copy_(part.view_as(t))
    job.load(params, momentum)


def fresh_store_port(args: argparse.Namespace) -> Path:
    return args.rendezvous_dir / "fresh.port"


def join(args: argparse.Namespace, device: Any, rank: int, fresh_store: Any, shards: tuple[list[Any], list[Any]] | None,
         history: list[int]) -> tuple[Job, list[int]]:  # fmt: skip
    """All four: the new world, the shards from replica A, and the steps so far (each step's data-parallel world)."""
    if rank == 0:
        # The run's history from rank 0 through the store: how many steps, and which ran on replica A alone.
        # (A broadcast over the new world was its only collective and cost 0.6-0.9 s of the join on four H100s:
        # NCCL connects a communicator's peers at its first collective.)
        fresh_store.set("history", ",".join(str(w) for w in history))
    job = new_world(args, device, rank, fresh_store)
    receive_shards(job, *(shards if shards is not None else (None, None)))
    mark("J_SHARDS")
    told = fresh_store.get("history").decode()
    return job, [int(w) for w in told.split(",") if w]


# --- the roles ------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """Run one role."""
    args = parse_args(argv)
    stacks_on_request()  # a trainer the judge finds hung tells it where its threads are (trainjudge.record_hang)
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    # One thread: the CPU kernels then split no tensor differently in the job and in the replay.
    torch.set_num_threads(1)
    device = _device(args)
    if args.role == "replacement":
        return replacement(args, device)
    rank = ROLES[args.role]
    job = old_world(args, device, rank)
    mark("READY", args.role, f"params={sum(p.numel() for p in job.model.parameters())}")
    if args.role == "victim":
        return victim(args, job)
    step, history = 0, []
    try:
        while True:
            job.step(step)
            history.append(4)
            step += 1
            if step > args.kill_step + 200:
                mark("NO_ERROR")
                return _exit(4)
    except Exception as exc:  # the peer's death, as PeerLostError
        mark("CAUGHT", f"{type(exc).__name__}:", " ".join(str(exc).split())[:300])
    if args.role == "partner":
        return partner(args, device, job, history)
    return survivor(args, device, rank, job, step, history)


def _exit(code: int) -> int:
    sys.stdout.flush()
    # Skip process-group destructors: the old world's may block on its aborted communicators.
    os._exit(code)


def victim(args: argparse.Namespace, job: Job) -> int:
    """Train until step --kill-step, then die in --kill-phase."""
    armed = {"on": False}

    def die(*_: Any) -> None:
        mark("KILL", args.kill_phase)
        os.kill(os.getpid(), signal.SIGKILL)

    def at(phase: str) -> Any:
        def hook(*_: Any) -> None:
            if armed["on"] and args.kill_phase == phase:
                die()

        return hook

    job.model[2].register_forward_pre_hook(at("forward"))
    job.model[2].register_full_backward_pre_hook(at("backward"))
    job.opt.register_step_pre_hook(at("optimizer"))
    for step in range(args.kill_step + 1):
        if step == args.kill_step:
            spare_ready(args)
        armed["on"] = step == args.kill_step
        job.step(step)
    die()  # "between": after the kill step's update, before the next step
    time.sleep(3600)
    return 4


def spare_ready(args: argparse.Namespace) -> None:
    """Wait until the spare says it is ready (its warm-up done): the fault comes with the spare up, as the case
    says. Without this wait a spare slower to warm up than the job to reach --kill-step (a busy machine) was
    not READY when the victim died, and the launcher judged the run a failed start."""
    deadline = time.monotonic() + args.pg_timeout
    while not (args.rendezvous_dir / "spare-ready").exists():
        if time.monotonic() > deadline:
            mark("RECOVER_FAILED", "the spare never said it was ready")
            _exit(5)
        time.sleep(0.01)


def survivor(args: argparse.Namespace, device: Any, rank: int, job: Job, step: int, history: list[int]) -> int:
    """Replica A: train on alone on the same shards, then let replica B back in."""
    try:
        alone = Job(args, device, rank, job.replica, None, rank, 2, job.watcher, job.replica)
        alone.load(*job.locals())
        del job
        mark("ALONE_READY")
    except Exception as exc:  # reported with the stage it broke
        mark("RECOVER_FAILED", f"{type(exc).__name__}:", " ".join(str(exc).split())[:300])
        return _exit(5)
    fresh: dict[str, Any] = {}

    def join_ready() -> bool:
        # Rank 0 looks (without waiting, until the alone budget is spent); the flag reaches rank 1 in the step's all_reduce.
        if rank != 0:
            return False
        wait = history.count(2) >= args.max_alone_steps
        if "store" not in fresh:
            if not fresh_store_port(args).exists() and not wait:
                return False
            fresh["store"] = join_store(fresh_store_port(args), 4, args.recover_timeout)
        keys = ["arrived/2", "arrived/3"]
        if wait:
            fresh["store"].wait(keys, timedelta(seconds=args.recover_timeout))
            return True
        return bool(fresh["store"].check(keys))

    losses, first = [], True
    try:
        while True:
            value, joining = alone.step(step, join_ready)
            losses.append(value)
            history.append(2)
            step += 1
            if first:
                mark("FIRST_STEP", "world=2")  # (f): the death to here
                first = False
            if joining:
                break
    except Exception as exc:  # replica A must train on
        mark("TRAIN_FAILED", f"{type(exc).__name__}:", " ".join(str(exc).split())[:300])
        return _exit(5)
    mark("ALONE_DONE", f"steps={history.count(2)}", f"digest={full_digest(alone.model)}",
         f"losses={','.join(f'{v:.6g}' for v in losses)}")  # fmt: skip
    mark("JOIN_SEEN", f"step={step}")
    shards = alone.locals()
    del alone
    if "store" not in fresh:
        fresh["store"] = join_store(fresh_store_port(args), 4, args.recover_timeout)
    return together(args, device, rank, fresh["store"], shards, history, losses)


def partner(args: argparse.Namespace, device: Any, job: Job, history: list[int]) -> int:
    """Replica B's live rank: say the replica is lost (the scheduler's cue for a replacement), then rejoin."""
    del job
    (args.rendezvous_dir / "replica-lost").write_text("2\n")
    store = join_store(fresh_store_port(args), 4, args.recover_timeout)
    store.set("arrived/2", "1")
    return together(args, device, 2, store, None, history, [])


def replacement(args: argparse.Namespace, device: Any) -> int:
    """A spare: up and on its device before the fault, started into the job when replica B is lost."""
    warm_up(args, device)
    mark("READY", "replacement")
    (args.rendezvous_dir / "spare-ready").write_text("1\n")
    lost = args.rendezvous_dir / "replica-lost"
    deadline = time.monotonic() + args.pg_timeout
    while not lost.exists():
        if time.monotonic() > deadline:
            mark("RECOVER_FAILED", "replica B was never reported lost")
            return _exit(5)
        time.sleep(0.002)
    mark("STARTED")  # the join time runs from here
    store = host_store(fresh_store_port(args), 4, args.recover_timeout)
    store.set("arrived/3", "1")
    return together(args, device, 3, store, None, [], [])


def warm_up(args: argparse.Namespace, device: Any) -> None:
    """The spare readies, before the fault, what the join would otherwise wait for: the modules it imports
    (FSDP, DeviceMesh, the watcher: about 1 s on the 2-core machine) and the device's context and kernels
    (one step of the model on dummy rows). Nothing here touches what the job computes (make_model seeds itself)."""
    import torch
    import torch.distributed  # noqa: F401
    import torch_peer_watcher  # noqa: F401
    from torch.distributed.device_mesh import DeviceMesh  # noqa: F401
    from torch.distributed.fsdp import fully_shard  # noqa: F401

    model = make_model(args.width, args.seed, device)
    x, y = shard(global_batch(0, args.width, args.seed, device), 0, 4)
    torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer(model.parameters()).step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def together(args: argparse.Namespace, device: Any, rank: int, store: Any, shards: tuple[list[Any], list[Any]] | None,
             history: list[int], alone_losses: list[float]) -> int:  # fmt: skip
    """The healed world: receive (or send) the shards, check that all agree, train --steps-after steps, check against the replay."""
    mark("J_STORE")
    try:
        job, history = join(args, device, rank, store, shards, history)
        mark("JOINED", f"digest={full_digest(job.model)}", f"at={len(history)}")
        losses = []
        for i in range(args.steps_after):
            value, _ = job.step(len(history))
            losses.append(value)
            history.append(4)
            mark(f"JOINT_STEP_{i + 1}", f"digest={full_digest(job.model)}")
    except Exception as exc:  # the healed world must train
        mark("TRAIN_FAILED", f"{type(exc).__name__}:", " ".join(str(exc).split())[:300])
        return _exit(5)
    _, expected, digests = replay(args.width, args.seed, device, history)
    start = len(history) - args.steps_after
    mine = [expected[s][rank] for s in range(start, len(history))]
    alone = [s for s, w in enumerate(history) if w == 2]
    # Replica A's losses alone against the replay too (rank r of 2 there).
    pairs = list(zip(losses, mine)) + list(zip(alone_losses, [expected[s][rank] for s in alone] if alone_losses else []))
    worst = max(abs(a - b) / max(abs(b), 1e-12) for a, b in pairs)
    digest = full_digest(job.model)
    alone_digest = digests[alone[-1]] if alone else "-"
    finite = all(math.isfinite(v) for v in losses)
    mark("HSDP_DONE", f"rank={rank}", f"digest={digest}", f"replay={digests[len(history) - 1]}", f"alone_replay={alone_digest}",
         f"alone_steps={len(alone)}", f"finite={finite}", f"worst_rel={worst:.3e}",
         f"losses={','.join(f'{v:.6g}' for v in losses)}", f"reference={','.join(f'{v:.6g}' for v in mine)}")  # fmt: skip
    ok = probe_context(device)
    job.watcher.stop()
    return _exit(0 if ok and finite and worst <= LOSS_RTOL and digest == digests[len(history) - 1] else 5)


if __name__ == "__main__":
    sys.exit(main())
