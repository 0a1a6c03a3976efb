"""The proxy waker on a CPU: joins of a mock of NCCL 2.28.9's proxy threads (tests/test_peer_watcher_proxywake.py's
MockComm: the same poll() timeout, loop and abort order as src/proxy.cc), aborted without and with the waker, in
alternation. No GPU, no NCCL: it shows what the waker does to threads that wait as NCCL's do, not NCCL itself.

Usage, from the repository root:
    PYTHONPATH=scripts python3 benchmarks/proxy_wake_mock.py [--runs N] [--threads N] [--older-joiner]
``--threads``: that many more threads in the process, asleep (a process of many threads: a look of the waker reads
a /proc/self/task/<tid>/syscall per thread it considers). Prints one line a run and the medians on stderr: the
join's seconds, the process's CPU seconds during the join (the waker's, nearly all: every other thread sleeps), and
the CPU seconds of a look at every thread (``joined_proxies()``, median of 10) and of a look as the waker makes it
(the threads started since it began and OLDER_PER_LOOK older ones, median of 10). ``--older-joiner``: the abort runs
in a thread started before the waker (PyTorch's watchdog's case), which the waker reaches in its round over the
older threads.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from test_peer_watcher_proxywake import MockComm  # noqa: E402

from torch_peer_watcher import proxywake  # noqa: E402
from torch_peer_watcher.proxywake import ProxyWaker, joined_proxies  # noqa: E402


def timed_abort(comm: MockComm, wake: bool, older_joiner: bool) -> tuple[float, float, dict]:
    """The abort's wall seconds, the process's CPU seconds meanwhile, and the waker's pokes. ``older_joiner``: the
    abort runs in a thread started before the waker (as PyTorch's watchdog would), not in the one entering it."""
    took: list[float] = []
    go = threading.Event()
    joiner = threading.Thread(target=lambda: go.wait() and took.append(comm.abort()))
    if older_joiner:
        joiner.start()
    cpu = time.process_time()
    waker = ProxyWaker() if wake else contextlib.nullcontext()
    with waker:
        if older_joiner:
            go.set()
            joiner.join()
        else:
            took.append(comm.abort())
    return took[0], time.process_time() - cpu, waker.woken.pokes if wake else {}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--older-joiner", action="store_true", help="abort in a thread started before the waker")
    args = p.parse_args(argv)
    # The mock names its threads as NCCL does under this setting, which the waker requires (the tests set it too).
    os.environ["NCCL_SET_THREAD_NAME"] = "1"
    asleep = threading.Event()
    for _ in range(args.threads):
        threading.Thread(target=asleep.wait, daemon=True).start()
    looks, waker_looks = [], []
    for _ in range(10):
        cpu = time.process_time()
        joined_proxies()
        looks.append(time.process_time() - cpu)
    # A look as the waker makes it (the threads started since it began, here none, and its share of the older ones),
    # where the waker reads its threads that way (OLDER_PER_LOOK).
    per_look = getattr(proxywake, "OLDER_PER_LOOK", None)
    if per_look is not None:
        older = sorted(proxywake.task_ids())
        known = set(older)
        for turn in range(0, 10 * per_look, per_look):
            cpu = time.process_time()
            joined_proxies([tid for tid in proxywake.task_ids() if tid not in known] + older[turn : turn + per_look])
            waker_looks.append(time.process_time() - cpu)
    plain, woken, cpu_plain, cpu_woken = [], [], [], []
    for run in range(args.runs):
        took, cpu, _ = timed_abort(MockComm(), False, args.older_joiner)
        plain.append(took)
        cpu_plain.append(cpu)
        took, cpu, pokes = timed_abort(MockComm(), True, args.older_joiner)
        woken.append(took)
        cpu_woken.append(cpu)
        print(f"run {run}: join without the waker {plain[-1]:.4f} s (CPU {cpu_plain[-1]:.4f} s), "
              f"with {woken[-1]:.4f} s (CPU {cpu_woken[-1]:.4f} s); pokes {pokes}", file=sys.stderr)
    asleep.set()
    older = ", joiner older than the waker" if args.older_joiner else ""
    as_waker = f"; a look as the waker makes it: {statistics.median(waker_looks) * 1e3:.2f} ms CPU" if waker_looks \
        else ""  # fmt: skip
    print(f"{args.threads} more threads{older}; median of {args.runs}: without {statistics.median(plain):.4f} s "
          f"(max {max(plain):.4f}, CPU {statistics.median(cpu_plain):.4f} s), with {statistics.median(woken):.4f} s "
          f"(max {max(woken):.4f}, CPU {statistics.median(cpu_woken):.4f} s); a look at every thread: "
          f"{statistics.median(looks) * 1e3:.2f} ms CPU{as_waker}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
