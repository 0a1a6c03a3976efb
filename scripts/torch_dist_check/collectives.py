"""Flat-tensor all_gather and reduce_scatter under the names each PyTorch version prefers.

PyTorch 2.13 deprecates ``all_gather_into_tensor``/``reduce_scatter_tensor`` in favour of
``all_gather_single``/``reduce_scatter_single`` (same arguments); older versions have only the former.
"""

from __future__ import annotations

from typing import Any


def all_gather_flat(output: Any, local: Any, group: Any) -> None:
    """Gather every rank's ``local`` into ``output`` (world x its size), rank order."""
    import torch.distributed as dist

    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(output, local, group=group)


def reduce_scatter_flat(output: Any, full: Any, group: Any) -> None:
    """Sum ``full`` over ranks and give rank r block r of the result in ``output``."""
    import torch.distributed as dist

    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(output, full, op=dist.ReduceOp.SUM, group=group)
