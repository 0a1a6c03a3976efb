"""`channelsmith build`: build recipes, one engine call per variant combination, then publish them all."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from channelsmith.build import BuildFailed, BuildJob, JobResult, build
from channelsmith.channel import DEFAULT_CHANNEL_DIR
from channelsmith.cli import _scheduled
from channelsmith.cli._build_report import present
from channelsmith.cli._help import INTERRUPTED, add_command
from channelsmith.cli._output import Output
from channelsmith.errors import RecipeError
from channelsmith.recipes import find_root, parse_overrides


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(
        subparsers,
        "build",
        summary="build recipes (each variant combination in its own engine call), test, publish into a channel",
        description="Build every variant combination the named recipes use, each in its own py-rattler-build "
        "call, run the recipes' tests, and publish all packages into the channel directory (indexed) only "
        "when every build succeeded. A failed or interrupted build leaves the channel as it was. "
        "Dependencies come from the local channel first, then the -c channels in order, and nowhere else.",
        examples=(
            "channelsmith build site-env --variant site=derecho",
            "channelsmith build pytorch-nccl-fault -c conda-forge --scheduler slurm --partition build --time 08:00:00",
        ),
        statuses=(
            (0, "every build and its tests succeeded and the packages are published (with --no-wait: the jobs "
             "are submitted)"),
            (1, "with --scheduler or --collect: a job failed, was cancelled or lost its result; nothing is "
             "published"),
            (2, "bad input (an unknown recipe, a bad option or value), or a build or its tests failed: the "
             "table says which, and nothing is published"),
            (3, "the environment failed: a channel, source or batch system that does not answer, no room on "
             "disk (checked before the first compile where it can be)"),
            INTERRUPTED,
        ),
    )
    parser.add_argument("recipes", nargs="*", metavar="RECIPE", help="recipes to build (names under recipes/; at least one, except with --collect)")
    parser.add_argument(
        "--channel-dir",
        default=str(DEFAULT_CHANNEL_DIR),
        metavar="DIR",
        help=f"the local channel to build against and publish into (default: ./{DEFAULT_CHANNEL_DIR})",
    )
    parser.add_argument(
        "-c",
        "--channel",
        action="append",
        default=[],
        dest="channels",
        metavar="CHANNEL",
        help="a further channel for dependencies, after the local one (repeat for more; e.g. conda-forge; "
        "default: the local channel alone)",
    )
    parser.add_argument(
        "--variant", action="append", default=[], metavar="KEY=VALUE",
        help="build only the combinations where KEY is VALUE (repeatable; default: every combination)",
    )  # fmt: skip
    parser.add_argument("--no-test", action="store_true", help="skip the recipes' tests")
    parser.add_argument("--json", action="store_true", help="print the build report as JSON on stdout")
    _scheduled.add_arguments(parser)
    parser.set_defaults(handler=run, interrupted=interrupted)


def run(args: argparse.Namespace, out: Output) -> int:
    _scheduled.check_arguments(args)
    if args.collect:
        return _scheduled.collect(args, out)
    if not args.recipes:
        raise RecipeError("no recipe named", hint="name the recipes to build, e.g. channelsmith build site-env")
    root = Path(args.root).resolve() if args.root else find_root()
    overrides = parse_overrides(args.variant)
    if args.scheduler:
        return _scheduled.submit(args, out, root, overrides)
    with _ProgressObserver(out) as observer:
        try:
            report = build(
                root,
                args.recipes,
                Path(args.channel_dir),
                extra_channels=args.channels,
                overrides=overrides,
                run_tests=not args.no_test,
                observer=observer,
            )
        except BuildFailed as failure:
            observer.stop()
            present(failure.report, out)
            raise
    present(report, out)
    return 0


def interrupted(args: argparse.Namespace) -> str:
    """What a Ctrl-C left: the builds stop, their work folders go, and the channel is published into only
    after every build succeeded. (A scheduled build reports its jobs itself.)"""
    return "interrupted; nothing was published (the channel is as it was)"


class _ProgressObserver:
    """A rich progress bar over the engine calls, with the current build step beside it."""

    def __init__(self, out: Output) -> None:
        self.out = out
        self.progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("[dim]{task.fields[step]}"),
            console=out.console,
            transient=True,
        )
        self.task = self.progress.add_task("building", total=None, step="")
        self.started = False

    def __enter__(self) -> _ProgressObserver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        if self.started:
            self.progress.stop()
            self.started = False

    def job_started(self, job: BuildJob, index: int, total: int) -> None:
        # Started with the first engine call, so that errors found before it print on their own.
        if not self.started:
            self.progress.start()
            self.started = True
        self.progress.update(self.task, total=total, completed=index, description=escape(job.label), step="starting")

    def step(self, job: BuildJob, message: str) -> None:
        self.progress.update(self.task, step=escape(message[:60]))

    def log(self, job: BuildJob, line: str) -> None:
        return None  # the bar shows steps; a failed build's error carries the log's tail

    def job_finished(self, job: BuildJob, result: JobResult) -> None:
        self.progress.advance(self.task)
        label, seconds = escape(job.label), f"{result.seconds:.1f} s"
        if not result.ok:
            line = f"[red]FAILED[/red] {label} after {seconds}"
        elif result.packages:
            names = escape(", ".join(p.file.name for p in result.packages))
            line = f"[green]built[/green] {label} in {seconds}: {names}"
        else:
            line = f"[dim]up to date[/dim] {label}: already in the channel"
        self.progress.console.print(line)
