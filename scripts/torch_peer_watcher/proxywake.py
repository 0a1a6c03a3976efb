"""Wake the proxy threads of an NCCL communicator that is being aborted, from outside NCCL (issue 74).

Why: on stock NCCL, ``ncclCommAbort`` ends with ``pthread_join`` of the communicator's two proxy threads,
"NCCL Service" and "NCCL UDS Service", and both wait in ``poll()`` with a 500 ms timeout that no abort
interrupts. The service thread sees the abort flag only at the top of its loop: the ``ncclProxyMsgClose``
the abort itself sends wakes it once, it then reads the flag and polls again, for a whole 500 ms, so every
abort took 0.5 s (docs/explain/nccl-abort-wakeup.md has the source lines, per NCCL version).

What is woken, and how it is told apart from everything else in the process:
- only a proxy thread that some thread is joining right now: that thread waits in ``futex(FUTEX_WAIT)`` on
  the proxy thread's id (glibc's ``pthread_join``), read from ``/proc/self/task/*/syscall``, on an address in
  that thread's stack (where glibc keeps its descriptor), and the joined thread's name is NCCL's ("NCCL Service
  NN", "NCCL UDS Service NN"); a proxy thread nobody joins (a healthy communicator's) is never touched;
- the descriptors are the ones that thread is blocked on: the ``pollfd`` array its ``poll()`` was given,
  read from ``/proc/self/mem`` (a read that cannot fault), never a guess among the process's sockets;
- the service thread is poked only when it sleeps in ``poll()`` with no peer connection left (every slot but
  the listening socket's is -1). Joined and in that state, its communicator is being aborted (or revoked):
  an orderly destroy sends ``ncclProxyMsgStop`` before the join, and the thread then leaves as soon as its
  last peer is gone, never sleeping with none. Only then does a stranger's connection end at once (NCCL's
  accept gives up on the abort flag); on a live communicator NCCL 2.28's accept would wait for a valid
  handshake. The poke is a TCP connection to the listening socket's own address, made while this process
  holds a duplicate of that socket, so the port cannot have been handed to another socket meanwhile;
- the UDS thread gets one datagram on its abstract socket (``@tmp/nccl-socket-<rank>-<hash>``), again
  through a held duplicate; a joined UDS thread checks the stop and abort flags before reading anything.

Linux with glibc, on x86_64 and aarch64; elsewhere nothing is done (:func:`unsupported` says why). Each
descriptor is checked again after it was duplicated (the thread still asleep in the same ``poll()``), so a
descriptor number NCCL closed and the process reused is never poked.
"""

from __future__ import annotations

import os
import platform
import re
import socket
import struct
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

