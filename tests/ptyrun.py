"""Run a command on a fake terminal (a pseudo-terminal from Python's pty module) and keep what it showed.

Progress bars appear only where the output is a terminal; the tests that prove them run the command
with stdin, stdout and stderr on the slave side of a pty, as a terminal session would.
"""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import termios
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

_ESCAPE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def run_in_pty(
    argv: Sequence[str], env: Mapping[str, str] | None = None, cwd: Path | None = None, timeout: float = 120,
    forked: bool = False,
) -> tuple[int, str]:  # fmt: skip
    """Run ``argv`` on a 120x40 terminal; returns its exit code and everything it wrote (escapes kept).

    ``forked``: a ``sys.executable`` command is forked from the test process's fork server, which imported torch
    once (torch_dist_check/harness/forkserver.py: the same streams, session, environment and directory), where
    another test already shows the command started as an interpreter of its own on a terminal."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    streams: dict[str, Any] = {"stdin": slave, "stdout": slave, "stderr": slave, "cwd": cwd, "start_new_session": True}
    proc: Any
    if forked:
        from torch_dist_check.harness import forkserver

        proc = forkserver.start(list(argv), dict(env or os.environ), **streams)
    else:
        proc = subprocess.Popen(list(argv), env=dict(env or os.environ), **streams)
    os.close(slave)
    chunks = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if not ready:
                if proc.poll() is not None:
                    break
                continue
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: every writer closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        else:
            proc.kill()
            raise TimeoutError(f"{argv} did not end within {timeout} s")
        return proc.wait(timeout=30), b"".join(chunks).decode(errors="replace")
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def plain(text: str) -> str:
    """Terminal output without its escape sequences and carriage returns, for reading lines."""
    return _ESCAPE.sub("", text).replace("\r\n", "\n").replace("\r", "\n")
