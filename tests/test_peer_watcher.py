"""torch_peer_watcher for real on CPU (gloo): dead and stuck peers, group selection, heartbeats, auto-start.

The process-level cases run torch_dist_check's peer-loss cases (``--checks peerloss
--peerloss-backend gloo``): real worker processes, a real SIGKILL or SIGSTOP, and the JSON figures.
The heartbeat is scaled down (0.5 s interval, 2 s timeout) so the default run stays short; the
full-length false positive (a peer busy 60 s against the default 5 s timeout) is marked heavy.
The NCCL side (abort of a blocked NCCL collective, CUDA context, transports, shrink) needs a GPU (one suffices: the placement shares it).
The jobs the tests start themselves fork from a process that imported torch once (harness/forkserver.py,
``fork_start``), but for the auto-start's: those prove what a new interpreter does as it starts.
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

import suite_process  # noqa: E402
from test_dist_check_run import _free_port, checks_by_name, run_check  # noqa: E402

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
sys.path.insert(0, str(SCRIPTS))

from torch_dist_check.harness import forkserver  # noqa: E402
from torch_peer_watcher.groups import backend_names  # noqa: E402
from torch_peer_watcher.settings import WatcherConfigError, WatcherSettings  # noqa: E402
from torch_peer_watcher.sockets import normalize  # noqa: E402

FAST_HEARTBEAT = ["--peerloss-heartbeat", "0.5", "--peerloss-heartbeat-timeout", "2"]


def job_env(**extra: str) -> dict[str, str]:
    """The environment of a job the tests start: theirs, with the scripts importable (tests/suite_process.py's
    PYTHONPATH, the one its fork server has)."""
    return dict(os.environ, PYTHONPATH=suite_process.python_path(), **extra)


def fork_start(argv: list[str], env: dict[str, str],
               **streams: Any) -> subprocess.Popen[str] | forkserver.ForkedProcess:  # fmt: skip
    """``subprocess.Popen(argv, env=env, text=True, **streams)``, forked from this test process's fork server,
    which imported torch once (harness/forkserver.py: the same script or code, arguments, environment, streams,
    session, exit handlers and exit status): each process here is a worker that imports torch first and ends by
    ``os._exit`` or at its last line, and none proves how an interpreter starts, so each would only cost a torch
    import of its own (1.4-2.2 s of CPU with PyPI's CUDA build on the 2-core CI machine)."""
    return forkserver.start(argv, env, text=True, **streams)


def peerloss(tmp_path: Path, *extra: str) -> dict[str, dict]:
    _, doc = run_check(["--checks", "peerloss", "--backends", "gloo", "--peerloss-backend", "gloo", *FAST_HEARTBEAT, *extra],
                       tmp_path)  # fmt: skip
    return checks_by_name(doc)


def only_run(check: dict) -> dict:
    assert len(check["details"]["runs"]) == 1
    return check["details"]["runs"][0]


@pytest.fixture(scope="module")
def watched_cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """The cases of one suite run that the tests below read, each with the watcher, a peer SIGKILLed where
    one dies: two worlds, a peer busy 3 s (half again the 2 s heartbeat timeout, holding the GIL in turns)
    and the shrink. One run for the three: the suite's own process costs a torch import (1.5 s of CPU)."""
    return peerloss(tmp_path_factory.mktemp("watched-cases"), "--peerloss-cases", "two-world,false-positive,shrink",
                    "--peerloss-watcher", "on", "--peerloss-busy", "3")  # fmt: skip


def test_sigkilled_peer_breaks_only_its_group_and_the_other_group_stays_exact(watched_cases):
    check = watched_cases["peerloss/gloo/two-world/watcher"]
    assert check["status"] == "pass", check
    run = only_run(check)
    # Death seen from the closed connection, in milliseconds, not after a heartbeat timeout: counted from when the
    # dead process ended (``closed_s``, through a pidfd; its files, its connections, closed just before). The kernel
    # closes a SIGKILLed process's files only after tearing down its memory: 0.02-0.09 s after the kill here with 3
    # busy loops on the 2 cores (20 runs); a verdict 1.24 s after the kill failed the old bound (0.5 s from the kill)
    # once in a full run, before the figures said when the victim ended. A close later than the heartbeat timeout
    # less an interval (1.5 s) may rightly be beaten by the silence's verdict.
    assert run["closed_s"] is not None and run["detected_s"] < run["closed_s"] + 0.5, run
    assert run["silent_s"] == "0.0" or run["closed_s"] > 1.0, run
    assert run["exception_s"] < run["closed_s"] + 0.5, run
    # Group selection: the default group and A (both hold the dead rank 1) were aborted, B was not.
    assert sorted(run["groups"].split(",")) == ["0", "1"]
    assert run["b_exact"] is True and run["b_longest_s"] < 1.0
    assert run["fresh_group_s"] < 5.0


def test_sigstopped_peer_is_declared_dead_by_heartbeat_and_without_the_watcher_nothing_raises(tmp_path):
    checks = peerloss(tmp_path, "--peerloss-cases", "single", "--peerloss-ops", "allreduce", "--peerloss-signal", "stop",
                      "--peerloss-exception-timeout", "5")  # fmt: skip
    watched = checks["peerloss/gloo/allreduce/watcher"]
    assert watched["status"] == "pass", watched
    run = only_run(watched)
    # Declared after the 2 s timeout, counted from the peer's last heartbeat, which came up to one
    # interval (0.5 s) before it stopped, or a little more where its thread woke late for its next beat
    # (1.4966 s once in a full run on 2 busy cores); a closed connection would be seen in milliseconds.
    assert 1.25 <= run["detected_s"] <= 4.0, run
    assert run["exception_s"] <= run["detected_s"] + 0.5
    # gloo has no abort: the watcher unblocked the collective by cutting its sockets to the peer.
    assert int(run["cut"]) >= 1
    unwatched = checks["peerloss/gloo/allreduce/no-watcher"]
    assert unwatched["status"] == "fail"
    assert "no exception within 5 s" in unwatched["reason"]


def test_peer_computing_longer_than_the_heartbeat_timeout_is_not_declared_dead(watched_cases):
    # Busy 3 s, half again the 2 s heartbeat timeout (FAST_HEARTBEAT), holding the GIL in turns.
    check = watched_cases["peerloss/gloo/false-positive"]
    assert check["status"] == "pass", check
    run = only_run(check)
    assert run["losses"] == 0 and run["exact"] is True
    assert run["waited_s"] >= 3.0


@pytest.mark.heavy
def test_peer_computing_60_s_is_not_declared_dead_with_the_default_heartbeat(tmp_path):
    _, doc = run_check(["--checks", "peerloss", "--backends", "gloo", "--peerloss-backend", "gloo",
                        "--peerloss-cases", "false-positive", "--peerloss-busy", "60"], tmp_path)  # fmt: skip
    check = checks_by_name(doc)["peerloss/gloo/false-positive"]
    assert check["status"] == "pass", check
    assert only_run(check)["waited_s"] >= 60.0


@pytest.mark.heavy
def test_every_gloo_case_with_the_watcher_recovers_from_kill_and_stop(tmp_path):
    for signal_name in ("kill", "stop"):
        checks = peerloss(tmp_path, "--peerloss-watcher", "on", "--peerloss-cases", "single,two-world",
                          "--peerloss-signal", signal_name)  # fmt: skip
        for name, check in checks.items():
            assert check["status"] == "pass", (signal_name, name, check["reason"])


AUTOSTART_WORKER = textwrap.dedent(
    """
    import os, signal, site, sys, time
    site.addsitedir(sys.argv[2])          # processes torch_peer_watcher.pth, as site-packages would
    import torch, torch.distributed as dist
    import torch_peer_watcher as tpw
    rank, world = int(sys.argv[1]), int(sys.argv[3])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    group = dist.new_group(list(range(world)))
    watcher = tpw.current()
    print("WATCHER", watcher is not None, flush=True)
    if watcher is None:
        os._exit(0)
    if rank == 1:
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        with watcher.guard(group):
            while True:
                dist.all_reduce(torch.ones(4), group=group)
    except tpw.PeerLostError as exc:
        print("LOST", exc.loss.rank, sorted(exc.loss.groups), flush=True)
    os._exit(0)
    """
)


def run_autostart(tmp_path: Path, switch: str, port: int, world: int = 2) -> list[str]:
    """Rank 0's lines of a job of ``world`` ranks started as interpreters (the .pth acts as one starts).

    Each an interpreter of its own, never forked (fork_start): the hook must be in place before torch.distributed
    is imported, as the .pth puts it as an interpreter starts; a child of the fork server has it imported already,
    and torch.distributed has re-exported the functions the hook wraps (torch_peer_watcher/autostart.py), so a
    hook that did nothing would show as 'off' there too."""
    site_dir = tmp_path / "site"
    site_dir.mkdir(exist_ok=True)
    (site_dir / "torch_peer_watcher.pth").write_text((SCRIPTS / "torch_peer_watcher" / "torch_peer_watcher.pth").read_text())
    script = tmp_path / "worker.py"
    script.write_text(AUTOSTART_WORKER)
    env = dict(os.environ, PYTHONPATH=str(SCRIPTS), TORCH_PEER_WATCHER=switch, TORCH_PEER_WATCHER_INTERVAL_S="0.5",
               TORCH_PEER_WATCHER_TIMEOUT_S="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")  # fmt: skip
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(site_dir), str(world)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(world)]  # fmt: skip
    out, _ = procs[0].communicate(timeout=120)
    for proc in procs[1:]:
        proc.wait(timeout=30)
    return out.splitlines()


