"""Check results, their merge across ranks, the summary table and the JSON document."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

PASS, FAIL, SKIPPED = "pass", "fail", "skipped"

# Exit codes of the whole run.
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INCOMPLETE = 0, 1, 2, 3

SCHEMA_VERSION = 1


@dataclass
class CheckResult:
    """One check's verdict on one rank (or merged over all ranks).

    ``details`` holds every figure the check measured; ``reason`` says in one line why it failed or
    was skipped (and may summarise a pass).
    """

    name: str
    status: str
    reason: str = ""
    details: dict[str, Any] = field(default_factory=dict)
    duration_s: float = 0.0
    ranks: list[int] = field(default_factory=list)

    @classmethod
    def skipped(cls, name: str, reason: str, **details: Any) -> CheckResult:
        """A check that was not run, and why."""
        return cls(name, SKIPPED, reason, dict(details))


def merge_rank_results(per_rank: Sequence[Sequence[CheckResult]]) -> list[CheckResult]:
    """Merge each rank's results into one result per check name, in first-seen order.

    A check fails if it failed on any rank, is skipped only if every rank skipped it, and passes
    otherwise. Reasons of failing ranks are kept with their rank numbers; details come from the
    lowest rank that ran the check, plus ``per_rank`` entries for ranks whose details differ.
    """
    order: list[str] = []
    by_name: dict[str, list[tuple[int, CheckResult]]] = {}
    for rank, results in enumerate(per_rank):
        for result in results:
            if result.name not in by_name:
                order.append(result.name)
                by_name[result.name] = []
            by_name[result.name].append((rank, result))

    merged: list[CheckResult] = []
    for name in order:
        entries = by_name[name]
        statuses = {r.status for _, r in entries}
        if FAIL in statuses:
            status = FAIL
        elif statuses == {SKIPPED}:
            status = SKIPPED
        else:
            status = PASS
        ran = [(rank, r) for rank, r in entries if r.status != SKIPPED] or entries
        base_rank, base = ran[0]
        if status == FAIL:
            reasons = [f"rank {rank}: {r.reason}" for rank, r in entries if r.status == FAIL]
            reason = "; ".join(reasons) if len(entries) > 1 else entries[0][1].reason
        else:
            reason = base.reason
        details = dict(base.details)
        differing = {str(rank): r.details for rank, r in ran if rank != base_rank and r.details != base.details}
        if differing:
            details["per_rank"] = differing
        merged.append(
            CheckResult(
                name=name,
                status=status,
                reason=reason,
                details=details,
                duration_s=max(r.duration_s for _, r in entries),
                ranks=[rank for rank, _ in entries],
            )
        )
    return merged


def summarize(results: Iterable[CheckResult]) -> dict[str, Any]:
    """Counts per status and the overall verdict (ok only if no non-skipped check failed)."""
    counts = {PASS: 0, FAIL: 0, SKIPPED: 0}
    for result in results:
        counts[result.status] += 1
    return {**counts, "ok": counts[FAIL] == 0}


def build_document(
    results: Sequence[CheckResult],
    job: dict[str, Any],
    incomplete_stage: str | None,
    extras: dict[str, Any],
    in_progress: bool = False,
) -> dict[str, Any]:
    """The JSON document (schema in docs/howto/verify.md).

    ``in_progress``: the run is still in ``incomplete_stage`` and gave no verdict yet (the copy rank 0
    writes as each stage starts); a run killed from outside leaves that copy, and whoever reads it
    knows the suite did not finish, whatever its launcher's exit status says.
    """
    summary = summarize(results)
    if incomplete_stage is not None:
        summary["ok"] = False
    return {
        "schema": SCHEMA_VERSION,
        "tool": "torch_dist_check",
        "version": _version(),
        "created_unix": time.time(),
        "job": job,
        "incomplete_stage": incomplete_stage,
        "in_progress": in_progress,
        "summary": summary,
        "checks": [asdict(r) for r in results],
        **extras,
    }


def _version() -> str:
    from torch_dist_check import __version__

    return __version__


@dataclass(frozen=True)
class OutputProblem:
    """Why a report file (--json, --plot) cannot be written where it was asked for, and what to do."""

    message: str
    hint: str


def output_path_problem(option: str, destination: str) -> OutputProblem | None:
    """Why the report file ``destination`` of ``option`` cannot be written, or None if it can.

    Looked at before any check runs, so that a mistyped path costs no run; creates nothing (a missing
    folder is the user's to make, never made silently). The JSON report replaces its file through a
    temporary one in the same folder; the plot is written in place.
    """
    path = Path(destination)
    parent = path.parent
    example = f"{option} {path.name if path.name else 'report'}"
    try:
        path.exists()
    except OSError as exc:  # a name the file system refuses (too long)
        return OutputProblem(f"{option} {destination}: {exc.strerror}", "pass a shorter file name")
    if path.is_dir():
        name = "sweep.png" if option == "--plot" else "report.json"
        return OutputProblem(f"{option} {destination} is a directory, not a file name",
                             f"name the file to write, e.g. {option} {path / name}")  # fmt: skip
    if not parent.is_dir():
        what = "is not a directory" if parent.exists() else "does not exist"
        return OutputProblem(f"{option} {destination}: the folder {parent} {what}",
                             f"create it first (mkdir -p {parent}), or write into the current folder: {example}")  # fmt: skip
    if not os.access(parent, os.W_OK | os.X_OK):
        return OutputProblem(f"{option} {destination}: the folder {parent} is not writable",
                             f"pass a path in a folder you can write to, e.g. {example}")  # fmt: skip
    if option == "--json" and path.exists() and not path.is_file():
        return OutputProblem(f"--json {destination} exists and is not a regular file (the report replaces it)",
                             "pass the name of a new or regular file, or - for stdout")  # fmt: skip
    if path.exists() and not os.access(path, os.W_OK):
        return OutputProblem(f"{option} {destination} exists and is not writable",
                             f"make it writable, or pass another file name, e.g. {example}")  # fmt: skip
    return None


def write_json(document: dict[str, Any], destination: str) -> None:
    """Write the document to a file (atomically), or to stdout for ``-``. OSError if the file cannot be written."""
    text = json.dumps(document, indent=2, default=str) + "\n"
    if destination == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    path = Path(destination)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


def render_table(results: Sequence[CheckResult], stream: TextIO) -> None:
    """A plain-text summary table for people: check, status, one-line reason or key figure."""
    rows = [("CHECK", "STATUS", "DETAIL")]
    for r in results:
        rows.append((r.name, r.status.upper(), _one_line(r.reason)))
    width0 = max(len(r[0]) for r in rows)
    width1 = max(len(r[1]) for r in rows)
    for name, status, detail in rows:
        stream.write(f"{name:<{width0}}  {status:<{width1}}  {detail}\n")
    summary = summarize(results)
    # Not "N passed, N failed": CI log readers take that form for a test runner's closing line.
    stream.write(f"checks: {summary[PASS]} pass, {summary[FAIL]} fail, {summary[SKIPPED]} skipped\n")
    stream.flush()


def _one_line(text: str, limit: int = 110) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


class StageTracker:
    """Names the stage a rank is in and bounds how long any stage may take.

    A background thread fires ``on_timeout(stage, limit_s)`` once when a stage outlives its limit;
    the callback reports which stage did not complete and ends the process, so no verdict hangs
    on a stuck collective or a dead peer.
    """

    def __init__(self, limit_s: float, on_timeout: Callable[[str, float], None], status_file: Path | None) -> None:
        self._limit_s = limit_s
        self._on_timeout = on_timeout
        self._status_file = status_file
        self._lock = threading.Lock()
        self._stage = "start"
        self._deadline = time.monotonic() + limit_s
        self._current_limit = limit_s
        self._thread = threading.Thread(target=self._watch, name="torch-dist-check-stage-watchdog", daemon=True)
        self._thread.start()

    @property
    def stage(self) -> str:
        """The stage this rank is in now."""
        with self._lock:
            return self._stage

    def enter(self, stage: str, limit_s: float | None = None) -> None:
        """Start a stage; it must end (the next ``enter``) within ``limit_s`` (default: the tracker's)."""
        limit = self._limit_s if limit_s is None else limit_s
        with self._lock:
            self._stage = stage
            self._current_limit = limit
            self._deadline = time.monotonic() + limit
        if self._status_file is not None:
            self._status_file.write_text(stage + "\n")

    def _watch(self) -> None:
        while True:
            time.sleep(0.2)
            with self._lock:
                expired = time.monotonic() > self._deadline
                stage, limit = self._stage, self._current_limit
            if expired:
                self._on_timeout(stage, limit)
                return
