"""Flat-tensor all_gather and reduce_scatter under the names each PyTorch version prefers.

PyTorch 2.13 deprecates ``all_gather_into_tensor``/``reduce_scatter_tensor`` in favour of
``all_gather_single``/``reduce_scatter_single`` (same arguments); older versions have only the former.

Some backends lack these flat forms: torch's ProcessGroupMPI raises ``no support for
_allgather_base in MPI process group`` (and ``_reduce_scatter_base``), and c10d's default says
``Backend X does not support _allgather_base``. Such an error becomes :class:`Unsupported`, so a
check can report the op as not implemented rather than as wrong. Only a RuntimeError (which
NotImplementedError is) whose message names the op and says it is unsupported counts; any other
error stays what it is.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

_UNSUPPORTED = re.compile(r"no support for|does not support|not supported|not implemented|unsupported", re.IGNORECASE)
# The names an op goes by in torch.distributed's Python API and in c10d's Backend methods.
ALL_GATHER_NAMES = ("all_gather_into_tensor", "all_gather_single", "_allgather_base", "allgather_base")
REDUCE_SCATTER_NAMES = ("reduce_scatter_tensor", "reduce_scatter_single", "_reduce_scatter_base", "reduce_scatter")


class Unsupported(Exception):
    """The backend says it does not implement ``op`` (the torch.distributed function called)."""

    def __init__(self, op: str, error: BaseException) -> None:
        self.op = op
        self.error = f"{type(error).__name__}: {_first_line(error)}"
        super().__init__(f"{op} is not implemented ({self.error})")


def _first_line(error: BaseException) -> str:
    text = str(error)
    return text.splitlines()[0] if text else ""


def says_unsupported(error: BaseException, names: Sequence[str]) -> bool:
    """True if ``error`` is a RuntimeError whose first line names one of ``names`` and calls it unsupported."""
    if not isinstance(error, RuntimeError):
        return False
    line = _first_line(error)
    return bool(_UNSUPPORTED.search(line)) and any(re.search(rf"\b{re.escape(n)}\b", line) for n in names)


def _call(fn: Any, names: Sequence[str], *args: Any, **kwargs: Any) -> None:
    try:
        fn(*args, **kwargs)
    except RuntimeError as exc:
        if says_unsupported(exc, names):
            raise Unsupported(fn.__name__, exc) from exc
        raise


def all_gather_flat(output: Any, local: Any, group: Any) -> None:
    """Gather every rank's ``local`` into ``output`` (world x its size), rank order."""
    import torch.distributed as dist

    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    _call(fn, ALL_GATHER_NAMES, output, local, group=group)


def reduce_scatter_flat(output: Any, full: Any, group: Any) -> None:
    """Sum ``full`` over ranks and give rank r block r of the result in ``output``."""
    import torch.distributed as dist

    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    _call(fn, REDUCE_SCATTER_NAMES, output, full, op=dist.ReduceOp.SUM, group=group)
