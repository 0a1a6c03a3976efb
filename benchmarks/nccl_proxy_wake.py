"""Issue 74's A/B on one GPU: how long stock NCCL's abort takes after a peer's death, with and without the watcher's
proxy waker (TORCH_PEER_WATCHER_WAKE_NCCL_PROXY), and whether a healthy communicator in the same process stays exact.

Each run starts three ranks on GPU 0, each with an ``NCCL_HOSTID`` of its own (NCCL joins them through its network, as
between nodes). The world W holds all three; H = new_group([0, 1]) is a second communicator of ranks 0 and 1 (its own
NCCL init, its own proxy threads), used once before the death. Rank 2 runs all_reduce + ``.item()`` on W and SIGKILLs
itself; once the launcher has seen it die, ranks 0 and 1 abort W through the watcher's own path
(``torch_peer_watcher.groups.abort_all``, the waker on or off by the arm) while their main threads are blocked in
W's dead collective. Measured on each survivor: the abort's seconds, the seconds from the abort's start to the main
thread's exception, the NCCL proxy threads poked; then H's all_reduce, checked exact, and that no proxy thread still
alive (H's) was poked. Arms alternate run by run: plain, wake, plain, wake, ...

Usage, from the repository root, on a GPU machine:
    OUT=DIR python3 benchmarks/nccl_proxy_wake.py [--runs N] [--out DIR] [--budget-s S]
``--runs`` per arm (default 10); no run starts after ``--budget-s`` (default 330; a run is killed after 45).
``--cpu``: the same runs over gloo on the CPU, a dry run of the orchestration where no GPU is (gloo has no proxy
threads: nothing is woken). Writes DIR/runs.jsonl (a line a survivor per run) and DIR/summary.json, and prints a
summary on stderr. Exit 0 when every run finished.
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
from datetime import timedelta
from pathlib import Path
from typing import Any

from nccl_abort_latency import loaded_nccl  # noqa: E402  (beside this file: run as a script from benchmarks/)

ROOT = Path(__file__).resolve().parent.parent
ARMS = ("plain", "wake")
RUN_TIMEOUT_S = 45.0
VICTIM_STEPS_S = 0.5
WAKE_ENV = "TORCH_PEER_WATCHER_WAKE_NCCL_PROXY"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--runs", type=int, default=10, help="runs per arm")
    p.add_argument("--out", default=os.environ.get("OUT"), help="where the results go (default: $OUT)")
    p.add_argument("--budget-s", type=float, default=330.0, help="start no run after this many seconds")
    p.add_argument("--cpu", action="store_true", help="gloo on the CPU: a dry run of the orchestration")
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rank is None and not args.out:
        p.error("give --out DIR or set OUT")
    if args.runs < 1:
        p.error("--runs must be at least 1")
    return args


def rank_env(rank: int, arm: str) -> dict[str, str]:
    """Rank ``rank``'s environment: GPU 0, a host of its own for NCCL, the waker on or off."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", NCCL_HOSTID=f"proxy-wake-host-{rank}",
               CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", "0"),
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "scripts"), os.environ.get("PYTHONPATH")])))
    env[WAKE_ENV] = "1" if arm == "wake" else "0"
    return env


def one_run(arm: str, index: int, cpu: bool = False) -> list[dict[str, Any]]:
    """Three ranks around a store this process hosts; the death fed to the survivors; their results."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, world_size=4, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=RUN_TIMEOUT_S))
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--port", str(store.port),
                               *(["--cpu"] if cpu else [])],
                              env=rank_env(r, arm), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(3)]
    results: list[dict[str, Any]] = []
    deadline = time.monotonic() + RUN_TIMEOUT_S  # the whole run's, however its steps share it

    def left() -> float:
        return max(0.1, deadline - time.monotonic())

    try:
        procs[2].wait(timeout=left())
        for p in procs[:2]:
            assert p.stdin is not None
            p.stdin.write("dead\n")
            p.stdin.flush()
        for rank, p in enumerate(procs[:2]):
            out, _ = p.communicate(timeout=left())
            lines = [line[len("RESULT "):] for line in out.splitlines() if line.startswith("RESULT ")]
            result = json.loads(lines[0]) if lines else None
            if result is None:
                result = {"error": f"rank {rank} ended (exit {p.returncode}) without a result", "output": out[-3000:]}
            results.append({"arm": arm, "run": index, "rank": rank, **result})
    except subprocess.TimeoutExpired:
        results.append({"arm": arm, "run": index, "error": f"no end within {RUN_TIMEOUT_S:.0f} s"})
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return results


def nccl_service_threads() -> set[int]:
    """The ids of this process's threads named as NCCL names its proxy service threads."""
    found = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            name = Path(f"/proc/self/task/{tid}/comm").read_text()
        except OSError:
            continue
        if name.startswith(("NCCL Service", "NCCL UDS Servic")):
            found.add(int(tid))
    return found


