"""PyTorch's NCCL watchdog settings that the watcher needs (torch_peer_watcher/watchdog.py, issue 67).

With PyTorch's defaults a survivor of a peer's death over NCCL's network transport died by SIGABRT about 60 s
later, or its shrink waited 60 s behind the watchdog. Importing the watcher makes every group made after the
import under the settings that let it live, where the job's environment names none; a value the user set stays,
and watch() of an NCCL group refuses a value that kills. On CPU: the settings as a group's maker sees them (also
in a process forked from one that imported the watcher, as a fork server's children are), and the refusal's
reasons. The refusal on a real NCCL group, and the import after init_process_group, run under ``-m gpu``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (bash scripts/install-test-deps.sh installs it)")

import suite_process  # noqa: E402

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
sys.path.insert(0, str(SCRIPTS))

from torch_peer_watcher import watchdog  # noqa: E402

NAMES = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_ENABLE_MONITORING",
         "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC", "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_FR_BUFFER_SIZE",
         "TORCH_NCCL_TRACE_BUFFER_SIZE")  # fmt: skip

# One rank of a gloo world of one: what the environment holds after the import, after init_process_group,
# and in a child forked after the import whose environment was replaced (a fork server's request).
MAKER = r"""
import json, os, sys
seen = {}
def settings():
    return {k: os.environ.get(k) for k in sys.argv[2].split(",")}
import torch, torch.distributed as dist, torch_peer_watcher
seen["after_import"] = settings()
pid = os.fork()
if pid == 0:
    os.environ.clear()
    os.environ.update(json.loads(sys.argv[3]))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[1]}", rank=0, world_size=1)
    print(json.dumps({"forked_after_group": settings()}), flush=True)
    os._exit(0)
os.waitpid(pid, 0)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{int(sys.argv[1]) + 1}", rank=0, world_size=1)
seen["after_group"] = settings()
print(json.dumps(seen), flush=True)
"""


def free_port_pair() -> int:
    import socket

    for _ in range(50):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            try:
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port
    raise RuntimeError("no two adjacent free ports")


def run_maker(env_extra: dict[str, str], child_env_extra: dict[str, str]) -> dict[str, dict[str, str | None]]:
    """MAKER's findings, run with the test's environment (but NAMES) and ``env_extra``.

    Forked from this test process's fork server, which imported torch, not the watcher, once (tests/suite_process.py):
    MAKER imports torch and torch.distributed before the watcher either way, so the watcher's import finds them as
    in an interpreter of its own; the variables the tests set are among those read only as a group is made
    (harness/forkserver.py's late ones), so the child's own values are read. An interpreter apiece cost a torch
    import (about 2 s of CPU with PyPI's CUDA build on the 2-core CI machine)."""
    base = {k: v for k, v in os.environ.items() if k not in NAMES}
    env = {**base, "PYTHONPATH": suite_process.python_path(), **env_extra}
    child_env = {"PATH": os.environ.get("PATH", ""), **child_env_extra}
    argv = [sys.executable, "-c", MAKER, str(free_port_pair()), ",".join(NAMES), json.dumps(child_env)]
    out = suite_process.run_argv(argv, env, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    seen: dict[str, dict[str, str | None]] = {}
    for line in out.stdout.splitlines():
        seen.update(json.loads(line))
    return seen


def test_groups_made_after_the_import_get_the_settings_and_a_users_value_stays() -> None:
    # The user named the error handling by its legacy name: it stays, and its current name is not set over it.
    seen = run_maker({"NCCL_ASYNC_ERROR_HANDLING": "0"}, {})
    assert seen["after_import"] == {**dict.fromkeys(NAMES), "NCCL_ASYNC_ERROR_HANDLING": "0"}  # the import alone: nothing
    assert seen["after_group"] == {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": None, "NCCL_ASYNC_ERROR_HANDLING": "0", "TORCH_NCCL_ENABLE_MONITORING": "0",
        "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "0", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
        # PyTorch >= 2.8 reads the flight recorder's size as TORCH_FR_BUFFER_SIZE (and warns on the old name).
        "TORCH_FR_BUFFER_SIZE": "0", "TORCH_NCCL_TRACE_BUFFER_SIZE": None,
    }  # fmt: skip
    # A child forked after the import with an environment of its own (a fork server's request): its group too.
    assert seen["forked_after_group"] == {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "NCCL_ASYNC_ERROR_HANDLING": None, "TORCH_NCCL_ENABLE_MONITORING": "0",
        "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "0", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0", "TORCH_FR_BUFFER_SIZE": "0",
        "TORCH_NCCL_TRACE_BUFFER_SIZE": None,
    }  # fmt: skip


def test_a_users_flight_recorder_stays_on_under_either_name() -> None:
    seen = run_maker({"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000"}, {"TORCH_FR_BUFFER_SIZE": "100"})
    assert seen["after_group"]["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "2000" and seen["after_group"]["TORCH_FR_BUFFER_SIZE"] is None
    assert seen["forked_after_group"]["TORCH_FR_BUFFER_SIZE"] == "100"


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({}, ["TORCH_NCCL_ASYNC_ERROR_HANDLING unset (PyTorch's default 3)", "TORCH_NCCL_ENABLE_MONITORING unset (PyTorch's default 1)",
              "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC unset (PyTorch's default 15000)"]),
        ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "TORCH_NCCL_ENABLE_MONITORING": "0", "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "0"},
         ["TORCH_NCCL_ASYNC_ERROR_HANDLING=3"]),
        ({"NCCL_ASYNC_ERROR_HANDLING": "1", "TORCH_NCCL_ENABLE_MONITORING": "1", "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "0"},
         ["NCCL_ASYNC_ERROR_HANDLING=1", "TORCH_NCCL_ENABLE_MONITORING=1"]),
        # The current name wins over the legacy one, as in PyTorch.
        ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0", "NCCL_ASYNC_ERROR_HANDLING": "3", "TORCH_NCCL_ENABLE_MONITORING": "0",
          "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "500"}, ["TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC=500"]),
        ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_ENABLE_MONITORING": "0", "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "0",
          "TORCH_FR_BUFFER_SIZE": "2000"}, []),
    ],
    ids=["pytorch-defaults", "skip-cleanup", "legacy-teardown-and-monitor", "dump-wait", "good-with-flight-recorder"],
)  # fmt: skip
def test_the_conflicts_name_each_setting_that_would_end_or_stall_a_survivor_and_what_to_set(env: dict[str, str], named: list[str]) -> None:
    found = watchdog.conflicts(dict(env))
    assert [c.split(":")[0] for c in found] == named
    for conflict in found:
        name = conflict.split("=")[0].split(" ")[0].removeprefix("NCCL_")
        setting = next(s for s in watchdog.SETTINGS if s.name.endswith(name))
        assert f"set {setting.name}={setting.value}" in conflict


