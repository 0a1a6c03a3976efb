"""One process of a peer-loss ``train`` case: a DDP training job that loses a rank and goes on.

Three ranks train a DDP model (an MLP, ``--width`` x 4 ``--width`` x ``--width``; 8.4 M parameters at the
default 1024) over a watched group S = new_group([0, 1, 2]) with SGD and momentum. The ``victim``
(rank 2) SIGKILLs itself at step ``--kill-step``, in the phase ``--kill-phase``: inside the forward pass
(a forward pre-hook of the second layer), inside the backward pass (a gradient hook of the first
layer, which fires after DDP has launched the first gradient bucket's all_reduce), just before the
optimizer step (a step pre-hook), or between two steps. The survivors (``survivor`` rank 0,
``partner`` rank 1) recover in one of two ways, each its own case:

- ``shrink``: S is watched with ``recovery="shrink"``; the watcher's verdict shrinks it
  (``shrink_group``, ``SHRINK_ABORT``) and the survivors rebuild DDP on the shrunk group of 2.
- ``fresh``: S is watched with the default recovery (abort); the survivors and a ``replacement``
  process (a standby, hosting the fresh store, warmed up before the fault: ``warm_up``; the victim
  joins the job only once it is) build a fresh world of 3 of their own and DDP on it, whose
  construction broadcasts the model from the survivor; the survivor broadcasts the optimizer's
  momentum too.

A step that met the dead peer never reaches the optimizer: each step waits for its gradients'
all_reduce and asks the watcher before ``opt.step()`` (a verdict raises PeerLostError), so that a
gradient an abort cut short is never applied; the step is then done again on the new group. Every
step's global batch is the same whatever the world size (48 rows drawn from the step number, rank r
of W taking rows r::W), so the data of the lost rank is shared out among the ranks that remain, and
the run must follow full-batch training: the survivor replays the steps after the recovery in one
process from the state it had when the new group was built (``reference``), and each rank's loss on
its rows must match that replay's. After ``--steps-after`` steps every rank marks a digest of its
parameters, which must be equal bitwise, and probes its device.

Marker lines as in :mod:`torch_dist_check.peerloss.worker`; the launcher (:mod:`peerloss`) judges.
"""

from __future__ import annotations

import argparse
import copy
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
from torch_dist_check.peerloss.worker import _device, exit_if_shrink_unsupported, probe_context

RECOVERIES = ("shrink", "fresh")
PHASES = ("forward", "backward", "optimizer", "between")
GLOBAL_BATCH = 48  # divisible by every world size the cases have (3, and 2 after a shrink)
LEARNING_RATE = 0.01
MOMENTUM = 0.9
# The survivors' losses against the one-process replay: the same arithmetic in another order.
LOSS_RTOL = 1e-3
GLOO_GROUP_TIMEOUT_S = 10.0
# The standby (train-fresh's replacement) writes this file into the rendezvous folder once it is warm.
STANDBY_FILE = "standby.ready"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The worker's arguments (the launcher sets them; not meant for people)."""
    p = argparse.ArgumentParser(prog="python -m torch_dist_check.peerloss.train_worker")
    p.add_argument("--role", choices=("survivor", "partner", "victim", "replacement"), required=True)
    p.add_argument("--recovery", choices=RECOVERIES, required=True)
    p.add_argument("--backend", choices=("nccl", "gloo"), required=True)
    p.add_argument("--rendezvous-dir", type=Path, required=True)
    p.add_argument("--device", type=int, default=0)
    p.add_argument("--kill-step", type=int, default=5)
    p.add_argument("--kill-phase", choices=PHASES, default="backward")
    p.add_argument("--steps-after", type=int, default=5)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--pg-timeout", type=float, default=300.0)
    p.add_argument("--recover-timeout", type=float, default=60.0)
    return p.parse_args(argv)


def make_model(width: int, seed: int, device: Any) -> Any:
    """The MLP every rank starts from (the same seed: the same weights)."""
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(width, 4 * width), torch.nn.ReLU(), torch.nn.Linear(4 * width, width)
    ).to(device)


