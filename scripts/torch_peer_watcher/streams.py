"""A step's end that raises on a peer's loss without waiting for the aborted collective's kernel.

A training step ends in ``torch.cuda.current_stream().synchronize()`` (or ``loss.item()``) so that the gradients'
all-reduce is known to have ended before the optimizer applies them. After a peer's death that call returns only
when the aborted all-reduce's kernel ends: NCCL's kernel reads the abort flag every so many spins, and on a GPU that
several ranks share the kernel ended 0.09-0.10 s after the watcher's verdict (issue 74, run J), so the survivor's
exception came 0.13 s after the death although the verdict stood after 0.03 s.

:func:`synchronize` waits for the same work by polling an event recorded on the stream, and wakes on the watcher's
verdict as well: it raises ``PeerLostError`` (``PartitionedError`` on the cut-off side) as soon as the verdict on a
member of the group stands. Only the Python thread goes on: later kernels on that stream run after the aborted
one on the GPU, but work on other streams (FSDP's, each group's NCCL stream) is not ordered by it, so what the
caller does next must not touch GPU state that the aborted step's work can still write. On a healthy step it
returns about :data:`POLL_MAX_S` after the work ended (the polls start at :data:`POLL_MIN_S` and double; later while
other Python threads hold the GIL).

Measured on one H100 over NCCL's network (docs/records/2026-12-07-step-wait-ab-one-h100.md): survivors that ended
every step with it raised 0.03-0.05 s after the death instead of 0.12 s, their first step came only 0.01-0.03 s
sooner, and one HSDP run in 26 broke bitwise equality (the replica rank whose Python went on gathered parameters
that differed from its partner's). The examples and the suite's workers therefore end their steps with the
blocking synchronize; this stays for callers who can keep to the rule above.
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
