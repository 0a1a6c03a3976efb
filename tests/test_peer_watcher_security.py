"""Issue 39: a stranger on the node cannot kill, crash or blind a job through the peer watcher.

Every attack of the issue runs against a real 2-rank gloo job on CPU (tests/peer_watcher_rank.py,
driven command by command; every wait is for an answer or an EOF, never for time): reading the store,
taking a peer's place at start, HELLO with a foreign, own, out-of-range or non-ASCII rank, junk
before and after authentication, a replayed handshake, a flood of idle connections against a low
RLIMIT_NOFILE, a process with no file descriptor left. The outcome each time: no loss, a live
thread, bounded fds, and a real stop still detected. The legitimate paths (heartbeat verdict, closed
connection, clean goodbye) run with and without a secret.
"""

from __future__ import annotations

import json
import os
import queue
import secrets
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="torch is not installed (bash scripts/install-test-deps.sh installs it)")

from test_dist_check_run import _free_port  # noqa: E402

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
sys.path.insert(0, str(SCRIPTS))

from torch_dist_check.harness import forkserver  # noqa: E402
from torch_peer_watcher import links as links_mod  # noqa: E402
from torch_peer_watcher import protocol  # noqa: E402
from torch_peer_watcher.protocol import Opener, Sealer, parse_endpoints, proof  # noqa: E402
from torch_peer_watcher.settings import WatcherConfigError, WatcherSettings, secret_from_env  # noqa: E402

WORKER = Path(__file__).resolve().parent / "peer_watcher_rank.py"
ANSWER_S = 60.0
NOFILE = 256


