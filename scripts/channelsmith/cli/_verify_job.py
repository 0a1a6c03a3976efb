"""`channelsmith verify --scheduler slurm|pbs` and `verify --collect DIR`: the suite as one batch job, a
live line while it waits and runs, then its report as if it had run here.

Exit codes: 0 when the suite verified the prefix (or, with --no-wait, when the job is submitted); 1 when
it did not, or the batch system ended the job (its time limit, a deletion, a node failure, ...: the
reason says which, and the report the stage the suite was in), or it ended without a report; 2 for a
user error and 3 for an environment failure, both before anything is submitted; 130 after Ctrl-C.
"""

from __future__ import annotations

import argparse
import os
import shlex
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.markup import escape
from rich.text import Text

from channelsmith.batch import time_limit_seconds
from channelsmith.cli._output import Output
from channelsmith.cli._scheduled import LiveDisplay, elapsed_text, wants_cancel
from channelsmith.errors import SchedulerError, VerifyError
from channelsmith.pbs import PbsOptions
from channelsmith.scheduler import verifying
from channelsmith.scheduler.verifying import VerifyJobOutcome, VerifyJobStatus, VerifyRequest
from channelsmith.slurm import SlurmOptions
from channelsmith.verify import VerifyReport, backends_from_csv, report_document

Presenter = Callable[[VerifyReport, Output], None]

