"""Issue 68: a stranger on the node (another Unix user, made for the test) decides no verdict.

The stranger is a process forked from the test that drops to a second Unix user before it does anything
(``useradd``, removed afterwards; skipped without root). It learns only what it can ask for: the store's
keys (the store has no authentication) and what a watcher answers to anyone (``PROBE``: ALIVE with the
listener's nonce and process id). Each attack runs against a real 2-rank gloo job with the secret set
(tests/peer_watcher_rank.py, interval 0.5 s, timeout 2 s):

1. the ids learnt by PROBE, junk written under the verdict key they named before (and over every
   verdict key the store lists), a SIGSTOP of rank 0 for 5 s with the store in a process of its own:
   the live rank 1 goes on, rank 0 is out after its SIGCONT;
2. a squatter on a dead rank's freed port holds the survivor's probe: the death is still declared
   "process gone" at once (the listener belongs to another user: no rank of this job);
3. a signed address replayed from a concurrent job of the same user with the same secret: refused as
   another job's, the rank links to its real peer, the other job sees no connection; a signed address
   that is dead: ``watch()`` fails with WatcherError naming the refused connect;
4. the secret file a directory, or a peer without a watcher, under auto-start: ``init_process_group``
   raises (WatcherConfigError, WatcherError) instead of a job that runs unwatched;
5. every verdict claim (and bell) the store lists deleted as soon as it appears, while both ranks judge
   each other (both stalled; the store in rank 0, whose peer claims an interval and 0.5 s after its verdict):
   rank 0 alone goes on, rank 1 is out although it found the pair's key empty.

The campaigns under load: benchmarks/peer_watcher_strangers.sh (docs/records/2026-12-06-peer-watcher-strangers.md).
"""

from __future__ import annotations

# The stranger, forked from this process, cannot read this interpreter's files once it is the other user:
# what it uses is imported here first (idna: socket.create_connection encodes a host name with it).
import encodings.idna  # noqa: F401
import json
import os
import pwd
import secrets
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch", reason="torch is not installed (bash scripts/install-test-deps.sh installs it)")

from torch.distributed import TCPStore  # noqa: E402  (the stranger's store client, imported before its fork)

from test_dist_check_run import _free_port  # noqa: E402
from test_peer_watcher_security import job_env, job_of, start_job, store_apart, store_client, watch_both  # noqa: E402
from torch_dist_check.harness import forkserver  # noqa: E402

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
sys.path.insert(0, str(SCRIPTS))

from other_user import tool  # noqa: E402
from torch_peer_watcher import protocol  # noqa: E402
from torch_peer_watcher.verdicts import PREFIX  # noqa: E402


