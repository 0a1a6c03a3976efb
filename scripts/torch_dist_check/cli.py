"""``python -m torch_dist_check``: the options, and what runs for them.

The command line alone: it parses and checks the options, then hands over to the harness
(:mod:`torch_dist_check.harness.run`): the launcher of this host's ranks (--nproc, --nodes), or one rank
of a launched job. Exit status: 0 if every non-skipped check passed, 1 if one failed, 2 for a usage or
launch error, 3 if a stage did not complete in time.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

from torch_dist_check.checks import bandwidth, envinfo
from torch_dist_check.harness import backends as backend_profiles
from torch_dist_check.harness import placement, startup
from torch_dist_check.harness.launch import SPAWNED_ENV, LaunchError, discover_rank, record_verdict
from torch_dist_check.harness.run import print_problem, report_path_problem, run_rank, run_spawned
from torch_dist_check.nodes import namespaces as nodes
from torch_dist_check.peerloss import cases as peerloss
from torch_dist_check.report.results import EXIT_INCOMPLETE, EXIT_USAGE

ALL_CHECKS = ("env", "correctness", "bandwidth", "fault", "peerloss")
# peerloss is a measurement campaign (minutes, cases expected to fail without the watcher): asked for by name.
DEFAULT_CHECKS = ("env", "correctness", "bandwidth", "fault")
# The options `--help` shows; `--help-all` shows every one.
COMMON_OPTIONS = (
    "--help", "--help-all", "--nproc", "--nodes", "--nproc-per-node", "--backends", "--import", "--checks", "--quick",
    "--stage-timeout", "--json", "--expect-nccl", "--expect-nccl-net", "--expect-busbw",
)  # fmt: skip
EPILOG = """\
examples:
  python -m torch_dist_check --nproc 2 --backends gloo --quick
  srun -n 8 python -m torch_dist_check --expect-nccl-net Libfabric --json report.json

exit status:
  0    every check that ran passed (skipped ones are listed with the reason)
  1    a check failed
  2    a usage or launch error: a bad option or value, a module or backend
       that cannot be loaded, ranks over several nodes without MASTER_ADDR
  3    a stage did not complete within --stage-timeout, or the suite could
       not run (NumPy missing, --nodes where no network namespace can be made)"""


def _csv(choices: Sequence[str]) -> Any:
    def parse(text: str) -> list[str]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        bad = [t for t in items if t not in choices]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(bad)} (choose from {', '.join(choices)})")
        return items

    return parse


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0 s, got {text}")
    return value


def _names(text: str) -> list[str]:
    return [t.strip().lower() for t in text.split(",") if t.strip()]


def _plugin(text: str) -> backend_profiles.BackendProfile:
    try:
        return backend_profiles.parse_plugin(text)
    except backend_profiles.BackendError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _positive(kind: Any) -> Any:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    return parse


def _within(low: float, high: float, unit: str) -> Any:
    """A float from ``low`` (included) to ``high`` (excluded)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not low <= value < high:
            raise argparse.ArgumentTypeError(f"must be from {low:g} to below {high:g}{unit}, got {text}")
        return value

    return parse


def _key_value(text: str) -> tuple[str, str]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    key, value = text.split("=", 1)
    return key, value


class _HelpFormatter(argparse.HelpFormatter):
    """argparse's formatter, except that the epilog (examples, exit statuses) is printed as written."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if text == EPILOG:
            return "\n".join(indent + line for line in text.splitlines())
        return super()._fill_text(text, width, indent)


class _BriefHelp(argparse.Action):
    """``-h``/``--help``: the common options only (``--help-all``: every one)."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:  # fmt: skip
        build_parser(brief=True).print_help()
        parser.exit()