# System call numbers, as /proc/<pid>/task/<tid>/syscall shows them: futex, and the calls glibc's poll() makes.
SYSCALLS = {
    "x86_64": {"futex": 202, "poll": (7, 271)},  # poll, ppoll
    "aarch64": {"futex": 98, "poll": (73,)},  # ppoll (aarch64 has no poll)
}
# FUTEX_WAIT and FUTEX_WAIT_BITSET, without FUTEX_PRIVATE_FLAG (128) and FUTEX_CLOCK_REALTIME (256).
FUTEX_WAITS = (0, 9)
FUTEX_CMD_MASK = 0x7F
# Thread names NCCL gives its proxy threads (ncclSetThreadName, "NCCL Service %2d" and "NCCL UDS Service %2d",
# 2.21.5 to 2.30.7), as the kernel keeps them: 15 characters.
SERVICE_NAME = "NCCL Service"
UDS_NAME = "NCCL UDS Servic"
# NCCL_IPC_SOCKNAME_STR "/tmp/nccl-socket-%d-%lx" with its first byte made NUL (Linux's abstract names).
UDS_SOCKET_PREFIX = b"\0tmp/nccl-socket-"
POLLIN = 0x1
POLLFD = struct.Struct("ihh")  # struct pollfd: int fd; short events; short revents
# A service thread's poll() covers its peers' slots and its listening socket: NCCL_MAX_PROXY_CONNECTIONS + 1
# (2.28: at most 2049; 2.30 sizes it by the communicator's ranks). Beyond this, it is not NCCL's array.
MAX_POLLFDS = 1 << 20
# How often the waker looks, how soon it pokes a thread that is still asleep again, and how often at most:
# a poke can land in the same wake as the abort's own ncclProxyMsgClose and be spent before the thread has
# read the flag, so the thread is poked again while it sleeps in the final poll.
LOOK_EVERY_S = 0.002
# A look reads a /proc file per thread it considers (about 12 us of CPU each on a 2-core machine): every look
# considers the threads started since the waker (where an abort's join runs, see ProxyWaker) and this many of the
# older ones, in turn: a look at 4000 threads costs 3 ms of CPU instead of 49 ms, an abort whose joiner is new
# is seen at the next look, one whose joiner is older within a round of the older threads
# (docs/records/2026-12-06-proxy-wake-look-cost-cpu.md).
OLDER_PER_LOOK = 64
POKE_AGAIN_S = 0.01
MAX_POKES = 8
# The NCCL releases the waker was proven on with a GPU: every abort woken at once, the healthy communicator beside
# them exact and never poked (docs/records/2026-12-06-nccl-proxy-wake-one-h100.md: 2.28.9, PyTorch 2.11's wheel,
# runs C, E and F; 2.30.7, PyTorch 2.15's, run G). Where the process loaded one of them, the watcher wakes unless
# TORCH_PEER_WATCHER_WAKE_NCCL_PROXY says 0; elsewhere only where it says 1.
PROVEN_NCCL = ((2, 28, 9), (2, 30, 7))


def unsupported() -> str | None:
    """Why this process cannot wake NCCL's proxy threads, or None if it can."""
    if sys.platform != "linux":
        return f"needs Linux's /proc (this is {sys.platform})"
    if platform.machine() not in SYSCALLS:
        return f"knows the system call numbers of {', '.join(SYSCALLS)} only, not {platform.machine()}"
    if platform.libc_ver()[0] != "glibc":
        return "needs glibc, whose pthread_join waits on the joined thread's id"
    if not os.path.isdir("/proc/self/task"):
        return "/proc is not mounted"
    if not os.path.exists("/proc/self/syscall"):  # a kernel without CONFIG_HAVE_ARCH_TRACEHOOK
        return "this kernel's /proc shows no thread's system call (/proc/<pid>/syscall)"
    return None


# strtoll(value, NULL, 0)'s number, as NCCL 2.21.5 to 2.29 read their integer settings (misc/param.cc).
STRTOLL = re.compile(r"\s*([+-]?)(?:0[xX](?P<hex>[0-9a-fA-F]+)|(?P<oct>0[0-7]*)|(?P<dec>[1-9][0-9]*))")


def nccl_names_threads(value: str | None) -> bool:
    """Whether some NCCL names its threads under ``NCCL_SET_THREAD_NAME=value``: 2.21.5 to 2.29 where
    strtoll(value, NULL, 0) is 1 (debug.cc), 2.30 where it is 1, T or TRUE in any case (a bool setting)."""
    if value is None:
        return False
    if value.upper() in ("T", "TRUE"):
        return True
    number = STRTOLL.match(value)
    if number is None:
        return False
    digits, base = next((number[g], b) for g, b in (("hex", 16), ("oct", 8), ("dec", 10)) if number[g] is not None)
    return number[1] != "-" and int(digits, base) == 1


@dataclass(frozen=True)
class Syscall:
    """What a sleeping thread waits in: the system call's number, its six arguments, the thread's stack pointer."""

    number: int
    args: tuple[int, ...]
    stack_pointer: int = 0


