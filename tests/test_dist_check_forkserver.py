"""Ranks and workers forked from one interpreter that imported torch once (issue 58): the child behaves as
`python -m MODULE` would (environment, directory, arguments, streams, exit status, exit handlers), a request
it cannot honour that way gets an interpreter of its own, and `--nproc` ranks and check workers take the fork."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from torch_dist_check.harness import forkserver
from torch_dist_check.nodes import namespaces

import suite_process

from test_dist_check_run import _free_port  # noqa: E402

TESTS = Path(__file__).resolve().parent
SCRIPTS = TESTS.parent / "scripts"


def child_env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join([str(TESTS), str(SCRIPTS)])
    return {**os.environ, "PYTHONPATH": path, "TORCH_DIST_CHECK_TEST_MARKER": "m", **extra}


@pytest.fixture(scope="module")
def server():
    held = forkserver.ForkServer(child_env())
    yield held
    held.close()


def run(server: forkserver.ForkServer, *args: str, **env: str):
    proc = server.start([sys.executable, "-m", "forkserver_child", *args], child_env(**env),
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    code = proc.wait(timeout=60)
    out, err = proc.stdout.read(), proc.stderr.read()
    return code, json.loads(out.splitlines()[0]), out, err


def test_a_forked_child_runs_the_module_as_its_own_interpreter_would(server, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, said, out, err = run(server, "exit", "0", TORCH_DIST_CHECK_TEST_MARKER="per request", TORCHINDUCTOR_CACHE_DIR=str(tmp_path))
    assert code == 0
    # Forked from the server, with torch already imported: no second import.
    assert said["ppid"] == server.proc.pid and said["torch_before_start"] is True
    assert said == {**said, "argv": ["exit", "0"], "cwd": str(tmp_path), "marker": "per request", "name": "__main__"}
    # The cache folder the request named, and the module that reads it not imported before the child ran.
    assert (said["inductor_cache"], said["inductor_cache_before_start"]) == (str(tmp_path), False)
    assert "a line to stderr" in err and "exit handler ran" in out
    # What the server's import of torch made is frozen (harness/startup.py: about 250,000 objects), and the
    # collector runs again for what the child makes.
    assert said["frozen_before_start"] > 100_000 and said["collecting_at_start"] is True


@pytest.mark.parametrize(("args", "status", "said_on_stderr"), [
    (("exit", "3"), 3, None),
    (("raise",), 1, "RuntimeError: planted in the child"),
    (("message",), 1, "a message instead of a status"),
])  # fmt: skip
def test_a_forked_child_ends_with_the_status_the_command_would(server, args, status, said_on_stderr):
    code, said, out, err = run(server, *args)
    assert (code, said["torch_before_start"]) == (status, True)
    assert said_on_stderr is None or said_on_stderr in err
    assert "exit handler ran" in out


def test_a_script_and_a_string_of_code_are_forked_too_with_their_stdin_and_a_session_of_their_own(server):
    proc = server.start([sys.executable, str(TESTS / "forkserver_child.py"), "exit", "0"], child_env(),
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    out, _ = proc.communicate(timeout=60)
    said = json.loads(out.splitlines()[0])
    assert (proc.returncode, said["torch_before_start"], said["name"]) == (0, True, "__main__")
    code = ("import json, os, sys; print(json.dumps({'argv': sys.argv, 'sid': os.getsid(0), 'pid': os.getpid(),"
            " 'line': sys.stdin.readline().strip(), 'path0': sys.path[0], 'torch': 'torch' in sys.modules}))")
    proc = server.start([sys.executable, "-c", code, "an argument"], child_env(), stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    out, err = proc.communicate("a line on stdin\n", timeout=60)
    said = json.loads(out)
    assert proc.returncode == 0 and err is None
    assert said == {**said, "argv": ["-c", "an argument"], "sid": said["pid"], "line": "a line on stdin", "path0": ""}
    assert said["torch"] is True


def test_a_forked_child_can_be_waited_for_with_a_bound_and_killed(server):
    proc = server.start([sys.executable, "-m", "forkserver_child", "sleep"], child_env(), stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE, text=True)  # fmt: skip
    assert json.loads(proc.stdout.readline())["torch_before_start"] is True
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.2)
    assert proc.poll() is None
    proc.kill()
    assert proc.wait(timeout=30) == -signal.SIGKILL
    assert proc.poll() == -signal.SIGKILL
    # stderr is line-buffered as an interpreter's is: what the child said before the kill is there.
    assert proc.stderr.read() == "a line to stderr\n"


def test_what_an_interpreter_reads_as_it_starts_if_different_gets_an_interpreter_of_its_own(server):
    # PYTHONPATH (and the like) shape the interpreter before any module runs: one that drops or reorders the
    # server's folders is not forked (one that only adds folders is: the tests below).
    other_path = os.pathsep.join([str(SCRIPTS), str(TESTS)])
    proc = server.start([sys.executable, "-m", "forkserver_child", "exit", "0"], child_env(PYTHONPATH=other_path),
                        stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert isinstance(proc, subprocess.Popen)
    said = json.loads(proc.stdout.readline())
    assert proc.wait(timeout=60) == 0
    assert (said["ppid"], said["torch_before_start"]) == (os.getpid(), False)
    # A command that is not `python -m MODULE` (a namespace node's nsenter line) is not forked either.
    assert not server.takes(["nsenter", "-t", "1", sys.executable, "-m", "forkserver_child"], child_env())
    # The watcher switched off explicitly starts an interpreter as unset does: forked.
    assert server.takes([sys.executable, "-m", "forkserver_child"], child_env(TORCH_PEER_WATCHER="0"))
    assert not server.takes([sys.executable, "-m", "forkserver_child"], child_env(TORCH_PEER_WATCHER="1"))
    # torch's cache folder is read only when torch first asks for it, in the child (whose environment is the
    # request's, test below); a test process that compiled once has it set: forked.
    assert server.takes([sys.executable, "-m", "forkserver_child"], child_env(TORCHINDUCTOR_CACHE_DIR="/elsewhere"))
    assert not server.takes([sys.executable, "-m", "forkserver_child"], child_env(TORCHINDUCTOR_FORCE_DISABLE_CACHES="1"))
    # The watcher's other settings (a case's fresh secret, its heartbeat) are read in the child: forked.
    assert server.takes([sys.executable, "-m", "forkserver_child"],
                        child_env(TORCH_PEER_WATCHER_SECRET="ab" * 32, TORCH_PEER_WATCHER_INTERVAL_S="0.5"))  # fmt: skip


# What a process says of its start: its path, whether torch was there before its code ran, what it imports.
SAYS_ITS_PATH = """import json, os, sys
before = "torch" in sys.modules
import planted
print(json.dumps({"path": sys.path, "torch_before_start": before, "planted": planted.WHERE, "ppid": os.getppid()}))
"""


def plant(folder: Path, **modules: str) -> Path:
    """A folder holding ``planted.py`` (which says where it is) and the given modules (name -> source)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "planted.py").write_text(f"WHERE = {str(folder)!r}\n")
    for name, source in modules.items():
        target = folder / name / "__init__.py" if name.endswith("/") else folder / f"{name}.py"
        target.parent.mkdir(exist_ok=True)
        target.write_text(source)
    return folder


