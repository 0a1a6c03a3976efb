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

Several NCCLs in one process (issue 38): PyPI's CUDA build of PyTorch loads the ``libnccl.so.2`` of
its ``nvidia-nccl`` wheel at import, and a program (or a plugin, or a test) can load another NCCL by
path beside it. Each library keeps its own per-thread group depth, and the watcher cannot tell which
of them the failed call went through, so it closes the leaked groups of every NCCL the process has
loaded: it asks the dynamic loader for the loaded objects (``dl_iterate_phdr``), not the soname,
which names only the first of them.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

# ncclResult_t of ncclGroupEnd() outside any group (nccl.h: ncclInvalidUsage = 5).
NCCL_INVALID_USAGE = 5
# A thread leaks one level per failed call; more than this means something else is wrong.
MAX_LEVELS = 16
# The file names of NCCL's library, whatever its version suffix (libnccl.so, libnccl.so.2, libnccl.so.2.21.5);
# its network plugins (libnccl-net*.so) are other libraries.
NCCL_FILE_PREFIX = "libnccl.so"


class _PhdrInfo(ctypes.Structure):
    """The head of glibc's ``struct dl_phdr_info`` (link.h): the object's load address and its path."""

    _fields_ = [("dlpi_addr", ctypes.c_void_p), ("dlpi_name", ctypes.c_char_p)]


_PHDR_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(_PhdrInfo), ctypes.c_size_t, ctypes.c_void_p)


def loaded_nccl_paths() -> list[str]:
    """The paths of every NCCL library this process has loaded, in load order; never loads one."""
    paths: list[str] = []

    def visit(info: Any, _size: int, _data: Any) -> int:
        name = (info.contents.dlpi_name or b"").decode(errors="replace")
        if os.path.basename(name).startswith(NCCL_FILE_PREFIX) and name not in paths:
            paths.append(name)
        return 0

    ctypes.CDLL(None).dl_iterate_phdr(_PHDR_CALLBACK(visit), None)
    return paths


def loaded_nccls() -> list[Any]:
    """Every NCCL library this process has already loaded (PyTorch's, and any other), as ctypes handles."""
    libraries = []
    for path in loaded_nccl_paths():
        try:
            libraries.append(ctypes.CDLL(path, mode=os.RTLD_NOLOAD))
        except OSError:  # unloaded since the loader listed it
            continue
    return libraries


def loaded_nccl() -> Any | None:
    """The first NCCL library this process loaded (PyTorch's, where PyTorch loaded one), or None."""
    libraries = loaded_nccls()
    return libraries[0] if libraries else None


def close_leaked_groups(lib: Any | None = None) -> int:
    """End every NCCL group the calling thread is still inside; the number ended (0 if none or no NCCL).

    Without ``lib``, in every NCCL the process has loaded. Each end runs NCCL's own cleanup of the
    group (the failed call recorded its error there, and that error is what ``ncclGroupEnd()``
    returns; it is expected and not raised).
    """
    libraries = [lib] if lib is not None else loaded_nccls()
    return sum(_close_groups_of(library) for library in libraries)


def _close_groups_of(lib: Any) -> int:
    closed = 0
    while closed < MAX_LEVELS:
        if lib.ncclGroupEnd() == NCCL_INVALID_USAGE:
            break
        closed += 1
    return closed
