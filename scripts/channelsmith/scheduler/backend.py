"""The batch systems a build can be submitted to, each an adapter module with the same interface.

This is the one place where Slurm and PBS are told apart; the plan, the state file, the status, the
submission and the collection call the adapter of the build's batch system through it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any, Protocol

from channelsmith import pbs, slurm
from channelsmith.batch import JobState


class Backend(Protocol):
    """What an adapter module provides (channelsmith.slurm, channelsmith.pbs)."""

    LABEL: str
    CANCEL_COMMAND: str
    Options: type

    def check_cluster(self, options: Any) -> None: ...

    def submit(
        self, script: Path, options: Any, log: Path, after_ok: Iterable[str] = (), name: str | None = None
    ) -> str: ...

    def job_states(self, job_ids: Iterable[str]) -> dict[str, JobState]: ...

    def cancel(self, job_ids: Iterable[str]) -> None: ...

    def kill_cause_in_log(self, text: str) -> str | None: ...


BACKENDS: Mapping[str, Backend] = {"slurm": slurm, "pbs": pbs}  # type: ignore[dict-item]


def backend(name: str) -> Backend:
    return BACKENDS[name]


def options_document(options: Any) -> dict[str, Any]:
    """An adapter's options as JSON (every options type is a dataclass whose ``extra`` is a tuple)."""
    return {**asdict(options), "extra": list(options.extra)}


def options_from_document(name: str, document: Mapping[str, Any]) -> Any:
    return backend(name).Options(**{**document, "extra": tuple(document["extra"])})