def says(proc) -> dict:
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    return json.loads(out.splitlines()[-1])


def test_a_pythonpath_that_adds_folders_is_forked_with_the_path_an_interpreter_would_have(server, tmp_path):
    # Folders before, between and after the server's (TESTS, SCRIPTS): the child's sys.path is a new
    # interpreter's, entry for entry, and the first added folder's module is the one imported.
    first, middle, last = (plant(tmp_path / name) for name in ("first", "middle", "last"))
    path = os.pathsep.join(map(str, [first, TESTS, middle, SCRIPTS, last]))
    argv = [sys.executable, "-c", SAYS_ITS_PATH]
    assert server.takes(argv, child_env(PYTHONPATH=path))
    forked = says(server.start(argv, child_env(PYTHONPATH=path), stdout=subprocess.PIPE, text=True, cwd=tmp_path))
    fresh = says(subprocess.Popen(argv, env=child_env(PYTHONPATH=path), stdout=subprocess.PIPE, text=True, cwd=tmp_path))
    assert (forked["ppid"], forked["torch_before_start"], fresh["torch_before_start"]) == (server.proc.pid, True, False)
    assert forked["path"] == fresh["path"] and forked["planted"] == fresh["planted"] == str(first)
    # A relative folder depends on the directory the interpreter starts in: an interpreter of its own.
    assert not server.takes(argv, child_env(PYTHONPATH=os.pathsep.join(["first", str(TESTS), str(SCRIPTS)])))


@pytest.mark.parametrize(("where", "planted"), [
    ("added", {"sitecustomize": "import sys\nsys.stderr.write('site hook ran\\n')\n"}),
    ("added", {"torch_dist_check/": "raise SystemExit('the planted torch_dist_check was imported')\n"}),
    ("first", {"torch_dist_check/": "raise SystemExit('the planted torch_dist_check was imported')\n"}),
])  # fmt: skip
def test_a_folder_an_interpreter_would_import_differently_from_gets_an_interpreter_of_its_own(server, tmp_path, where, planted):
    # An added folder with a site hook (run as an interpreter starts), or a folder on the path (added, or the
    # script's own: sys.path[0]) holding a package by the name of one the server imported from elsewhere
    # (torch_dist_check, from SCRIPTS): the child execs a new interpreter, which runs or imports the folder's.
    folder = plant(tmp_path / "plant", **planted)
    path = os.pathsep.join([str(folder), str(TESTS), str(SCRIPTS)]) if where == "added" else child_env()["PYTHONPATH"]
    script = folder / "says.py"
    script.write_text(SAYS_ITS_PATH + "import torch_dist_check\n")
    proc = server.start([sys.executable, str(script)], child_env(PYTHONPATH=path), stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE, text=True)  # fmt: skip
    assert isinstance(proc, forkserver.ForkedProcess)
    out, err = proc.communicate(timeout=60)
    said = json.loads(out.splitlines()[-1])
    assert (said["ppid"], said["torch_before_start"]) == (server.proc.pid, False), said
    if "sitecustomize" in planted:
        assert proc.returncode == 0 and err == "site hook ran\n", err
    else:
        assert proc.returncode == 1 and "the planted torch_dist_check was imported" in err, err


