"""Run code on ``torch.distributed.distributed_c10d`` once it is imported (at once if it already is), without
importing torch.

Both the auto-start (:mod:`torch_peer_watcher.autostart`) and the watchdog settings
(:mod:`torch_peer_watcher.watchdog`) wrap functions of that module before ``torch.distributed`` re-exports
them: a one-shot finder at the head of ``sys.meta_path`` hands back the module's spec with a loader that
runs each registered patch right after the module's own code.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import threading
from collections.abc import Callable
from typing import Any

TARGET = "torch.distributed.distributed_c10d"

_pending: list[Callable[[Any], None]] = []
_lock = threading.Lock()


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing itself; when TARGET is imported, hands back its spec with a patching loader."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != TARGET:
            return None
        # One shot, and out of the way before asking the other finders (no recursion).
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module: Any) -> None:
            exec_module(module)
            with _lock:
                patches = list(_pending)
                _pending.clear()
            for patch in patches:
                patch(module)

        spec.loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


def when_imported(patch: Callable[[Any], None]) -> None:
    """Call ``patch(distributed_c10d)`` now if the module is imported, else right after its import."""
    with _lock:
        module = sys.modules.get(TARGET)
        if module is None:
            _pending.append(patch)
            if not any(isinstance(f, _Finder) for f in sys.meta_path):
                sys.meta_path.insert(0, _Finder())
    if module is not None:
        patch(module)
