"""``torch_peer_watcher.leave_world()`` beside the watcher's own loss handling (a helper's attack, session 31).

Real processes, real gloo, a real SIGKILL; the watcher's aborts made slow (``groups.abort`` wrapped), as stock
NCCL's teardown is. The waker itself: tests/test_peer_watcher_proxywake.py.
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="torch is not installed (bash scripts/install-test-deps.sh installs it)")

from test_peer_watcher_gloo import start_ranks  # noqa: E402

from torch_peer_watcher.settings import WAKE_NCCL_PROXY_ENV, WatcherConfigError  # noqa: E402

PRELUDE = """
import os, signal, sys, threading, time
import torch, torch.distributed as dist
import torch_peer_watcher as tpw
from torch_peer_watcher import groups
from torch.distributed import distributed_c10d as c10d
rank = int(sys.argv[1])
T0 = time.monotonic()
events = []
def note(what):
    events.append((what, round(time.monotonic() - T0, 3)))
"""

# Rank 0 leaves the world twice at once: its main thread as soon as lost() answers, and its callback. The old
# module-level stop() held its lock through the watcher's wait for the handlers, the callback's handler among them:
# both calls waited out the 60 s bound.
TWICE = PRELUDE + """
dist.init_process_group("gloo", rank=rank, world_size=2)
watcher = tpw.start(settings=tpw.WatcherSettings(interval_s=0.25, timeout_s=2.0))
dist.all_reduce(torch.ones(4))
if rank == 1:
    time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGKILL)
real = groups.abort
def slow(watched):
    time.sleep(1.5)
    real(watched)
groups.abort = slow
def leave(where):
    note(where + " calls")
    tpw.leave_world()
    note(where + " left")
watcher.on_peer_lost(lambda loss: leave("callback"))
while watcher.lost() is None:
    time.sleep(0.001)
leave("main")
deadline = time.monotonic() + 90
while not any(what == "callback left" for what, _ in events) and time.monotonic() < deadline:
    time.sleep(0.01)
print("EVENTS", events, dist.is_initialized(), flush=True)
os._exit(0)
"""

# Rank 2 dies, then rank 1: rank 0's callback for rank 1's loss leaves the world while the watcher still aborts
# rank 2's group (3 s). From a callback, stop() used to wait for nothing, and the world's abort ran beside the
# watcher's abort of the same group (on NCCL two aborts of one communicator at once).
BESIDE = PRELUDE + """
dist.init_process_group("gloo", rank=rank, world_size=3)
h01, h02 = dist.new_group([0, 1]), dist.new_group([0, 2])
watcher = tpw.start(settings=tpw.WatcherSettings(interval_s=0.25, timeout_s=2.0), watch_world=False)
for g, members in ((h01, (0, 1)), (h02, (0, 2))):
    if rank in members:
        watcher.watch(g)
dist.barrier()
if rank in (1, 2):
    time.sleep(0.8 if rank == 1 else 0.5)
    os.kill(os.getpid(), signal.SIGKILL)
real, real_world = groups.abort, c10d._abort_process_group
def slow(watched):
    name = "h02" if watched.group is h02 else "h01"
    note(name + " abort starts")
    time.sleep(3.0 if name == "h02" else 0.1)
    real(watched)
    note(name + " abort ends")
def world(group=None):
    note("world abort starts")
    real_world(group)
groups.abort, c10d._abort_process_group = slow, world
def callback(loss):
    if loss.rank == 1:
        note("callback calls")
        tpw.leave_world()
        note("callback left")
watcher.on_peer_lost(callback)
deadline = time.monotonic() + 90
while not {"callback left", "h02 abort ends"} <= {what for what, _ in events} and time.monotonic() < deadline:
    time.sleep(0.01)
print("EVENTS", events, dist.is_initialized(), flush=True)
os._exit(0)
"""


def _events(tmp_path: Path, worker: str, size: int) -> tuple[dict[str, float], str]:
    procs = start_ranks(tmp_path, textwrap.dedent(worker), size)
    try:
        out = procs[0].communicate(timeout=150)[0]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    line = next((line for line in out.splitlines() if line.startswith("EVENTS ")), None)
    assert line is not None, out
    events_text, _, initialized = line.removeprefix("EVENTS ").rpartition(" ")
    assert initialized == "False", ("the world was left", out)
    return dict(ast.literal_eval(events_text)), out


def test_leave_world_in_main_and_in_a_callback_at_once_waits_for_the_aborts_not_the_60_s_bound(tmp_path: Path) -> None:
    events, out = _events(tmp_path, TWICE, 2)
    assert {"main left", "callback left"} <= events.keys(), out
    # The watcher's abort takes 1.5 s; before the fix both calls returned after 60 s.
    assert events["main left"] - events["main calls"] < 10, out
    assert events["callback left"] - events["callback calls"] < 10, out


def test_leave_world_from_a_callback_waits_for_the_watchers_other_aborts(tmp_path: Path) -> None:
    events, out = _events(tmp_path, BESIDE, 3)
    assert {"h02 abort starts", "callback calls", "h02 abort ends", "world abort starts"} <= events.keys(), out
    assert events["h02 abort starts"] < events["callback calls"] < events["h02 abort ends"], ("the race was set up", out)
    # Before the fix the world's abort began at once (0.2 s), while h02's abort ran until 3 s.
    assert events["world abort starts"] >= events["h02 abort ends"], out


def test_leave_world_reads_only_its_own_setting_and_refuses_a_bad_one(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    import torch_peer_watcher as tpw

    assert not dist.is_initialized()
    # The watcher's other variables are not read: a process leaving its world is not starting a watcher.
    monkeypatch.setenv("TORCH_PEER_WATCHER_TIMEOUT_S", "abc")
    assert tpw.leave_world() is None
    monkeypatch.setenv(WAKE_NCCL_PROXY_ENV, "yes")
    with pytest.raises(WatcherConfigError, match=f"{WAKE_NCCL_PROXY_ENV}='yes': expected 1"):
        tpw.leave_world()
