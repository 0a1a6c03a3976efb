"""Run the peer-loss cases: each run's fresh processes (their environment and command lines), the run
itself, and the case's result over its runs (:func:`run_cases`). What the cases are:
:mod:`torch_dist_check.peerloss.cases`; how a run is judged: :mod:`torch_dist_check.peerloss.judges`.
"""

from __future__ import annotations

import os
import random
import secrets
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from torch_dist_check.checks.fault import WorkerProcess
from torch_dist_check.harness import placement
from torch_dist_check.nodes.namespaces import NodeNetwork, degrade_method
from torch_dist_check.peerloss import hsdp
from torch_dist_check.peerloss.cases import (
    CUT_MOMENT_JITTER_S,
    CUT_OUTCOMES,
    ROLES,
    TRAIN_PHASES,
    CaseRun,
    PeerLossCase,
    PeerLossSettings,
    b_iters,
    brief_cut_loop_s,
    case_placement,
    goals_met,
    heartbeat_timeout_s,
    missed_goal,
    role_nodes,
    summarize,
    watcher_missing,
)
from torch_dist_check.peerloss.judges import judge, judge_node
from torch_dist_check.peerloss.worker import NODE_KINDS
from torch_dist_check.report.results import FAIL, PASS, CheckResult


_DROP_FROM_WORKER_ENV = ("NCCL_DEBUG_FILE", "TORCH_DIST_CHECK_NCCL_LOG", "RANK", "WORLD_SIZE", "LOCAL_RANK")
# Transport switches a case sets itself: inherited values would make "p2p" mean something else.
_TRANSPORT_ENV = ("NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "NCCL_IB_DISABLE", "NCCL_NET", "NCCL_SOCKET_IFNAME")
# ncclft's activation defaults (docs/explain/nccl-fault-tolerance.md); a value in the environment wins.
_NCCL_DEFAULTS = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
    "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "0",
    "TORCH_NCCL_TRACE_BUFFER_SIZE": "0",
    # The heartbeat monitor would std::abort a process whose watchdog looks stuck.
    "TORCH_NCCL_ENABLE_MONITORING": "0",
}
# What --peerloss-settings pytorch takes out of the workers' environment: every variable the watcher sets where the
# environment names none, under every name PyTorch reads it by (torch_peer_watcher.watchdog.SETTINGS).
_PYTORCH_SETTINGS = (*_NCCL_DEFAULTS, "NCCL_ASYNC_ERROR_HANDLING", "TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT")


def worker_env(case: PeerLossCase, base: Mapping[str, str], settings: PeerLossSettings) -> dict[str, str]:
    """The environment every worker of a case shares (its placement adds per-process variables)."""
    env = {k: v for k, v in base.items() if k not in _DROP_FROM_WORKER_ENV}
    # The worker starts the watcher itself when the case says so; auto-start would blur "without".
    env.update(PYTHONUNBUFFERED="1", TORCH_PEER_WATCHER="0")
    # This launcher hands every rank of the case the same fresh secret: the watchers' links authenticate.
    env.pop("TORCH_PEER_WATCHER_SECRET_FILE", None)
    env["TORCH_PEER_WATCHER_SECRET"] = secrets.token_hex(32)
    if settings.heartbeat_s is not None:
        env["TORCH_PEER_WATCHER_INTERVAL_S"] = str(settings.heartbeat_s)
    if settings.heartbeat_timeout_s is not None:
        env["TORCH_PEER_WATCHER_TIMEOUT_S"] = str(settings.heartbeat_timeout_s)
    if case.backend == "nccl":
        for key in (*_TRANSPORT_ENV, *placement.PLACEMENT_ENV):
            env.pop(key, None)
        env.setdefault("NCCL_DEBUG", "WARN")
        if settings.nccl_settings == "pytorch":
            for key in _PYTORCH_SETTINGS:
                env.pop(key, None)
        else:
            for key, value in _NCCL_DEFAULTS.items():
                env.setdefault(key, value)
            if case.kind in ("shrink", "train-shrink"):
                # PyTorch's watchdog (mode 2) aborts a communicator with an async error, the one the
                # watcher's shrink_group is shrinking at that moment: the watcher handles the error here.
                env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "0"
        # NVLink multicast stays off on shared multi-GPU hosts.
        env["NCCL_NVLS_ENABLE"] = "0"
        if case.transport in ("shm", "net"):
            env["NCCL_P2P_DISABLE"] = "1"
        if case.transport == "net":
            env.update(NCCL_SHM_DISABLE="1", NCCL_IB_DISABLE="1", NCCL_NET="Socket", NCCL_SOCKET_IFNAME="lo")
    else:
        env["GLOO_SOCKET_IFNAME"] = "lo"
    env.update(settings.extra_env)
    return env


