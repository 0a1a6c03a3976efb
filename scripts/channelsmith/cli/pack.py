"""`channelsmith pack`: one tar holding every package a deploy's lock pins, for a node with no network."""

from __future__ import annotations

import argparse
from contextlib import nullcontext
from pathlib import Path

from channelsmith.bundle import PIXI_PACK_VERSION_MATCHED, PackReport, default_cache_dir, pack
from channelsmith.bundle.anchors import NAMESPACE
from channelsmith.cli._help import INTERRUPTED, add_command
from channelsmith.cli._output import Output
from channelsmith.gpu import solved_for
from channelsmith.lock import LOCK_NAME, parse_channel_map
from channelsmith.sources import CACHE_ENV, DEFAULT_CACHE


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(
        subparsers,
        "pack",
        summary="pack a deploy's lock into one tar for an air-gapped install (pixi-pack's layout)",
        description="Fetch every package the lock pins from the lock's own URLs (file://, http(s)://) or the "
        "package cache, check each against the lock's sha256, then write one uncompressed tar in the layout "
        f"pixi-pack {PIXI_PACK_VERSION_MATCHED} writes (channel/<subdir>/ with repodata.json, pixi-pack.json, "
        "environment.yml), plus the lock and a POSIX unpack.sh, and write its sha256 to FILE.tar.sha256 (and with "
        "--sign its OpenSSH signature to FILE.tar.sig) in --anchor-dir, else beside it: anchors that must travel "
        "to the site by another path than the bundle. Install it with channelsmith deploy --bundle, or check it "
        "first with sha256sum -c or ssh-keygen -Y verify and then run its unpack.sh.",
        examples=(
            "channelsmith pack --lock ./env/channelsmith.lock -o env.tar --anchor-dir ./anchors",
            "channelsmith pack --lock ./env/channelsmith.lock -o env.tar --sign ~/.ssh/id_ed25519",
        ),
        statuses=(
            (0, "the bundle and its anchors are written"),
            (2, "bad input: a lock that cannot be read or has no such platform, a package that cannot be "
             "fetched or fails the lock's sha256, a key that cannot sign; no bundle is written"),
            INTERRUPTED,
        ),
    )
    parser.add_argument("--lock", required=True, metavar="LOCK", help=f"the lock a deploy wrote (PREFIX/{LOCK_NAME}; required)")
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
        help="channelsmith's cache (the same for every command): pack keeps the packages it downloaded, checked, "
        f"in DIR/packages and takes them from there (default: ${CACHE_ENV}, else {DEFAULT_CACHE})",
    )
    parser.add_argument(
        "--channel-map",
        action="append",
        default=[],
        metavar="OLD=NEW",
        help="take the packages the lock records in channel OLD (a path or URL, as the lock names it) from "
        "channel NEW, e.g. after the channel moved (repeatable; files are still checked against the lock's "
        "sha256, and the bundle keeps the lock as given; default: the lock's own channels)",
    )
    parser.add_argument(
        "--anchor-dir",
        default=None,
        metavar="DIR",
        help="write FILE.tar.sha256 (and FILE.tar.sig) into DIR instead of beside the bundle: keep them on "
        "another path than the bundle, which they vouch for (default: beside the bundle)",
    )
    parser.add_argument(
        "--sign",
        default=None,
        metavar="KEY",
        help=f"sign the bundle with this OpenSSH key (ssh-keygen -Y sign -n {NAMESPACE}), into FILE.tar.sig; "
        "a site checks it against its signers file (deploy --bundle --allowed-signers FILE; default: not signed)",
    )
    parser.add_argument("--json", action="store_true", help="print the pack report as JSON on stdout")
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
            cache_dir=default_cache_dir(args.cache_dir),
            channel_map=parse_channel_map(args.channel_map),
            anchor_dir=Path(args.anchor_dir) if args.anchor_dir else None,
            sign_key=Path(args.sign) if args.sign else None,
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
    out.note(f"GPUs: {solved_for(report.cuda_arch, report.site_profile, report.runs_on)}")
    beside = report.sha256_file.parent.resolve() == report.bundle.parent.resolve()
    out.note(
        f"sha256 {report.sha256} (written to {report.sha256_file}): it must travel to the site by another path "
        "than the bundle (a ticket, the site's config repository), or whoever changes the bundle changes it too"
        + (": it lies beside the bundle, pass --anchor-dir DIR to write it elsewhere" if beside else "")
    )
    if report.signature_file:
        out.note(
            f"signature written to {report.signature_file}: the site checks it against its signers file, which "
            "must reach the site by another path than the bundle (the signature itself may travel with it)"
        )
    name = report.bundle.name
    # Absolute: the unpack.sh line below runs from a private copy's folder.
    sums, signature = report.sha256_file.absolute(), report.signature_file and report.signature_file.absolute()
    if signature:
        check = f"ssh-keygen -Y verify -f SIGNERS -I PRINCIPAL -n {NAMESPACE} -s {signature} <{name}"
        install = f"--allowed-signers SIGNERS --signature {signature}"
    else:
        check = f"sha256sum -c {sums}"
        install = f"--sha256 {report.sha256}"
    out.note(f"install it with no network: channelsmith deploy --bundle {report.bundle} {install} --prefix DIR")
    if report.unpack_sh:
        # The site's own tools check a private copy before anything from the bundle runs (docs/howto/air-gap.md, 3').
        out.note(
            f"or without channelsmith, check a private copy first, then run its unpack.sh: "
            f'B=$(mktemp -d) && cp {report.bundle} "$B" && cd "$B" && {check} && tar -xf {name} unpack.sh && '
            f"sh unpack.sh --bundle {name} {install} PREFIX"
        )
    else:
        out.note(f"unpack.sh cannot install this bundle ({report.unpack_sh_note}); use deploy --bundle or pixi-unpack")
