"""The fork server's side of harness/forkserver.py: the wire between client and server, the server's loop,
and what a forked child does to become the interpreter its request describes.

The wire: a 4-byte length, then JSON; a request carries the child's stdin, stdout and stderr descriptors.
"""

from __future__ import annotations

import atexit
import builtins
import ctypes
import gc
import importlib.machinery
import io
import json
import os
import resource
import runpy
import selectors
import signal
import socket
import struct
import sys
import threading
import traceback
import types
from collections.abc import Sequence
from typing import Any

from torch_dist_check.harness import startup

_HEADER = struct.Struct("!I")
# Signals the server ignores (a child gets an interpreter's usual handling of them back).
IGNORED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_PR_SET_PDEATHSIG = 1
_CLONE_NEWNET = 0x40000000


def send(sock: socket.socket, message: dict[str, Any], fds: Sequence[int] = ()) -> None:
    data = json.dumps(message).encode()
    payload = _HEADER.pack(len(data)) + data
    if fds:
        socket.send_fds(sock, [payload], list(fds))
    else:
        sock.sendall(payload)


def _recv_exact(sock: socket.socket, size: int, fds: list[int]) -> bytes | None:
    chunks = []
    while size:
        data, got, _flags, _addr = socket.recv_fds(sock, size, 4)
        fds.extend(got)
        if not data:
            return None
        chunks.append(data)
        size -= len(data)
    return b"".join(chunks)


def recv(sock: socket.socket) -> tuple[dict[str, Any], list[int]] | None:
    fds: list[int] = []
    header = _recv_exact(sock, _HEADER.size, fds)
    if header is None:
        return None
    body = _recv_exact(sock, _HEADER.unpack(header)[0], fds)
    if body is None:
        return None
    return json.loads(body), fds


def serve(sock: socket.socket) -> None:
    """Fork a child for each request until the client closes the socket (or is gone); report each child's end."""
    try:
        _serve(sock)
    except (BrokenPipeError, ConnectionResetError):
        pass