def global_batch(step: int, width: int, seed: int, device: Any) -> tuple[Any, Any]:
    """Step ``step``'s 48 rows (inputs, targets), the same on every rank: a noisy linear map to learn."""
    import torch

    target_map = torch.Generator().manual_seed(seed + 1)
    weights = torch.randn(width, width, generator=target_map) / math.sqrt(width)
    rows = torch.Generator().manual_seed(seed * 1_000_003 + step)
    x = torch.randn(GLOBAL_BATCH, width, generator=rows)
    y = x @ weights + 0.01 * torch.randn(GLOBAL_BATCH, width, generator=rows)
    return x.to(device), y.to(device)


def shard(batch: tuple[Any, Any], rank: int, world: int) -> tuple[Any, Any]:
    """Rank ``rank`` of ``world`` takes rows rank::world of the global batch."""
    x, y = batch
    return x[rank::world], y[rank::world]


def params_digest(model: Any) -> str:
    """sha256 of every parameter's bytes, in order: equal digests are bitwise-equal models."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def momentum_buffers(opt: Any, params: list[Any]) -> list[Any]:
    """The optimizer's momentum buffer of each parameter (zeros where it has none yet)."""
    import torch

    return [opt.state[p].setdefault("momentum_buffer", torch.zeros_like(p)) for p in params]


def reference(model_state: dict[str, Any], momentum: list[Any], start: int, steps: int, args: argparse.Namespace,
              device: Any, rank: int, world: int) -> list[float]:  # fmt: skip
    """Replay ``steps`` steps from ``start`` in one process on the full batch; rank ``rank`` of
    ``world``'s loss on its rows at each step (before that step's update)."""
    import torch

    model = make_model(args.width, args.seed, device)
    model.load_state_dict(model_state)
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=LEARNING_RATE, momentum=MOMENTUM)
    for p, buf in zip(params, momentum):
        opt.state[p]["momentum_buffer"] = buf.clone()
    losses = []
    loss_fn = torch.nn.MSELoss()
    for step in range(start, start + steps):
        x, y = global_batch(step, args.width, args.seed, device)
        opt.zero_grad(set_to_none=True)
        out = model(x)
        loss_fn(out, y).backward()
        with torch.no_grad():
            mine = loss_fn(out[rank::world], y[rank::world]).item()
        losses.append(mine)
        opt.step()
    return losses


class Trainer:
    """DDP over one group, and the step that never applies a gradient a dead peer cut short."""

    def __init__(self, args: argparse.Namespace, model: Any, opt: Any, group: Any, device: Any, watcher: Any) -> None:
        self.args, self.model, self.opt, self.device, self.watcher = args, model, opt, device, watcher
        self.group = group
        self.ddp = self._wrap(group)

    def _wrap(self, group: Any) -> Any:
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [self.device.index] if self.device.type == "cuda" else None
        return DDP(self.model, process_group=group, device_ids=ids)

    def rebuild(self, group: Any) -> None:
        """DDP on the new group (its construction broadcasts the model from the group's rank 0)."""
        self.group = group
        del self.ddp
        self.ddp = self._wrap(group)

    def step(self, step: int) -> float:
        """One training step on this rank's rows; the loss on them (before the update)."""
        import torch

        rank, world = self.group.rank(), self.group.size()
        x, y = shard(global_batch(step, self.args.width, self.args.seed, self.device), rank, world)
        self.opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(self.ddp(x), y)
        loss.backward()
        # The gradients' all_reduce must have ended, and without a loss, before the optimizer uses them.
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self.watcher.raise_if_lost(self.group)
        self.opt.step()
        return loss.item()


