"""Build recipes with py-rattler-build and publish the packages into a channel, all or nothing.

Every variant combination a recipe uses is built in its own engine call: py-rattler-build 0.73 pins
``pin_subpackage(exact=True)`` to the wrong variant when several variants build in one call. Each call
writes into a temporary output directory chosen by the combination's staging identity, so a staging
compile (libtorch) is reused across Python versions, but never across sites or flavors (the engine's
staging cache ignores values used only inside scripts). The packages reach the channel only when every
requested build and its tests succeeded; a failure or an interrupt leaves the channel as it was.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from rattler_build import ToolConfiguration

from channelsmith import channel, preflight
from channelsmith.errors import BuildError, PatchError, SourceError, UnreachableError
from channelsmith.recipes import (
    Recipe,
    RenderedOutput,
    load_stage0,
    render_variants,
    select_recipes,
    single_config,
    to_output,
    used_combinations,
)
from channelsmith.sources import cache_root

# Engine log lines kept per build for the error message of a failed build.
LOG_TAIL_LINES = 25

# Where py-rattler-build keeps downloaded sources inside its output directory, and where channelsmith
# keeps them for good (below the source cache: $CHANNELSMITH_CACHE or ~/.cache/channelsmith).
ENGINE_SOURCE_CACHE = "src_cache"


@dataclass(frozen=True)
class BuildJob:
    """One recipe at one variant combination (the keys it uses), rendered alone; each of its outputs
    is built by its own engine call."""

    recipe: Recipe
    variant: dict[str, str]
    distinguishing: dict[str, str]
    outputs: tuple[RenderedOutput, ...]
    rendered: tuple[Any, ...]

    @property
    def label(self) -> str:
        """``recipe [key=value ...]`` with the values that tell this job from the recipe's others."""
        values = _values(self.distinguishing)
        return f"{self.recipe.name} [{values}]" if self.distinguishing else self.recipe.name

    @property
    def staging_keys(self) -> tuple[str, ...]:
        """The staging compiles this job runs or reuses (empty when it has none)."""
        return tuple(sorted({s.key for o in self.outputs for s in o.staging}))


@dataclass(frozen=True)
class BuiltPackage:
    """A package file one engine call produced."""

    recipe: str
    name: str
    version: str
    build_string: str
    subdir: str
    file: Path


@dataclass
class JobResult:
    """What became of one engine call."""

    recipe: str
    variant: dict[str, str]
    distinguishing: dict[str, str]
    ok: bool
    seconds: float
    packages: list[BuiltPackage] = field(default_factory=list)
    in_channel: list[tuple[str, str, str]] = field(default_factory=list)
    error: str | None = None


@dataclass
class BuildReport:
    """The outcome of ``build``: one result per engine call, and where the packages went."""

    channel: Path
    results: list[JobResult] = field(default_factory=list)
    published: list[Path] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.results)


class BuildFailed(BuildError):
    """A build or its tests failed; ``report`` holds every result up to and including the failure."""

    def __init__(self, message: str, hint: str, report: BuildReport) -> None:
        super().__init__(message, hint=hint)
        self.report = report


class BuildUnreachable(BuildFailed, UnreachableError):
    """A build failed because a channel it needs stopped answering (exit code 3, not 2)."""


class BuildObserver(Protocol):
    """Receives progress while jobs build (the CLI shows it with rich)."""

    def job_started(self, job: BuildJob, index: int, total: int) -> None: ...

    def step(self, job: BuildJob, message: str) -> None: ...

    def log(self, job: BuildJob, line: str) -> None: ...

    def job_finished(self, job: BuildJob, result: JobResult) -> None: ...


class _Quiet:
    """An observer that shows nothing (library use, tests)."""

    def job_started(self, job: BuildJob, index: int, total: int) -> None:
        return None

    def step(self, job: BuildJob, message: str) -> None:
        return None

    def log(self, job: BuildJob, line: str) -> None:
        return None

    def job_finished(self, job: BuildJob, result: JobResult) -> None:
        return None


class _EngineProgress:
    """py-rattler-build's progress callback: forwards build steps, keeps the log's tail."""

    def __init__(self, job: BuildJob, observer: BuildObserver) -> None:
        self.job = job
        self.observer = observer
        self.tail: deque[str] = deque(maxlen=LOG_TAIL_LINES)

    def on_download_start(self, event: Any) -> None:
        self.observer.step(self.job, f"downloading {event.url}")

    def on_download_progress(self, event: Any) -> None:
        return None

    def on_download_complete(self, event: Any) -> None:
        return None

    def on_build_step(self, event: Any) -> None:
        self.observer.step(self.job, f"{event.step_name}: {event.message}")

    def on_log(self, event: Any) -> None:
        for line in str(event.message).splitlines():
            self.tail.append(line)
            self.observer.log(self.job, line)