# The options that mean something only with --scheduler, as (attribute, flag): for both batch systems,
# then for one of them only.
_SCHEDULER_ONLY = (
    ("nodes", "--nodes"), ("ntasks_per_node", "--ntasks-per-node"), ("gpus_per_node", "--gpus-per-node"),
    ("time_limit", "--time"), ("account", "--account"), ("no_wait", "--no-wait"), ("run_dir", "--run-dir"),
)  # fmt: skip
_ONLY_FOR = {
    "slurm": (("partition", "--partition"), ("sbatch_args", "--sbatch-arg")),
    "pbs": (("queue", "--queue"), ("qsub_args", "--qsub-arg")),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The batch-job options of `channelsmith verify`."""
    group = parser.add_argument_group(
        "scheduler",
        "Run the suite as one batch job on the compute nodes (docs/howto/verify.md, 'Acceptance through the scheduler'): "
        "NODES x NTASKS-PER-NODE ranks under srun (Slurm) or mpiexec (PBS); its report comes back here.",
    )
    group.add_argument(
        "--scheduler", choices=("slurm", "pbs"), default=None,
        help="submit the suite as a batch job (default: run it on this machine)",
    )  # fmt: skip
    group.add_argument(
        "--nodes", type=int, default=None, metavar="N",
        help="compute nodes of the job (default 1); for stand-in nodes on this host, pass the suite's own: -- --nodes N",
    )  # fmt: skip
    group.add_argument(
        "--ntasks-per-node", type=int, default=None, metavar="M",
        help="ranks per node, as the suite's --nproc-per-node (default 2; one per GPU on GPU nodes)",
    )  # fmt: skip
    group.add_argument(
        "--gpus-per-node", type=int, default=None, metavar="G", help="GPUs per node (default: none asked for)"
    )
    group.add_argument(
        "--time", dest="time_limit", default=None, metavar="HH:MM:SS",
        help="the job's time limit, as hours:minutes:seconds (00:30:00: 30 minutes); default: the queue's",
    )  # fmt: skip
    group.add_argument("--account", default=None, metavar="A", help="account (PBS: project, -A) charged for the job (default: yours)")
    group.add_argument("--partition", default=None, metavar="P", help="Slurm partition of the job (default: the cluster's)")
    group.add_argument("--queue", default=None, metavar="Q", help="PBS queue of the job (Derecho: main) (default: the server's)")
    group.add_argument(
        "--sbatch-arg", dest="sbatch_args", action="append", default=[], metavar="ARG",
        help="one more sbatch argument, passed as is (repeat for more; default: none)",
    )  # fmt: skip
    group.add_argument(
        "--qsub-arg", dest="qsub_args", action="append", default=[], metavar="ARG",
        help="one more qsub argument, passed as is (repeat for more; default: none)",
    )  # fmt: skip
    group.add_argument(
        "--run-dir", default=None, metavar="DIR",
        help="where the job's script, log and report go; on a file system the nodes share "
        f"(default: ./{verifying.DEFAULT_RUN_DIR})",
    )  # fmt: skip
    group.add_argument("--no-wait", action="store_true", help="print the job id and the collect command, then exit")
    group.add_argument(
        "--collect", default=None, metavar="DIR", help="wait for the verify job submitted into DIR, then show its report (default: run or submit)"
    )
    group.add_argument("--cancel-on-interrupt", action="store_true", help="on Ctrl-C, cancel the job without asking")


def check_arguments(args: argparse.Namespace) -> None:
    """Refuse option combinations that mean nothing (exit 2, before anything is submitted)."""
    if args.collect:
        options = (("scheduler", "--scheduler"), ("prefix", "--prefix"), *_SCHEDULER_ONLY, *_ONLY_FOR["slurm"],
                   *_ONLY_FOR["pbs"])  # fmt: skip
        given = [flag for attribute, flag in options if getattr(args, attribute)]
        if given:
            raise SchedulerError(
                f"--collect takes no {', '.join(given)}: it collects the job submitted into its directory",
                hint=f"run `channelsmith verify --collect {args.collect}` alone",
            )
        return
    if not args.scheduler:
        options = _SCHEDULER_ONLY + _ONLY_FOR["slurm"] + _ONLY_FOR["pbs"]
        given = [flag for attribute, flag in options if getattr(args, attribute)]
        if args.cancel_on_interrupt:
            given.append("--cancel-on-interrupt")
        if given:
            raise SchedulerError(
                f"options for a scheduler given without --scheduler: {', '.join(given)}",
                hint="add --scheduler slurm or --scheduler pbs, or leave them out to run the suite on this machine",
            )
        return
    given = [flag for attribute, flag in (("launcher", "--launcher"), ("nproc", "--nproc")) if getattr(args, attribute)]
    if given:
        raise SchedulerError(
            f"{', '.join(given)} given with --scheduler: the job starts its ranks with the site's launcher",
            hint="give the ranks as --nodes N --ntasks-per-node M instead",
        )
    for other, options in _ONLY_FOR.items():
        given = [flag for attribute, flag in options if other != args.scheduler and getattr(args, attribute)]
        if given:
            raise SchedulerError(
                f"options for {other} given with --scheduler {args.scheduler}: {', '.join(given)}",
                hint=f"leave them out, or use --scheduler {other}",
            )
    for attribute, flag, least in (("nodes", "--nodes", 1), ("ntasks_per_node", "--ntasks-per-node", 1),
                                   ("gpus_per_node", "--gpus-per-node", 0)):  # fmt: skip
        value = getattr(args, attribute)
        if value is not None and value < least:
            raise SchedulerError(f"{flag} {value} is not a valid count", hint=f"give {least} or more")
    if args.time_limit is not None:
        time_limit_seconds(args.time_limit)


def prefix_of(args: argparse.Namespace) -> Path:
    """--prefix, else the active environment; VerifyError when there is neither."""
    if args.prefix is not None:
        return Path(args.prefix)
    active = os.environ.get("CONDA_PREFIX")
    if not active:
        raise VerifyError(
            "no --prefix given and no environment is active ($CONDA_PREFIX is not set)",
            hint="pass --prefix with the deployed environment, or activate it first",
        )
    return Path(active)


def submit(args: argparse.Namespace, out: Output, prefix: Path, suite_args: tuple[str, ...], present: Presenter) -> int:
    """Submit the suite as one batch job, then wait for it unless --no-wait."""
    request = VerifyRequest(
        prefix=prefix,
        nodes=args.nodes or 1,
        ntasks_per_node=args.ntasks_per_node or 2,
        gpus_per_node=args.gpus_per_node,
        backends=backends_from_csv(args.backends),
        suite_args=suite_args,
        timeout_s=args.timeout,
    )
    options: SlurmOptions | PbsOptions
    if args.scheduler == "pbs":
        options = PbsOptions(queue=args.queue, account=args.account, walltime=args.time_limit, extra=tuple(args.qsub_args))
    else:
        options = SlurmOptions(partition=args.partition, account=args.account, time_limit=args.time_limit,
                               extra=tuple(args.sbatch_args))  # fmt: skip
    run_dir = Path(args.run_dir or verifying.DEFAULT_RUN_DIR)
    scheduled = verifying.submit(request, args.scheduler, options, run_dir)
    if args.no_wait:
        command = collect_command(scheduled.run_dir)
        if out.json_mode:
            out.json({"run_dir": scheduled.run_dir, "job_id": scheduled.job_id, "log": scheduled.files.log,
                      "collect": command})  # fmt: skip
        else:
            out.note(f"submitted verify job {scheduled.job_id}; its log: {scheduled.files.log}")
            out.note(f"collect its report when it is done (also after a logout): {command}")
        return 0
    return _wait(scheduled.run_dir, out, args.cancel_on_interrupt, present)


def collect(args: argparse.Namespace, out: Output, present: Presenter) -> int:
    """Wait for the verify job of an earlier submission, then show its report."""
    return _wait(Path(args.collect).resolve(), out, args.cancel_on_interrupt, present)


def collect_command(run_dir: Path) -> str:
    return shlex.join(["channelsmith", "verify", "--collect", str(run_dir)])


def _wait(run_dir: Path, out: Output, cancel_on_interrupt: bool, present: Presenter) -> int:
    try:
        with _LiveLine(out) as line:
            outcome = verifying.collect(run_dir, line)
    except KeyboardInterrupt:
        return _interrupted(run_dir, out, cancel_on_interrupt)
    _present(outcome, out, present)
    return 0 if outcome.ok else 1


def _interrupted(run_dir: Path, out: Output, cancel_on_interrupt: bool) -> int:
    """Ctrl-C while waiting: cancel the job (asked, or --cancel-on-interrupt) or leave it running."""
    if wants_cancel(out, cancel_on_interrupt, "cancel the verify job?"):
        cancelled = verifying.cancel(run_dir)
        out.error(f"interrupted; cancelled the verify job ({', '.join(cancelled) or 'it had ended'})")
    else:
        out.error("interrupted; the verify job goes on; collect its report later with: " + collect_command(run_dir))
    return 130


def state_text(status: VerifyJobStatus) -> str:
    """The state with its reason and, for a requeued job, how often and why ("RUNNING (requeued once: ...)")."""
    parts = [status.reason] if status.reason else []
    if status.requeue_causes:
        count = "once" if status.requeues == 1 else f"{status.requeues} times"
        parts.append(f"requeued {count}: {', then '.join(status.requeue_causes)}")
    return f"{status.state} ({'; '.join(parts)})" if parts else status.state


class _LiveLine(LiveDisplay):
    """The job's state on one line of stderr, redrawn at every look; where stderr is no terminal (a log,
    CI), one line per change of state instead."""

    def __init__(self, out: Output) -> None:
        super().__init__(out)
        self.shown = ""

    def update(self, status: VerifyJobStatus) -> None:
        line = f"verify job {status.job_id}: {state_text(status)}"
        if self.live is not None:
            waited = elapsed_text(time.monotonic() - self.started)
            self.live.update(Text(f"{line} (waited {waited}; Ctrl-C to stop waiting)"), refresh=True)
        elif line != self.shown:
            self.console.print(escape(line))
        self.shown = line


def _job_document(outcome: VerifyJobOutcome) -> dict[str, Any]:
    status = outcome.status
    return {
        "job_id": status.job_id,
        "state": status.state,
        "reason": status.reason,
        "elapsed_s": None if status.elapsed_s is None else round(status.elapsed_s, 1),
        "log": status.log,
        "requeues": status.requeues,
        "requeue_causes": list(status.requeue_causes),
    }


def _present(outcome: VerifyJobOutcome, out: Output, present: Presenter) -> None:
    """The suite's report (of a job killed mid-run: what it had, and the stage it was in), then the job's
    end on stderr: its state where it is not verified (the batch system's account first), and its log."""
    status = outcome.status
    if out.json_mode:
        document: dict[str, Any] = report_document(outcome.report) if outcome.report else {}
        document["ok"] = outcome.ok
        document["error"] = outcome.error
        document["job"] = _job_document(outcome)
        out.json(document)
    elif outcome.report is not None:
        present(outcome.report, out)
    elapsed = elapsed_text(status.elapsed_s)
    if outcome.report is None:
        out.error(f"verify job {status.job_id}: {state_text(status)}; {outcome.error}; its log: {status.log}")
    elif not outcome.ok:
        out.error(f"verify job {status.job_id}: {state_text(status)} ({elapsed}); its log: {status.log}")
    else:
        shown = f"{elapsed}; {state_text(status)}" if status.requeues else elapsed
        out.err_console.print(f"verify job {status.job_id} ({shown}); its log: {status.log}", markup=False,
                              highlight=False)  # fmt: skip
