"""Ranks and workers forked from one interpreter that imported torch once.

Every rank that ``--nproc`` starts and every worker of the fault and peer-loss checks runs
``python -m MODULE ARGS``, and each such interpreter would import torch again: 1.0-1.6 s of CPU
apiece (more with the CUDA build), and on a shared file system one more storm of metadata reads.
Here they are forked instead from a server process that imported torch and torch.distributed once
and touched no device (CUDA is initialized only in the children). A child takes the environment,
working directory and standard output and error of the request, runs the module as ``__main__``
with the request's arguments, runs its exit handlers and exits with the status the command would
have had; a signal that kills it shows as the same negative return code.

The same serves a script or a string of code (``sys.executable PATH`` or ``-c CODE``: the peer
watcher's test jobs). A forked child is the interpreter its request would start, or it is not forked:
it takes the requester's resource limits, CPU affinity, nice value, umask, signal mask and ignored
signals (:func:`process_state`); runs its command in a fresh ``__main__`` with runpy's frames as
``python -m`` has them; and ends as an interpreter ends (``sys.excepthook`` for an uncaught exception,
threading's shutdown, the exit handlers, the standard streams and the files left open flushed, an
uncaught ^C by SIGINT). A request gets its own interpreter instead (:func:`start`'s fallback,
``subprocess.Popen``) when ``TORCH_DIST_CHECK_FORK=0``, when its command is none of these (a namespace
node's ``nsenter`` line), when PYTHONHASHSEED is not a fixed number (each interpreter draws its own
string-hash seed, a forked child would share its server's) or PYTHONSAFEPATH is set
(:func:`forkable_env`), and when its environment differs from the one the server started with in any
variable but those read after an interpreter's start (:data:`LATE_NAMES`, :data:`LATE_PREFIXES`: the rank
and rendezvous, NCCL's, PyTorch's NCCL and gloo settings, the suite's and the watcher's own), except a
PYTHONPATH that only adds absolute folders to the server's (:func:`shares`); such a request gets a server of
its own, started with its environment, where there is room for one. A forked child whose path holds a module
an interpreter of its own would import differently (a site hook in an added folder or zip, a module named
like one the server imported from elsewhere or looked for in vain, in an added folder or the one its
``sys.path[0]`` will be) execs an interpreter in place instead (harness/forkchild.py). The server ends when
the process that started it exits (:func:`close_all`, which waits for it: its CPU and that of the children
it waited for count as that process's children's); children it forked run on to their own end, as exec'd
ones would. A child whose server was killed from outside has an unknown exit status (``status_unknown``). In
``ps`` a forked child shows the server's command line.

A process that already imported torch and started nothing yet (rank 0 of the suite as it starts,
before the fault and peer-loss checks fork their workers) makes its server by forking itself
(:func:`prefork`): no interpreter and no torch import more.
"""

from __future__ import annotations

import atexit
import io
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import weakref
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from torch_dist_check.harness import forkchild, startup

# "0" (or "no", "off", "false"): every rank and worker starts its own interpreter, as before.
FORK_ENV = "TORCH_DIST_CHECK_FORK"
# What the server imports before it forks anything.
PRELOAD = ("torch", "torch.distributed")
# The variables a forked child may have otherwise than the environment its server started with. Each is
# read, where it is read at all, after an interpreter started and imported PRELOAD (by the rendezvous, by
# a group as it is made, by CUDA's initialization, which the server never does, or by the suite's and the
# peer watcher's own code as it runs), so the child's own value is the one read, as in an interpreter of
# its own: tests/test_dist_check_forkserver.py records every variable the server's start reads (C's
# getenv and Python's os.environ) and finds none of these among them. Every other variable may be read
# at the start (torch alone reads some hundred there: TORCH_DISTRIBUTED_DEBUG, PYTORCH_JIT, OpenMP's,
# the C library's), so a request that differs from its server in any other gets an interpreter.
LATE_NAMES = frozenset({
    # The rank and the rendezvous (torch.distributed's env:// and the suite's own launch discovery).
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    # Read by CUDA as it initializes, which happens in the child only.
    "CUDA_VISIBLE_DEVICES",
    # Read by torch when it first asks for its compile cache (torch._inductor, which PRELOAD does not import).
    "TORCHINDUCTOR_CACHE_DIR",
    # pytest's name of the test that runs (a new value for every test of a test process).
    "PYTEST_CURRENT_TEST",
})  # fmt: skip
# Families read as a group or a communicator is made (NCCL's, PyTorch's NCCL and gloo settings), and the
# suite's and the peer watcher's settings, read by their code as it runs; TORCH_PEER_WATCHER itself (the
# auto-start switch its .pth reads as the interpreter starts) is not among them.
LATE_PREFIXES = ("NCCL_", "TORCH_NCCL_", "GLOO_", "TORCH_DIST_CHECK_", "TORCH_PEER_WATCHER_")
_OFF = frozenset({"0", "no", "off", "false"})
# PYTHONHASHSEED's largest value (an interpreter refuses more).
_MAX_HASH_SEED = 4294967295

