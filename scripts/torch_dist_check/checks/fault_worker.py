"""One rank of a fault-injection case (started by :mod:`torch_dist_check.checks.fault`, two at a time).

Rank 1 SIGKILLs itself after a warm-up. Rank 0 keeps issuing the collective until an exception
reaches Python, proves the CPU side is alive, then proves its device is usable again. Each step is
printed as a timestamped marker line (``TDC <EVENT> <unix time> ...``) that the launcher reads;
the launcher, not this process, bounds every wait.

``--recover abort`` makes the survivor abort its process group after the exception (the recovery an
application owes under TORCH_NCCL_ASYNC_ERROR_HANDLING=0). ``--plant abort`` and ``--plant hang`` make the survivor misbehave on purpose (abort after the
exception, or block before reporting it) so the launcher's verdict can be shown to fail.
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

MARK = "TDC"
# What a launcher sends a worker it judged hung before it kills it: every thread's stack, on the worker's output.
STACKS_SIGNAL = signal.SIGUSR1


def mark(event: str, *extra: object) -> None:
    """Print one timestamped marker line and flush it at once."""
    line = " ".join([MARK, event, f"{time.time():.6f}", *(str(e) for e in extra)])
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def stacks_on_request() -> None:
    """Print every thread's stack on :data:`STACKS_SIGNAL` (:meth:`WorkerProcess.stacks` asks): faulthandler's,
    written in C, so it comes while every Python thread is blocked (a collective, a lock, a wait)."""
    import faulthandler

    faulthandler.register(STACKS_SIGNAL, all_threads=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The worker's arguments (the launcher sets them; not meant for people)."""
    parser = argparse.ArgumentParser(prog="python -m torch_dist_check.checks.fault_worker")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--backend", choices=("nccl", "gloo"), required=True)
    parser.add_argument("--op", choices=("allreduce", "sendrecv"), required=True)
    parser.add_argument("--kill-after", type=float, default=2.0)
    parser.add_argument("--issue-for", type=float, default=150.0)
    parser.add_argument("--plant", choices=("none", "abort", "hang"), default="none")
    parser.add_argument("--recover", choices=("none", "abort"), default="none")
    parser.add_argument("--pg-timeout", type=float, default=60.0)
    parser.add_argument("--rendezvous-dir", type=Path, required=True, help="where rank 0 publishes its store's port")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run one rank of the case; exit 0 only after the survivor's device proved usable."""
    args = parse_args(argv)
    import torch
    import torch.distributed as dist

    if args.backend == "nccl":
        torch.cuda.set_device(args.rank)
        device = torch.device("cuda", args.rank)
    else:
        device = torch.device("cpu")
    # Rank 0 hosts the store on a port the kernel gave it (torch_dist_check.harness.rendezvous).
    from torch_dist_check.harness.rendezvous import host_store, join_store

    port_file = args.rendezvous_dir / "world.port"
    store = (host_store if args.rank == 0 else join_store)(port_file, 2, args.pg_timeout)
    dist.init_process_group(
        args.backend,
        store=store,
        rank=args.rank,
        world_size=2,
        timeout=timedelta(seconds=args.pg_timeout),
        **({"device_id": device} if args.backend == "nccl" else {}),
    )
    t = torch.ones(1 << 16, device=device)
    dist.all_reduce(t)
    if args.op == "sendrecv":
        # Create the two-rank point-to-point communicator before the fault.
        if args.rank == 1:
            dist.send(t, dst=0)
        else:
            dist.recv(t, src=1)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    mark("READY", args.rank)

    if args.rank == 1:
        time.sleep(args.kill_after)
        mark("KILL")
        os.kill(os.getpid(), signal.SIGKILL)

    deadline = time.monotonic() + args.issue_for
    try:
        while time.monotonic() < deadline:
            if args.op == "allreduce":
                work = dist.all_reduce(t, async_op=True)
            else:
                work = dist.irecv(t, src=1)
            if args.backend == "gloo":
                # gloo reports a dead peer on wait(); NCCL reports it on a later enqueue.
                work.wait()
            time.sleep(0.01)
    except Exception as exc:  # the point of the test: the peer's death must surface as a Python exception
        if args.plant == "hang":
            threading.Event().wait()
        message = " ".join(str(exc).split())[:300]
        mark("CAUGHT", f"{type(exc).__name__}:", message)
        if args.plant == "abort":
            os.abort()
        # The CPU side is alive: Python still runs code after the exception.
        mark("CPU_OK", sum(range(1000)))
        if args.recover == "abort":
            # What an application does under TORCH_NCCL_ASYNC_ERROR_HANDLING=0, where PyTorch
            # leaves the broken communicator alone (documented with _abort_process_group).
            try:
                dist.distributed_c10d._abort_process_group()
                mark("ABORTED")
            except Exception as abort_exc:  # reported; the device probe decides the verdict
                mark("ABORT_FAILED", f"{type(abort_exc).__name__}: {abort_exc}"[:200])
        probe_device(device)
        return 0
    mark("NO_ERROR")
    sys.stdout.flush()
    os._exit(4)


def probe_device(device: Any) -> None:
    """Wait until every stream of the device is idle, then compute on it; mark GPU_OK and exit.

    Runs until it succeeds; the launcher decides how long that may take and kills the process if
    it takes too long. Exits with os._exit to skip process-group destructors, which may block on
    an aborted communicator.
    """
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    value = int(torch.arange(8, device=device).sum().item())
    mark("GPU_OK", value)
    sys.stdout.flush()
    os._exit(0 if value == 28 else 5)


if __name__ == "__main__":
    sys.exit(main())
