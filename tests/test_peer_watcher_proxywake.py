"""The proxy waker (torch_peer_watcher.proxywake, issue 74): it wakes the proxy threads an abort is joining, and
no other thread's sockets.

NCCL's two proxy threads are played by real POSIX threads (ctypes' pthread_create) that do what NCCL 2.28.9's
ncclProxyService and ncclProxyServiceUDS do (src/proxy.cc): poll() with a 500 ms timeout on a pollfd array whose
last slot is the listening socket and whose free slots are -1, the abort flag read at the top of the loop, a
connection without NCCL's handshake dropped when the flag is set, the UDS thread leaving on stop or abort before it
reads. The "abort" is NCCL's order: flag, ncclProxyMsgClose on the main thread's own connection, stop, pthread_join.
The GPU test (-m gpu) measures the real thing on stock NCCL.
"""

from __future__ import annotations

import ctypes
import json
import os
import platform
import secrets
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from torch_peer_watcher import proxywake
from torch_peer_watcher.settings import WAKE_NCCL_PROXY_ENV, WatcherConfigError, WatcherSettings

ROOT = Path(__file__).resolve().parent.parent
needs_proc = pytest.mark.skipif(proxywake.unsupported() is not None, reason=f"proxy waker: {proxywake.unsupported()}")

libc = ctypes.CDLL(None, use_errno=True)
THREAD_MAIN = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)
PR_SET_NAME = 15
MAGIC = b"NCCLMAGC"  # what NCCL's own connections send first (its socket magic); a poke sends nothing
POLL_TIMEOUT_MS = 500


@pytest.fixture(autouse=True)
def named_nccl_threads(monkeypatch):
    # What importing torch_peer_watcher sets before the first NCCL group (watchdog.SETTINGS): NCCL names its
    # threads only then, and the waker tells the proxy threads by their names.
    monkeypatch.setenv("NCCL_SET_THREAD_NAME", "1")


class PollFd(ctypes.Structure):
    _fields_ = [("fd", ctypes.c_int), ("events", ctypes.c_short), ("revents", ctypes.c_short)]


