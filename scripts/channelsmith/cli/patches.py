"""`channelsmith patches check|port|compile-check`: patch series against real upstream source."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from channelsmith import patches as series_tools
from channelsmith.cli._help import INTERRUPTED, USER_ERROR, DeprecatedAlias, add_command
from channelsmith.cli._output import Output
from channelsmith.recipes import find_root
from channelsmith.sources import CACHE_ENV, DEFAULT_CACHE, OFFLINE_ENV, SourceFinder, cache_root, offline_requested, open_given

EXIT_FAILED = 1


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(
        subparsers,
        "patches",
        summary="check patch series against real upstream source, port them, compile-check them",
        description="Patch series tooling: `channelsmith patches ACTION --help` shows each action's options.",
        examples=(
            "channelsmith patches check pytorch-nccl-fault --offline",
            "channelsmith patches port pytorch/cuda-aware-mpi --from 2.6.0 --to 2.7.1 --source ./pytorch-v2.7.1",
        ),
        statuses=(
            (0, "nothing failed"),
            (EXIT_FAILED, "a patch or a unit failed (each action's --help says which)"),
            USER_ERROR,
            INTERRUPTED,
        ),
    )
    commands = parser.add_subparsers(dest="patches_command", metavar="ACTION")
    commands.required = True

    check = add_command(
        commands,
        "check",
        summary="apply every rendered patch list, in order, to its real upstream tree (strip 1, no fuzz)",
        description="For every (recipe, upstream version) with patches, obtain the upstream tree (--source, "
        "the source cache, the recipe's release tarball checked against its sha256, Debian's source package) "
        "and apply the patches in order. Each (recipe, series, version) is verified, failed or unverifiable. "
        "Writes nothing in the repository.",
        examples=(
            "channelsmith patches check",
            "channelsmith patches check pytorch-cray-mpich --version 2.7.1 --source ./pytorch-v2.7.1",
        ),
        statuses=(
            (0, "no series failed (an unverifiable one is listed with the reason)"),
            (EXIT_FAILED, "a series failed to apply (--strict: or was unverifiable)"),
            (2, "bad input: an unknown recipe or version, a --source that is not a release tree or tarball"),
            INTERRUPTED,
        ),
    )
    check.add_argument("recipes", nargs="*", metavar="RECIPE", help="recipes to check (default: all with patches)")
    check.add_argument("--version", action="append", default=[], dest="versions", metavar="V",
                       help="check only upstream version V (repeatable; default: every version with patches)")
    check.add_argument("--strict", action="store_true", help="also exit 1 when a series is unverifiable")
    _source_options(check)
    check.add_argument("--json", action="store_true", help="print the results as JSON on stdout")
    check.set_defaults(handler=run_check, interrupted=interrupted_reading)

    port = add_command(
        commands,
        "port",
        summary="apply a series of one version to another version's tree and write the regenerated series",
        description="Apply SERIES at --from to the --to tree, write patches/<project>/<to>/<series>/ with "
        "regenerated diffs and headers whose Versions: names the new version, report hunks that need a "
        "human (their .rej go to the report folder, not into the repository) and print the recipe block "
        "to add.",
        examples=(
            "channelsmith patches port pytorch/cuda-aware-mpi --from 2.6.0 --to 2.7.1 --source ./pytorch-v2.7.1",
            "channelsmith patches port pytorch/nccl-fault --from 2.15.0 --to 2.16.0 --source ./pytorch-v2.16.0 "
            "--report ./port-report",
        ),
        statuses=(
            (0, "every hunk applied: the regenerated series is written"),
            (EXIT_FAILED, "some hunks need a human: the patches that applied are written, the others' .rej files and "
             "partial diffs are in the report folder"),
            (2, "bad input: an unknown series or version, a target folder that exists (without --force)"),
            INTERRUPTED,
        ),
    )
    port.add_argument("series", metavar="SERIES", help="PROJECT/SERIES, e.g. pytorch/nccl-fault (required)")
    port.add_argument("--from", dest="from_version", required=True, metavar="V1", help="version to port from (required)")
    port.add_argument("--to", dest="to_version", required=True, metavar="V2", help="version to port to (required)")
    port.add_argument("--force", action="store_true", help="replace the patches of an existing target folder")
    port.add_argument("--report", metavar="DIR", default=None,
                      help="where .rej files and partial diffs go (default: CACHE/port-reports/SERIES-V1-to-V2, CACHE being "
                           "--cache-dir)")
    _source_options(port)
    port.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    port.set_defaults(handler=run_port, interrupted=interrupted_port)

    compile_check = add_command(
        commands,
        "compile-check",
        summary="compile each translation unit a series patches (-fsyntax-only) against the release wheel's headers",
        description="Apply each series to its upstream tree, then compile every patched C++ file (and a unit "
        "including each patched header) with -fsyntax-only against torch/include of the matching PyTorch "
        "release wheel, mpi.h (MPICH), nccl.h (NVIDIA NCCL wheel) and the CUDA headers, with the build's "
        "defines.",
        examples=(
            "channelsmith patches compile-check pytorch-cray-mpich --version 2.6.0",
        ),
        statuses=(
            (0, "every unit compiled (or was skipped, with the reason)"),
            (EXIT_FAILED, "a unit failed to compile: its compiler log follows the table"),
            (2, "bad input: an unknown recipe or version, a --source that is not a release tree or tarball"),
            INTERRUPTED,
        ),
    )
    compile_check.add_argument("recipes", nargs="*", metavar="RECIPE", help="recipes to compile-check (default: all with patches)")
    compile_check.add_argument("--version", action="append", default=[], dest="versions", metavar="V",
                               help="only upstream version V (repeatable; default: every version with patches)")
    _source_options(compile_check)
    compile_check.add_argument("--json", action="store_true", help="print the results as JSON on stdout")
    compile_check.set_defaults(handler=run_compile_check, interrupted=interrupted_reading)


def interrupted_reading(args: argparse.Namespace) -> str:
    """What a Ctrl-C left in `check` and `compile-check`: they patch copies in temporary folders (removed)
    and write nothing in the repository; a download cut short is never used as a finished one."""
    return (
        "interrupted; nothing in the repository was changed (patches are applied to temporary copies, "
        "now removed); a download cut short in the source cache is not used: the next run fetches it again"
    )


def interrupted_port(args: argparse.Namespace) -> str:
    """What a Ctrl-C left in `port`: the regenerated series is staged and moved into the repository last."""
    project, _, name = args.series.partition("/")
    return (
        f"interrupted; patches/{project}/{args.to_version}/{name}/ is unchanged unless the port was already "
        "moving the regenerated patches into it (its last step): if it is there, run the port again with --force; "
        "the report folder may hold .rej files of this run"
    )


def _source_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--source", metavar="DIR|TARBALL", default=None,
                        help="an upstream tree or release tarball to use for its version (version.txt or NCCL's "
                             "makefiles/version.mk decides; default: the source cache, else a download)")
    parser.add_argument("--cache-dir", dest="cache", metavar="DIR", default=None,
                        help="channelsmith's cache (the same for every command), where upstream trees and release "
                        f"tarballs are kept (default: ${CACHE_ENV}, else {DEFAULT_CACHE}; formerly --cache)")
    parser.add_argument("--cache", dest="cache", metavar="DIR", action=DeprecatedAlias, replacement="--cache-dir")
    parser.add_argument("--offline", action="store_true",
                        help=f"never download release tarballs (also: {OFFLINE_ENV}=1)")


def _finder(args: argparse.Namespace, project: str = "pytorch") -> SourceFinder:
    given = open_given(Path(args.source), project) if args.source else None
    return SourceFinder(cache_root(args.cache), given=given, offline=args.offline or offline_requested())


def _root(args: argparse.Namespace) -> Path:
    return Path(args.root).resolve() if args.root else find_root()


def run_check(args: argparse.Namespace, out: Output) -> int:
    root = _root(args)
    started = time.monotonic()
    results = series_tools.check(root, _finder(args), args.recipes, args.versions)
    elapsed = time.monotonic() - started
    failed = [r for r in results if r.status == series_tools.FAILED]
    unverifiable = [r for r in results if r.status == series_tools.UNVERIFIABLE]
    code = EXIT_FAILED if failed or (args.strict and unverifiable) else 0
    if out.json_mode:
        out.json({"ok": code == 0, "seconds": round(elapsed, 1), "results": results})
        return code
    out.table(
        "patch series checked against upstream source",
        ("recipe", "for package version", "series", "version", "patches", "status", "source / why"),
        (
            (r.recipe, _builds(r.builds), f"{r.series} (reconstructed)" if r.reconstructed else r.series,
             r.version, r.patches, r.status, r.source if r.status != series_tools.UNVERIFIABLE else r.reason)
            for r in results
        ),
    )
    # A reconstructed series applies to real upstream source, but what it produces is not a release's
    # file: say so next to the verdict, every time.
    for result in results:
        if result.reconstructed:
            out.note(f"RECONSTRUCTED {result.series} {result.version} ({result.recipe}): {result.reconstructed}")
    for result in failed:
        for failure in result.failures:
            out.note(f"FAILED {result.series} {result.version}: {failure.patch}: {failure.file} {failure.hunk}")
            out.note(f"  {failure.message}")
            for line in failure.mismatches:
                out.note(f"    {line}")
    counts = {s: sum(1 for r in results if r.status == s)
              for s in (series_tools.VERIFIED, series_tools.FAILED, series_tools.UNVERIFIABLE)}
    out.note(", ".join(f"{n} {s}" for s, n in counts.items()) + f" ({elapsed:.1f} s)")
    return code


def _builds(versions: tuple[str, ...]) -> str:
    """Which of the recipe's package versions a row is for: one release's series may serve several builds
    (torch-mpi-backend 2.11.0 compiles 2.6.0's ProcessGroupMPI.cpp)."""
    return ", ".join(versions) or "-"


def run_port(args: argparse.Namespace, out: Output) -> int:
    root = _root(args)
    project = args.series.partition("/")[0]
    cache = cache_root(args.cache)
    report = Path(args.report).resolve() if args.report else (
        cache / "port-reports" / f"{args.series.replace('/', '-')}-{args.from_version}-to-{args.to_version}"
    )
    result = series_tools.port(
        root, args.series, args.from_version, args.to_version, _finder(args, project), report, force=args.force,
    )
    code = 0 if result.clean else EXIT_FAILED
    if out.json_mode:
        out.json({"clean": result.clean, "result": result})
        return code
    out.note(f"ported {result.series} {result.from_version} -> {result.to_version} onto {result.source}")
    out.table(
        f"{result.target_dir}",
        ("patch", "written", "needs a human"),
        (
            (p.name, p.written or "no (see the report folder)", "; ".join(f"{f.file} {f.hunk} ({f.message})" for f in p.rejected) or "no")
            for p in result.patches
        ),
    )
    if not result.clean:
        out.note(f"rejected hunks (.rej) and partial diffs: {result.report_dir}")
    out.note("add this block to the recipe's source list (not done for you):")
    out.note(result.recipe_block)
    return code


def run_compile_check(args: argparse.Namespace, out: Output) -> int:
    root = _root(args)
    started = time.monotonic()
    with out.steps("compile-check") as step:
        results = series_tools.compile_check(
            root, _finder(args), cache_root(args.cache), args.recipes, args.versions, progress=step
        )
    elapsed = time.monotonic() - started
    broken = [r for r in results if r.status == series_tools.FAILED]
    code = EXIT_FAILED if broken else 0
    if out.json_mode:
        out.json({"ok": code == 0, "seconds": round(elapsed, 1), "units": results})
        return code
    out.table(
        "patched translation units compiled (-fsyntax-only)",
        ("recipe", "for package version", "series", "version", "unit", "status", "detail"),
        ((r.recipe, _builds(r.builds), r.series, r.version, r.unit, r.status, r.detail) for r in results),
    )
    for result in broken:
        out.note(f"FAILED {result.unit}:\n{result.log}")
    counts = {s: sum(1 for r in results if r.status == s)
              for s in (series_tools.COMPILED, series_tools.FAILED, series_tools.SKIPPED)}
    out.note(", ".join(f"{n} {s}" for s, n in counts.items()) + f" ({elapsed:.1f} s)")
    return code