class Rank:
    """A rank process: commands on stdin, one answer line each on stdout (read by a thread)."""

    def __init__(self, rank: int, env: dict[str, str], log: Path) -> None:
        self.rank = rank
        self.log = log
        with log.open("w") as stderr:
            # Forked from a process that imported torch once (harness/forkserver.py; an exec'd one where the
            # environment's start-up variables differ): the CPU the job costs changes, not what it does.
            self.proc = forkserver.start([sys.executable, str(WORKER), str(rank)], env, stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=stderr, text=True, start_new_session=True)  # fmt: skip
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.pid = int(self.expect("INIT")[1])

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def send(self, command: str) -> None:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def expect(self, *prefixes: str, timeout: float = ANSWER_S, losses_ok: bool = False) -> list[str]:
        """The next line that starts with one of ``prefixes``; a LOSS line before it fails, unless ``losses_ok``."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"rank {self.rank}: no {prefixes} within {timeout} s; stderr: {self.stderr()}") from None
            if line is None:
                raise AssertionError(f"rank {self.rank} exited before {prefixes}; stderr: {self.stderr()}")
            words = line.split(" ", 1)
            if words[0] in prefixes:
                return [words[0], *words[1:]]
            if words[0] == "LOSS" and not losses_ok:
                raise AssertionError(f"rank {self.rank} declared a loss: {line}; stderr: {self.stderr()}")

    def ask(self, command: str, *answers: str, timeout: float = ANSWER_S) -> list[str]:
        self.send(command)
        return self.expect(*answers, timeout=timeout)

    def status(self) -> dict:
        return json.loads(self.ask("STATUS", "STATUS")[1])

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/fd"))

    def stderr(self) -> str:
        return self.log.read_text()[-3000:]

    def wait_for(self, what: str, condition, timeout: float = ANSWER_S):
        """Ask ``condition()`` until it holds (what the rank does shows only in its answers and its log)."""
        deadline = time.monotonic() + timeout
        while not (result := condition()):
            assert time.monotonic() < deadline, f"rank {self.rank}: not {what} within {timeout} s; stderr: {self.stderr()}"
            time.sleep(0.05)
        return result

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)


def job_env(secret: str | None, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCH_PEER_WATCHER")}
    env.update(PYTHONPATH=str(SCRIPTS), PYTHONUNBUFFERED="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
               GLOO_SOCKET_IFNAME="lo", TORCH_PEER_WATCHER_HOST="127.0.0.1", TORCH_PEER_WATCHER_INTERVAL_S="0.5",
               TORCH_PEER_WATCHER_TIMEOUT_S="2")  # fmt: skip
    env.update(extra)
    if secret is not None:
        env["TORCH_PEER_WATCHER_SECRET"] = secret
    return env


def job_of(env: dict[str, str]) -> str:
    """The job binding the ranks started with ``env`` compute (their store: 127.0.0.1 at MASTER_PORT)."""
    return protocol.job_binding("127.0.0.1", int(env["MASTER_PORT"]), env)


def start_job(tmp_path: Path, env0: dict[str, str], env1: dict[str, str]) -> tuple[Rank, Rank]:
    ranks: list[Rank] = []
    threads = [threading.Thread(target=lambda r=r, e=e: ranks.append(Rank(r, e, tmp_path / f"rank{r}.log")))
               for r, e in ((0, env0), (1, env1))]  # fmt: skip
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if len(ranks) != 2:
        for rank in ranks:
            rank.kill()
        raise AssertionError(f"the job did not start: {[(tmp_path / f'rank{r}.log').read_text()[-2000:] for r in (0, 1)]}")
    ranks.sort(key=lambda r: r.rank)
    return ranks[0], ranks[1]


def store_apart(env: dict[str, str]):
    """The job's store served by the test process at ``env``'s MASTER_PORT, as under torchrun's agent (the ranks
    started with TORCH_PEER_WATCHER_TEST_STORE=client). Keep it referenced while the job runs."""
    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", int(env["MASTER_PORT"]), is_master=True, timeout=timedelta(seconds=60),
                    wait_for_workers=False)  # fmt: skip


def watch_both(rank0: Rank, rank1: Rank) -> None:
    """Both ranks start their watcher and watch the world, rank 1 first."""
    for rank in (rank0, rank1):
        rank.ask("START", "STARTED")
    rank1.send("WATCH")
    rank0.ask("WATCH", "WATCHED")
    rank1.expect("WATCHED")


def store_client(env: dict[str, str]):
    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", int(env["MASTER_PORT"]), is_master=False, timeout=timedelta(seconds=30))


def watcher_address(store, rank: int) -> tuple[str, int]:
    """What any process that reaches the store reads: the rank's watcher address (``host|port|mac``)."""
    (key,) = [k for k in store.list_keys() if k.endswith(f"torch_peer_watcher/addr/{rank}")]
    address = protocol.parse_address(store.get(key).decode().rsplit("|", 2)[0])
    assert address is not None
    return address


def hello(rank: int, nonce: str, listens: str = "127.0.0.1|9") -> str:
    """A well-formed HELLO line for ``rank`` (a stranger can write one: it proves nothing yet)."""
    return f"HELLO {rank} {nonce} {secrets.token_hex(16)} {listens}\n"