class MockComm:
    """One communicator's proxy threads, as NCCL 2.28.9 runs them, and its main thread's connection to them."""

    SLOTS = 8

    def __init__(self, device: int = 0, reuse_port: bool = False) -> None:
        self.abort_flag = False
        self.stop = False
        self.strangers_while_running = 0  # connections without the handshake while the flag was 0: must stay 0
        self.strangers_while_aborting = 0
        self.uds_datagrams = 0
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, int(reuse_port))
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(16)
        self.listener.setblocking(False)
        self.uds = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.uds.bind(b"\0tmp/nccl-socket-0-" + secrets.token_hex(8).encode())
        self.uds.setblocking(False)
        self.pollfds = (PollFd * (self.SLOTS + 1))()
        for slot in self.pollfds:
            slot.fd, slot.events = -1, 0x1 | 0x10
        self.pollfds[self.SLOTS].fd, self.pollfds[self.SLOTS].events = self.listener.fileno(), 0x1
        self.uds_pollfd = (PollFd * 1)()
        self.uds_pollfd[0].fd, self.uds_pollfd[0].events = self.uds.fileno(), 0x1 | 0x10
        self.peers: dict[int, socket.socket] = {}
        self.service_tid = 0
        self._mains = [THREAD_MAIN(self._service), THREAD_MAIN(self._uds_service)]
        self._names = [f"NCCL Service {device:2d}".encode(), f"NCCL UDS Service {device:2d}".encode()[:15]]
        self.threads = [ctypes.c_ulong(), ctypes.c_ulong()]
        for handle, main in zip(self.threads, self._mains):
            assert libc.pthread_create(ctypes.byref(handle), None, main, None) == 0
        self.own = self.connect()  # the main thread's connection to its own proxy (peerSocks)

    def connect(self) -> socket.socket:
        """A connection as NCCL makes one: the handshake first."""
        before = len(self.peers)
        conn = socket.create_connection(self.listener.getsockname())
        conn.sendall(MAGIC)
        deadline = time.monotonic() + 5
        while len(self.peers) <= before and time.monotonic() < deadline:
            time.sleep(0.001)
        return conn

    def _name(self, index: int) -> None:
        libc.prctl(PR_SET_NAME, ctypes.c_char_p(self._names[index]), 0, 0, 0)

    def _service(self, _arg: int) -> None:
        self._name(0)
        self.service_tid = threading.get_native_id()
        stop = False
        while not stop or self.peers:
            if self.abort_flag:
                stop = True
            while libc.poll(self.pollfds, self.SLOTS + 1, POLL_TIMEOUT_MS) < 0:
                pass
            if self.pollfds[self.SLOTS].revents:
                self._accept()
            for slot in range(self.SLOTS):
                fd = self.pollfds[slot].fd
                if fd >= 0 and self.pollfds[slot].revents:
                    data = self.peers[fd].recv(64)
                    if data == b"stop":  # ncclProxyMsgStop: an orderly destroy
                        stop = True
                    if not data or data in (b"close", b"stop"):
                        self.peers.pop(fd).close()
                        self.pollfds[slot].fd = -1
        return None

    def _accept(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except BlockingIOError:
            return
        # With the flag set NCCL's accept gives up at once; without, it would wait for the handshake.
        conn.settimeout(0.0 if self.abort_flag else 0.05)
        try:
            magic = conn.recv(len(MAGIC), socket.MSG_PEEK)
        except OSError:
            magic = b""
        if magic != MAGIC:
            if self.abort_flag:
                self.strangers_while_aborting += 1
            else:
                self.strangers_while_running += 1
            conn.close()
            return
        conn.recv(len(MAGIC))
        conn.setblocking(False)
        slot = next(s for s in range(self.SLOTS) if self.pollfds[s].fd < 0)
        self.pollfds[slot].fd = conn.fileno()
        self.peers[conn.fileno()] = conn

    def _uds_service(self, _arg: int) -> None:
        self._name(1)
        while True:
            while libc.poll(self.uds_pollfd, 1, POLL_TIMEOUT_MS) < 0:
                pass
            if self.stop or self.abort_flag:
                break
            if self.uds_pollfd[0].revents:
                try:
                    self.uds.recv(64)
                    self.uds_datagrams += 1
                except BlockingIOError:
                    pass
        return None

    def abort(self) -> float:
        """ncclCommAbort's order (flag, close message, stop, join both threads); its seconds."""
        started = time.monotonic()
        self.abort_flag = True
        self._close_stop_and_join()
        return time.monotonic() - started

    def destroy(self) -> float:
        """ncclCommDestroy's order (flag 0: ncclProxyMsgStop on a new connection, close message, stop, join)."""
        started = time.monotonic()
        stop = self.connect()
        stop.sendall(b"stop")
        stop.close()
        self._close_stop_and_join()
        return time.monotonic() - started

    def _close_stop_and_join(self) -> None:
        """Both ends' common tail: the close message on this rank's own connection, stop, join both threads."""
        self.own.sendall(b"close")
        self.own.close()
        self.stop = True
        for handle in self.threads:
            assert libc.pthread_join(handle, None) == 0

    def end(self) -> None:
        """Stop a communicator that was not aborted (the test's cleanup)."""
        self.abort_flag = True
        if self.own.fileno() >= 0:
            self.own.close()
        self.stop = True
        for handle in self.threads:
            libc.pthread_join(handle, None)
        self.listener.close()
        self.uds.close()


@needs_proc
def test_parsers_read_procs_lines_and_ncclS_pollfd_layout():
    assert proxywake.parse_syscall("running\n") is None
    assert proxywake.parse_syscall("-1 0x7ffd 0x7f00\n") is None
    call = proxywake.parse_syscall("202 0x7f12340910 0x0 0x2a 0x0 0x0 0x0 0x7ffd 0x7f00\n")
    assert call == proxywake.Syscall(202, (0x7F12340910, 0, 42, 0, 0, 0), 0x7FFD)
    assert proxywake.parse_state("123 (NCCL Service  0) S 1 2 3") == "S"
    assert proxywake.parse_state("123 (a) b (c)) R 1") == "R"
    assert proxywake.service_listener([(-1, 0x11), (-1, 0x11), (7, 0x1)]) == 7
    assert proxywake.service_listener([(-1, 0x11), (9, 0x11), (7, 0x1)]) is None, "a peer is still connected"
    assert proxywake.service_listener([(7, 0x1)]) is None
    assert proxywake.uds_socket([(5, 0x11)]) == 5 and proxywake.uds_socket([(5, 1), (6, 1)]) is None


@needs_proc
def test_an_aborted_communicators_proxy_threads_are_joined_at_once_with_the_waker_and_after_500_ms_without():
    plain = MockComm()
    without = plain.abort()
    woken_comm = MockComm()
    with proxywake.ProxyWaker() as waker:
        with_waker = woken_comm.abort()
    assert without >= 0.4, f"the mock no longer waits as NCCL does ({without:.3f} s)"
    assert with_waker < 0.15, f"the abort took {with_waker:.3f} s with the waker; it did {waker.woken}"
    kinds = {kind for kind, _ in waker.woken.pokes}
    assert kinds == {"service", "uds"}, waker.woken
    assert woken_comm.strangers_while_running == 0 and woken_comm.uds_datagrams == 0
    for comm in (plain, woken_comm):
        comm.listener.close()
        comm.uds.close()


@needs_proc
def test_the_waker_touches_no_healthy_communicator_and_no_joined_proxy_with_a_peer_left():
    healthy = MockComm(device=0)
    # Joined with a peer still connected (another local rank that has not aborted yet): its sockets stay untouched.
    waiting = MockComm(device=1)
    other_rank = waiting.connect()
    aborted = MockComm(device=2)
    joins: list[float] = []
    with proxywake.ProxyWaker() as waker:
        joiner = threading.Thread(target=lambda: joins.append(waiting.abort()))
        joiner.start()
        aborted.abort()
        time.sleep(0.3)
        assert joiner.is_alive(), "the communicator with a peer left ended before its peer did"
        other_rank.close()
        joiner.join(5)
    assert not joiner.is_alive()
    assert healthy.strangers_while_running == 0 and healthy.strangers_while_aborting == 0
    assert healthy.uds_datagrams == 0
    assert waiting.strangers_while_aborting == 0, f"a proxy with a peer left was poked: {waker.woken}"
    assert aborted.strangers_while_aborting >= 1
    # The healthy one still serves: a new connection with the handshake is taken as a peer.
    before = len(healthy.peers)
    late = healthy.connect()
    assert len(healthy.peers) == before + 1
    late.close()
    healthy.end()
    for comm in (waiting, aborted):
        comm.listener.close()
        comm.uds.close()


@needs_proc
def test_the_waker_never_pokes_an_orderly_destroy_even_while_it_waits_for_a_peer():
    # Flag 0: a stranger's connection would hold NCCL 2.28's accept for good. The destroy waits for another local
    # rank's connection meanwhile, joined and asleep in poll(): the waker must leave it alone.
    destroyed = MockComm()
    other_rank = destroyed.connect()
    with proxywake.ProxyWaker() as waker:
        joiner = threading.Thread(target=destroyed.destroy)
        joiner.start()
        time.sleep(0.3)
        other_rank.close()
        joiner.join(5)
    assert not joiner.is_alive()
    assert destroyed.strangers_while_running == 0, waker.woken
    assert ("service", destroyed.service_tid) not in waker.woken.pokes
    destroyed.listener.close()
    destroyed.uds.close()


@needs_proc
def test_two_aborts_at_once_beside_an_orderly_destroy_wake_the_two_and_leave_the_destroy_alone():
    # The watcher aborts two groups in threads of their own while the application destroys a third, healthy one
    # (flag 0: a stranger's connection would hold NCCL 2.28's accept); another local rank holds the destroy a while.
    first, second, destroyed = MockComm(device=0), MockComm(device=1), MockComm(device=2)
    other_rank = destroyed.connect()
    took: dict[str, float] = {}
    jobs = {"first": first.abort, "second": second.abort, "destroy": destroyed.destroy}
    with proxywake.ProxyWaker() as waker:
        threads = [threading.Thread(target=lambda n=n, job=job: took.__setitem__(n, job())) for n, job in jobs.items()]
        for thread in threads:
            thread.start()
        time.sleep(0.3)
        other_rank.close()
        for thread in threads:
            thread.join(5)
    assert not any(thread.is_alive() for thread in threads)
    assert took["first"] < 0.15 and took["second"] < 0.15, f"{took}: {waker.woken}"
    for comm in (first, second):
        assert ("service", comm.service_tid) in waker.woken.pokes and comm.strangers_while_running == 0
    assert ("service", destroyed.service_tid) not in waker.woken.pokes, waker.woken
    assert destroyed.strangers_while_running == 0 and destroyed.strangers_while_aborting == 0
    for comm in (first, second, destroyed):
        comm.listener.close()
        comm.uds.close()


@needs_proc
def test_a_listening_socket_that_shares_its_port_is_never_connected_to():
    comm = MockComm(reuse_port=True)  # another socket may hold its port too
    assert comm.listener.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT)
    with proxywake.ProxyWaker() as waker:
        comm.abort()
    assert ("service", comm.service_tid) not in waker.woken.pokes, waker.woken
    assert comm.strangers_while_aborting == 0
    comm.listener.close()
    comm.uds.close()


