"""`channelsmith deploy`: solve from the local channel first and install into a prefix, or install a lock."""

from __future__ import annotations

import argparse
from pathlib import Path

from channelsmith.bundle import install_bundle
from channelsmith.bundle.anchors import NO_ANCHOR, REQUIRE_ANCHOR_ENV
from channelsmith.channel import DEFAULT_CHANNEL_DIR
from channelsmith.cli._help import INTERRUPTED, add_command
from channelsmith.cli._output import Output
from channelsmith.deploy import DeployReport, deploy, deploy_lock
from channelsmith.errors import DeployError
from channelsmith.gpu import DEFAULT_CUDA_DRIVER, IGNORE_GPUS_HERE
from channelsmith.lock import LOCK_NAME, parse_channel_map


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(
        subparsers,
        "deploy",
        summary="install packages from the local channel (strict priority) into a prefix and write a lock file",
        description="Solve the specs with strict channel priority against the local channel first, then the "
        "-c channels in order (and no default channel), install them into the prefix, and write a lock file "
        "that re-creates exactly this environment. With --lock, install a lock file's packages without "
        "solving. Package files from local channels are checked against their sha256 before installing.",
        examples=(
            "channelsmith deploy site-env-derecho 'pytorch *ncclft*' -c conda-forge --prefix ./env",
            "channelsmith deploy --bundle env.tar --sha256 \"$(cut -d' ' -f1 env.tar.sha256)\" --prefix ./env",
        ),
        statuses=(
            (0, "installed, and the lock file written"),
            (2, "bad input: no spec, options that exclude each other, a channel that cannot be read, specs that "
             "do not solve, a package or bundle that fails its sha256 or signature check, GPUs here that "
             "disagree with the ones named"),
            INTERRUPTED,
        ),
    )
    parser.add_argument(
        "specs",
        nargs="*",
        metavar="SPEC",
        help="package specs, e.g. site-env-derecho or 'pytorch ==2.6.0 *cray_mpich*' (at least one, except with "
        "--lock or --bundle)",
    )
    parser.add_argument("--prefix", required=True, metavar="DIR", help="the environment to create or update (required)")
    parser.add_argument(
        "--channel-dir",
        default=None,
        metavar="DIR",
        help=f"the local channel, searched first (default: ./{DEFAULT_CHANNEL_DIR} if it exists; without it, "
        "the -c channels alone)",
    )
    parser.add_argument(
        "-c",
        "--channel",
        action="append",
        default=[],
        dest="channels",
        metavar="CHANNEL",
        help="a further channel after the local one (a directory, a URL, or a name such as conda-forge; "
        "repeat for more; default: the local channel alone)",
    )
    parser.add_argument(
        "--lock",
        metavar="FILE",
        help="install exactly the packages of this lock file, without solving; with --bundle, a trusted lock "
        "kept apart from the bundle, which every package of the bundle must match (default: solve the specs)",
    )
    parser.add_argument(
        "--channel-map",
        action="append",
        default=[],
        metavar="OLD=NEW",
        help="with --lock: take the packages the lock file records in channel OLD (a path or URL, as the "
        "lock names it) from channel NEW, e.g. after the channel moved (repeatable; files are still checked "
        "against the lock's sha256, and the new lock file records NEW; default: the lock's own channels)",
    )
    parser.add_argument(
        "--bundle",
        metavar="FILE.tar",
        help="install a bundle channelsmith pack wrote, with no network, into a new or empty prefix (default: "
        "install from channels)",
    )
    parser.add_argument(
        "--sha256",
        metavar="HEX",
        help="with --bundle: the bundle's sha256 as pack printed it (FILE.tar.sha256), carried apart from the "
        "bundle; a bundle with any other digest is refused (default: none: without --sha256, --allowed-signers "
        f"or --lock, only the bundle's own lock checks it, which the output says; {REQUIRE_ANCHOR_ENV}=1 refuses that)",
    )
    parser.add_argument(
        "--allowed-signers",
        metavar="FILE",
        help="with --bundle: the site's signers file (ssh-keygen's allowed-signers format); the bundle must carry "
        "a signature (pack --sign) by a key it lists, checked on the bytes installed; the signer is the principal "
        "the file names for that key (default: none)",
    )
    parser.add_argument(
        "--signature",
        metavar="FILE.sig",
        help="with --allowed-signers: the bundle's signature (default: FILE.tar.sig beside the bundle)",
    )
    parser.add_argument(
        "--lock-out", metavar="FILE", help=f"where to write the lock file (default: PREFIX/{LOCK_NAME})"
    )
    parser.add_argument(
        "--cuda-arch",
        metavar="X.Y",
        help="solve for GPUs whose lowest compute capability is X.Y (__cuda_arch), e.g. 8.0 for A100: for a "
        "machine without GPUs and a profile that declares none; a site profile that declares other GPUs, "
        f"or a GPU here that reports another, refuses it (see {IGNORE_GPUS_HERE}; default: the site profile's, "
        "else this machine's GPUs)",
    )
    parser.add_argument(
        "--cuda-driver",
        metavar="X.Y",
        help="the CUDA of the compute nodes' driver (__cuda; nvidia-smi's \"CUDA Version\"), e.g. 12.4: what "
        "a package with GPU code requires. Default: this machine's driver where a GPU answers, else the site "
        f"profile's, else {DEFAULT_CUDA_DRIVER} (any CUDA 12 build, no CUDA 13 one); older than the profile "
        "declares, or newer than this machine's driver, is refused",
    )
    parser.add_argument(
        IGNORE_GPUS_HERE,
        action="store_true",
        help="solve for the GPUs --cuda-arch/--cuda-driver or the site profile name although this machine's "
        "GPUs disagree with them (without it the deploy stops); the output and --json say so, and the "
        "environment may not run on this machine",
    )
    parser.add_argument("--json", action="store_true", help="print the deploy report as JSON on stdout")
    parser.set_defaults(handler=run, interrupted=interrupted)