class _DeprecatedAlias(argparse.Action):
    """An old spelling of an option: stores into the new one's destination and says on stderr which
    spelling to use (not in the ranks the launcher started: it said so once). Hidden from the help; the
    new option's help names it. (channelsmith has its own: this package imports nothing from it.)"""

    def __init__(self, option_strings: list[str], dest: str, *, replacement: str, **kwargs: Any) -> None:
        self.replacement = replacement
        super().__init__(option_strings, dest, help=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:  # fmt: skip
        if os.environ.get(SPAWNED_ENV) != "1":
            print(f"{parser.prog}: warning: {option_string} is deprecated and will be removed; use {self.replacement}",
                  file=sys.stderr)  # fmt: skip
        setattr(namespace, self.dest, values)


def goals_help() -> str:
    """What --peerloss-goals enforces, goal by goal, from the goals the judges use."""
    g, train, hsdp_median = peerloss.GOALS, peerloss.TRAIN_GOALS, peerloss.MEDIAN_GOALS["train-hsdp"]["first_step_s"]
    return (
        "fail a watcher case whose worst run misses a goal (default: each goal is reported, met or not, and "
        "fails nothing). The goals, in seconds from the peer's death to: "
        f"(a) the survivor's exception, <= {g['exception_s']:g}; "
        f"(b) an exact all_reduce in a fresh group with a replacement process, <= {g['fresh_group_s']:g}, and "
        f"aborting the dead group's idle communicator after it, <= {g['idle_abort_s']:g}; "
        f"(c) the longest iteration of group B, a group beside the broken one (two-world), <= {g['b_longest_s']:g}; "
        "(d) the survivor's GPU still computes: reported, no time goal; "
        f"(e) an exact all_reduce on the shrunk group (shrink), <= {g['shrunk_group_s']:g}; "
        f"(f) the first training step on the new group, <= {train['train-shrink']:g} (train-shrink), "
        f"{train['train-fresh']:g} (train-fresh), {train['train-hsdp']:g} (train-hsdp, and its median <= "
        f"{hsdp_median:g}); with --nodes, a cut link seen on both sides within the heartbeat timeout + "
        f"{peerloss.PARTITION_SLACK_S:g}"
    )


def build_parser(brief: bool = False) -> argparse.ArgumentParser:
    """All options, docs/howto/verify.md explains each group; ``brief``: only the COMMON_OPTIONS are in its
    help (the parser that `--help` prints; every option still parses)."""
    p = argparse.ArgumentParser(
        prog="python -m torch_dist_check",
        # Every option is listed below it (every one with --help-all): a usage line naming each, 50 lines
        # long, would bury an error message under it.
        usage="%(prog)s [OPTION ...]",
        description="Prove that this PyTorch's distributed stack works here: environment, correctness, "
        "bandwidth and fault tolerance, on every available backend. Run it under a launcher (torchrun, srun, "
        "mpiexec) or with --nproc / --nodes, which start the ranks here."
        + (" --help-all shows every option." if brief else ""),
        epilog=EPILOG,
        formatter_class=_HelpFormatter,
        add_help=False,
    )
    p.add_argument("-h", "--help", action=_BriefHelp, help="show the common options and exit")
    p.add_argument("--help-all", action="help", help="show every option and exit")
    run = p.add_argument_group("what to run")
    run.add_argument("--nproc", type=int, default=None,
                     help="start N local ranks (default: none: run as one rank of a job a launcher started)")  # fmt: skip
    run.add_argument("--nodes", type=int, default=None,
                     help="start N stand-in nodes on this host, each a network namespace with its own address "
                     "(10.99.0.n on a bridge of its own) and NCCL_HOSTID, and --nproc-per-node ranks on each "
                     "(needs root or unprivileged user namespaces; exit 3 where neither works; default: none)")  # fmt: skip
    run.add_argument("--nproc-per-node", type=int, default=None, help="ranks per node with --nodes (default 1)")
    run.add_argument("--backends", type=_names, default=None,
                     help="comma-separated backends registered with torch.distributed (default: gloo,nccl,mpi "
                     "and every --plugin; unavailable ones are skipped)")  # fmt: skip
    run.add_argument("--import", dest="imports", metavar="MODULE", action="append", default=[],
                     help="import MODULE in every rank before any check, so the backends it registers "
                     "exist (repeatable; e.g. torch_mpi_backend; default: none)")  # fmt: skip
    run.add_argument("--plugin", dest="plugins", metavar="NAME[:devices=cpu+cuda][:launch=mpi][:dtypes=D+D]",
                     type=_plugin, action="append", default=[],
                     help="profile of a plug-in backend (repeatable); default devices=cpu+cuda (those it "
                     "registered), launch=any, dtypes=int32+int64+float32+float64 (default: no plug-in)")  # fmt: skip
    run.add_argument("--checks", type=_csv(ALL_CHECKS), default=list(DEFAULT_CHECKS),
                     help="comma-separated checks: env,correctness,bandwidth,fault (the default) and peerloss")  # fmt: skip
    run.add_argument("--gpu-sharing", choices=placement.SHARING, default="net",
                     help="when a node has fewer GPUs than NCCL ranks, how ranks share them: net (one "
                     "NCCL_HOSTID per rank, NCCL connects them through its network; default) or node "
                     "(NCCL_MULTI_RANK_GPU_ENABLE=1, NCCL >= 2.30, in-node transports)")  # fmt: skip
    run.add_argument("--quick", action="store_true",
                     help="small sizes and few iterations (CI): sweep up to 4 MiB, 2 warm-ups, 5 iterations")  # fmt: skip
    run.add_argument("--stage-timeout", type=_positive_seconds, default=900.0, metavar="SECONDS",
                     help="seconds any one stage may take (default 900; formerly --timeout, which channelsmith "
                     "verify uses for the whole suite)")  # fmt: skip
    run.add_argument("--timeout", dest="stage_timeout", type=_positive_seconds, action=_DeprecatedAlias,
                     replacement="--stage-timeout")  # fmt: skip
    out = p.add_argument_group("output")
    out.add_argument("--json", metavar="FILE", nargs="?", const="-", default=None,
                     help="print every figure as JSON on stdout (the table goes to stderr), as channelsmith's --json "
                     "does; or, given FILE, write it to FILE ('-': stdout) and keep the table on stdout "
                     "(default: the table alone, on stdout)")  # fmt: skip
    out.add_argument("--plot", metavar="FILE", default=None,
                     help="draw the bandwidth sweep into a PNG (needs matplotlib; default: no plot)")  # fmt: skip
    bw = p.add_argument_group("bandwidth sweep (nccl-tests style)")
    bw.add_argument("--min-bytes", type=bandwidth.parse_size, default=None, help="smallest size (default 8)")
    bw.add_argument("--max-bytes", type=bandwidth.parse_size, default=None,
                    help="largest size (default 1G on GPUs, 64M on CPUs; 4M with --quick)")  # fmt: skip
    bw.add_argument("--warmup", type=int, default=None, help="warm-up iterations per size (default 5; 2 with --quick)")
    bw.add_argument("--iters", type=int, default=None, help="timed iterations per size (default 20; 5 with --quick)")
    bw.add_argument("--size-budget-s", type=float, default=None,
                    help="seconds of timed iterations per size before the count is cut (>= 3 kept; default 2)")  # fmt: skip
    bw.add_argument("--max-call-s", type=_positive_seconds, default=0.5,
                    help="a collective's sweep ends after the first size whose single call takes longer than "
                    "this (default 0.5; keeps a CPU backend's default run short, NCCL on NVLink is far below it)")  # fmt: skip
    bw.add_argument("--collectives", type=_csv(bandwidth.COLLECTIVES), default=list(bandwidth.COLLECTIVES),
                    help=f"comma-separated collectives the sweep times: {','.join(bandwidth.COLLECTIVES)} (default: all)")  # fmt: skip
    exp = p.add_argument_group("expectations (turn facts into pass/fail)")
    exp.add_argument("--expect-nccl", metavar="X.Y.Z", default=None, help="the loaded libnccl must be this version (default: any)")
    exp.add_argument("--expect-nccl-under", metavar="DIR", default=None, help="the loaded libnccl must live under DIR (default: anywhere)")
    exp.add_argument("--expect-nccl-net", metavar="NAME", default=None,
                     help="every NCCL communicator must use this network (e.g. Libfabric, IB, Socket; whole "
                     "name, any case; default: NCCL_NET)")  # fmt: skip
    exp.add_argument("--expect-busbw", metavar="GBPS", type=float, default=None,
                     help="every backend's peak all_reduce busbw must reach this (default: no floor)")  # fmt: skip
    exp.add_argument("--no-nccl-log", action="store_true",
                     help="leave NCCL_DEBUG alone (the NCCL network check is then skipped)")  # fmt: skip
    ft = p.add_argument_group("fault tolerance")
    ft.add_argument("--fault-backend", choices=("nccl", "gloo"), default="nccl",
                    help="nccl (needs 2 GPUs); gloo runs the same harness on CPU (default nccl)")  # fmt: skip
    ft.add_argument("--fault-modes", type=lambda s: [int(x) for x in s.split(",")], default=[0, 2],
                    help="TORCH_NCCL_ASYNC_ERROR_HANDLING values (default 0,2)")  # fmt: skip
    ft.add_argument("--fault-ops", type=_csv(("allreduce", "sendrecv")), default=["allreduce", "sendrecv"],
                    help="comma-separated ops the survivor is waiting in when its peer dies: allreduce, sendrecv "
                    "(a send the dead peer never receives) (default: both)")  # fmt: skip
    ft.add_argument("--fault-init-timeout", type=_positive_seconds, default=120.0, metavar="SECONDS",
                    help="seconds the fault workers (and the peer-loss cases' processes) may take to start and form "
                    "their group, at most, before the case fails (default %(default)g)")  # fmt: skip
    ft.add_argument("--fault-exception-timeout", type=float, default=60.0,
                    help="seconds from the peer's death to the exception, at most (default 60)")  # fmt: skip
    ft.add_argument("--fault-gpu-timeout", type=float, default=90.0,
                    help="seconds from the peer's death until the GPU is usable, at most (default 90)")  # fmt: skip
    ft.add_argument("--fault-jobs", type=int, default=1, help="cases run at once (default 1)")
    ft.add_argument("--fault-env", type=_key_value, action="append", default=[], metavar="KEY=VALUE",
                    help="extra environment for the fault workers (repeatable; default: none)")  # fmt: skip
    ft.add_argument("--fault-recover", choices=("none", "abort"), default="none",
                    help="none: wait for PyTorch to free the GPU; abort: the survivor aborts its process group "
                    "after the exception (the application's duty under TORCH_NCCL_ASYNC_ERROR_HANDLING=0) (default none)")  # fmt: skip
    ft.add_argument("--fault-plant", choices=("none", "abort", "hang"), default="none",
                    help="make the survivor misbehave, to show the check fails (abort: os.abort after the "
                    "exception; hang: block instead of reporting it; default none: behave)")  # fmt: skip
    pl = p.add_argument_group("peer loss (recovery from a dead or stuck peer, with and without torch_peer_watcher; "
                              "--fault-init-timeout and --fault-env apply too)")  # fmt: skip
    pl.add_argument("--peerloss-backend", choices=("nccl", "gloo"), default="nccl",
                    help="nccl (on the GPUs the node has, shared as the placement allows); gloo runs the same cases on CPU "
                    "(default nccl)")  # fmt: skip
    pl.add_argument("--peerloss-cases", type=_csv((*peerloss.KINDS, *peerloss.KIND_ALIASES, *peerloss.NODE_KINDS)), default=None,
                    help="single (transport x op), two-world, false-positive, shrink, train-shrink and train-fresh "
                    "(a DDP job; train: both); with --nodes 2 or more also the faults between nodes: partition, "
                    "node-kill, store-lost, lossy-link, brief-cut, heal-stop (default: all that apply)")  # fmt: skip
    pl.add_argument("--peerloss-transports", type=_csv(peerloss.TRANSPORTS), default=list(peerloss.TRANSPORTS),
                    help="NCCL transports: p2p (nothing forced), shm (NCCL_P2P_DISABLE=1), net (sockets); default all")  # fmt: skip
    pl.add_argument("--peerloss-ops", type=_csv(peerloss.OPS), default=list(peerloss.OPS),
                    help="comma-separated ops the survivor issues as its peer dies, in the single cases: allreduce, "
                    "sendrecv, coalesced (all_reduce_coalesced) (default: all)")  # fmt: skip
    pl.add_argument("--peerloss-watcher", type=_csv(peerloss.WATCHER_MODES), default=list(peerloss.WATCHER_MODES),
                    help="on,off: run each case with and without the watcher (default both)")  # fmt: skip
    pl.add_argument("--peerloss-settings", choices=peerloss.NCCL_SETTINGS, default="flavor",
                    help="the NCCL workers' PyTorch settings: flavor (pytorch-nccl-fault's activation defaults: "
                    "TORCH_NCCL_ASYNC_ERROR_HANDLING=2, TORCH_NCCL_ENABLE_MONITORING=0, ..., where the environment "
                    "does not name them; default) or pytorch (those taken out: PyTorch's own, as next to a stock "
                    "PyTorch; the watcher then sets its own)")  # fmt: skip
    pl.add_argument("--peerloss-signal", choices=("kill", "stop"), default="kill",
                    help="kill: the peer dies (SIGKILL); stop: it freezes (SIGSTOP), found by heartbeat only (default kill)")  # fmt: skip
    pl.add_argument("--peerloss-pattern", choices=peerloss.PATTERNS, default="wait",
                    help="how the survivor issues A's op: wait (then .item() on CUDA; default), enqueue (the "
                    "call alone), poll (async_op=True, is_completed() polled)")  # fmt: skip
    pl.add_argument("--peerloss-runs", type=_positive(int), default=1, help="runs per case (median and worst reported; default 1)")
    pl.add_argument("--peerloss-busy", type=_positive(float), default=60.0,
                    help="seconds the peer computes in the false-positive case (default 60)")  # fmt: skip
    pl.add_argument("--peerloss-heartbeat", type=_positive(float), default=None,
                    help="watcher heartbeat interval, s (default: the watcher's, 1)")  # fmt: skip
    pl.add_argument("--peerloss-heartbeat-timeout", type=_positive(float), default=None,
                    help="silence before a peer is declared dead, s (default: the watcher's, 5); a cut that heals "
                         "is tolerated when shorter than this minus one interval minus 0.3 s")  # fmt: skip
    pl.add_argument("--peerloss-exception-timeout", type=_positive(float), default=30.0,
                    help="seconds from the death to the exception, at most (default 30)")  # fmt: skip
    pl.add_argument("--peerloss-recover-timeout", type=_positive(float), default=60.0,
                    help="seconds from the death to the fresh group's exact all_reduce, at most (default 60)")  # fmt: skip
    pl.add_argument("--peerloss-train-width", type=_positive(int), default=1024,
                    help="the train cases' MLP is W x 4W x W (default 1024: 8.4 M parameters)")  # fmt: skip
    pl.add_argument("--peerloss-train-steps", type=_positive(int), default=5,
                    help="training steps on the new group after the recovery, checked against a one-process replay (default 5)")  # fmt: skip
    pl.add_argument("--peerloss-link-loss", type=_within(0.0, 100.0, " %"), default=peerloss.LOSSY_LINK[0],
                    help="lossy-link: the share of packets lost each way, %% (default %(default)g)")  # fmt: skip
    pl.add_argument("--peerloss-link-delay", type=_within(0.0, 10_000.0, " ms"), default=peerloss.LOSSY_LINK[1],
                    help="lossy-link: the delay added each way, ms (default %(default)g; made by the kernel's netem, or "
                    "without it by a delay line in user space, which needs /dev/net/tun; 0 makes the loss alone "
                    "with nftables where netem is missing)")  # fmt: skip
    pl.add_argument("--peerloss-cut-s", type=_positive(float), default=None,
                    help="brief-cut: how long node 1's link stays cut before it heals, s, plus a random jitter "
                    "(default: half the heartbeat timeout)")  # fmt: skip
    pl.add_argument("--peerloss-cut-jitter-s", type=_within(0.0, 3600.0, " s"), default=peerloss.CUT_JITTER_S,
                    help="brief-cut: each run's cut is longer by a random 0 to this, s (default %(default)g; the "
                    "cut each run got is in its figures, cut_s)")  # fmt: skip
    pl.add_argument("--peerloss-goals", action="store_true", help=goals_help())
    if brief:
        for action in p._actions:
            if not set(action.option_strings) & set(COMMON_OPTIONS):
                action.help = argparse.SUPPRESS
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: spawn ranks for --nproc, or run as one rank of a launched job."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.backends is None:
        args.backends = [*backend_profiles.BUILTIN_BACKENDS, *(p.name for p in args.plugins if p.name not in backend_profiles.BUILTIN_BACKENDS)]
    problem = missing_numpy()
    if problem is not None:
        print(problem, file=sys.stderr)
        return EXIT_INCOMPLETE
    logs = None
    if "nccl" in args.backends and not args.no_nccl_log:
        # Before any --import module could bring NCCL up. The --nproc launcher sets it up for its
        # ranks, which inherit it: it then knows where their logs are when one dies in NCCL.
        pattern = envinfo.enable_nccl_log_capture(os.environ)
        logs = os.path.dirname(pattern) if pattern else None
    code = _run(args, argv)
    if logs is not None:  # the folder this process made: gone after a passing run, kept (and named) otherwise
        envinfo.drop_nccl_logs(logs, keep=code != 0)
    return code


def _run(args: argparse.Namespace, argv: list[str]) -> int:
    """The run once NCCL's log is set up: the --nproc/--nodes launcher, or one rank."""
    launcher = (args.nproc is not None or args.nodes is not None) and os.environ.get(SPAWNED_ENV) != "1"
    try:
        # Every rank imports the modules itself (and the --nproc launcher, to refuse a bad name early).
        backend_profiles.import_modules(args.imports)
        args.profiles = backend_profiles.resolve(args.backends, args.plugins, args.imports)
    except backend_profiles.BackendError as exc:
        print(f"torch_dist_check: {exc}", file=sys.stderr)
        return EXIT_USAGE
    layout = layout_problem(args)
    if layout is not None:
        print(f"torch_dist_check: {layout}", file=sys.stderr)
        return EXIT_USAGE
    if launcher:
        problem = report_path_problem(args)
        if problem is not None:
            print_problem(problem)
            return EXIT_USAGE
        return run_spawned(args, argv)
    try:
        info = discover_rank(os.environ)
    except LaunchError as exc:
        print(f"torch_dist_check: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if info.master_addr is None:
        print(
            f"torch_dist_check: {info.world_size} ranks over several nodes, and MASTER_ADDR is not set.\n"
            "hint: export MASTER_ADDR=$(hostname) in the job script before mpiexec (rank 0 must run on that host)",
            file=sys.stderr,
        )
        return EXIT_USAGE
    # torch with the cycle collector paused (harness/startup.py), once the options and the launch are
    # known good (an --import module that imports torch did it the same way already).
    startup.import_all(startup.TORCH)
    code = run_rank(args, info)
    record_verdict(info.rank, code)
    return code


def layout_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with --nproc, --nodes and --nproc-per-node together, or None."""
    if args.nodes is not None:
        if args.nproc is not None:
            return "--nproc and --nodes exclude each other: give --nodes N --nproc-per-node M for N x M ranks"
        if not 1 <= args.nodes <= nodes.MAX_NODES:
            return f"--nodes must be between 1 and {nodes.MAX_NODES}, not {args.nodes}"
        if args.nproc_per_node is not None and args.nproc_per_node < 1:
            return f"--nproc-per-node must be at least 1, not {args.nproc_per_node}"
    elif args.nproc_per_node is not None:
        return "--nproc-per-node needs --nodes (for ranks on this node alone: --nproc N)"
    elif args.nproc is not None and args.nproc < 1:
        return "--nproc must be at least 1"
    return None


def missing_numpy() -> str | None:
    """Why the suite cannot run without NumPy, when it is missing; None when it imports.

    torch.distributed's object collectives (all_gather_object, which every rank uses to agree on the
    run) turn their tensors back into bytes with ``Tensor.numpy()``: without NumPy the first one
    raises "Numpy is not available" and the run would end as a failing check, not as what it is.
    """
    try:
        import numpy  # noqa: F401
    except ImportError as exc:
        return (
            f"torch_dist_check: NumPy cannot be imported ({exc}); torch.distributed's object collectives, "
            "which every rank uses to agree on the run, need it, so no check was run\n"
            "hint: install numpy next to PyTorch (pip install numpy, or conda install numpy), then run again"
        )
    return None