@needs_proc
def test_on_an_architecture_of_unknown_system_call_numbers_the_waker_says_so_and_starts_no_thread(monkeypatch):
    monkeypatch.setattr(proxywake.platform, "machine", lambda: "riscv64")
    before = threading.active_count()
    with proxywake.ProxyWaker() as waker:
        assert threading.active_count() == before
    assert waker.woken.errors == ["not woken: knows the system call numbers of x86_64, aarch64 only, not riscv64"]


@needs_proc
def test_in_a_process_of_many_threads_most_looks_read_only_the_threads_started_since_the_waker(monkeypatch):
    # A look reads a /proc file per thread it considers (about 12 us of CPU each on the 2-core machine): 1000
    # threads made every 2 ms look a 13 ms one, and the waker ran a core for the whole abort. The joiners of an
    # abort are threads started after the waker (abort_all's, PyTorch's std::async, NCCL < 2.28.3's job thread)
    # or the one that entered it; the older threads are looked at in turn, OLDER_PER_LOOK a look.
    reads: dict[int, int] = {}
    task_syscall = proxywake.task_syscall

    def counted(tid: int) -> proxywake.Syscall | None:
        reads[tid] = reads.get(tid, 0) + 1
        return task_syscall(tid)

    monkeypatch.setattr(proxywake, "task_syscall", counted)
    idle = threading.Event()
    older = [threading.Thread(target=idle.wait, daemon=True) for _ in range(1000)]
    for thread in older:
        thread.start()
    comm = MockComm()
    other_rank = comm.connect()  # joined with a peer left: looked at, and left alone, for 0.3 s or more
    try:
        with proxywake.ProxyWaker() as waker:
            joiner = threading.Thread(target=comm.abort)
            joiner.start()
            # 0.3 s, or longer on a loaded machine, until the waker has looked at the joiner 10 times (seen: 8 looks
            # in 0.3 s with another test run beside it).
            deadline = time.monotonic() + 10
            time.sleep(0.3)
            while reads.get(joiner.native_id, 0) < 10 and time.monotonic() < deadline:
                time.sleep(0.05)
            other_rank.close()
            joiner.join(5)
            assert not joiner.is_alive()
    finally:
        idle.set()
        for thread in older:
            thread.join()
    assert waker.woken.errors == [] and ("service", comm.service_tid) not in waker.woken.pokes, waker.woken
    assert reads.get(joiner.native_id, 0) >= 10, reads.get(joiner.native_id)
    print(f"reads: an older thread's {reads[older[0].native_id]}, the joiner's {reads[joiner.native_id]}")
    assert reads[older[0].native_id] < reads[joiner.native_id] / 2
    comm.listener.close()
    comm.uds.close()