def refused_port() -> tuple[str, int]:
    """An address where a connect is refused at once: a port bound here and never listened on (kept bound)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    _HELD.append(sock)
    return sock.getsockname()


_HELD: list[socket.socket] = []


def read_until_eof(sock: socket.socket, timeout: float = 20.0) -> bytes:
    """Everything the other side sends until it closes (an AssertionError if it does not)."""
    sock.settimeout(timeout)
    received = b""
    try:
        while data := sock.recv(4096):
            received += data
    except TimeoutError:
        raise AssertionError(f"the watcher kept the connection open {timeout} s (got {received[:200]!r})") from None
    except ConnectionResetError:
        pass
    return received


def refused(address: tuple[str, int], payload: bytes) -> bytes:
    """Send ``payload`` on a fresh connection; what came back before the watcher closed it."""
    with socket.create_connection(address, timeout=10) as sock:
        try:
            sock.sendall(payload)
        except (BrokenPipeError, ConnectionResetError):
            return b""
        return read_until_eof(sock)


def read_line(sock: socket.socket, timeout: float = 20.0) -> bytes:
    sock.settimeout(timeout)
    data = b""
    while not data.endswith(b"\n"):
        chunk = sock.recv(1)
        assert chunk, f"closed after {data!r}"
        data += chunk
    return data[:-1]


class PeerPlay:
    """The test as rank ``rank``'s watcher (it holds ``key``): dials the real listener at ``address``, then
    speaks the sealed protocol. ``listens`` is the listener address its HELLO gives (where the real rank
    probes when the link ends; by default one where a connect is refused, as after a process's death).
    ``recording`` holds the two handshake lines sent."""

    def __init__(self, address: tuple[str, int], key: bytes, rank: int = 0, listener: int = 1,
                 listens: tuple[str, int] | None = None) -> None:  # fmt: skip
        self.sock = socket.create_connection(address, timeout=10)
        self.inbox = b""
        self.lock = threading.Lock()
        nonce, my_id = secrets.token_hex(16), secrets.token_hex(16)
        listens_text = protocol.address_text(listens or refused_port())
        first = f"HELLO {rank} {nonce} {my_id} {listens_text}\n".encode()
        self.sock.sendall(first)
        words = self.line().split()
        assert words[0] == b"CHALLENGE", words
        nonces, ids = (nonce, words[1].decode()), (my_id, words[2].decode())
        dialled = protocol.address_text(address)
        assert words[3].decode() == proof(key, "listener", rank, listener, nonces, ids, dialled, listens_text), "the listener's proof is wrong"
        auth = f"AUTH {proof(key, 'dialer', rank, listener, nonces, ids, dialled, listens_text)}\n".encode()
        self.sock.sendall(auth)
        self.recording = [first, auth]
        out, into = protocol.link_keys(key, rank, listener, nonces, dialled)
        self.sealer, self.opener = Sealer(out), Opener(into)

    def line(self, timeout: float = 20.0) -> bytes:
        """The next line (without its newline); TimeoutError if none is complete within ``timeout``."""
        self.sock.settimeout(timeout)
        while b"\n" not in self.inbox:
            data = self.sock.recv(4096)
            assert data, f"closed after {self.inbox!r}"
            self.inbox += data
        line, _, self.inbox = self.inbox.partition(b"\n")
        return line

    def read(self, timeout: float = 20.0) -> bytes:
        """The next message's body; its MAC must be right."""
        body = self.opener.open(self.line(timeout))
        assert body is not None, "a message from the real rank failed its MAC"
        return body

    def drain(self) -> None:
        """Read every message that arrives within 0.2 s of the last."""
        try:
            while True:
                self.read(timeout=0.2)
        except TimeoutError:
            pass

    def send(self, body: bytes) -> None:
        with self.lock:
            self.sock.sendall(self.sealer.seal(body))

    def close(self) -> None:
        self.sock.close()


def thread_cpu_over(rank: Rank, seconds: float) -> float:
    """CPU seconds the rank's watcher thread used in a window of ``seconds`` (a measurement, not a wait)."""
    before = rank.status()["cpu_s"]
    time.sleep(seconds)
    return rank.status()["cpu_s"] - before


def test_a_stranger_cannot_take_a_place_crash_flood_or_blind_a_rank(tmp_path):
    secret = secrets.token_hex(32)
    env = job_env(secret)
    rank0, rank1 = start_job(tmp_path, env, dict(env, TORCH_PEER_WATCHER_TEST_NOFILE=str(NOFILE)))
    conns: list[socket.socket] = []
    try:
        rank1.ask("START", "STARTED")
        rank1.send("WATCH")  # waits for rank 0, which does not watch yet

        # The store: any process on the node reads every key. It holds addresses, and nothing to authenticate with.
        store = store_client(env)
        keys = store.list_keys()
        values = {k: store.get(k) for k in keys}
        mine = sorted(k.split("torch_peer_watcher/", 1)[1] for k in keys if "torch_peer_watcher/" in k)
        assert mine == ["addr/1"], keys
        assert not any(secret.encode() in v for v in values.values())
        address = watcher_address(store, 1)

        # Taking rank 0's place before it links: the stranger gets a challenge it cannot answer.
        squatter = socket.create_connection(address, timeout=10)
        conns.append(squatter)
        squatter.sendall(hello(0, secrets.token_hex(16)).encode())
        assert read_line(squatter).startswith(b"CHALLENGE ")
        # A wrong answer, and the older protocols' HELLOs (version 1's token stolen from the store, version
        # 2's without an id or address), are refused at once.
        assert refused(address, f"{hello(0, secrets.token_hex(16))}AUTH {'0' * 64}\n".encode()).startswith(b"CHALLENGE ")
        assert refused(address, b"HELLO 0 0123456789abcdef\n") == b""
        assert refused(address, f"HELLO 0 {secrets.token_hex(16)}\n".encode()) == b""
        # The real rank 0 links although the squatter is still waiting as rank 0.
        rank0.ask("START", "STARTED")
        rank0.ask("WATCH", "WATCHED")
        rank1.expect("WATCHED")
        squatter.sendall(f"AUTH {secrets.token_hex(32)}\n".encode())
        assert read_until_eof(squatter) == b""
        for rank in (rank0, rank1):
            rank.send("ALLREDUCE")
        for rank in (rank0, rank1):
            assert rank.expect("REDUCED", "RAISED") == ["REDUCED", "[2.0, 2.0]"]

        # HELLO for a rank that is not in the job, is the listener's own, does not dial it, is linked
        # already, or is no number at all; junk; no newline: each connection is closed, no challenge sent.
        nonce = secrets.token_hex(16)
        for payload in (hello(99, nonce), hello(2, nonce), hello(1, nonce), hello("\u00b2", nonce),
                        hello(-1, nonce), hello("00", nonce), hello("1e400", nonce), hello(9999999999999, nonce),
                        hello(0, nonce, "127.0.0.1|70000"), hello(0, nonce, "a b|1"), hello(0, nonce).strip() + " extra\n",
                        f"PROBE 1 {nonce} {nonce}\n", f"PROBE 5 {nonce} {nonce}\n",
                        'E [["a", 1e400]]\n', "H\n", "B\n", "L\n"):  # fmt: skip
            assert refused(address, payload.encode()) == b"", payload
        for payload in (b"\xff\xfe\x00\n", b"x" * 10_000, b"\n" * 10):
            assert refused(address, payload) == b"", payload
        # HELLO for rank 0, which is linked: a challenge (only its own process, proven, may make its link
        # anew), and a wrong answer changes nothing.
        assert refused(address, f"{hello(0, nonce)}AUTH {'0' * 64}\n".encode()).startswith(b"CHALLENGE ")
        # Rank 1 never dials rank 0: rank 0 refuses it too. Anyone may ask rank 0 whether it lives as if
        # it were rank 1 (a PROBE): the answer, bound to a nonce and to the address, serves nobody else.
        assert refused(watcher_address(store, 0), hello(1, nonce).encode()) == b""
        assert refused(watcher_address(store, 0), f"PROBE 1 {nonce} {nonce}\n".encode()).startswith(b"ALIVE ")
        assert refused(address, f"PROBE 0 {nonce} {nonce}\n".encode()).startswith(b"ALIVE ")
        status = rank1.status()
        assert status["alive"] and status["links"] == [0] and status["losses"] == [], status
        assert rank0.status()["losses"] == []

        # A flood of idle connections against RLIMIT_NOFILE 256: a bounded number waits, the rest are refused.
        baseline = rank1.fds()
        flood = [socket.create_connection(address, timeout=10) for _ in range(300)]
        conns.extend(flood)
        closed = _wait_for_eofs(flood, len(flood) - links_mod.MAX_PENDING)
        assert closed == len(flood) - links_mod.MAX_PENDING
        assert rank1.fds() <= baseline + links_mod.MAX_PENDING + 4
        assert thread_cpu_over(rank1, 1.5) < 0.3, "the watcher thread spins under the flood"
        for sock in flood:
            sock.close()
        rank1.wait_for("done with the flood", lambda: rank1.status()["pending"] == 0)

        # No file descriptor left at all: accept fails with EMFILE and /proc/self/fd cannot be read.
        rank1.ask("HOG", "HOGGED")
        waiting = [socket.create_connection(address, timeout=10) for _ in range(5)]
        conns.extend(waiting)
        assert thread_cpu_over(rank1, 1.5) < 0.3, "the watcher thread spins on a listener it cannot accept"
        status = rank1.status()
        assert status["alive"] and status["losses"] == [], status
        # Rank 0 still holds rank 1's last endpoints (an empty set would make it cut nothing) and heard its heartbeats.
        status0 = rank0.status()
        assert status0["endpoints"]["1"] and status0["losses"] == [], status0
        rank1.ask("UNHOG", "UNHOGGED")
        for sock in waiting:
            sock.close()

        # After all that, a real stall of rank 0 is still seen (its watcher's thread cannot run for 6 s: the
        # 2 s timeout, then rank 1 waits one interval and a margin before it claims the verdict in the store,
        # since rank 0 hosts the store), and rank 1's blocked all_reduce raises.
        rank0.send("STALL 6")
        rank1.send("ALLREDUCE")
        raised = rank1.expect("RAISED", "REDUCED", "PARTITIONED", losses_ok=True)
        assert raised[0] == "RAISED", raised
        loss = json.loads(raised[1])
        assert loss["rank"] == 0 and "no heartbeat from rank 0" in loss["cause"] and loss["cut"] >= 1, loss
        assert rank1.status()["alive"]
        assert "refused a connection" in rank1.stderr()
        rank0.expect("STALLED", losses_ok=True)
        # Rank 0 hosts the store: its endpoints, which rank 1 cut, include the store's port; rank 0 then
        # learns it is out and cuts its sockets to rank 1's endpoints. Neither cuts a connection to the store.
        assert rank1.ask("STORE", "STORED", "STOREERROR") == ["STORED", "1"]
    finally:
        for sock in conns:
            sock.close()
        for rank in (rank0, rank1):
            rank.kill()


def _wait_for_eofs(socks: list[socket.socket], count: int, timeout: float = 30.0) -> int:
    """Wait until ``count`` of ``socks`` were closed by the other side; how many were."""
    selector = selectors.DefaultSelector()
    for sock in socks:
        sock.setblocking(False)
        selector.register(sock, selectors.EVENT_READ)
    closed = 0
    deadline = time.monotonic() + timeout
    while closed < count and time.monotonic() < deadline:
        for key, _ in selector.select(timeout=max(0.0, deadline - time.monotonic())):
            try:
                data = key.fileobj.recv(4096)
            except ConnectionResetError:
                data = b""
            assert not data, f"a flooding connection got {data!r}"
            selector.unregister(key.fileobj)
            closed += 1
    selector.close()
    return closed


class Heartbeats:
    """Sends H on an authenticated link every 0.2 s, as a live peer's thread would, until stopped."""

    def __init__(self, play: PeerPlay) -> None:
        self.play = play
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(0.2):
            try:
                self.play.send(b"H")
            except OSError:
                return

    def end(self) -> None:
        self.stop.set()
        self.thread.join()


@pytest.mark.parametrize("with_secret", [True, False], ids=["secret", "no-secret"])
def test_the_legitimate_paths_work_and_junk_or_a_replay_from_a_peer_changes_nothing(tmp_path, with_secret):
    """The test plays rank 0's watcher (it holds the job's secret, or there is none) against a real rank 1."""
    secret = secrets.token_hex(32) if with_secret else None
    env = job_env(secret)
    key = protocol.job_key(secret, job_of(env))
    # Rank 0's process runs no watcher of its own until the end, where it tries with another secret.
    other = job_env(secrets.token_hex(32), MASTER_PORT=env["MASTER_PORT"], TORCH_PEER_WATCHER_CONNECT_TIMEOUT_S="3")
    rank0, rank1 = start_job(tmp_path, other, env)
    try:
        rank1.ask("START", "STARTED")
        address = watcher_address(store_client(env), 1)
        if not with_secret:
            assert "TORCH_PEER_WATCHER_SECRET nor TORCH_PEER_WATCHER_SECRET_FILE is set" in rank1.stderr()

        play = PeerPlay(address, key)
        beats = Heartbeats(play)
        assert play.read() == b"H"
        play.send(b'E [["127.0.0.1", 5]]')
        rank1.wait_for("given the endpoints", lambda: rank1.status()["endpoints"].get("0") == [["127.0.0.1", 5]])
        # Junk from the authenticated peer (each message sealed): ignored, the last valid endpoints are kept.
        # The last one, the only message of no known type, is logged once handled: all before it were handled.
        for junk in (b'E [["a", 1e400]]', b'E [["a", 70000]]', b'E [["a", true]]', b"E NaN", b'E {"a": 1}', b"E [[1, 2]]",
                     b'E [["a", 1, 2]]', b"E " + b"[" * 100_000, b"E \xff\xfe", b"E " + b"9" * 5000, b"HELLO 0 x"):  # fmt: skip
            play.send(junk)
        rank1.wait_for("done with the junk", lambda: "a message this watcher does not know" in rank1.stderr())
        assert "an invalid endpoint list" in rank1.stderr()
        status = rank1.status()
        assert status["alive"] and status["links"] == [0] and status["losses"] == [], status
        assert status["endpoints"]["0"] == [["127.0.0.1", 5]], status
        # Another process with the secret claiming rank 0 while rank 0 is linked: challenged, then refused
        # after its proof (only the same process may make its link anew); the first link stays.
        with pytest.raises(AssertionError, match="closed after"):
            PeerPlay(address, key).read()
        status = rank1.status()
        assert status["links"] == [0] and status["losses"] == [], status
        # The thread still beats: what was sent before is read, then a new heartbeat comes.
        play.drain()
        assert play.read() == b"H"

        # A clean goodbye: the link ends, nobody is declared lost.
        beats.end()
        play.send(b"B")
        play.sock.settimeout(20)
        rest = play.inbox + b"".join(iter(lambda: play.sock.recv(4096), b""))
        assert all(play.opener.open(line) == b"H" for line in rest.splitlines()), rest[:200]
        play.close()
        status = rank1.status()
        assert status["links"] == [] and status["losses"] == [], status

        # A recorded handshake replayed: the listener's nonce is new, so the recorded AUTH is wrong.
        with socket.create_connection(address, timeout=10) as replay:
            replay.sendall(play.recording[0])
            assert read_line(replay).startswith(b"CHALLENGE ")
            replay.sendall(play.recording[1])
            assert read_until_eof(replay) == b""
        # An answer made with another key (a stranger's guess; without a secret the empty key is the right one).
        with pytest.raises(AssertionError, match="the listener's proof is wrong"):
            PeerPlay(address, b"guess")
        rank1.wait_for("done with the guess", lambda: rank1.status()["pending"] == 0)
        assert rank1.status()["links"] == []

        # The heartbeat verdict: a linked peer that stops beating is declared lost after the 2 s timeout.
        play = PeerPlay(address, key)
        assert play.read() == b"H"
        loss = json.loads(rank1.expect("LOSS")[1])
        assert loss["rank"] == 0 and loss["cause"].startswith("no heartbeat from rank 0"), loss
        # The accused side reads the verdict, sealed, before the close.
        bodies = []
        while (body := play.read()) != b"L":
            bodies.append(body)
        assert set(bodies) <= {b"H"}, bodies
        play.close()
        # The closed connection of a process that is gone (its listener refuses the probe): lost at once.
        play = PeerPlay(address, key)
        assert play.read() == b"H"
        play.close()
        loss = json.loads(rank1.expect("LOSS")[1])
        # EOF, or a reset where the closed side had unread heartbeats: both a close, and nothing listens.
        assert loss["rank"] == 0 and loss["cause"].startswith("rank 0 closed its connection"), loss
        assert loss["cause"].endswith("(process gone)"), loss

        # A rank 0 whose secret differs takes rank 1's address for a forgery (it is not signed with its
        # key), waits for a signed one until its connect timeout, and says why.
        rank0.ask("START", "STARTED")
        error = rank0.ask("WATCH", "WATCHERROR")[1]
        assert "no address for rank 1 signed with this job's secret" in error and "TORCH_PEER_WATCHER_SECRET" in error, error
        assert "or the ranks have different secrets" in rank0.stderr()
        assert rank1.status()["alive"]
    finally:
        for rank in (rank0, rank1):
            rank.kill()


def test_the_secret_comes_from_the_environment_or_a_private_file(tmp_path, monkeypatch):
    token = "s" * 40
    assert secret_from_env({"TORCH_PEER_WATCHER_SECRET": token}) == token
    assert secret_from_env({}) is None
    monkeypatch.delenv("TORCH_PEER_WATCHER_SECRET", raising=False)
    monkeypatch.delenv("TORCH_PEER_WATCHER_SECRET_FILE", raising=False)
    assert WatcherSettings.from_env({"TORCH_PEER_WATCHER_SECRET": token}).secret == token
    # Settings made in code (interval, timeout) still take the launcher's secret.
    monkeypatch.setenv("TORCH_PEER_WATCHER_SECRET", token)
    assert WatcherSettings(interval_s=0.5, timeout_s=2.0).secret == token
    monkeypatch.delenv("TORCH_PEER_WATCHER_SECRET")
    assert token not in repr(WatcherSettings(secret=token))
    path = tmp_path / "secret"
    path.write_text(token + "\n")
    path.chmod(0o600)
    assert secret_from_env({"TORCH_PEER_WATCHER_SECRET_FILE": str(path)}) == token
    path.chmod(0o640)
    with pytest.raises(WatcherConfigError, match=r"can be read or written by others \(mode 0640\): chmod 600"):
        secret_from_env({"TORCH_PEER_WATCHER_SECRET_FILE": str(path)})
    with pytest.raises(WatcherConfigError, match="both TORCH_PEER_WATCHER_SECRET and TORCH_PEER_WATCHER_SECRET_FILE"):
        secret_from_env({"TORCH_PEER_WATCHER_SECRET": token, "TORCH_PEER_WATCHER_SECRET_FILE": str(path)})
    with pytest.raises(WatcherConfigError, match="fewer than 16"):
        secret_from_env({"TORCH_PEER_WATCHER_SECRET": "short"})
    with pytest.raises(WatcherConfigError, match="cannot open it"):
        secret_from_env({"TORCH_PEER_WATCHER_SECRET_FILE": str(tmp_path / "absent")})


def test_an_endpoint_list_is_parsed_strictly():
    assert parse_endpoints(b'[["10.0.0.1", 5], ["::1", 65535]]') == {("10.0.0.1", 5), ("::1", 65535)}
    assert parse_endpoints(b"[]") == frozenset()
    for junk in (b'[["a", 1e400]]', b'[["a", 1.0]]', b'[["a", Infinity]]', b'[["a", 0]]', b'[["a", true]]', b"[[1, 2]]",
                 b'[["\xc2\xb2", 1]]', b"[" * 100_000, b"\xff", b"1" * 5000, b'[["a", 1]', b'{"a": 1}'):  # fmt: skip
        assert parse_endpoints(junk) is None, junk


def test_torch_dist_check_hands_each_run_of_its_ranks_a_fresh_secret():
    from torch_dist_check.peerloss import cases as peerloss
    from torch_dist_check.peerloss import runner

    case = peerloss.PeerLossCase("single", "gloo", None, "allreduce", True)
    caller = {"TORCH_PEER_WATCHER_SECRET_FILE": "/elsewhere", "TORCH_PEER_WATCHER_SECRET": "x" * 64}
    first = runner.worker_env(case, caller, peerloss.PeerLossSettings())
    second = runner.worker_env(case, caller, peerloss.PeerLossSettings())
    assert "TORCH_PEER_WATCHER_SECRET_FILE" not in first
    assert len(first["TORCH_PEER_WATCHER_SECRET"]) == 64 and first["TORCH_PEER_WATCHER_SECRET"] != "x" * 64
    assert first["TORCH_PEER_WATCHER_SECRET"] != second["TORCH_PEER_WATCHER_SECRET"]
