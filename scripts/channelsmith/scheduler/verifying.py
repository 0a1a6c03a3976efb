"""Acceptance as one batch job: the suite (channelsmith.verify) run on N nodes under the site's
launcher (srun in a Slurm job, mpiexec in a PBS job), then read back as if it had run here.

The run directory holds ``verify.json`` (the request and the job id) and, as a build's unit does,
``job.sh``, ``job.log`` (the suite's output as it runs, its stage lines among it), ``started`` (one
line per start of the job) and ``result.json`` (written by the job as the suite starts, then with the
suite's verdict); ``suite.json`` is the suite's own report, which it rewrites as each stage begins, and
``requeues`` says why each earlier run of a requeued job ended.

The batch system's account wins over what the job wrote: a job it ended (a node failure, a
preemption, its memory, its time limit, a deletion) is reported as such, with the stage the suite was
in, even where the job wrote a verdict on its way out; a job it requeued says so, how often and why.
Waiting is the build's own machinery (channelsmith.scheduler.collecting.watch). The job itself is
``python -m channelsmith.scheduler --verify RUN_DIR``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import socket
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import channelsmith
from channelsmith.batch import JobState
from channelsmith.errors import JobOptionsRefused, SchedulerError, VerifyError
from channelsmith.pbs import PbsOptions
from channelsmith.scheduler.backend import Backend, backend, options_document, options_from_document
from channelsmith.scheduler.collecting import watch
from channelsmith.scheduler.state import UnitFiles, locked, write_json
from channelsmith.scheduler.status import ended_without_result, log_tail
from channelsmith.slurm import SlurmOptions
from channelsmith.verify import VerifyOptions, VerifyReport, prepare_suite, probe_prefix, report_of, run_suite

DEFAULT_RUN_DIR = Path("channelsmith-verify")
STATE_FILE = "verify.json"
STATE_VERSION = 1
# The suite's rendezvous on one node: rank 0's store binds a port the kernel gives it and publishes
# it in this file (torch_dist_check.harness.rendezvous), so no port chosen ahead can be taken meanwhile.
# Across nodes the ranks meet on the first node at the suite's own port (MASTER_ADDR/MASTER_PORT).
PORT_FILE_ENV = "TORCH_DIST_CHECK_PORT_FILE"
# The suite's own report in the run directory, rewritten as each stage begins (survives a killed job).
SUITE_REPORT = "suite.json"
# Why each earlier run of a requeued job ended, one line per requeue (written by the job's next run).
REQUEUES_FILE = "requeues"
# The line each run of the job starts its log with; what follows the last one is the current run's.
RUN_MARK = "channelsmith: acceptance suite in "
# Said of a requeue whose cause the batch system wrote nowhere the job can read (a node that died
# outright writes no kill line).
NO_CAUSE = "no cause in its log"
# How often the batch system is asked, at most, while a job that wrote its verdict is ending.
ENDING_POLL_S = 0.25


@dataclass(frozen=True)
class VerifyRequest:
    """What the job runs: the suite against ``prefix`` on ``nodes`` x ``ntasks_per_node`` ranks."""

    prefix: Path
    nodes: int = 1
    ntasks_per_node: int = 2
    gpus_per_node: int | None = None
    backends: tuple[str, ...] = ()
    suite_args: tuple[str, ...] = ()
    timeout_s: float = 3600.0


@dataclass
class ScheduledVerify:
    """The content of a run directory's state file."""

    run_dir: Path
    request: VerifyRequest
    scheduler: str
    options: Any
    job_id: str | None = None

    @property
    def backend(self) -> Backend:
        return backend(self.scheduler)

    @property
    def files(self) -> UnitFiles:
        return UnitFiles(self.run_dir)


@dataclass(frozen=True)
class VerifyJobStatus:
    """Where the job stands: the batch system's state while it knows the job, then its files.

    ``elapsed_s`` counts from the job's first start; ``requeue_causes`` has one entry per requeue.
    """

    job_id: str
    state: str
    reason: str
    elapsed_s: float | None
    ended: bool
    log: Path
    requeue_causes: tuple[str, ...] = ()

    @property
    def requeues(self) -> int:
        return len(self.requeue_causes)