def test_a_folder_holding_a_module_the_servers_imports_looked_for_in_vain_gets_an_interpreter_of_its_own(server, tmp_path):
    # torch's import looks for optional modules and goes on without them (opt_einsum among them:
    # harness/startup.py records them). An interpreter whose path holds one imports it; a child forked from a
    # server that found none would not have it.
    folder = plant(tmp_path / "plant", opt_einsum="PLANTED = True\n")
    code = "import json, torch.backends.opt_einsum as o; print(json.dumps(o.is_available()))"
    argv, env = [sys.executable, "-c", code], child_env(PYTHONPATH=os.pathsep.join([str(folder), str(TESTS), str(SCRIPTS)]))
    forked = server.start(argv, env, stdout=subprocess.PIPE, text=True)
    fresh = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True)
    assert isinstance(forked, forkserver.ForkedProcess) and says(forked) is True and says(fresh) is True


def test_a_zip_file_added_to_the_path_gets_an_interpreter_of_its_own(server, tmp_path):
    # What a zip holds (here a site hook, run as an interpreter starts) is not listed as a folder's is.
    archive = tmp_path / "hooks.zip"
    with zipfile.ZipFile(archive, "w") as zipped:
        zipped.writestr("sitecustomize.py", "import sys\nsys.stderr.write('site hook ran\\n')\n")
    env = child_env(PYTHONPATH=os.pathsep.join([str(archive), str(TESTS), str(SCRIPTS)]))
    proc = server.start([sys.executable, "-c", "pass"], env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and err == "site hook ran\n", err


def test_a_request_with_pythonsafepath_gets_an_interpreter_of_its_own(tmp_path):
    # PYTHONSAFEPATH's interpreter puts no folder of its own first on its path; a forked child's first entry is
    # its working directory or script's folder (harness/forkchild.py), in place of the first PYTHONPATH folder.
    env = child_env(PYTHONSAFEPATH="1")
    held = forkserver.ForkServer(env, preload=("json",))
    try:
        argv = [sys.executable, "-c", "import json, sys; print(json.dumps(sys.path))"]
        proc = held.start(argv, env, stdout=subprocess.PIPE, text=True, cwd=tmp_path)
        fresh = subprocess.run(argv, env=env, capture_output=True, text=True, cwd=tmp_path, check=True)
        assert not isinstance(proc, forkserver.ForkedProcess)
        assert json.loads(proc.communicate(timeout=60)[0]) == json.loads(fresh.stdout)
    finally:
        held.close()


SHARED = """
import json, os, subprocess, sys
from torch_dist_check.harness import forkserver

forkserver.PRELOAD = ("json",)  # a server cheap to start
argv = [sys.executable, "-c", "import os; print(os.getppid())"]
base = os.environ["PYTHONPATH"]
ppids = []
# The first request adds a folder: its server is started with this process's own PYTHONPATH all the same.
for path in (os.pathsep.join([sys.argv[1], base]), base, os.pathsep.join([base, sys.argv[1]])):
    child = forkserver.start(argv, dict(os.environ, PYTHONPATH=path), stdout=subprocess.PIPE, text=True)
    ppids.append(int(child.communicate(timeout=60)[0]))
print(json.dumps({"ppids": ppids, "servers": [s.proc.pid for s in forkserver._servers.values()]}))
"""


def test_requests_that_only_add_folders_to_a_servers_pythonpath_share_that_server_whichever_comes_first(tmp_path):
    done = subprocess.run([sys.executable, "-c", SHARED, str(tmp_path)], env=child_env(), capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    facts = json.loads(done.stdout.splitlines()[-1])
    assert len(facts["servers"]) == 1 and facts["ppids"] == facts["servers"] * 3, facts


def test_a_check_worker_is_forked_too():
    # WorkerProcess (the fault and peer-loss checks' workers), forked from this test process's server. Here, not in a
    # process of its own (which started a server of its own, one torch import more: 1.5 s of CPU).
    from torch_dist_check.checks.fault import WorkerProcess, wait_until

    worker = WorkerProcess(0, [sys.executable, "-m", "forkserver_child", "exit", "0"], child_env())
    assert wait_until(lambda: not worker.alive(), 60), worker.output()
    worker.kill()
    assert isinstance(worker.proc, forkserver.ForkedProcess) and worker.proc.returncode == 0, worker.output()
    assert json.loads(worker.lines[0])["torch_before_start"] is True, worker.lines


def test_a_worker_seen_ended_has_had_every_line_it_wrote_read():
    # The end of a forked worker is reported over the server's socket, its lines come through a pipe: a judge
    # that read the events as soon as the worker was seen ended missed the last ones when the reading thread
    # lagged (a cut-off peer's PartitionedError, seen once in a full run as "the peer exit code 0"). Here the
    # reader is held back on purpose (the worker's lock, taken by this test) until after the worker ended.
    import threading

    from torch_dist_check.checks.fault import WorkerProcess

    code = "import time\nprint('TDC FIRST 1.0 at once', flush=True)\ntime.sleep(0.5)\nprint('TDC LAST 2.0 last', flush=True)\n"
    worker = WorkerProcess(0, [sys.executable, "-c", code], child_env())
    deadline = time.monotonic() + 60
    while worker.event("FIRST") is None:
        assert time.monotonic() < deadline, worker.tail(5)
        time.sleep(0.01)
    worker._lock.acquire()
    try:
        while worker.proc.poll() is None:
            assert time.monotonic() < deadline, "the worker did not end"
            time.sleep(0.01)
    finally:
        threading.Timer(0.3, worker._lock.release).start()
    assert not worker.alive()
    assert "LAST" in worker.events, worker.lines  # read without the lock: what alive() waited for


def server_of(said: dict) -> forkserver.ForkServer:
    """The server of this process's that forked the child that said ``said`` (a server started for another
    PYTHONPATH of this test process's may have served it: forkserver.shares)."""
    return next(server for server in forkserver._servers.values() if server.proc.pid == said["ppid"])


@pytest.fixture
def servers_of_its_own(monkeypatch):
    """forkserver.start's servers for one test alone, cheap to start (json preloaded, not torch): the test kills
    them. This test process's own, which every later test here shares, live on (each one killed cost a torch
    import more when the next test needed it again: 1.3-1.6 s of CPU with PyPI's CUDA build)."""
    monkeypatch.setattr(forkserver, "_servers", {})
    monkeypatch.setattr(forkserver, "PRELOAD", ("json",))
    yield
    forkserver.close_all()


def test_a_server_killed_from_outside_is_replaced_by_a_new_one(servers_of_its_own):
    env = child_env(TORCH_DIST_CHECK_TEST_MARKER="a server killed from outside")
    argv = [sys.executable, "-m", "forkserver_child", "exit", "0"]
    first = forkserver.start(argv, env, stdout=subprocess.PIPE, text=True)
    assert isinstance(first, forkserver.ForkedProcess)
    killed = server_of(json.loads(first.stdout.readline()))
    assert first.wait(timeout=60) == 0
    killed.proc.kill()
    killed.proc.wait()
    deadline = time.monotonic() + 30
    while not killed.lost:
        assert time.monotonic() < deadline, "the client never saw its server end"
        time.sleep(0.01)
    proc = forkserver.start(argv, env, stdout=subprocess.PIPE, text=True)
    said = json.loads(proc.stdout.readline())
    assert proc.wait(timeout=60) == 0
    assert isinstance(proc, forkserver.ForkedProcess) and server_of(said) is not killed


EVICTION = """
import json, os, subprocess, sys
from torch_dist_check.harness import forkserver

forkserver.PRELOAD, forkserver.MAX_SERVERS = ("json",), 1  # servers cheap to start, room for one
argv = [sys.executable, "-m", "forkserver_child"]
first = forkserver.start([*argv, "exit", "0"], dict(os.environ, MKL_X="a"))
first.wait(timeout=60)
server_a = next(iter(forkserver._servers.values()))
# A's child has ended: A makes room for B, and is ended itself.
sleeper = forkserver.start([*argv, "sleep"], dict(os.environ, MKL_X="b"), stdout=subprocess.PIPE, text=True)
sleeper.stdout.readline()
# B's child still runs: a third set gets an interpreter of its own, B stays.
third = forkserver.start([*argv, "exit", "0"], dict(os.environ, MKL_X="c"))
facts = {"a_ended": server_a.proc.wait(timeout=30) is not None, "kinds": [type(p).__name__ for p in (first, sleeper, third)],
         "servers": [dict(k)["MKL_X"] for k in forkserver._servers]}
third.wait(timeout=60)
sleeper.kill()
facts["sleeper"] = sleeper.wait(timeout=60)
print(json.dumps(facts))
"""


def test_the_server_used_least_recently_and_idle_makes_room_and_a_busy_one_is_kept():
    done = subprocess.run([sys.executable, "-c", EVICTION], env=child_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    facts = json.loads(done.stdout.splitlines()[-1])
    assert facts == {"a_ended": True, "kinds": ["ForkedProcess", "ForkedProcess", "Popen"], "servers": ["b"],
                     "sleeper": -9}, facts  # fmt: skip


def test_a_child_whose_server_was_killed_can_still_be_killed_and_waited_for_and_its_status_is_unknown(servers_of_its_own):
    # No report of its end will come: the wait notices the child gone by itself instead of hanging, and says
    # that how it ended is unknown (only its server could wait for it), never a signal or status made up.
    env = child_env(TORCH_DIST_CHECK_TEST_MARKER="a server killed under a running child")
    proc = forkserver.start([sys.executable, "-m", "forkserver_child", "sleep"], env, stdout=subprocess.PIPE, text=True)
    assert isinstance(proc, forkserver.ForkedProcess)
    server = server_of(json.loads(proc.stdout.readline()))
    server.proc.kill()
    server.proc.wait()
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.3)
    proc.kill()
    assert proc.wait(timeout=30) == forkserver.UNKNOWN_STATUS
    assert proc.status_unknown == forkserver.LOST_SERVER and "unknown" in proc.status_unknown


def test_forking_is_off_with_the_switch():
    env = child_env(TORCH_DIST_CHECK_FORK="0")
    assert not forkserver.enabled(env) and forkserver.enabled(child_env())
    proc = forkserver.start([sys.executable, "-m", "forkserver_child", "exit", "0"], env, stdout=subprocess.PIPE,
                            text=True)  # fmt: skip
    assert isinstance(proc, subprocess.Popen) and proc.wait(timeout=60) == 0


def _children_of(pid: int) -> list[tuple[int, str]]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        ppid = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("PPid:")), None)
        if ppid == pid:
            found.append((int(entry.name), cmdline))
    return found