def parse_syscall(text: str) -> Syscall | None:
    """``/proc/<pid>/task/<tid>/syscall``'s line as a :class:`Syscall`; None for a running thread or one outside
    any system call ("running", "-1 sp pc")."""
    fields = text.split()
    if len(fields) < 7 or not fields[0].lstrip("-").isdigit() or int(fields[0]) < 0:
        return None
    stack_pointer = int(fields[7], 16) if len(fields) > 7 else 0
    return Syscall(int(fields[0]), tuple(int(arg, 16) for arg in fields[1:7]), stack_pointer)


def parse_state(stat: str) -> str:
    """The state letter of ``/proc/<pid>/task/<tid>/stat`` (after the name, which may hold spaces and parentheses)."""
    rest = stat[stat.rfind(")") + 1 :].split()
    return rest[0] if rest else "?"


def parse_pollfds(raw: bytes) -> list[tuple[int, int]]:
    """A ``struct pollfd`` array's (fd, events) pairs."""
    return [(fd, events) for fd, events, _ in POLLFD.iter_unpack(raw[: len(raw) - len(raw) % POLLFD.size])]


def service_listener(pollfds: list[tuple[int, int]]) -> int | None:
    """The listening socket's descriptor of a proxy service thread's ``pollfd`` array, if the thread has no peer
    connection left: the last slot is the listening socket (POLLIN), every other slot -1 (NCCL's free slot).
    None otherwise (a peer still connected, or not NCCL's layout)."""
    if len(pollfds) < 2:
        return None
    listen_fd, events = pollfds[-1]
    if listen_fd < 0 or not events & POLLIN or any(fd >= 0 for fd, _ in pollfds[:-1]):
        return None
    return listen_fd


def uds_socket(pollfds: list[tuple[int, int]]) -> int | None:
    """The descriptor a proxy UDS thread polls: its ``pollfd`` array has exactly one slot."""
    return pollfds[0][0] if len(pollfds) == 1 and pollfds[0][0] >= 0 else None


def _read(path: str) -> str | None:
    # os.open/os.read, not open(): a look reads a file per thread of the process, and Python's file objects
    # doubled its cost (benchmarks/proxy_wake_mock.py --threads; docs/records/2026-12-06-proxy-wake-look-cost-cpu.md).
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # the thread ended
        return None
    try:
        return os.read(fd, 4096).decode(errors="replace")  # /proc's syscall, comm and stat lines are shorter
    except OSError:
        return None
    finally:
        os.close(fd)


def task_syscall(tid: int) -> Syscall | None:
    """What thread ``tid`` of this process sleeps in, or None (running, outside a system call, or gone)."""
    text = _read(f"/proc/self/task/{tid}/syscall")
    return parse_syscall(text) if text else None


def task_name(tid: int) -> str:
    """Thread ``tid``'s name ('' if gone)."""
    return (_read(f"/proc/self/task/{tid}/comm") or "").rstrip("\n")


def task_state(tid: int) -> str:
    """Thread ``tid``'s state letter ('S' asleep; '?' if gone)."""
    stat = _read(f"/proc/self/task/{tid}/stat")
    return parse_state(stat) if stat else "?"


def read_memory(address: int, size: int) -> bytes | None:
    """``size`` bytes of this process's memory at ``address``, or None where they are not mapped (no fault)."""
    try:
        fd = os.open("/proc/self/mem", os.O_RDONLY)
    except OSError:
        return None
    try:
        data = os.pread(fd, size, address)
    except (OSError, OverflowError):
        return None
    finally:
        os.close(fd)
    return data if len(data) == size else None


@dataclass(frozen=True)
class JoinedProxy:
    """An NCCL proxy thread that another thread is joining."""

    tid: int
    kind: str  # "service" or "uds"
    joined_by: int
    # What the joiner waits on: glibc's pthread_join waits on the joined thread's descriptor (struct pthread),
    # which glibc keeps at the top of that thread's own stack.
    futex_address: int = 0