def test_autostart_watches_every_group_when_switched_on_and_nothing_when_off(tmp_path):
    lines = run_autostart(tmp_path, "1", _free_port())
    assert "WATCHER True" in lines, lines
    # The default group and new_group's group were both watched and both aborted.
    assert "LOST 1 ['0', '1']" in lines, lines
    # Off: no watcher for the default group or a new one; one rank shows it (a second costs a torch import).
    assert "WATCHER False" in run_autostart(tmp_path, "0", _free_port(), world=1)


def test_invalid_heartbeat_setting_is_refused_with_the_variable_named():
    with pytest.raises(WatcherConfigError, match="TORCH_PEER_WATCHER_TIMEOUT_S='soon'"):
        WatcherSettings.from_env({"TORCH_PEER_WATCHER_TIMEOUT_S": "soon"})
    with pytest.raises(WatcherConfigError, match="shorter than two intervals"):
        WatcherSettings(interval_s=1.0, timeout_s=1.5)
    assert WatcherSettings.from_env({"TORCH_PEER_WATCHER_TIMEOUT_S": "0"}).timeout_s == 0


def test_invalid_autostart_switch_fails_init_process_group_with_a_clear_error(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(SCRIPTS), TORCH_PEER_WATCHER="1", TORCH_PEER_WATCHER_INTERVAL_S="-1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))  # fmt: skip
    code = ("import torch_peer_watcher.autostart as a; a.install(); import torch.distributed as dist; "
            "dist.init_process_group('gloo', rank=0, world_size=1)")  # fmt: skip
    # An interpreter of its own, as run_autostart's: the hook is installed before torch.distributed is imported.
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "WatcherConfigError: heartbeat interval must be > 0 s, got -1.0" in proc.stderr


def test_backend_names_and_endpoint_forms():
    assert backend_names("cpu:gloo,cuda:nccl") == ("gloo", "nccl")
    assert backend_names("nccl") == ("nccl",)
    assert normalize(("::ffff:127.0.0.1", 5, 0, 0)) == ("127.0.0.1", 5)


def test_peerloss_bad_run_count_is_a_usage_error(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "torch_dist_check", "--checks", "peerloss", "--peerloss-runs", "0"],
                          env=dict(os.environ, PYTHONPATH=str(SCRIPTS)), capture_output=True, text=True, cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 2
    assert "--peerloss-runs: must be > 0, got 0" in proc.stderr
    assert list(tmp_path.iterdir()) == []


FORK_WORKER = textwrap.dedent(
    """
    import os, signal, sys, time
    import torch.distributed as dist
    import torch_peer_watcher as tpw
    rank = int(sys.argv[1])
    dist.init_process_group("gloo", rank=rank, world_size=2)
    watcher = tpw.start(settings=tpw.WatcherSettings(interval_s=1.0, timeout_s=20.0))
    if rank == 1:
        if os.fork() == 0:          # a child that outlives its parent, as a data-loader worker may
            time.sleep(30)
            os._exit(0)
        time.sleep(0.5)
        print("KILL", time.time(), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    loss = watcher.wait_for_loss(timeout_s=25)
    print("LOSS", loss.detected_at if loss else None, loss.cause if loss else None, flush=True)
    os._exit(0)
    """
)


def test_a_forked_child_does_not_hide_its_parents_death(tmp_path):
    script = tmp_path / "fork_worker.py"
    script.write_text(FORK_WORKER)
    env = job_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), GLOO_SOCKET_IFNAME="lo")
    procs = [fork_start([sys.executable, str(script), str(r)], env, stdout=subprocess.PIPE, start_new_session=True)
             for r in (0, 1)]  # fmt: skip
    try:
        survivor_out, _ = procs[0].communicate(timeout=120)
    finally:
        # The forked child still holds the victim's stdout: end its whole session.
        for proc in procs:
            try:
                os.killpg(proc.pid, 9)
            except ProcessLookupError:
                pass
    victim_out, _ = procs[1].communicate(timeout=30)
    killed_at = float(victim_out.split()[1])
    _, detected_at, *cause = survivor_out.split()
    # The child closed its copy of the link at fork: the parent's death is EOF at once, long
    # before the 20 s heartbeat timeout.
    assert float(detected_at) - killed_at < 1.0, survivor_out
    assert "closed its connection" in " ".join(cause)


