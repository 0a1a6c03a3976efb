"""One process of a peer-loss case (started by :mod:`torch_dist_check.peerloss.cases`).

Roles:
- ``survivor`` (rank 0): issues the op on group A in its main thread until an exception reaches
  Python; in the two-world case a second thread runs group B's loop meanwhile and records its
  longest iteration and whether every result was exact. Then it probes its device (is the CUDA
  context intact?) and builds a fresh group with the replacement process, whose all_reduce must
  be exact.
- ``victim`` (rank 1): runs the op with the survivor, then SIGKILLs (or SIGSTOPs) itself.
- ``live`` (rank 2, two-world case): group B's other member; its loop never touches A.
- ``busy`` (rank 1, false-positive case): computes for ``--busy-s`` seconds while the survivor
  waits inside an all_reduce, then joins it; nothing may be declared lost.
- ``replacement``: hosts the fresh group's store from the start (its startup is paid before the
  fault) and joins the survivor's fresh group.
- ``shrink`` case: a world of 3, group S = all three; ``survivor`` (rank 0) and ``partner`` (rank 1)
  run S's op, the ``victim`` (rank 2) dies. Both survivors watch S with ``recovery="shrink"``: the
  watcher's verdict shrinks S (``shrink_group`` with ``SHRINK_ABORT``), the op raises
  ``PeerLostError`` under ``guard()``, and both run an all_reduce on the shrunk group, which must be
  exact. No replacement process, no new rendezvous.
- node cases (``--nodes``; :data:`NODE_KINDS`): ``survivor`` (rank 0, node 0, the store's host) and
  ``peer`` (rank 1, another node) run exact all_reduces on the watched world while the launcher
  brings a fault between their nodes (a cut link, a node killed, a lossy link, a cut that heals). A
  rank that gets ``PeerLostError`` trains on (the survivor: a fresh group with the ``replacement`` on
  its node); one that gets ``PartitionedError`` marks PARTITIONED and stops, writing nothing; one that
  gets any other error marks nothing more and fails, as an application that catches neither would.

Each step is a timestamped marker line (``TDC <EVENT> <unix time> ...``), as in fault_worker; the
launcher bounds every wait. Groups: the single-world case runs the op on the default group, the
two-world case on A = new_group([0, 1]) with B = new_group([0, 2]). Stores: rank 0 hosts the world's
and the replacement the fresh group's, each on a port the kernel gave it (:mod:`rendezvous`).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from torch_dist_check.checks.fault_worker import mark, stacks_on_request
from torch_dist_check.harness.rendezvous import host_store, join_store

OPS = ("allreduce", "sendrecv", "coalesced")
# The node cases' gloo world: an op gloo itself never wakes ends by this timeout, not the 300 s default. A side
# that got no CPU for 2.5 s or more at a healed cut had its verdict, yet its all_reduce waited in gloo's
# UnboundBuffer::waitSend on a pair gloo had closed itself, with nothing left for the watcher to cut: 2 of 6
# runs of gloo alone on two namespace nodes (docs/records/2026-12-06-brief-cut-hang-gloo.md). It then raises
# under the watcher's guard as the verdict says, late; the run's peer_exception_s shows how late.
NODE_GLOO_TIMEOUT_S = 15.0

# Faults between namespace nodes (torch_dist_check.nodes.namespaces), brought by the launcher.
NODE_KINDS = ("partition", "node-kill", "store-lost", "lossy-link", "brief-cut", "heal-stop")
PATTERNS = ("wait", "enqueue", "poll")


def node_gloo_timeout_s() -> float:
    """The node cases' gloo op timeout: :data:`NODE_GLOO_TIMEOUT_S`, or longer where the watcher's heartbeat
    timeout (its verdict's pace) is long: an op blocked on a lost peer must outlast the verdict that ends it."""
    from torch_peer_watcher.settings import WatcherConfigError, WatcherSettings

    try:
        verdict_pace_s = WatcherSettings.from_env().timeout_s
    except WatcherConfigError:  # the watcher's start says what is wrong with its settings
        verdict_pace_s = 0.0
    return max(NODE_GLOO_TIMEOUT_S, 3 * verdict_pace_s)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The worker's arguments (the launcher sets them; not meant for people)."""
    p = argparse.ArgumentParser(prog="python -m torch_dist_check.peerloss.worker")
    p.add_argument("--role", choices=("survivor", "victim", "live", "busy", "partner", "replacement", "peer"), required=True)
    p.add_argument("--kind", choices=("single", "two-world", "false-positive", "shrink", *NODE_KINDS), required=True)
    p.add_argument("--backend", choices=("nccl", "gloo"), required=True)
    p.add_argument("--op", choices=OPS, default="allreduce")
    p.add_argument("--watcher", choices=("on", "off"), default="off")
    p.add_argument("--rendezvous-dir", type=Path, required=True, help="where the stores' hosts publish their ports")
    p.add_argument("--device", type=int, default=0, help="the GPU index (nccl), from the case's placement")
    p.add_argument("--kill-after", type=float, default=2.0)
    p.add_argument("--signal", choices=("kill", "stop"), default="kill")
    p.add_argument("--pattern", choices=PATTERNS, default="wait")
    p.add_argument("--issue-for", type=float, default=120.0)
    p.add_argument("--b-iters", type=int, default=100)
    p.add_argument("--b-period", type=float, default=0.05)
    p.add_argument("--busy-s", type=float, default=60.0)
    p.add_argument("--pg-timeout", type=float, default=300.0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run one role; the survivor exits 0 once its fresh group proved exact."""
    args = parse_args(argv)
    import torch

    device = _device(args)
    if args.role == "replacement":
        return replacement(args, device)
    import torch.distributed as dist

    if args.watcher == "on" or args.kind in ("shrink", *NODE_KINDS):
        # As a user imports it: before the first group, which is then made under the watcher's settings of
        # PyTorch's NCCL watchdog (torch_peer_watcher.watchdog).
        import torch_peer_watcher  # noqa: F401
    rank = {"survivor": 0, "victim": 2 if args.kind == "shrink" else 1, "busy": 1, "partner": 1, "live": 2, "peer": 1}[args.role]
    world_size = 3 if args.kind in ("two-world", "shrink") else 2
    port_file = args.rendezvous_dir / "world.port"
    store = host_store(port_file, world_size, args.pg_timeout) if rank == 0 else join_store(port_file, world_size, args.pg_timeout)
    # The shrink case binds the world to its GPU: shrink_group gives the shrunk group its backend on
    # the parent's bound device (without one, on the CPU, where NCCL cannot serve CUDA tensors).
    bound = {"device_id": device} if args.kind == "shrink" and device.type == "cuda" else {}
    timeout = args.pg_timeout
    if args.kind in NODE_KINDS and args.backend == "gloo":
        timeout = min(timeout, node_gloo_timeout_s())
    dist.init_process_group(args.backend, store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout), **bound)  # fmt: skip
    group_a = group_b = None
    if args.kind == "two-world":
        group_a = dist.new_group([0, 1])
        group_b = dist.new_group([0, 2])
    if args.kind == "shrink":
        return shrink_case(args, device, rank)
    if args.kind in NODE_KINDS:
        return node_case(args, device, rank)
    watcher = None
    if args.watcher == "on":
        import torch_peer_watcher

        watcher = torch_peer_watcher.start()
        if group_a is not None and rank in (0, 1):
            watcher.watch(group_a)
        if group_b is not None and rank in (0, 2):
            watcher.watch(group_b)
    t = torch.ones(1 << 16, device=device)
    if rank in (0, 1):
        _op(args.op, t, rank, group_a, "wait")
    if group_b is not None and rank in (0, 2):
        dist.all_reduce(t, group=group_b)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    mark("READY", args.role)

    if args.role == "victim":
        return victim(args, t, group_a)
    if args.role == "live":
        b_loop(args, group_b, device)
        _goodbye(watcher)
        sys.stdout.flush()
        os._exit(0)
    if args.role == "busy":
        return busy(args, t, watcher)
    return survivor(args, t, device, group_a, group_b, watcher)


def _device(args: argparse.Namespace) -> Any:
    import torch

    if args.backend != "nccl":
        return torch.device("cpu")
    # The launcher's placement chose the GPU (torch_dist_check.harness.placement).
    torch.cuda.set_device(args.device)
    return torch.device("cuda", args.device)


def _op(op: str, t: Any, rank: int, group: Any, pattern: str = "wait") -> None:
    """One step of the op on ``group`` (None: default group) between ranks 0 and 1, in the survivor's pattern.

    ``wait``: the call, then ``.item()`` on CUDA (a training step waits for its device sooner or
    later); ``enqueue``: the call alone (on NCCL the host keeps enqueuing into a dead group);
    ``poll``: ``async_op=True`` and ``is_completed()`` polled, then ``wait()`` (Multiworld's pattern).
    """
    import torch.distributed as dist

    async_op = pattern == "poll"
    if op == "allreduce":
        work = dist.all_reduce(t, group=group, async_op=async_op)
    elif op == "coalesced":
        half = t.numel() // 2
        work = dist.all_reduce_coalesced([t[:half], t[half:]], group=group, async_op=async_op)
    elif rank == 1:
        work = (dist.isend if async_op else dist.send)(t, dst=0, group=group)
    else:
        work = (dist.irecv if async_op else dist.recv)(t, src=1, group=group)
    if async_op:
        # all_reduce_coalesced hands back a Future (done()), the others a Work (is_completed()).
        finished = work.done if hasattr(work, "done") else work.is_completed
        while not finished():
            time.sleep(0.001)
        work.wait()
    if t.is_cuda and pattern != "enqueue":
        t.view(-1)[0].item()


def victim(args: argparse.Namespace, t: Any, group_a: Any) -> int:
    """Run the op with the survivor, then die (SIGKILL) or freeze (SIGSTOP) in the middle of the loop."""
    end = time.monotonic() + args.kill_after
    while time.monotonic() < end:
        t.fill_(1)
        # The pattern is the survivor's; the victim just takes part until it dies.
        _op(args.op, t, 1, group_a, "wait")
        time.sleep(0.01)
    mark("KILL", args.signal)
    os.kill(os.getpid(), signal.SIGKILL if args.signal == "kill" else signal.SIGSTOP)
    time.sleep(3600)
    return 4


def b_loop(args: argparse.Namespace, group_b: Any, device: Any) -> dict[str, Any]:
    """Group B's loop (same count on both members): longest iteration, inexact results."""
    import torch
    import torch.distributed as dist

    t = torch.ones(1 << 16, device=device)
    longest = 0.0
    inexact = 0
    error = ""
    done = 0
    for _ in range(args.b_iters):
        started = time.monotonic()
        try:
            t.fill_(1)
            dist.all_reduce(t, group=group_b)
            ok = bool((t == 2).all().item())
        except Exception as exc:  # B must not fail: record it, the launcher judges
            error = f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
            break
        longest = max(longest, time.monotonic() - started)
        inexact += 0 if ok else 1
        done += 1
        time.sleep(args.b_period)
    mark("B_DONE", f"iterations={done}", f"longest_s={longest:.6f}", f"inexact={inexact}", f"error={error or '-'}")
    return {"iterations": done, "longest_s": longest, "inexact": inexact, "error": error}


def survivor(args: argparse.Namespace, t: Any, device: Any, group_a: Any, group_b: Any, watcher: Any) -> int:
    """Issue the op until it raises, then prove the process, its device and a fresh group work."""
    b_thread = None
    if group_b is not None:
        b_thread = threading.Thread(target=b_loop, args=(args, group_b, device), daemon=True)
        b_thread.start()
    if args.kind == "false-positive":
        return survivor_waits_for_busy_peer(args, t, device, watcher)
    deadline = time.monotonic() + args.issue_for
    try:
        while time.monotonic() < deadline:
            t.fill_(1)
            _op(args.op, t, 0, group_a, args.pattern)
            time.sleep(0.01)
    except Exception as exc:  # the point of the case: the peer's death surfaces as a Python exception
        mark("CAUGHT", f"{type(exc).__name__}:", " ".join(str(exc).split())[:300])
    else:
        mark("NO_ERROR")
        sys.stdout.flush()
        os._exit(4)
    mark("CPU_OK", sum(range(1000)))
    if args.backend == "nccl":
        close_leaked_nccl_groups()
    if watcher is not None:
        loss = watcher.wait_for_loss(group_a, timeout_s=30)
        if loss is not None:
            mark("LOSS", f"{loss.detected_at:.6f}", f"abort_s={loss.abort_s}", f"groups={','.join(loss.groups)}",
                 f"cut={loss.sockets_cut}", f"silent_s={loss.silent_s}", loss.cause)  # fmt: skip
    if not probe_context(device):
        sys.stdout.flush()
        os._exit(6)
    fresh_group(args, device, rank=0)
    if b_thread is not None:
        b_thread.join()
    sys.stdout.flush()
    # Skip process-group destructors: they may block on the aborted communicators.
    os._exit(0)


def survivor_waits_for_busy_peer(args: argparse.Namespace, t: Any, device: Any, watcher: Any) -> int:
    """Wait inside one all_reduce while the peer computes; it must complete exactly, nothing lost."""
    import torch.distributed as dist

    started = time.monotonic()
    t.fill_(1)
    try:
        dist.all_reduce(t)
        exact = bool((t == 2).all().item())
    except Exception as exc:  # a false positive: the watcher aborted a healthy group
        mark("FP_FAILED", f"{type(exc).__name__}:", " ".join(str(exc).split())[:300])
        sys.stdout.flush()
        os._exit(7)
    losses = watcher.losses() if watcher is not None else []
    mark("FP_DONE", f"waited_s={time.monotonic() - started:.3f}", f"exact={exact}", f"losses={len(losses)}")
    _goodbye(watcher)
    sys.stdout.flush()
    os._exit(0 if exact and not losses else 7)


def busy(args: argparse.Namespace, t: Any, watcher: Any) -> int:
    """Compute for --busy-s (half pure Python, holding the GIL in turns; half tensor math), then join."""
    import torch
    import torch.distributed as dist

    mark("BUSY", f"{args.busy_s}")
    end = time.monotonic() + args.busy_s
    a = torch.randn(256, 256, device=t.device)
    while time.monotonic() < end:
        total = 0
        for i in range(200_000):
            total += i * i
        for _ in range(20):
            a = torch.tanh(a @ a)
    t.fill_(1)
    dist.all_reduce(t)
    exact = bool((t == 2).all().item())
    losses = watcher.losses() if watcher is not None else []
    mark("BUSY_DONE", f"exact={exact}", f"losses={len(losses)}")
    _goodbye(watcher)
    sys.stdout.flush()
    os._exit(0 if exact and not losses else 7)


def probe_context(device: Any) -> bool:
    """Is the device still usable (the CUDA context survived)? Marks GPU_OK or CONTEXT_LOST."""
    import torch

    try:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        value = int(torch.arange(8, device=device).sum().item())
    except Exception as exc:  # e.g. "an illegal memory access was encountered": the context is lost
        mark("CONTEXT_LOST", f"{type(exc).__name__}:", " ".join(str(exc).split())[:300])
        return False
    mark("GPU_OK", value, device.type)
    return value == 28


def close_leaked_nccl_groups() -> None:
    """What an application does after catching NCCL's error itself (without guard()): close the group
    a failed send/recv left open in this thread, or its next group never initialises (issue 20)."""
    from torch_peer_watcher.ncclgroups import close_leaked_groups

    mark("NCCL_GROUPS", f"closed={close_leaked_groups()}")


def fresh_group(args: argparse.Namespace, device: Any, rank: int) -> bool:
    """Build a new two-rank group with the replacement process and check one all_reduce."""
    import torch
    import torch.distributed as dist

    try:
        port_file = args.rendezvous_dir / "fresh.port"
        # The replacement (rank 1) hosts the store: it started before the fault, the survivor joins.
        store = host_store(port_file, 2, 60) if rank == 1 else join_store(port_file, 2, 60)
        if args.backend == "nccl":
            group = dist.ProcessGroupNCCL(store, rank, 2)
        else:
            group = dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=60))
        t = torch.ones(1 << 16, device=device)
        group.allreduce([t]).wait()
        exact = bool((t == 2).all().item())
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except Exception as exc:  # reported with the stage it broke
        mark("FRESH_FAILED", f"{type(exc).__name__}:", " ".join(str(exc).split())[:300])
        return False
    # PyTorch 2.6.0's gloo backend has no abort() in Python (it came with ProcessGroup.abort, 2.7): no figure there.
    if rank == 0 and exact and hasattr(group, "abort"):
        # The fresh communicator is idle now: how long its abort takes (NCCL's proxy threads).
        started = time.monotonic()
        group.abort()
        mark("FRESH_OK", f"idle_abort_s={time.monotonic() - started:.6f}")
    else:
        mark("FRESH_OK" if exact else "FRESH_INEXACT")
    return exact


def shrink_case(args: argparse.Namespace, device: Any, rank: int) -> int:
    """The shrink case's three ranks: two survivors shrink S after the victim's death, then use it."""
    import torch
    import torch.distributed as dist
    import torch_peer_watcher

    group = dist.new_group([0, 1, 2])
    t = torch.ones(1 << 16, device=device)
    _op(args.op, t, rank, group, "wait")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if rank == 0:
        exit_if_shrink_unsupported(group)
    # Only the default group's store: the world itself is not watched, nothing of it is aborted.
    watcher = torch_peer_watcher.start(watch_world=False)
    watcher.watch(group, recovery="shrink")
    mark("READY", args.role)
    if args.role == "victim":
        return victim(args, t, group)
    deadline = time.monotonic() + args.issue_for
    try:
        with watcher.guard(group):
            while time.monotonic() < deadline:
                # A verdict that came between two steps stops the loop before it touches S again.
                watcher.raise_if_lost(group)
                t.fill_(1)
                _op(args.op, t, rank, group, args.pattern)
                time.sleep(0.01)
    except Exception as exc:  # the point of the case; the launcher checks the type (PeerLostError)
        mark("CAUGHT", f"{type(exc).__name__}:", " ".join(str(exc).split())[:300])
        # guard() closed what a failed send/recv left open in this thread.
        mark("NCCL_GROUPS", f"closed={getattr(exc, 'nccl_groups_closed', 0)}")
    else:
        mark("NO_ERROR")
        sys.stdout.flush()
        os._exit(4)
    mark("CPU_OK", sum(range(1000)))
    shrunk = watcher.shrunk(group, timeout_s=60)
    if shrunk is not None:
        mark("SHRUNK_GOT")  # (e) less this: the shrunk group's first all_reduce
    loss = watcher.wait_for_loss(group, timeout_s=5)
    if loss is not None:
        mark("LOSS", f"{loss.detected_at:.6f}", f"abort_s={loss.abort_s}", f"groups={','.join(loss.groups)}",
             f"shrunk={','.join(loss.shrunk) or '-'}", f"errors={len(loss.errors)}", loss.cause)  # fmt: skip
    if shrunk is None:
        why = "; ".join(loss.errors) if loss is not None and loss.errors else "no shrunk group within 60 s"
        mark("SHRINK_FAILED", " ".join(why.split())[:300])
        sys.stdout.flush()
        os._exit(5)
    try:
        t = torch.ones(1 << 16, device=device)
        dist.all_reduce(t, group=shrunk)
        exact = bool((t == shrunk.size()).all().item())
    except Exception as exc:  # the shrunk group must work
        mark("SHRINK_FAILED", f"{type(exc).__name__}:", " ".join(str(exc).split())[:300])
        sys.stdout.flush()
        os._exit(5)
    mark("SHRUNK_OK" if exact else "SHRUNK_INEXACT", f"size={shrunk.size()}")
    ok = probe_context(device)
    _goodbye(watcher)
    sys.stdout.flush()
    os._exit(0 if exact and ok else 5)


def node_case(args: argparse.Namespace, device: Any, rank: int) -> int:
    """One rank of a fault between nodes: exact all_reduces on the watched world until the fault, or
    until the survivor's ``--issue-for`` is up (both stop on the same iteration: rank 0 raises a flag
    in the reduced tensor's last element); then train on, or stop if this side was cut off."""
    import torch
    import torch.distributed as dist
    import torch_peer_watcher
    from torch_peer_watcher import PartitionedError, PeerLostError

    # A side the judge finds hung tells it where its threads are (trainjudge.record_hang), and when its watcher
    # handled a loss (the loop's own markers say nothing of a verdict that never reached it).
    stacks_on_request()
    watcher = torch_peer_watcher.start()
    watcher.on_peer_lost(_mark_handled)
    t = torch.ones(1 << 16, device=device)
    dist.all_reduce(t)
    mark("READY", args.role, f"group_timeout_s={_world_timeout_s(device)}")
    deadline = time.monotonic() + args.issue_for
    iterations = inexact = 0
    slowest = 0.0  # the longest all_reduce: how slow the link made it (lossy-link)
    world = dist.group.WORLD  # asked by name: lost() of no group forgets a rank that linked again, not what it broke
    try:
        with watcher.guard(world):
            while True:
                watcher.raise_if_lost(world)
                t.fill_(1)
                t[-1] += 1 if rank == 0 and time.monotonic() > deadline else 0
                began = time.monotonic()
                dist.all_reduce(t)
                # An all_reduce that an abort cut short returns on NCCL without an error, with whatever the
                # kernel had: that step is void (a verdict is at hand; raise_if_lost ends the loop next).
                if not bool((t[:-1] == 2).all().item()) and watcher.lost(world) is None:
                    inexact += 1
                    # Marked at once: a verdict later in the loop ends it without LOOP_DONE's count.
                    if inexact == 1:
                        mark("INEXACT", f"iteration={iterations}")
                slowest = max(slowest, time.monotonic() - began)
                iterations += 1
                if t[-1].item() > 2:
                    break
                time.sleep(0.01)
    except PartitionedError as exc:
        mark("CAUGHT", f"{type(exc).__name__}:", " ".join(str(exc).split())[:300])
        _mark_loss(exc.loss)
        # The cut-off side stops here: no new group, no store write, no checkpoint. Its device must
        # still be usable (the goal "the GPU stays usable everywhere").
        usable = probe_context(device)
        mark("PARTITIONED", f"rank={rank}", f"context={'ok' if usable else 'lost'}")
        sys.stdout.flush()
        os._exit(0)
    except Exception as exc:  # PeerLostError on the side that keeps the store
        mark("CAUGHT", f"{type(exc).__name__}:", " ".join(str(exc).split())[:300])
        loss = watcher.wait_for_loss(None, timeout_s=5)
        if loss is not None:
            _mark_loss(loss)
        if args.kind == "heal-stop":
            # The store's side stops its watcher in its recovery, as HSDP's rejoin and auto-start's hook before
            # destroy_process_group do: its listener closes, and the peer's redial is refused (issue 68). It keeps
            # the job's store up meanwhile (its fresh group takes it down), until the peer has judged too.
            timeout_s = watcher.settings.timeout_s
            _goodbye(watcher)
            time.sleep(2 * timeout_s)
        if rank != 0:
            if not isinstance(exc, PeerLostError):
                # No verdict turned the error into PeerLostError: the application's recovery never runs.
                sys.stdout.flush()
                os._exit(5)
            # Only a rank that is not cut off gets here; were it on the cut side, it would train on alone.
            mark("TRAINS_ON", f"rank={rank}")
            sys.stdout.flush()
            os._exit(0)
        exact = probe_context(device) and fresh_group(args, device, rank=0)
        sys.stdout.flush()
        os._exit(0 if exact else 5)
    mark("LOOP_DONE", f"iterations={iterations}", f"inexact={inexact}", f"losses={len(watcher.losses())}", f"slowest={slowest:.4f}")
    _goodbye(watcher)
    sys.stdout.flush()
    os._exit(0 if not inexact else 5)


def _world_timeout_s(device: Any) -> float | None:
    """The timeout the world's backend runs its ops under (None where the backend does not say)."""
    import torch.distributed as dist

    try:
        return dist.group.WORLD._get_backend(device).options._timeout.total_seconds()
    except (AttributeError, RuntimeError):
        return None


def _mark_handled(loss: Any) -> None:
    """The watcher handled a loss (its groups aborted): marked from its thread, whatever the loop does."""
    mark("HANDLED", f"rank={loss.rank}", f"sockets_cut={loss.sockets_cut}", f"groups={','.join(loss.groups) or '-'}",
         " ".join(loss.cause.split())[:200], f"| cut off: {' '.join(loss.cut_off.split())[:200]}" if loss.cut_off else "")  # fmt: skip


def _mark_loss(loss: Any) -> None:
    mark("LOSS", f"{loss.detected_at:.6f}", f"silent_s={loss.silent_s}", f"abort_s={loss.abort_s}",
         f"cut_off={'yes' if loss.cut_off else 'no'}", loss.cause)  # fmt: skip


def exit_if_shrink_unsupported(group: Any) -> None:
    """Mark UNSUPPORTED with the reason and end the process if this PyTorch cannot shrink ``group``
    (rank 0 only: the launcher reads one reason and skips the case)."""
    from torch_peer_watcher.groups import shrink_unsupported

    missing = shrink_unsupported(group)
    if missing:
        mark("UNSUPPORTED", missing)
        sys.stdout.flush()
        os._exit(0)


def replacement(args: argparse.Namespace, device: Any) -> int:
    """Host the fresh group's store, wait for the survivor, run the fresh all_reduce."""
    import torch

    if device.type == "cuda":
        torch.ones(1, device=device).sum().item()
    mark("READY", "replacement")
    exact = fresh_group(args, device, rank=1)
    sys.stdout.flush()
    os._exit(0 if exact else 5)


def _goodbye(watcher: Any) -> None:
    if watcher is not None:
        watcher.stop()


if __name__ == "__main__":
    sys.exit(main())
