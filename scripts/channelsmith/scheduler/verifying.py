"""Acceptance as one batch job: the suite (channelsmith.verify) run on N nodes under the site's
launcher (srun in a Slurm job, mpiexec in a PBS job), then read back as if it had run here.

The run directory holds ``verify.json`` (the request and the job id) and, as a build's unit does,
``job.sh``, ``job.log``, ``started`` and ``result.json`` (the suite's report, written by the job).
Waiting and the job's state are the build's own machinery (channelsmith.scheduler.collecting.watch,
status.ended_without_result): a job the batch system killed says why, as a build's job does.
The job itself is ``python -m channelsmith.scheduler --verify RUN_DIR``.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import socket
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import channelsmith
from channelsmith.batch import JobState
from channelsmith.errors import SchedulerError, VerifyError
from channelsmith.pbs import PbsOptions
from channelsmith.scheduler.backend import Backend, backend, options_document, options_from_document
from channelsmith.scheduler.collecting import watch
from channelsmith.scheduler.state import UnitFiles, locked, write_json
from channelsmith.scheduler.status import ended_without_result
from channelsmith.slurm import SlurmOptions
from channelsmith.verify import CheckOutcome, VerifyOptions, VerifyReport, probe_prefix, verify_prefix

DEFAULT_RUN_DIR = Path("channelsmith-verify")
STATE_FILE = "verify.json"
STATE_VERSION = 1
# The suite's rendezvous on one node: rank 0's store binds a port the kernel gives it and publishes
# it in this file (torch_dist_check.harness.rendezvous), so no port chosen ahead can be taken meanwhile.
# Across nodes the ranks meet on the first node at the suite's own port (MASTER_ADDR/MASTER_PORT).
PORT_FILE_ENV = "TORCH_DIST_CHECK_PORT_FILE"


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
    """Where the job stands: the batch system's state while it knows the job, then its files."""

    job_id: str
    state: str
    reason: str
    elapsed_s: float | None
    ended: bool
    log: Path


@dataclass(frozen=True)
class VerifyJobOutcome:
    """The job once it ended: its status, and the suite's report when the suite wrote one (else why not)."""

    status: VerifyJobStatus
    report: VerifyReport | None
    error: str | None

    @property
    def ok(self) -> bool:
        return self.report is not None and self.report.ok


class VerifyObserver(Protocol):
    """Receives the job's status at every look at the batch system (the live line)."""

    def update(self, status: VerifyJobStatus) -> None: ...


def job_options(scheduler: str, request: VerifyRequest, options: Any) -> Any:
    """The adapter's options with the job's shape (nodes, ranks and GPUs per node) added."""
    if scheduler == "slurm":
        shape = [f"--nodes={request.nodes}", f"--ntasks-per-node={request.ntasks_per_node}"]
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
    adapter.check_cluster(options)
    scheduled = ScheduledVerify(run_dir, request, scheduler, options)
    created = not run_dir.exists()
    with locked(run_dir):
        _refuse_running(run_dir)
        files = scheduled.files
        for stale in (files.log, files.started, files.result, run_dir / "rendezvous.port"):
            stale.unlink(missing_ok=True)
        files.script.write_text(_job_script(run_dir, request))
        files.script.chmod(0o755)
        try:
            scheduled.job_id = adapter.submit(files.script, options, log=files.log, name="channelsmith-verify")
        except BaseException:
            # Refused (PBS judges some options only at qsub) or interrupted: nothing was submitted.
            if created:
                shutil.rmtree(run_dir, ignore_errors=True)
            raise
        save(scheduled)
    return scheduled


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
    """The job's status from the batch system (asked now unless ``known`` is given), then its files.

    As for a build's unit, the batch system is asked before the result is read: a job that ends in
    between has written its result and is judged by it.
    """
    job_id = scheduled.job_id or ""
    if known is None:
        known = scheduled.backend.job_states([job_id])
    files = scheduled.files
    elapsed = _elapsed(files)
    result = _read_result(files)
    if result is not None:
        state = "COMPLETED" if result.get("ok") else "FAILED"
        reason = "" if result.get("ok") else (result.get("error") or "checks failed").splitlines()[0]
        return VerifyJobStatus(job_id, state, reason, elapsed, True, files.log)
    job = known.get(job_id)
    if job is not None and not job.ended:
        reason = "" if job.reason in ("None", "") else job.reason
        return VerifyJobStatus(job_id, job.state, reason, elapsed, False, files.log)
    state, reason = ended_without_result(scheduled.backend, job, files.log)
    return VerifyJobStatus(job_id, state, reason, elapsed, True, files.log)


