"""`channelsmith publish`: copy package files into the local channel and re-index it, atomically."""

from __future__ import annotations

import argparse
from pathlib import Path

from channelsmith import channel
from channelsmith.cli._help import ENVIRONMENT, INTERRUPTED, add_command
from channelsmith.cli._output import Output
from channelsmith.errors import ChannelError, UserError


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(
        subparsers,
        "publish",
        summary="publish package files into the local channel and re-index it (or check / re-index it)",
        description="Validate every package archive, then, holding the channel's lock, copy each into its "
        "subdir and rebuild the index so that readers never see repodata listing a missing file. A corrupt "
        "package is refused before anything is written. Creates the channel if the directory is absent or "
        "empty. --check verifies the channel (repodata against files, sha256 included); --reindex rebuilds "
        "its repodata from the package files it holds.",
        examples=(
            "channelsmith publish output/linux-64/*.conda output/noarch/*.conda --channel-dir /shared/channel",
            "channelsmith publish --check --channel-dir /shared/channel",
        ),
        statuses=(
            (0, "published (or: the channel checks out; re-indexed)"),
            (2, "bad input: no package given, a corrupt or unreadable package (refused before anything is "
             "written), a channel whose repodata does not match its files (--check), a channel that cannot "
             "be written"),
            ENVIRONMENT,
            INTERRUPTED,
        ),
    )
    parser.add_argument("packages", nargs="*", metavar="PKG", help=".conda or .tar.bz2 files to publish (at least one, except with --check or --reindex)")
    parser.add_argument(
        "--channel-dir",
        default=str(channel.DEFAULT_CHANNEL_DIR),
        metavar="DIR",
        help=f"the local channel directory (default: ./{channel.DEFAULT_CHANNEL_DIR})",
    )
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--check", action="store_true", help="only check the channel; publish nothing")
    action.add_argument("--reindex", action="store_true", help="rebuild the channel's repodata from its package files")
    parser.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
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
        before = listed_names(channel_dir)
        report = channel.reindex(channel_dir)
        changes = index_changes(before, listed_names(channel_dir))
        if out.json_mode:
            out.json({"channel": report, "reindexed": changes})
            return 0
        present_reindex(report, changes, out)
        return 0
    else:
        if not args.packages:
            raise ChannelError(
                "no package files given",
                hint="channelsmith publish DIR/noarch/NAME-VERSION-BUILD.conda ... (the files a build wrote: "
                "rattler-build writes them under ./output/SUBDIR/, channelsmith build into its --channel-dir)",
            )
        result = channel.publish_files(channel_dir, [Path(p) for p in args.packages])
        report = channel.check_channel(channel_dir, hashes=False)
        if out.json_mode:
            out.json({"channel": report, "published": result.targets, "added": result.added,
                      "unchanged": result.unchanged})  # fmt: skip
            return 0
        if result.added:
            rows = ((p.name, p.parent.name) for p in result.added)
            out.table(f"published into {report.url}", ("package", "subdir"), rows)
        else:
            out.note(f"nothing new to publish into {report.url}")
        for path in result.unchanged:
            out.note(f"already in the channel with the same content (nothing written): {path.parent.name}/{path.name}")
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


def listed_names(channel_dir: Path) -> dict[str, set[str] | None]:
    """Per subdir, the package files its repodata lists (None where that repodata cannot be read)."""
    names: dict[str, set[str] | None] = {}
    if not channel_dir.is_dir():
        return names
    for subdir in channel.channel_subdirs(channel_dir):
        try:
            names[subdir] = {p.path.name for p in channel.listed_packages(channel_dir, subdir)}
        except ChannelError:
            names[subdir] = None
    return names


def index_changes(before: dict[str, set[str] | None], after: dict[str, set[str] | None]) -> dict[str, dict]:
    """Per subdir: what a re-index added to and dropped from the index, and whether the old index was readable."""
    changes = {}
    for subdir in sorted(set(before) | set(after)):
        old, new = before.get(subdir), after.get(subdir) or set()
        changes[subdir] = {
            "old_index": "unreadable" if subdir in before and old is None else "none" if subdir not in before else "read",
            "added": sorted(new - (old or set())),
            "dropped": sorted((old or set()) - new),
        }
    return changes


def present_reindex(report: channel.ChannelReport, changes: dict[str, dict], out: Output) -> None:
    """What the re-index changed, per subdir, then the check of the rebuilt index."""
    counts = {s.name: s.packages for s in report.subdirs}
    out.table(
        f"re-indexed {report.url} from its package files",
        ("subdir", "packages", "old index", "added to the index", "dropped from the index"),
        (
            (subdir, counts.get(subdir, 0), change["old_index"], ", ".join(change["added"]) or "-",
             ", ".join(change["dropped"]) or "-")
            for subdir, change in changes.items()
        ),  # fmt: skip
    )
    changed = sum(len(c["added"]) + len(c["dropped"]) for c in changes.values())
    what = f"{changed} change(s) to the index" if changed else "the index already listed exactly these files"
    out.note(
        f"rebuilt the repodata of {len(changes)} subdir(s) from the package files: {what}; {report.packages} "
        "packages; the new repodata matches the files (sizes and sha256 checked)"
    )


def present(report: channel.ChannelReport, out: Output) -> None:
    """One row per subdir, then a line on what was verified and any unlisted package files."""
    out.table(f"channel {report.url}", ("subdir", "packages"), ((s.name, s.packages) for s in report.subdirs))
    checked = "sizes and sha256" if report.hashes_verified else "sizes"
    out.note(f"{report.packages} packages; repodata matches the files ({checked} checked)")
    for path in report.unlisted:
        out.note(f"not in the index yet (the next publish or --reindex adds it): {path}")
