"""PyTorch's own NCCL watchdog, set so that a dead peer is the watcher's to handle, not the end of the process.

``ProcessGroupNCCL`` reads these variables when a group is made. With PyTorch's defaults a peer that dies
or leaves a group kills the survivors: over NCCL's network transport (every multi-node job) the survivor's
communicator records the closed connection as an error, its watchdog waits 4 x
``TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC`` (60 s) for a debug dump and then, under
``TORCH_NCCL_ASYNC_ERROR_HANDLING=3`` (the default), rethrows in its thread: SIGABRT; the heartbeat monitor
(``TORCH_NCCL_ENABLE_MONITORING``) ends the process as well, whatever the error handling (pytorch#155916).
On one H100 with stock PyTorch 2.11.0, the HSDP example failed 3 of 12 runs that way and a DDP shrink
waited out its 60 s behind the watchdog (docs/howto/survive-a-dead-rank.md, "PyTorch's watchdog").

So importing ``torch_peer_watcher`` arranges (:func:`install`) that every process group made afterwards,
in this process or in one forked from it, is made under the values below wherever the job's environment
does not name them (the flavor's activation sets the same); a value the user set stays, and
:func:`refusal` then says why the watcher cannot watch an NCCL group under it. Groups made before the
import were made under whatever the environment held then; :func:`refusal` names those too.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from torch_peer_watcher import c10dhook


@dataclass(frozen=True)
class WatchdogSetting:
    """One of PyTorch's NCCL variables: the value the watcher sets, and which values it cannot work with."""

    name: str
    value: str
    # PyTorch's default when the variable is unset, as the message names it.
    pytorch_default: str
    why: str
    # The older name PyTorch still reads (the current name wins where both are set), and the release that
    # brought the current name: before it, the watcher sets the older one.
    legacy: str | None = None
    renamed_in: tuple[int, int] = (0, 0)
    # Values under which a watched NCCL group cannot survive a peer's death; None: any value works.
    allowed: frozenset[str] | None = None

    def current(self, env: MutableMapping[str, str]) -> str | None:
        """The value PyTorch reads from ``env``, or None where neither name is set."""
        if self.name in env:
            return env[self.name]
        return env.get(self.legacy) if self.legacy else None

    def name_for(self, torch_version: tuple[int, int] | None) -> str:
        """The name this PyTorch reads (the current one where the version is not known)."""
        old = self.legacy is not None and torch_version is not None and torch_version < self.renamed_in
        return self.legacy if old and self.legacy else self.name

    def conflict(self, env: MutableMapping[str, str]) -> str | None:
        """Why ``env``'s value (or PyTorch's default, where unset) stops the watcher; None if it works."""
        if self.allowed is None:
            return None
        value = self.current(env)
        if value is not None and value.strip() in self.allowed:
            return None
        shown = f"{self.name} unset (PyTorch's default {self.pytorch_default})" if value is None else \
            f"{self.name}={value}" if self.name in env else f"{self.legacy}={value}"  # fmt: skip
        return f"{shown}: {self.why}; set {self.name}={self.value}"


SETTINGS = (
    WatchdogSetting(
        "TORCH_NCCL_ASYNC_ERROR_HANDLING", "2", "3",
        "1 and 3 end the process when a collective fails, and a peer's death fails the survivors' collectives "
        "(2, CleanUpOnly, aborts the failed communicators and raises in Python; 0 leaves them to the watcher)",
        legacy="NCCL_ASYNC_ERROR_HANDLING", allowed=frozenset({"0", "2"}),
    ),
    WatchdogSetting(
        "TORCH_NCCL_ENABLE_MONITORING", "0", "1",
        "the heartbeat monitor ends the process with SIGABRT after a failed collective, whatever "
        "TORCH_NCCL_ASYNC_ERROR_HANDLING says (pytorch#155916)",
        allowed=frozenset({"0"}),
    ),
    WatchdogSetting(
        "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC", "0", "15000",
        "the watchdog waits 4 times this long (60 s by default) for a debug dump before it acts on a failed "
        "collective, and a shrink of that group waited behind it",
        allowed=frozenset({"0"}),
    ),
    WatchdogSetting(
        "TORCH_NCCL_DUMP_ON_TIMEOUT", "0", "1",
        "on a failed collective the watchdog signals a debug dump to every rank through the job's store, and the "
        "watcher's agreement on a shrink shares that store connection; any value works",
    ),
    WatchdogSetting(
        "TORCH_FR_BUFFER_SIZE", "0", "2000",
        "the flight recorder symbolizes its stack traces before the abort (up to 8 s); any value works",
        # PyTorch >= 2.8 warns in every process where the older name is set.
        legacy="TORCH_NCCL_TRACE_BUFFER_SIZE", renamed_in=(2, 8),
    ),
    WatchdogSetting(
        "NCCL_SET_THREAD_NAME", "1", "0",
        "NCCL names its proxy threads only under 1, and the proxy waker (TORCH_PEER_WATCHER_WAKE_NCCL_PROXY) tells "
        "them by name: under 0 an abort waits out the proxy's 500 ms poll(); any value works",
    ),
)  # fmt: skip

