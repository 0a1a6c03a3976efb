"""The batch job: one unit built into its output directory on a compute node, its result written for
the collecting side (``python -m channelsmith.scheduler BUILD_DIR UNIT_ID``)."""

from __future__ import annotations

import json
import socket
import sys
import time
from collections.abc import Iterable
from pathlib import Path

from channelsmith.build import BuildJob, JobResult, build_unpublished, plan_jobs
from channelsmith.errors import SchedulerError, UserError
from channelsmith.scheduler.state import BuildRequest, Identity, Unit, load, result_document, write_json

class _JobLog:
    """Writes the engine's progress and its whole log to stdout, which the batch system keeps as the job's log."""

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
    write_json(files.result, {"ok": ok, "finished": time.time(), "results": [result_document(r) for r in results]})
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