@dataclass(frozen=True)
class VerifyJobOutcome:
    """The job once it ended: its status, and the suite's report when the suite wrote one (else why
    not); the report of a suite stopped mid-run names the stage it was in and has no exit code."""

    status: VerifyJobStatus
    report: VerifyReport | None
    error: str | None

    @property
    def ok(self) -> bool:
        return self.report is not None and self.report.ok and self.status.state == "COMPLETED"


class VerifyObserver(Protocol):
    """Receives the job's status at every look at the batch system (the live line)."""

    def update(self, status: VerifyJobStatus) -> None: ...


def job_options(scheduler: str, request: VerifyRequest, options: Any) -> Any:
    """The adapter's options with the job's shape (nodes, ranks and GPUs per node) added."""
    if scheduler == "slurm":
        # --open-mode=append: a requeued job's next run adds to its log instead of emptying it, so the
        # line slurmstepd wrote when it ended the earlier run (why it was requeued) stays.
        shape = [f"--nodes={request.nodes}", f"--ntasks-per-node={request.ntasks_per_node}", "--open-mode=append"]
        if request.gpus_per_node is not None:
            shape.append(f"--gpus-per-node={request.gpus_per_node}")
        return SlurmOptions(**{**asdict(options), "extra": (*shape, *options.extra)})
    chunk = f"ncpus={request.ntasks_per_node}:mpiprocs={request.ntasks_per_node}"
    if request.gpus_per_node is not None:
        chunk += f":ngpus={request.gpus_per_node}"
    return PbsOptions(**{**asdict(options), "select": f"{request.nodes}:{chunk}", "extra": tuple(options.extra)})


def launcher(scheduler: str, request: VerifyRequest) -> tuple[str, ...]:
    """The site's launcher inside the job: srun (a failing rank ends the step at once, instead of
    leaving the others waiting at the rendezvous), or mpiexec with the ranks per node (MPICH's Hydra
    and Cray PALS both read the job's hosts from PBS)."""
    if scheduler == "slurm":
        return ("srun", f"--nodes={request.nodes}", f"--ntasks-per-node={request.ntasks_per_node}",
                "--kill-on-bad-exit=1")  # fmt: skip
    total = request.nodes * request.ntasks_per_node
    return ("mpiexec", "-n", str(total), "-ppn", str(request.ntasks_per_node))


def submit(request: VerifyRequest, scheduler: str, options: Any, run_dir: Path) -> ScheduledVerify:
    """Submit the suite as one batch job; returns the run's state.

    Refused before anything is submitted: a prefix without python or torch (VerifyError), a run
    directory whose job still runs, a batch system that does not answer or refuses the options
    (SchedulerError and the rest of the UserError family).
    """
    run_dir = run_dir.resolve()
    if run_dir.exists() and not run_dir.is_dir():
        raise SchedulerError(f"{run_dir} is not a directory", hint="pass another --run-dir")
    request = VerifyRequest(**{**asdict(request), "prefix": request.prefix.resolve()})
    probe_prefix(request.prefix)
    adapter = backend(scheduler)
    options = job_options(scheduler, request, options)
    with _options_named(scheduler):
        adapter.check_cluster(options)
    scheduled = ScheduledVerify(run_dir, request, scheduler, options)
    created = not run_dir.exists()
    with locked(run_dir):
        _refuse_running(run_dir)
        files = scheduled.files
        for stale in (files.log, files.started, files.result, run_dir / "rendezvous.port", run_dir / SUITE_REPORT,
                      run_dir / REQUEUES_FILE):  # fmt: skip
            stale.unlink(missing_ok=True)
        files.script.write_text(_job_script(run_dir, request))
        files.script.chmod(0o755)
        try:
            with _options_named(scheduler):
                scheduled.job_id = adapter.submit(files.script, options, log=files.log, name="channelsmith-verify")
        except BaseException:
            # Refused (PBS judges some options only at qsub) or interrupted: nothing was submitted.
            if created:
                shutil.rmtree(run_dir, ignore_errors=True)
            raise
        save(scheduled)
    return scheduled


# The options of `channelsmith verify --scheduler` that become the job's batch options, per batch system.
_JOB_OPTION_FLAGS = {
    "slurm": "--nodes/--ntasks-per-node/--gpus-per-node/--time/--partition/--account/--sbatch-arg",
    "pbs": "--nodes/--ntasks-per-node/--gpus-per-node/--time/--queue/--account/--qsub-arg",
}


