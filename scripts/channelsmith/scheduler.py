"""Builds as batch jobs of the cluster's scheduler (Slurm), published all at once when every job succeeded.

The engine calls are the ones a direct build makes (channelsmith.build.plan_jobs), grouped into units:
the calls that share one engine output directory (a staging compile and every Python version reusing
it) form one unit, every other call a unit of its own. Each unit is one batch job that builds into its
own directory below the build directory and publishes nothing; the build directory, the repository and
the channel directory must therefore be on a file system the compute nodes share. A unit waits
(afterok) for every unit that builds a package one of its outputs requires (a build, host or run
requirement the package matches: nccl before the PyTorch flavors), and for the unit that builds an
output it renders too (a noarch library every Python version pins); their output directories are its
channels, right after the local channel.

The build directory holds ``state.json`` (the request and every unit with its job id) and, per unit,
``units/<id>/`` with the job script, its log, and the job's ``result.json``. Whoever can read it can
collect: the command that submitted, or ``channelsmith build --collect DIR`` after a logout. Collecting
waits until no job is pending or running; when every unit has a successful result, all their packages
are published with channelsmith.channel.publish in one go, as a direct build publishes; otherwise the
channel is not touched. Submitting the same build again keeps the units that succeeded or still run
and submits the others afresh.

Run as ``python -m channelsmith.scheduler BUILD_DIR UNIT_ID``, this module is the batch job itself.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shlex
import shutil
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from rattler import BuildString, MatchSpec, PackageRecord

from channelsmith import channel, slurm
from channelsmith.build import (
    BuildJob,
    BuildReport,
    BuiltPackage,
    JobResult,
    build_unpublished,
    channel_identities,
    channel_in_use,
    engine_channels,
    plan_jobs,
    shared_output,
)
from channelsmith.errors import SchedulerError, UserError

Identity = tuple[str, str, str]

DEFAULT_BUILD_DIR = Path("channelsmith-jobs")
STATE_FILE = "state.json"
STATE_VERSION = 1
UNITS_DIR = "units"

# How often a waiting command looks at its jobs. The result files, which a job writes as it ends,
# are read every FILE_POLL_S seconds (a stat on the shared file system). squeue, which shows pending
# and running jobs and those that ended without a result, is asked after FILE_POLL_S, then twice as
# long each time, up to $CHANNELSMITH_POLL_INTERVAL (default 5 s), to spare the controller.
POLL_ENV = "CHANNELSMITH_POLL_INTERVAL"
DEFAULT_POLL_S = 5.0
FILE_POLL_S = 0.25

# Requirements that must exist before a unit runs: build and host ones to build, run ones for the tests.
REQUIREMENT_KINDS = ("build", "host", "run")

# Shown for a unit whose every package the channel already lists: no job is submitted for it.
IN_CHANNEL = "IN CHANNEL"


@dataclass(frozen=True)
class BuildRequest:
    """What to build, against and into which channel: the arguments of ``channelsmith build``."""

    root: Path
    recipes: tuple[str, ...]
    overrides: dict[str, str]
    channel_dir: Path
    extra_channels: tuple[str, ...] = ()
    run_tests: bool = True


@dataclass
class Unit:
    """One batch job: the engine calls that share an output directory."""

    id: str
    recipe: str
    label: str
    variants: list[dict[str, str]]
    distinguishing: list[dict[str, str]]
    builds: list[Identity]
    built_elsewhere: list[Identity]
    in_channel: list[Identity]
    depends_on: list[str]
    channels: list[str] = field(default_factory=list)
    job_id: str | None = None


@dataclass(frozen=True)
class UnitFiles:
    """Where one unit's batch job keeps its script, log, output directory and result."""

    dir: Path

    @property
    def script(self) -> Path:
        return self.dir / "job.sh"

    @property
    def log(self) -> Path:
        return self.dir / "job.log"

    @property
    def started(self) -> Path:
        return self.dir / "started"

    @property
    def result(self) -> Path:
        return self.dir / "result.json"

    @property
    def output(self) -> Path:
        return self.dir / "out"


@dataclass
class ScheduledBuild:
    """The content of a build directory's state file."""

    build_dir: Path
    request: BuildRequest
    options: slurm.SlurmOptions
    units: list[Unit]
    published: list[Path] | None = None

    def files(self, unit: Unit) -> UnitFiles:
        return UnitFiles(self.build_dir / UNITS_DIR / unit.id)

    @property
    def job_ids(self) -> list[str]:
        return [u.job_id for u in self.units if u.job_id]


