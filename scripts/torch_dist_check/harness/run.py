"""Run the checks: the ranks this host starts (--nproc, --nodes), and one rank's run of the checks.

Every rank runs the same checks in the same order. A CPU (gloo) control group carries agreement
(which backends every rank can run), timings and the results to rank 0, which prints the summary
table and writes the JSON document. The options are :mod:`torch_dist_check.cli`'s.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import socket
import sys
import tempfile
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path
from typing import Any

from torch_dist_check.checks import bandwidth, correctness, envinfo, fault
from torch_dist_check.harness import backends as backend_profiles
from torch_dist_check.harness import forkserver, placement
from torch_dist_check.harness.launch import (
    PORT_FILE_ENV,
    STATUS_DIR_ENV,
    RankInfo,
    SpawnOutcome,
    batch_job,
    record_verdict,
    spawn_local,
    stage_file,
)
from torch_dist_check.harness.progress import StageProgress
from torch_dist_check.nodes import namespaces as nodes
from torch_dist_check.peerloss import cases as peerloss
from torch_dist_check.peerloss import runner as peerloss_runner
from torch_dist_check.report.results import (
    EXIT_FAILED,
    EXIT_INCOMPLETE,
    EXIT_OK,
    EXIT_USAGE,
    FAIL,
    PASS,
    CheckResult,
    OutputProblem,
    StageTracker,
    build_document,
    merge_rank_results,
    output_path_problem,
    render_table,
    write_json,
)

# Settings that decide how the network stack behaves; the report records them as the run found them.
NETWORK_ENV_PREFIXES = ("NCCL_", "TORCH_NCCL_", "FI_", "MPICH_", "OMPI_MCA_", "UCX_", "GLOO_", "CUDA_VISIBLE_DEVICES")


# The default largest size of a sweep of CPU tensors. Their bus bandwidth has levelled off by then (gloo on
# 2 ranks, 2-core CI machine, peak busbw with 64 MiB / 256 MiB sweeps: all_reduce 1.91 / 1.97 GB/s,
# all_gather 1.27 / 1.36, reduce_scatter 0.65 / 0.60, broadcast 5.37 / 5.13), while each larger size costs
# seconds of copies: the default gloo run takes 17 s with this, 37 s with 256 MiB, 59 s with 1 GiB.
CPU_DEFAULT_MAX_BYTES = 64 << 20


def sweep_settings(args: argparse.Namespace, device_type: str) -> bandwidth.SweepSettings:
    """Sweep settings for tensors on ``device_type`` from the options, --quick changing only the defaults."""
    default_max = 4 << 20 if args.quick else CPU_DEFAULT_MAX_BYTES if device_type == "cpu" else 1 << 30
    return bandwidth.SweepSettings(
        min_bytes=args.min_bytes if args.min_bytes is not None else 8,
        max_bytes=args.max_bytes if args.max_bytes is not None else default_max,
        warmup=args.warmup if args.warmup is not None else (2 if args.quick else 5),
        iters=args.iters if args.iters is not None else (5 if args.quick else 20),
        size_budget_s=args.size_budget_s if args.size_budget_s is not None else (0.5 if args.quick else 2.0),
        max_call_s=args.max_call_s,
    )


def fault_settings(args: argparse.Namespace) -> fault.FaultSettings:
    """Fault-check settings from the options."""
    return fault.FaultSettings(
        init_timeout_s=args.fault_init_timeout,
        exception_timeout_s=args.fault_exception_timeout,
        gpu_timeout_s=args.fault_gpu_timeout,
        plant=args.fault_plant,
        recover=args.fault_recover,
        extra_env=dict(args.fault_env),
    )


def fault_total_s(args: argparse.Namespace) -> float:
    """Upper bound of the whole fault stage."""
    if "fault" not in args.checks:
        return 0.0
    cases = fault.cases_for(args.fault_backend, args.fault_modes, args.fault_ops)
    rounds = -(-len(cases) // max(1, args.fault_jobs))
    return rounds * fault.case_bound_s(fault_settings(args))


def peerloss_total_s(args: argparse.Namespace) -> float:
    """Upper bound of the whole peer-loss stage."""
    if "peerloss" not in args.checks:
        return 0.0
    return len(peerloss_cases(args)) * peerloss_runner.case_bound_s(peerloss_settings(args))


def peerloss_settings(args: argparse.Namespace) -> peerloss.PeerLossSettings:
    """Peer-loss settings from the options."""
    return peerloss.PeerLossSettings(
        init_timeout_s=args.fault_init_timeout,
        signal=args.peerloss_signal,
        pattern=args.peerloss_pattern,
        exception_timeout_s=args.peerloss_exception_timeout,
        recover_timeout_s=args.peerloss_recover_timeout,
        busy_s=args.peerloss_busy,
        heartbeat_s=args.peerloss_heartbeat,
        heartbeat_timeout_s=args.peerloss_heartbeat_timeout,
        runs=args.peerloss_runs,
        enforce_goals=args.peerloss_goals,
        train_steps_after=args.peerloss_train_steps,
        train_width=args.peerloss_train_width,
        link_loss_pct=args.peerloss_link_loss,
        link_delay_ms=args.peerloss_link_delay,
        cut_s=args.peerloss_cut_s,
        cut_jitter_s=args.peerloss_cut_jitter_s,
        extra_env=dict(args.fault_env),
        nccl_settings=args.peerloss_settings,
    )


def peerloss_cases(args: argparse.Namespace) -> list[peerloss.PeerLossCase]:
    """The peer-loss cases the options select."""
    kinds = args.peerloss_cases
    if kinds is None:
        kinds = [*peerloss.KINDS, *(peerloss.NODE_KINDS if (args.nodes or 0) >= 2 else ())]
    return peerloss.cases_for(
        args.peerloss_backend, peerloss.expand_kinds(kinds), args.peerloss_transports, args.peerloss_ops,
        args.peerloss_watcher,
    )


def report_path_problem(args: argparse.Namespace) -> OutputProblem | None:
    """Why --json or --plot cannot be written where asked, or None: looked at before any check runs."""
    if args.json and args.json != "-":
        problem = output_path_problem("--json", args.json)
        if problem is not None:
            return problem
    if args.plot:
        from torch_dist_check.report.plot import plot_path_problem

        return plot_path_problem(args.plot)
    return None


def print_problem(problem: OutputProblem) -> None:
    """A usage error on stderr: what is wrong, then what to do."""
    print(f"torch_dist_check: {problem.message}\nhint: {problem.hint}", file=sys.stderr)


def write_report(document: dict[str, Any], destination: str) -> bool:
    """Write the JSON report; a failure to write it says so on stderr and never ends the run."""
    try:
        write_json(document, destination)
    except OSError as exc:
        print(f"torch_dist_check: report not written to {destination}: {exc.strerror or exc}", file=sys.stderr)
        return False
    return True


def run_spawned(args: argparse.Namespace, argv: list[str]) -> int:
    """Start --nproc local ranks, wait with a bound, and report every rank that ended abnormally.

    A rank that died (a signal, a crash handler's ``exit(1)``, the deadline) adds a failing
    ``harness/ranks`` check to what rank 0 had reported so far, so --json always leaves a report
    that says why; when the ranks died before their network check, it is read from NCCL's logs.
    """
    # A launcher that has torch already (itself forked from a caller's fork server) forks its ranks from
    # itself: no interpreter and no torch import more. Started as a command it has not: a server of its own.
    # Not where it imported a user's modules (--import): the ranks' interpreters import them themselves, and
    # a module's state inherited instead (a log file whose descriptor the server closes) would not be theirs.
    if not args.imports:
        forkserver.prefork()
    # The ranks' stage and verdict files, read as they end: removed with the run (one was left in TMPDIR by each).
    status_dir = Path(tempfile.mkdtemp(prefix="torch-dist-check-"))
    try:
        return _run_spawned(args, argv, status_dir)
    finally:
        shutil.rmtree(status_dir, ignore_errors=True)


def _run_spawned(args: argparse.Namespace, argv: list[str], status_dir: Path) -> int:
    stages = 4 + 2 * len(args.backends) * 2
    # Ranks bound each of their stages themselves; this backstop adds time to start Python and torch.
    deadline = args.stage_timeout * stages + fault_total_s(args) + peerloss_total_s(args) + 120
    if args.nodes is not None:
        try:
            node_set = nodes.NodeSet(args.nodes)
        except nodes.NodesUnavailable as exc:
            print(f"torch_dist_check: --nodes needs network namespaces, and {exc}\n"
                  "hint: run as root, or where the kernel lets users make user namespaces "
                  "(unshare --user --map-root-user --net true must work)", file=sys.stderr)  # fmt: skip
            return EXIT_INCOMPLETE
        with node_set as network:
            print(f"torch_dist_check: {args.nodes} node(s) on this host: "
                  + ", ".join(f"node {n.index} {n.address} ({nodes.IFNAME}, NCCL_HOSTID={n.hostid})" for n in network.nodes),
                  file=sys.stderr)  # fmt: skip
            world_size = args.nodes * (args.nproc_per_node or 1)
            outcome = spawn_local(world_size, argv, deadline, status_dir, StageProgress(), network)
    else:
        world_size = args.nproc
        outcome = spawn_local(world_size, argv, deadline, status_dir, StageProgress())
    if not outcome.abnormal:
        for end in outcome.ranks:
            if end.status_unknown is not None:
                # Said, not counted: the rank reached its verdict, and how its process ended nobody can know.
                print(f"torch_dist_check: {end.describe()}", file=sys.stderr)
        return outcome.exit_code
    reason = ("ranks did not finish within %.0f s; " % deadline if outcome.timed_out else "a rank ended abnormally; ") + "; ".join(
        r.describe() for r in outcome.ranks
    )
    print(f"torch_dist_check: {reason}", file=sys.stderr)
    harness = CheckResult(
        "harness/ranks",
        FAIL,
        reason,
        {
            "exit_codes": [r.exit_code for r in outcome.ranks],
            "verdicts": [r.verdict for r in outcome.ranks],
            "stages": [r.stage for r in outcome.ranks],
            "stderr_tails": [list(r.tail) for r in outcome.ranks],
        },
    )
    # Keep what rank 0 reported before it stopped (it rewrites its file at every stage).
    earlier: list[CheckResult] = []
    job: dict[str, Any] = {"launcher": "spawn", "world_size": world_size, "argv": argv}
    if args.json and args.json != "-" and Path(args.json).exists():
        partial = json.loads(Path(args.json).read_text())
        earlier = [CheckResult(**c) for c in partial["checks"]]
        job = partial["job"]
    results = [*earlier, *_network_after_death(args, outcome, earlier), harness]
    if args.json:
        write_report(build_document(results, job, outcome.ranks[0].stage or "start", {}), args.json)
    render_table(results, sys.stderr if args.json == "-" else sys.stdout)
    incomplete = outcome.timed_out or any(r.verdict == EXIT_INCOMPLETE for r in outcome.ranks)
    return EXIT_INCOMPLETE if incomplete else EXIT_FAILED


def _network_after_death(args: argparse.Namespace, outcome: SpawnOutcome, earlier: list[CheckResult]) -> list[CheckResult]:
    """``env/nccl-network`` from the dead ranks' NCCL logs, when the ranks did not get to check it.

    Empty when the check was not asked for, rank 0 reported it, or no rank left a log (NCCL never ran).
    """
    if "env" not in args.checks or any(c.name == "env/nccl-network" for c in earlier):
        return []
    if os.environ.get("NCCL_DEBUG", "").upper() not in ("INFO", "TRACE"):
        return []
    per_rank: list[list[CheckResult]] = []
    for end in outcome.ranks:
        path = envinfo.nccl_log_path(os.environ, end.pid, socket.gethostname())
        per_rank.append([envinfo.nccl_network_from_log(path, args.expect_nccl_net, os.environ)] if path and os.path.exists(path) else [])
    merged = merge_rank_results(per_rank)
    for result in merged:
        result.reason = f"{result.reason} (read from NCCL's logs after the ranks ended abnormally)"
    return merged


class Run:
    """One rank's run: the control group, the results so far, and the stage watchdog."""

    def __init__(self, args: argparse.Namespace, info: RankInfo) -> None:
        self.args = args
        self.info = info
        self.results: list[CheckResult] = []
        self.job: dict[str, Any] = {
            "launcher": info.launcher,
            "world_size": info.world_size,
            "local_world_size": info.local_world_size,
            "master_addr": info.master_addr,
            "master_port": info.master_port,
            "batch_job": batch_job(os.environ),
            "argv": sys.argv[1:],
            "network_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(NETWORK_ENV_PREFIXES)},
        }
        network = nodes.network_from_env(os.environ)
        if network is not None:
            self.job["nodes"] = [{"node": n.index, "address": n.address, "ifname": nodes.IFNAME, "nccl_hostid": n.hostid}
                                 for n in network.nodes]  # fmt: skip
        self.extras: dict[str, Any] = {}
        # Rank 0 writes the reports; where it cannot, the run stops before its first check.
        self.path_problem = report_path_problem(args) if info.rank == 0 else None
        self.report_path_ok = self.path_problem is None
        status_dir = os.environ.get(STATUS_DIR_ENV)
        status = stage_file(Path(status_dir), info.rank) if status_dir else None
        self.tracker = StageTracker(args.stage_timeout, self._on_timeout, status)
        # Rank 0 shows its stages itself, unless --nproc started it (the launcher shows them then).
        self.progress = StageProgress() if info.rank == 0 and not status_dir else None
        self.control: Any = None
        # The groups of the backends under test; released with the control group at teardown.
        self.groups: list[Any] = []

    def teardown(self) -> None:
        """Destroy every process group and join its backends' threads, while the interpreter lives.

        A backend's worker thread (gloo's, ProcessGroupMPI's) drops its last reference to a finished
        collective, and with it to the tensors Python made for it, shortly after the caller saw the
        collective complete. Dropping a tensor that Python made needs the GIL. Two ways that goes
        wrong: the group is destroyed from Python, which holds the GIL while the C++ destructor waits
        for that worker (a deadlock); or the group outlives this function (``Run`` sits in a reference
        cycle with its tracker, so the collector at exit frees it) and the worker asks for the GIL
        while the interpreter finalizes, which ends the thread with pthread_exit, and unwinding
        through the backend's C++ loop calls std::terminate ("terminate called without an active
        exception", signal 6, after a run that passed).

        So each group's backends are held from Python while the groups are destroyed, and released
        last: torch's Python wrapper of a backend releases the GIL before the backend's destructor
        runs, so the worker can finish and be joined.
        """
        import torch.distributed as dist

        backends = [
            pg._get_backend(device)
            for pg in list(dist.distributed_c10d._world.pg_map)
            for device in pg._device_types
        ]
        dist.destroy_process_group()
        self.control = None
        self.groups.clear()
        gc.collect()
        while backends:
            backends.pop()

    def enter(self, stage: str, limit_s: float | None = None) -> None:
        """Start a bounded stage; rank 0 rewrites its JSON file so far, naming the stage in progress.

        A run killed from outside (a batch system's time limit) thus still leaves a report that says
        which stage did not complete; the final report replaces it.
        """
        self.tracker.enter(stage, limit_s)
        if self.progress is not None and stage == "report":
            # The report follows on stdout, often the terminal the live line is on: end the line first.
            self.progress.close()
            self.progress = None
        elif self.progress is not None:
            self.progress.stage(stage)
        if self.info.rank == 0 and self.args.json and self.args.json != "-" and self.report_path_ok:
            write_report(build_document(self.results, self.job, stage, self.extras, in_progress=True), self.args.json)

    def _on_timeout(self, stage: str, limit_s: float) -> None:
        """A stage outlived its bound: report it (rank 0 with what it has) and end the process."""
        message = f"stage '{stage}' did not complete within {limit_s:.0f} s"
        if self.progress is not None:
            self.progress.close()
        print(f"torch_dist_check rank {self.info.rank}: {message}", file=sys.stderr, flush=True)
        if self.info.rank == 0:
            results = [*self.results, CheckResult(stage, FAIL, message)]
            document = build_document(results, self.job, stage, self.extras)
            if self.args.json:
                write_report(document, self.args.json)
            render_table(results, sys.stderr if self.args.json == "-" else sys.stdout)
        sys.stdout.flush()
        record_verdict(self.info.rank, EXIT_INCOMPLETE)
        os._exit(EXIT_INCOMPLETE)

    def agree(self, flag: bool) -> bool:
        """True only if ``flag`` is true on every rank."""
        import torch
        import torch.distributed as dist

        value = torch.tensor([1 if flag else 0], dtype=torch.int32)
        dist.all_reduce(value, op=dist.ReduceOp.MIN, group=self.control)
        return bool(value.item())


def backend_unavailable(
    profile: backend_profiles.BackendProfile, info: RankInfo, nccl_placement: placement.Placement | None
) -> str | None:
    """Why this rank cannot run the backend of ``profile``, or None if it can."""
    import torch
    import torch.distributed as dist

    backend = profile.name
    if profile.plugin:
        if profile.mpi_launch and not info.is_mpi_launch:
            return f"not started by mpiexec/mpirun (the {backend} profile says it takes its ranks from MPI)"
        if not profile.devices:
            return f"{backend} registered none of the devices the suite tests (cpu, cuda)"
        return None
    if backend == "gloo":
        return None if dist.is_gloo_available() else "PyTorch was built without gloo"
    if backend == "nccl":
        if not dist.is_nccl_available():
            return "PyTorch was built without NCCL"
        if not torch.cuda.is_available():
            return "no CUDA device is visible"
        return nccl_placement.skip if nccl_placement is not None else None
    if not dist.is_mpi_available():
        return "PyTorch was built without MPI (torch.distributed.is_mpi_available() is False)"
    if not info.is_mpi_launch:
        return "not started by mpiexec/mpirun (torch's MPI backend takes its ranks from MPI)"
    return None


def run_rank(args: argparse.Namespace, info: RankInfo) -> int:
    """Run every selected check as this rank; rank 0 reports. Returns the exit status."""
    import torch
    import torch.distributed as dist

    if info.rank == 0 and {"fault", "peerloss"} & set(args.checks) and not args.imports:
        # Their workers fork from this process as it is now (torch imported, no thread or group yet),
        # not from a new interpreter that would import torch again (harness/forkserver.py, prefork); not
        # where it imported a user's modules, whose state (an open file) no worker's interpreter would hold.
        forkserver.prefork()
    run = Run(args, info)

    run.enter("init")
    control_timeout = max(args.stage_timeout, fault_total_s(args) + peerloss_total_s(args) + 60)
    port_file = os.environ.get(PORT_FILE_ENV)
    if port_file:
        # Ranks that --nproc started: rank 0's store binds a port the kernel gives it, then publishes it.
        from torch_dist_check.harness.rendezvous import host_store, join_store

        store = (host_store if info.rank == 0 else join_store)(Path(port_file), info.world_size, control_timeout)
        run.job["master_port"] = int(store.port)
        rendezvous: dict[str, Any] = {"store": store}
    else:
        rendezvous = {"init_method": f"tcp://{info.master_addr}:{info.master_port}"}
    dist.init_process_group(
        "gloo", rank=info.rank, world_size=info.world_size, timeout=timedelta(seconds=control_timeout), **rendezvous
    )
    run.control = dist.new_group(backend="gloo", timeout=timedelta(seconds=control_timeout))
    # Every rank stops when rank 0 cannot write its reports (under srun or mpiexec the path is only
    # looked at where it is written), before any check runs.
    if not run.agree(run.report_path_ok):
        if run.path_problem is not None:
            print_problem(run.path_problem)
        run.teardown()
        return EXIT_USAGE
    hosts: list[Any] = [None] * info.world_size
    dist.all_gather_object(hosts, socket.gethostname(), group=run.control)
    run.job["hosts"] = hosts
    results = run.results

    if "env" in args.checks:
        run.enter("env")
        results.append(envinfo.torch_check())
        results.append(envinfo.nccl_library_check(args.expect_nccl, args.expect_nccl_under))
        results.append(envinfo.mpi_check(envinfo.mpi_facts(mpi_initialized=False)))

    # The fault cases run first, before this job's own NCCL communicators exist: their two worker
    # processes then share the GPUs with nothing but idle CUDA contexts.
    if "fault" in args.checks:
        run.enter("fault", fault_total_s(args) + 60)
        if info.rank == 0:
            results.extend(_fault_results(args))
        dist.barrier(group=run.control)
    if "peerloss" in args.checks:
        run.enter("peerloss", peerloss_total_s(args) + 60)
        if info.rank == 0:
            results.extend(_peerloss_results(args))
        dist.barrier(group=run.control)

    nccl_ran = False
    mpi_cuda: CheckResult | None = None
    mpi_ran = False
    plan_counts = correctness.default_counts(args.quick)
    run.job["backends"] = {p.name: p.describe() for p in args.profiles}
    run.job["imports"] = list(args.imports)
    group: Any = None
    nccl_placement = place_nccl_ranks(args, info) if "nccl" in args.backends else None
    if nccl_placement is not None:
        run.job["placement"] = nccl_placement.describe()
    for profile in args.profiles:
        backend = profile.name
        reason = backend_unavailable(profile, info, nccl_placement)
        everywhere = run.agree(reason is None)
        devices = _devices(profile, info) if everywhere else []
        if everywhere and not devices:
            reason, everywhere = f"none of its devices ({', '.join(profile.devices)}) is visible here", False
        if not everywhere:
            why = reason or "unavailable on another rank"
            for check in ("correctness", "bandwidth"):
                if check in args.checks:
                    results.append(CheckResult.skipped(f"{check}/{backend}", why))
            continue
        if backend == "nccl" and nccl_placement is not None:
            results.append(CheckResult("placement/nccl", PASS, nccl_placement.summary(), nccl_placement.describe()))
        run.enter(f"group/{backend}")
        try:
            group = dist.new_group(backend=backend, timeout=timedelta(seconds=args.stage_timeout))
            run.groups.append(group)
        except Exception as exc:  # a backend that cannot form a group fails its checks, the run goes on
            why = f"new_group(backend={backend!r}) raised {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            results.extend(CheckResult(f"{check}/{backend}", FAIL, why) for check in ("correctness", "bandwidth") if check in args.checks)
            continue
        plan = correctness.Plan(profile.dtypes, plan_counts)
        for device in devices:
            if "correctness" in args.checks:
                run.enter(f"correctness/{backend}/{device.type}")
                outcome = correctness.run_correctness(backend, device, group, info.rank, info.world_size, plan)
                results.extend(outcome)
                if backend == "mpi" and device.type == "cuda":
                    mpi_cuda = outcome[0]
            if "bandwidth" in args.checks:
                run.enter(f"bandwidth/{backend}/{device.type}")
                results.extend(
                    bandwidth.run_sweep(
                        backend, device, group, info.world_size, sweep_settings(args, device.type),
                        args.collectives, args.expect_busbw, run.control,
                    )  # fmt: skip
                )
            if device.type == "cuda":
                torch.cuda.empty_cache()
        nccl_ran = nccl_ran or backend == "nccl"
        mpi_ran = mpi_ran or backend == "mpi"

    if "env" in args.checks:
        run.enter("env/after")
        results.append(envinfo.nccl_network_check(nccl_ran, args.expect_nccl_net))
        results.append(envinfo.mpi_cuda_aware_check(envinfo.mpi_facts(mpi_initialized=mpi_ran), mpi_cuda))

    run.enter("report")
    gathered: list[Any] = [None] * info.world_size
    dist.all_gather_object(gathered, [asdict(r) for r in results], group=run.control)
    code = [EXIT_OK]
    if info.rank == 0:
        merged = merge_rank_results([[CheckResult(**r) for r in rank_results] for rank_results in gathered])
        if args.plot:
            from torch_dist_check.report.plot import plot_sweeps

            run.extras["plot"] = plot_sweeps(merged, args.plot)
        document = build_document(merged, run.job, None, run.extras)
        stream = sys.stderr if args.json == "-" else sys.stdout
        render_table(merged, stream)
        if run.extras.get("plot") and not run.extras["plot"]["written"]:
            stream.write(f"plot not written: {run.extras['plot']['reason']}\n")
        if args.json:
            write_report(document, args.json)
        code = [EXIT_OK if document["summary"]["ok"] else EXIT_FAILED]
    dist.broadcast_object_list(code, src=0, group=run.control)
    # The final report is written; teardown is bounded but does not rewrite it.
    run.tracker.enter("teardown", 120)
    group = None  # the loop's last group: run.teardown() must hold the only references left
    run.teardown()
    return int(code[0])


def place_nccl_ranks(args: argparse.Namespace, info: RankInfo) -> placement.Placement | None:
    """Seat this node's ranks on its GPUs for NCCL and export this rank's placement variables.

    Runs before this process creates any NCCL communicator: NCCL reads ``NCCL_HOSTID`` once, at its
    first one. None where NCCL cannot run at all (no NCCL in torch, no GPU).
    """
    import torch
    import torch.distributed as dist

    if not dist.is_nccl_available() or not torch.cuda.is_available():
        return None
    node_hostid = os.environ.get(placement.HOSTID_ENV) if nodes.network_from_env(os.environ) else None
    if node_hostid:
        # A stand-in node (--nodes): its ranks share the node's NCCL_HOSTID and its slice of the GPUs.
        seats = placement.place_on_node(
            torch.cuda.device_count(), node_index(), info.local_world_size, envinfo.loaded_nccl_version(),
            args.gpu_sharing, node_hostid,
        )  # fmt: skip
    else:
        seats = placement.place(
            torch.cuda.device_count(),
            range(info.local_world_size),
            envinfo.loaded_nccl_version(),
            args.gpu_sharing,
            f"{socket.gethostname()}.tdc",
        )
    if seats.skip is None:
        os.environ.update(seats.seats[info.local_rank].env)
    return seats


def _devices(profile: backend_profiles.BackendProfile, info: RankInfo) -> list[Any]:
    """The devices of the profile this rank has: CPU, and this rank's GPU if one is visible."""
    import torch

    devices = [torch.device("cpu")] if "cpu" in profile.devices else []
    if "cuda" in profile.devices and torch.cuda.is_available() and torch.cuda.device_count() > 0:
        # On a stand-in node (--nodes) the node's ranks take the node's slice of the GPUs.
        index = (node_index() * info.local_world_size + info.local_rank) % torch.cuda.device_count()
        torch.cuda.set_device(index)
        devices.append(torch.device("cuda", index))
    return devices


def node_index() -> int:
    """This rank's stand-in node (--nodes), 0 without."""
    return int(os.environ.get(nodes.NODE_ENV, "0"))


def _fault_results(args: argparse.Namespace) -> list[CheckResult]:
    """Run the fault cases on this node (rank 0 only), or say why they cannot run here."""
    import torch
    import torch.distributed as dist

    cases = fault.cases_for(args.fault_backend, args.fault_modes, args.fault_ops)
    if args.fault_backend == "nccl":
        reason = None
        if "nccl" not in args.backends:
            reason = "the nccl backend is not selected (--backends)"
        elif not dist.is_nccl_available():
            reason = "PyTorch was built without NCCL"
        elif not torch.cuda.is_available() or torch.cuda.device_count() < 2:
            reason = "needs 2 GPUs on this node (use --fault-backend gloo to exercise the harness on CPU)"
        if reason:
            return [CheckResult.skipped(case.name, reason) for case in cases]
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return fault.run_cases(cases, fault_settings(args), args.fault_jobs)


def _peerloss_results(args: argparse.Namespace) -> list[CheckResult]:
    """Run the peer-loss cases on this node (rank 0 only), or say why they cannot run here.

    NCCL cases run on the GPUs this node has: with fewer than a case's slots, its processes share
    them as the case's transport allows (torch_dist_check.harness.placement).
    """
    import torch
    import torch.distributed as dist

    cases = peerloss_cases(args)
    gpus = 0
    nccl_version = None
    if args.peerloss_backend == "nccl":
        reason = None
        if "nccl" not in args.backends:
            reason = "the nccl backend is not selected (--backends)"
        elif not dist.is_nccl_available():
            reason = "PyTorch was built without NCCL"
        elif not torch.cuda.is_available():
            reason = "no CUDA device is visible (use --peerloss-backend gloo to run the cases on CPU)"
        if reason:
            return [CheckResult.skipped(case.name, reason) for case in cases]
        gpus = torch.cuda.device_count()
        nccl_version = envinfo.loaded_nccl_version()
        torch.cuda.empty_cache()
    return peerloss_runner.run_cases(cases, peerloss_settings(args), gpus, nccl_version, nodes.network_from_env(os.environ))