@contextlib.contextmanager
def _options_named(scheduler: str) -> Iterator[None]:
    """A refusal of the job's options names the verify options they came from (not a build's)."""
    try:
        yield
    except JobOptionsRefused as exc:
        raise SchedulerError(exc.message, hint=f"fix {_JOB_OPTION_FLAGS[scheduler]} (tried: {exc.tried})") from None


def _refuse_running(run_dir: Path) -> None:
    if not (run_dir / STATE_FILE).exists():
        return
    earlier = load(run_dir)
    if earlier.job_id and not status(earlier).ended:
        raise SchedulerError(
            f"{run_dir} holds verify job {earlier.job_id}, which is still pending or running",
            hint=f"wait for it (channelsmith verify --collect {run_dir}), cancel it "
            f"({earlier.backend.CANCEL_COMMAND} {earlier.job_id}), or pass another --run-dir",
        )


def _job_script(run_dir: Path, request: VerifyRequest) -> str:
    """The batch script: this Python, with this channelsmith on its path, runs the suite."""
    package_root = Path(channelsmith.__file__).resolve().parent.parent
    command = shlex.join([sys.executable, "-m", "channelsmith.scheduler", "--verify", str(run_dir)])
    return (
        "#!/bin/bash\n"
        f"# channelsmith verify job: the acceptance suite in {request.prefix} on {request.nodes} node(s), "
        f"{request.ntasks_per_node} rank(s) each\n"
        "set -euo pipefail\n"
        f"export PYTHONPATH={shlex.quote(str(package_root))}${{PYTHONPATH:+:$PYTHONPATH}}\n"
        f"exec {command}\n"
    )


def save(scheduled: ScheduledVerify) -> None:
    request = asdict(scheduled.request)
    request["prefix"] = str(request["prefix"])
    write_json(
        scheduled.run_dir / STATE_FILE,
        {
            "version": STATE_VERSION,
            "request": request,
            "scheduler": scheduled.scheduler,
            "options": options_document(scheduled.options),
            "job_id": scheduled.job_id,
        },
    )


def load(run_dir: Path) -> ScheduledVerify:
    """The verify job kept in ``run_dir``; SchedulerError when there is none or it is unreadable."""
    state_file = run_dir / STATE_FILE
    try:
        document = json.loads(state_file.read_text())
    except FileNotFoundError:
        raise SchedulerError(
            f"{run_dir} holds no verify job (no {STATE_FILE})",
            hint="pass the --run-dir a `channelsmith verify --scheduler slurm|pbs` used",
        ) from None
    except (OSError, ValueError) as exc:
        raise SchedulerError(f"cannot read {state_file}: {exc}", hint="submit the verify job again") from None
    if document.get("version") != STATE_VERSION:
        raise SchedulerError(
            f"{state_file} was written by another channelsmith (state version {document.get('version')})",
            hint="collect it with that version, or remove the directory and submit again",
        )
    req = document["request"]
    request = VerifyRequest(
        **{**req, "prefix": Path(req["prefix"]), "backends": tuple(req["backends"]),
           "suite_args": tuple(req["suite_args"])}
    )  # fmt: skip
    options = options_from_document(document["scheduler"], document["options"])
    return ScheduledVerify(run_dir, request, document["scheduler"], options, document["job_id"])


