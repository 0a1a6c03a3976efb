"""The fork server's side of harness/forkserver.py: the wire between client and server, the server's loop,
and what a forked child does to become the interpreter its request describes.

The wire: a 4-byte length, then JSON; a request carries the child's stdin, stdout and stderr descriptors.
"""

from __future__ import annotations

import atexit
import ctypes
import importlib.machinery
import io
import json
import os
import runpy
import selectors
import signal
import socket
import struct
import sys
import traceback
import types
from collections.abc import Sequence
from typing import Any

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
        for pid in list(children):
            try:
                done, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                children.discard(pid)
                continue
            if done:
                children.discard(pid)
                send(sock, {"exited": pid, "code": os.waitstatus_to_exitcode(status)})


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
    """In the forked child: become the interpreter the request describes (its streams, session, environment,
    directory and namespace), run its module, code or script, then exit as that interpreter would."""
    code = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for number in IGNORED:
            signal.signal(number, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
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
        unbuffered = bool(env.get("PYTHONUNBUFFERED"))
        sys.stdin = open(0, encoding=sys.stdout.encoding or "utf-8", closefd=False)
        sys.stdout = _stream(1, unbuffered, os.isatty(1), "strict")
        sys.stderr = _stream(2, unbuffered, True, "backslashreplace")
        if request.get("netns") is not None:
            _enter_netns(int(request["netns"]), server_pid)
        if not _take_path(request, server_path):
            _exec_interpreter(request)  # never returns
        code = 0
        try:
            _run(request["how"], request["what"], request["args"], request["cwd"])
        except SystemExit as exc:
            code = _exit_status(exc)
        except KeyboardInterrupt:
            _exit_handlers()
            # As an interpreter ends on an unhandled ^C: by the signal itself.
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        except BaseException:
            traceback.print_exc()
            code = 1
        _exit_handlers()
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def _take_path(request: dict[str, Any], server_path: str) -> bool:
    """Make ``sys.path`` past its first entry what the request's PYTHONPATH gives an interpreter (the server's
    folders and those the request adds, in the request's order, ahead of the rest), as harness/forkserver.py's
    ``shares`` allowed. False where this process cannot be that interpreter: a folder the request adds holds
    a ``sitecustomize`` or ``usercustomize`` (which the interpreter runs as it starts), or an added folder or
    the one ``sys.path[0]`` will be (the working directory, the script's folder) holds a module by the name
    of one this process imported from elsewhere (which the interpreter would import from that folder)."""
    wanted = request["env"].get("PYTHONPATH", "")
    added: list[str] = []
    if wanted != server_path:
        kept = [os.path.abspath(entry) for entry in server_path.split(os.pathsep)] if server_path else []
        entries = [os.path.abspath(entry) for entry in wanted.split(os.pathsep)]
        added = [entry for entry in entries if entry not in kept]
        rest = [entry for entry in sys.path[1:] if entry not in kept]
        sys.path[1:] = list(dict.fromkeys([*entries, *rest]))
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
    aside, which no folder shadows), or None."""
    for name, paths in _modules_in(folder).items():
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


def _run(how: str, what: str, args: list[str], cwd: str) -> None:
    """Run the request's module, code or script as ``__main__``, with ``sys.argv`` and ``sys.path[0]`` as the
    interpreter would set them (the working directory for -m, '' for -c, the script's folder)."""
    if how == "module":
        sys.path[0] = cwd
        sys.argv = [what, *args]
        runpy.run_module(what, run_name="__main__", alter_sys=True)
    elif how == "path":
        sys.path[0] = os.path.dirname(what)
        sys.argv = [what, *args]
        runpy.run_path(what, run_name="__main__")
    else:
        sys.path[0] = ""
        sys.argv = ["-c", *args]
        main = types.ModuleType("__main__")
        sys.modules["__main__"] = main
        exec(compile(what, "<string>", "exec"), main.__dict__)


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