def test_nccl_peerloss_cases_cover_the_matrix_and_skip_with_a_reason_without_gpus(tmp_path):
    from torch_dist_check.peerloss import cases as peerloss

    cases = peerloss.cases_for("nccl", peerloss.KINDS, peerloss.TRANSPORTS, peerloss.OPS, peerloss.WATCHER_MODES)
    names = [c.name for c in cases]
    # transport {p2p, shm, net} x op {all_reduce, send/recv, coalesced} x {with, without}, two-world x 2,
    # false positive, shrink and the three train cases (with the watcher only).
    assert len(names) == 3 * 3 * 2 + 2 + 1 + 1 + 3 and len(set(names)) == len(names)
    assert "peerloss/nccl/shm/coalesced/no-watcher" in names and "peerloss/nccl/p2p/two-world/watcher" in names
    assert "peerloss/nccl/p2p/shrink/watcher" in names
    assert {"peerloss/nccl/p2p/train-shrink/watcher", "peerloss/nccl/p2p/train-fresh/watcher"} <= set(names)
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the NCCL cases would really run")
    _, doc = run_check(["--checks", "peerloss", "--backends", "gloo,nccl"], tmp_path)
    checks = checks_by_name(doc)
    assert set(checks) == set(names)
    assert all(c["status"] == "skipped" for c in checks.values())
    reason = checks["peerloss/nccl/net/sendrecv/watcher"]["reason"]
    assert reason in ("PyTorch was built without NCCL", "no CUDA device is visible (use --peerloss-backend gloo to run the cases on CPU)")