def status(scheduled: ScheduledVerify, known: Mapping[str, JobState] | None = None) -> VerifyJobStatus:
    """The job's status: the batch system's account (asked now unless ``known`` is given), then its files.

    A job the batch system still shows as pending or running has not ended, even where it wrote its
    verdict (it is ending, or the batch system is about to requeue it); one the batch system ended
    itself is reported as such whatever the job wrote; a verdict decides only for a job that ended
    by itself, or that the batch system has forgotten and whose log has no kill line for its last run.
    """
    job_id = scheduled.job_id or ""
    if known is None:
        known = scheduled.backend.job_states([job_id])
    files = scheduled.files
    job = known.get(job_id)
    starts = _starts(files)
    last_run = _last_run_log(files.log)
    requeues = job.requeues if job is not None else max(0, len(starts) - 1)
    causes = _requeue_causes(scheduled, requeues, last_run)
    result = _final_result(files)

    def shown(state: str, reason: str, ended: bool) -> VerifyJobStatus:
        return VerifyJobStatus(job_id, state, reason, _elapsed(files, starts, result, ended), ended, files.log, causes)

    if job is not None and not job.ended:
        return shown(job.state, "" if job.reason in ("None", "") else job.reason, False)
    if job is not None and job.killed:
        return shown(job.state, job.reason, True)
    if job is None and starts:
        cause = scheduled.backend.kill_cause_in_log(last_run)
        if cause is not None:
            return shown("ENDED", cause, True)
    if result is not None:
        ok = bool(result.get("ok"))
        return shown("COMPLETED" if ok else "FAILED", "" if ok else (result.get("error") or "checks failed").splitlines()[0],
                     True)  # fmt: skip
    state, reason = ended_without_result(scheduled.backend, job, files.log)
    return shown(state, reason, True)


def collect(run_dir: Path, observer: VerifyObserver | None = None) -> VerifyJobOutcome:
    """Wait until the job ended, then read the suite's report (None, with why, when it wrote none).

    Once the running job wrote its verdict, the batch system is asked again every ENDING_POLL_S until it
    says the job ended, and how: a job killed as it ended (a node failing) is not reported by its verdict.
    (A verdict of a run before a requeue waits for the next run, at the usual pace.)
    """
    scheduled = load(run_dir.resolve())
    asked = float("-inf")

    def judge(known: Mapping[str, JobState]) -> VerifyJobStatus:
        nonlocal asked
        current = status(scheduled, known)
        ending = current.state in ("RUNNING", "COMPLETING")
        if ending and not current.ended and _final_result(scheduled.files) is not None:
            if time.monotonic() - asked >= ENDING_POLL_S:
                asked = time.monotonic()
                current = status(scheduled)
        return current

    final = watch(
        scheduled.backend,
        [scheduled.job_id or ""],
        judge,
        lambda current: current.ended,
        observer.update if observer is not None else lambda current: None,
    )
    report, error = _report(scheduled)
    return VerifyJobOutcome(final, report, error)


def cancel(run_dir: Path) -> list[str]:
    """Cancel the job if it is pending or running; returns its id (or nothing)."""
    scheduled = load(run_dir.resolve())
    if not scheduled.job_id or status(scheduled).ended:
        return []
    scheduled.backend.cancel([scheduled.job_id])
    return [scheduled.job_id]


def _report(scheduled: ScheduledVerify) -> tuple[VerifyReport | None, str | None]:
    """The suite's report: its verdict, or, for a job stopped mid-run, the report the suite wrote as
    its last stage began (no exit code); else None and why there is none."""
    files = scheduled.files
    result = _read_result(files)
    if result is None:
        return None, "the suite wrote no report"
    if result.get("error"):
        return None, str(result["error"])
    document = result.get("document")
    exit_code = result.get("exit_code")
    if result.get("running"):
        document, exit_code = _read_json(scheduled.run_dir / SUITE_REPORT), None
    if document is None:
        return None, "the job was stopped before the suite wrote a report"
    report = report_of(scheduled.request.prefix, Path(result["python"]), result["torch_version"], result["suite_source"],
                       tuple(result["command"]), exit_code, document)  # fmt: skip
    return report, None


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return None


def _read_result(files: UnitFiles) -> dict[str, Any] | None:
    return _read_json(files.result)


def _final_result(files: UnitFiles) -> dict[str, Any] | None:
    """What the job wrote when the suite ended (or could not run); None while it runs or never wrote one."""
    result = _read_result(files)
    return None if result is None or result.get("running") else result


def _starts(files: UnitFiles) -> list[float]:
    """When each run of the job started (more than one: the batch system requeued it)."""
    try:
        return [float(line) for line in files.started.read_text().split()]
    except (OSError, ValueError):
        return []


def _elapsed(files: UnitFiles, starts: list[float], result: Mapping[str, Any] | None, ended: bool) -> float | None:
    """Seconds since the job first started: until its verdict, or, for one that ended without it, until
    its log was last written (a kill line is written as the job is killed)."""
    if not starts:
        return None
    if result is not None and result.get("finished") is not None:
        finished = float(result["finished"])
    elif ended:
        try:
            finished = files.log.stat().st_mtime
        except OSError:
            finished = time.time()
    else:
        finished = time.time()
    return max(0.0, finished - starts[0])