@needs_proc
def test_same_mapping_tells_one_mapping_from_the_next():
    import mmap

    page = mmap.PAGESIZE
    region = mmap.mmap(-1, 3 * page)
    start = ctypes.addressof(ctypes.c_char.from_buffer(region))
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    assert libc.mprotect(start + page, page, 0) == 0  # a guard page between: three mappings, as a thread stack's
    assert proxywake.same_mapping(start, start + page - 1)
    assert not proxywake.same_mapping(start, start + 2 * page)


def test_the_waker_setting_is_on_off_or_left_to_the_loaded_nccl(monkeypatch):
    monkeypatch.delenv(WAKE_NCCL_PROXY_ENV, raising=False)
    assert WatcherSettings().wake_nccl_proxy is None, "unset: the waker's own default (the loaded NCCL's release)"
    monkeypatch.setenv(WAKE_NCCL_PROXY_ENV, "1")
    assert WatcherSettings().wake_nccl_proxy is True, "settings made in code read the launch's choice too"
    assert WatcherSettings.from_env({}).wake_nccl_proxy is None
    assert WatcherSettings.from_env({WAKE_NCCL_PROXY_ENV: ""}).wake_nccl_proxy is None
    assert WatcherSettings.from_env({WAKE_NCCL_PROXY_ENV: "0"}).wake_nccl_proxy is False
    assert WatcherSettings.from_env({WAKE_NCCL_PROXY_ENV: "1"}).wake_nccl_proxy is True
    with pytest.raises(WatcherConfigError, match=f"{WAKE_NCCL_PROXY_ENV}='yes': expected 1 .*, 0 .*, or unset"):
        WatcherSettings.from_env({WAKE_NCCL_PROXY_ENV: "yes"})


def test_the_waker_runs_by_default_only_where_the_loaded_nccl_is_a_proven_release(monkeypatch):
    # Only the NCCLs it was proven on with a GPU (PROVEN_NCCL) get it unasked; the release is the library the
    # process mapped, asked through its ncclGetVersion, not the headers torch was built with.
    torch = pytest.importorskip("torch")
    assert torch is not None
    loaded = proxywake.loaded_nccl()
    if loaded is None:
        pytest.skip("no libnccl is mapped in this process (a CPU build of PyTorch, or NCCL linked into libtorch)")
    maps = Path("/proc/self/maps").read_text()
    assert "libnccl.so" in maps and len(loaded) == 3 and loaded >= (2, 0, 0), loaded
    monkeypatch.setenv("NCCL_SET_THREAD_NAME", "1")
    monkeypatch.setattr(proxywake, "PROVEN_NCCL", (loaded,))
    if proxywake.unsupported() is None:
        assert proxywake.by_default() is True
        with proxywake.waking_proxies(None) as woken:
            assert woken is not None, "unset on a proven release: the waker runs"
    monkeypatch.setattr(proxywake, "PROVEN_NCCL", ((1, 0, 0),))
    assert proxywake.by_default() is False
    with proxywake.waking_proxies(None) as woken:
        assert woken is None, "unset on a release it was not proven on: nothing runs"
    monkeypatch.setattr(proxywake, "PROVEN_NCCL", (loaded,))
    monkeypatch.setenv("NCCL_SET_THREAD_NAME", "0")
    assert proxywake.by_default() is False, "NCCL does not name its threads: the waker could tell none"
    with proxywake.waking_proxies(False) as woken:
        assert woken is None, "0 (False) wins over a proven release"


def test_waking_proxies_off_starts_no_thread():
    before = threading.active_count()
    with proxywake.waking_proxies(False) as woken:
        assert woken is None and threading.active_count() == before


@needs_proc
def test_abort_all_wakes_the_proxies_of_its_aborts_only_when_asked():
    from torch_peer_watcher import groups

    assert groups.abort_all([]).woken is None
    with_waker = groups.abort_all([], wake_nccl_proxy=True)
    assert with_waker.woken is not None and with_waker.woken.errors == []


class _MockGroup:
    """What the background release calls: ``abort()``, here a mock communicator's (NCCL's order and 500 ms wait)."""

    def __init__(self) -> None:
        self.comm = MockComm()
        self.abort_s: float | None = None

    def abort(self) -> None:
        self.abort_s = self.comm.abort()
        self.comm.listener.close()
        self.comm.uds.close()


