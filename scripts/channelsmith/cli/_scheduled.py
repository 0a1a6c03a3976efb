"""`channelsmith build --scheduler slurm|pbs` and `build --collect DIR`: batch jobs, a live table, one publish.

Exit codes: 0 when every job succeeded and the packages are published (or, with --no-wait, when the
jobs are submitted); 1 when a job failed, was cancelled or lost its result (nothing is published);
2 for a user error and 3 for an environment failure (the batch system, a channel or a source that does not answer,
no room on disk), both before anything is submitted; 130 after Ctrl-C.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.live import Live
from rich.markup import escape
from rich.prompt import Confirm
from rich.table import Table

from channelsmith import pbs, scheduler
from channelsmith.cli._build_report import present, report_document
from channelsmith.cli._output import Output
from channelsmith.errors import SchedulerError
from channelsmith.scheduler import ScheduledBuild, ScheduledReport, UnitStatus
from channelsmith.pbs import PbsOptions
from channelsmith.slurm import SlurmOptions

# The options that only mean something with --scheduler, as (attribute, flag): for both batch
# systems, then for one of them only.
_SCHEDULER_ONLY = (("account", "--account"), ("time_limit", "--time"), ("no_wait", "--no-wait"))
_ONLY_FOR = {
    "slurm": (
        ("partition", "--partition"),
        ("cpus_per_task", "--cpus-per-task"),
        ("gpus", "--gpus"),
        ("sbatch_args", "--sbatch-arg"),
    ),
    "pbs": (("queue", "--queue"), ("select", "--select"), ("qsub_args", "--qsub-arg")),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The scheduler options of `channelsmith build`."""
    group = parser.add_argument_group(
        "scheduler",
        "Build on compute nodes: one batch job per engine output directory (a staging compile and the "
        "outputs reusing it stay in one job), jobs wait for the jobs building packages they require, "
        "and the packages are published when every job succeeded (docs/howto/build-on-a-scheduler.md).",
    )
    group.add_argument(
        "--scheduler", choices=("slurm", "pbs"), default=None,
        help="submit the builds as batch jobs of Slurm or PBS (PBS Pro, OpenPBS) (default: build on this machine)",
    )  # fmt: skip
    group.add_argument("--partition", default=None, metavar="P", help="Slurm partition of every job (default: the cluster's)")
    group.add_argument("--account", default=None, metavar="A", help="account (PBS: project, -A) charged for the jobs (default: yours)")
    group.add_argument(
        "--time", dest="time_limit", default=None, metavar="HH:MM:SS", help="time limit per job (PBS: walltime) (default: the queue's)"
    )
    group.add_argument("--queue", default=None, metavar="Q", help="PBS queue of every job (Derecho: main) (default: the server's)")
    group.add_argument(
        "--select", default=None, metavar="SPEC",
        help="PBS select statement of every job, without 'select=' (e.g. 1:ncpus=64; default: the queue's)",
    )  # fmt: skip
    group.add_argument(
        "--qsub-arg", dest="qsub_args", action="append", default=[], metavar="ARG",
        help="one more qsub argument, passed as is (repeat for more; e.g. --qsub-arg=-lmem=200GB; default: none)",
    )  # fmt: skip
    group.add_argument("--cpus-per-task", type=int, default=None, metavar="N", help="CPUs per job (default: the partition's)")
    group.add_argument("--gpus", type=int, default=None, metavar="N", help="GPUs per job (default: none asked for)")
    group.add_argument(
        "--sbatch-arg", dest="sbatch_args", action="append", default=[], metavar="ARG",
        help="one more sbatch argument, passed as is (repeat for more; e.g. --sbatch-arg=--mem=64G; default: none)",
    )  # fmt: skip
    group.add_argument(
        "--build-dir", default=str(scheduler.DEFAULT_BUILD_DIR), metavar="DIR",
        help="where the jobs build and the state file lives; on a file system the compute nodes share "
        f"(default: ./{scheduler.DEFAULT_BUILD_DIR})",
    )  # fmt: skip
    group.add_argument("--no-wait", action="store_true", help="print the job ids and the collect command, then exit")
    group.add_argument(
        "--collect", default=None, metavar="DIR",
        help="wait for the jobs of a build submitted into DIR (even from another login), then publish (default: build or submit)",
    )  # fmt: skip
    group.add_argument(
        "--cancel-on-interrupt", action="store_true", help="on Ctrl-C, cancel the jobs without asking"
    )


