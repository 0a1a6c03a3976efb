"""A gloo survivor blocked on another survivor, not on the dead rank, raises at once (issue 45's 10 s waits).

When a rank dies, the survivors blocked on it see its connection close. A survivor can also wait on
another survivor, which left the collective when its own connection to the dead rank broke: on
gloo (no working abort) that wait lasted until the group's timeout. Seen in train-fresh across
namespace nodes (5 of 14 runs at about 10 s). The watcher now cuts every socket of the gloo group it
aborts, and only that group's: a group without the dead rank stays exact. ``watcher.abort(group)``
does the same for a group the application leaves, and ``watch(group, leave_on_any_loss=True)`` does it at
the loss of any peer (HSDP's replicate group).

Real processes, real gloo, a real SIGKILL; about 10 s.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch", reason="torch is not installed (bash scripts/install-test-deps.sh installs it)")

from test_dist_check_run import _free_port  # noqa: E402

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
sys.path.insert(0, str(SCRIPTS))

from torch_dist_check.harness import forkserver  # noqa: E402

GROUP_TIMEOUT_S = 60

WORKER = textwrap.dedent(
    f"""
    import os, signal, sys, time
    from datetime import timedelta
    import torch, torch.distributed as dist
    import torch_peer_watcher as tpw
    rank = int(sys.argv[1])
    dist.init_process_group("gloo", rank=rank, world_size=3)
    g = dist.new_group([0, 1, 2], timeout=timedelta(seconds={GROUP_TIMEOUT_S}))
    h = dist.new_group([0, 1], timeout=timedelta(seconds={GROUP_TIMEOUT_S}))  # without the victim
    k = dist.new_group([0, 1], timeout=timedelta(seconds={GROUP_TIMEOUT_S}))  # left on any loss
    watcher = tpw.start(settings=tpw.WatcherSettings(interval_s=0.25, timeout_s=2.0), watch_world=False)
    watcher.watch(g)
    if rank in (0, 1):
        watcher.watch(h)
        watcher.watch(k, leave_on_any_loss=True)
    dist.all_reduce(torch.ones(4), group=g)
    if rank == 2:
        time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGKILL)
    # 1 waits on the victim, 0 on 1: 1's wait ends when the victim's connection closes; 0's only if
    # 1's side of their connection in g is cut (1 never sends).
    t = torch.zeros(4)
    started = time.monotonic()
    try:
        with watcher.guard(g):
            dist.recv(t, src=2 if rank == 1 else 1, group=g)
        print("RECEIVED", flush=True)
    except tpw.PeerLostError as exc:
        print("LOST", rank, exc.ranks, f"{{time.monotonic() - started:.3f}}", exc.loss.sockets_cut, flush=True)
    t = torch.ones(4)
    dist.all_reduce(t, group=h)
    print("H", rank, t.tolist(), flush=True)
    # The application leaves h although nobody in it died: rank 1 aborts it through the watcher while
    # rank 0 waits on it there (gloo's own abort() would leave rank 0 waiting out the 60 s).
    started = time.monotonic()
    if rank == 1:
        time.sleep(0.5)
        print("ABORT", rank, watcher.abort(h), flush=True)
    else:
        try:
            dist.recv(t, src=1, group=h)
        except RuntimeError as exc:
            print("LEFT", rank, f"{{time.monotonic() - started:.3f}}", flush=True)
    # k never held the victim, yet the victim's loss aborted it (leave_on_any_loss): rank 0 waits on rank 1
    # there, which never sends, and the wait ends at once instead of after the group's 60 s.
    if rank == 0:
        started = time.monotonic()
        try:
            dist.recv(t, src=1, group=k)
        except RuntimeError as exc:
            print("ANY", rank, f"{{time.monotonic() - started:.3f}}", watcher.losses()[0].groups.count(k.group_name), flush=True)
    watcher.stop()
    os._exit(0)
    """
)


def start_ranks(tmp_path: Path, worker: str, size: int, **popen: object) -> list[Any]:
    """``size`` processes running ``worker`` (its rank as argv[1]) on gloo over loopback, output on stdout;
    forked from a process that imported torch once (harness/forkserver.py), which changes their CPU, not
    what they do."""
    script = tmp_path / "worker.py"
    script.write_text(worker)
    env = dict(os.environ, PYTHONPATH=str(SCRIPTS), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
               GLOO_SOCKET_IFNAME="lo")  # fmt: skip
    return [forkserver.start([sys.executable, str(script), str(r)], env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, **popen) for r in range(size)]  # type: ignore[arg-type]  # fmt: skip


def test_a_survivor_waiting_on_another_survivor_raises_at_once_and_other_groups_stay_exact(tmp_path: Path) -> None:
    procs = start_ranks(tmp_path, WORKER, 3)
    try:
        outs = [proc.communicate(timeout=GROUP_TIMEOUT_S + 60)[0] for proc in procs[:2]]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    lines = {rank: [line.split() for line in out.splitlines() if line.split()[:1] in (["LOST"], ["H"], ["RECEIVED"], ["ABORT"], ["LEFT"], ["ANY"])]
             for rank, out in enumerate(outs)}  # fmt: skip
    for rank in (0, 1):
        lost = [line for line in lines[rank] if line[0] == "LOST"]
        assert lost and lost[0][2] == "(2,)", (rank, outs[rank])
        # Far below the group's 60 s timeout (without the group's cut, rank 0 waited all of it: 60.006 s).
        assert float(lost[0][3]) < 10.0, (rank, outs[rank])
        # The group without the victim kept its connections: its all_reduce is exact on both.
        assert ["H", str(rank), "[2.0,", "2.0,", "2.0,", "2.0]"] in lines[rank], (rank, outs[rank])
    # watcher.abort(h) on rank 1 cut its sockets of h (one, to rank 0), and rank 0's wait there ended.
    assert ["ABORT", "1", "1"] in lines[1], outs[1]
    left = [line for line in lines[0] if line[0] == "LEFT"]
    assert left and float(left[0][2]) < 10.0, outs[0]
    # A group watched with leave_on_any_loss was aborted by the victim's loss, though it never held the victim.
    left_on_loss = [line for line in lines[0] if line[0] == "ANY"]
    assert left_on_loss and float(left_on_loss[0][2]) < 5.0 and left_on_loss[0][3] == "1", outs[0]


def test_a_sockaddr_is_found_in_a_record_only_with_its_own_port_and_address() -> None:
    import socket
    import struct

    from torch_peer_watcher.sockets import _sockaddr_in

    v4 = b"\x00" * 18 + struct.pack("=H", socket.AF_INET) + struct.pack(">H", 40751) + bytes([127, 0, 0, 1]) + b"\x00" * 8
    assert _sockaddr_in(v4, socket.AF_INET, ("127.0.0.1", 40751))
    assert not _sockaddr_in(v4, socket.AF_INET, ("127.0.0.1", 40752))
    assert not _sockaddr_in(v4, socket.AF_INET, ("10.99.0.1", 40751))
    six = socket.inet_pton(socket.AF_INET6, "fe80::1")
    v6 = b"\x01" * 5 + struct.pack("=H", socket.AF_INET6) + struct.pack(">H", 5555) + b"\x00\x00\x00\x07" + six + b"\x00" * 4
    assert _sockaddr_in(v6, socket.AF_INET6, ("fe80::1%tdc0", 5555, 0, 2))
    assert not _sockaddr_in(v6, socket.AF_INET6, ("fe80::2", 5555, 0, 0))
    assert not _sockaddr_in(v6, socket.AF_INET, ("127.0.0.1", 5555))


# A slow abort, as ncclCommAbort's teardown on stock NCCL: in C++ with the GIL released (ProcessGroup.abort's binding),
# here ATen matmuls of a few ms each for TEARDOWN_S after the groups' real abort. raise_if_lost() answers as soon as the
# verdict stands, while it runs.
TEARDOWN_S = 1.0

SLOW_ABORT = textwrap.dedent(
    f"""
    import os, signal, sys, threading, time
    import torch, torch.distributed as dist
    import torch_peer_watcher as tpw
    from torch_peer_watcher import groups, watcher as watcher_mod
    rank = int(sys.argv[1])
    real_all, real_one, real_cut = groups.abort_all, groups.abort, watcher_mod.cut_connections_to
    m = torch.randn(400, 400)
    def say(*words):  # one write per line: the watcher's thread prints too
        os.write(1, (" ".join(str(w) for w in words) + "\\n").encode())
    def teardown():
        torch.set_num_threads(1)
        end = time.monotonic() + {TEARDOWN_S}
        while time.monotonic() < end:
            m @ m
    def slow_all(*args, **kwargs):
        done = real_all(*args, **kwargs)
        teardown()
        return done
    def timed_one(watched):  # every abort of a group, the watcher's and the application's: when it ran
        began = time.monotonic()
        done = real_one(watched)
        say("ABORTED", f"{{began:.6f}}", f"{{time.monotonic():.6f}}", threading.current_thread().name)
        return done
    def slow_cut(*args, **kwargs):  # the verdict's handling before its aborts begin (here the gloo cut) takes time
        time.sleep(0.3)
        return real_cut(*args, **kwargs)
    groups.abort_all, groups.abort = slow_all, timed_one
    if THEN == "abort":  # the exit's case must exit while the teardown runs in C++, not in this sleep
        watcher_mod.cut_connections_to = slow_cut
    dist.init_process_group("gloo", rank=rank, world_size=3)
    g = dist.new_group([0, 1, 2])
    watcher = tpw.start(settings=tpw.WatcherSettings(interval_s=0.25, timeout_s=2.0), watch_world=False)
    watcher.watch(g)
    dist.all_reduce(torch.ones(4), group=g)
    if rank == 2:
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        for _ in range(100000):
            dist.all_reduce(torch.ones(4), group=g)
    except RuntimeError:  # gloo saw the closed connection
        pass
    try:
        while True:
            watcher.raise_if_lost(g)
            time.sleep(0.002)
    except (tpw.PeerLostError, tpw.PartitionedError) as exc:  # cut off: rank 0, the store's host, may be gone
        # The aborts were still running; the verdict stood (wait_for_loss(aborted=False), what an HSDP survivor waits for).
        say("RAISED", watcher.wait_for_loss(g, 0) is None, watcher.wait_for_loss(g, 0, aborted=False).rank == 2)
    if THEN == "exit":
        sys.exit(3)  # as examples/peer_watcher_shrink.py on PartitionedError, or an uncaught PeerLostError
    store = dist.distributed_c10d._get_default_store()
    if rank == 0:  # the application leaves the group itself
        watcher.abort(g)
        say("ABORT_RETURNED")
        store.wait(["rank1/done"])  # it hosts the store: rank 1's verdict must still reach it
    else:  # as examples/hsdp_recovery.py's new_world leaves the world
        tpw.stop()
        say("STOPPED", [loss.abort_s >= {TEARDOWN_S} for loss in watcher.losses()])
        dist.distributed_c10d._abort_process_group(g)
        store.set("rank1/done", "1")
    os._exit(0)
    """
)


def run_slow_abort(tmp_path: Path, then: str) -> list[tuple[str, int]]:
    """The survivors' output and exit (rank 2 dies): both exit (``then="exit"``), or rank 0 aborts the group and rank 1
    stops the watcher."""
    worker = SLOW_ABORT.replace("THEN", repr(then))
    if then == "exit":  # interpreters of their own: a child forked by harness/forkserver.py ends without the finalization
        script = tmp_path / "slow_abort.py"
        script.write_text(worker)
        env = dict(os.environ, PYTHONPATH=str(SCRIPTS), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
                   GLOO_SOCKET_IFNAME="lo")  # fmt: skip
        procs = [subprocess.Popen([sys.executable, str(script), str(r)], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True) for r in range(3)]  # fmt: skip
    else:
        procs = start_ranks(tmp_path, worker, 3)
    try:
        return [(proc.communicate(timeout=60)[0], proc.returncode) for proc in procs[:2]]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_an_exit_while_the_watchers_aborts_run_waits_for_them(tmp_path: Path) -> None:
    """raise_if_lost() answers while the watcher's aborts run. A survivor that then ends its interpreter: the watcher's
    thread came back from the C++ call during the finalization and the process died of "terminate called without an
    active exception" (SIGABRT, 6 of 6 survivors before the exit waited for it: torch_peer_watcher.settles)."""
    for rank, (out, code) in enumerate(run_slow_abort(tmp_path, "exit")):
        assert "RAISED True True" in out, (rank, out)  # it did exit while the aborts ran
        assert code == 3 and "terminate called" not in out, (rank, code, out)