@needs_proc
def test_a_shrunk_parent_released_in_the_background_has_its_proxy_threads_woken_when_asked():
    # The NCCL shrink (a group rebuilt from the store) releases its parent beside the job; the survivor's blocked
    # step waited for that abort on the GPU (train-shrink raised 0.33-0.59 s after the death, the rebuilt group
    # ready at 0.12 s), so the release wakes the abort's proxy threads as abort_all does.
    from torch_peer_watcher import groups

    # Compared as sets of "kind:tid xN": a thread id an earlier test's thread had may come again (the kernel reuses
    # them), and its count then changes rather than a new entry coming.
    before, errors_before = set(groups.released_wakes()), len(groups.wait_for_releases(5))
    plain = _MockGroup()
    groups.release_in_background(plain, wake_nccl_proxy=False).join(10)
    assert plain.abort_s is not None and plain.abort_s >= 0.4, plain.abort_s
    assert set(groups.released_wakes()) == before, "no waker asked for: nothing poked"
    # Made only now: its proxy threads' 500 ms polls start here. Made beside the first, their timeouts fell with the
    # end of the first's abort (0.5 s after both were made), and its UDS thread could leave its poll by itself before
    # the waker came to it (CI, 1 run in a full test run: only the service thread was poked).
    woken = _MockGroup()
    groups.release_in_background(woken, wake_nccl_proxy=True).join(10)
    assert woken.abort_s is not None and woken.abort_s < 0.15, woken.abort_s
    pokes = set(groups.released_wakes()) - before
    assert {poke.split(":")[0] for poke in pokes} == {"service", "uds"}, pokes
    assert woken.comm.strangers_while_running == 0
    assert groups.wait_for_releases(5)[errors_before:] == []


def _recorded_releases(monkeypatch) -> tuple:
    """PyTorch's c10d, the groups module, and the list each release_aborted_parent call lands in (group, setting)."""
    pytest.importorskip("torch", reason="torch is not installed (bash scripts/install-test-deps.sh installs it)")
    from torch.distributed import distributed_c10d as c10d

    from torch_peer_watcher import groups

    if groups.shrink_seam_missing() is not None:
        pytest.skip(f"no shrink seam in this PyTorch: {groups.shrink_seam_missing()}")
    released = []
    monkeypatch.setattr(groups, "release_aborted_parent", lambda group, wake=False: released.append((group, wake)))
    return c10d, groups, released


def test_the_watchers_shrink_passes_the_waker_setting_to_the_parents_release(monkeypatch):
    # Stock shrink_group's finalize, inside aborting_shrinks: the parent's release gets the setting it was given.
    c10d, groups, released = _recorded_releases(monkeypatch)
    for wake in (True, None, False):
        with groups.aborting_shrinks(wake):
            c10d._cleanup_original_group("parent")
    assert released == [("parent", True), ("parent", None), ("parent", False)]
    gloo = groups.WatchedGroup(group=None, name="g", ranks=frozenset({0, 1}), backends=("gloo",), is_default=True)
    assert groups.waker_setting([gloo], None) is False, "unasked, a gloo group's release runs no waker"


def test_the_default_runs_the_waker_only_for_an_abort_of_an_nccl_group(monkeypatch):
    # Unasked, the waker runs on a proven NCCL only where an NCCL communicator is aborted: a gloo job's abort has
    # no proxy thread to wake, and a waker thread looking through /proc every 2 ms would only cost it CPU.
    from torch_peer_watcher import groups

    monkeypatch.setattr(proxywake, "by_default", lambda: True)  # as on a proven release
    gloo = groups.WatchedGroup(group=None, name="g", ranks=frozenset({0, 1}), backends=("gloo",), is_default=True)
    nccl = groups.WatchedGroup(group=None, name="n", ranks=frozenset({0, 1}), backends=("gloo", "nccl"),
                               is_default=False)  # fmt: skip
    assert groups.waker_setting([gloo], None) is False
    assert groups.waker_setting([gloo, nccl], None) is None, "an NCCL group among them: the default decides"
    assert groups.waker_setting([gloo], True) is True, "asked for: it runs"
    assert groups.abort_all([], wake_nccl_proxy=None).woken is None, "no NCCL group aborted: no waker"


