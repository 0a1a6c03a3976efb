"""Child-process servers for the tests, started so that no test can wait forever on them.

Issue 38: a test read the port of ``python -m http.server`` from its stdout with ``readline()``. That
line is block-buffered unless PYTHONUNBUFFERED is set, which a user's shell normally does not set,
so the README's test command hung. Here a server prints its own port with an explicit flush, and the
test reads it with a deadline: a server that never answers fails the test with what it printed.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

# Prints the port it bound (flushed), then serves the folder argv[1]; logs each request line to argv[2] if given.
FILE_SERVER = """
import functools, http.server, sys
class Handler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args):
        if len(sys.argv) > 2:
            with open(sys.argv[2], "a") as log:
                log.write(self.requestline + "\\n")
server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=sys.argv[1]))
print(server.server_address[1], flush=True)
server.serve_forever()
"""

# Seconds a child may take to print its first line: a Python start-up on a busy 2-core machine is well under this.
FIRST_LINE_TIMEOUT_S = 30.0


def first_line(proc: subprocess.Popen[str], timeout_s: float = FIRST_LINE_TIMEOUT_S) -> str:
    """The first line ``proc`` writes to its stdout (a pipe), waiting at most ``timeout_s``.

    Fails the test, killing ``proc``, when no whole line came in time or the child ended first.
    """
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    received = b""
    deadline = time.monotonic() + timeout_s
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        while b"\n" not in received:
            left = deadline - time.monotonic()
            if left <= 0 or not selector.select(left):
                proc.kill()
                raise AssertionError(f"{proc.args!r} printed no line within {timeout_s:.0f} s (so far: {received!r})")
            chunk = os.read(fd, 4096)
            if not chunk:
                raise AssertionError(f"{proc.args!r} ended (exit {proc.wait()}) before printing a line: {received!r}")
            received += chunk
    return received.split(b"\n", 1)[0].decode()


@contextlib.contextmanager
def line_server(argv: Sequence[str]) -> Iterator[int]:
    """Start ``python -c`` ARGV (a program that prints its port first), yield that port, and kill it at the end."""
    proc = subprocess.Popen([sys.executable, "-c", *argv], stdout=subprocess.PIPE, text=True)
    try:
        yield int(first_line(proc))
    finally:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def file_server(directory: Path, log: Path | None = None) -> Iterator[str]:
    """An HTTP server on 127.0.0.1 serving ``directory``; yields its base URL (no trailing slash)."""
    with line_server([FILE_SERVER, str(directory), *([str(log)] if log else [])]) as port:
        yield f"http://127.0.0.1:{port}"
