"""Where each unit stands: the batch system's state while its job is known there, then what its files say."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from channelsmith.batch import JobState
from channelsmith.build import JobResult
from channelsmith.scheduler.backend import Backend
from channelsmith.scheduler.state import ScheduledBuild, Unit, UnitFiles, read_result

# Shown for a unit whose every package the channel already lists: no job is submitted for it.
IN_CHANNEL = "IN CHANNEL"
# Characters at the end of a job's log where the batch system's kill line is looked for.
_LOG_TAIL = 16384


@dataclass(frozen=True)
class UnitStatus:
    """Where one unit stands: the batch system's state while its job is known there, then what its files say."""

    unit: Unit
    files: UnitFiles
    state: str
    reason: str
    elapsed_s: float | None
    ended: bool
    ok: bool
    results: tuple[JobResult, ...] = ()


def unit_statuses(scheduled: ScheduledBuild, known: Mapping[str, JobState] | None = None) -> list[UnitStatus]:
    """Every unit's status, from the batch system (squeue or qstat, asked now unless ``known`` is given)
    and the files its job wrote.

    The batch system must be asked before the files are read: a job that ends between the two reads has
    then written its result, and is judged by it. An older answer only delays seeing a job that ended
    without one.
    """
    if known is None:
        known = scheduled.backend.job_states(scheduled.job_ids)
    return [_status(scheduled, unit, known.get(unit.job_id or "")) for unit in scheduled.units]


def _status(scheduled: ScheduledBuild, unit: Unit, job: JobState | None) -> UnitStatus:
    files = scheduled.files(unit)
    if unit.job_id is None:
        return UnitStatus(unit, files, IN_CHANNEL, "", None, ended=True, ok=True)
    elapsed = _elapsed(files)
    result = read_result(files)
    # A job the batch system killed can still write a failed result: its build's script died of the kill
    # and the job wrote that the build failed before it ended itself (1 of 15 scancels on a busy node).
    # The kill is the cause: such a job is judged as one that ended without a result.
    killed = result is not None and not result[0] and scheduled.backend.kill_cause_in_log(log_tail(files.log)) is not None
    if result is not None and not killed:
        ok, results = result
        if ok and scheduled.published is None:
            gone = [p.file.name for r in results for p in r.packages if not p.file.is_file()]
            if gone:
                return UnitStatus(unit, files, "STALE", f"its packages are gone: {', '.join(gone)}", elapsed,
                                  ended=True, ok=False, results=results)  # fmt: skip
        return UnitStatus(unit, files, "COMPLETED" if ok else "FAILED", "", elapsed, True, ok, results)
    if job is not None and not job.ended:
        reason = "" if job.reason in ("None", "") else job.reason
        return UnitStatus(unit, files, job.state, reason, elapsed, ended=False, ok=False)
    state, reason = ended_without_result(scheduled.backend, job, files.log)
    return UnitStatus(unit, files, state, reason, elapsed, ended=True, ok=False)


def ended_without_result(adapter: Backend, job: JobState | None, log: Path) -> tuple[str, str]:
    """The state and the reason of a job that ended without writing its result: the cause the batch
    system gives (its time limit, a deletion and by whom, a node failure, ...), or, once it has
    forgotten the job, the line it wrote into the job's log when it killed it."""
    if job is None:
        cause = adapter.kill_cause_in_log(log_tail(log))
        return "ENDED", cause or f"no result: {adapter.LABEL} no longer knows the job"
    if job.dependency_failed:
        return "CANCELLED", "a job it depends on failed"
    return job.state, job.reason if job.reason not in ("", "None") else "no result"


def log_tail(log: Path) -> str:
    """The end of a job's log ("" when there is none yet)."""
    try:
        with log.open("rb") as handle:
            handle.seek(max(0, log.stat().st_size - _LOG_TAIL))
            return handle.read().decode(errors="replace")
    except OSError:
        return ""


def _elapsed(files: UnitFiles) -> float | None:
    try:
        started = float(files.started.read_text())
    except (OSError, ValueError):
        return None
    try:
        finished = float(json.loads(files.result.read_text())["finished"])
    except (OSError, ValueError, KeyError, TypeError):
        finished = time.time()
    return max(0.0, finished - started)
