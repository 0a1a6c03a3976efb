"""Put on PYTHONPATH with TORCH_PEER_WATCHER_TEST_JUDGING_S=S: every process's watcher then takes S seconds more
to judge a verdict (its store probe starts S seconds late), so that PyTorch's NCCL watchdog, which aborts a
communicator whose peer closed its connection on its own loop, gets there first (issue 74: a step whose
all-reduce the watchdog aborted must not be applied while the watcher still judges the peer's death).

Used by the GPU rows of ``benchmarks/peer_loss_net.py`` named with ``+slowjudge`` (a process that starts afresh;
``tests/peer_watcher_rank.py``, forked from a warm process, wraps the same function itself). It wraps the
watcher's function once its module is imported, and changes nothing else (no module is imported early).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import time

TARGET = "torch_peer_watcher.watcher"
DELAY_S = float(os.environ.get("TORCH_PEER_WATCHER_TEST_JUDGING_S") or 0)


class _SlowJudging(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):  # noqa: ANN001, ANN201 (importlib's protocol)
        if name != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module) -> None:  # noqa: ANN001
            run(module)
            probe = module.store_out_of_reach

            def slow_probe(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
                time.sleep(DELAY_S)
                return probe(*args, **kwargs)

            module.store_out_of_reach = slow_probe

        spec.loader.exec_module = exec_module
        return spec


if DELAY_S > 0:
    sys.meta_path.insert(0, _SlowJudging())