@dataclass(frozen=True)
class UnitStatus:
    """Where one unit stands: Slurm's state while its job is known there, then what its files say."""

    unit: Unit
    files: UnitFiles
    state: str
    reason: str
    elapsed_s: float | None
    ended: bool
    ok: bool
    results: tuple[JobResult, ...] = ()


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
    """Receives every unit's status each time the waiting command asks Slurm (the CLI's live table)."""

    def update(self, statuses: Sequence[UnitStatus]) -> None: ...


class _NoDisplay:
    def update(self, statuses: Sequence[UnitStatus]) -> None:
        return None


# ---------------------------------------------------------------------------------------------------
# Planning: units and their dependencies


def plan_units(request: BuildRequest) -> list[Unit]:
    """The batch jobs of a build, in an order where every unit comes after the units it depends on.

    Raises what plan_jobs raises for bad recipes or variants, and SchedulerError when recipes of the
    call require each other's packages in a cycle.
    """
    jobs = plan_jobs(request.root, request.recipes, request.overrides)
    listed = channel_identities(request.channel_dir) if channel_in_use(request.channel_dir) else set()
    groups: dict[tuple[str, str], list[BuildJob]] = {}
    for index, job in enumerate(jobs):
        groups.setdefault((job.recipe.name, shared_output(job) or f"job-{index}"), []).append(job)

    owner: dict[Identity, int] = {}
    reported: set[Identity] = set()
    units: list[Unit] = []
    needs: list[set[int]] = []
    for members in groups.values():
        rendered = list(dict.fromkeys(o.identity for job in members for o in job.outputs))
        builds = [i for i in rendered if i not in listed and i not in owner]
        elsewhere = [i for i in rendered if i not in listed and i in owner]
        in_channel = [i for i in rendered if i in listed and i not in reported]
        reported.update(in_channel)
        for identity in builds:
            owner[identity] = len(units)
        needs.append({owner[i] for i in elsewhere})
        recipe = members[0].recipe.name
        variants = [dict(job.variant) for job in members]
        key = json.dumps([recipe, variants, builds], sort_keys=True)
        units.append(
            Unit(
                id=f"{recipe}-{hashlib.sha256(key.encode()).hexdigest()[:10]}",
                recipe=recipe,
                label=_unit_label(members),
                variants=variants,
                distinguishing=[dict(job.distinguishing) for job in members],
                builds=builds,
                built_elsewhere=elsewhere,
                in_channel=in_channel,
                depends_on=[],
            )
        )

    providers = [(index, _record(identity)) for identity, index in owner.items()]
    for index, members in enumerate(groups.values()):
        for spec in _requirement_specs(members):
            needs[index].update(j for j, record in providers if j != index and spec.matches(record))
    order = _dependency_order(units, needs)
    for index, unit in enumerate(units):
        unit.depends_on = [units[j].id for j in sorted(needs[index])]
    return [units[i] for i in order]


def _unit_label(members: Sequence[BuildJob]) -> str:
    """``recipe [k=v ...]``; a key whose value differs between the unit's calls lists every value."""
    values: dict[str, list[str]] = {}
    for job in members:
        for key, value in job.distinguishing.items():
            values.setdefault(key, [])
            if value not in values[key]:
                values[key].append(value)
    recipe = members[0].recipe.name
    if not values:
        return recipe
    shown = " ".join(f"{key}={','.join(found)}" for key, found in sorted(values.items()))
    return f"{recipe} [{shown}]"


def _record(identity: Identity) -> PackageRecord:
    name, version, build_string = identity
    return PackageRecord(name=name, version=version, build=BuildString(build_string), build_number=0, subdir="noarch")


def _requirement_specs(members: Sequence[BuildJob]) -> list[MatchSpec]:
    """Every plain requirement of the unit's outputs as a match spec.

    Pins (``pin_subpackage``, ``pin_compatible``) are left out: they name a sibling output, which the
    unit renders itself, or a host requirement, which is listed on its own.
    """
    specs: dict[str, MatchSpec] = {}
    for job in members:
        for output in job.outputs:
            for kind in REQUIREMENT_KINDS:
                for text in output.requirements.get(kind, ()):
                    if text.startswith("{") or text in specs:
                        continue
                    try:
                        specs[text] = MatchSpec(text)
                    except Exception:  # rattler raises its own parse error types; the engine reports them
                        continue
    return list(specs.values())