# Set on the c10d module once its group maker is wrapped.
_PATCHED = "_torch_peer_watcher_watchdog"
# Why NCCL groups made before the import may run under settings the watcher cannot work with (None: none were).
_made_before: str | None = None


def apply_defaults(env: MutableMapping[str, str] | None = None) -> list[str]:
    """Set every variable of :data:`SETTINGS` that ``env`` (default ``os.environ``) names under neither of
    its names; returns those set."""
    env = os.environ if env is None else env
    version = _torch_version()
    applied = []
    for setting in SETTINGS:
        if setting.current(env) is None:
            name = setting.name_for(version)
            env[name] = setting.value
            applied.append(name)
    return applied


def conflicts(env: MutableMapping[str, str] | None = None) -> list[str]:
    """What in ``env`` (default ``os.environ``) would stop a watched NCCL group from surviving a peer's death."""
    env = os.environ if env is None else env
    return [why for setting in SETTINGS if (why := setting.conflict(env)) is not None]


def refusal() -> str | None:
    """Why the watcher cannot watch an NCCL group of this process, or None: the settings its groups are made
    under now, and those the NCCL groups made before the import were made under."""
    reasons = conflicts()
    if _made_before is not None:
        reasons.append(_made_before)
    if not reasons:
        return None
    return (
        "PyTorch's NCCL watchdog would end this process (or stall its recovery) when a peer dies: "
        + "; ".join(reasons)
        + ". Export these in the job script, or import torch_peer_watcher before init_process_group, "
        "which sets them for every group made after it where the environment does not name them"
    )


def install() -> None:
    """Make every process group that ``torch.distributed`` makes from now on under :data:`SETTINGS`'s values
    (where the environment names none): wraps ``distributed_c10d._new_process_group_helper``, which
    ``init_process_group`` and ``new_group`` call, as soon as the module is imported. Imports no torch."""
    c10dhook.when_imported(_patch)


def _patch(c10d: Any) -> None:
    global _made_before
    if getattr(c10d, _PATCHED, False):
        return
    setattr(c10d, _PATCHED, True)
    earlier = _nccl_groups(c10d)
    why = conflicts()
    if earlier and why:
        _made_before = (f"{earlier} NCCL process group(s) were made before torch_peer_watcher was imported, under "
                        f"{', '.join(w.split(':')[0] for w in why)}")  # fmt: skip
    for name in ("_new_process_group_helper", "init_process_group", "new_group"):
        maker = getattr(c10d, name, None)
        if maker is not None:
            # The first of these that exists: init_process_group and new_group call the helper by its name.
            setattr(c10d, name, _made_under_defaults(maker))
            return


def _made_under_defaults(maker: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(maker)
    def make(*args: Any, **kwargs: Any) -> Any:
        # Again at every group: a process forked from this one (a fork server) may have another environment.
        apply_defaults()
        return maker(*args, **kwargs)

    return make


def _nccl_groups(c10d: Any) -> int:
    """How many of the groups ``c10d`` already made run on NCCL."""
    count = 0
    for group in list(getattr(getattr(c10d, "_world", None), "pg_map", {}) or {}):
        try:
            if "nccl" in str(c10d.get_backend(group)).lower():
                count += 1
        except (RuntimeError, ValueError, AttributeError):
            continue
    return count


def _torch_version() -> tuple[int, int] | None:
    """(major, minor) of the torch this process imported, or None (not imported, or not read)."""
    torch = sys.modules.get("torch")
    try:
        major, minor = str(getattr(torch, "__version__", "")).split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        return None