def rank_main(args: argparse.Namespace) -> int:
    """One rank: W and H, the victim's death or the survivor's abort, ``RESULT {json}`` on stdout."""
    import torch_peer_watcher  # noqa: F401 - before init_process_group: PyTorch's watchdog lets a rank outlive a peer
    import torch
    import torch.distributed as dist
    from torch_peer_watcher import groups
    from torch_peer_watcher.settings import WatcherSettings

    rank = args.rank
    device = torch.device("cpu") if args.cpu else torch.device("cuda", 0)
    if not args.cpu:
        torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", args.port, is_master=False, timeout=timedelta(seconds=RUN_TIMEOUT_S))
    dist.init_process_group("gloo" if args.cpu else "nccl", store=store, rank=rank, world_size=3,
                            timeout=timedelta(seconds=RUN_TIMEOUT_S))
    healthy = dist.new_group([0, 1])
    t = torch.ones(1 << 16, device=device)
    dist.all_reduce(t)
    if rank in (0, 1):
        dist.all_reduce(t, group=healthy)  # H's communicator and its proxy threads exist before the death
    if not args.cpu:
        torch.cuda.synchronize(device)
    if rank == 2:
        end = time.monotonic() + VICTIM_STEPS_S
        while time.monotonic() < end:
            dist.all_reduce(t)
            t.view(-1)[0].item()
        os.kill(os.getpid(), signal.SIGKILL)
    figures: dict[str, Any] = {"nccl": None if args.cpu else loaded_nccl(), "torch": torch.__version__}
    settings = WatcherSettings.from_env()
    world = groups.describe(None)
    aborted = threading.Event()

    def abort_on_death() -> None:
        sys.stdin.readline()
        figures["threads_before"] = sorted(nccl_service_threads())
        figures["abort_started"] = time.monotonic()
        done = groups.abort_all([world], wake_nccl_proxy=settings.wake_nccl_proxy)
        figures["abort_s"] = time.monotonic() - figures["abort_started"]
        figures["abort_errors"] = done.errors
        figures["poked"] = [f"{kind}:{tid}" for (kind, tid), _ in (done.woken.pokes.items() if done.woken else [])]
        figures["waker_errors"] = done.woken.errors if done.woken else []
        aborted.set()

    threading.Thread(target=abort_on_death, daemon=True).start()
    try:
        while True:
            dist.all_reduce(t)
            t.view(-1)[0].item()
    except Exception:  # the dead collective fails once its communicator is aborted (or NCCL saw the death first)
        raised_at = time.monotonic()
    if not aborted.wait(RUN_TIMEOUT_S):
        figures["error"] = f"the abort did not return within {RUN_TIMEOUT_S:.0f} s"
    else:
        # negative where the collective raised before the abort began
        figures["exception_s"] = raised_at - figures["abort_started"]
        figures["threads_after"] = sorted(nccl_service_threads())
        alive = set(figures["threads_after"])
        figures["poked_alive"] = [p for p in figures["poked"] if int(p.split(":")[1]) in alive]
        exact = True
        for size in (1, 1 << 20):
            ramp = torch.arange(size, device=device, dtype=torch.float32)
            x = float(rank + 1) * ramp
            dist.all_reduce(x, group=healthy)
            expected = 3.0 * ramp
            exact = exact and bool(torch.equal(x, expected))
        figures["healthy_exact"] = exact
    figures.pop("abort_started", None)
    print("RESULT " + json.dumps(figures), flush=True)
    os._exit(0)


def arm_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One arm's figures over its survivors' rows (two a run)."""
    good = [r for r in rows if "abort_s" in r]
    aborts = sorted(r["abort_s"] for r in good)
    exceptions = sorted(r["exception_s"] for r in good if "exception_s" in r)
    runs = {r["run"] for r in rows}

    def stats(values: list[float]) -> dict[str, float | None]:
        if not values:
            return {"median": None, "max": None}
        return {"median": round(statistics.median(values), 4), "max": round(max(values), 4)}

    return {
        "runs": len(runs),
        "survivors": len(good),
        "failed": [r.get("error", "") for r in rows if "abort_s" not in r or "error" in r],
        "abort_s_median": stats(aborts)["median"], "abort_s_max": stats(aborts)["max"],
        "exception_s_median": stats(exceptions)["median"], "exception_s_max": stats(exceptions)["max"],
        # runs in which every survivor found H's all_reduce exact
        "healthy_exact": len(runs - {r["run"] for r in rows if not r.get("healthy_exact")}),
        "poked_alive": sum(len(r.get("poked_alive", [])) for r in good),
        "poked_median": statistics.median(len(r.get("poked", [])) for r in good) if good else None,
        "waker_errors": sorted({e for r in good for e in r.get("waker_errors", [])}),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.rank is not None:
        return rank_main(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    rows: list[dict[str, Any]] = []
    with open(out / "runs.jsonl", "w") as log:
        for index in range(args.runs):
            for arm in ARMS:
                if time.monotonic() - started > args.budget_s:
                    print(f"budget of {args.budget_s:.0f} s spent: stopped before run {index} ({arm})", file=sys.stderr)
                    break
                for row in one_run(arm, index, args.cpu):
                    rows.append(row)
                    log.write(json.dumps(row) + "\n")
                    log.flush()
                    print(f"run {index} {arm} rank {row.get('rank')}: abort {row.get('abort_s', float('nan')):.3f} s, "
                          f"exception {row.get('exception_s', float('nan')):.3f} s, "
                          f"healthy exact {row.get('healthy_exact')}, "
                          f"poked {row.get('poked')} {row.get('error', '')}", file=sys.stderr)
            else:
                continue
            break
    nccl = next((r["nccl"] for r in rows if "nccl" in r), None)
    summary = {"nccl": nccl, "torch": next((r["torch"] for r in rows if "torch" in r), None),
               "seconds": round(time.monotonic() - started, 1),
               "arms": {arm: arm_summary([r for r in rows if r["arm"] == arm]) for arm in ARMS}}
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"NCCL {nccl}, {summary['seconds']} s", file=sys.stderr)
    for arm, s in summary["arms"].items():
        print(f"{arm:5s}: {s['runs']} runs, {s['survivors']} survivors; abort median {s['abort_s_median']} s "
              f"(max {s['abort_s_max']}), exception median {s['exception_s_median']} s (max {s['exception_s_max']}); "
              f"healthy group exact in {s['healthy_exact']} runs; live proxy threads poked: {s['poked_alive']}; "
              f"failures: {len(s['failed'])}", file=sys.stderr)
    return 0 if all(not s["failed"] for s in summary["arms"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
