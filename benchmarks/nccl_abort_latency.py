"""Benchmark: how long ncclCommAbort takes, through PyTorch, for a dead peer's and an idle communicator.

Two ranks share GPU 0 (the placement of torch_dist_check's one-GPU peerloss cases):
- ``--transport net``: each rank gets its own ``NCCL_HOSTID``, so NCCL sees two hosts and connects
  them through its network (Socket unless a plugin is configured);
- ``--transport p2p``: ``NCCL_MULTI_RANK_GPU_ENABLE=1`` (NCCL >= 2.30), in-node P2P.

Cases:
- ``dead``: rank 1 SIGKILLs itself while both run all_reduce + ``.item()`` in a loop; once the
  launcher has seen it die, it tells rank 0, whose second thread aborts the default group's NCCL
  backend (``ProcessGroupNCCL.abort()``, i.e. ``ncclCommAbort``) while its main thread is blocked in
  the dead collective. Reported: the abort call's duration, and when the main thread's exception came.
- ``idle``: both ranks finish an all_reduce, synchronize, meet at the store, then each aborts.

Which NCCL is measured is whatever libnccl this PyTorch has mapped: each run reports its path and
the version that library's ``ncclGetVersion`` returns (``torch.cuda.nccl.version()`` reports the
version PyTorch was built with). One JSON line per run on stdout, a summary on stderr.

Usage: python benchmarks/nccl_abort_latency.py --transport net --case dead --runs 5 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

KILL_AFTER_S = 1.0
RUN_TIMEOUT_S = 60.0


@dataclass
class Run:
    """One run's figures, from rank 0 (abort_s, exception_s) and rank 1 (idle: its own abort_s)."""

    transport: str
    case: str
    nccl: str
    abort_s: float
    peer_abort_s: float | None
    exception_s: float | None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The launcher's and the workers' arguments."""
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--transport", choices=("net", "p2p"), required=True)
    p.add_argument("--case", choices=("dead", "idle"), required=True)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--json", help="write every run and the summary here")
    p.add_argument("--role", choices=("rank0", "rank1"), help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def worker_env(transport: str, rank: int) -> dict[str, str]:
    """The environment that places both ranks on GPU 0 with the chosen transport."""
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES=os.environ.get(
        "CUDA_VISIBLE_DEVICES", "0"))
    if transport == "net":
        env["NCCL_HOSTID"] = f"abort-latency-host-{rank}"
    else:
        env["NCCL_MULTI_RANK_GPU_ENABLE"] = "1"
    return env


def one_run(args: argparse.Namespace) -> Run:
    """Start both ranks around a store this process hosts, feed rank 0 the death, collect its figures."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, world_size=3, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=RUN_TIMEOUT_S))
    cmd = [sys.executable, __file__, "--transport", args.transport, "--case", args.case, "--port", str(store.port)]
    procs = [subprocess.Popen([*cmd, "--role", f"rank{r}"], env=worker_env(args.transport, r),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for r in (0, 1)]
    try:
        if args.case == "dead":
            procs[1].wait(timeout=RUN_TIMEOUT_S)
            assert procs[0].stdin is not None
            procs[0].stdin.write("dead\n")
            procs[0].stdin.flush()
        out0, _ = procs[0].communicate(timeout=RUN_TIMEOUT_S)
        out1 = "" if args.case == "dead" else procs[1].communicate(timeout=RUN_TIMEOUT_S)[0]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    r0 = _result(out0, procs[0].returncode)
    r1 = _result(out1, procs[1].returncode) if args.case == "idle" else {}
    return Run(args.transport, args.case, r0["nccl"], r0["abort_s"], r1.get("abort_s"), r0.get("exception_s"))


def _result(out: str, rc: int | None) -> dict[str, Any]:
    for line in out.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise SystemExit(f"a rank ended (exit {rc}) without a result; its output:\n{out}")


def loaded_nccl() -> str:
    """The version and path of the libnccl mapped into this process, from its own ncclGetVersion."""
    import ctypes

    with open("/proc/self/maps") as maps:
        path = next(line.split()[-1] for line in maps if "libnccl.so" in line)
    code = ctypes.c_int()
    ctypes.CDLL(path).ncclGetVersion(ctypes.byref(code))
    # NCCL_VERSION_CODE since 2.9: major * 10000 + minor * 100 + patch.
    major, rest = divmod(code.value, 10000)
    return f"{major}.{rest // 100}.{rest % 100} ({path})"


def worker(args: argparse.Namespace) -> int:
    """One rank: init NCCL on GPU 0, run the case, print ``RESULT {json}``."""
    import torch
    import torch.distributed as dist

    rank = 0 if args.role == "rank0" else 1
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", args.port, is_master=False, timeout=timedelta(seconds=RUN_TIMEOUT_S))
    # device_id: the communicator exists before the first op (eager init), as in the suite.
    dist.init_process_group("nccl", store=store, rank=rank, world_size=2, device_id=device,
                            timeout=timedelta(seconds=RUN_TIMEOUT_S))
    backend = dist.distributed_c10d._get_default_group()._get_backend(device)
    nccl = loaded_nccl()
    t = torch.ones(1 << 16, device=device)
    dist.all_reduce(t)
    torch.cuda.synchronize(device)
    if args.case == "idle":
        # Both ranks abort a live, idle communicator at about the same time.
        store.add("idle", 1)
        while store.add("idle", 0) < 2:
            time.sleep(0.001)
        started = time.monotonic()
        backend.abort()
        print("RESULT " + json.dumps({"nccl": nccl, "abort_s": time.monotonic() - started}), flush=True)
        os._exit(0)
    if rank == 1:
        end = time.monotonic() + KILL_AFTER_S
        while time.monotonic() < end:
            dist.all_reduce(t)
            t.view(-1)[0].item()
        os.kill(os.getpid(), signal.SIGKILL)
    figures: dict[str, Any] = {"nccl": nccl}
    aborted = threading.Event()

    def abort_on_death() -> None:
        sys.stdin.readline()
        figures["abort_started"] = time.monotonic()
        backend.abort()
        figures["abort_s"] = time.monotonic() - figures["abort_started"]
        aborted.set()

    threading.Thread(target=abort_on_death, daemon=True).start()
    try:
        while True:
            dist.all_reduce(t)
            t.view(-1)[0].item()
    except Exception:  # the dead collective fails once its communicator is aborted
        figures["exception_s"] = time.monotonic() - figures.get("abort_started", time.monotonic())
    aborted.wait(RUN_TIMEOUT_S)
    figures.pop("abort_started", None)
    print("RESULT " + json.dumps(figures), flush=True)
    os._exit(0)


def main(argv: list[str] | None = None) -> int:
    """Run the case ``--runs`` times; print one JSON line per run and a summary."""
    args = parse_args(argv)
    if args.role:
        return worker(args)
    runs = []
    for _ in range(args.runs):
        run = one_run(args)
        runs.append(run)
        print(json.dumps(asdict(run)), flush=True)
    aborts = [r.abort_s for r in runs]
    summary = {"transport": args.transport, "case": args.case, "nccl": runs[0].nccl, "runs": len(runs),
               "abort_s_min": min(aborts), "abort_s_median": statistics.median(aborts), "abort_s_max": max(aborts)}
    print(f"nccl {summary['nccl']} {args.transport} {args.case}: abort {min(aborts):.4f}-{max(aborts):.4f} s "
          f"(median {summary['abort_s_median']:.4f}) over {len(runs)} runs", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "runs": [asdict(r) for r in runs]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