def run(args: argparse.Namespace, out: Output) -> int:
    prefix = Path(args.prefix)
    lock_out = Path(args.lock_out) if args.lock_out else None
    show_progress = not out.json_mode and out.err_console.is_terminal
    if args.sha256 and not args.bundle:
        raise DeployError("--sha256 is the digest of a bundle; it takes --bundle", hint="pass --bundle FILE.tar too")
    if (args.allowed_signers or args.signature) and not args.bundle:
        raise DeployError(
            "--allowed-signers and --signature check a bundle's signature; they take --bundle",
            hint="pass --bundle FILE.tar too",
        )
    if args.bundle:
        if args.sha256 and args.specs and args.specs[0] == Path(args.bundle).name:
            # `--sha256 $(cat FILE.tar.sha256)` unquoted: the line's second word arrives as a spec.
            raise DeployError(
                f"--sha256 {args.sha256} is followed by {args.specs[0]!r}, the second word of FILE.tar.sha256: "
                "--sha256 takes the digest alone",
                hint="pass its first word only: --sha256 \"$(cut -d' ' -f1 FILE.tar.sha256)\"",
            )
        if (args.specs or args.channels or args.lock_out or args.channel_map or args.cuda_arch or args.cuda_driver
                or args.ignore_gpus_here):
            raise DeployError(
                "--bundle installs exactly the bundle's lock; it takes no specs, -c, --channel-map, --lock-out, "
                f"--cuda-arch, --cuda-driver or {IGNORE_GPUS_HERE}",
                hint="drop those options: the bundle's lock is written to PREFIX/" + LOCK_NAME,
            )
        report = install_bundle(
            Path(args.bundle),
            prefix=prefix,
            sha256=args.sha256,
            trusted_lock=Path(args.lock) if args.lock else None,
            allowed_signers=Path(args.allowed_signers) if args.allowed_signers else None,
            signature=Path(args.signature) if args.signature else None,
            show_progress=show_progress,
        )
    elif args.lock:
        if args.specs or args.channels or args.cuda_arch or args.cuda_driver or args.ignore_gpus_here:
            raise DeployError(
                "--lock installs exactly what the lock file lists; it takes no specs, -c channels, --cuda-arch, "
                f"--cuda-driver or {IGNORE_GPUS_HERE}",
                hint=f"drop the specs, -c, --cuda-arch, --cuda-driver and {IGNORE_GPUS_HERE}, or drop --lock to "
                "solve afresh",
            )
        report = deploy_lock(
            Path(args.lock),
            prefix=prefix,
            lock_out=lock_out,
            show_progress=show_progress,
            channel_map=parse_channel_map(args.channel_map),
        )
    else:
        if args.channel_map:
            raise DeployError(
                "--channel-map points a lock file at moved channels; it takes --lock",
                hint="pass the channels to solve from with --channel-dir and -c instead",
            )
        if not args.specs:
            raise DeployError("no package specs given", hint="channelsmith deploy site-env-derecho --prefix ./env")
        report = deploy(
            args.specs,
            prefix=prefix,
            channel_dir=local_channel(args.channel_dir),
            channels=args.channels,
            lock_out=lock_out,
            show_progress=show_progress,
            cuda_arch=args.cuda_arch,
            cuda_driver=args.cuda_driver,
            ignore_gpus_here=args.ignore_gpus_here,
        )
    present(report, out)
    if args.bundle and not out.json_mode:
        if report.anchor == NO_ANCHOR:
            out.note(
                "checked against the bundle's own lock only, which shows damage, not a change: pass --sha256 HEX "
                "(FILE.tar.sha256), --allowed-signers FILE or --lock LOCK, kept apart from the bundle, to check it "
                f"against an outside anchor ({REQUIRE_ANCHOR_ENV}=1 refuses bundles without one)"
            )
        else:
            signer = f" (signed by {report.signer})" if report.signer else ""
            out.note(f"checked against the outside anchor: {report.anchor}{signer}")
        out.note(f"activate it with: . {report.prefix}/activate.sh (or conda activate {report.prefix})")
    return 0