def main(argv: list[str] | None = None) -> int:
    """Run one role."""
    args = parse_args(argv)
    stacks_on_request()  # a trainer the judge finds hung tells it where its threads are (trainjudge.record_hang)
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = _device(args)
    if args.role == "replacement":
        return replacement(args, device)
    import torch.distributed as dist

    rank = {"survivor": 0, "partner": 1, "victim": 2}[args.role]
    if args.role == "victim" and args.recovery == "fresh":
        # The fault comes once the standby is up and warm, as a spare of a real job is long before one.
        if not standby_warm(args.rendezvous_dir, args.pg_timeout):
            mark("NO_STANDBY", f"no {STANDBY_FILE} within {args.pg_timeout:.0f} s")
            sys.stdout.flush()
            os._exit(5)
    # As a user imports it: before the first group, which is then made under the watcher's settings of PyTorch's
    # NCCL watchdog (torch_peer_watcher.watchdog). Cheap: the watcher itself starts below.
    import torch_peer_watcher

    port_file = args.rendezvous_dir / "world.port"
    store = host_store(port_file, 3, args.pg_timeout) if rank == 0 else join_store(port_file, 3, args.pg_timeout)
    # Bound to the GPU: shrink_group gives the shrunk group its backend on the parent's bound device.
    bound = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(args.backend, store=store, rank=rank, world_size=3,
                            timeout=timedelta(seconds=args.pg_timeout), **bound)  # fmt: skip
    # gloo has no working abort. A survivor can also be waiting on the other survivor, which left the
    # collective when its own connection broke (seen on 2 cores, about 1 run in 10): the watcher cuts
    # every socket of the gloo group it aborts, which ends that wait; the short timeout is a safety net.
    timeout = timedelta(seconds=GLOO_GROUP_TIMEOUT_S if args.backend == "gloo" else args.pg_timeout)
    group = dist.new_group([0, 1, 2], timeout=timeout)
    if args.recovery == "shrink" and rank == 0:
        exit_if_shrink_unsupported(group)
    model = make_model(args.width, args.seed, device)
    opt = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE, momentum=MOMENTUM)
    # The first optimizer (torch._compile's wrapper) or DDP built imports torch._dynamo: about 830 modules,
    # 1 s on an idle core, several on a busy host, in stretches that hold the GIL. Started before them, the
    # watcher's heartbeat thread could not run through them: with a 1 s heartbeat timeout across 3 namespace
    # nodes on 2 busy cores, a peer declared a live rank lost during setup in 4 of 18 runs (issue 45). So the
    # watcher starts once that one-time work is done; READY says how many modules were imported after.
    trainer = Trainer(args, model, opt, group, device, _NoWatcher())
    loaded = set(sys.modules)
    # Only S is watched: the world keeps the dead rank and is never used again.
    watcher = torch_peer_watcher.start(watch_world=False)
    watcher.watch(group, recovery="shrink" if args.recovery == "shrink" else "abort")
    watcher.on_peer_lost(mark_loss)
    trainer.watcher = watcher
    mark("READY", args.role, f"params={sum(p.numel() for p in model.parameters())}",
         f"imports_watched={len(set(sys.modules) - loaded)}")  # fmt: skip
    if args.role == "victim":
        return victim(args, trainer)
    return survivor(args, trainer, rank)


def mark_loss(loss: Any) -> None:
    """The watcher's verdict and what its settle took (the judge's split of the survivor's exception)."""
    mark("LOSS", f"{loss.detected_at:.6f}", f"rank={loss.rank}", f"silent_s={loss.silent_s}", f"judged_s={loss.judged_s:.4f}",
         f"abort_s={loss.abort_s:.4f}", f"proxy_wakes={len(loss.proxy_wakes)}", " ".join(loss.cause.split())[:200])  # fmt: skip


def _die(args: argparse.Namespace) -> None:
    mark("KILL", args.kill_phase)
    os.kill(os.getpid(), signal.SIGKILL)


def victim(args: argparse.Namespace, trainer: Trainer) -> int:
    """Train until step --kill-step, then die in --kill-phase."""
    armed = {"on": False}

    def at(phase: str) -> Any:
        def hook(*_: Any) -> None:
            if armed["on"] and args.kill_phase == phase:
                _die(args)

        return hook

    model = trainer.model
    model[2].register_forward_pre_hook(at("forward"))
    model[0].weight.register_hook(at("backward"))
    trainer.opt.register_step_pre_hook(at("optimizer"))
    for step in range(args.kill_step + 1):
        armed["on"] = step == args.kill_step
        trainer.step(step)
    _die(args)  # "between": after the kill step's update, before the next step
    time.sleep(3600)
    return 4


def survivor(args: argparse.Namespace, trainer: Trainer, rank: int) -> int:
    """Train; on the loss, recover (shrink or fresh), redo the step, train --steps-after steps, check."""
    from torch_peer_watcher import PeerLostError

    step = 0
    limit = args.kill_step + 200
    while True:
        try:
            with trainer.watcher.guard(trainer.group):
                trainer.watcher.raise_if_lost(trainer.group)
                trainer.step(step)
        except Exception as exc:  # the peer's death, as PeerLostError under guard()
            mark("CAUGHT", f"{type(exc).__name__}:", " ".join(str(exc).split())[:300])
            if not isinstance(exc, PeerLostError):
                sys.stdout.flush()
                os._exit(5)
            break
        step += 1
        if step > limit:
            mark("NO_ERROR")
            sys.stdout.flush()
            os._exit(4)
    if not recover(args, trainer, rank, step):
        sys.stdout.flush()
        os._exit(5)
    return train_after(args, trainer, step)


