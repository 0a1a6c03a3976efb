"""One rank of benchmarks/ofi_profile.sh (issue 57): NCCL all_reduce of one size in a steady loop, so that a
system-wide ``perf record`` of a few seconds sees only the data path (no import, no NCCL init).

Run under ``python3 -m torch.distributed.run --nproc_per_node 2``. Rank 0 writes ``$READY`` once both ranks
are past warm-up; both then make the number of calls rank 0 chose for ``$PROFILE_S`` plus 3 s; each rank prints
one JSON line (calls, seconds, bus bandwidth in GB/s) to stdout at the end (NCCL's log goes there too).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> int:
    size = int(os.environ.get("PROFILE_BYTES", str(64 << 20)))
    ready = Path(os.environ["READY"])
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local % torch.cuda.device_count())
    device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl", device_id=device)
    world = dist.get_world_size()
    tensor = torch.ones(size // 4, dtype=torch.float32, device=device)
    # The loop's length is agreed before it starts (rank 0's warm-up rate, PROFILE_S plus 3 s of calls): no
    # host synchronization inside it, and one blocking wait at its end, so that no thread spins on the GPU
    # while perf samples (a spinning cudaStreamSynchronize was 40% of every sample).
    dist.all_reduce(tensor)  # the first call connects the peers
    torch.cuda.synchronize()
    began = time.monotonic()
    for _ in range(5):
        dist.all_reduce(tensor)
    torch.cuda.synchronize()
    per_call = (time.monotonic() - began) / 5
    count = torch.tensor([max(10, int((float(os.environ.get("PROFILE_S", "4")) + 3) / per_call))], device=device)
    dist.broadcast(count, src=0)
    calls = int(count.item())
    dist.barrier()
    if dist.get_rank() == 0:
        ready.touch()
    began = time.monotonic()
    for _ in range(calls):
        dist.all_reduce(tensor)
    done = torch.cuda.Event(blocking=True)
    done.record()
    done.synchronize()
    seconds = time.monotonic() - began
    busbw = calls * size * 2 * (world - 1) / world / seconds / 1e9
    print(json.dumps({"rank": dist.get_rank(), "bytes": size, "calls": calls, "seconds": round(seconds, 3),
                      "busbw_gbs": round(busbw, 3), "nccl_net": os.environ.get("NCCL_NET", "")}), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
