"""`channelsmith verify`: run the acceptance suite against a deployed prefix and show its verdict."""

from __future__ import annotations

import argparse
from pathlib import Path
from channelsmith.cli import _verify_job
from channelsmith.cli._help import INTERRUPTED, add_command
from channelsmith.cli._output import Output
from channelsmith.verify import (
    VerifyOptions,
    VerifyReport,
    backends_from_csv,
    split_launcher,
    summary_rows,
    report_document,
    verify_prefix,
)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(
        subparsers,
        "verify",
        summary="run the acceptance suite (torch_dist_check) with a deployed prefix's python, here or as a batch job",
        description="Activate PREFIX (including its etc/conda/activate.d scripts) and run "
        "`python -m torch_dist_check` there: environment (NCCL loaded, NCCL network, MPI), correctness "
        "of every collective, bandwidth sweep and fault tolerance. With --scheduler, the same runs as one "
        "batch job on the compute nodes under the site's launcher (srun; mpiexec under PBS), and its report "
        "comes back here. Arguments after `--` go to the suite unchanged (e.g. -- --quick --expect-nccl-net "
        "Libfabric). docs/howto/verify.md explains each check.",
        examples=(
            "channelsmith verify --prefix ./env -- --quick",
            "channelsmith verify --prefix /shared/env --scheduler slurm --nodes 2 --ntasks-per-node 4 "
            "--gpus-per-node 4 --time 00:30:00",
        ),
        statuses=(
            (0, "verified: every check that ran passed (with --no-wait: the job is submitted)"),
            (1, "not verified: a check failed, or the suite stopped in a stage (its own stage timeout, a batch "
             "job's time limit, a deletion, a node failure: the output says which)"),
            (2, "bad input (no prefix, a prefix without torch, options that exclude each other), or the suite "
             "did not finish within --timeout or ended without its report"),
            (3, "with --scheduler: the batch system does not answer; nothing is submitted"),
            INTERRUPTED,
        ),
    )
    parser.add_argument(
        "--prefix", default=None, type=Path,
        help="the deployed environment (default: the active one, $CONDA_PREFIX); on a file system the nodes share "
        "with --scheduler",
    )  # fmt: skip
    parser.add_argument("--nproc", type=int, default=None, help="local ranks to start, as the suite's --nproc (default 2; ignored with --launcher)")
    parser.add_argument("--backends", default=None, help="comma-separated: gloo,nccl,mpi, as the suite's --backends (default: all available)")
    parser.add_argument(
        "--launcher", default=None, metavar="CMD", help='run the ranks under a launcher, e.g. "srun -n 8" or "mpiexec -n 4" (default: none: --nproc local ranks)'
    )
    parser.add_argument(
        "--timeout", type=float, default=3600.0, metavar="SECONDS",
        help="seconds the whole suite may take, all stages together (default 3600; each stage's limit is the "
        "suite's own --stage-timeout, e.g. -- --stage-timeout 600)",
    )
    parser.add_argument("--json", action="store_true", help="print the suite's full JSON report on stdout")
    _verify_job.add_arguments(parser)
    parser.add_argument("suite_args", nargs=argparse.REMAINDER, help="-- then arguments for torch_dist_check, passed unchanged (default: none)")
    parser.set_defaults(handler=run, interrupted=interrupted)


def run(args: argparse.Namespace, out: Output) -> int:
    _verify_job.check_arguments(args)
    if args.collect:
        return _verify_job.collect(args, out, present)
    extra = list(args.suite_args)
    if extra and extra[0] == "--":
        extra = extra[1:]
    prefix = _verify_job.prefix_of(args)
    if args.scheduler:
        return _verify_job.submit(args, out, prefix, tuple(extra), present)
    options = VerifyOptions(
        prefix=prefix,
        nproc=2 if args.nproc is None else args.nproc,
        backends=backends_from_csv(args.backends),
        launcher=split_launcher(args.launcher),
        suite_args=tuple(extra),
        timeout_s=args.timeout,
    )
    report = verify_prefix(options)
    if out.json_mode:
        out.json(report_document(report))
    else:
        present(report, out)
    return 0 if report.ok else 1


def interrupted(args: argparse.Namespace) -> str:
    """What a Ctrl-C left: the suite was stopped (its ranks with it) before its verdict. (A verify job
    reports itself: see _verify_job.)"""
    return (
        f"interrupted; the acceptance suite was stopped (its ranks too) and gave no verdict; "
        f"{args.prefix or 'the prefix'} is as it was (the suite writes nothing there)"
    )


def present(report: VerifyReport, out: Output) -> None:
    """The suite's checks as a table (a line when none completed), then one line with the verdict."""
    title = f"acceptance suite in {report.prefix} (torch {report.torch_version})"
    if report.checks:
        out.table(title, ("check", "status", "detail"), summary_rows(report.checks))
    else:
        out.note(f"{title}: no check completed")
    if report.gpus:
        out.note(f"GPUs: {report.gpus}")
    summary = report.document["summary"]
    verdict = "verified" if report.ok else "NOT verified"
    counts = f"{summary['pass']} pass, {summary['fail']} fail, {summary['skipped']} skipped"
    if not report.finished:
        # Stopped from outside: the stage it was in is known, an exit code of its own is not.
        out.note(f"{verdict}: {counts}; the suite did not finish: it was stopped in stage "
                 f"'{report.incomplete_stage or 'start'}' (suite from {report.suite_source})")  # fmt: skip
        return
    stage = f"; stage '{report.incomplete_stage}' did not complete" if report.incomplete_stage else ""
    out.note(f"{verdict}: {counts}{stage} (suite from {report.suite_source}, exit code {report.exit_code})")