# What a stream of :func:`start` may be: None, subprocess.PIPE / DEVNULL / STDOUT, a descriptor or a file.
Stream = Any


def enabled(env: Mapping[str, str] | None = None) -> bool:
    """False when ``TORCH_DIST_CHECK_FORK`` turns forking off."""
    env = os.environ if env is None else env
    return env.get(FORK_ENV, "1").strip().lower() not in _OFF


def read_late(name: str) -> bool:
    """Whether ``name`` is one of the variables read only after an interpreter's start (LATE_NAMES, LATE_PREFIXES)."""
    return name in LATE_NAMES or name.startswith(LATE_PREFIXES)


def startup_vars(env: Mapping[str, str]) -> dict[str, str]:
    """The variables of ``env`` an interpreter may read as it starts: all but :func:`read_late`'s (a peer
    watcher switched off counts as unset: its .pth does nothing then)."""
    picked = {name: value for name, value in env.items() if not read_late(name)}
    if picked.get("TORCH_PEER_WATCHER", "").strip() in ("", "0"):
        picked.pop("TORCH_PEER_WATCHER", None)
    return picked


def forkable_env(env: Mapping[str, str]) -> bool:
    """Whether ``env`` lets a forked child be its interpreter: it gives every interpreter the same string-hash
    seed (PYTHONHASHSEED a number; else each draws its own, and a forked child would share its server's and so
    its siblings': the same set order in every rank, which no launcher gives), and sets no PYTHONSAFEPATH (its
    interpreter puts no folder of its own first on its path, which a child here does)."""
    seed = env.get("PYTHONHASHSEED", "")
    return seed.isdigit() and int(seed) <= _MAX_HASH_SEED and not env.get("PYTHONSAFEPATH")