def _dependency_order(units: Sequence[Unit], needs: Sequence[set[int]]) -> list[int]:
    """Unit indices, each after every unit it needs (Kahn's algorithm); SchedulerError on a cycle."""
    waiting = {i: set(n) for i, n in enumerate(needs)}
    order: list[int] = []
    while waiting:
        ready = sorted(i for i, n in waiting.items() if not n - set(order))
        if not ready:
            stuck = ", ".join(units[i].label for i in sorted(waiting))
            raise SchedulerError(
                f"recipes of this build require each other's packages in a cycle (among: {stuck})",
                hint="build one of them first on its own, then the others against the channel",
            )
        for i in ready:
            order.append(i)
            del waiting[i]
    return order


# ---------------------------------------------------------------------------------------------------
# Submitting


def submit(request: BuildRequest, options: slurm.SlurmOptions, build_dir: Path) -> ScheduledBuild:
    """Submit one batch job per unit that is neither done nor running; returns the build's state.

    Everything that can be refused is checked before the first job is submitted (recipes, variants,
    the channel, Slurm and the job options: SchedulerError and the rest of the UserError family). A
    refusal or an interrupt half-way cancels the jobs this call submitted.
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
    units = plan_units(request)
    base_channels = engine_channels(request.channel_dir, request.extra_channels)
    local = 1 if channel_in_use(request.channel_dir) else 0
    slurm.check_cluster(options)
    if build_dir.exists() and not build_dir.is_dir():
        raise SchedulerError(f"{build_dir} is not a directory", hint="pass another --build-dir")
    scheduled = ScheduledBuild(build_dir, request, options, units)
    with _locked(build_dir):
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
                unit.job_id = slurm.submit(
                    files.script, options, after_ok=waits, log=files.log, name=f"channelsmith-{unit.recipe}"
                )
                submitted.append(unit.job_id)
                # Written after every submission, so that no job id is ever lost.
                _save(scheduled)
        except BaseException:
            _withdraw(scheduled, submitted)
            raise
        for stale in _unit_dirs(build_dir) - set(by_id):
            shutil.rmtree(build_dir / UNITS_DIR / stale, ignore_errors=True)
        _save(scheduled)
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
            hint=f"wait for them (channelsmith build --collect {build_dir}), cancel them (scancel), "
            "or pass another --build-dir",
        )
    return statuses


def _withdraw(scheduled: ScheduledBuild, submitted: Sequence[str]) -> None:
    """Cancel the jobs one submission made before it failed, and forget them."""
    with _interrupts_deferred():
        if submitted:
            slurm.cancel(submitted)
        for unit in scheduled.units:
            if unit.job_id in submitted:
                unit.job_id = None
        _save(scheduled)


def _job_script(build_dir: Path, unit: Unit) -> str:
    """The batch script: this Python, with this channelsmith on its path, runs the unit."""
    package_root = Path(__file__).resolve().parent.parent
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


# ---------------------------------------------------------------------------------------------------
# Following the jobs


def unit_statuses(scheduled: ScheduledBuild, known: Mapping[str, slurm.JobState] | None = None) -> list[UnitStatus]:
    """Every unit's status, from squeue (asked now unless ``known`` is given) and the files its job wrote.

    squeue must be read before the files: a job that ends between the two reads has then written its
    result, and is judged by it. An older squeue answer only delays seeing a job that ended without one.
    """
    if known is None:
        known = slurm.job_states(scheduled.job_ids)
    return [_status(scheduled, unit, known.get(unit.job_id or "")) for unit in scheduled.units]


def _status(scheduled: ScheduledBuild, unit: Unit, job: slurm.JobState | None) -> UnitStatus:
    files = scheduled.files(unit)
    if unit.job_id is None:
        return UnitStatus(unit, files, IN_CHANNEL, "", None, ended=True, ok=True)
    elapsed = _elapsed(files)
    result = _read_result(files)
    if result is not None:
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
    if job is None:
        state, reason = "ENDED", "no result: Slurm no longer knows the job"
    elif job.state == "CANCELLED" and "Dependency" in job.reason:
        state, reason = "CANCELLED", "a job it depends on failed"
    else:
        state, reason = job.state, "no result"
    return UnitStatus(unit, files, state, reason, elapsed, ended=True, ok=False)


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


def collect(build_dir: Path, observer: StatusObserver | None = None) -> ScheduledReport:
    """Wait until no job of the build is pending or running, then publish everything if all succeeded.

    Nothing is published when any unit failed, was cancelled or lost its result; the report says
    which and names their logs. A build already published is reported again, unchanged.
    """
    observer = observer or _NoDisplay()
    build_dir = build_dir.resolve()
    scheduled = load(build_dir)
    longest = poll_interval()
    interval = min(FILE_POLL_S, longest)
    asked = float("-inf")
    while True:
        if time.monotonic() - asked >= interval:
            known = slurm.job_states(scheduled.job_ids)
            asked = time.monotonic()
            interval = min(2 * interval, longest)
        statuses = unit_statuses(scheduled, known)
        observer.update(statuses)
        if all(s.ended for s in statuses):
            break
        time.sleep(FILE_POLL_S)
    report = BuildReport(channel=scheduled.request.channel_dir, results=_results(statuses))
    if all(s.ok for s in statuses):
        report.published = _publish(build_dir, report)
    return ScheduledReport(build_dir, statuses, report)


def _publish(build_dir: Path, report: BuildReport) -> list[Path]:
    """Publish every unit's packages at once (under the build directory's lock, once), then free the
    output directories. An interrupt waits until the channel is whole again."""
    with _locked(build_dir), _interrupts_deferred(then_raise=False):
        scheduled = load(build_dir)
        if scheduled.published is None:
            packages = [p.file for r in report.results for p in r.packages]
            scheduled.published = channel.publish(scheduled.request.channel_dir, packages) if packages else []
            _save(scheduled)
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
    slurm.cancel(active)
    return active


# ---------------------------------------------------------------------------------------------------
# The batch job


class _JobLog:
    """Writes the engine's progress and its whole log to stdout, which Slurm keeps as the job's log."""

    def job_started(self, job: BuildJob, index: int, total: int) -> None:
        print(f"== channelsmith: {job.label} ({index + 1} of {total} in this job)", flush=True)

    def step(self, job: BuildJob, message: str) -> None:
        print(f"-- {message}", flush=True)

    def log(self, job: BuildJob, line: str) -> None:
        print(line, flush=True)

    def job_finished(self, job: BuildJob, result: JobResult) -> None:
        outcome = "built" if result.ok else f"FAILED: {result.error}"
        print(f"== channelsmith: {job.label} {outcome} ({result.seconds:.1f} s)", flush=True)


def run_unit(build_dir: Path, unit_id: str) -> int:
    """Build one unit into its output directory and write its result; the exit code of the batch job."""
    scheduled = load(build_dir)
    unit = next((u for u in scheduled.units if u.id == unit_id), None)
    if unit is None:
        print(f"channelsmith: {build_dir} has no unit {unit_id} (submitted again since?)", file=sys.stderr)
        return 2
    files = scheduled.files(unit)
    files.started.write_text(f"{time.time()}\n")
    print(f"channelsmith: {unit.label} on {socket.gethostname()}, output in {files.output}", flush=True)
    request = scheduled.request
    try:
        results = build_unpublished(
            _unit_jobs(request, unit),
            files.output,
            unit.channels,
            run_tests=request.run_tests,
            built_elsewhere=unit.built_elsewhere,
            in_channel=unit.in_channel,
            observer=_JobLog(),
        )
        ok = bool(results) and all(r.ok for r in results)
        built = {(p.name, p.version, p.build_string) for r in results for p in r.packages}
        missing = [i for i in unit.builds if i not in built]
        if ok and missing:
            ok = False
            results[-1].ok = False
            results[-1].error = (
                f"the recipe renders differently than when the job was submitted: {_identities(missing)} "
                "were not built; submit the build again"
            )
    except UserError as exc:
        ok = False
        first, shown = unit.variants[0], unit.distinguishing[0]
        results = [JobResult(unit.recipe, first, shown, ok=False, seconds=0.0, error=str(exc))]
        print(f"channelsmith: {exc}", flush=True)
    _write_json(files.result, {"ok": ok, "finished": time.time(), "results": [_result_document(r) for r in results]})
    print(f"channelsmith: {'done' if ok else 'FAILED'}", flush=True)
    return 0 if ok else 1


def _unit_jobs(request: BuildRequest, unit: Unit) -> list[BuildJob]:
    """The unit's engine calls, rendered again on the compute node exactly as the submitting side did."""
    jobs = {json.dumps(j.variant, sort_keys=True): j for j in plan_jobs(request.root, [unit.recipe], request.overrides)}
    chosen = [jobs.get(json.dumps(v, sort_keys=True)) for v in unit.variants]
    if any(job is None for job in chosen):
        raise SchedulerError(
            f"recipe {unit.recipe} no longer renders the variants this job was submitted for",
            hint="submit the build again",
        )
    return [job for job in chosen if job is not None]