def task_ids() -> list[int]:
    """The ids of this process's threads."""
    return [int(name) for name in os.listdir("/proc/self/task")]


def joined_proxies(among: Iterable[int] | None = None) -> list[JoinedProxy]:
    """The NCCL proxy threads some thread of this process (or of ``among``) is joining now (``pthread_join``: a
    futex wait whose expected value is the joined thread's id)."""
    numbers = SYSCALLS[platform.machine()]
    found = []
    for joiner in task_ids() if among is None else among:
        call = task_syscall(joiner)
        if call is None or call.number != numbers["futex"] or call.args[1] & FUTEX_CMD_MASK not in FUTEX_WAITS:
            continue
        tid = call.args[2]
        if tid == joiner or not 0 < tid <= 1 << 22:  # pid_max is at most 2**22
            continue
        thread = task_name(tid)
        kind = "service" if thread.startswith(SERVICE_NAME) else "uds" if thread.startswith(UDS_NAME) else None
        if kind is not None:
            found.append(JoinedProxy(tid, kind, joiner, call.args[0]))
    return found


def same_mapping(first: int, second: int) -> bool:
    """True if both addresses lie in one mapping of this process (``/proc/self/maps``)."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                start, _, end = line.partition(" ")[0].partition("-")
                low, high = int(start, 16), int(end, 16)
                if low <= first < high:
                    return low <= second < high
    except (OSError, ValueError):
        return False
    return False


def sleeping_poll(tid: int) -> tuple[Syscall, list[tuple[int, int]]] | None:
    """The ``poll()`` thread ``tid`` sleeps in and the (fd, events) it was given, or None."""
    if task_state(tid) != "S":
        return None
    call = task_syscall(tid)
    if call is None or call.number not in SYSCALLS[platform.machine()]["poll"]:
        return None
    address, count = call.args[0], call.args[1]
    if not 0 < count <= MAX_POLLFDS:
        return None
    raw = read_memory(address, count * POLLFD.size)
    return None if raw is None else (call, parse_pollfds(raw))


@dataclass
class Woken:
    """What a :class:`ProxyWaker` did: pokes per (kind, thread id), and what it could not do."""

    pokes: dict[tuple[str, int], int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)


class ProxyWaker:
    """While active, wakes the NCCL proxy threads that an abort is joining (see the module's docstring).

    Use it around the abort: ``with ProxyWaker(): group.abort()``. One thread looks every
    ``LOOK_EVERY_S``; :attr:`woken` says what it did. Does nothing where :func:`unsupported` says so.
    Every look considers the thread that entered the block and the threads started since, which is where an
    abort's join runs (``abort_all``'s threads, PyTorch 2.11's ``std::async`` around ``abortComms``, NCCL
    2.21's thread per job); a join in an older thread (PyTorch's watchdog aborting on its own) is found by the
    looks' rounds over the older threads (``OLDER_PER_LOOK`` a look).
    """

    def __init__(self) -> None:
        self.woken = Woken()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # Duplicates of the sockets poked and the connections made: closed when the waker stops, so that a
        # socket NCCL closes meanwhile keeps its address (nothing else can take its port or name).
        self._held: list[socket.socket] = []
        self._last_poke: dict[tuple[str, int], float] = {}
        self._joins: dict[tuple[int, int], bool] = {}
        self._older: list[int] = []

    def __enter__(self) -> ProxyWaker:
        why = unsupported()
        names = os.environ.get("NCCL_SET_THREAD_NAME")
        if why is None and not nccl_names_threads(names):
            # Seen on one H100 (NCCL 2.28.9): without it every NCCL thread is named as the process is.
            shown = "NCCL_SET_THREAD_NAME unset" if names is None else f"NCCL_SET_THREAD_NAME={names}"
            why = (f"{shown}, under which NCCL names no thread and the waker finds no proxy thread; "
                   "set NCCL_SET_THREAD_NAME=1 before the first NCCL communicator (importing torch_peer_watcher "
                   "does where it is unset)")  # fmt: skip
        if why is not None:
            self.woken.errors.append(f"not woken: {why}")
            return self
        try:
            self._older = sorted(set(task_ids()) - {threading.get_native_id()})
            thread = threading.Thread(target=self._run, name="torch-peer-watcher-proxy-waker", daemon=True)
            thread.start()
        except Exception as exc:  # no fd or thread left: said, and the abort it was to help runs as it would without
            self.woken.errors.append(f"not woken: the waker could not start: {type(exc).__name__}: {exc}")
            return self
        self._thread = thread
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        for held in self._held:
            held.close()
        self._held.clear()

    def _run(self) -> None:
        # A developer's trace of what the waker sees (every thread's name, state and system call at each look):
        # TORCH_PEER_WATCHER_WAKE_TRACE=PATH appends to PATH.<pid>.
        trace_path = os.environ.get("TORCH_PEER_WATCHER_WAKE_TRACE")
        trace = open(f"{trace_path}.{os.getpid()}", "a") if trace_path else None  # noqa: SIM115
        older, turn = set(self._older), 0
        while not self._stop.is_set():
            try:
                if trace is not None:
                    for name in os.listdir("/proc/self/task"):
                        tid = int(name)
                        print(f"{time.monotonic():.4f} {tid} {task_name(tid)!r} {task_state(tid)} "
                              f"{(_read(f'/proc/self/task/{tid}/syscall') or '').strip()}", file=trace)  # fmt: skip
                    trace.flush()
                among = [tid for tid in task_ids() if tid not in older] + self._older[turn : turn + OLDER_PER_LOOK]
                turn = turn + OLDER_PER_LOOK if turn + OLDER_PER_LOOK < len(self._older) else 0
                for proxy in joined_proxies(among):
                    self._wake(proxy)
            except Exception as exc:  # recorded, never raised into the abort it helps
                self.woken.errors.append(f"{type(exc).__name__}: {exc}")
                return
            self._stop.wait(LOOK_EVERY_S)

    def _wake(self, proxy: JoinedProxy) -> None:
        key = (proxy.kind, proxy.tid)
        count = self.woken.pokes.get(key, 0)
        if count >= MAX_POKES or time.monotonic() - self._last_poke.get(key, -1e9) < POKE_AGAIN_S:
            return
        asleep = sleeping_poll(proxy.tid)
        if asleep is None:
            return
        call, pollfds = asleep
        # The joiner waits on this thread's own descriptor: the join is of this thread, not a futex that happens
        # to hold the same number.
        pair = (proxy.joined_by, proxy.tid)
        if pair not in self._joins:
            self._joins[pair] = same_mapping(proxy.futex_address, call.stack_pointer)
        if not self._joins[pair]:
            return
        fd = service_listener(pollfds) if proxy.kind == "service" else uds_socket(pollfds)
        if fd is None:
            return
        try:
            duplicate = os.dup(fd)
        except OSError:  # closed meanwhile
            return
        try:
            held = socket.socket(fileno=duplicate)
        except OSError:  # no socket: not NCCL's
            os.close(duplicate)
            return
        # Still asleep in the same poll(): the descriptor was NCCL's when it was duplicated (the thread closes
        # its sockets only after leaving its loop, and never polls again after that).
        again = sleeping_poll(proxy.tid)
        if again is None or again[0] != call or again[1] != pollfds:
            held.close()
            return
        try:
            poked = self._poke_service(held) if proxy.kind == "service" else self._poke_uds(held)
        except OSError as exc:
            poked = False
            self.woken.errors.append(f"{proxy.kind} thread {proxy.tid}: {exc.strerror or exc}")
        if not poked:
            held.close()
            return
        self._held.append(held)
        self.woken.pokes[key] = count + 1
        self._last_poke[key] = time.monotonic()

    def _poke_service(self, listener: socket.socket) -> bool:
        """Connect to ``listener``'s address, if it is a listening TCP socket no other socket can share."""
        if listener.type != socket.SOCK_STREAM or listener.family not in (socket.AF_INET, socket.AF_INET6):
            return False
        if not listener.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            return False
        if listener.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT):  # another socket may hold the port too
            return False
        client = socket.socket(listener.family, socket.SOCK_STREAM)
        client.setblocking(False)
        client.connect_ex(listener.getsockname())
        self._held.append(client)
        return True

    def _poke_uds(self, uds: socket.socket) -> bool:
        """Send one datagram to ``uds``'s abstract name, if it is NCCL's UDS socket."""
        if uds.family != socket.AF_UNIX or uds.type != socket.SOCK_DGRAM:
            return False
        name = uds.getsockname()
        if not isinstance(name, bytes) or not name.startswith(UDS_SOCKET_PREFIX):
            return False
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as client:
            client.setblocking(False)
            client.sendto(b"\0", name)
        return True