def test_an_abort_or_a_stop_while_the_watchers_aborts_run_waits_for_them(tmp_path: Path) -> None:
    """Two aborts of one NCCL communicator at once are safe only where the backend serializes them (the legacy
    NCCLComm's lock; nccl2's abortNcclComm has none): rank 0's watcher.abort() of the group a loss is aborting runs
    after the watcher's abort, and rank 1's stop() (then the world's abort, as examples/hsdp_recovery.py leaves it)
    returns once the loss is handled."""
    [(out0, code0), (out1, code1)] = run_slow_abort(tmp_path, "abort")
    assert "RAISED True True" in out0 and "RAISED True True" in out1, (out0, out1)  # while the aborts ran
    spans = sorted((float(a), float(b), who) for _, a, b, who in (line.split() for line in out0.splitlines() if line.startswith("ABORTED ")))
    # rank 0's abort began once the watcher's had ended, though it was asked for before the watcher's began
    assert code0 == 0 and len(spans) == 2 and spans[1][0] >= spans[0][1], (code0, out0)
    assert spans[0][2].startswith("torch-peer-watcher-abort") and spans[1][2] == "MainThread", out0
    assert code1 == 0 and "STOPPED [True]" in out1, (code1, out1)  # the loss was handled, its abort's teardown included