def check_arguments(args: argparse.Namespace) -> None:
    """Refuse option combinations that mean nothing (exit 2, before anything is submitted)."""
    if args.collect and args.recipes:
        raise SchedulerError(
            "--collect takes no recipes: it collects what was submitted into its directory",
            hint=f"run `channelsmith build --collect {args.collect}` alone",
        )
    if args.collect and args.scheduler:
        raise SchedulerError("--collect and --scheduler exclude each other", hint="collect with --collect DIR alone")
    if not args.scheduler:
        options = _SCHEDULER_ONLY + _ONLY_FOR["slurm"] + _ONLY_FOR["pbs"]
        given = [flag for attribute, flag in options if getattr(args, attribute)]
        if args.cancel_on_interrupt and not args.collect:
            given.append("--cancel-on-interrupt")
        if given:
            raise SchedulerError(
                f"options for a scheduler given without --scheduler: {', '.join(given)}",
                hint="add --scheduler slurm or --scheduler pbs, or leave them out for a build on this machine",
            )
    else:
        for other, options in _ONLY_FOR.items():
            given = [flag for attribute, flag in options if other != args.scheduler and getattr(args, attribute)]
            if given:
                raise SchedulerError(
                    f"options for {other} given with --scheduler {args.scheduler}: {', '.join(given)}",
                    hint=f"leave them out, or use --scheduler {other}",
                )
    if args.scheduler == "pbs":
        if args.select is not None:
            pbs.check_select(args.select)
        if args.time_limit is not None:
            pbs.walltime_seconds(args.time_limit)
    if args.cpus_per_task is not None and args.cpus_per_task < 1:
        raise SchedulerError(f"--cpus-per-task {args.cpus_per_task} is not a valid count", hint="give 1 or more")
    if args.gpus is not None and args.gpus < 0:
        raise SchedulerError(f"--gpus {args.gpus} is not a valid count", hint="give 0 or more")


def submit(args: argparse.Namespace, out: Output, root: Path, overrides: dict[str, str]) -> int:
    """Submit the build, then wait for it unless --no-wait."""
    request = scheduler.BuildRequest(
        root=root,
        recipes=tuple(args.recipes),
        overrides=overrides,
        channel_dir=Path(args.channel_dir),
        extra_channels=tuple(args.channels),
        run_tests=not args.no_test,
    )
    options: SlurmOptions | PbsOptions
    if args.scheduler == "pbs":
        options = pbs.with_site_profile(
            PbsOptions(queue=args.queue, account=args.account, walltime=args.time_limit, select=args.select,
                       extra=tuple(args.qsub_args)),
            overrides.get("site"),
        )  # fmt: skip
    else:
        options = SlurmOptions(
            partition=args.partition,
            account=args.account,
            time_limit=args.time_limit,
            cpus_per_task=args.cpus_per_task,
            gpus=args.gpus,
            extra=tuple(args.sbatch_args),
        )
    scheduled = scheduler.submit(request, args.scheduler, options, Path(args.build_dir))
    if args.no_wait:
        _present_submitted(scheduled, out)
        return 0
    return _wait(scheduled.build_dir, out, args.cancel_on_interrupt)


def collect(args: argparse.Namespace, out: Output) -> int:
    """Wait for the jobs of an earlier submission, then publish."""
    return _wait(Path(args.collect).resolve(), out, args.cancel_on_interrupt)


def collect_command(build_dir: Path) -> str:
    """The command that collects a build later, from any login to the same file system."""
    return shlex.join(["channelsmith", "build", "--collect", str(build_dir)])


def _wait(build_dir: Path, out: Output, cancel_on_interrupt: bool) -> int:
    try:
        with _LiveTable(out) as table:
            result = scheduler.collect(build_dir, table)
    except KeyboardInterrupt:
        return _interrupted(build_dir, out, cancel_on_interrupt)
    _present_collected(result, out)
    return 0 if result.ok else 1


def wants_cancel(out: Output, cancel_on_interrupt: bool, question: str) -> bool:
    """After Ctrl-C while waiting on batch jobs: cancel them? Yes with --cancel-on-interrupt; a terminal is
    asked ``question``; anything else (a script, a log) leaves them running."""
    if cancel_on_interrupt:
        return True
    if sys.stdin.isatty():
        return Confirm.ask(question, console=out.err_console, default=False)
    return False


def _interrupted(build_dir: Path, out: Output, cancel_on_interrupt: bool) -> int:
    """Ctrl-C while waiting: cancel the jobs (asked, or --cancel-on-interrupt) or leave them running."""
    if wants_cancel(out, cancel_on_interrupt, "cancel the build's pending and running jobs?"):
        cancelled = scheduler.cancel(build_dir)
        shown = ", ".join(cancelled) or "none were left"
        out.error(f"interrupted; cancelled the build's jobs ({shown}); nothing was published")
    else:
        out.error(
            "interrupted; the jobs go on and nothing was published yet; collect them later with: "
            + collect_command(build_dir)
        )
    return 130


