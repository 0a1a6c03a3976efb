"""The watcher's shrink releases the aborted parent with abort(), never destroy_process_group (issue 42).

gloo cannot shrink (``supports_shrinking`` is False in torch 2.13.0), so the NCCL shrink itself runs
on GPU nodes only. What runs here is the part that changed, on real gloo groups of a real world:
PyTorch's own ``_finalize_shrunk_group`` (the last step of ``shrink_group``) with a real new backend,
inside and outside :func:`torch_peer_watcher.groups.aborting_shrinks`. Inside, the parent must be
aborted and left out of every map of ``distributed_c10d._world`` without ``destroy_process_group``
being called; outside (a user's own ``shrink_group``) PyTorch's original destroy must still run.
Each case runs in a child process, so no test leaves a process group behind in pytest's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="torch is not installed (bash scripts/install-test-deps.sh installs it)")
from torch.distributed import distributed_c10d as _c10d  # noqa: E402

if not hasattr(_c10d, "_prepare_shrink_target_group"):
    # 2.6.0 (CI's oldest release) has neither shrink_group nor ProcessGroup.abort: the watcher's shrink_unsupported
    # says so and it aborts instead (test_dist_check_train, test_peer_watcher's shrink case).
    pytest.skip(f"PyTorch {__import__('torch').__version__} has no shrink_group steps (_prepare_shrink_target_group)",
                allow_module_level=True)

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
sys.path.insert(0, str(SCRIPTS))

import suite_process  # noqa: E402
from torch_dist_check.harness import forkserver  # noqa: E402

# A world of one on gloo; a parent group P, a real gloo backend standing in for the shrunk one, and
# PyTorch's _finalize_shrunk_group run on them. destroy_process_group is wrapped only to record
# its calls (it still runs). Prints one JSON line.
CHILD = r"""
import json, sys
from datetime import timedelta
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from torch_peer_watcher import groups

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
# Every abort is recorded, and takes ABORT_S (as ncclCommAbort waits out the proxy's 500 ms poll on
# stock NCCL); gloo's own abort does nothing to see.
import os, threading, time
aborted, ABORT_S = [], float(sys.argv[2])
original_abort = dist.ProcessGroup.abort
def recording_abort(self):
    time.sleep(ABORT_S)
    aborted.append((self.group_name, threading.current_thread().name))
    return original_abort(self)
dist.ProcessGroup.abort = recording_abort
destroyed = []
original_destroy = c10d.destroy_process_group
def recording_destroy(group=None):
    destroyed.append(getattr(group, "group_name", None))
    return original_destroy(group)
c10d.destroy_process_group = recording_destroy

parent = dist.new_group([0])
name = parent.group_name
new_backend = dist.ProcessGroupGloo(dist.PrefixStore("shrunk/", dist.HashStore()), 0, 1, timedelta(seconds=10))
info = {"process_group": parent, "is_default_group": False, "group_size": 1, "current_rank": 0,
        "group_name": name, "pg_options_override": None}
scope = sys.argv[1]
began = time.monotonic()
if scope == "watcher":
    with groups.aborting_shrinks():
        new = c10d._finalize_shrunk_group(info, set(), new_backend)
else:
    new = c10d._finalize_shrunk_group(info, set(), new_backend)
finalize_s = time.monotonic() - began
aborted_at_return = list(aborted)
errors = groups.wait_for_releases(30)
maps = {m: parent in getattr(c10d._world, m) for m in ("pg_map", "pg_names", "pg_group_ranks", "pg_backend_config", "pg_to_tag")}
maps["tags_to_pg"] = any(parent in pgs for pgs in c10d._world.tags_to_pg.values())
import torch
t = torch.ones(2)
new.allreduce([t]).wait()
print(json.dumps({"destroyed": destroyed, "parent": name, "in_maps": maps,
                  "new_registered": new in c10d._world.pg_map, "new_ranks": dist.get_process_group_ranks(new),
                  "seam": groups.shrink_seam_missing(), "result": t.tolist(), "finalize_s": finalize_s,
                  "aborted_at_return": aborted_at_return, "aborted": aborted, "release_errors": errors}), flush=True)