def _identities(identities: Iterable[Identity]) -> str:
    return ", ".join("-".join(i) for i in identities)


# ---------------------------------------------------------------------------------------------------
# The state file


def load(build_dir: Path) -> ScheduledBuild:
    """The scheduled build kept in ``build_dir``; SchedulerError when there is none or it is unreadable."""
    state_file = build_dir / STATE_FILE
    try:
        document = json.loads(state_file.read_text())
    except FileNotFoundError:
        raise SchedulerError(
            f"{build_dir} holds no scheduled build (no {STATE_FILE})",
            hint="pass the --build-dir a `channelsmith build ... --scheduler slurm` used",
        ) from None
    except (OSError, ValueError) as exc:
        raise SchedulerError(f"cannot read {state_file}: {exc}", hint="submit the build again") from None
    if document.get("version") != STATE_VERSION:
        raise SchedulerError(
            f"{state_file} was written by another channelsmith (state version {document.get('version')})",
            hint="collect it with that version, or remove the directory and submit again",
        )
    req = document["request"]
    request = BuildRequest(
        root=Path(req["root"]),
        recipes=tuple(req["recipes"]),
        overrides=dict(req["overrides"]),
        channel_dir=Path(req["channel_dir"]),
        extra_channels=tuple(req["extra_channels"]),
        run_tests=bool(req["run_tests"]),
    )
    options = slurm.SlurmOptions(**{**document["slurm"], "extra": tuple(document["slurm"]["extra"])})
    units = []
    for entry in document["units"]:
        for key in ("builds", "built_elsewhere", "in_channel"):
            entry[key] = [tuple(i) for i in entry[key]]
        units.append(Unit(**entry))
    published = document["published"]
    return ScheduledBuild(
        build_dir=build_dir,
        request=request,
        options=options,
        units=units,
        published=None if published is None else [Path(p) for p in published],
    )