class _Interrupts:
    """SIGINT/SIGTERM during a build: stop the engine's build processes at once, then stop channelsmith.

    py-rattler-build holds the GIL for a whole engine call (hours of compiling), so no Python code of
    ours runs until it returns, and a KeyboardInterrupt raised inside its progress callback is
    swallowed while the build goes on (and would then be published). So the handler only records the
    signal; the signal number also goes, through Python's C-level wakeup fd, to a small watcher process
    (its own session, so a terminal's Ctrl-C does not reach it), which forwards the signal to every
    process below this one: the build script, make, the compilers. The engine call then fails and
    ``check`` raises KeyboardInterrupt before anything is published.

    When the engine is busy inside this process (downloading, solving) and does not hand control back
    within the grace period (``$CHANNELSMITH_INTERRUPT_GRACE`` seconds, default 10), or on a second
    signal, the watcher kills the build with SIGKILL and removes its work directory itself. Nothing is
    published either way: the watcher lives only while builds run, never while publishing.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)
    GRACE_ENV = "CHANNELSMITH_INTERRUPT_GRACE"
    DEFAULT_GRACE_SECONDS = 10.0

    def __init__(self, work: Path) -> None:
        self.work = work
        self.received: int | None = None

    def check(self) -> None:
        """Raise KeyboardInterrupt when a signal arrived."""
        if self.received is not None:
            raise KeyboardInterrupt

    def _record(self, signum: int, frame: object) -> None:
        self.received = signum

    def _grace(self) -> float:
        text = os.environ.get(self.GRACE_ENV, "")
        try:
            return max(0.0, float(text)) if text else self.DEFAULT_GRACE_SECONDS
        except ValueError:
            raise BuildError(
                f"{self.GRACE_ENV}={text!r} is not a number of seconds", hint=f"unset {self.GRACE_ENV} or set e.g. 10"
            ) from None

    @contextlib.contextmanager
    def installed(self) -> Iterator[_Interrupts]:
        """Handlers and watcher in place for the duration (only the main thread may install them)."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        grace = self._grace()
        reader, writer = os.pipe()
        os.set_blocking(writer, False)
        watcher = subprocess.Popen(
            [sys.executable, "-c", _WATCHER, str(os.getpid()), str(self.work), str(grace)],
            stdin=reader,
            start_new_session=True,
        )
        os.close(reader)
        previous = {s: signal.signal(s, self._record) for s in self.SIGNALS}
        previous_fd = signal.set_wakeup_fd(writer, warn_on_full_buffer=False)
        try:
            yield self
        finally:
            signal.set_wakeup_fd(previous_fd)
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            os.close(writer)
            watcher.wait()


# The watcher process. It reads signal numbers from stdin and sends each to every descendant of the
# build process (except itself), and again every AGAIN_S until the build hands control back (a process
# forked after a forward got none); EOF means channelsmith has control again and it ends. If the build
# process is still inside the engine a grace period after a signal, or a second signal comes, it kills
# the build process and its descendants and removes the work directory. Plain Python: it starts fast
# and imports nothing of ours.
_WATCHER = """
import os, select, shutil, signal, sys, time
parent, work, grace, me = int(sys.argv[1]), sys.argv[2], float(sys.argv[3]), os.getpid()
AGAIN_S = 0.2
wanted = {int(signal.SIGINT), int(signal.SIGTERM)}
def children(pid):
    found = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{task}/children") as handle:
                    found.extend(int(c) for c in handle.read().split())
            except FileNotFoundError:
                pass
    except FileNotFoundError:
        pass
    return found
def forward(pid, signum):
    for child in children(pid):
        if child != me:
            forward(child, signum)
            try:
                os.kill(child, signum)
            except ProcessLookupError:
                pass
deadline = None
last = None
while True:
    wait = None if deadline is None else min(AGAIN_S, max(0.0, deadline - time.monotonic()))
    if not select.select([0], [], [], wait)[0]:
        if time.monotonic() < deadline:
            # Again until the engine returns: a process started after the last forward (a build script that was
            # forking its next command then) got nothing and would run on, to the grace's SIGKILL.
            forward(parent, last)
            continue
        sys.stderr.write(
            f"channelsmith: the build did not stop within {grace:g} s of the interrupt; killed it "
            "(nothing was published, the channel is as it was)\\n"
        )
        forward(parent, signal.SIGKILL)
        try:
            os.kill(parent, signal.SIGKILL)
        except ProcessLookupError:
            pass
        shutil.rmtree(work, ignore_errors=True)
        break
    data = os.read(0, 64)
    if not data:
        break
    for signum in data:
        if signum in wanted:
            deadline = time.monotonic() + grace if deadline is None else time.monotonic()
            last = signum
            forward(parent, signum)
"""