def collect(run_dir: Path, observer: VerifyObserver | None = None) -> VerifyJobOutcome:
    """Wait until the job ended, then read the suite's report (None, with why, when it wrote none)."""
    scheduled = load(run_dir.resolve())
    final = watch(
        scheduled.backend,
        [scheduled.job_id or ""],
        lambda known: status(scheduled, known),
        lambda current: current.ended,
        observer.update if observer is not None else lambda current: None,
    )
    result = _read_result(scheduled.files)
    if result is None or result.get("document") is None:
        error = (result or {}).get("error") or "the suite wrote no report"
        return VerifyJobOutcome(final, None, error)
    return VerifyJobOutcome(final, _report(scheduled.request, result), None)


def cancel(run_dir: Path) -> list[str]:
    """Cancel the job if it is pending or running; returns its id (or nothing)."""
    scheduled = load(run_dir.resolve())
    if not scheduled.job_id or status(scheduled).ended:
        return []
    scheduled.backend.cancel([scheduled.job_id])
    return [scheduled.job_id]


def _report(request: VerifyRequest, result: Mapping[str, Any]) -> VerifyReport:
    document = result["document"]
    checks = tuple(
        CheckOutcome(c["name"], c["status"], c.get("reason", ""), c.get("details", {})) for c in document["checks"]
    )
    return VerifyReport(
        prefix=request.prefix,
        python=Path(result["python"]),
        torch_version=result["torch_version"],
        suite_source=result["suite_source"],
        command=tuple(result["command"]),
        exit_code=int(result["exit_code"]),
        ok=bool(result["ok"]),
        incomplete_stage=document.get("incomplete_stage"),
        checks=checks,
        document=document,
    )


def _read_result(files: UnitFiles) -> dict[str, Any] | None:
    try:
        return dict(json.loads(files.result.read_text()))
    except (OSError, ValueError):
        return None


def _elapsed(files: UnitFiles) -> float | None:
    try:
        started = float(files.started.read_text())
    except (OSError, ValueError):
        return None
    finished = (_read_result(files) or {}).get("finished")
    return max(0.0, (float(finished) if finished is not None else time.time()) - started)


def run_job(run_dir: Path) -> int:
    """The batch job: run the suite under the site's launcher and write its report for the collecting
    side; the exit code is the suite's (0 verified, 1 not), 2 when it could not run."""
    scheduled = load(run_dir)
    request, files = scheduled.request, scheduled.files
    files.started.write_text(f"{time.time()}\n")
    print(f"channelsmith: acceptance suite in {request.prefix} on {socket.gethostname()}", flush=True)
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
        report = verify_prefix(options)
    except VerifyError as exc:
        print(f"channelsmith: {exc}", flush=True)
        write_json(files.result, {"ok": False, "finished": time.time(), "error": str(exc), "document": None})
        return 2
    write_json(
        files.result,
        {
            "ok": report.ok,
            "finished": time.time(),
            "error": None,
            "python": str(report.python),
            "torch_version": report.torch_version,
            "suite_source": report.suite_source,
            "command": list(report.command),
            "exit_code": report.exit_code,
            "document": report.document,
        },
    )
    summary = report.document["summary"]
    print(
        f"channelsmith: {'verified' if report.ok else 'NOT verified'}: {summary['pass']} pass, "
        f"{summary['fail']} fail, {summary['skipped']} skipped (exit code {report.exit_code})",
        flush=True,
    )
    return 0 if report.ok else 1