def _argv(role: str, case: PeerLossCase, settings: PeerLossSettings, rendezvous_dir: Path, device: int) -> list[str]:
    issue_for = settings.exception_timeout_s + settings.kill_after_s + 30
    if case.kind == "lossy-link":
        # The loop must outlast the heartbeat timeout twice over with the link lossy and slow.
        issue_for = settings.kill_after_s + 2 * heartbeat_timeout_s(settings) + 1
    elif case.kind in ("brief-cut", "heal-stop"):
        issue_for = brief_cut_loop_s(settings)
    return [
        sys.executable, "-m", "torch_dist_check.peerloss.worker",
        "--role", role, "--kind", case.kind, "--backend", case.backend, "--op", case.op,
        "--watcher", "on" if case.watcher else "off", "--rendezvous-dir", str(rendezvous_dir), "--device", str(device),
        "--kill-after", str(settings.kill_after_s), "--signal", settings.signal, "--pattern", settings.pattern,
        "--issue-for", str(issue_for),
        "--b-iters", str(b_iters(settings)), "--b-period", str(settings.b_period_s),
        "--busy-s", str(settings.busy_s), "--pg-timeout", str(max(300.0, settings.busy_s + 120)),
    ]  # fmt: skip


def _train_argv(role: str, case: PeerLossCase, settings: PeerLossSettings, rendezvous_dir: Path, device: int,
                run_index: int) -> list[str]:  # fmt: skip
    return [
        sys.executable, "-m", "torch_dist_check.peerloss.train_worker",
        "--role", role, "--recovery", case.kind.removeprefix("train-"), "--backend", case.backend,
        "--rendezvous-dir", str(rendezvous_dir), "--device", str(device),
        "--kill-step", str(settings.train_kill_step), "--kill-phase", train_phase(run_index),
        "--steps-after", str(settings.train_steps_after), "--width", str(settings.train_width),
        "--pg-timeout", "300", "--recover-timeout", str(settings.recover_timeout_s),
    ]  # fmt: skip


def train_phase(run_index: int) -> str:
    """The phase of the step the victim dies in on run ``run_index``: each in turn, from a random start
    drawn once per process, so that every phase comes up in 4 runs and no run is tied to one."""
    return TRAIN_PHASES[(_PHASE_OFFSET + run_index) % len(TRAIN_PHASES)]


_PHASE_OFFSET = random.SystemRandom().randrange(len(TRAIN_PHASES))


def run_once(
    case: PeerLossCase, settings: PeerLossSettings, seats: placement.Placement | None = None, run_index: int = 0,
    network: NodeNetwork | None = None,
) -> tuple[bool | None, str, dict[str, Any]]:
    """Run the case once, on the nodes of ``network`` if given: (passed, or None if this PyTorch cannot
    run it; reason; figures)."""
    env = worker_env(case, os.environ, settings)
    where = role_nodes(case.kind, len(network.nodes)) if network is not None else {}
    workers = {}
    # The stores' hosts publish the ports they bound here (no port chosen before it is bound).
    with tempfile.TemporaryDirectory(prefix="peerloss-") as rendezvous_dir:
        for i, (role, _) in enumerate(ROLES[case.kind]):
            seat = seats.seats[i] if seats is not None else placement.Seat(0)
            if case.kind == "train-hsdp":
                argv = hsdp.argv(role, case.backend, Path(rendezvous_dir), seat.device, train_phase(run_index), settings)
            elif case.kind.startswith("train-"):
                argv = _train_argv(role, case, settings, Path(rendezvous_dir), seat.device, run_index)
            else:
                argv = _argv(role, case, settings, Path(rendezvous_dir), seat.device)
            if network is not None:
                node = network.nodes[where[role]]
                # The seat's own host id (a GPU shared through the network) wins over the node's.
                command, entry = network.node_start(node.index, argv)
                workers[role] = WorkerProcess(i, command, {**env, **node.env(), **seat.env}, **entry)
            else:
                workers[role] = WorkerProcess(i, argv, {**env, **seat.env})
        run = CaseRun(workers)
        if network is not None:
            run.figures["nodes"] = dict(where)
        try:
            ok, reason = judge_node(case, settings, run, network, where) if case.kind in NODE_KINDS else judge(case, settings, run)
        finally:
            run.kill_all()
    if ok is False:
        # A judge that recorded a side's last lines took them before it asked for its stacks (trainjudge.record_hang).
        run.figures.setdefault("survivor_tail", run.workers["survivor"].tail())
        for role, worker in run.workers.items():
            if role != "survivor":
                run.figures.setdefault(f"{role}_tail", worker.tail(10))
    return ok, reason, run.figures