def interrupted(args: argparse.Namespace) -> str:
    """What a Ctrl-C left: the prefix as the interrupted solve or install left it, no new lock file."""
    prefix = Path(args.prefix)
    if not prefix.exists():
        return f"interrupted; nothing was installed ({prefix} was not created)"
    if not (prefix / "conda-meta").is_dir():
        return f"interrupted; {prefix} may hold part of an install: remove it, then deploy again"
    return (
        f"interrupted; {prefix} may be partly installed or updated, and no lock file was written for it: "
        "deploy again into it to finish"
    )


def local_channel(given: str | None) -> Path | None:
    """The local channel to search first: the one given (which must exist), else ./channel if it
    exists, else none (a cluster deploying from a shared channel directory or URL with -c)."""
    if given is not None:
        return Path(given)
    return DEFAULT_CHANNEL_DIR if DEFAULT_CHANNEL_DIR.exists() else None


def present(report: DeployReport, out: Output) -> None:
    """The installed packages as a table (or the JSON report), then where the lock file is."""
    for note in report.notes:  # on stderr in JSON mode, and in the report too
        out.note(note)
    if out.json_mode:
        out.json(report)
        return
    how = f"from the lock file ({len(report.packages)} packages)" if report.from_lock else "solved"
    out.table(
        f"deployed into {report.prefix} ({how}, {report.seconds:.2f} s)",
        ("package", "version", "build", "channel"),
        ((p.name, p.version, p.build, p.channel) for p in report.packages),
    )
    if report.gpu is not None:
        out.note(f"GPUs: {report.gpu.summary}")
    out.note(
        f"lock file: {report.lock_file} (re-create with: channelsmith deploy --lock {report.lock_file} --prefix DIR)"
    )
