"""A step's end that raises on a peer's loss without waiting for the aborted collective's kernel.

A training step ends in ``torch.cuda.current_stream().synchronize()`` (or ``loss.item()``) so that the gradients'
all-reduce is known to have ended before the optimizer applies them. After a peer's death that call returns only
when the aborted all-reduce's kernel ends: NCCL's kernel reads the abort flag every so many spins, and on a GPU that
several ranks share the kernel ended 0.09-0.10 s after the watcher's verdict (issue 74, run J), so the survivor's
exception came 0.13 s after the death although the verdict stood after 0.03 s.

:func:`synchronize` waits for the same work by polling an event recorded on the stream, and wakes on the watcher's
verdict as well: it raises ``PeerLostError`` (``PartitionedError`` on the cut-off side) as soon as the verdict on a
member of the group stands. Nothing is lost by not waiting for the kernel: the stream stays ordered behind it, so
every later kernel on that stream (the recovery's, and any that reuses memory the step freed) runs after it on the
GPU, and only the Python thread goes on. On a healthy step it returns about :data:`POLL_MAX_S` after the work
ended (the polls start at :data:`POLL_MIN_S` and double; later while other Python threads hold the GIL).
Not yet run on a GPU: ``tests/test_peer_watcher_gloo.py``'s GPU case and ``benchmarks/step_wait.py`` are written
for it (issue 74).
"""

from __future__ import annotations

from typing import Any

POLL_MIN_S = 20e-6
POLL_MAX_S = 200e-6


def synchronize(watcher: Any, group: Any = None, stream: Any = None) -> None:
    """Wait until the work queued so far on ``stream`` (default: the current CUDA stream; none on CPU) has ended;
    raise ``PeerLostError`` as soon as a member of ``group`` (None: any watched group) is lost, whether or not it
    has. As :meth:`~torch_peer_watcher.watcher.PeerWatcher.raise_if_lost`: ``group`` is a group the watcher watches
    (an unwatched one has no members it knows), and a group left on any loss (``leave_on_any_loss``) raises only for
    its own members."""
    import torch

    watcher.raise_if_lost(group)
    if stream is None:
        if not torch.cuda.is_initialized():  # this process queued no CUDA work (CPU, gloo)
            return
        stream = torch.cuda.current_stream()
    event = torch.cuda.Event()
    event.record(stream)
    delay = POLL_MIN_S
    while not event.query():
        watcher.raise_if_lost(group)
        watcher.wait_for_loss(group, delay, aborted=False)  # woken by a verdict
        delay = min(2 * delay, POLL_MAX_S)
    watcher.raise_if_lost(group)