def _serve(sock: socket.socket) -> None:
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    # A ^C at the terminal or a batch system's SIGTERM reaches the whole process group: the children
    # end by it, the server stays to report them until its client closes the socket.
    for number in IGNORED:
        signal.signal(number, signal.SIG_IGN)
    selector = selectors.DefaultSelector()
    selector.register(sock, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    children: set[int] = set()
    server_pid = os.getpid()
    while True:
        for key, _events in selector.select():
            if key.fileobj == wake_r:
                try:
                    os.read(wake_r, 4096)
                except BlockingIOError:
                    pass
                continue
            got = recv(sock)
            if got is None:
                # The client is gone or closing: the children that ended are waited for (their CPU counts
                # as this server's children's, and so its client's once it waits for the server); those
                # still running run on.
                _reap(children)
                return
            request, fds = got
            pid = os.fork()
            if pid == 0:
                selector.close()
                signal.set_wakeup_fd(-1)
                os.close(wake_r)
                os.close(wake_w)
                sock.close()
                _child(request, fds, server_pid)  # never returns
            for fd in fds:
                os.close(fd)
            children.add(pid)
            send(sock, {"pid": pid})
        for pid, code in _reap(children):
            send(sock, {"exited": pid, "code": code})


def _reap(children: set[int]) -> list[tuple[int, int]]:
    """Wait for the children that ended (removed from ``children``); (pid, return code) of each."""
    ended = []
    for pid in list(children):
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            children.discard(pid)
            continue
        if done:
            children.discard(pid)
            ended.append((pid, os.waitstatus_to_exitcode(status)))
    return ended


def _stream(fd: int, unbuffered: bool, line_buffering: bool, errors: str) -> io.TextIOWrapper:
    """A standard stream as the interpreter makes it: with PYTHONUNBUFFERED on the unbuffered file itself,
    else buffered, flushed at each line where ``line_buffering`` (stderr always, stdout on a terminal)."""
    raw = io.FileIO(fd, "w", closefd=False)
    binary: Any = raw if unbuffered else io.BufferedWriter(raw)
    return io.TextIOWrapper(binary, encoding=sys.stdout.encoding or "utf-8", errors=errors,
                            line_buffering=line_buffering, write_through=unbuffered)  # fmt: skip


def _enter_netns(pid: int, server_pid: int) -> None:
    """Die with the server (so with its client), as ``setpriv --pdeathsig KILL`` would; then enter the
    network namespace of ``pid``, as ``nsenter --net`` would."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL) != 0 or os.getppid() != server_pid:
        raise OSError("torch_dist_check: the process that started this rank is gone; not starting it")
    fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            number = ctypes.get_errno()
            raise OSError(number, f"setns into the network namespace of process {pid}: {os.strerror(number)}")
    finally:
        os.close(fd)


def _child(request: dict[str, Any], fds: list[int], server_pid: int) -> None:
    """In the forked child: become the interpreter the request describes (its signals, streams, session,
    environment, directory, limits and namespace), run its module, code or script, then end as that
    interpreter would (harness/forkserver.py's docstring says what that takes)."""
    code = 1
    try:
        _take_signals(request["state"])
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in set(fds):
            if fd > 2:
                os.close(fd)
        if request.get("new_session"):
            os.setsid()
        env = request["env"]
        server_path = os.environ.get("PYTHONPATH", "")
        os.environ.clear()
        os.environ.update(env)
        os.chdir(request["cwd"])
        _take_limits(request["state"])
        unbuffered = bool(env.get("PYTHONUNBUFFERED"))
        sys.stdin = sys.__stdin__ = open(0, encoding=sys.stdout.encoding or "utf-8", closefd=False)
        sys.stdout = sys.__stdout__ = _stream(1, unbuffered, os.isatty(1), "strict")
        sys.stderr = sys.__stderr__ = _stream(2, unbuffered, True, "backslashreplace")
        if request.get("netns") is not None:
            _enter_netns(int(request["netns"]), server_pid)
        if not _take_path(request, server_path):
            _exec_interpreter(request)  # never returns
        code = _run_as_main(request)
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(code)


def _take_signals(state: dict[str, Any]) -> None:
    """The signal handling an interpreter started by the requester would have: the signals the requester
    ignores stay ignored (exec keeps them so), the others this server ignores or catches are back to
    their default, SIGINT raises KeyboardInterrupt unless ignored, SIGPIPE and SIGXFSZ are ignored (as
    every interpreter sets them), and the requesting thread's signal mask is the child's."""
    ignored = set(state["ignored"])
    for number in range(1, signal.NSIG):
        if number in (signal.SIGKILL, signal.SIGSTOP):
            continue
        try:
            current = signal.getsignal(number)
            if number in ignored:
                signal.signal(number, signal.SIG_IGN)
            elif current is signal.SIG_IGN or callable(current):
                signal.signal(number, signal.SIG_DFL)
        except (OSError, ValueError):
            pass
    signal.signal(signal.SIGINT, signal.SIG_IGN if signal.SIGINT in ignored else signal.default_int_handler)
    for number in (signal.SIGPIPE, signal.SIGXFSZ):
        signal.signal(number, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_SETMASK, state["mask"])


def _take_limits(state: dict[str, Any]) -> None:
    """The requester's resource limits, CPU affinity, nice value and umask (an interpreter inherits them)."""
    for name, (soft, hard) in state["limits"].items():
        which = getattr(resource, name, None)
        if which is not None and resource.getrlimit(which) != (soft, hard):
            resource.setrlimit(which, (soft, hard))
    if set(state["affinity"]) != os.sched_getaffinity(0):
        os.sched_setaffinity(0, state["affinity"])
    if os.getpriority(os.PRIO_PROCESS, 0) != state["nice"]:
        os.setpriority(os.PRIO_PROCESS, 0, state["nice"])
    os.umask(state["umask"])


def _take_path(request: dict[str, Any], server_path: str) -> bool:
    """Make ``sys.path`` past its first entry what the request's PYTHONPATH gives an interpreter (the server's
    folders and those the request adds, in the request's order, ahead of the rest), as harness/forkserver.py's
    ``shares`` allowed. False where this process cannot be that interpreter: a folder the request adds holds
    a ``sitecustomize`` or ``usercustomize`` (which the interpreter runs as it starts), or an added folder or
    the one ``sys.path[0]`` will be (the working directory, the script's folder) holds a module by the name
    of one this process imported from elsewhere or looked for in vain as it preloaded (which the interpreter
    would import from that folder), or an added entry is a zip file."""
    wanted = request["env"].get("PYTHONPATH", "")
    added: list[str] = []
    if wanted != server_path:
        kept = [os.path.abspath(entry) for entry in server_path.split(os.pathsep)] if server_path else []
        entries = [os.path.abspath(entry) for entry in wanted.split(os.pathsep)]
        added = [entry for entry in entries if entry not in kept]
        rest = [entry for entry in sys.path[1:] if entry not in kept]
        sys.path[1:] = list(dict.fromkeys([*entries, *rest]))
    if any(os.path.exists(entry) and not os.path.isdir(entry) for entry in added):
        return False  # a zip file: what it holds (a site hook, a module) is not listed here
    if any(name in _SITE_HOOKS for folder in added for name in _modules_in(folder)):
        return False
    first = os.path.dirname(request["what"]) if request["how"] == "path" else request["cwd"]
    return not any(_shadowed(folder) for folder in (*added, first))


# What an interpreter imports from its path as it starts, before the command's own modules.
_SITE_HOOKS = ("sitecustomize", "usercustomize")


def _modules_in(folder: str) -> dict[str, list[str]]:
    """The top-level modules and packages (or namespace portions) an import finds in ``folder``: name -> paths."""
    try:
        entries = os.listdir(folder)
    except OSError:
        return {}
    found: dict[str, list[str]] = {}
    suffixes = importlib.machinery.all_suffixes()
    for entry in entries:
        path = os.path.join(folder, entry)
        names = [entry[: -len(suffix)] for suffix in suffixes if entry.endswith(suffix)]
        if not names and os.path.isdir(path):
            names = [entry]
        for name in names:
            if name.isidentifier():
                found.setdefault(name, []).append(path)
    return found


def _shadowed(folder: str) -> str | None:
    """A name in ``folder`` of a module this process imported from elsewhere (built-in and frozen modules
    aside, which no folder shadows) or looked for in vain as it preloaded (startup.MISSED), or None."""
    for name, paths in _modules_in(folder).items():
        if name in startup.MISSED:
            return name
        module = sys.modules.get(name)
        if module is None or name == "__main__":
            continue
        spec = getattr(module, "__spec__", None)
        if spec is not None and spec.origin in ("built-in", "frozen"):
            continue
        places = {os.path.realpath(p) for p in (*(getattr(module, "__path__", None) or ()), getattr(module, "__file__", None)) if p}
        if not places & {os.path.realpath(path) for path in paths}:
            return name
    return None


def _exec_interpreter(request: dict[str, Any]) -> None:
    """Become an interpreter of the request's own (the same process: its streams, session, environment,
    directory and namespace are set)."""
    how, what = request["how"], request["what"]
    command = {"module": ["-m", what], "code": ["-c", what], "path": [what]}[how]
    os.execve(sys.executable, [sys.executable, *command, *request["args"]], request["env"])


def _run_as_main(request: dict[str, Any]) -> int:
    """Run the request as an interpreter runs its command, and end as it ends; the exit status.

    An uncaught exception goes to ``sys.excepthook`` (whose SystemExit sets the status), then the interpreter's
    end: threading's shutdown (non-daemon threads joined, unawaited executor jobs run), the exit handlers,
    the standard streams flushed (a failure there is status 120), and what the interpreter's clean-up does
    to the files left open (their buffers written). An uncaught ^C ends it by SIGINT, after all of that."""
    interrupted = False
    try:
        _run(request["how"], request["what"], request["args"], request["cwd"])
        code = 0
    except SystemExit as exc:
        code = _exit_status(exc)
    except BaseException as exc:
        interrupted = isinstance(exc, KeyboardInterrupt)
        code = _uncaught(exc)
    code = _finalize(code)
    if interrupted:
        # As an interpreter ends on an unhandled ^C: by the signal itself.
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return code


def _uncaught(exc: BaseException) -> int:
    """What the interpreter does with an exception that ends its command: ``sys.excepthook`` with the
    traceback from the command's first frame on (this module's frames are not the command's); the status."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    exc = exc.with_traceback(tb)
    sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, tb
    hook = getattr(sys, "excepthook", None)
    if hook is None:
        print("sys.excepthook is missing", file=sys.stderr)
        sys.__excepthook__(type(exc), exc, tb)
        return 1
    try:
        hook(type(exc), exc, tb)
    except SystemExit as hook_exit:
        return _exit_status(hook_exit)
    except BaseException as hook_error:
        print("Error in sys.excepthook:", file=sys.stderr)
        sys.__excepthook__(type(hook_error), hook_error, hook_error.__traceback__)
        print("\nOriginal exception was:", file=sys.stderr)
        sys.__excepthook__(type(exc), exc, tb)
    return 1


def _finalize(code: int) -> int:
    """The interpreter's end after its command (Py_FinalizeEx's order); the exit status."""
    try:
        threading._shutdown()  # type: ignore[attr-defined]  # what Py_FinalizeEx calls first
    except BaseException:
        traceback.print_exc()
    _exit_handlers()
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None and not stream.closed:
                stream.flush()
        except Exception:
            code = 120
    _flush_open_files()
    return code


def _flush_open_files() -> None:
    """Write what files left open hold in their buffers, as the interpreter's clean-up does when it frees them
    (text layers first: they write into the buffered ones below them)."""
    texts, buffers = [], []
    for obj in gc.get_objects():
        kind = type(obj)
        if issubclass(kind, io.TextIOBase):
            texts.append(obj)
        elif issubclass(kind, (io.BufferedWriter, io.BufferedRandom)):
            buffers.append(obj)
    for file in (*texts, *buffers):
        try:
            if not file.closed and file.writable():
                file.flush()
        except Exception:
            pass


def _run(how: str, what: str, args: list[str], cwd: str) -> None:
    """Run the request's module, code or script in a fresh ``__main__``, with ``sys.argv`` and ``sys.path[0]``
    as the interpreter sets them (the working directory for -m, '' for -c, the script's folder), the way
    it runs each (runpy's ``_run_module_as_main`` for -m, as ``python -m`` calls it; the compiled file or
    string otherwise): the same frames in a traceback."""
    main = types.ModuleType("__main__")
    main.__dict__.update(__builtins__=builtins, __loader__=importlib.machinery.BuiltinImporter, __annotations__={})
    sys.modules["__main__"] = main
    if how == "module":
        sys.path[0] = cwd
        sys.argv = ["-m", *args]
        runpy._run_module_as_main(what, True)  # type: ignore[attr-defined]
    elif how == "path":
        sys.path[0] = os.path.dirname(what)
        sys.argv = [what, *args]
        with io.open_code(what) as source:
            code = compile(source.read(), what, "exec", dont_inherit=True)
        main.__dict__.update(__file__=what, __cached__=None,
                             __loader__=importlib.machinery.SourceFileLoader("__main__", what))  # fmt: skip
        exec(code, main.__dict__)
    else:
        sys.path[0] = ""
        sys.argv = ["-c", *args]
        exec(compile(what, "<string>", "exec", dont_inherit=True), main.__dict__)


def _exit_status(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def _exit_handlers() -> None:
    try:
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