def _save(scheduled: ScheduledBuild) -> None:
    request = scheduled.request
    _write_json(
        scheduled.build_dir / STATE_FILE,
        {
            "version": STATE_VERSION,
            "request": {
                "root": str(request.root),
                "recipes": list(request.recipes),
                "overrides": request.overrides,
                "channel_dir": str(request.channel_dir),
                "extra_channels": list(request.extra_channels),
                "run_tests": request.run_tests,
            },
            "slurm": {**asdict(scheduled.options), "extra": list(scheduled.options.extra)},
            "units": [asdict(u) for u in scheduled.units],
            "published": None if scheduled.published is None else [str(p) for p in scheduled.published],
        },
    )


def _write_json(path: Path, document: Any) -> None:
    """Write a JSON file whole or not at all (a reader on another node never sees half of it)."""
    scratch = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    scratch.write_text(json.dumps(document, indent=2) + "\n")
    os.replace(scratch, path)


def _result_document(result: JobResult) -> dict[str, Any]:
    document = asdict(result)
    for package in document["packages"]:
        package["file"] = str(package["file"])
    return document


def _read_result(files: UnitFiles) -> tuple[bool, tuple[JobResult, ...]] | None:
    try:
        document = json.loads(files.result.read_text())
    except (OSError, ValueError):
        return None
    results = []
    for entry in document["results"]:
        packages = [BuiltPackage(**{**p, "file": Path(p["file"])}) for p in entry.pop("packages")]
        in_channel = [tuple(i) for i in entry.pop("in_channel")]
        results.append(JobResult(**entry, packages=packages, in_channel=in_channel))
    return bool(document["ok"]), tuple(results)


@contextlib.contextmanager
def _locked(build_dir: Path) -> Iterator[None]:
    """The build directory (created if absent) held exclusively: one submission or publish at a time."""
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / ".lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextlib.contextmanager
def _interrupts_deferred(then_raise: bool = True) -> Iterator[None]:
    """SIGINT and SIGTERM wait until the block is done (a publish, state bookkeeping).

    Then they raise KeyboardInterrupt, or, with ``then_raise`` False, are dropped: after a publish the
    command has done its work and reports it.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    previous = {
        s: signal.signal(s, lambda signum, frame: received.append(signum)) for s in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if received and then_raise:
            raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(run_unit(Path(sys.argv[1]), sys.argv[2]))
