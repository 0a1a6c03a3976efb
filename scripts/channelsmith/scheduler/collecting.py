"""Collecting: wait until no job of the build is pending or running, then publish every unit's packages
at once when all succeeded (or nothing); and cancelling a build's jobs."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar

from channelsmith import channel
from channelsmith.batch import JobState
from channelsmith.build import BuildReport, JobResult
from channelsmith.errors import SchedulerError
from channelsmith.scheduler.backend import Backend
from channelsmith.scheduler.state import interrupts_deferred, load, locked, save
from channelsmith.scheduler.status import IN_CHANNEL, UnitStatus, unit_statuses

# How often a waiting command looks at its jobs. The result files, which a job writes as it ends,
# are read every FILE_POLL_S seconds (a stat on the shared file system). The batch system (squeue,
# qstat), which shows pending and running jobs and those that ended without a result, is asked after
# FILE_POLL_S, then twice as long each time, up to $CHANNELSMITH_POLL_INTERVAL (default 5 s), to spare
# its server.
POLL_ENV = "CHANNELSMITH_POLL_INTERVAL"
DEFAULT_POLL_S = 5.0
FILE_POLL_S = 0.25

Judged = TypeVar("Judged")


@dataclass
class ScheduledReport:
    """The outcome of collecting a scheduled build."""

    build_dir: Path
    statuses: list[UnitStatus]
    report: BuildReport

    @property
    def ok(self) -> bool:
        return all(s.ok for s in self.statuses)

    @property
    def failed(self) -> list[UnitStatus]:
        return [s for s in self.statuses if s.ended and not s.ok]


class StatusObserver(Protocol):
    """Receives every unit's status each time the waiting command asks the batch system (the live table)."""

    def update(self, statuses: Sequence[UnitStatus]) -> None: ...


class _NoDisplay:
    def update(self, statuses: Sequence[UnitStatus]) -> None:
        return None


def poll_interval() -> float:
    """The longest wait between two looks at the jobs ($CHANNELSMITH_POLL_INTERVAL, default 5 s)."""
    text = os.environ.get(POLL_ENV, "")
    try:
        value = float(text) if text else DEFAULT_POLL_S
    except ValueError:
        value = -1.0
    if value <= 0:
        raise SchedulerError(
            f"{POLL_ENV}={text!r} is not a positive number of seconds", hint=f"unset {POLL_ENV} or set e.g. 5"
        )
    return value


def watch(
    adapter: Backend,
    job_ids: Sequence[str],
    judge: Callable[[Mapping[str, JobState]], Judged],
    ended: Callable[[Judged], bool],
    update: Callable[[Judged], None],
) -> Judged:
    """Look at jobs until ``ended`` says they are done; returns the last judgement.

    ``judge`` turns the batch system's states into what the caller shows (reading the jobs' files
    each time), ``update`` receives every judgement (the live display). The files are read every
    FILE_POLL_S; the batch system is asked less and less often (see POLL_ENV).
    """
    longest = poll_interval()
    interval = min(FILE_POLL_S, longest)
    asked = float("-inf")
    known: Mapping[str, JobState] = {}
    while True:
        if time.monotonic() - asked >= interval:
            known = adapter.job_states(job_ids)
            asked = time.monotonic()
            interval = min(2 * interval, longest)
        judged = judge(known)
        update(judged)
        if ended(judged):
            return judged
        time.sleep(FILE_POLL_S)


def collect(build_dir: Path, observer: StatusObserver | None = None) -> ScheduledReport:
    """Wait until no job of the build is pending or running, then publish everything if all succeeded.

    Nothing is published when any unit failed, was cancelled or lost its result; the report says
    which and names their logs. A build already published is reported again, unchanged.
    """
    observer = observer or _NoDisplay()
    build_dir = build_dir.resolve()
    scheduled = load(build_dir)
    statuses = watch(
        scheduled.backend,
        scheduled.job_ids,
        lambda known: unit_statuses(scheduled, known),
        lambda current: all(s.ended for s in current),
        observer.update,
    )
    report = BuildReport(channel=scheduled.request.channel_dir, results=_results(statuses))
    if all(s.ok for s in statuses):
        report.published = _publish(build_dir, report)
    return ScheduledReport(build_dir, statuses, report)


def _publish(build_dir: Path, report: BuildReport) -> list[Path]:
    """Publish every unit's packages at once (under the build directory's lock, once), then free the
    output directories. An interrupt waits until the channel is whole again."""
    with locked(build_dir), interrupts_deferred(then_raise=False):
        scheduled = load(build_dir)
        if scheduled.published is None:
            packages = [p.file for r in report.results for p in r.packages]
            scheduled.published = channel.publish(scheduled.request.channel_dir, packages) if packages else []
            save(scheduled)
            for unit in scheduled.units:
                shutil.rmtree(scheduled.files(unit).output, ignore_errors=True)
        return list(scheduled.published)


def _results(statuses: Sequence[UnitStatus]) -> list[JobResult]:
    """One JobResult per engine call, as a direct build reports them; a unit without results gets one
    for its first call, saying why."""
    results: list[JobResult] = []
    for status in statuses:
        unit = status.unit
        if status.state in ("COMPLETED", "FAILED"):
            results.extend(status.results)
        elif status.state == IN_CHANNEL:
            results.extend(
                JobResult(unit.recipe, variant, shown, ok=True, seconds=0.0,
                          in_channel=list(unit.in_channel) if index == 0 else [])
                for index, (variant, shown) in enumerate(zip(unit.variants, unit.distinguishing))
            )  # fmt: skip
        elif status.ended:
            results.append(
                JobResult(unit.recipe, unit.variants[0], unit.distinguishing[0], ok=False,
                          seconds=status.elapsed_s or 0.0,
                          error=f"job {unit.job_id} ended {status.state} ({status.reason}); log: {status.files.log}")
            )  # fmt: skip
    return results


def cancel(build_dir: Path) -> list[str]:
    """Cancel every pending or running job of the build; returns their ids."""
    scheduled = load(build_dir.resolve())
    active = [s.unit.job_id for s in unit_statuses(scheduled) if not s.ended and s.unit.job_id]
    scheduled.backend.cancel(active)
    return active