def recover(args: argparse.Namespace, trainer: Trainer, rank: int, step: int) -> bool:
    """Get the new group and rebuild DDP on it; marks GROUP_READY and DDP_READY, or RECOVER_FAILED."""
    try:
        if args.recovery == "shrink":
            group = trainer.watcher.shrunk(trainer.group, timeout_s=args.recover_timeout)
            loss = trainer.watcher.lost(trainer.group)
            if group is None:
                raise RuntimeError("no shrunk group: " + ("; ".join(loss.errors) if loss is not None and loss.errors else "timeout"))
            # Built anew from the store where a member's shrink failed (the watcher's fallback), or shrunk.
            how = "rebuilt" if loss is not None and loss.rebuilt else "shrunk"
            mark("GROUP_READY", f"size={group.size()}", f"how={how}", " ".join("; ".join(loss.rebuilt).split())[:300] if loss else "")
        else:
            group = fresh_world(args, trainer.device, rank)
            mark("GROUP_READY", f"size={group.size()}")
        trainer.rebuild(group)
        mark("DDP_READY")  # DDP's construction broadcast the model: the new group's communicator works
        if args.recovery == "fresh":
            share_state(trainer, step)
            mark("STATE_SHARED")  # the momentum and the step, broadcast over the fresh world
    except Exception as exc:  # reported with the stage it broke
        mark("RECOVER_FAILED", f"{type(exc).__name__}:", " ".join(str(exc).split())[:300])
        return False
    return True


def fresh_world(args: argparse.Namespace, device: Any, rank: int) -> Any:
    """A world of 3 of our own with the replacement (rank 2), on its store: not split from the old
    world, which still holds the dead rank (a split from it raised ncclRemoteError, issue 30)."""
    import torch.distributed as dist

    port_file = args.rendezvous_dir / "fresh.port"
    store = host_store(port_file, 3, args.recover_timeout) if rank == 2 else join_store(port_file, 3, args.recover_timeout)
    return own_group(args, dist.PrefixStore("fresh/", store), rank, 3, device)


def own_group(args: argparse.Namespace, store: Any, rank: int, size: int, device: Any) -> Any:
    """A process group of ``size`` on ``store``, with the case's backend on ``device``; no world needed."""
    import torch.distributed as dist
    from torch.distributed import ProcessGroup

    if args.backend == "nccl":
        backend = dist.ProcessGroupNCCL(store, rank, size)
        kind = ProcessGroup.BackendType.NCCL
    else:
        backend = dist.ProcessGroupGloo(store, rank, size, timedelta(seconds=args.pg_timeout))
        kind = ProcessGroup.BackendType.GLOO
    group = ProcessGroup(store, rank, size)
    group._register_backend(device, kind, backend)
    group._set_default_backend(kind)
    return group


def share_state(trainer: Trainer, step: int) -> int:
    """From the fresh group's rank 0 (the survivor) to the others: the optimizer's momentum and the step
    to resume at (DDP's construction broadcast the parameters already). Returns that step."""
    import torch
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    for buf in momentum_buffers(trainer.opt, list(trainer.model.parameters())):
        trainer.group.broadcast([buf], opts).wait()
    at = torch.tensor([float(step)], device=trainer.device)
    trainer.group.broadcast([at], opts).wait()
    return int(at.item())


