"""The suite's command, ``python -m torch_dist_check ARGS``, as most tests start it (issue 58).

Forked from a fork server of the test process's own (torch_dist_check/harness/forkserver.py), which
imported torch once, instead of a new interpreter that imports it again for each run (1.5-1.7 s of
CPU apiece with PyPI's CUDA wheel on the 2-core CI machine). Everything else is the command's: its
environment, directory, arguments, streams, session, signals and exit status
(tests/test_dist_check_forkserver.py holds the server to that), and a ``--nproc`` launcher started so
forks its ranks from itself. ``TORCH_DIST_CHECK_FORK=0`` in the tests' environment starts each run as
its own interpreter, as a user's shell does. The tests about how the command starts (the live line on
a terminal under ``--nproc``, the fork server's own, a NumPy that cannot be imported, a report path refused
before the run, the docs' blocks, rank 0 of each example) start it that way always.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from torch_dist_check.harness import forkserver

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def python_path(*first: str | os.PathLike[str]) -> str:
    """PYTHONPATH for a process the tests start: ``first``, the scripts folder, then the rest of the tests'
    own PYTHONPATH, each entry once and none empty (an empty one puts the process's working directory on
    its path). tests/conftest.py sets the tests' own to ``python_path()``: processes started with the same
    start-up variables fork from one fork server per test process, where 'scripts:' and 'scripts' made two
    (1.9 s of CPU each with the CUDA wheel)."""
    entries = [*map(str, first), str(SCRIPTS), *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    return os.pathsep.join(dict.fromkeys(entry for entry in entries if entry))


def command(args: Sequence[str]) -> list[str]:
    return [sys.executable, "-m", "torch_dist_check", *args]


def start(args: Sequence[str], env: Mapping[str, str], *, cwd: str | os.PathLike[str] | None = None,
          stdout: Any = None, stderr: Any = None, text: bool = True,
          start_new_session: bool = False) -> subprocess.Popen[Any] | forkserver.ForkedProcess:  # fmt: skip
    """``subprocess.Popen(command(args), env=env, cwd=cwd, ...)``, forked where the server can."""
    return forkserver.start(command(args), env, cwd=cwd, stdout=stdout, stderr=stderr, text=text,
                            start_new_session=start_new_session)  # fmt: skip


def run(args: Sequence[str], env: Mapping[str, str], *, timeout: float,
        cwd: str | os.PathLike[str] | None = None) -> subprocess.CompletedProcess[str]:  # fmt: skip
    """``subprocess.run(command(args), env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)``."""
    return run_argv(command(args), env, timeout=timeout, cwd=cwd)


def run_argv(argv: Sequence[str], env: Mapping[str, str], *, timeout: float,
             cwd: str | os.PathLike[str] | None = None) -> subprocess.CompletedProcess[str]:  # fmt: skip
    """``subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)``, forked where
    the server can (``sys.executable`` with ``-m``, ``-c`` or a script)."""
    proc = forkserver.start(argv, env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)
        raise
    return subprocess.CompletedProcess(list(argv), proc.wait(), out, err)