def plan_jobs(root: Path, names: Iterable[str], overrides: Mapping[str, str] | None = None) -> list[BuildJob]:
    """The engine calls that build ``names`` (every recipe when empty), rendered and checked.

    Raises RecipeError/VariantError for unknown recipes or variants (from channelsmith.recipes), and
    PatchError when a listed patch file does not exist, before any engine call.
    """
    jobs: list[BuildJob] = []
    for recipe in select_recipes(root, names):
        stage0 = load_stage0(recipe)
        combos = used_combinations(root, recipe, overrides)
        # Shown in progress and the summary: the keys whose values differ between the recipe's jobs,
        # plus the ones the user narrowed (the compiler keys, the same for all, would only be noise).
        shown = {k for k in {k for c in combos for k in c} if len({c.get(k) for c in combos}) > 1}
        shown |= set(overrides or {})
        for combo in combos:
            rendered = render_variants(recipe, stage0, single_config(combo))
            siblings = frozenset(v.recipe.package.name for v in rendered)
            job = BuildJob(
                recipe=recipe,
                variant=combo,
                distinguishing={k: v for k, v in combo.items() if k in shown},
                outputs=tuple(to_output(recipe, v, siblings) for v in rendered),
                rendered=tuple(rendered),
            )
            _check_patches(job)
            jobs.append(job)
    return jobs


def _check_patches(job: BuildJob) -> None:
    for output in job.outputs:
        for patch in output.patches:
            if not patch.is_file():
                where = f" ({_values(job.distinguishing)})" if job.distinguishing else ""
                raise PatchError(
                    f"recipe {job.recipe.name} lists patch {_shown(patch)} for {output.name}{where}, "
                    "but that file does not exist",
                    hint=f"add the patch under patches/ or fix its path in {job.recipe.recipe_file}",
                )


def build(
    root: Path,
    names: Iterable[str],
    channel_dir: Path,
    extra_channels: Iterable[str] = (),
    overrides: Mapping[str, str] | None = None,
    run_tests: bool = True,
    observer: BuildObserver | None = None,
) -> BuildReport:
    """Build every used variant combination of the named recipes, then publish them all into ``channel_dir``.

    The engine resolves dependencies from the local channel first, then ``extra_channels`` in order, and
    from nothing else (no default channel). Builds stop at the first failure: BuildFailed (a BuildError
    carrying the report) is raised, nothing is published and every temporary directory is removed. An
    interrupt (SIGINT, SIGTERM) stops the running build and raises KeyboardInterrupt, with the same effect.
    """
    observer = observer or _Quiet()
    channel_dir = channel_dir.resolve()
    extra_channels = list(extra_channels)
    jobs = plan_jobs(root, names, overrides)
    # The local channel first, then the ones given, and nothing else.
    channels = engine_channels(channel_dir, extra_channels)
    in_use = channel_in_use(channel_dir)
    in_channel = channel_identities(channel_dir) if in_use else set()
    report = BuildReport(channel=channel_dir)
    source_cache = _source_cache_dir()
    planned = [o for job in jobs for o in job.outputs if o.identity not in in_channel]
    preflight.check_ready(channel_dir, extra_channels, planned, Path(tempfile.gettempdir()), source_cache)
    work = Path(tempfile.mkdtemp(prefix="channelsmith-build-"))
    interrupts = _Interrupts(work)
    # Packages already built by an earlier job (e.g. libtorch, which every Python version renders too),
    # and the output dirs that hold them.
    built: set[tuple[str, str, str]] = set()
    earlier: list[Path] = []
    local = 1 if in_use else 0
    try:
        with interrupts.installed():
            for index, job in enumerate(jobs):
                observer.job_started(job, index, len(jobs))
                output_dir = _output_dir(work, job, index, source_cache)
                # Packages earlier jobs built (e.g. a noarch library that every Python version pins)
                # are found in their output dirs, right after the local channel.
                job_channels = channels[:local] + [d.as_uri() for d in earlier if d != output_dir] + channels[local:]
                result = _run_job(job, output_dir, job_channels, run_tests, observer, built, in_channel)
                if output_dir not in earlier:
                    earlier.append(output_dir)
                interrupts.check()
                report.results.append(result)
                observer.job_finished(job, result)
                if not result.ok:
                    raise _failure(job, result, channels, extra_channels, report)
        packages = [p.file for r in report.results for p in r.packages]
        if packages:
            report.published = channel.publish(channel_dir, packages)
        return report
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _source_cache_dir() -> Path:
    """The shared source cache every engine output directory links to, created if absent."""
    source_cache = cache_root() / ENGINE_SOURCE_CACHE
    try:
        source_cache.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SourceError(
            f"cannot create the source cache {source_cache}: {exc.strerror}",
            hint="set CHANNELSMITH_CACHE to a writable folder",
        ) from None
    return source_cache