def _last_run_log(log: Path) -> str:
    """The end of the job's log from the start of its last run (the whole end where no run started)."""
    tail = log_tail(log)
    at = tail.rfind(RUN_MARK)
    return tail[at:] if at >= 0 else tail


def _requeue_causes(scheduled: ScheduledVerify, requeues: int, last_run: str) -> tuple[str, ...]:
    """Why each requeue happened: the causes the job's later runs recorded, then, for the requeue no run
    has followed yet (the job waits, or was deleted while it waited), the kill line its last run ended with."""
    try:
        recorded = scheduled.run_dir.joinpath(REQUEUES_FILE).read_text().splitlines()
    except OSError:
        recorded = []
    if len(recorded) < requeues:
        recorded.append(_requeue_cause(scheduled.backend.kill_cause_in_log(last_run)))
    return tuple((recorded + [NO_CAUSE] * requeues)[:requeues])


def _requeue_cause(kill_cause: str | None) -> str:
    """A kill line's cause without the advice after it (a requeued job is submitted again already)."""
    return kill_cause.split("; ")[0] if kill_cause else NO_CAUSE


def run_job(run_dir: Path) -> int:
    """The batch job: run the suite under the site's launcher and write its report for the collecting
    side; the exit code is the suite's (0 verified, 1 not), 2 when it could not run.

    The suite's output goes to the job's log as it runs. A run after a requeue records why the
    earlier one ended (the kill line the batch system wrote into the log) before it starts afresh.
    """
    scheduled = load(run_dir)
    request, files = scheduled.request, scheduled.files
    earlier = len(_starts(files))
    note = ""
    if earlier:
        cause = _requeue_cause(scheduled.backend.kill_cause_in_log(_last_run_log(files.log)))
        with (run_dir / REQUEUES_FILE).open("a") as handle:
            handle.write(f"{cause}\n")
        note = f" (run {earlier + 1}: requeued after {cause})"
    with files.started.open("a") as handle:
        handle.write(f"{time.time()}\n")
    print(f"{RUN_MARK}{request.prefix} on {socket.gethostname()}{note}", flush=True)
    if request.nodes == 1 and PORT_FILE_ENV not in os.environ and "MASTER_PORT" not in os.environ:
        port_file = run_dir / "rendezvous.port"
        port_file.unlink(missing_ok=True)  # a job the batch system runs again must not read the last run's port
        os.environ[PORT_FILE_ENV] = str(port_file)
    options = VerifyOptions(
        prefix=request.prefix,
        nproc=None,
        backends=request.backends,
        launcher=launcher(scheduled.scheduler, request),
        suite_args=request.suite_args,
        timeout_s=request.timeout_s,
    )
    try:
        suite = prepare_suite(options, run_dir / SUITE_REPORT)
        # What the collecting side needs to read the suite's own report should the job be killed mid-run.
        about = {"python": str(suite.python), "torch_version": suite.torch_version, "suite_source": suite.suite_source,
                 "command": list(suite.command)}  # fmt: skip
        write_json(files.result, {"ok": False, "running": True, "finished": None, "error": None, **about,
                                  "document": None})  # fmt: skip
        report = run_suite(suite, options.timeout_s, pass_output=True)
    except VerifyError as exc:
        print(f"channelsmith: {exc}", flush=True)
        write_json(files.result, {"ok": False, "finished": time.time(), "error": str(exc), "document": None})
        return 2
    write_json(
        files.result,
        {"ok": report.ok, "finished": time.time(), "error": None, **about, "exit_code": report.exit_code,
         "document": report.document},
    )  # fmt: skip
    summary = report.document["summary"]
    ended = (f"exit code {report.exit_code}" if report.finished
             else f"the suite did not finish: stopped in stage '{report.incomplete_stage or 'start'}'")  # fmt: skip
    print(
        f"channelsmith: {'verified' if report.ok else 'NOT verified'}: {summary['pass']} pass, "
        f"{summary['fail']} fail, {summary['skipped']} skipped ({ended})",
        flush=True,
    )
    return 0 if report.ok else 1