@needs_proc
def test_watcher_abort_of_a_group_says_why_the_waker_woke_nothing(tmp_path):
    # PeerWatcher.abort(group) (the HSDP replica's leave_old) runs the waker too: a refusal there reached nobody,
    # where abort_all's lands in the loss's errors.
    pytest.importorskip("torch")
    code = (
        "import warnings, torch.distributed as dist\n"
        "from torch_peer_watcher.watcher import PeerWatcher\n"
        "from torch_peer_watcher.settings import WatcherSettings\n"
        f"store = dist.FileStore({str(tmp_path / 'store')!r}, 1)\n"
        "dist.init_process_group('gloo', rank=0, world_size=1, store=store)\n"
        "watcher = PeerWatcher(store, 0, WatcherSettings(wake_nccl_proxy=True), world_size=1)\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    watcher.abort(dist.group.WORLD)\n"
        "print('WARNINGS', [str(w.message) for w in caught])\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT / "scripts"), NCCL_SET_THREAD_NAME="0")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    shown = next(line for line in run.stdout.splitlines() if line.startswith("WARNINGS"))
    assert "waking NCCL's proxy threads: not woken: NCCL_SET_THREAD_NAME=0" in shown, shown


LEAVE_WORLD = """
import inspect, sys, torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
sys.path.insert(0, {tests!r})
import torch_peer_watcher
from test_peer_watcher_proxywake import MockComm
dist.init_process_group("gloo", rank=0, world_size=1, store=dist.FileStore({store!r}, 1))
comm, real, took = MockComm(), c10d._abort_process_group, []
def abort_world(group=None):  # the world's abort, as PyTorch makes it, aborts an NCCL-modelled communicator too
    real(group)
    took.append(comm.abort())
c10d._abort_process_group = abort_world
woken = torch_peer_watcher.leave_world()
# PyTorch 2.6's world abort is a no-op (it says so) without an NCCL backend: the world stays initialized there
left = not dist.is_initialized() or "no-op" in inspect.getsource(real)
print("LEFT", round(took[0], 3), left, sorted(k for k, _ in woken.pokes) if woken else None)
"""


@needs_proc
@pytest.mark.parametrize("wake", ["1", "0", ""])
def test_leave_world_wakes_the_proxy_threads_that_the_worlds_abort_joins(tmp_path, wake):
    # The HSDP rejoin leaves the old world by aborting every group: on one H100 with the wheel's NCCL 2.28.9 that
    # took 0.52 s (each communicator's abort waits out its proxy threads' 500 ms poll()). leave_world() runs the
    # waker around PyTorch's real _abort_process_group (a gloo world of one here), whose abort also aborts a
    # communicator modelled on NCCL 2.28.9's threads (MockComm): woken when asked, 0.5 s when not, and unasked a
    # world without an NCCL group runs no waker at all.
    pytest.importorskip("torch")
    code = LEAVE_WORLD.format(tests=str(ROOT / "tests"), store=str(tmp_path / "store"))
    env = dict(os.environ, PYTHONPATH=str(ROOT / "scripts"), **{WAKE_NCCL_PROXY_ENV: wake})
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    _, took, left, pokes = next(line for line in run.stdout.splitlines() if line.startswith("LEFT")).split(" ", 3)
    assert left == "True", "the world was left"
    if wake == "1":
        assert float(took) < 0.15 and pokes == "['service', 'uds']", (took, pokes)
    else:
        assert float(took) >= 0.3 and pokes == "None", (took, pokes)


@needs_proc
def test_without_nccl_thread_names_the_waker_says_why_it_wakes_nothing(monkeypatch):
    # Seen on one H100 with NCCL 2.28.9: under NCCL_SET_THREAD_NAME=0 (NCCL's default) every proxy thread is named
    # as the process is, and a waker looking for "NCCL Service" found none in 20 aborts.
    monkeypatch.setenv("NCCL_SET_THREAD_NAME", "0")
    with proxywake.ProxyWaker() as waker:
        pass
    assert waker.woken.pokes == {}
    assert waker.woken.errors == [
        "not woken: NCCL_SET_THREAD_NAME=0, under which NCCL names no thread and the waker finds no proxy thread; "
        "set NCCL_SET_THREAD_NAME=1 before the first NCCL communicator (importing torch_peer_watcher does where it "
        "is unset)"
    ]


@needs_proc
@pytest.mark.parametrize("value", ["true", "T", "0x1", "01", " 1"])
def test_the_waker_looks_wherever_some_nccl_names_its_threads(monkeypatch, value):
    # NCCL 2.30.7 reads the variable as a bool (1, T, TRUE: param/parser_default.h), 2.21.5 to 2.28.9 with
    # strtoll(value, NULL, 0) == 1 (debug.cc, misc/param.cc): under each of these values that NCCL names its threads.
    monkeypatch.setenv("NCCL_SET_THREAD_NAME", value)
    comm = MockComm()
    with proxywake.ProxyWaker() as waker:
        took = comm.abort()
    comm.listener.close()
    comm.uds.close()
    assert waker.woken.errors == [] and took < 0.15, f"{took:.3f} s: {waker.woken}"


def test_nccl_names_threads_reads_the_value_as_nccl_does():
    for on in ("1", "true", "TRUE", "t", "0x1", "01", "+1", " 1", "1abc"):
        assert proxywake.nccl_names_threads(on), on
    for off in (None, "", "0", "2", "0x10", "011", "-1", "yes", "false", "0x"):
        assert not proxywake.nccl_names_threads(off), off


def _gpus() -> int:
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


@pytest.mark.gpu
@pytest.mark.skipif(platform.machine() not in proxywake.SYSCALLS, reason="proxy waker: unknown architecture")
def test_on_stock_nccl_the_waker_ends_the_abort_within_0_1_s_and_a_healthy_group_stays_exact(tmp_path):
    if _gpus() < 1:
        pytest.skip("needs an NVIDIA GPU (nvidia-smi lists none)")
    pytest.importorskip("torch")
    out = tmp_path / "out"
    command = [sys.executable, str(ROOT / "benchmarks/nccl_proxy_wake.py"), "--runs", "2", "--out", str(out)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=f"{ROOT}/scripts"))
    assert run.returncode == 0, run.stdout + run.stderr
    summary = (out / "summary.json").read_text()
    arms = json.loads(summary)["arms"]
    assert arms["wake"]["healthy_exact"] == arms["wake"]["runs"] == 2, summary
    assert arms["plain"]["healthy_exact"] == arms["plain"]["runs"] == 2, summary
    assert arms["wake"]["poked_alive"] == arms["plain"]["poked_alive"] == 0, summary
    # Stock NCCL's abort takes 0.5 s without the waker (the plain arm, reported); the channel's NCCL is fast either way.
    assert arms["wake"]["abort_s_median"] < 0.1, summary