def train_after(args: argparse.Namespace, trainer: Trainer, start: int) -> int:
    """--steps-after steps on the new group from ``start`` (the step the loss interrupted); then the checks."""
    import torch

    rank, world = trainer.group.rank(), trainer.group.size()
    params = list(trainer.model.parameters())
    state = copy.deepcopy(trainer.model.state_dict())
    momentum = [b.clone() for b in momentum_buffers(trainer.opt, params)]
    losses = []
    try:
        for i in range(args.steps_after):
            losses.append(trainer.step(start + i))
            if i == 0:
                mark("FIRST_STEP", f"world={world}")  # (f): the death to here
    except Exception as exc:  # the new group must train
        mark("TRAIN_FAILED", f"{type(exc).__name__}:", " ".join(str(exc).split())[:300])
        sys.stdout.flush()
        os._exit(5)
    finite = all(math.isfinite(v) for v in losses)
    expected = reference(state, momentum, start, args.steps_after, args, trainer.device, rank, world)
    worst = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, expected))
    from torch_peer_watcher.groups import released_wakes  # proxy threads the background release of a shrunk parent woke

    mark("TRAIN_DONE", f"world={world}", f"rank={rank}", f"release_wakes={len(released_wakes())}",
         f"digest={params_digest(trainer.model)}", f"finite={finite}",
         f"worst_rel={worst:.3e}", f"first={losses[0]:.6g}", f"last={losses[-1]:.6g}",
         f"losses={','.join(f'{v:.6g}' for v in losses)}", f"reference={','.join(f'{v:.6g}' for v in expected)}")  # fmt: skip
    ok = probe_context(trainer.device)
    trainer.watcher.stop()
    sys.stdout.flush()
    # Skip process-group destructors: the old group's may block on its aborted communicators.
    os._exit(0 if ok and finite and worst <= LOSS_RTOL else 5)


def replacement(args: argparse.Namespace, device: Any) -> int:
    """Host the fresh store from the start; join the survivors' fresh world, receive the model, train."""
    import torch

    started = time.monotonic()
    warm_up(args, device)
    mark("READY", "replacement", f"warm_s={time.monotonic() - started:.4f}")
    announce_standby(args.rendezvous_dir)
    # Another seed: the weights must come from the survivor's broadcast, not from the same start.
    model = make_model(args.width, args.seed + 99, device)
    opt = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE, momentum=MOMENTUM)
    try:
        group = fresh_world(args, device, rank=2)
        mark("GROUP_READY", f"size={group.size()}")
        trainer = Trainer(args, model, opt, group, device, _NoWatcher())
        start = share_state(trainer, -1)
    except Exception as exc:  # reported with the stage it broke
        mark("RECOVER_FAILED", f"{type(exc).__name__}:", " ".join(str(exc).split())[:300])
        sys.stdout.flush()
        os._exit(5)
    return train_after(args, trainer, start)


def warm_up(args: argparse.Namespace, device: Any) -> None:
    """A standby's warm-up before the fault: what a cold process pays on its first DDP step, paid now.

    The fresh world's first collectives wait for their slowest member, and a replacement that never ran a
    step is cold: on a GPU its first NCCL communicator loads NCCL and reads the host (NVML, the network
    plugins), and its first forward and backward pass load their kernels and cuBLAS. A step of DDP over a
    group of one (on a store of its own) does all of it; the model is a throwaway of the same shapes. On
    one H100 over NCCL's network the survivors' first step after the death came 0.51 s after it with this
    warm-up against 1.53 s without (docs/records/2026-12-06-peer-loss-net-one-h100.md, run I). On a CPU it
    warms little (the optimizer, made before the fault, already imported torch._dynamo) and costs little.
    """
    import torch
    import torch.distributed as dist

    model = make_model(args.width, args.seed + 98, device)
    opt = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE, momentum=MOMENTUM)
    trainer = Trainer(args, model, opt, own_group(args, dist.HashStore(), 0, 1, device), device, _NoWatcher())
    trainer.step(0)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def announce_standby(rendezvous_dir: Path) -> None:
    """Say that the standby is warm, in a file that appears whole (written aside, then renamed)."""
    partial = rendezvous_dir / f"{STANDBY_FILE}.{os.getpid()}.partial"
    partial.write_text("warm\n")
    os.replace(partial, rendezvous_dir / STANDBY_FILE)


def standby_warm(rendezvous_dir: Path, timeout_s: float) -> bool:
    """Whether the standby said it is warm within ``timeout_s`` (waits for it until then)."""
    deadline = time.monotonic() + timeout_s
    while not (rendezvous_dir / STANDBY_FILE).exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


class _NoWatcher:
    """The replacement joins after the loss: nothing to watch, nothing to stop."""

    def raise_if_lost(self, group: Any = None) -> None:
        return None

    def stop(self) -> None:
        return None


if __name__ == "__main__":
    sys.exit(main())
