"""Submitting: one batch job per unit that is neither done nor running, each waiting (afterok) for the
units it depends on; a refusal or an interrupt half-way withdraws what this submission started."""

from __future__ import annotations

import shlex
import shutil
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import channelsmith
from channelsmith import preflight
from channelsmith.build import ENGINE_SOURCE_CACHE, channel_identities, channel_in_use, engine_channels, plan_jobs
from channelsmith.errors import SchedulerError
from channelsmith.scheduler.backend import backend
from channelsmith.scheduler.planning import plan_units
from channelsmith.scheduler.state import (
    STATE_FILE,
    UNITS_DIR,
    BuildRequest,
    ScheduledBuild,
    Unit,
    interrupts_deferred,
    load,
    locked,
    save,
)
from channelsmith.scheduler.status import UnitStatus, unit_statuses
from channelsmith.sources import cache_root


def submit(request: BuildRequest, scheduler: str, options: Any, build_dir: Path) -> ScheduledBuild:
    """Submit one batch job per unit that is neither done nor running; returns the build's state.

    Everything that can be refused is checked before the first job is submitted (recipes, variants,
    the channel and that it can be written, room for the packages, the channels and sources the jobs
    download from, as seen from this machine; the batch system ``scheduler`` ("slurm", "pbs") and the
    job ``options`` of its adapter: SchedulerError and the rest of the UserError family). A refusal or
    an interrupt half-way cancels the jobs this call submitted.
    """
    request = BuildRequest(
        root=request.root.resolve(),
        recipes=tuple(request.recipes),
        overrides=dict(request.overrides),
        channel_dir=request.channel_dir.resolve(),
        extra_channels=tuple(request.extra_channels),
        run_tests=request.run_tests,
    )
    build_dir = build_dir.resolve()
    jobs = plan_jobs(request.root, request.recipes, request.overrides)
    units = plan_units(request, jobs)
    base_channels = engine_channels(request.channel_dir, request.extra_channels)
    local = 1 if channel_in_use(request.channel_dir) else 0
    listed = channel_identities(request.channel_dir) if local else set()
    planned = [o for job in jobs for o in job.outputs if o.identity not in listed]
    source_cache = cache_root() / ENGINE_SOURCE_CACHE
    preflight.check_ready(request.channel_dir, request.extra_channels, planned, build_dir, source_cache)
    adapter = backend(scheduler)
    adapter.check_cluster(options)
    if build_dir.exists() and not build_dir.is_dir():
        raise SchedulerError(f"{build_dir} is not a directory", hint="pass another --build-dir")
    scheduled = ScheduledBuild(build_dir, request, scheduler, options, units)
    created = not build_dir.exists()
    with locked(build_dir):
        previous = _previous_statuses(build_dir, {u.id for u in units})
        by_id = {u.id: u for u in units}
        done = {i for i, s in previous.items() if s.ok}
        submitted: list[str] = []
        try:
            for unit in units:
                upstream = _upstream(unit, by_id)
                unit.channels = (
                    base_channels[:local]
                    + [scheduled.files(u).output.as_uri() for u in upstream]
                    + base_channels[local:]
                )
                earlier = previous.get(unit.id)
                if earlier is not None and earlier.unit.job_id and (earlier.ok or not earlier.ended):
                    unit.job_id = earlier.unit.job_id
                    continue
                if not unit.builds:
                    continue
                files = scheduled.files(unit)
                shutil.rmtree(files.dir, ignore_errors=True)
                files.dir.mkdir(parents=True)
                files.script.write_text(_job_script(build_dir, unit))
                files.script.chmod(0o755)
                waits = [by_id[d].job_id for d in unit.depends_on if by_id[d].job_id and d not in done]
                unit.job_id = adapter.submit(
                    files.script, options, after_ok=waits, log=files.log, name=f"channelsmith-{unit.recipe}"
                )
                submitted.append(unit.job_id)
                # Written after every submission, so that no job id is ever lost.
                save(scheduled)
        except BaseException:
            _withdraw(scheduled, submitted)
            if created and not submitted:
                # Refused at the first submission (PBS has no trial submission; qsub judges the
                # options there): nothing ran, so nothing is left behind.
                shutil.rmtree(build_dir, ignore_errors=True)
            raise
        for stale in _unit_dirs(build_dir) - set(by_id):
            shutil.rmtree(build_dir / UNITS_DIR / stale, ignore_errors=True)
        save(scheduled)
    return scheduled


def _upstream(unit: Unit, by_id: Mapping[str, Unit]) -> list[Unit]:
    """Every unit this one depends on, directly or through others, in dependency order."""
    seen: dict[str, Unit] = {}

    def visit(current: Unit) -> None:
        for dep in current.depends_on:
            if dep not in seen:
                visit(by_id[dep])
                seen[dep] = by_id[dep]

    visit(unit)
    return list(seen.values())


def _previous_statuses(build_dir: Path, planned: set[str]) -> dict[str, UnitStatus]:
    """The units of an earlier submission into ``build_dir``, by id; SchedulerError when jobs of another
    build still run there (their output would be lost)."""
    if not (build_dir / STATE_FILE).exists():
        return {}
    previous = load(build_dir)
    if previous.published is not None:
        return {}  # every job of a published build ended, and its output directories are gone
    statuses = {s.unit.id: s for s in unit_statuses(previous)}
    foreign = [s for s in statuses.values() if not s.ended and s.unit.id not in planned]
    if foreign:
        jobs = ", ".join(f"{s.unit.job_id} ({s.unit.label})" for s in foreign)
        raise SchedulerError(
            f"{build_dir} holds jobs of another build that are still pending or running: {jobs}",
            hint=f"wait for them (channelsmith build --collect {build_dir}), cancel them "
            f"({previous.backend.CANCEL_COMMAND}), "
            "or pass another --build-dir",
        )
    return statuses


def _withdraw(scheduled: ScheduledBuild, submitted: Sequence[str]) -> None:
    """Cancel the jobs one submission made before it failed, and forget them."""
    with interrupts_deferred():
        if submitted:
            scheduled.backend.cancel(submitted)
        for unit in scheduled.units:
            if unit.job_id in submitted:
                unit.job_id = None
        save(scheduled)


def _job_script(build_dir: Path, unit: Unit) -> str:
    """The batch script: this Python, with this channelsmith on its path, runs the unit."""
    package_root = Path(channelsmith.__file__).resolve().parent.parent
    command = shlex.join([sys.executable, "-m", "channelsmith.scheduler", str(build_dir), unit.id])
    return (
        "#!/bin/bash\n"
        f"# channelsmith batch job: {unit.label} (unit {unit.id})\n"
        "set -euo pipefail\n"
        f"export PYTHONPATH={shlex.quote(str(package_root))}${{PYTHONPATH:+:$PYTHONPATH}}\n"
        f"exec {command}\n"
    )


def _unit_dirs(build_dir: Path) -> set[str]:
    units_dir = build_dir / UNITS_DIR
    return {p.name for p in units_dir.iterdir() if p.is_dir()} if units_dir.is_dir() else set()
