"""The proxy waker on a CPU: joins of a mock of NCCL 2.28.9's proxy threads (tests/test_peer_watcher_proxywake.py's
MockComm: the same poll() timeout, loop and abort order as src/proxy.cc), aborted without and with the waker, in
alternation. No GPU, no NCCL: it shows what the waker does to threads that wait as NCCL's do, not NCCL itself.

Usage, from the repository root: PYTHONPATH=scripts python3 benchmarks/proxy_wake_mock.py [--runs N]
Prints one line a run and the medians on stderr.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from test_peer_watcher_proxywake import MockComm  # noqa: E402

from torch_peer_watcher.proxywake import ProxyWaker  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--runs", type=int, default=10)
    args = p.parse_args(argv)
    plain, woken = [], []
    for run in range(args.runs):
        comm = MockComm()
        plain.append(comm.abort())
        comm = MockComm()
        with ProxyWaker() as waker:
            woken.append(comm.abort())
        print(f"run {run}: join without the waker {plain[-1]:.4f} s, with {woken[-1]:.4f} s; pokes {waker.woken.pokes}",
              file=sys.stderr)
    print(f"median of {args.runs}: without {statistics.median(plain):.4f} s (max {max(plain):.4f}), "
          f"with {statistics.median(woken):.4f} s (max {max(woken):.4f})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
