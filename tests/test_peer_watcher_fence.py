"""Two live ranks that would declare each other lost: the side declared lost first stops.

A lossy link (20% each way, issue 45's lossy-link case with nftables) or a rank that stalls past the
heartbeat timeout makes one side declare the other lost while both still reach the store; the other
side then saw its link closed and declared the first lost too ("process gone"): both trained on. The
accuser now sends ``L`` ("I declared you lost") before it closes the link, and the accused, which
reads it, gets PartitionedError, which recovery code does not catch.

Here rank 1 holds the GIL for 3 s (its watcher thread sends nothing), so rank 0 declares it lost
after the 1 s timeout, a wrong verdict on a live process. Real processes and gloo; about 5 s.
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
    import ctypes, os, sys
    import torch, torch.distributed as dist
    import torch_peer_watcher as tpw
    rank = int(sys.argv[1])
    dist.init_process_group("gloo", rank=rank, world_size=2)
    watcher = tpw.start(settings=tpw.WatcherSettings(interval_s=0.25, timeout_s=1.0))
    dist.all_reduce(torch.ones(4))
    if rank == 1:
        # The GIL held for 3 s in a C call (poll() with no file descriptor, through PyDLL, which keeps the GIL):
        # the watcher's thread gets no turn, and no core spins.
        libc = ctypes.PyDLL(None)
        libc.poll.argtypes = (ctypes.c_void_p, ctypes.c_ulong, ctypes.c_int)
        libc.poll(None, 0, 3000)
    loss = watcher.wait_for_loss(None, timeout_s=20)
    try:
        watcher.raise_if_lost()
        print("NOTHING", rank, loss, flush=True)
    except tpw.PartitionedError as exc:
        print("PARTITIONED", rank, " ".join(str(exc).split()), flush=True)
    except tpw.PeerLostError as exc:
        print("LOST", rank, exc.ranks, flush=True)
    if rank == 0:
        sys.stdin.read()  # rank 0 hosts the store: kept until rank 1 has answered
    watcher.stop()
    os._exit(0)
    """
)


def test_of_two_live_ranks_that_declare_each_other_lost_only_the_first_accuser_goes_on(tmp_path: Path) -> None:
    procs = start_ranks(tmp_path, WORKER, 2, stdin=subprocess.PIPE)
    try:
        one = procs[1].communicate(timeout=120)[0]
        outs = [procs[0].communicate(timeout=60)[0], one]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    said = [[line for line in out.splitlines() if line.split()[:1] in (["LOST"], ["PARTITIONED"], ["NOTHING"])] for out in outs]
    # Rank 0's verdict came first (rank 1 was silent): it goes on, as after a real death.
    assert said[0] == ["LOST 0 (1,)"], outs[0]
    # Rank 1, alive, saw its link closed and would have declared rank 0 lost too; the store says otherwise.
    assert len(said[1]) == 1 and said[1][0].startswith("PARTITIONED 1 "), outs[1]
    assert "rank 0 declared this rank lost first" in said[1][0] and "their link failed" in said[1][0], outs[1]