def engine_channels(channel_dir: Path, extra_channels: Iterable[str]) -> list[str]:
    """The channels the engine resolves from: the local channel (when it has content), then the given ones.

    An existing channel is checked before anything is built, so a corrupt one fails fast (sizes only:
    publish verifies hashes under its lock). An absent or empty one is not given to the engine:
    creating it now would change the disk even when the build fails.
    """
    channels = list(extra_channels)
    if channel_in_use(channel_dir):
        channel.check_channel(channel_dir, hashes=False)
        channels.insert(0, channel.channel_url(channel_dir))
    return channels


def channel_in_use(channel_dir: Path) -> bool:
    """Whether the channel directory already has content (when absent or empty, publish creates it)."""
    return channel_dir.is_file() or (channel_dir.is_dir() and any(channel_dir.iterdir()))


def channel_identities(channel_dir: Path) -> set[tuple[str, str, str]]:
    """(name, version, build string) of every package the channel lists.

    These are not built again: a package file name is immutable in a channel (publish refuses the same
    name with other content), so a rebuild needs a new build number.
    """
    identities = set()
    for subdir in channel.channel_subdirs(channel_dir):
        if (channel_dir / subdir / channel.REPODATA).is_file():
            for listed in channel.listed_packages(channel_dir, subdir):
                stem = listed.path.name.removesuffix(".conda").removesuffix(".tar.bz2")
                name, version, build_string = stem.rsplit("-", 2)
                identities.add((name, version, build_string))
    return identities


def shared_output(job: BuildJob) -> str | None:
    """The name of the engine output directory a job shares with the jobs of its staging identity
    (they reuse one staging compile there); None for a job without a staging compile."""
    if not job.staging_keys:
        return None
    return "staging-" + hashlib.sha256("\n".join(job.staging_keys).encode()).hexdigest()[:16]


def _output_dir(work: Path, job: BuildJob, index: int, source_cache: Path) -> Path:
    """One engine output directory per staging identity; jobs without a staging compile get their own."""
    output_dir = work / (shared_output(job) or f"job-{index:03d}")
    _prepare_output_dir(output_dir, source_cache)
    return output_dir


def _prepare_output_dir(output_dir: Path, source_cache: Path) -> None:
    """Create an engine output directory whose ``src_cache`` links to the shared source cache.

    The engine keeps downloaded sources in ``<output dir>/src_cache``; with the link, an upstream
    tarball (PyTorch's is hundreds of MB) is fetched once, not once per site and version, and a later
    build finds it without network.
    """
    output_dir.mkdir(parents=True, exist_ok=True)
    link = output_dir / ENGINE_SOURCE_CACHE
    if not link.is_symlink():
        link.symlink_to(source_cache, target_is_directory=True)


def build_unpublished(
    jobs: Iterable[BuildJob],
    output_dir: Path,
    channels: Iterable[str],
    run_tests: bool = True,
    built_elsewhere: Iterable[tuple[str, str, str]] = (),
    in_channel: Iterable[tuple[str, str, str]] = (),
    observer: BuildObserver | None = None,
) -> list[JobResult]:
    """Build ``jobs`` one after another in one output directory and publish nothing (a batch job's share).

    The jobs share ``output_dir`` (one staging identity, or a single job). Outputs listed in
    ``built_elsewhere`` are skipped (another batch job builds them; its output directory is among
    ``channels``), as are those in ``in_channel``, which are reported as already in the channel.
    Stops at the first failure; the results include it.
    """
    observer = observer or _Quiet()
    jobs = list(jobs)
    _prepare_output_dir(output_dir, _source_cache_dir())
    built = set(built_elsewhere)
    listed = set(in_channel)
    results: list[JobResult] = []
    for index, job in enumerate(jobs):
        observer.job_started(job, index, len(jobs))
        result = _run_job(job, output_dir, list(channels), run_tests, observer, built, listed)
        results.append(result)
        observer.job_finished(job, result)
        if not result.ok:
            break
    return results