def run_case(
    case: PeerLossCase, settings: PeerLossSettings, seats: placement.Placement | None = None, network: NodeNetwork | None = None
) -> CheckResult:
    """Run the case ``settings.runs`` times (on the nodes of ``network`` if given); fail if any run
    failed (or missed a goal, if enforced)."""
    started = time.monotonic()
    runs = []
    failures = []
    where = {"placement": seats.describe()} if seats is not None else {}
    for index in range(settings.runs):
        ok, reason, figures = run_once(case, settings, seats, index, network)
        if ok is None:
            # This PyTorch cannot run the case (e.g. no shrink_group): one run says so for all.
            return CheckResult.skipped(case.name, reason, **where)
        runs.append({"ok": ok, "reason": reason, **figures})
        if not ok:
            failures.append(f"run {index + 1}: {reason}")
    details: dict[str, Any] = {
        **where,
        "kind": case.kind,
        "backend": case.backend,
        "transport": case.transport,
        "op": case.op,
        "watcher": case.watcher,
        "signal": settings.signal,
        "pattern": settings.pattern,
        "runs": runs,
        "summary": summarize(runs),
    }
    if case.kind in NODE_KINDS:
        within = [r["detected_within_goal"] for r in runs if "detected_within_goal" in r]
        details["goals"] = {"detected_s": all(within) if within else None}
    if case.kind in ("brief-cut", "heal-stop"):
        details["outcomes"] = {word: n for word in CUT_OUTCOMES if (n := sum(r.get("outcome") == word for r in runs))}
    elif case.watcher and case.kind != "false-positive":
        details["goals"] = goals_met(details["summary"], case)
    status = PASS if not failures else FAIL
    if status == PASS and settings.enforce_goals and details.get("goals") and case.kind not in NODE_KINDS:
        missed = [name for name, met in details["goals"].items() if met is False]
        if missed:
            status = FAIL
            failures.append("goal missed: " + ", ".join(missed_goal(details["summary"], case.kind, n) for n in missed))
    reason = "; ".join(failures) if failures else (runs[0]["reason"] if len(runs) == 1 else _worst_line(details["summary"]))
    if case.kind in ("brief-cut", "heal-stop") and len(runs) > 1:
        reason = _cut_line(details["outcomes"], runs) + ("; " + reason if failures else "")
    if seats is not None:
        reason += f" [placement {seats.kind}]"
    return CheckResult(case.name, status, reason, details, time.monotonic() - started)


def _worst_line(summary: Mapping[str, Mapping[str, float]]) -> str:
    return "; ".join(f"{name} median {v['median']} worst {v['worst']} (n={v['n']})" for name, v in summary.items())


def _cut_line(outcomes: Mapping[str, int], runs: Sequence[Mapping[str, Any]]) -> str:
    """'20 runs: 12 tolerated, 8 one side; cut 0.51-0.99 s'."""
    cuts = [float(r["cut_s"]) for r in runs if r.get("cut_s") is not None]
    span = f"; cut {min(cuts):.2f}-{max(cuts):.2f} s" if cuts else ""
    return f"{len(runs)} runs: " + ", ".join(f"{n} {word}" for word, n in outcomes.items()) + span


def run_cases(
    cases: Sequence[PeerLossCase], settings: PeerLossSettings, gpus: int = 0, nccl_version: tuple[int, int, int] | None = None,
    network: NodeNetwork | None = None,
) -> list[CheckResult]:
    """Run the cases one after the other (they share the devices), NCCL's placed on ``gpus`` GPUs, and
    every case's processes on the nodes of ``network`` if given."""
    missing = watcher_missing()
    no_lossy_link = (degrade_method(network, settings.link_delay_ms)[1]
                     if network is not None and any(c.kind == "lossy-link" for c in cases) else None)  # fmt: skip
    results = []
    for case in cases:
        seats = case_placement(case, gpus, nccl_version)
        if case.watcher and missing:
            results.append(CheckResult.skipped(case.name, missing))
        elif case.kind in NODE_KINDS and (network is None or len(network.nodes) < 2):
            results.append(CheckResult.skipped(case.name, "a fault between nodes needs --nodes 2 or more"))
        elif case.kind == "lossy-link" and no_lossy_link:
            results.append(CheckResult.skipped(case.name, no_lossy_link))
        elif seats is not None and seats.skip:
            results.append(CheckResult.skipped(case.name, seats.skip, placement=seats.describe()))
        elif settings.pattern == "poll" and case.backend == "gloo" and case.op == "sendrecv" and case.kind == "single":
            # Measured with torch 2.13.0: gloo's isend/irecv work stays not completed until wait().
            results.append(CheckResult.skipped(case.name, "gloo's send/recv work never reports is_completed() before wait()"))
        else:
            results.append(run_case(case, settings, seats, network))
    return results


def case_bound_s(settings: PeerLossSettings) -> float:
    """The longest one case can take (all its runs)."""
    waits = (settings.recover_timeout_s, settings.busy_s + 60, brief_cut_loop_s(settings) + settings.recover_timeout_s)
    one = settings.init_timeout_s + settings.kill_after_s + CUT_MOMENT_JITTER_S + 30 + max(waits)
    return settings.runs * (one + settings.b_window_s + 60)