FAKE_NCCL = "int ncclGetVersion(int *version) { *version = %d; return 0; }\n"


def _fake_nccl(folder: Path, code: int) -> Path:
    """A libnccl.so.2 whose ncclGetVersion says ``code`` (NCCL_VERSION_CODE), built with the system's C compiler."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "nccl.c").write_text(FAKE_NCCL % code)
    built = subprocess.run(["cc", "-shared", "-fPIC", "-o", str(folder / "libnccl.so.2"), str(folder / "nccl.c")],
                           capture_output=True, text=True)  # fmt: skip
    assert built.returncode == 0, built.stderr
    return folder / "libnccl.so.2"


def _probe(code: str) -> str:
    """What ``python -c code`` printed, with the watcher's package importable; it must exit 0."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "scripts"))
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout


def test_the_loaded_nccl_is_the_library_mapped_even_once_another_is_installed_at_its_path(tmp_path):
    # The release decides whether the waker runs unasked: it must be the NCCL the job runs, not the file an
    # upgrade put at the same path since (the job keeps the one it mapped). No GPU or PyTorch needed.
    if shutil.which("cc") is None:
        pytest.skip("no C compiler (cc) to build a stand-in libnccl")
    lib = _fake_nccl(tmp_path / "lib", 22809)
    newer = _fake_nccl(tmp_path / "newer", 23007)
    other = _fake_nccl(tmp_path / "other", 22105)
    code = (
        "import ctypes, os, sys\n"
        "from torch_peer_watcher import proxywake\n"
        "print('NONE', proxywake.loaded_nccl())\n"
        f"ctypes.CDLL({str(lib)!r})\n"
        f"os.replace({str(newer)!r}, {str(lib)!r})  # the upgrade, under the running process\n"
        "print('LOADED', proxywake.loaded_nccl())\n"
        f"ctypes.CDLL({str(other)!r})  # a second release mapped beside it (one a plugin brought)\n"
        "print('TWO', proxywake.loaded_nccl())\n"
    )
    lines = dict(line.split(" ", 1) for line in _probe(code).splitlines())
    assert lines["NONE"] == "None", "no libnccl mapped: no release"
    assert lines["LOADED"] == "(2, 28, 9)", f"the mapped library's release, not the replacement's: {lines}"
    assert lines["TWO"] == "None", f"two releases mapped: none can be named: {lines}"


def test_the_loaded_nccl_is_read_again_once_the_process_loads_another_library(tmp_path):
    # A second release mapped after a first read (a plugin's, another framework's) makes the release untellable:
    # the waker must not go on running unasked as if only the proven one were mapped (a cached release did).
    # Stand-ins built with cc.
    if shutil.which("cc") is None:
        pytest.skip("no C compiler (cc) to build a stand-in libnccl")
    proven = _fake_nccl(tmp_path / "proven", 22809)
    other = _fake_nccl(tmp_path / "other", 23007)
    code = (
        "import ctypes, os\n"
        "from torch_peer_watcher import proxywake\n"
        f"ctypes.CDLL({str(proven)!r})\n"
        "print('WATCHED', proxywake.loaded_nccl())\n"
        "os.environ['NCCL_SET_THREAD_NAME'] = '1'\n"
        "can = proxywake.unsupported() is None\n"
        "print('DEFAULT', proxywake.by_default() if can else 'unsupported')\n"
        f"ctypes.CDLL({str(other)!r})  # mapped afterwards\n"
        "print('LATER', proxywake.loaded_nccl())\n"
        "print('DEFAULT_LATER', proxywake.by_default() if can else 'unsupported')\n"
    )
    lines = dict(line.split(" ", 1) for line in _probe(code).splitlines())
    assert lines["WATCHED"] == "(2, 28, 9)", lines
    assert lines["LATER"] == "None", f"two releases mapped since the first read: none can be named: {lines}"
    assert lines["DEFAULT"] in ("True", "unsupported"), f"the proven release alone: the waker runs unasked: {lines}"
    assert lines["DEFAULT_LATER"] in ("False", "unsupported"), f"two releases: the waker waits to be asked: {lines}"


def test_the_loaded_nccl_is_found_at_a_path_ending_in_a_space(tmp_path):
    # /proc/self/maps ends a line with the mapped file's path as it is: a name ending in a space is still the
    # library the job runs, and a proven release there must still be named (so that the waker runs unasked).
    if shutil.which("cc") is None:
        pytest.skip("no C compiler (cc) to build a stand-in libnccl")
    built = _fake_nccl(tmp_path / "lib", 22809)
    odd = built.with_name("libnccl.so.2 ")
    built.rename(odd)
    code = (
        "import ctypes\n"
        "from torch_peer_watcher import proxywake\n"
        f"ctypes.CDLL({str(odd)!r})\n"
        "print(proxywake.loaded_nccl())\n"
    )
    shown = _probe(code)
    assert shown.strip() == "(2, 28, 9)", shown