def _run_job(
    job: BuildJob,
    output_dir: Path,
    channels: list[str],
    run_tests: bool,
    observer: BuildObserver,
    built: set[tuple[str, str, str]],
    in_channel: set[tuple[str, str, str]],
) -> JobResult:
    """Build the job's outputs not built yet, in the engine's order; ``built`` gains the new ones.

    An output an earlier job already built is in the same output directory (same staging identity), where
    the engine finds it as a local package, e.g. for ``pin_subpackage``; one the channel already lists
    is taken from there.
    """
    tool_config = ToolConfiguration(test_strategy="native" if run_tests else "skip")
    progress = _EngineProgress(job, observer)
    result = JobResult(
        recipe=job.recipe.name, variant=dict(job.variant), distinguishing=dict(job.distinguishing), ok=True, seconds=0.0
    )
    start = time.monotonic()
    for output, variant in zip(job.outputs, job.rendered):
        if output.identity in in_channel:
            result.in_channel.append(output.identity)
            in_channel.discard(output.identity)  # reported once, by the first job that renders it
            built.add(output.identity)
            continue
        if output.identity in built:
            continue
        try:
            engine_result = variant.run_build(
                tool_config=tool_config,
                output_dir=output_dir,
                channels=list(channels),
                progress_callback=progress,
                # The engine's staging cache key includes the build prefix, which by default carries a
                # timestamp; without it, a staging compile is reused by later jobs in this output dir.
                no_build_id=True,
            )
        except Exception as exc:  # the engine raises its own error types for build and test failures
            result.ok = False
            result.error = _failure_text(exc, progress.tail, output_dir.parent)
            break
        built.add(output.identity)
        for path in engine_result.packages:
            result.packages.append(
                BuiltPackage(
                    recipe=job.recipe.name,
                    name=engine_result.name,
                    version=str(engine_result.version),
                    build_string=engine_result.build_string,
                    subdir=Path(path).parent.name,
                    file=Path(path),
                )
            )
    result.seconds = time.monotonic() - start
    return result


def _failure_text(exc: BaseException, tail: Iterable[str], work: Path) -> str:
    """The engine's error and the last lines of its log.

    Lines that point into the work directory (the engine's "run the script manually" advice) are left
    out: that directory is removed when the build stops.
    """
    lines = [
        line
        for line in tail
        if line.strip() and str(work) not in line and not line.strip().startswith(("To run ", "Prefix:"))
    ]
    text = str(exc).strip() or type(exc).__name__
    if lines:
        text += "\nlast lines of the engine log:\n  " + "\n  ".join(lines)
    return text


def _failure(
    job: BuildJob, result: JobResult, channels: list[str], extra_channels: list[str], report: BuildReport
) -> BuildFailed:
    """The error of a failed job: BuildUnreachable when a channel stopped answering meanwhile (the engine
    then reports only that it could not resolve, after its retries), else BuildFailed."""
    error = result.error or ""
    if "resolve dependencies" in error:
        unreachable = preflight.unreachable_channels(extra_channels)
        if unreachable:
            causes = "; ".join(f"channel {name} could not be reached: {why}" for name, why in unreachable)
            return BuildUnreachable(
                f"build of {job.label} failed: {causes}",
                hint="nothing was published; the channel is as it was. The recipe is not at fault: build again "
                "when the channel answers (or pass a copy of it with -c)",
                report=report,
            )
    return BuildFailed(f"build of {job.label} failed: {error}", hint=_failure_hint(error, channels), report=report)


def _failure_hint(error: str, channels: list[str]) -> str:
    hint = "nothing was published; the channel is as it was. Fix the recipe and build again"
    if "Failed to download" in error:
        hint += (
            ". This recipe's sources come from upstream and need network access; once downloaded they "
            f"are kept in {cache_root() / ENGINE_SOURCE_CACHE} for later builds"
        )
    if "resolve dependencies" in error:
        searched = ", ".join(channels) or "no channel"
        hint += f". Dependencies come only from the local channel and the -c channels ({searched})"
        if not any("conda-forge" in c for c in channels):
            hint += "; add -c conda-forge for a recipe that needs conda-forge packages (and network access)"
    return hint


def _values(variant: Mapping[str, str]) -> str:
    return " ".join(f"{k}={v}" for k, v in sorted(variant.items()))


def _shown(path: Path) -> str:
    """A path relative to the working directory when it is below it (shorter messages)."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)