def test_apply_defaults_sets_only_what_neither_name_holds() -> None:
    env = {"NCCL_ASYNC_ERROR_HANDLING": "0", "TORCH_NCCL_ENABLE_MONITORING": "1"}
    applied = watchdog.apply_defaults(env)
    assert applied == ["TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC", "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_FR_BUFFER_SIZE", "NCCL_SET_THREAD_NAME"]
    assert env == {"NCCL_ASYNC_ERROR_HANDLING": "0", "TORCH_NCCL_ENABLE_MONITORING": "1", "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "0",
                   "TORCH_NCCL_DUMP_ON_TIMEOUT": "0", "TORCH_FR_BUFFER_SIZE": "0", "NCCL_SET_THREAD_NAME": "1"}  # fmt: skip
    assert watchdog.conflicts(env) == [watchdog.SETTINGS[1].conflict(env)]  # the user's monitor stays, and is named


# One rank on one GPU: the watcher refuses a group made under settings that kill, with the reason.
REFUSE = textwrap.dedent(
    r"""
    import os, sys
    import torch, torch.distributed as dist
    late = sys.argv[2] == "late"
    if not late:
        import torch_peer_watcher
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{sys.argv[1]}", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    import torch_peer_watcher
    print("BACKEND", torch.__version__, type(dist.group.WORLD._get_backend(torch.device("cuda"))).__name__, flush=True)
    try:
        torch_peer_watcher.start()
        print("WATCHED", flush=True)
    except torch_peer_watcher.WatcherError as exc:
        print("REFUSED", exc, flush=True)
    os._exit(0)
    """
)


@pytest.mark.gpu
@pytest.mark.parametrize(("when", "env", "expect"), [
    ("early", {}, "WATCHED"),
    ("early", {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}, "TORCH_NCCL_ASYNC_ERROR_HANDLING=3: 1 and 3 end the process"),
    ("late", {}, "made before torch_peer_watcher was imported, under TORCH_NCCL_ASYNC_ERROR_HANDLING unset"),
], ids=["imported-first", "users-skip-cleanup", "imported-after-init"])  # fmt: skip
def test_an_nccl_group_is_watched_only_under_settings_that_let_the_process_live(
    when: str, env: dict[str, str], expect: str, record_property: Any
) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU for NCCL (torch sees none)")
    base = {k: v for k, v in os.environ.items() if k not in NAMES and not k.startswith("TORCH_PEER_WATCHER")}
    secret = {"TORCH_PEER_WATCHER_SECRET": os.urandom(16).hex()}
    out = subprocess.run([sys.executable, "-c", REFUSE, str(free_port_pair()), when],
                         env={**base, **secret, "PYTHONPATH": str(SCRIPTS), **env}, capture_output=True, text=True, timeout=180)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    # Which implementation "nccl" ran on, in the report (-rA, --junitxml): 2.15.0's default is nccl2.
    _, version, backend = next(l for l in out.stdout.splitlines() if l.startswith("BACKEND")).split()
    record_property("nccl_backend", f"torch {version}: {backend}")
    print(f"nccl ran on torch {version}: {backend}")
    if version.split("+")[0] == "2.15.0" and base.get("TORCH_DIST_USE_NCCL2") != "0":
        assert backend == "ProcessGroupNCCL2", out.stdout
    line = next(l for l in out.stdout.splitlines() if l.startswith(("WATCHED", "REFUSED")))
    if expect == "WATCHED":
        assert line == "WATCHED", out.stdout
    else:
        assert line.startswith("REFUSED rank 0 cannot watch group") and "PyTorch's NCCL watchdog would end" in line, line
        assert expect in line, line
