"""Running py-rattler, the engine under channel, deploy, bundle and expansion, from synchronous code.

At the bottom of the package (beside errors), so that every module that calls py-rattler's
coroutines runs them one way, with the exit pause py-rattler 0.28 needs.
"""

from __future__ import annotations

import asyncio
import atexit
import time
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

_exit_pause_registered = False


def _pause_at_exit() -> None:
    # py-rattler 0.28 finishes each coroutine on a tokio thread that still drops Python objects
    # after the asyncio future has resolved; if the interpreter is already finalizing, the process
    # dies with SIGSEGV/SIGABRT (reproduced: 10 of 40 runs of a bare `index_fs` script). A short
    # pause before finalization lets those threads finish (0 of 40 with the pause).
    time.sleep(0.05)


def run_rattler(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run one py-rattler coroutine to completion from synchronous code.

    Called from inside a running event loop (a notebook, an async caller), the coroutine runs on a
    worker thread with its own loop, since a loop cannot be re-entered.
    """
    global _exit_pause_registered
    if not _exit_pause_registered:
        atexit.register(_pause_at_exit)
        _exit_pause_registered = True
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coroutine).result()
