"""`channelsmith publish`: copy package files into the local channel and re-index it, atomically."""

from __future__ import annotations

import argparse
from pathlib import Path

from channelsmith import channel
from channelsmith.cli._output import Output
from channelsmith.errors import ChannelError, UserError


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "publish",
        help="publish package files into the local channel and re-index it (or check / re-index it)",
        description="Validate every package archive, then, holding the channel's lock, copy each into its "
        "subdir and rebuild the index so that readers never see repodata listing a missing file. A corrupt "
        "package is refused before anything is written. Creates the channel if the directory is absent or "
        "empty. --check verifies the channel (repodata against files, sha256 included); --reindex rebuilds "
        "its repodata from the package files it holds.",
    )
    parser.add_argument("packages", nargs="*", metavar="PKG", help=".conda or .tar.bz2 files to publish")
    parser.add_argument(
        "--channel-dir",
        default=str(channel.DEFAULT_CHANNEL_DIR),
        metavar="DIR",
        help=f"the local channel directory (default: ./{channel.DEFAULT_CHANNEL_DIR})",
    )
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--check", action="store_true", help="only check the channel; publish nothing")
    action.add_argument("--reindex", action="store_true", help="rebuild the channel's repodata from its package files")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.set_defaults(handler=run, interrupted=interrupted)


def run(args: argparse.Namespace, out: Output) -> int:
    channel_dir = Path(args.channel_dir)
    if (args.check or args.reindex) and args.packages:
        raise ChannelError(
            "--check and --reindex take no package files",
            hint="run channelsmith publish PKG ... to publish, then --check or --reindex on its own",
        )
    if args.check:
        report = channel.check_channel(channel_dir)
    elif args.reindex:
        report = channel.reindex(channel_dir)
    else:
        if not args.packages:
            raise ChannelError(
                "no package files given", hint="channelsmith publish output/noarch/NAME-VERSION-BUILD.conda ..."
            )
        published = channel.publish(channel_dir, [Path(p) for p in args.packages])
        report = channel.check_channel(channel_dir, hashes=False)
        if out.json_mode:
            out.json({"channel": report, "published": published})
            return 0
        out.table(f"published into {report.url}", ("package", "subdir"), ((p.name, p.parent.name) for p in published))
    if out.json_mode:
        out.json({"channel": report})
        return 0
    present(report, out)
    return 0


def interrupted(args: argparse.Namespace) -> str:
    """What a Ctrl-C left, read from the channel: its repodata only ever lists whole files (each package
    and each repodata.json is renamed into place complete), so the question is which packages it lists."""
    channel_dir = Path(args.channel_dir)
    if args.check:
        return "interrupted; --check writes nothing: the channel is as it was"
    try:
        report = channel.check_channel(channel_dir, hashes=False)
        listed = {p.path.name for s in report.subdirs for p in channel.listed_packages(channel_dir, s.name)}
    except UserError:
        return f"interrupted; there is no channel at {channel_dir}: nothing was published"
    if args.reindex:
        left = f"interrupted; each subdir's repodata is whole (the old index or the rebuilt one), {len(listed)} packages listed"
    else:
        given = [Path(p).name for p in args.packages]
        missing = [name for name in given if name not in listed]
        left = f"interrupted; {len(given) - len(missing)} of the {len(given)} packages are in the channel's index"
        if missing:
            left += f" (not: {', '.join(missing)}; publish them again)"
    if report.unlisted:
        left += (
            f"; {len(report.unlisted)} package file(s) reached the channel but not its index "
            f"(the next publish or --reindex lists them): {', '.join(p.name for p in report.unlisted)}"
        )
    return left


def present(report: channel.ChannelReport, out: Output) -> None:
    """One row per subdir, then a line on what was verified and any unlisted package files."""
    out.table(f"channel {report.url}", ("subdir", "packages"), ((s.name, s.packages) for s in report.subdirs))
    checked = "sizes and sha256" if report.hashes_verified else "sizes"
    out.note(f"{report.packages} packages; repodata matches the files ({checked} checked)")
    for path in report.unlisted:
        out.note(f"not in the index yet (the next publish or --reindex adds it): {path}")