def loaded_nccl() -> tuple[int, int, int] | None:
    """The release of the libnccl this process has mapped, asked through its ``ncclGetVersion``; None where no
    libnccl is mapped (NCCL linked into libtorch, or not loaded yet), one does not answer, or two releases are
    mapped (which one a communicator runs cannot be told). Read anew at each call, about 1 ms in a process that
    imported PyTorch's CUDA build: a cache would miss a second NCCL mapped since, and a check of the dynamic
    loader's counts (``dl_iterate_phdr``) calls back into Python under the loader's lock, which an import that
    holds the GIL in ``dlopen`` can wait on (a deadlock on the abort's path)."""
    try:
        with open("/proc/self/maps") as maps:
            lines = maps.read().splitlines()
    except OSError:
        return None
    fields = (line.split(maxsplit=5) for line in lines)
    # A file replaced or removed since it was mapped shows as "PATH (deleted)"; the path is kept as it is (a name
    # may end in a space).
    paths = {f[5].removesuffix(" (deleted)") for f in fields if len(f) == 6}
    releases = {_release_of(p) for p in paths if os.path.basename(p).startswith("libnccl.so")}
    if len(releases) != 1 or None in releases:
        return None
    return releases.pop()


def _release_of(path: str) -> tuple[int, int, int] | None:
    try:
        import ctypes

        # RTLD_NOLOAD: the library already loaded under that name, never the file now at the path (a newer NCCL
        # installed under the running job would answer for one it does not run).
        lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        code = ctypes.c_int(0)
        if lib.ncclGetVersion(ctypes.byref(code)) != 0:
            return None
    except (OSError, AttributeError):
        return None
    value = code.value  # NCCL_VERSION_CODE: X*10000+Y*100+Z from 2.9 on
    return (value // 10000, value % 10000 // 100, value % 100)


def by_default() -> bool:
    """Whether the waker runs with its setting unset: where this process can wake (:func:`unsupported`), NCCL
    names its threads (``NCCL_SET_THREAD_NAME``, which importing the watcher sets to 1 where unset) and the
    loaded NCCL is one of :data:`PROVEN_NCCL`."""
    return (unsupported() is None and nccl_names_threads(os.environ.get("NCCL_SET_THREAD_NAME"))
            and loaded_nccl() in PROVEN_NCCL)  # fmt: skip


@contextmanager
def waking_proxies(enabled: bool | None) -> Iterator[Woken | None]:
    """A :class:`ProxyWaker` around the block when ``enabled`` (None: :func:`by_default`); yields what it did
    (None when it did not run)."""
    if enabled is None:
        enabled = by_default()
    if not enabled:
        yield None
        return
    with ProxyWaker() as waker:
        yield waker.woken