def _key(env: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """The key of ``env``'s server among this process's: its start-up variables."""
    return tuple(sorted(startup_vars(env).items()))


def shares(server: Mapping[str, str], request: Mapping[str, str]) -> bool:
    """Whether a server started with the start-up variables ``server`` can fork a request with ``request``'s:
    the same, or the same but for a PYTHONPATH that keeps the server's folders in their order and adds
    others (before, between or after them; every one of both an absolute path). The child puts the added
    folders on its path where the request has them; one that holds a module by the name of one the
    server imported from elsewhere, or a ``sitecustomize``, makes the child an interpreter of its own
    (harness/forkchild.py): a test's PYTHONPATH that only adds a folder of its own costs no interpreter
    and no torch import of its own (1.2-1.9 s of CPU with PyPI's CUDA build)."""
    if server == request:
        return True
    ours, theirs = dict(server), dict(request)
    kept, wanted = ours.pop("PYTHONPATH", ""), theirs.pop("PYTHONPATH", "")
    if ours != theirs:
        return False
    kept_entries, wanted_entries = kept.split(os.pathsep) if kept else [], wanted.split(os.pathsep)
    if not all(os.path.isabs(entry) for entry in (*kept_entries, *wanted_entries)):
        return False
    remaining = iter(wanted_entries)
    return all(entry in remaining for entry in kept_entries)  # a sub-list, in order


def process_state() -> dict[str, Any]:
    """What a process started from this thread inherits besides its environment: resource limits, CPU
    affinity, nice value, umask, signal mask and the signals ignored. A forked child takes the requester's."""
    limits = {}
    for name in dir(resource):
        if name.startswith("RLIMIT_"):
            try:
                limits[name] = list(resource.getrlimit(getattr(resource, name)))
            except (OSError, ValueError):
                pass
    return {
        "limits": limits,
        "affinity": sorted(os.sched_getaffinity(0)),
        "nice": os.getpriority(os.PRIO_PROCESS, 0),
        "umask": _umask(),
        "mask": sorted(int(number) for number in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
        "ignored": _ignored_signals(),
    }


def _umask() -> int:
    """This process's umask, read without changing it (Linux 4.7 and later show it in /proc)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _ignored_signals() -> list[int]:
    """The signals this process ignores (an exec'd child keeps them ignored)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("SigIgn:"):
                bits = int(line.split()[1], 16)
                return [number for number in range(1, signal.NSIG) if bits >> (number - 1) & 1]
    except (OSError, ValueError, IndexError):
        pass
    return [number for number in range(1, signal.NSIG) if _getsignal(number) is signal.SIG_IGN]


def _getsignal(number: int) -> Any:
    try:
        return signal.getsignal(number)
    except (OSError, ValueError):
        return None


def _can_take(server: Mapping[str, Any], request: Mapping[str, Any]) -> bool:
    """Whether a child of a server whose process had ``server``'s state can take ``request``'s: without
    privilege no hard limit can be raised and no nice value lowered."""
    if os.geteuid() == 0:
        return True
    if request["nice"] < server["nice"]:
        return False
    return all(_not_above(hard, server["limits"].get(name, [0, resource.RLIM_INFINITY])[1])
               for name, (_soft, hard) in request["limits"].items())  # fmt: skip


def _not_above(value: int, bound: int) -> bool:
    if bound == resource.RLIM_INFINITY:
        return True
    return value != resource.RLIM_INFINITY and value <= bound


def command_of(argv: Sequence[str]) -> tuple[str, str, list[str]] | None:
    """(how, what, arguments) when ``argv`` is ``sys.executable`` running a module (``-m NAME``), a string
    of code (``-c CODE``) or a script (``PATH``), as (``"module"``, ``"code"``, ``"path"``); else None."""
    if len(argv) < 2 or argv[0] != sys.executable:
        return None
    if argv[1] in ("-m", "-c") and len(argv) >= 3:
        return ("module" if argv[1] == "-m" else "code"), argv[2], list(argv[3:])
    if not argv[1].startswith("-") and os.path.isfile(argv[1]) and not zipfile.is_zipfile(argv[1]):
        return "path", os.path.abspath(argv[1]), list(argv[2:])
    return None


# --- the client side: what the launcher and the checks hold.


# Why a forked child's status is unknown: its server, which alone could wait for it, is gone.
LOST_SERVER = ("its exit status is unknown: the fork server that started it ended before it reported the "
               "child's end (killed from outside?), and only that server could wait for it")  # fmt: skip
# The return code such a child is given (Popen's callers need a number): an exit status no interpreter
# gives on its own, never a signal's; ``status_unknown`` says why.
UNKNOWN_STATUS = 255


class ForkedProcess:
    """The part of ``subprocess.Popen`` the harness uses, for a child of the fork server.

    ``status_unknown`` is None, or why the child's exit status cannot be known (:data:`LOST_SERVER`); its
    ``returncode`` is then :data:`UNKNOWN_STATUS`."""

    def __init__(self, server: ForkServer, pid: int, stdin: IO[Any] | None, stdout: IO[Any] | None,
                 stderr: IO[Any] | None) -> None:  # fmt: skip
        self.pid = pid
        self.stdin = stdin
        self.stdout = stdout
        self.stderr = stderr
        self.returncode: int | None = None
        self.status_unknown: str | None = None
        self._server = server
        self._ended = threading.Event()

    def _end(self, code: int) -> None:
        self.returncode = code
        self._ended.set()

    def poll(self) -> int | None:
        if not self._ended.is_set() and self._server.lost and not _exists(self.pid):
            # The server was killed (it ignores ^C and SIGTERM), and the child has ended since: how is lost,
            # and no status is made up for it (a signal that did not happen, a verdict it did not give).
            self.status_unknown = LOST_SERVER
            self._end(UNKNOWN_STATUS)
        return self.returncode if self._ended.is_set() else None

    def wait(self, timeout: float | None = None) -> int:
        # In steps, so that a server killed from outside (no report will come) is noticed too.
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired([str(self.pid)], timeout or 0.0)
            self._ended.wait(0.1 if left is None else min(0.1, left))
        assert self.returncode is not None
        return self.returncode

    def communicate(self, input: Any = None, timeout: float | None = None) -> tuple[Any, Any]:  # noqa: A002
        """Popen.communicate: write ``input``, read both pipes to their end, wait; (stdout, stderr)."""
        if self.stdin is not None:
            if input:
                self.stdin.write(input)
            self.stdin.close()
        got: dict[str, Any] = {}
        readers = [threading.Thread(target=lambda n=name, f=f: got.__setitem__(n, f.read()), daemon=True)
                   for name, f in (("out", self.stdout), ("err", self.stderr)) if f is not None]  # fmt: skip
        for reader in readers:
            reader.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        for reader in readers:
            reader.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if reader.is_alive():
                raise subprocess.TimeoutExpired([str(self.pid)], timeout or 0.0)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return got.get("out"), got.get("err")

    def send_signal(self, sig: int) -> None:
        # Only while the server has not reported it ended (Popen's own guard against a reused pid).
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


def _exists(pid: int) -> bool:
    """True while ``pid`` runs (a zombie that nobody reaps has ended)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


class ForkServer:
    """A server process that imported :data:`PRELOAD` with ``env``'s start-up variables, and the thread
    that reads its replies. :func:`start` keeps one per process; a test may hold its own."""

    def __init__(self, env: Mapping[str, str], preload: Sequence[str] | None = None, here: bool = False) -> None:
        """``here``: the server is this process, forked (:func:`prefork` says when that is as good as a new
        interpreter); else a new interpreter that imports ``preload``."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.startup = startup_vars(env)
        # The server's process starts with this thread's limits, nice value and the rest (fork and exec keep them).
        self.state = process_state()
        self.proc: subprocess.Popen[bytes] | _ForkedServer
        if here:
            self.proc = _ForkedServer(_fork_server_here(theirs, ours))
        else:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "torch_dist_check.harness.forkserver", str(theirs.fileno()),
                 ",".join(PRELOAD if preload is None else preload)],
                env=dict(env), stdin=subprocess.DEVNULL, pass_fds=[theirs.fileno()],
            )  # fmt: skip
        theirs.close()
        self.sock = ours
        self.lost = False
        self._lock = threading.Lock()
        self._pid_reply: list[int] = []
        self._replied = threading.Condition()
        self._children: dict[int, ForkedProcess] = {}
        self._early: dict[int, int] = {}
        self.used = time.monotonic()
        self._reader = threading.Thread(target=self._read, name="torch_dist_check-forkserver", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                got = forkchild.recv(self.sock)
            except OSError:
                got = None
            if got is None:
                break
            message, _ = got
            with self._replied:
                if "pid" in message:
                    self._pid_reply.append(int(message["pid"]))
                    self._replied.notify_all()
                elif "exited" in message:
                    pid, code = int(message["exited"]), int(message["code"])
                    child = self._children.pop(pid, None)
                    if child is None:
                        self._early[pid] = code
                    else:
                        child._end(code)
        with self._replied:
            self.lost = True
            self._replied.notify_all()

    def busy(self) -> bool:
        """True while a child it forked has not been reported ended."""
        with self._replied:
            return bool(self._children)

    def takes(self, argv: Sequence[str], env: Mapping[str, str], state: Mapping[str, Any] | None = None) -> bool:
        """True when this server can fork ``argv`` with ``env`` (and this thread's :func:`process_state`, or
        ``state``) as an interpreter of its own would start it: a command it can run, an environment that
        differs from the server's in late-read variables alone (:func:`shares`), a fixed string-hash seed and
        no PYTHONSAFEPATH (:func:`forkable_env`), and limits and a nice value the child may take."""
        if self.lost or command_of(argv) is None or not forkable_env(env):
            return False
        return shares(self.startup, startup_vars(env)) and _can_take(self.state, state or process_state())

    def start(self, argv: Sequence[str], env: Mapping[str, str], *, stdin: Stream = None, stdout: Stream = None,
              stderr: Stream = None, text: bool = False, start_new_session: bool = False, netns: int | None = None,
              fallback: Sequence[str] | None = None, cwd: str | os.PathLike[str] | None = None,
              ) -> subprocess.Popen[Any] | ForkedProcess:  # fmt: skip
        """As the module's :func:`start`, with this server (forking on or off as :meth:`takes` says)."""
        state = process_state()
        if not self.takes(argv, env, state):
            return _own_process(fallback or argv, env, stdin, stdout, stderr, text, start_new_session, cwd)
        target = command_of(argv)
        assert target is not None  # takes() said so
        opened: list[int] = []
        try:
            in_fd, in_file = _child_end(stdin, 0, text, opened, writes=False)
            out_fd, out_file = _child_end(stdout, 1, text, opened)
            if stderr == subprocess.STDOUT:
                err_fd, err_file = out_fd, None
            else:
                err_fd, err_file = _child_end(stderr, 2, text, opened)
            how, what, args = target
            request = {"how": how, "what": what, "args": args, "env": dict(env), "cwd": os.path.abspath(cwd or os.getcwd()),
                       "netns": netns, "new_session": start_new_session, "state": state}  # fmt: skip
            return self._fork(request, [in_fd, out_fd, err_fd], in_file, out_file, err_file)
        finally:
            for fd in opened:
                os.close(fd)

    def _fork(self, request: dict[str, Any], fds: list[int], stdin: IO[Any] | None, stdout: IO[Any] | None,
              stderr: IO[Any] | None) -> ForkedProcess:  # fmt: skip
        self.used = time.monotonic()
        with self._lock:
            with self._replied:
                self._pid_reply.clear()
            forkchild.send(self.sock, request, fds)
            with self._replied:
                while not self._pid_reply and not self.lost:
                    self._replied.wait(1.0)
                if not self._pid_reply:
                    raise OSError("the fork server ended before it started the process")
                pid = self._pid_reply.pop()
                child = ForkedProcess(self, pid, stdin, stdout, stderr)
                if pid in self._early:
                    child._end(self._early.pop(pid))
                else:
                    self._children[pid] = child
        return child

    def close(self) -> None:
        """End the server (its children run on) and wait for it."""
        try:
            # shutdown, not close alone: the reader thread is inside recvmsg on this socket.
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._reader.join(timeout=5)
        self.sock.close()
        self.proc.wait(timeout=30)


class _ForkedServer:
    """The part of ``subprocess.Popen`` a :class:`ForkServer` uses, for a server forked from this process."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            done, status = os.waitpid(self.pid, os.WNOHANG)
            if done:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"fork server {self.pid}", timeout or 0.0)
            time.sleep(0.01)
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            os.kill(self.pid, signal.SIGKILL)


def _fork_server_here(theirs: socket.socket, ours: socket.socket) -> int:
    """Fork this process into a server on ``theirs``; the server's pid."""
    for stream in (sys.stdout, sys.stderr):
        # What this process has buffered must not be written again by a child that replaces the stream.
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
    pid = os.fork()
    if pid:
        return pid
    code = 0
    try:
        ours.close()
        # The servers this process holds are not the server's (nor their lock, which prefork holds now).
        global _server_lock
        _server_lock = threading.Lock()
        _servers.clear()
        # As a new interpreter would start: no handler of this process's in Python, stdin empty, and no
        # descriptor of this process's but the standard streams and the socket (a pipe held open here
        # would keep its reader waiting for an end of file).
        for number in range(1, signal.NSIG):
            try:
                handler = signal.getsignal(number)
                if callable(handler) and handler is not signal.default_int_handler:
                    signal.signal(number, signal.SIG_DFL)
            except (OSError, ValueError):
                pass
        # Objects of this process that clean up at its exit (a TemporaryDirectory's weakref.finalize) are
        # not the server's nor its children's to clean up.
        for finalizer in list(getattr(weakref.finalize, "_registry", {})):
            finalizer.atexit = False
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        keep = theirs.fileno()
        os.closerange(3, keep)
        os.closerange(keep + 1, _max_fd())
        forkchild.serve(theirs)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        os._exit(code)


def _max_fd() -> int:
    try:
        return max(int(name) for name in os.listdir("/proc/self/fd")) + 1
    except (OSError, ValueError):
        return os.sysconf("SC_OPEN_MAX")


# One server per set of start-up variables (a rank's workers share one; a test process may need more), at
# most MAX_SERVERS at once: the one used least recently that has no child left makes room for a new one.
MAX_SERVERS = 4
_servers: dict[tuple[tuple[str, str], ...], ForkServer] = {}
_server_lock = threading.Lock()


def _room_for_one() -> bool:
    """Whether one more server may start, after the dead ones are forgotten and, where MAX_SERVERS run,
    the one used least recently that has no child left is ended. Called with _server_lock held."""
    for key, server in list(_servers.items()):
        if server.lost:
            del _servers[key]
    if len(_servers) < MAX_SERVERS:
        return True
    idle = [key for key, server in _servers.items() if not server.busy()]
    if not idle:
        return False
    _servers.pop(min(idle, key=lambda key: _servers[key].used)).close()
    return True


def prefork(env: Mapping[str, str] | None = None) -> bool:
    """Make this process's fork server for ``env`` (default: this process's environment) a fork of this
    process, now; True where the server is there (made now or before).

    Call it where this process has imported :data:`PRELOAD` and started no thread and no group of its
    own (the check's workers then cost no torch import of their own: the server that :func:`start`
    would make otherwise is a new interpreter that imports torch again). The server is then this
    process as it is at the call: the modules it imported so far stay imported in every child,
    as torch and torch.distributed are in a new server, and so do the exit handlers it registered so
    far (none in the suite before its ranks start; torch's own, as in a new server). Its
    ``weakref.finalize`` objects (a temporary directory's clean-up) stay this process's alone.
    False, and nothing done, where forking is off, where the string-hash seed is not fixed or PYTHONSAFEPATH
    is set (nothing would fork: :func:`forkable_env`), where a preloaded module is not imported, where another Python thread
    runs, or where ``env``'s start-up variables are not this interpreter's. Not for a process that imported
    a user's module (the suite's ``--import``): the server closes the descriptors it inherits, and a module
    that holds one (a log file) would hand its number to whatever a child opens next.
    """
    env = os.environ if env is None else env
    if not enabled(env) or not forkable_env(env) or startup_vars(env) != startup_vars(os.environ):
        return False
    key = _key(env)
    with _server_lock:
        server = _servers.get(key)
        if server is not None and not server.lost:
            return True
        # Checked after the lookup: a server made before has a thread of its own here (its reader).
        ready = all(name in sys.modules for name in PRELOAD) and threading.active_count() == 1
        if not ready or not _room_for_one():
            return False
        _servers[key] = ForkServer(env, here=True)
        _close_at_exit()
    return True


def start(argv: Sequence[str], env: Mapping[str, str], *, stdin: Stream = None, stdout: Stream = None,
          stderr: Stream = None, text: bool = False, start_new_session: bool = False, netns: int | None = None,
          fallback: Sequence[str] | None = None, cwd: str | os.PathLike[str] | None = None,
          ) -> subprocess.Popen[Any] | ForkedProcess:  # fmt: skip
    """Start ``argv`` like ``subprocess.Popen(argv, env=env, cwd=cwd, stdin=..., stdout=..., stderr=...)``: forked from
    this process's server when it is ``sys.executable`` with ``-m MODULE``, ``-c CODE`` or a script and
    forking is on (a server per set of start-up variables: this process's own where the request's only add
    folders to its PYTHONPATH, so that later such requests share it, else the first such request's), else
    in a process of its own.

    The streams take None (inherit), ``subprocess.PIPE``, ``subprocess.DEVNULL``, a descriptor or a file,
    and ``stderr`` also ``subprocess.STDOUT``; with ``text`` the pipes are text (undecodable bytes
    replaced). With ``netns`` the child enters the network namespace of that process first, and is
    killed when the server ends (its client gone); ``fallback`` is the command run instead where the
    child is not forked (an ``nsenter`` line).
    """
    server = None
    if enabled(env) and command_of(argv) is not None and forkable_env(env):
        key, wanted = _key(env), startup_vars(env)
        with _server_lock:
            server = _servers.get(key)
            if server is None or server.lost:
                server = next((s for s in _servers.values() if not s.lost and shares(s.startup, wanted)), None)
                if server is None and _room_for_one():
                    base = os.environ if shares(startup_vars(os.environ), wanted) else env
                    server = _servers[_key(base)] = ForkServer(base)
                    _close_at_exit()
    if server is not None:
        try:
            return server.start(argv, env, stdin=stdin, stdout=stdout, stderr=stderr, text=text,
                                start_new_session=start_new_session, netns=netns, fallback=fallback, cwd=cwd)  # fmt: skip
        except OSError:
            # The server died (killed from outside): this one and the next start as their own interpreter.
            server.lost = True
    return _own_process(fallback or argv, env, stdin, stdout, stderr, text, start_new_session, cwd)


_closing_at_exit = False


def _close_at_exit() -> None:
    """Have :func:`close_all` run at this process's exit (once). Called with _server_lock held."""
    global _closing_at_exit
    if not _closing_at_exit:
        atexit.register(close_all)
        _closing_at_exit = True


def close_all() -> None:
    """End every server this process started and wait for each, as at its exit: a server waited for counts
    its CPU, and that of the children it waited for, as this process's children's (``/usr/bin/time``,
    ``getrusage``), as the interpreters of its requests would have counted; and none outlives this process.
    Children still running run on to their own end, as exec'd ones would."""
    with _server_lock:
        servers = list(_servers.values())
        _servers.clear()
    for server in servers:
        try:
            server.close()
        except (OSError, subprocess.TimeoutExpired):
            server.proc.kill()


def _own_process(argv: Sequence[str], env: Mapping[str, str], stdin: Stream, stdout: Stream, stderr: Stream,
                 text: bool, start_new_session: bool, cwd: str | os.PathLike[str] | None = None) -> subprocess.Popen[Any]:  # fmt: skip
    return subprocess.Popen(list(argv), env=dict(env), stdin=stdin, stdout=stdout, stderr=stderr, text=text,
                            errors="replace" if text else None, start_new_session=start_new_session, cwd=cwd)  # fmt: skip


def _child_end(how: Stream, inherited: int, text: bool, opened: list[int],
               writes: bool = True) -> tuple[int, IO[Any] | None]:  # fmt: skip
    """The descriptor the child gets (in place of ``inherited``), and the file this process holds of a pipe."""
    if how is None:
        try:
            os.fstat(inherited)
            return inherited, None
        except OSError:
            how = subprocess.DEVNULL
    if how == subprocess.DEVNULL:
        fd = os.open(os.devnull, os.O_WRONLY if writes else os.O_RDONLY)
        opened.append(fd)
        return fd, None
    if how == subprocess.PIPE:
        read_fd, write_fd = os.pipe()
        ours, theirs = (read_fd, write_fd) if writes else (write_fd, read_fd)
        opened.append(theirs)
        if not writes:
            raw = open(ours, "wb")
            return theirs, (io.TextIOWrapper(raw, encoding="utf-8", write_through=True) if text else raw)
        return theirs, (open(ours, encoding="utf-8", errors="replace") if text else open(ours, "rb"))
    if isinstance(how, int) and how >= 0:
        return how, None
    if hasattr(how, "fileno"):
        return how.fileno(), None
    raise ValueError(f"unsupported stream setting {how!r}")


def main(argv: Sequence[str]) -> None:
    """``python -m torch_dist_check.harness.forkserver FD PRELOAD``: import PRELOAD, then serve FD."""
    sock = socket.socket(fileno=int(argv[0]))
    for name in filter(None, argv[1].split(",")):
        try:
            startup.import_all([name])
        except Exception:
            # Not preloaded: each child imports it again, and says itself why it cannot.
            pass
    forkchild.serve(sock)


if __name__ == "__main__":
    main(sys.argv[1:])