def test_the_fault_check_keeps_the_flavors_watcher_off_and_peerloss_starts_it_only_when_asked():
    from torch_dist_check.checks import fault
    from torch_dist_check.peerloss import cases as peerloss
    from torch_dist_check.peerloss import runner

    flavor_env = {"TORCH_PEER_WATCHER": "1", "NCCL_P2P_DISABLE": "1"}
    assert fault.worker_env(fault.FaultCase("nccl", 2, "allreduce"), flavor_env, {})["TORCH_PEER_WATCHER"] == "0"
    case = peerloss.PeerLossCase("single", "nccl", "p2p", "allreduce", True)
    env = runner.worker_env(case, {**flavor_env, "NCCL_HOSTID": "inherited"}, peerloss.PeerLossSettings())
    # The worker starts the watcher itself; "p2p" means nothing forced, whatever the caller's environment.
    assert env["TORCH_PEER_WATCHER"] == "0" and "NCCL_P2P_DISABLE" not in env and env["NCCL_NVLS_ENABLE"] == "0"
    # A placement variable comes from the case's own placement, never from the caller.
    assert "NCCL_HOSTID" not in env


def test_a_survivor_polling_async_work_recovers_too(tmp_path):
    checks = peerloss(tmp_path, "--peerloss-cases", "single", "--peerloss-ops", "coalesced,sendrecv",
                      "--peerloss-watcher", "on", "--peerloss-pattern", "poll")  # fmt: skip
    check = checks["peerloss/gloo/coalesced/watcher"]
    assert check["status"] == "pass", check
    run = only_run(check)
    assert check["details"]["pattern"] == "poll" and run["exception_s"] < run["closed_s"] + 0.5, run
    assert checks["peerloss/gloo/sendrecv/watcher"]["status"] == "skipped"


