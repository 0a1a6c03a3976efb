"""What ``watcher.synchronize()`` costs a healthy step against ``torch.cuda.current_stream().synchronize()`` followed by
``watcher.raise_if_lost()`` (issue 74: the step's end that raises on the verdict polls an event instead of blocking).

One process on one GPU, a one-rank gloo world with a started watcher (the real object the step calls). Each step
queues matmuls worth about STEP milliseconds of GPU time, then waits one way or the other; the two ways alternate,
step by step, so that clocks and other load fall on both alike. Prints, for each step size, the median wall time of
a step each way, their difference and the 95th percentiles.

Usage, on a GPU machine, from the repository root:
    PYTHONPATH=scripts python3 benchmarks/step_wait.py [--steps 300] [--sizes-ms 2,10,50]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from ports import free_port  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300, help="steps each way, per size (default 300)")
    p.add_argument("--sizes-ms", default="2,10,50", help="a step's GPU work in ms, comma-separated (default 2,10,50)")
    args = p.parse_args()
    import torch
    import torch.distributed as dist
    import torch_peer_watcher as tpw

    if not torch.cuda.is_available():
        print("step_wait: needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    watcher = tpw.start()
    x = torch.randn(2048, 2048, device="cuda")
    torch.cuda.synchronize()

    def matmuls(n: int) -> None:
        for _ in range(n):
            x @ x

    # How many matmuls make a millisecond.
    for _ in range(3):
        began = time.perf_counter()
        matmuls(50)
        torch.cuda.synchronize()
        per_ms = 50 / ((time.perf_counter() - began) * 1000)

    def blocking() -> None:
        torch.cuda.current_stream().synchronize()
        watcher.raise_if_lost()

    ways = {"blocking synchronize + raise_if_lost": blocking, "watcher.synchronize": watcher.synchronize}
    print(torch.__version__, torch.cuda.get_device_name(0), f"{per_ms:.1f} matmuls/ms")
    for size in (float(s) for s in args.sizes_ms.split(",")):
        n = max(1, round(size * per_ms))
        times: dict[str, list[float]] = {name: [] for name in ways}
        for step in range(2 * args.steps + 20):
            name = list(ways)[step % 2]
            began = time.perf_counter()
            matmuls(n)
            ways[name]()
            if step >= 20:  # warm-up steps are not counted
                times[name].append(time.perf_counter() - began)
        medians = {name: statistics.median(t) * 1000 for name, t in times.items()}
        p95 = {name: sorted(t)[int(0.95 * len(t))] * 1000 for name, t in times.items()}
        (a, b) = medians.values()
        print(f"step {size:g} ms ({n} matmuls), {args.steps} each: "
              + "; ".join(f"{name} median {medians[name]:.3f} ms, p95 {p95[name]:.3f} ms" for name in ways)
              + f"; difference {b - a:+.3f} ms ({(b - a) / a * 100:+.2f} %)")  # fmt: skip
    watcher.stop()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
