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

pytest.importorskip("torch", reason="torch is not installed (pip install torch==2.13.0)")

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"

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
if scope == "watcher":
    with groups.aborting_shrinks():
        new = c10d._finalize_shrunk_group(info, set(), new_backend)
else:
    new = c10d._finalize_shrunk_group(info, set(), new_backend)
maps = {m: parent in getattr(c10d._world, m) for m in ("pg_map", "pg_names", "pg_group_ranks", "pg_backend_config", "pg_to_tag")}
maps["tags_to_pg"] = any(parent in pgs for pgs in c10d._world.tags_to_pg.values())
import torch
t = torch.ones(2)
new.allreduce([t]).wait()
print(json.dumps({"destroyed": destroyed, "parent": name, "in_maps": maps,
                  "new_registered": new in c10d._world.pg_map, "new_ranks": dist.get_process_group_ranks(new),
                  "seam": groups.shrink_seam_missing(), "result": t.tolist()}), flush=True)
"""


def run_finalize(scope: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SCRIPTS), os.environ.get("PYTHONPATH", "")]), "PYTHONUNBUFFERED": "1",
           "TORCH_PEER_WATCHER": "0", "GLOO_SOCKET_IFNAME": "lo"}  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(CHILD), scope], env=env, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_watchers_shrink_aborts_the_parent_and_drops_it_from_every_group_map_without_destroying_it() -> None:
    got = run_finalize("watcher")
    assert got["seam"] is None  # torch 2.13.0's shrink_group has the step the watcher replaces
    assert got["destroyed"] == [], got
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