AFTER_ABORT_WORKER = textwrap.dedent(
    """
    import ctypes, os, signal, sys
    import torch, torch.distributed as dist
    import torch_peer_watcher as tpw
    rank = int(sys.argv[1])
    dist.init_process_group("gloo", rank=rank, world_size=3)
    a, b, c = dist.new_group([0, 1]), dist.new_group([0, 2]), dist.new_group([0, 1, 2])
    watcher = tpw.start(settings=tpw.WatcherSettings(interval_s=0.5, timeout_s=2.0))
    if rank in (0, 1):
        watcher.watch(a)
    if rank in (0, 2):
        watcher.watch(b)
    watcher.watch(c, recovery="shrink")
    t = torch.ones(4)
    if rank in (0, 1):
        dist.all_reduce(t, group=a)
    dist.all_reduce(t, group=c)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    loss = watcher.wait_for_loss(c, timeout_s=30)
    if rank == 0:
        # The op comes after the watcher handled the loss: it reaches the aborted group's backend.
        try:
            dist.all_reduce(t, group=a)
        except Exception as exc:
            print("AFTER", type(exc).__name__, " ".join(str(exc).split())[:120], flush=True)
        try:
            with watcher.guard(a):
                if os.environ.get("NCCL_LIBRARY"):
                    # What PyTorch's NCCL send/recv leaves when NCCL fails inside it: an open group.
                    ctypes.CDLL(os.environ["NCCL_LIBRARY"]).ncclGroupStart()
                dist.all_reduce(t, group=a)
        except tpw.PeerLostError as exc:
            print("GUARD", exc.ranks, exc.nccl_groups_closed, flush=True)
        t = torch.ones(4)
        dist.all_reduce(t, group=b)
        print("B", t.tolist(), flush=True)
    if rank == 2:
        dist.all_reduce(torch.ones(4), group=b)
    print("SHRUNK", watcher.shrunk(c, timeout_s=5), sorted(loss.shrunk), flush=True)
    print("ERRORS", " | ".join(loss.errors), flush=True)
    watcher.stop()
    os._exit(0)
    """
)


def cached_nccl_library() -> Path | None:
    """The cached libnccl (test_ncclgroups), or None where the channelsmith tool that caches it is not installed
    (CI's torch 2.6.0 venv holds torch alone): the guard's group closing then goes unchecked, as without a cache."""
    try:
        from test_ncclgroups import nccl_library
    except ImportError:
        return None
    return nccl_library()


