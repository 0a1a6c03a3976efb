"""Close the NCCL group that a failed send or recv left open in the calling thread.

Why (issue 20): PyTorch's ``ProcessGroupNCCL::pointToPoint`` (2.6.0's source; the same failure on
stock 2.11.0) runs a single send or recv as ``ncclGroupStart()``, then ``ncclSend``/``ncclRecv``
under ``C10D_NCCL_CHECK_NONBLOCKING``, then ``ncclGroupEnd()``. When the peer is gone NCCL returns
``ncclRemoteError``, the check throws ``DistBackendError``, and ``ncclGroupEnd()`` is never called.
NCCL keeps its group depth per thread, so that thread stays inside a group: every later NCCL call it
makes is deferred to a group end that never comes. A new communicator is then never initialised
(its rank count reads 0), and its first collective fails with ``invalid root 0 (root should be in
the 0..0 range)``. It happens only when NCCL itself saw the dead peer before the watcher's abort
(after the abort, PyTorch raises before it calls NCCL).

:func:`close_leaked_groups` calls ``ncclGroupEnd()`` in the calling thread until NCCL answers that
the thread is in no group (``ncclInvalidUsage``), and says how many it closed. NCCL then prints
``ncclGroupEnd: not in a group call.`` at ``NCCL_DEBUG=WARN``: that warning is this probe's.
:meth:`PeerWatcher.guard` calls it when it turns an error into ``PeerLostError``. Call it in the
thread that caught a ``DistBackendError`` from NCCL, before that thread creates another group; never
inside a group the application opened itself (``batch_isend_irecv``, ``_coalescing_manager``),
which it would close too.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

NCCL_SONAME = "libnccl.so.2"
# ncclResult_t of ncclGroupEnd() outside any group (nccl.h: ncclInvalidUsage = 5).
NCCL_INVALID_USAGE = 5
# A thread leaks one level per failed call; more than this means something else is wrong.
MAX_LEVELS = 16


def loaded_nccl() -> Any | None:
    """The NCCL library this process has already loaded (PyTorch's), or None; never loads one.

    Found by its soname, which every NCCL build sets (the wheels' and conda-forge's alike).
    """
    try:
        return ctypes.CDLL(NCCL_SONAME, mode=os.RTLD_NOLOAD)
    except OSError:
        return None


def close_leaked_groups(lib: Any | None = None) -> int:
    """End every NCCL group the calling thread is still inside; the number ended (0 if none or no NCCL).

    Each end runs NCCL's own cleanup of the group (the failed call recorded its error there, and
    that error is what ``ncclGroupEnd()`` returns; it is expected and not raised).
    """
    lib = lib if lib is not None else loaded_nccl()
    if lib is None:
        return 0
    closed = 0
    while closed < MAX_LEVELS:
        if lib.ncclGroupEnd() == NCCL_INVALID_USAGE:
            break
        closed += 1
    return closed