NO_NAMESPACES = namespaces.unavailable_reason()


@pytest.mark.parametrize("placement", [
    pytest.param(["--nproc", "2"], id="nproc"),
    pytest.param(["--nodes", "2", "--nproc-per-node", "1"], id="nodes", marks=pytest.mark.skipif(
        NO_NAMESPACES is not None or os.geteuid() != 0, reason=f"needs root and network namespaces: {NO_NAMESPACES}")),
])  # fmt: skip
def test_ranks_are_forked_from_the_launchers_server_not_started_each(tmp_path, placement):
    # The ranks: children of the launcher's fork server, not of the launcher; on namespace nodes, each in
    # a network namespace of its own.
    env = {**os.environ, "PYTHONPATH": str(SCRIPTS)}
    env.pop("TORCH_DIST_CHECK_FORK", None)
    launcher = subprocess.Popen(
        [sys.executable, "-m", "torch_dist_check", *placement, "--backends", "gloo", "--checks", "env,correctness",
         "--quick", "--json", str(tmp_path / "report.json")],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    seen: dict[int, str] = {}
    sightings: dict[int, int] = {}
    servers: set[int] = set()
    while launcher.poll() is None:
        for pid, cmdline in _children_of(launcher.pid):
            if "torch_dist_check.harness.forkserver" in cmdline:
                servers.add(pid)
                # Forked children show the server's command line; so does, until its exec, the child that runs
                # `ldconfig -p` as the server imports torch (the same mechanism made a second "server" once in the
                # fault-workers test above): a rank runs its checks for seconds and is seen in more than one scan.
                for child, _ in filter(lambda found: "torch_dist_check.harness.forkserver" in found[1], _children_of(pid)):
                    try:
                        seen[child] = os.readlink(f"/proc/{child}/ns/net")
                        sightings[child] = sightings.get(child, 0) + 1
                    except OSError:
                        pass
        time.sleep(0.01)
    ranks = {child: net for child, net in seen.items() if sightings[child] > 1}
    assert launcher.wait() == 0, launcher.stderr.read()
    assert len(servers) == 1 and len(ranks) == 2, (servers, seen, sightings)
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["incomplete_stage"] is None and report["summary"]["ok"] is True
    ours = os.readlink("/proc/self/ns/net")
    if "--nodes" in placement:
        # Read as the child starts, the namespace may still be the server's: the last reading counts.
        assert ours not in ranks.values() and len(set(ranks.values())) == 2, ranks
    else:
        assert set(ranks.values()) == {ours}


# One interpreter that imports torch (1.5-2.1 s of CPU each with PyPI's CUDA build: process accounting, a run of
# this module) for the prefork tests below, each reading its part of what it says. First where prefork must do
# nothing, each case with its own cause alone: torch not imported yet; then, torch imported, forking switched off;
# then, switched on again, a thread running. With none left (the thread ended), prefork makes the server of this
# same process: each cause alone was what stopped it. Then, as rank 0 before its fault workers, a worker given a
# variable that torch reads as it is imported.
PREFORK_RUN = """
import json, os, signal, subprocess, sys, threading
from torch_dist_check.harness import forkserver

def nothing_made():
    return not forkserver.prefork() and not forkserver._servers

facts = {"nothing_made": {"torch not imported": nothing_made()}}
import torch, torch.distributed
os.environ["TORCH_DIST_CHECK_FORK"] = "0"
facts["nothing_made"]["switched off"] = nothing_made()
del os.environ["TORCH_DIST_CHECK_FORK"]
release = threading.Event()
thread = threading.Thread(target=release.wait, args=(60,), daemon=True)
thread.start()
facts["nothing_made"]["a thread runs"] = nothing_made()
release.set()
thread.join()

signal.signal(signal.SIGUSR1, lambda *_: print("the parent's handler ran in the child", flush=True))
held = os.pipe()  # a pipe of this process's: the server must not hold it open
print("buffered before the fork", end="")  # not flushed here: no child may write it again
facts["made_then_found"] = [forkserver.prefork(), forkserver.prefork()]
server = next(iter(forkserver._servers.values()))
os.close(held[1])
child = forkserver.start([sys.executable, "-m", "forkserver_child", "exit", "0"], dict(os.environ),
                         stdout=subprocess.PIPE, text=True)
said = json.loads(child.stdout.readline())
child.wait(timeout=60)
mine = open("/proc/self/cmdline", "rb").read()
facts["preforked"] = {"said": said, "server": server.proc.pid, "code": child.returncode,
                      "server_is_this_process": open(f"/proc/{server.proc.pid}/cmdline", "rb").read() == mine,
                      "pipe_closed_everywhere": os.read(held[0], 1) == b""}

from torch_dist_check.checks.fault import FaultCase, WorkerProcess, wait_until, worker_env
env = worker_env(FaultCase("gloo", None, "allreduce"), os.environ, {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})
argv = [sys.executable, "-c", sys.argv[1]]
worker = WorkerProcess(0, argv, env)
assert wait_until(lambda: not worker.alive(), 60), worker.output()
facts["fault_env"] = {"output": worker.output(), "preforked_takes": server.takes(argv, env)}
print()
print(json.dumps(facts))
"""
DEBUG_LEVEL = "import torch.distributed as dist; print(dist.get_debug_level())"


@pytest.fixture(scope="module")
def prefork_run() -> tuple[str, dict]:
    """PREFORK_RUN's output and what it says, in an environment without TORCH_DISTRIBUTED_DEBUG."""
    env = {k: v for k, v in child_env().items() if k != "TORCH_DISTRIBUTED_DEBUG"}
    done = subprocess.run([sys.executable, "-c", PREFORK_RUN, DEBUG_LEVEL], env=env, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout, json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("why", ["a thread runs", "torch not imported", "switched off"])
def test_prefork_does_nothing_where_a_fork_of_this_process_would_not_do(prefork_run, why):
    _, facts = prefork_run
    # Nothing made, and the same process made its server once its causes were gone (the test below).
    assert facts["nothing_made"][why] is True and facts["made_then_found"] == [True, True], facts


def test_prefork_makes_the_server_from_this_process_as_a_new_interpreter_would_be(prefork_run):
    # A process that imported torch: its server is a fork of it (no second interpreter, no second import);
    # what it had buffered, its Python signal handlers and its descriptors stay its own.
    out, facts = prefork_run
    assert out.count("buffered before the fork") == 1, out
    assert facts["made_then_found"] == [True, True], facts
    preforked = facts["preforked"]
    assert preforked["server_is_this_process"] and preforked["said"]["ppid"] == preforked["server"], preforked
    assert preforked["said"]["torch_before_start"] and preforked["code"] == 0, preforked
    assert preforked["pipe_closed_everywhere"], preforked


def test_a_fault_env_variable_read_at_torchs_import_reaches_the_worker(prefork_run):
    # Issue 73: --fault-env TORCH_DISTRIBUTED_DEBUG=DETAIL was silently not applied to a forked fault worker
    # (torch reads it as torch.distributed is imported): rank 0's server (a prefork, as the suite's) does not take
    # such a worker now (it gets a server started with that environment, or an interpreter of its own).
    _, facts = prefork_run
    assert facts["made_then_found"] == [True, True], facts
    said = facts["fault_env"]
    assert (said["output"].split(), said["preforked_takes"]) == (["DebugLevel.DETAIL"], False), said


def test_a_one_process_runs_fault_workers_fork_from_that_process_itself(tmp_path):
    # Without --nproc, the process that runs the fault check is the workers' server's origin: no interpreter
    # of the fork server's is started (one torch import for the run, not two).
    env = {**os.environ, "PYTHONPATH": str(SCRIPTS), "MASTER_PORT": str(_free_port())}
    env.pop("TORCH_DIST_CHECK_FORK", None)
    argv = [sys.executable, "-m", "torch_dist_check", "--checks", "fault", "--backends", "gloo", "--fault-backend",
            "gloo", "--fault-ops", "allreduce", "--json", str(tmp_path / "report.json")]  # fmt: skip
    launcher = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    # Its command line as /proc shows it (read from /proc at once, it could still be this process's, before the exec).
    own = "".join(f"{arg} " for arg in argv)
    servers: set[int] = set()
    workers: set[int] = set()
    exec_servers: list[str] = []
    # Until both workers were seen (each lives for seconds): every look reads all of /proc.
    while launcher.poll() is None and len(workers) < 2:
        for pid, cmdline in _children_of(launcher.pid):
            if "torch_dist_check.harness.forkserver" in cmdline:
                exec_servers.append(cmdline)
            elif cmdline == own:
                # A server is a fork that forks workers: torch's import runs `ldconfig -p`, whose child shows
                # this command line too until its exec (seen once as a second "server" in a loaded full run).
                forked = [child for child, line in _children_of(pid) if line == own]
                if forked:
                    servers.add(pid)
                    workers.update(forked)
        time.sleep(0.05)
    assert launcher.wait() == 0, launcher.stderr.read()
    assert not exec_servers and len(servers) == 1 and len(workers) == 2, (exec_servers, servers, workers)
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["summary"]["ok"] is True


# A process that asks for the probes of tests/fork_probe.py both ways: forked from its server (started before
# it changed anything of its own), then as interpreters of their own; after the server started, it takes a
# umask, limits, a nice value, a CPU, a signal mask and an ignored signal of its own, which an interpreter
# it starts inherits. It says, for each probe, whether it was forked and what each way printed and returned.
PROBES = """
import json, os, resource, signal, subprocess, sys
from torch_dist_check.harness import forkserver

forkserver.PRELOAD = ("json",)  # a server cheap to start: what is compared is the process, not torch
probe_file, out_dir = sys.argv[1], sys.argv[2]
env = dict(os.environ)
assert forkserver.start([sys.executable, "-c", "pass"], env).wait(timeout=60) == 0  # the server, as this process is
base = next(iter(forkserver._servers.values()))
os.umask(0o027)
resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
os.setpriority(os.PRIO_PROCESS, 0, os.getpriority(os.PRIO_PROCESS, 0) + 3)
os.sched_setaffinity(0, [min(os.sched_getaffinity(0))])
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
signal.signal(signal.SIGTERM, signal.SIG_IGN)
signal.signal(signal.SIGUSR2, lambda *_: None)  # caught here: an interpreter it starts has the default
source = open(probe_file).read()
FORMS = {"script": [sys.executable, probe_file], "module": [sys.executable, "-m", "fork_probe"],
         "code": [sys.executable, "-c", source]}
CASES = [(form, probe, {}) for form in FORMS for probe in ("observe", "ending", "hook", "raise", "interrupt", "message", "status")]
# Read late (the rank, the rendezvous, a group's settings, the suite's own): forked, and read as given.
CASES.append(("module", "observe", {"RANK": "3", "MASTER_PORT": "29999", "GLOO_SOCKET_IFNAME": "lo", "TORCH_DIST_CHECK_PROBE": "x"}))
# Read as an interpreter starts (the time zone, the locale): not from the server of another environment
# (a server of their own, started with it, or an interpreter); no fixed hash seed: interpreters of their own.
CASES.append(("module", "observe", {"TZ": "America/Denver"}))
CASES.append(("module", "observe", {"LC_ALL": "C"}))
CASES.append(("module", "observe", {"PYTHONHASHSEED": None}))
results = []
for index, (form, probe, extra) in enumerate(CASES):
    child_env = {k: v for k, v in {**env, **extra}.items() if v is not None}
    ways = {"base_takes": base.takes([*FORMS[form], probe], child_env)}
    for way in ("forked", "exec"):
        args = [*FORMS[form], probe, os.path.join(out_dir, f"{index}-{way}.txt")]
        start = forkserver.start if way == "forked" else subprocess.Popen
        proc = start(args, env=child_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = proc.communicate(timeout=60)
        written = os.path.join(out_dir, f"{index}-{way}.txt")
        ways[way] = {"code": proc.returncode, "out": out.replace(written, "FILE"), "err": err.replace(written, "FILE"),
                     "file": open(written).read() if os.path.exists(written) else None,
                     "forked": isinstance(proc, forkserver.ForkedProcess)}
    results.append({"form": form, "probe": probe, "extra": extra, **ways})
print(json.dumps(results))
"""


def test_a_forked_child_observes_and_ends_as_an_interpreter_of_its_own(tmp_path):
    # Issue 73: every probe, in every form (a script, -m, -c), forked and exec'd, prints and writes the same
    # and ends with the same status; what cannot be made equal (a variable read as an interpreter starts,
    # a string-hash seed each interpreter draws for itself) is not forked from a server of another environment.
    env = child_env(PYTHONHASHSEED="4242")
    done = subprocess.run([sys.executable, "-c", PROBES, str(TESTS / "fork_probe.py"), str(tmp_path)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout.splitlines()[-1])
    for result in results:
        forked, fresh = result["forked"], result["exec"]
        where = f"{result['form']} {result['probe']} {result['extra']}"
        late_or_same = set(result["extra"]) <= {"RANK", "MASTER_PORT", "GLOO_SOCKET_IFNAME", "TORCH_DIST_CHECK_PROBE"}
        assert result["base_takes"] is late_or_same and fresh["forked"] is False, where
        if "PYTHONHASHSEED" in result["extra"]:
            assert forked["forked"] is False, where
            # Each interpreter its own seed: the two differ, as two ranks' would.
            assert json.loads(forked["out"])["hash"] != json.loads(fresh["out"])["hash"], where
            continue
        for part in ("code", "out", "err", "file"):
            assert forked[part] == fresh[part], (where, part, forked[part], fresh[part])
    by = {(r["form"], r["probe"]): r["forked"] for r in results if not r["extra"]}
    said = json.loads(by["module", "observe"]["out"])
    # What the requester changed after its server started reached the child: a forked one took it.
    assert said["umask"] == "0027" and said["nofile"][0] == 256 and said["core"] == [0, 0] and len(said["affinity"]) == 1
    assert int(said["blocked"], 16) & (1 << (signal.SIGUSR1 - 1)) and int(said["ignored"], 16) & (1 << (signal.SIGTERM - 1))
    assert not int(said["caught"], 16) & (1 << (signal.SIGUSR2 - 1)) and set(said["descriptors"]) == {"0", "1", "2"}
    assert by["module", "ending"]["out"].splitlines() == [
        "the main code ended", "the executor's job ran", "the non-daemon thread ran to its end", "the exit handler ran after the threads"]
    assert by["module", "ending"]["file"] == "written, never flushed\n"
    statuses = {probe: by["script", probe]["code"] for probe in ("hook", "raise", "interrupt", "message", "status")}
    assert statuses == {"hook": 3, "raise": 1, "interrupt": -signal.SIGINT, "message": 1, "status": 5}
    assert "Traceback" in by["module", "raise"]["err"] and "ValueError: uncaught in the probe" in by["module", "raise"]["err"]


# An interpreter that starts as a fork server does, and as the suite's launcher and rank 0 are when they
# make their server of themselves (forkserver.prefork: the suite's modules imported), recording each variable
# read: Python's reads of
# os.environ here, C's through getenv (tests/envrec/envrec.c, preloaded). A reading of the whole environment
# is recorded as "*".
RECORDED_START = """
import os, sys
log = open(os.environ["ENVREC_LOG"], "a")
class Recording(type(os.environ)):
    def __getitem__(self, key):
        log.write(f"{key}\\n")
        return super().__getitem__(key)
    def __contains__(self, key):
        log.write(f"{key}\\n")
        return super().__contains__(key)
    def __iter__(self):
        log.write("*\\n")
        return super().__iter__()
os.environ.__class__ = Recording
from torch_dist_check.harness import forkserver, startup
startup.import_all(forkserver.PRELOAD)
import torch_dist_check.cli, torch_dist_check.harness.run  # what a launcher or rank 0 holds as it preforks
log.flush()
"""


def test_the_variables_a_forked_child_may_have_otherwise_are_read_by_nothing_at_the_servers_start(tmp_path):
    # forkserver.LATE_NAMES and LATE_PREFIXES: a child forks from a server whose environment differs from its
    # own in these alone, so none may be read before the child's code runs (torch reads TORCH_DISTRIBUTED_DEBUG,
    # PYTORCH_JIT and the like at its import: the recording shows them, so it sees what it must).
    compiler = shutil.which("cc")
    if compiler is None:
        pytest.skip("no C compiler (cc) to build the getenv recorder tests/envrec/envrec.c")
    recorder = tmp_path / "envrec.so"
    subprocess.run([compiler, "-shared", "-fPIC", "-O2", "-o", str(recorder), str(TESTS / "envrec" / "envrec.c"), "-ldl"],
                   check=True, capture_output=True, timeout=60)  # fmt: skip
    log = tmp_path / "read.txt"
    env = {**child_env(), "ENVREC_LOG": str(log), "LD_PRELOAD": str(recorder)}
    done = subprocess.run([sys.executable, "-c", RECORDED_START], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    read = set(log.read_text().split())
    assert {"TORCH_DISTRIBUTED_DEBUG", "PYTORCH_JIT", "TORCH_LOGS_FORMAT", "OMP_NUM_THREADS"} <= read, sorted(read)
    assert "*" not in read, "the start read the whole environment: no variable can be said to be read late"
    late = sorted(name for name in read if forkserver.read_late(name))
    assert not late, f"read as the server starts, so a forked child would keep the server's value: {late}"
    # The names the rule lists are the ones the harness and the tests set per rank and per worker.
    assert all(forkserver.read_late(name) for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
               "MASTER_ADDR", "MASTER_PORT", "NCCL_HOSTID", "GLOO_SOCKET_IFNAME", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
               "TORCH_PEER_WATCHER_SECRET", "TORCH_DIST_CHECK_SPAWNED", "CUDA_VISIBLE_DEVICES"))  # fmt: skip
    assert not any(forkserver.read_late(name) for name in ("TORCH_PEER_WATCHER", "TORCH_DISTRIBUTED_DEBUG", "TZ", "LC_ALL"))


ACCOUNTED = """
import os, sys
from torch_dist_check.harness import forkserver
forkserver.PRELOAD = ("json",)  # a server cheap to start
burn = "import time\\nend = time.process_time() + 0.6\\nwhile time.process_time() < end: pass"
child = forkserver.start([sys.executable, "-c", burn], dict(os.environ))
assert isinstance(child, forkserver.ForkedProcess) and child.wait(timeout=60) == 0
print(next(iter(forkserver._servers.values())).proc.pid, flush=True)
"""


def test_a_forked_childs_cpu_counts_as_its_requesters_and_the_server_ends_with_it():
    # Issue 73: the server was never waited for (it outlived its client, and /usr/bin/time of a launcher showed
    # a tenth of the CPU its ranks used). Now the client's exit ends the server and waits for it, and the
    # server waited for its child: the child's CPU is the requester's children's, as an exec'd child's is.
    proc = subprocess.Popen([sys.executable, "-c", ACCOUNTED], env=child_env(), stdout=subprocess.PIPE, text=True)
    server_pid = int(proc.stdout.readline())
    _pid, status, usage = os.wait4(proc.pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert not Path(f"/proc/{server_pid}").exists(), "the server outlived the process that started it"
    # The requester's own CPU is a fraction of this (no torch); RUSAGE_CHILDREN of it holds the server's child.
    assert usage.ru_utime + usage.ru_stime >= 0.5, usage


HELD_FILE = """
import atexit, os
import torch.distributed  # as a backend plug-in does: the launcher then has torch before its ranks start
log = open(os.environ["TORCH_DIST_CHECK_TEST_LOG"], "a")
log.write(f"imported in {os.getpid()}\\n")
atexit.register(log.flush)
"""


@pytest.mark.parametrize("fork", ["1", "0"])
def test_an_import_module_holding_an_open_file_passes_forked_and_exec(tmp_path, fork):
    # Issue 73: the launcher, having imported such a module, made its fork server of itself; the ranks did not
    # import the module again and its descriptor's number was reused (a socket): "Broken pipe", exit 1.
    (tmp_path / "heldfile.py").write_text(HELD_FILE)
    log = tmp_path / "log.txt"
    env = {**child_env(), "PYTHONPATH": os.pathsep.join([str(tmp_path), str(SCRIPTS)]), "TORCH_DIST_CHECK_FORK": fork,
           "TORCH_DIST_CHECK_TEST_LOG": str(log), "MASTER_PORT": str(_free_port())}  # fmt: skip
    done = suite_process.run(["--nproc", "2", "--import", "heldfile", "--backends", "gloo", "--checks", "env,correctness",
                              "--quick"], env, timeout=240)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # The launcher and each rank imported it themselves.
    assert len(set(log.read_text().splitlines())) == 3, log.read_text()


def test_a_rank_whose_server_was_lost_is_reported_with_an_unknown_status_and_its_verdict():
    # Issue 73: ranks that had passed were reported "killed by SIGKILL in stage 'teardown'" and the run failed.
    from torch_dist_check.harness.launch import RankEnd

    passed = RankEnd(rank=1, pid=1, exit_code=None, verdict=0, stage="teardown", killed=False, tail=("x",),
                     status_unknown=forkserver.LOST_SERVER)  # fmt: skip
    assert not passed.abnormal and passed.status == 0
    assert passed.describe() == f"rank 1: its verdict 0, then ended in stage 'teardown'; {forkserver.LOST_SERVER}"
    assert "SIG" not in passed.describe()
    silent = RankEnd(rank=1, pid=1, exit_code=None, verdict=None, stage="correctness", killed=False, tail=(),
                     status_unknown=forkserver.LOST_SERVER)  # fmt: skip
    assert silent.abnormal and silent.status == 1 and "no verdict recorded" in silent.describe()
