"""What the interpreter's exit does for the watcher: wait for the loss handlers still running, then collect.

A verdict starts a thread that judges it and aborts the lost peer's groups (``PeerWatcher._handle_loss``).
``raise_if_lost()`` and ``lost()`` answer as soon as the verdict stands, while the aborts still run (on stock
NCCL ``ncclCommAbort``'s teardown: 0.1 s and more), so an application may end its interpreter meanwhile: the
cut-off side is told to stop on ``PartitionedError``, and a survivor may stop on an uncaught ``PeerLostError``.
A daemon thread that comes back from a C++ call that released the GIL (``ProcessGroup.abort``) while the
interpreter finalizes ends the process with "terminate called without an active exception" (SIGABRT): on
gloo with the abort's teardown stood in for by ATen matmuls, 6 of 6 survivors that called ``sys.exit(3)``
after ``raise_if_lost()`` did (``tests/test_peer_watcher_gloo.py``). So the exit waits for them, at most
:data:`SETTLE_EXIT_WAIT_S`, as it waits for the shrinks' background releases
(:func:`torch_peer_watcher.groups.wait_for_releases`).

Then it collects the stopped watchers' objects (:func:`collect_at_exit`), while the interpreter is still whole:
left for its teardown, their destruction ended the process with the same message in 4 of 30 clean runs of
examples/peer_watcher_minimal.py (issue 54; which object aborts was not isolated); in none of 20 with a
collection. The collection ran in ``stop()`` until issue 55: there it cost 0.2-0.6 s of every HSDP rejoin (a full
``gc.collect()`` of a process holding PyTorch), so it runs once, at exit (atexit hooks run before the teardown).
One hook does both, in that order: a collection beside a running abort would race it.
"""

from __future__ import annotations

import atexit
import gc
import threading
import time

SETTLE_EXIT_WAIT_S = 60.0
_running: set[threading.Thread] = set()
_lock = threading.Lock()
_exit_registered = False
_collect = False


def track(thread: threading.Thread) -> None:
    """Count ``thread`` (a loss handler, not started yet) among those the exit waits for."""
    with _lock:
        _running.add(thread)
    _register()


def collect_at_exit() -> None:
    """Collect the stopped watchers' objects at exit (``PeerWatcher.stop()`` asks), after the wait."""
    global _collect
    _collect = True
    _register()


def _register() -> None:
    global _exit_registered
    with _lock:
        if not _exit_registered:
            _exit_registered = True
            atexit.register(_at_exit)


def _at_exit() -> None:
    wait_for_settles(SETTLE_EXIT_WAIT_S)
    if _collect:
        gc.collect()


def untrack(thread: threading.Thread) -> None:
    with _lock:
        _running.discard(thread)


def in_handler() -> bool:
    """Whether the calling thread is a loss handler (a callback runs in one)."""
    with _lock:
        return threading.current_thread() in _running


def wait_for_settles(timeout_s: float) -> None:
    """Wait until every loss this process is handling (in other threads) is handled, its groups aborted, at most
    ``timeout_s`` in all. The shrinks' background releases have their own wait at exit (``groups``)."""
    deadline = time.monotonic() + timeout_s
    with _lock:
        running = [t for t in _running if t is not threading.current_thread()]
    for thread in running:
        thread.join(max(0.0, deadline - time.monotonic()))


def after_fork_in_child() -> None:
    """A forked child has none of its parent's handlers, and a fork while one held the lock left it held."""
    global _lock
    _lock = threading.Lock()
    _running.clear()
