"""watch() on a group whose backend the watcher cannot abort is refused at once, with why (issue 72).

The watcher ends work blocked on a dead peer by cutting gloo's sockets or by the NCCL backend's abort()
(legacy ProcessGroupNCCL, and 2.15.0's nccl2). c10d's Backend.abort() does nothing, so a group of any other
backend without an abort of its own would stay blocked until its timeout while looking watched. The stand-in
backends are real ones registered through torch.distributed.Backend.register_backend (gloo underneath), one
with an abort() and one without; a real one-rank world, a real watcher.
"""

from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="torch is not installed (bash scripts/install-test-deps.sh installs it)")

from test_peer_watcher_gloo import start_ranks  # noqa: E402

WORKER = textwrap.dedent(
    """
    import sys
    import torch.distributed as dist
    from torch._C._distributed_c10d import ProcessGroupGloo
    import torch_peer_watcher as tpw
    from torch_peer_watcher.losses import WatcherError


    class NoAbort(dist.ProcessGroup):
        def __init__(self, store, rank, size, timeout):
            super().__init__(rank, size)
            self.gloo = ProcessGroupGloo(store, rank, size, timeout)

        def getBackendName(self):
            return "noabort"

        def allreduce(self, tensors, opts):
            return self.gloo.allreduce(tensors, opts)


    class WithAbort(NoAbort):
        def getBackendName(self):
            return "withabort"

        def abort(self):
            self.gloo.abort()


    dist.Backend.register_backend("noabort", NoAbort, devices=["cpu"])
    dist.Backend.register_backend("withabort", WithAbort, devices=["cpu"])
    dist.init_process_group("gloo", rank=0, world_size=1)
    watcher = tpw.start(settings=tpw.WatcherSettings(interval_s=0.25, timeout_s=2.0), watch_world=False)
    watcher.watch(None)
    print("WATCHED gloo", flush=True)
    for name in ("withabort", "noabort"):
        group = dist.new_group([0], backend=name)
        try:
            watcher.watch(group)
            print("WATCHED", name, flush=True)
        except WatcherError as exc:
            print("REFUSED", name, exc, flush=True)
    dist.destroy_process_group()
    """
)


def test_watch_refuses_a_group_whose_backend_has_no_abort_and_takes_one_that_has(tmp_path: Path) -> None:
    (proc,) = start_ranks(tmp_path, WORKER, 1)
    try:
        out = proc.communicate(timeout=120)[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    lines = [line for line in out.splitlines() if line.startswith(("WATCHED", "REFUSED"))]
    assert lines[:2] == ["WATCHED gloo", "WATCHED withabort"], out
    assert lines[2].startswith("REFUSED noabort rank 0 cannot watch group "), out
    # What is wrong and what to change.
    assert "its noabort backend (__main__.NoAbort) has no abort() of its own" in lines[2]
    assert "watch gloo or NCCL groups, or give the backend an abort()" in lines[2]
    assert proc.returncode == 0, out
