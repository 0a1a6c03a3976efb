"""The build directory: the request and every unit with its job id (``state.json``), each unit's files
(``units/<id>/``: job script, log, output, result), and the lock that makes one submission or publish
at a time. Files are written whole or not at all: a reader on another node never sees half of one."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import threading
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from channelsmith.build import BuiltPackage, JobResult
from channelsmith.errors import SchedulerError
from channelsmith.scheduler.backend import Backend, backend, options_document, options_from_document

Identity = tuple[str, str, str]

DEFAULT_BUILD_DIR = Path("channelsmith-jobs")
STATE_FILE = "state.json"
# Version 1 (Slurm only) kept the options under "slurm"; version 2 names the batch system.
STATE_VERSION = 2
UNITS_DIR = "units"


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
    scheduler: str
    options: Any
    units: list[Unit]
    published: list[Path] | None = None

    @property
    def backend(self) -> Backend:
        """The adapter of the batch system the jobs were submitted to (channelsmith.slurm or .pbs)."""
        return backend(self.scheduler)

    def files(self, unit: Unit) -> UnitFiles:
        return UnitFiles(self.build_dir / UNITS_DIR / unit.id)

    @property
    def job_ids(self) -> list[str]:
        return [u.job_id for u in self.units if u.job_id]


def load(build_dir: Path) -> ScheduledBuild:
    """The scheduled build kept in ``build_dir``; SchedulerError when there is none or it is unreadable."""
    state_file = build_dir / STATE_FILE
    try:
        document = json.loads(state_file.read_text())
    except FileNotFoundError:
        raise SchedulerError(
            f"{build_dir} holds no scheduled build (no {STATE_FILE})",
            hint="pass the --build-dir a `channelsmith build ... --scheduler slurm|pbs` used",
        ) from None
    except (OSError, ValueError) as exc:
        raise SchedulerError(f"cannot read {state_file}: {exc}", hint="submit the build again") from None
    if document.get("version") == 1:
        document = {**document, "scheduler": "slurm", "options": document["slurm"]}
    elif document.get("version") != STATE_VERSION:
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
    options = options_from_document(document["scheduler"], document["options"])
    units = []
    for entry in document["units"]:
        for key in ("builds", "built_elsewhere", "in_channel"):
            entry[key] = [tuple(i) for i in entry[key]]
        units.append(Unit(**entry))
    published = document["published"]
    return ScheduledBuild(
        build_dir=build_dir,
        request=request,
        scheduler=document["scheduler"],
        options=options,
        units=units,
        published=None if published is None else [Path(p) for p in published],
    )


def save(scheduled: ScheduledBuild) -> None:
    request = scheduled.request
    write_json(
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
            "scheduler": scheduled.scheduler,
            "options": options_document(scheduled.options),
            "units": [asdict(u) for u in scheduled.units],
            "published": None if scheduled.published is None else [str(p) for p in scheduled.published],
        },
    )


def write_json(path: Path, document: Any) -> None:
    """Write a JSON file whole or not at all (a reader on another node never sees half of it)."""
    scratch = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    scratch.write_text(json.dumps(document, indent=2) + "\n")
    os.replace(scratch, path)


def result_document(result: JobResult) -> dict[str, Any]:
    document = asdict(result)
    for package in document["packages"]:
        package["file"] = str(package["file"])
    return document


def read_result(files: UnitFiles) -> tuple[bool, tuple[JobResult, ...]] | None:
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
def locked(build_dir: Path) -> Iterator[None]:
    """The build directory (created if absent) held exclusively: one submission or publish at a time."""
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / ".lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextlib.contextmanager
def interrupts_deferred(then_raise: bool = True) -> Iterator[None]:
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