"""


def _child_env() -> dict[str, str]:
    """The scripts importable, output unbuffered, no watcher started by itself, gloo on loopback."""
    return {**os.environ, "PYTHONPATH": suite_process.python_path(), "PYTHONUNBUFFERED": "1",
            "TORCH_PEER_WATCHER": "0", "GLOO_SOCKET_IFNAME": "lo"}  # fmt: skip


def run_finalize(scope: str, abort_s: float = 0.0) -> dict:
    # Forked from a process that imported torch once (harness/forkserver.py): its CPU changes, not what it does.
    # The abort's time is an argument: a variable of its own would have made a fork server of its own.
    proc = forkserver.start([sys.executable, "-c", textwrap.dedent(CHILD), scope, str(abort_s)], _child_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def test_the_watchers_shrink_aborts_the_parent_and_drops_it_from_every_group_map_without_destroying_it() -> None:
    # The parent's abort takes 1.5 s here; the shrunk group is handed over without waiting for it
    # (issue 55: stock NCCL's abort waits up to 0.5 s for the proxy thread's poll), and the abort is done
    # in the watcher's release thread, which wait_for_releases (and the interpreter's exit) waits for.
    got = run_finalize("watcher", abort_s=1.5)
    assert got["seam"] is None  # torch 2.13.0's shrink_group has the step the watcher replaces
    assert got["destroyed"] == [], got
    assert got["finalize_s"] < 1.0 and got["aborted_at_return"] == [], got
    assert got["aborted"] == [[got["parent"], "torch_peer_watcher-release"]] and got["release_errors"] == [], got
    assert not any(got["in_maps"].values()), got["in_maps"]
    # The shrunk group is registered as stock shrink_group registers it, and it works.
    assert got["new_registered"] and got["new_ranks"] == [0] and got["result"] == [1.0, 1.0]


def test_a_users_own_shrink_group_outside_the_watcher_still_destroys_the_parent_as_pytorch_does() -> None:
    # The control: the same call outside the watcher's scope reaches destroy_process_group, so the
    # test above observes the change and not a PyTorch that never destroys.
    got = run_finalize("user")
    assert got["destroyed"] == [got["parent"]], got
    assert not any(got["in_maps"].values()) and got["new_registered"]


def test_shrink_unsupported_names_a_pytorch_whose_shrink_group_lacks_the_seam(monkeypatch: pytest.MonkeyPatch) -> None:
    sys.path.insert(0, str(SCRIPTS))
    from torch.distributed import distributed_c10d as c10d

    from torch_peer_watcher import groups

    assert groups.shrink_seam_missing() is None
    # A PyTorch whose shrink_group finalizes another way: the watcher refuses to shrink (and aborts)
    # rather than risk the destroy that hangs.
    monkeypatch.delattr(c10d, "_cleanup_original_group")
    why = groups.shrink_seam_missing()
    assert why is not None and "_cleanup_original_group" in why
    with pytest.raises(RuntimeError, match="cannot shrink without destroying the parent"):
        with groups.aborting_shrinks():
            pass


# Three ranks on gloo over a real TCPStore; rank 2 leaves (the dead peer) once the others have made G.
# Ranks 0 and 1 agree on a shrink of group G that failed on rank 1, then both rebuild G without rank 2
# from the store; rank 0 also waits for a word that rank 1 never gives (on the world group). Prints one
# JSON line per rank.
REBUILD_CHILD = r"""
import json, os, sys
from datetime import timedelta
import torch, torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from torch_peer_watcher import groups

rank, port = int(sys.argv[1]), int(sys.argv[2])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=3,
                        timeout=timedelta(seconds=60))
g = dist.new_group([0, 1, 2], timeout=timedelta(seconds=45))
store = c10d._get_default_store()
if rank == 2:
    # Gone once every member has made G: a rank that left while the others were still connecting their
    # gloo pairs to it failed their new_group instead ("Connection closed by peer", 1 run in 5 under load).
    store.wait(["made/0", "made/1"])
    os._exit(0)
store.set(f"made/{rank}", "1")
watched = groups.describe(g, "shrink")
failure = "DistBackendError: NCCL error: remote process exited" if rank == 1 else None
others = groups.agree_on_shrink(watched, {2}, failure, timeout_s=30)
new = groups.rebuild(watched, [2])
t = torch.full((4,), float(rank + 1))
new.allreduce([t]).wait()
silent = groups.agree_on_shrink(groups.describe(None, "shrink"), {2}, None, timeout_s=1) if rank == 0 else None
print(json.dumps({"others": others, "silent": silent, "ranks": dist.get_process_group_ranks(new), "size": new.size(),
                  "rank_in_new": new.rank(), "sum": t.tolist(), "parent_in_map": g in c10d._world.pg_map,
                  "timeout_s": new._get_backend(torch.device("cpu")).options._timeout.total_seconds()}), flush=True)
os._exit(0)
"""


def test_members_agree_that_a_shrink_failed_and_rebuild_the_group_from_the_store() -> None:
    """The fallback for a shrink that fails on some member (NCCL's network transport between nodes):
    each member's word through the store, then the group built anew without the dead rank, registered
    as a shrink's result and working; a member that never answers is named after the timeout."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [forkserver.start([sys.executable, "-c", textwrap.dedent(REBUILD_CHILD), str(r), str(port)], _child_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(3)]  # fmt: skip
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    got = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs[:2]]
    assert got[0]["others"] == "group rank 1: DistBackendError: NCCL error: remote process exited", got[0]
    assert got[1]["others"] == "", got[1]  # rank 0's shrink worked; rank 1 knows its own failure
    assert got[0]["silent"] == "no word from group rank 1 within 1 s", got[0]
    for rank, g in enumerate(got):
        assert g["ranks"] == [0, 1] and g["size"] == 2 and g["rank_in_new"] == rank, g
        assert g["sum"] == [3.0] * 4 and not g["parent_in_map"], g
        assert g["timeout_s"] == 45.0, g  # the group's own timeout, not the agreement's 30 s