# The ranks on gloo; each survivor's CUDA stream busy for BUSY_S (torch.cuda._sleep) as a stream stands behind an
# aborted NCCL kernel, which ends only when the kernel reads the abort flag.
BUSY_S = 3.0

BUSY_STREAM = textwrap.dedent(
    f"""
    import os, signal, sys, time
    import torch, torch.distributed as dist
    import torch_peer_watcher as tpw
    rank = int(sys.argv[1])
    def say(*words):
        os.write(1, (" ".join(str(w) for w in words) + "\\n").encode())
    torch.cuda.set_device(0)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(); torch.cuda._sleep(10 ** 8); end.record(); end.synchronize()
    cycles_per_s = 10 ** 8 / (start.elapsed_time(end) / 1000)
    dist.init_process_group("gloo", rank=rank, world_size=3)
    g = dist.new_group([0, 1, 2])
    watcher = tpw.start(settings=tpw.WatcherSettings(interval_s=0.25, timeout_s=2.0), watch_world=False)
    watcher.watch(g)
    # Healthy: the wait returns once the stream's work has ended, not before.
    torch.cuda._sleep(int(0.3 * cycles_per_s))
    done = torch.cuda.Event(); done.record()
    began = time.monotonic()
    watcher.synchronize(g)
    say("HEALTHY", done.query(), f"{{time.monotonic() - began:.3f}}")
    dist.all_reduce(torch.ones(4), group=g)
    if rank == 2:
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    torch.cuda._sleep(int({BUSY_S} * cycles_per_s))
    done = torch.cuda.Event(); done.record()
    began = time.monotonic()
    try:
        watcher.synchronize(g)
        say("RETURNED", done.query(), f"{{time.monotonic() - began:.3f}}")
    except tpw.PeerLostError as exc:
        say("RAISED", exc.ranks, done.query(), f"{{time.monotonic() - began:.3f}}")
    torch.cuda.synchronize()
    watcher.stop()
    os._exit(0)
    """
)


@pytest.mark.gpu
def test_the_steps_wait_raises_on_the_verdict_while_the_stream_is_still_busy(tmp_path: Path) -> None:
    """watcher.synchronize() at a step's end raises on a peer's loss without waiting for the stream's work (behind an
    aborted NCCL all-reduce: until its kernel reads the abort flag, 0.1 s after the verdict on a shared GPU); on a
    healthy step it returns once the work has ended."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False)")
    procs = start_ranks(tmp_path, BUSY_STREAM, 3)
    try:
        outs = [proc.communicate(timeout=60)[0] for proc in procs[:2]]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    for rank, out in enumerate(outs):
        healthy = [line.split() for line in out.splitlines() if line.startswith("HEALTHY ")]
        assert healthy and healthy[0][1] == "True" and float(healthy[0][2]) >= 0.2, (rank, out)
        raised = [line.split() for line in out.splitlines() if line.startswith("RAISED ")]
        # raised on the verdict (the death after 0.5 s, the verdict within the 2 s timeout), the stream still busy
        assert raised and raised[0][1] == "(2,)" and raised[0][2] == "False", (rank, out)
        assert float(raised[0][3]) < BUSY_S - 0.5, (rank, out)
