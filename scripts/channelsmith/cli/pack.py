"""`channelsmith pack`: one tar holding every package a deploy's lock pins, for a node with no network."""

from __future__ import annotations

import argparse
from contextlib import nullcontext
from pathlib import Path

from channelsmith.bundle import PIXI_PACK_VERSION_MATCHED, PackReport, default_cache_dir, pack
from channelsmith.cli._output import Output
from channelsmith.deploy import LOCK_NAME, parse_channel_map
from channelsmith.gpu import solved_for


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "pack",
        help="pack a deploy's lock into one tar for an air-gapped install (pixi-pack's layout)",
        description="Fetch every package the lock pins from the lock's own URLs (file://, http(s)://) or the "
        "package cache, check each against the lock's sha256, then write one uncompressed tar in the layout "
        f"pixi-pack {PIXI_PACK_VERSION_MATCHED} writes (channel/<subdir>/ with repodata.json, pixi-pack.json, "
        "environment.yml), plus the lock and a POSIX unpack.sh, and write its sha256 to FILE.tar.sha256 beside it. "
        "Install it with channelsmith deploy --bundle, pixi-unpack, or unpack.sh.",
    )
    parser.add_argument("--lock", required=True, metavar="LOCK", help=f"the lock a deploy wrote (PREFIX/{LOCK_NAME})")
    parser.add_argument(
        "-o",
        "--output",
        default="environment.tar",
        metavar="FILE.tar",
        help="the bundle to write (default: ./environment.tar)",
    )
    parser.add_argument(
        "--platform",
        default=None,
        metavar="SUBDIR",
        help="the lock's platform to pack (default: its only one, else this machine's)",
    )
    parser.add_argument(
        "--cache-dir",
        default=None,
        metavar="DIR",
        help=f"where downloaded packages are kept, checked, and taken from (default: {default_cache_dir()})",
    )
    parser.add_argument(
        "--channel-map",
        action="append",
        default=[],
        metavar="OLD=NEW",
        help="take the packages the lock records in channel OLD (a path or URL, as the lock names it) from "
        "channel NEW, e.g. after the channel moved (repeatable; files are still checked against the lock's "
        "sha256, and the bundle keeps the lock as given)",
    )
    parser.add_argument("--json", action="store_true", help="print the pack report as JSON")
    parser.set_defaults(handler=run, interrupted=interrupted)


def run(args: argparse.Namespace, out: Output) -> int:
    terminal = out.err_console.is_terminal
    # A terminal gets the byte progress bar; a log or a pipe one line per stage (a live stage line and
    # the bar would be two live displays at once).
    with nullcontext(None) if terminal else out.steps("pack") as stage:
        report = pack(
            Path(args.lock),
            Path(args.output),
            platform=args.platform,
            cache_dir=Path(args.cache_dir) if args.cache_dir else None,
            channel_map=parse_channel_map(args.channel_map),
            show_progress=not out.json_mode and terminal,
            stage=stage,
        )
    present(report, out)
    return 0


def interrupted(args: argparse.Namespace) -> str:
    """What a Ctrl-C left: the bundle is written under a temporary name and renamed at the end."""
    output = Path(args.output)
    state = f"{output} is as it was" if output.exists() else f"no bundle was written ({output} does not exist)"
    return (
        f"interrupted; {state}; packages already fetched stay in the package cache, checked against the lock, "
        "and the next pack takes them from there"
    )


def present(report: PackReport, out: Output) -> None:
    """The packed packages as a table (or the JSON report), then how to install the bundle."""
    if out.json_mode:
        out.json(report)
        return
    out.table(
        f"packed {report.bundle} ({report.platform}, {len(report.packages)} packages, "
        f"{report.bytes / 1e6:.1f} MB, {report.seconds:.2f} s)",
        ("package", "version", "build", "from"),
        ((p.name, p.version, p.build, p.source) for p in report.packages),
    )
    out.note(f"GPUs: {solved_for(report.cuda_arch, report.site_profile)}")
    out.note(f"sha256 {report.sha256} (written to {report.sha256_file}); carry it apart from the bundle")
    out.note(
        f"install it with no network: channelsmith deploy --bundle {report.bundle} --sha256 {report.sha256} "
        "--prefix DIR"
    )
    if report.unpack_sh:
        out.note(
            f"or without channelsmith: tar -xf {report.bundle} -C DIR && sh DIR/unpack.sh --bundle {report.bundle} "
            f"--sha256 {report.sha256} PREFIX"
        )
    else:
        out.note(f"unpack.sh cannot install this bundle ({report.unpack_sh_note}); use deploy --bundle or pixi-unpack")