def test_an_op_after_the_watchers_abort_raises_the_backends_error_not_a_value_error(tmp_path):
    """Issue 20: a survivor's op on an aborted group raised ValueError ('not initialized in the world
    group map'), because the abort also dropped the group from PyTorch's bookkeeping. And guard()
    closes the NCCL group a failed send/recv left open (with a real libnccl where one is cached)."""
    script = tmp_path / "after_abort.py"
    script.write_text(AFTER_ABORT_WORKER)
    library = cached_nccl_library()
    env = job_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), GLOO_SOCKET_IFNAME="lo",
                  NCCL_LIBRARY=str(library or ""))  # fmt: skip
    procs = [fork_start([sys.executable, str(script), str(r)], env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for r in (0, 1, 2)]  # fmt: skip
    out, _ = procs[0].communicate(timeout=120)
    for proc in procs[1:]:
        proc.communicate(timeout=30)
    lines = {line.split()[0]: line for line in out.splitlines() if line.split()}
    assert "AFTER" in lines, out
    # gloo's own error (RuntimeError; NCCL's is DistBackendError), never the bookkeeping's ValueError.
    assert lines["AFTER"].startswith("AFTER RuntimeError") and "Connection" in lines["AFTER"], out
    assert lines["GUARD"] == f"GUARD (1,) {1 if library else 0}", out
    assert lines["B"] == "B [2.0, 2.0, 2.0, 2.0]", out
    # gloo cannot shrink (torch 2.13.0): the group watched for a shrink was aborted instead, and said why.
    assert lines["SHRUNK"] == "SHRUNK None []", out
    # The watcher says why before calling shrink_group (PyTorch's own refusal is a TypeError).
    assert "shrink: RuntimeError: cannot shrink" in lines["ERRORS"] and (
        "does not support shrink_group" in lines["ERRORS"] or "has no torch.distributed" in lines["ERRORS"]), out


def test_the_shrink_case_is_skipped_naming_what_this_pytorch_lacks(watched_cases):
    assert [name for name in watched_cases if "shrink" in name] == ["peerloss/gloo/shrink/watcher"]
    check = watched_cases["peerloss/gloo/shrink/watcher"]
    assert check["status"] == "skipped", check
    assert "does not support shrink_group" in check["reason"] or "has no torch.distributed" in check["reason"]


def test_watch_refuses_an_unknown_recovery():
    from torch_peer_watcher.watcher import PeerWatcher

    watcher = PeerWatcher.__new__(PeerWatcher)
    with pytest.raises(ValueError, match="recovery must be one of abort, shrink, not 'restart'"):
        watcher.watch(None, recovery="restart")


def test_shrink_refuses_an_nccl_group_bound_to_no_gpu_saying_how_to_bind_it():
    """Issue 20: shrink_group of an unbound NCCL group made a group with no CUDA backend (on one
    H100, the shrunk group's all_reduce raised 'No backend type associated with device type cuda')."""
    pytest.importorskip("torch")
    from torch_peer_watcher import groups

    class UnboundNccl:
        bound_device_id = None

    from unittest import mock

    with mock.patch("torch.distributed.distributed_c10d.get_backend", return_value="nccl"):
        why = groups.shrink_unsupported(UnboundNccl())
    if why is not None and "has no torch.distributed" in why:
        pytest.skip(why)
    assert why is not None and "not bound to a GPU" in why and "device_id=" in why


def test_stop_collects_nothing_itself_and_the_stopped_watchers_objects_go_at_exit(tmp_path):
    # Issue 55: a gc.collect() in stop() cost 0.2-0.6 s of every HSDP rejoin; the collection that keeps the
    # interpreter's teardown from aborting (issue 54) now runs once, at exit.
    env = job_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    code = """
import gc, sys
import torch.distributed as dist
import torch_peer_watcher as tpw
dist.init_process_group('gloo', rank=0, world_size=1)
watcher = tpw.start()
full = []
gc.callbacks.append(lambda phase, info: phase == 'start' and info['generation'] == 2 and full.append(1))
tpw.stop()
print('full collections in stop:', len(full), flush=True)
gc.callbacks.append(lambda phase, info: phase == 'start' and info['generation'] == 2 and print('collected at exit', flush=True))
"""
    # Forked, as fork_start's are: a child of the fork server runs the exit handlers, this collection among them,
    # as an interpreter does before its teardown; where the collection runs is what this proves.
    proc = suite_process.run_argv([sys.executable, "-c", code], env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "full collections in stop: 0" in proc.stdout
    assert proc.stdout.rstrip().endswith("collected at exit"), proc.stdout