@needs_proc
def test_a_release_whose_waker_cannot_start_still_aborts_the_parent(monkeypatch):
    # At the fd limit the waker's first look (os.listdir("/proc/self/task")) raises EMFILE, and where no thread is
    # left its start raises: the parent must be aborted all the same, the waker's failure recorded.
    from types import SimpleNamespace

    from torch_peer_watcher import groups

    for error in (OSError(24, "Too many open files"), RuntimeError("can't start new thread")):

        def refuse(*args, error=error):
            raise error

        aborted = []

        class Group:
            def abort(self):
                aborted.append(True)

        with monkeypatch.context() as patch:
            if isinstance(error, OSError):
                patch.setattr(proxywake, "task_ids", refuse)
            else:  # only the waker's thread fails to start, not the release's own
                no_thread = type("NoThread", (threading.Thread,), {"start": refuse})
                patch.setattr(proxywake, "threading", SimpleNamespace(Thread=no_thread, Event=threading.Event,
                                                                      get_native_id=threading.get_native_id))  # fmt: skip
            groups.release_in_background(Group(), wake_nccl_proxy=True).join(10)
        assert aborted == [True], f"{error!r}: the parent was never aborted"
        assert any("waking NCCL's proxy threads" in e and str(error) in e for e in groups.wait_for_releases(5))


@needs_proc
def test_a_release_whose_abort_raises_records_the_error_and_what_its_waker_poked():
    from torch_peer_watcher import groups

    class Raising(_MockGroup):
        def abort(self):
            super().abort()
            raise RuntimeError("abort failed")

    group, before = Raising(), set(groups.released_wakes())
    groups.release_in_background(group, wake_nccl_proxy=True).join(10)
    assert group.abort_s is not None and group.abort_s < 0.15, group.abort_s
    assert "RuntimeError: abort failed" in groups.wait_for_releases(5)
    assert not [t for t in threading.enumerate() if t.name == "torch-peer-watcher-proxy-waker"]
    tids = {int(p.split(":")[1].split()[0]) for p in set(groups.released_wakes()) - before}
    assert group.comm.service_tid in tids, groups.released_wakes()


def test_two_releases_poking_one_thread_list_it_once(monkeypatch):
    # Two releases at once run a waker each, and each sees both aborts' joins: one thread poked by both is one entry.
    from contextlib import contextmanager

    from torch_peer_watcher import groups

    @contextmanager
    def poked(_enabled):
        yield proxywake.Woken(pokes={("service", 4242424): 1})

    monkeypatch.setattr(groups, "waking_proxies", poked)

    class Group:
        def abort(self):
            pass

    for _ in range(2):
        groups.release_in_background(Group(), wake_nccl_proxy=True).join(10)
    assert [p for p in groups.released_wakes() if ":4242424 " in p] == ["service:4242424 x2"]


def test_a_nested_aborting_shrinks_leaves_the_outer_scope_aborting(monkeypatch):
    c10d, groups, released = _recorded_releases(monkeypatch)
    with groups.aborting_shrinks(True):
        with groups.aborting_shrinks(False):
            c10d._cleanup_original_group("inner")
        c10d._cleanup_original_group("outer")
    assert released == [("inner", False), ("outer", True)]


@needs_proc
def test_a_waker_that_cannot_start_says_so_and_the_aborts_it_was_to_help_still_run(monkeypatch):
    # Every abort path enters the waker first (abort_all, PeerWatcher.abort, the releases): at the fd limit its first
    # listing of /proc/self/task raises EMFILE, and where no thread is left its start raises. Neither may reach the
    # abort, or a survivor would stay blocked on its dead peer.
    from torch_peer_watcher import groups

    def no_fd_left():
        raise OSError(24, "Too many open files")

    def no_thread_left(self):
        raise RuntimeError("can't start new thread")

    for how, patch in (("no fd", lambda: monkeypatch.setattr(proxywake, "task_ids", no_fd_left)),
                       ("no thread", lambda: monkeypatch.setattr(threading.Thread, "start", no_thread_left))):  # fmt: skip
        patch()
        with proxywake.waking_proxies(True) as woken:
            assert woken is not None
        assert any("could not start" in e for e in woken.errors), (how, woken.errors)
        monkeypatch.undo()
        monkeypatch.setenv("NCCL_SET_THREAD_NAME", "1")
    aborted = []

    class Group:
        def abort(self):
            aborted.append(True)

    monkeypatch.setattr(proxywake, "task_ids", no_fd_left)
    watched = groups.WatchedGroup(group=Group(), name="n", ranks=frozenset({0, 1}), backends=("nccl",), is_default=False)
    monkeypatch.setattr(groups, "abort", lambda w: w.group.abort() or "abort()")
    done = groups.abort_all([watched], wake_nccl_proxy=True)
    assert aborted == [True] and done.woken is not None and any("could not start" in e for e in done.woken.errors)


def test_a_child_forked_while_a_release_holds_its_lock_can_still_end():
    # The releases' lock, held by a release thread at the moment another thread forks, stays held in the child (it
    # has no such thread): the child's exit (atexit wait_for_releases) would wait on it for good.
    from torch_peer_watcher import groups

    with groups._releases_lock:
        pid = os.fork()
        if pid == 0:
            try:
                groups.wait_for_releases(1)
                groups.released_wakes()
            finally:
                os._exit(0)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.02)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    pytest.fail("the forked child hung on the releases' lock")
