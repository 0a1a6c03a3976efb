"""torch imported with Python's cycle collector paused, and what the import made frozen.

``import torch`` makes some hundreds of thousands of objects that live as long as the process. While
they are made, the collector's full passes walk them again and again, and the interpreter's exit
walks them once more: with PyPI's CUDA build of torch 2.13.0 on the 2-core CI machine, about a third
of the 1.5 s of CPU that ``import torch`` and a normal exit take. Paused during the imports and frozen
after them (``gc.freeze``: moved to a generation no pass visits), those objects cost none of it, and
a process forked later (a rank or worker of the fork server) shares their pages instead of touching
them at its first collection. What is frozen is what a process keeps to its end anyway: modules,
their functions and classes, registries. Objects made after the imports are collected as before.

Used where the suite starts a rank (the command's rank path), imports a ``--import`` module, or preloads
a fork server (harness/forkserver.py).
"""

from __future__ import annotations

import gc
import importlib
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

TORCH = ("torch", "torch.distributed")

# The top-level modules that :func:`import_all`'s imports looked for and found nowhere on the path (torch's
# optional ones: opt_einsum, dill, tqdm, ...). A process forked later from this one must not be given a
# path that holds one of them: an interpreter of its own would have found it (harness/forkchild.py).
MISSED: set[str] = set()


class _RecordMissed:
    """The last finder on ``sys.meta_path``: reached only by an import no other finder found."""

    @staticmethod
    def find_spec(fullname: str, path: object = None, target: object = None) -> None:
        if path is None:
            MISSED.add(fullname)


@contextmanager
def collector_paused() -> Iterator[None]:
    """Run the block with the cycle collector off, then freeze every object alive (an exception too)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if was_enabled:
            gc.enable()


def import_all(names: Iterable[str]) -> None:
    """Import each module in turn with the collector paused; the first that fails raises, as ``import`` does.
    The top-level modules they looked for in vain are added to :data:`MISSED`."""
    recorder = _RecordMissed()
    sys.meta_path.append(recorder)
    try:
        with collector_paused():
            for name in names:
                importlib.import_module(name)
    finally:
        sys.meta_path.remove(recorder)