def elapsed_text(seconds: float | None) -> str:
    """Seconds as H:MM:SS, '-' when unknown."""
    if seconds is None:
        return "-"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


def _state(status: UnitStatus) -> str:
    return f"{status.state} ({status.reason})" if status.reason else status.state


def _status_table(statuses: Sequence[UnitStatus], title: str) -> Table:
    table = Table(title=title)
    for column in ("job", "variant", "state", "elapsed", "log"):
        table.add_column(column)
    colours = {"COMPLETED": "green", scheduler.IN_CHANNEL: "dim", "RUNNING": "cyan", "PENDING": "yellow"}
    for status in statuses:
        colour = colours.get(status.state, "red" if status.ended else "")
        state = f"[{colour}]{escape(_state(status))}[/{colour}]" if colour else escape(_state(status))
        log = str(status.files.log) if status.unit.job_id else "-"
        table.add_row(status.unit.job_id or "-", escape(status.unit.label), state, elapsed_text(status.elapsed_s), log)
    return table


class LiveDisplay:
    """What a wait on batch jobs shows on stderr: redrawn in place (rich's Live) where stderr is a terminal;
    elsewhere (a log, CI) the subclass prints a line per change of state."""

    def __init__(self, out: Output) -> None:
        self.console = out.err_console
        self.live = Live(console=self.console, auto_refresh=False) if self.console.is_terminal else None
        self.started = time.monotonic()

    def __enter__(self) -> Any:
        if self.live is not None:
            self.live.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.live is not None:
            self.live.stop()


class _LiveTable(LiveDisplay):
    """The jobs as a table on stderr, redrawn at every look at the batch system; where stderr is no terminal (a log,
    CI), one line per change of a job's state instead, and the table once at the end."""

    def __init__(self, out: Output) -> None:
        super().__init__(out)
        self.shown: dict[str, str] = {}
        self.last: Sequence[UnitStatus] = ()

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        if self.live is None and self.last:
            self.console.print(_status_table(self.last, "jobs"))

    def update(self, statuses: Sequence[UnitStatus]) -> None:
        self.last = statuses
        if self.live is not None:
            waited = elapsed_text(time.monotonic() - self.started)
            self.live.update(_status_table(statuses, f"jobs (waited {waited}; Ctrl-C to stop waiting)"), refresh=True)
            return
        for status in statuses:
            state = _state(status)
            if self.shown.get(status.unit.id) != state:
                self.shown[status.unit.id] = state
                self.console.print(f"job {status.unit.job_id or '-'} {escape(status.unit.label)}: {escape(state)}")


def _jobs_document(statuses: Sequence[UnitStatus]) -> list[dict[str, Any]]:
    return [
        {
            "unit": s.unit.id,
            "job_id": s.unit.job_id,
            "recipe": s.unit.recipe,
            "variant": s.unit.label,
            "variants": s.unit.variants,
            "state": s.state,
            "reason": s.reason,
            "elapsed_s": None if s.elapsed_s is None else round(s.elapsed_s, 1),
            "log": str(s.files.log) if s.unit.job_id else None,
        }
        for s in statuses
    ]


def _present_submitted(scheduled: ScheduledBuild, out: Output) -> None:
    statuses = scheduler.unit_statuses(scheduled)
    command = collect_command(scheduled.build_dir)
    if out.json_mode:
        out.json({"build_dir": str(scheduled.build_dir), "collect": command, "jobs": _jobs_document(statuses)})
        return
    out.console.print(_status_table(statuses, f"submitted into {scheduled.build_dir}"))
    out.note(f"collect and publish when they are done (also after a logout): {command}")


def _present_collected(result: ScheduledReport, out: Output) -> None:
    if out.json_mode:
        document = report_document(result.report)
        document["ok"] = result.ok
        document["build_dir"] = str(result.build_dir)
        document["jobs"] = _jobs_document(result.statuses)
        out.json(document)
    else:
        present(result.report, out)
    for status in result.failed:
        errors = [r.error for r in status.results if r.error]
        cause = f": {errors[0].splitlines()[0]}" if errors else ""
        log = f"; its log: {status.files.log}" if status.files.log.is_file() else "; it never ran"
        out.error(f"job {status.unit.job_id} {status.unit.label}: {_state(status)}{cause}{log}")
    if result.failed:
        out.err_console.print(
            "nothing was published; the channel is as it was. Fix the cause and run the same command again: "
            "only the jobs that did not succeed are submitted again",
            markup=False,
            highlight=False,
        )