@pytest.fixture(scope="module")
def stranger() -> Iterator[tuple[int, int]]:
    """(uid, gid) of a second Unix user made for these tests, removed afterwards."""
    if os.geteuid() != 0:
        pytest.skip("a second Unix user (the stranger) can only be made as root (useradd)")
    useradd, userdel = tool("useradd"), tool("userdel")
    if useradd is None or userdel is None:
        pytest.skip("useradd and userdel (Debian's passwd package) are not installed")
    name = f"tpw68s{os.getpid()}"
    made = subprocess.run([useradd, "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
                          capture_output=True, text=True)  # fmt: skip
    if made.returncode != 0:
        pytest.skip(f"useradd could not make a user here: {made.stderr.strip()[:200]}")
    try:
        entry = pwd.getpwnam(name)
        yield entry.pw_uid, entry.pw_gid
    finally:
        subprocess.run([userdel, name], capture_output=True)


class Stranger:
    """``target(*args)`` in a child forked from the test that runs as the other user; its JSON result."""

    def __init__(self, ids: tuple[int, int], target: Callable[..., Any], *args: Any) -> None:
        read, write = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # the stranger: the other user from the first line on, no secret in its environment
            code = 1
            try:
                os.close(read)
                os.setgroups([])
                os.setgid(ids[1])
                os.setuid(ids[0])
                for name in [n for n in os.environ if n.startswith("TORCH_PEER_WATCHER")]:
                    del os.environ[name]
                result = target(*args)
                code = 0
            except BaseException as exc:  # reported to the test, which fails on it
                result = {"error": f"{type(exc).__name__}: {exc}"}
            finally:
                os.write(write, json.dumps(result).encode())
                os._exit(code)
        os.close(write)
        self._read = read

    def result(self, timeout: float = 60.0) -> Any:
        """What the stranger returned (it must end within ``timeout``)."""
        data = b""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0 and select.select([self._read], [], [], left)[0]:
            chunk = os.read(self._read, 65536)
            if not chunk:
                break
            data += chunk
        else:
            self.kill()
            raise AssertionError(f"the stranger did not end within {timeout} s")
        os.close(self._read)
        os.waitpid(self.pid, 0)
        result = json.loads(data)
        assert not (isinstance(result, dict) and "error" in result), result
        return result

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass


def _watcher_keys(store) -> dict[int, str]:
    """Rank -> the store key of its watcher address (what anyone can list)."""
    found = {}
    for key in store.list_keys():
        head, sep, rank = key.rpartition("torch_peer_watcher/addr/")
        if sep and rank.isdigit():
            found[int(rank)] = key
    return found


def _ask_id(address: tuple[str, int], as_rank: int) -> str:
    """The listener's process id, as it answers a PROBE to anyone who asks."""
    with socket.create_connection(address, timeout=10) as sock:
        sock.sendall(f"PROBE {as_rank} {secrets.token_hex(16)} {secrets.token_hex(16)}\n".encode())
        sock.settimeout(10)
        answer = sock.recv(512).split()
    assert answer and answer[0] == b"ALIVE", answer
    return answer[2].decode()


def learn_ids_and_write_junk(port: int, seconds: float) -> dict:
    """Attack 1, as the stranger: the ranks' ids by PROBE, junk under the key they named (issue 52's
    ``<prefix>/0-1/<id0>-<id1>``), then junk over every verdict key the store lists, for ``seconds``."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    addresses = {r: _address_in(store.get(k).decode()) for r, k in _watcher_keys(store).items()}
    ids = {0: _ask_id(addresses[0], 1), 1: _ask_id(addresses[1], 0)}
    guessed = f"{PREFIX}/0-1/{ids[0]}-{ids[1]}"
    store.set(guessed, "junk")
    overwritten: set[str] = set()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for key in store.list_keys():
            if key.startswith(PREFIX) and key != guessed:
                store.set(key, "junk")
                overwritten.add(key)
        time.sleep(0.002)
    return {"ids": ids, "guessed": guessed, "overwritten": sorted(overwritten)}


def delete_every_claim(port: int, seconds: float) -> dict:
    """Issue 68's last race, as the stranger: delete every key under the verdicts' prefix that the store lists
    (the claims, and the bells they ring) as soon as it appears, for ``seconds``."""
    store = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    deleted: list[str] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for key in store.list_keys():
            if key.startswith(PREFIX) and store.delete_key(key):
                deleted.append(key)
        time.sleep(0.002)
    return {"deleted": deleted}


def squat(address: tuple[str, int], seconds: float) -> dict:
    """Attack 2, as the stranger: bind the dead rank's port as soon as it is free, accept, answer nothing."""
    end = time.monotonic() + seconds
    server = None
    while server is None and time.monotonic() < end:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
            sock.listen(16)
            server = sock
        except OSError:
            sock.close()
    if server is None:
        return {"bound": False, "held": 0}
    Path(f"/tmp/tpw68-squatting-{address[1]}").touch()
    held = []
    server.settimeout(0.05)
    while time.monotonic() < end:
        try:
            held.append(server.accept()[0])
        except TimeoutError:
            continue
    return {"bound": True, "held": len(held)}


def test_ids_asked_for_and_junk_in_the_store_cannot_put_the_live_rank_out_with_the_store_apart(tmp_path, stranger):
    env = job_env(secrets.token_hex(32), TORCH_PEER_WATCHER_TEST_STORE="client")
    server = store_apart(env)
    rank0, rank1 = start_job(tmp_path, env, env)
    attacker = None
    try:
        watch_both(rank0, rank1)
        attacker = Stranger(stranger, learn_ids_and_write_junk, int(env["MASTER_PORT"]), 9.0)
        time.sleep(1.0)  # the stranger asks both ranks for their ids and writes its junk first
        os.kill(rank0.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        rank1.send("ALLREDUCE")
        said = rank1.expect("RAISED", "PARTITIONED", "REDUCED", losses_ok=True, timeout=30)
        assert said[0] == "RAISED", said  # PeerLostError: rank 1 goes on
        assert json.loads(said[1])["rank"] == 0
        time.sleep(max(0.0, 5.0 - (time.monotonic() - stopped)))
        os.kill(rank0.pid, signal.SIGCONT)
        loss = json.loads(rank0.expect("LOSS", losses_ok=True, timeout=30)[1])
        assert loss["cut_off"] and "rank 1 declared this rank lost first" in loss["cut_off"], loss
        rank0.send("ALLREDUCE")
        assert rank0.expect("RAISED", "PARTITIONED", "REDUCED", losses_ok=True)[0] == "PARTITIONED"
        learnt = attacker.result()
        # The attack ran: the stranger had both ids, wrote under the key they used to name, and found the
        # pair's real key in the listing once rank 1 had claimed it, and wrote over it: nothing changed.
        assert len(learnt["ids"]["0"]) == 32 and len(learnt["ids"]["1"]) == 32, learnt
        assert server.get(learnt["guessed"]) == b"junk"
        assert learnt["overwritten"], learnt
    finally:
        if attacker is not None:
            attacker.kill()
        for rank in (rank0, rank1):
            rank.kill()
        del server


def test_a_claim_deleted_between_the_two_sides_claims_leaves_only_the_first_side_training(tmp_path, stranger):
    env = job_env(secrets.token_hex(32))  # the store in rank 0: it claims at once, rank 1 1.0 s later
    rank0, rank1 = start_job(tmp_path, env, env)
    attacker = None
    try:
        watch_both(rank0, rank1)
        attacker = Stranger(stranger, delete_every_claim, int(env["MASTER_PORT"]), 10.0)
        # Both stalled past the 2 s timeout. Rank 1 resumes first, judges rank 0 silent and waits 1 s (rank 0
        # hosts the store) before it claims; rank 0 resumes 0.25 s later, finds itself declared lost and claims
        # at once (it hosts the store): the stranger has 0.75 s to delete that claim.
        rank1.send("STALL 2.75")
        rank0.send("STALL 3")
        for rank in (rank0, rank1):
            rank.expect("STALLED")
        losses = [json.loads(rank.expect("LOSS", losses_ok=True, timeout=30)[1]) for rank in (rank0, rank1)]
        assert losses[0]["cut_off"] is None, losses
        # Rank 1 found the key empty (before issue 68's bells it won it then, and both went on), but its bell rang.
        assert losses[1]["cut_off"] and "deleted or changed the claim" in losses[1]["cut_off"], losses
        rank1.send("ALLREDUCE")
        assert rank1.expect("RAISED", "PARTITIONED", "REDUCED", losses_ok=True)[0] == "PARTITIONED"
        deleted = attacker.result()["deleted"]
        assert any("/bell/" not in key for key in deleted) and any("/bell/" in key for key in deleted), deleted
    finally:
        if attacker is not None:
            attacker.kill()
        for rank in (rank0, rank1):
            rank.kill()


def test_a_squatter_on_the_dead_ranks_port_does_not_hide_the_death(tmp_path, stranger):
    env = job_env(secrets.token_hex(32), TORCH_PEER_WATCHER_TEST_STORE="client")
    server = store_apart(env)
    rank0, rank1 = start_job(tmp_path, env, env)
    attacker = None
    try:
        watch_both(rank0, rank1)
        address = _rank_address(env, 0)
        marker = Path(f"/tmp/tpw68-squatting-{address[1]}")
        marker.unlink(missing_ok=True)
        attacker = Stranger(stranger, squat, address, 8.0)
        # The race made certain: the survivor is stopped (well within its timeout) while rank 0 dies and the
        # stranger takes its port; it reads the closed link when it runs again and probes the squatter.
        os.kill(rank1.pid, signal.SIGSTOP)
        rank0.kill()
        deadline = time.monotonic() + 1.0
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.005)
        assert marker.exists(), "the stranger could not bind the freed port"
        resumed = time.time()
        os.kill(rank1.pid, signal.SIGCONT)
        loss = json.loads(rank1.expect("LOSS", losses_ok=True, timeout=30)[1])
        assert loss["rank"] == 0 and loss["cut_off"] is None, loss
        assert loss["cause"].endswith("(process gone)") and "another user" in loss["cause"], loss
        # At once: the heartbeat deadline (the 2 s timeout from rank 0's last heartbeat) is not waited for.
        assert loss["detected_at"] - resumed < 1.0, loss
        squatted = attacker.result()
        assert squatted["bound"] and squatted["held"] >= 1, squatted
        marker.unlink(missing_ok=True)
    finally:
        if attacker is not None:
            attacker.kill()
        for rank in (rank0, rank1):
            rank.kill()
        del server


def _rank_address(env: dict[str, str], rank: int) -> tuple[str, int]:
    store = store_client(env)
    return _address_in(store.get(_watcher_keys(store)[rank]).decode())


def _address_in(value: str) -> tuple[str, int]:
    """The (host, port) of a store value ``host|port|tag|mac`` (public: the MAC only proves it)."""
    address = protocol.parse_address("|".join(value.split("|")[:2]))
    assert address is not None, value
    return address


def replay(source_port: int, target_port: int, rank: int, seconds: float) -> dict:
    """Attack 3, as the stranger: copy ``rank``'s signed address from one job's store into another's."""
    from torch.distributed import TCPStore

    source = TCPStore("127.0.0.1", source_port, is_master=False, timeout=timedelta(seconds=30))
    target = TCPStore("127.0.0.1", target_port, is_master=False, timeout=timedelta(seconds=30))
    value = source.get(_watcher_keys(source)[rank])
    key = _watcher_keys(target)[rank]
    writes = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        target.set(key, value)
        writes += 1
        time.sleep(0.01)
    return {"writes": writes}


def _wait_until_replayed(source_port: int, target_port: int, rank: int, timeout: float = 30.0) -> None:
    """Until ``rank``'s key in the target job's store holds the source job's signed address (replay's first write)."""
    from torch.distributed import TCPStore

    source = TCPStore("127.0.0.1", source_port, is_master=False, timeout=timedelta(seconds=30))
    target = TCPStore("127.0.0.1", target_port, is_master=False, timeout=timedelta(seconds=30))
    value, key = source.get(_watcher_keys(source)[rank]), _watcher_keys(target)[rank]
    deadline = time.monotonic() + timeout
    while target.get(key) != value:
        assert time.monotonic() < deadline, f"the stranger's replay never reached the store within {timeout} s"
        time.sleep(0.01)


def test_a_signed_address_of_a_concurrent_job_with_the_same_secret_is_refused_as_another_jobs(tmp_path, stranger):
    secret = secrets.token_hex(32)
    env_a, env_b = job_env(secret), job_env(secret, TORCH_PEER_WATCHER_CONNECT_TIMEOUT_S="30")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a0, a1 = start_job(tmp_path / "a", env_a, env_a)
    b0, b1 = start_job(tmp_path / "b", env_b, env_b)
    attacker = None
    try:
        for rank in (a0, a1):
            rank.ask("START", "STARTED")
        a1.send("WATCH")
        a0.ask("WATCH", "WATCHED")
        a1.expect("WATCHED")
        b1.ask("START", "STARTED")
        b1.send("WATCH")
        attacker = Stranger(stranger, replay, int(env_a["MASTER_PORT"]), int(env_b["MASTER_PORT"]), 1, 1.5)
        # b0 reads rank 1's address only once the replayed one is in job B's store: a stranger slowed by a
        # busy machine (a fixed 0.2 s here before) wrote it after b0 had read the real one, in one full run.
        _wait_until_replayed(int(env_a["MASTER_PORT"]), int(env_b["MASTER_PORT"]), 1)
        b0.ask("START", "STARTED")
        b0.ask("WATCH", "WATCHED")
        b1.expect("WATCHED")
        assert attacker.result()["writes"] > 10
        assert "is signed for another job" in b0.stderr()
        for rank in (b0, b1):
            rank.send("ALLREDUCE")
        for rank in (b0, b1):
            assert rank.expect("REDUCED", "RAISED") == ["REDUCED", "[2.0, 2.0]"]
        # Job A's rank 1 was never dialled by job B.
        status = a1.status()
        assert status["links"] == [0] and status["losses"] == [] and status["made"] == 1, status
        assert "refused a connection" not in a1.stderr()
    finally:
        if attacker is not None:
            attacker.kill()
        for rank in (a0, a1, b0, b1):
            rank.kill()


def test_a_dead_address_signed_for_this_job_fails_watch_with_a_watcher_error_naming_the_refused_connect(tmp_path):
    """What an address from an earlier job at the same store and with the same secret leaves: nothing listens."""
    secret = secrets.token_hex(32)
    env = job_env(secret, TORCH_PEER_WATCHER_CONNECT_TIMEOUT_S="2")
    rank0, rank1 = start_job(tmp_path, env, env)
    try:
        dead = socket.socket()
        dead.bind(("127.0.0.1", 0))  # bound, never listening: a connect is refused
        store = store_client(env)
        rank0.ask("START", "STARTED")
        key = _watcher_keys(store)[0][:-1] + "1"  # rank 1 runs no watcher: its key is written by the test alone
        store.set(key, protocol.sign_address(protocol.job_key(secret, job_of(env)), 1, dead.getsockname(), job_of(env)))
        error = rank0.ask("WATCH", "WATCHERROR", "WATCHED")
        assert error[0] == "WATCHERROR", error
        assert "could not link to rank 1" in error[1] and "cannot be reached" in error[1], error
        dead.close()
    finally:
        for rank in (rank0, rank1):
            rank.kill()


def _autostart_run(tmp_path: Path, extra: dict[str, str], ranks: list[int], world: int) -> list[subprocess.CompletedProcess]:
    port = _free_port()
    code = ("import torch_peer_watcher.autostart as a, sys; a.install(); import torch.distributed as dist; "
            "dist.init_process_group('gloo', rank=int(sys.argv[1]), world_size=int(sys.argv[2])); print('TRAINING')")  # fmt: skip
    procs: list[tuple[list[str], subprocess.Popen[str] | forkserver.ForkedProcess]] = []
    for rank in ranks:
        proc: subprocess.Popen[str] | forkserver.ForkedProcess
        env = dict(job_env(None), MASTER_PORT=str(port), TORCH_PEER_WATCHER_CONNECT_TIMEOUT_S="3", **extra)
        argv = [sys.executable, "-c", code, str(rank), str(world)]
        if rank == 0:
            # The watched rank: an interpreter of its own, whose hook is installed before torch.distributed is
            # imported, as the .pth installs it as an interpreter starts (a fork server's child has it imported,
            # its functions re-exported before the hook could wrap them: torch_peer_watcher/autostart.py).
            proc = subprocess.Popen(argv, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        else:
            # A peer without the watcher (TORCH_PEER_WATCHER=0: its install() does nothing): forked from this test
            # process's fork server, which imported torch once (harness/forkserver.py), not a torch import of its
            # own (1.4-2.2 s of CPU with PyPI's CUDA build on the 2-core CI machine).
            env["TORCH_PEER_WATCHER"] = "0"
            proc = forkserver.start(argv, env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        procs.append((argv, proc))
    done = []
    for argv, proc in procs:
        out, err = proc.communicate(timeout=120)
        done.append(subprocess.CompletedProcess(argv, proc.returncode, out, err))
    return done


def test_with_the_secret_set_a_watcher_that_cannot_set_up_stops_the_job_instead_of_a_warning(tmp_path):
    folder = tmp_path / "secret"
    folder.mkdir(mode=0o700)
    (run,) = _autostart_run(tmp_path, {"TORCH_PEER_WATCHER": "1", "TORCH_PEER_WATCHER_SECRET_FILE": str(folder)}, [0], 1)
    assert run.returncode != 0 and "TRAINING" not in run.stdout, run
    assert "WatcherConfigError" in run.stderr and "is a directory, not a regular file" in run.stderr, run.stderr[-2000:]
    assert "IsADirectoryError" not in run.stderr
    # A peer that runs no watcher: with a secret, init_process_group raises WatcherError; without one, a warning.
    secret = {"TORCH_PEER_WATCHER": "1", "TORCH_PEER_WATCHER_SECRET": secrets.token_hex(32)}
    watched, plain = _autostart_run(tmp_path, secret, [0, 1], 2)
    assert watched.returncode != 0 and "TRAINING" not in watched.stdout, watched
    assert "WatcherError" in watched.stderr and "rank 1 published no watcher address" in watched.stderr, watched.stderr[-2000:]
    watched, plain = _autostart_run(tmp_path, {"TORCH_PEER_WATCHER": "1"}, [0, 1], 2)
    assert watched.returncode == 0 and "TRAINING" in watched.stdout, watched
    assert "this group is not watched" in watched.stderr
