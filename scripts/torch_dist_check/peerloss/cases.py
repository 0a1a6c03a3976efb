"""Peer loss: how fast and how cleanly a process recovers when a peer of one of its groups dies.

Cases (each started fresh, workers from :mod:`torch_dist_check.peerloss.worker`):
- ``single``: survivor and victim in one group; the victim dies (SIGKILL, or SIGSTOP: alive but
  stuck) while both run the op (all_reduce, send/recv, or one coalesced all_reduce) in the
  survivor's pattern (``wait``, ``enqueue``, ``poll``: :func:`peerloss_worker._op`). NCCL runs
  it over each transport: ``p2p`` (nothing forced), ``shm`` (NCCL_P2P_DISABLE=1), ``net``
  (sockets over loopback); gloo has one transport (TCP).
- ``two-world``: the survivor is in group A with the victim and in group B with a live peer; B's
  loop runs in a second thread of the survivor while A fails.
- ``false-positive``: the peer computes for ``busy_s`` while the survivor waits inside an
  all_reduce; the all_reduce must complete exactly and nothing may be declared lost.
- ``shrink``: 3 ranks in one group, one dies; the watcher's verdict shrinks the group
  (``shrink_group``, ``SHRINK_ABORT``) and both survivors run an exact all_reduce on it.
- node cases (``--nodes`` 2 or more, :mod:`torch_dist_check.nodes.namespaces`; the watcher on): ``partition``
  (node 1's link cut: silence both ways), ``node-kill`` (every process of node 1 SIGKILLed),
  ``store-lost`` (node 0, the store's host, killed whole), ``lossy-link`` (node 1's link with netem's
  5% loss and 50 ms delay each way for twice the heartbeat timeout), ``brief-cut`` (node 1's link cut
  at a random moment of the all_reduce loop and healed after ``cut_s`` plus a random jitter). Only the
  side that keeps the store may train on; the other must raise ``PartitionedError``; a slow link is
  never a loss; a cut that heals is either tolerated (no verdict, every all_reduce exact) or ends as a
  partition does, never with both sides training nor with neither (:func:`judge_brief_cut`).
With ``--nodes``, every case's processes run on the nodes: the survivor on node 0, the other roles
on the other nodes in turn, a replacement on the node of the process it replaces.
Every case but the false positive and shrink runs with and without torch_peer_watcher (shrink
needs the watcher's verdict). Where the node has fewer GPUs than a case has slots, the
processes share them through :mod:`torch_dist_check.harness.placement` (``net``: one ``NCCL_HOSTID``
each; ``p2p``/``shm``: ``NCCL_MULTI_RANK_GPU_ENABLE=1``, NCCL >= 2.30, else skipped).

Figures per run (seconds from the victim's death): (a) ``exception_s``, the exception in the
survivor; ``detected_s``, the watcher's verdict; (b) ``fresh_group_s``, a fresh group with a
replacement process ran an exact all_reduce, and ``idle_abort_s``, how long aborting that idle
communicator then took; (c) ``b_longest_s`` and ``b_exact``, group B's longest iteration and
whether every B result was exact; (d) ``context_survived``, the survivor's device still computes
(None on CPU); (e) ``shrunk_group_s``, an exact all_reduce on the shrunk group. Issue 20's goals
(with the watcher, worst run: (a) <= 0.1 s, idle abort <= 0.02 s, (b) <= 1 s, (c) <= 0.1 s,
(e) <= 0.2 s) are reported per case; ``enforce_goals`` makes a miss a failure.
"""

from __future__ import annotations

import importlib.util
import os
import random
import secrets
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch_dist_check.checks.fault import WorkerProcess, describe_exit, wait_until
from torch_dist_check.harness import placement
from torch_dist_check.nodes.namespaces import DELAYLINE, NFTABLES, NodeNetwork, degrade_method
from torch_dist_check.peerloss import hsdp, trainjudge
from torch_dist_check.peerloss.train_worker import LOSS_RTOL
from torch_dist_check.peerloss.trainjudge import fields
from torch_dist_check.peerloss.worker import NODE_KINDS, OPS, PATTERNS
from torch_dist_check.report.results import FAIL, PASS, CheckResult

TRANSPORTS = ("p2p", "shm", "net")
KINDS = ("single", "two-world", "false-positive", "shrink", "train-shrink", "train-fresh", "train-hsdp")
# --peerloss-cases train: both ways a DDP job recovers.
KIND_ALIASES = {"train": ("train-shrink", "train-fresh")}
# The train cases' victim dies in one of these phases of a step, a different one each run.
TRAIN_PHASES = ("forward", "backward", "optimizer", "between")
WATCHER_MODES = ("on", "off")

# Issue 20's goals for the cases with the watcher (seconds, worst run).
GOALS = {"exception_s": 0.1, "idle_abort_s": 0.02, "fresh_group_s": 1.0, "b_longest_s": 0.1, "shrunk_group_s": 0.2}
# Issue 30's goal for the train cases, (f): the death to the first training step done on the new group.
TRAIN_GOALS = {"train-shrink": 0.5, "train-fresh": 1.5, "train-hsdp": hsdp.FIRST_STEP_WORST_GOAL_S}
# Issue 42's goal on the median too: replica A's first step alone (f) within 0.5 s of the death.
MEDIAN_GOALS = {"train-hsdp": {"first_step_s": hsdp.FIRST_STEP_MEDIAN_GOAL_S}}
# The goals each kind measures.
_KIND_GOALS = {
    "single": ("exception_s", "idle_abort_s", "fresh_group_s"),
    "two-world": ("exception_s", "idle_abort_s", "fresh_group_s", "b_longest_s"),
    "shrink": ("exception_s", "shrunk_group_s"),
    "train-shrink": ("first_step_s",),
    "train-fresh": ("first_step_s",),
    "train-hsdp": ("first_step_s",),
}
# Each kind's processes, and the GPU slot each takes when there are enough GPUs (the processes of
# one communicator never share a slot): the survivor GPU 0, the others GPU 1, shrink's victim GPU 2.
ROLES = {
    "single": (("survivor", 0), ("victim", 1), ("replacement", 1)),
    "two-world": (("survivor", 0), ("victim", 1), ("live", 1), ("replacement", 1)),
    "false-positive": (("survivor", 0), ("busy", 1)),
    "shrink": (("survivor", 0), ("partner", 1), ("victim", 2)),
    "train-shrink": (("survivor", 0), ("partner", 1), ("victim", 2)),
    "train-fresh": (("survivor", 0), ("partner", 1), ("victim", 2), ("replacement", 2)),
    "train-hsdp": hsdp.ROLES,
    # The node cases' replacement stands in for the lost peer in a fresh group with the survivor, on the
    # survivor's node: on another GPU than the survivor's, or NCCL refuses the group ("Duplicate GPU").
    "partition": (("survivor", 0), ("peer", 1), ("replacement", 1)),
    "node-kill": (("survivor", 0), ("peer", 1), ("replacement", 1)),
    "store-lost": (("survivor", 0), ("peer", 1), ("replacement", 1)),
    "lossy-link": (("survivor", 0), ("peer", 1)),
    "brief-cut": (("survivor", 0), ("peer", 1), ("replacement", 1)),
}
# A lossy link by default (issue 45): netem's loss (%) and delay (ms), each way.
LOSSY_LINK = (5.0, 50.0)
# The watcher's heartbeat timeout and interval when the settings leave them to the watcher (its defaults).
WATCHER_TIMEOUT_S = 5.0
WATCHER_INTERVAL_S = 1.0
# Issue 45's goal: a cut link is seen within the heartbeat timeout plus this, on both sides.
PARTITION_SLACK_S = 0.5
# brief-cut (issue 52): the cut comes this much later than kill_after_s at most, at random, so that it
# falls anywhere in an all_reduce or between two (the heartbeats start together: a fixed moment would
# test one phase of them).
CUT_MOMENT_JITTER_S = 1.0
# brief-cut: a random share of this (s, --peerloss-cut-jitter-s) lengthens each run's cut.
CUT_JITTER_S = 0.5
# brief-cut: beyond the cut and one heartbeat timeout and interval, how long a verdict may take to end the
# workers' loop: the store's host's peer claims an interval + 0.25 s after its verdict, a store call is
# waited on for 1 s at most, guard() waits 1 s for a verdict after an error; plus a margin for the host.
VERDICT_SETTLE_S = 3.0
# brief-cut: the words a run's outcome is counted by; the first two pass.
CUT_OUTCOMES = ("tolerated", "one side", "split brain", "nobody", "wrong side", "inexact", "late verdict", "hang", "error")
_RANDOM = random.SystemRandom()

_DROP_FROM_WORKER_ENV = ("NCCL_DEBUG_FILE", "TORCH_DIST_CHECK_NCCL_LOG", "RANK", "WORLD_SIZE", "LOCAL_RANK")
# Transport switches a case sets itself: inherited values would make "p2p" mean something else.
_TRANSPORT_ENV = ("NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "NCCL_IB_DISABLE", "NCCL_NET", "NCCL_SOCKET_IFNAME")
# ncclft's activation defaults (docs/pytorch-nccl-fault.md); a value in the environment wins.
_NCCL_DEFAULTS = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
    "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "0",
    "TORCH_NCCL_TRACE_BUFFER_SIZE": "0",
    # The heartbeat monitor would std::abort a process whose watchdog looks stuck.
    "TORCH_NCCL_ENABLE_MONITORING": "0",
    "NCCL_DEBUG": "WARN",
}


@dataclass(frozen=True)
class PeerLossCase:
    """One case: kind, backend, NCCL transport (None for gloo), op, and whether the watcher runs."""

    kind: str
    backend: str
    transport: str | None
    op: str
    watcher: bool

    @property
    def name(self) -> str:
        """The check name, e.g. peerloss/nccl/shm/sendrecv/watcher or peerloss/gloo/two-world/no-watcher."""
        parts = ["peerloss", self.backend, *([self.transport] if self.transport else [])]
        parts.append(self.op if self.kind == "single" else self.kind)
        if self.kind != "false-positive":
            parts.append("watcher" if self.watcher else "no-watcher")
        return "/".join(parts)


@dataclass(frozen=True)
class PeerLossSettings:
    """Bounds (seconds) and options of the peer-loss cases."""

    init_timeout_s: float = 120.0
    kill_after_s: float = 2.0
    signal: str = "kill"
    pattern: str = "wait"
    exception_timeout_s: float = 30.0
    recover_timeout_s: float = 60.0
    busy_s: float = 60.0
    b_period_s: float = 0.05
    b_window_s: float = 6.0
    heartbeat_s: float | None = None
    heartbeat_timeout_s: float | None = None
    runs: int = 1
    enforce_goals: bool = False
    train_kill_step: int = 5
    train_steps_after: int = 5
    train_width: int = 1024
    # The lossy-link case's loss (%) and delay (ms), each way.
    link_loss_pct: float = LOSSY_LINK[0]
    link_delay_ms: float = LOSSY_LINK[1]
    # The brief cut's length before its jitter (None: half the heartbeat timeout) and the jitter's bound.
    cut_s: float | None = None
    cut_jitter_s: float = CUT_JITTER_S
    extra_env: Mapping[str, str] = field(default_factory=dict)


def cases_for(
    backend: str, kinds: Sequence[str], transports: Sequence[str], ops: Sequence[str], watcher_modes: Sequence[str]
) -> list[PeerLossCase]:
    """The cases to run, in a stable order: single (transport x op x watcher), two-world, false positive, shrink."""
    nets: list[str | None] = list(transports) if backend == "nccl" else [None]
    modes = [mode == "on" for mode in watcher_modes]
    cases: list[PeerLossCase] = []
    if "single" in kinds:
        cases += [PeerLossCase("single", backend, net, op, w) for net in nets for op in ops for w in modes]
    if "two-world" in kinds:
        # One transport per backend for the two-world case: nothing forced (p2p) on NCCL.
        net = None if backend == "gloo" else ("p2p" if "p2p" in transports else nets[0])
        cases += [PeerLossCase("two-world", backend, net, "allreduce", w) for w in modes]
    if "false-positive" in kinds:
        net = None if backend == "gloo" else ("p2p" if "p2p" in transports else nets[0])
        cases.append(PeerLossCase("false-positive", backend, net, "allreduce", True))
    # Faults between nodes are judged by the watcher's verdicts: there is no case without it.
    cases += [PeerLossCase(kind, backend, None if backend == "gloo" else "net", "allreduce", True)
              for kind in NODE_KINDS if kind in kinds and "on" in watcher_modes]  # fmt: skip
    if "shrink" in kinds and "on" in watcher_modes:
        # The shrink follows the watcher's verdict: there is no case without it.
        net = None if backend == "gloo" else ("p2p" if "p2p" in transports else nets[0])
        cases.append(PeerLossCase("shrink", backend, net, "allreduce", True))
    for kind in ("train-shrink", "train-fresh", "train-hsdp"):
        if kind in kinds and "on" in watcher_modes:
            # A training job recovers through the watcher: there is no case without it.
            net = None if backend == "gloo" else ("p2p" if "p2p" in transports else nets[0])
            cases.append(PeerLossCase(kind, backend, net, "hsdp" if kind == "train-hsdp" else "ddp", True))
    return cases


def expand_kinds(kinds: Sequence[str]) -> list[str]:
    """The kinds, with ``train`` standing for both train cases."""
    out: list[str] = []
    for kind in kinds:
        for k in KIND_ALIASES.get(kind, (kind,)):
            if k not in out:
                out.append(k)
    return out


def case_placement(case: PeerLossCase, gpus: int, nccl_version: tuple[int, int, int] | None) -> placement.Placement | None:
    """Where the case's processes run (None for gloo: CPU only)."""
    if case.backend != "nccl":
        return None
    sharing = "net" if case.transport == "net" else "node"
    slots = [slot for _, slot in ROLES[case.kind]]
    return placement.place(gpus, slots, nccl_version, sharing, f"{socket.gethostname()}.peerloss")


def watcher_missing() -> str | None:
    """Why the watcher cases cannot run here, or None."""
    if importlib.util.find_spec("torch_peer_watcher") is None:
        return "torch_peer_watcher is not installed (conda install torch-peer-watcher)"
    return None


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


def role_nodes(kind: str, nodes: int) -> dict[str, int]:
    """The node each role of a case runs on: the survivor on node 0, the other roles on the other nodes
    in turn, a replacement on the node of the process it replaces (node 0 in the node cases, where it
    stands in for the peer the survivor lost)."""
    where: dict[str, int] = {}
    others = [role for role, _ in ROLES[kind] if role not in ("survivor", "replacement")]
    where["survivor"] = 0
    for i, role in enumerate(others):
        where[role] = 1 + i % (nodes - 1) if nodes > 1 else 0
    if any(role == "replacement" for role, _ in ROLES[kind]):
        where["replacement"] = 0 if kind in NODE_KINDS else where.get("victim", 0)
    return where


def heartbeat_timeout_s(settings: PeerLossSettings) -> float:
    """The watcher's heartbeat timeout in the cases."""
    return settings.heartbeat_timeout_s if settings.heartbeat_timeout_s is not None else WATCHER_TIMEOUT_S


def heartbeat_interval_s(settings: PeerLossSettings) -> float:
    """The watcher's heartbeat interval in the cases."""
    return settings.heartbeat_s if settings.heartbeat_s is not None else WATCHER_INTERVAL_S


def cut_length_s(settings: PeerLossSettings) -> float:
    """The brief cut's length before its random jitter: ``cut_s``, or half the heartbeat timeout."""
    return settings.cut_s if settings.cut_s is not None else heartbeat_timeout_s(settings) / 2


def brief_cut_loop_s(settings: PeerLossSettings) -> float:
    """How long the brief-cut workers run their all_reduces (from READY): past the latest cut, twice its
    longest length (TCP's retransmissions back off while the link is cut, so data may cross again only
    that long after the cut began), a heartbeat timeout and interval, and the verdict's settling."""
    longest_cut = cut_length_s(settings) + settings.cut_jitter_s
    return (settings.kill_after_s + CUT_MOMENT_JITTER_S + 2 * longest_cut + heartbeat_timeout_s(settings)
            + heartbeat_interval_s(settings) + VERDICT_SETTLE_S)  # fmt: skip


def _b_iters(settings: PeerLossSettings) -> int:
    return max(1, int((settings.kill_after_s + settings.b_window_s) / settings.b_period_s))


def _argv(role: str, case: PeerLossCase, settings: PeerLossSettings, rendezvous_dir: Path, device: int) -> list[str]:
    issue_for = settings.exception_timeout_s + settings.kill_after_s + 30
    if case.kind == "lossy-link":
        # The loop must outlast the heartbeat timeout twice over with the link lossy and slow.
        issue_for = settings.kill_after_s + 2 * heartbeat_timeout_s(settings) + 1
    elif case.kind == "brief-cut":
        issue_for = brief_cut_loop_s(settings)
    return [
        sys.executable, "-m", "torch_dist_check.peerloss.worker",
        "--role", role, "--kind", case.kind, "--backend", case.backend, "--op", case.op,
        "--watcher", "on" if case.watcher else "off", "--rendezvous-dir", str(rendezvous_dir), "--device", str(device),
        "--kill-after", str(settings.kill_after_s), "--signal", settings.signal, "--pattern", settings.pattern,
        "--issue-for", str(issue_for),
        "--b-iters", str(_b_iters(settings)), "--b-period", str(settings.b_period_s),
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


def _record_groups_closed(fig: dict[str, Any], survivor: WorkerProcess) -> None:
    """How many NCCL groups a failed send/recv had left open in the survivor's thread (closed by
    torch_peer_watcher.ncclgroups before it built another group)."""
    closed = survivor.event("NCCL_GROUPS")
    if closed:
        fig["nccl_groups_closed"] = int(fields(closed[1])["closed"])


@dataclass
class _Run:
    """One run's workers and figures."""

    workers: dict[str, WorkerProcess]
    figures: dict[str, Any] = field(default_factory=dict)

    def kill_all(self) -> None:
        for worker in self.workers.values():
            worker.kill()


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
                workers[role] = WorkerProcess(i, network.node_argv(node.index, argv), {**env, **node.env(), **seat.env})
            else:
                workers[role] = WorkerProcess(i, argv, {**env, **seat.env})
        run = _Run(workers)
        if network is not None:
            run.figures["nodes"] = dict(where)
        try:
            ok, reason = _judge_node(case, settings, run, network, where) if case.kind in NODE_KINDS else _judge(case, settings, run)
        finally:
            run.kill_all()
    if ok is False:
        run.figures["survivor_tail"] = run.workers["survivor"].tail()
        for role, worker in run.workers.items():
            if role != "survivor":
                run.figures[f"{role}_tail"] = worker.tail(10)
    return ok, reason, run.figures


def _judge(case: PeerLossCase, settings: PeerLossSettings, run: _Run) -> tuple[bool | None, str]:
    w, fig = run.workers, run.figures
    survivor = w["survivor"]

    def all_ready() -> bool:
        return all(x.event("READY") for x in w.values())

    def unsupported() -> bool:
        return bool(survivor.event("UNSUPPORTED"))

    if not wait_until(lambda: all_ready() or unsupported() or not all(x.alive() for x in w.values()), settings.init_timeout_s) \
            or not all_ready():  # fmt: skip
        # The marker may reach the reader a moment after the survivor's exit was seen.
        if wait_until(unsupported, 2.0):
            return None, survivor.event("UNSUPPORTED")[1]  # type: ignore[index]
        dead = [f"{role} {describe_exit(x.proc.returncode)}" for role, x in w.items() if not x.alive()]
        # A verdict before the fault (a train worker marks each) is why a setup broke: a live peer declared lost.
        early = [f"{role}: {x.event('LOSS')[1].split(' ', 1)[1]}" for role, x in w.items() if x.event("LOSS")]  # type: ignore[index]
        return False, (f"stage 'init' did not complete within {settings.init_timeout_s:.0f} s ({', '.join(dead) or 'no READY'})"
                       + (f"; a peer was declared lost before the fault: {'; '.join(early)}" if early else ""))  # fmt: skip
    if case.kind == "false-positive":
        return _judge_false_positive(settings, run)
    if case.kind == "shrink":
        return _judge_shrink(settings, run)
    if case.kind == "train-hsdp":
        return hsdp.judge(settings, run.workers, run.figures, settings.train_steps_after)
    if case.kind.startswith("train-"):
        return _judge_train(settings, run)

    victim = w["victim"]
    if not wait_until(lambda: bool(victim.event("KILL")), settings.kill_after_s + 30):
        return False, "stage 'kill': the victim did not reach its kill point"
    death = victim.event("KILL")[0]  # type: ignore[index]

    def settled() -> bool:
        return bool(survivor.event("CPU_OK") or survivor.event("NO_ERROR") or not survivor.alive())

    wait_until(settled, max(0.0, death + settings.exception_timeout_s - time.time()))
    caught = survivor.event("CAUGHT")
    fig["exception_s"] = round(caught[0] - death, 4) if caught else None
    fig["exception"] = caught[1] if caught else None
    if not survivor.event("CPU_OK"):
        if not survivor.alive():
            return False, f"(a) the survivor died ({describe_exit(survivor.proc.returncode)})"
        return False, f"(a) no exception within {settings.exception_timeout_s:.0f} s of the peer's death"

    wait_until(lambda: bool(survivor.event("FRESH_OK") or survivor.event("FRESH_FAILED") or survivor.event("FRESH_INEXACT")
                            or survivor.event("CONTEXT_LOST") or not survivor.alive()),
               max(0.0, death + settings.recover_timeout_s - time.time()))  # fmt: skip
    loss = survivor.event("LOSS")
    if loss:
        words = loss[1].split()
        fig["detected_s"] = round(float(words[0]) - death, 4)
        fig.update({k: v for k, v in fields(loss[1]).items() if k in ("abort_s", "groups", "cut")})
    _record_groups_closed(fig, survivor)
    trainjudge.record_context(survivor, fig)
    if survivor.event("CONTEXT_LOST"):
        fig["context_error"] = survivor.event("CONTEXT_LOST")[1]  # type: ignore[index]
        return False, f"(d) the CUDA context was lost: {fig['context_error'][:120]}"
    fresh = survivor.event("FRESH_OK")
    fig["fresh_group_s"] = round(fresh[0] - death, 4) if fresh else None
    if fresh and "idle_abort_s" in fields(fresh[1]):
        fig["idle_abort_s"] = round(float(fields(fresh[1])["idle_abort_s"]), 4)
    if not fresh:
        failed = survivor.event("FRESH_FAILED") or survivor.event("FRESH_INEXACT")
        why = failed[1] if failed else f"not within {settings.recover_timeout_s:.0f} s of the peer's death"
        return False, f"(b) the fresh group with a replacement failed: {why[:160]}"

    if case.kind == "two-world":
        live = w["live"]
        wait_until(lambda: bool(survivor.event("B_DONE") and live.event("B_DONE")), settings.b_window_s + settings.kill_after_s + 30)
        b_done = survivor.event("B_DONE")
        if not b_done:
            return False, "(c) group B's loop in the survivor did not finish"
        b = fields(b_done[1])
        fig["b_longest_s"] = round(float(b["longest_s"]), 4)
        fig["b_iterations"] = int(b["iterations"])
        fig["b_exact"] = b["inexact"] == "0" and b["error"] == "-" and fig["b_iterations"] == _b_iters(settings)
        if not fig["b_exact"]:
            return False, f"(c) group B broke: {b_done[1][:160]}"

    wait_until(lambda: not survivor.alive(), 15)
    if survivor.proc.returncode != 0:
        return False, f"survivor {describe_exit(survivor.proc.returncode)} after recovering"
    return True, _summary(fig)


def _judge_node(
    case: PeerLossCase, settings: PeerLossSettings, run: _Run, network: NodeNetwork | None, where: Mapping[str, int]
) -> tuple[bool, str]:
    """Bring the fault between the nodes, then: only the side that keeps the store trains on."""
    assert network is not None
    w, fig = run.workers, run.figures
    survivor, peer = w["survivor"], w["peer"]
    ready = wait_until(lambda: all(x.event("READY") for x in w.values()) or not all(x.alive() for x in w.values()),
                       settings.init_timeout_s)  # fmt: skip
    if not ready or not all(x.event("READY") for x in w.values()):
        dead = [f"{role} {describe_exit(x.proc.returncode)}" for role, x in w.items() if not x.alive()]
        return False, f"stage 'init' did not complete within {settings.init_timeout_s:.0f} s ({', '.join(dead) or 'no READY'})"
    time.sleep(settings.kill_after_s)
    if case.kind == "brief-cut":
        moment = _RANDOM.uniform(0.0, CUT_MOMENT_JITTER_S)
        fig["cut_after_s"] = round(settings.kill_after_s + moment, 4)
        time.sleep(moment)
    timeout = heartbeat_timeout_s(settings)
    fig["heartbeat_timeout_s"] = timeout
    lost_node = where["survivor"] if case.kind == "store-lost" else where["peer"]
    method = None
    if case.kind == "lossy-link":
        method, why_not = degrade_method(network, settings.link_delay_ms)
        if method is None:
            return False, f"the link cannot be made lossy here: {why_not}"
        fig["link"] = _link_words(settings, method)
    # Taken before the fault is brought, so that a figure is never shorter than the truth.
    fault_at = time.time()
    if case.kind in ("partition", "brief-cut"):
        network.cut(lost_node)
    elif method is not None:
        network.degrade(lost_node, settings.link_loss_pct, settings.link_delay_ms, method)
    else:
        for role, x in w.items():
            if where[role] == lost_node:
                x.kill()
    fig["fault_s"] = round(time.time() - fault_at, 4)
    healed = case.kind != "brief-cut"
    try:
        if case.kind == "brief-cut":
            target = cut_length_s(settings) + _RANDOM.uniform(0.0, settings.cut_jitter_s)
            fig["cut_target_s"] = round(target, 4)
            time.sleep(max(0.0, fault_at + target - time.time()))
            heal_at = time.time()
            network.heal(lost_node)
            healed = True
            # From before the cut to after the heal: never shorter than the truth (fault_s and heal_s say
            # how long each command took, the link was down for at least cut_s less both).
            fig["cut_s"] = round(time.time() - fault_at, 4)
            fig["heal_s"] = round(time.time() - heal_at, 4)
        return _node_outcome(case, settings, run, where, lost_node, fault_at)
    finally:
        # The next case gets the network whole again.
        if case.kind == "partition" or not healed:
            network.heal(lost_node)
        elif method is not None:
            network.undegrade(lost_node, method)


def _node_outcome(
    case: PeerLossCase, settings: PeerLossSettings, run: _Run, where: Mapping[str, int], lost_node: int, fault_at: float
) -> tuple[bool, str]:
    """Judge what each side did after the fault."""
    w, fig = run.workers, run.figures
    survivor, peer = w["survivor"], w["peer"]
    timeout = heartbeat_timeout_s(settings)

    def settled(x: WorkerProcess) -> bool:
        return bool(x.event("FRESH_OK") or x.event("FRESH_FAILED") or x.event("PARTITIONED") or x.event("TRAINS_ON")
                    or x.event("LOOP_DONE") or not x.alive())  # fmt: skip

    alive = [x for role, x in (("survivor", survivor), ("peer", peer))
             if where[role] != lost_node or case.kind in ("partition", "lossy-link", "brief-cut")]  # fmt: skip
    bound = settings.recover_timeout_s + (2 * timeout + 1 if case.kind == "lossy-link" else 0)
    if case.kind == "brief-cut":
        # A tolerated cut ends with the workers' loop.
        bound += brief_cut_loop_s(settings)
    wait_until(lambda: all(settled(x) for x in alive), bound)
    for role, x in (("survivor", survivor), ("peer", peer)):
        caught, loss = x.event("CAUGHT"), x.event("LOSS")
        key = "" if role == "survivor" else "peer_"
        fig[f"{key}exception_s"] = round(caught[0] - fault_at, 4) if caught else None
        fig[f"{key}exception"] = caught[1][:200] if caught else None
        fig[f"{key}detected_s"] = round(float(loss[1].split()[0]) - fault_at, 4) if loss else None
    fig["detect_goal_s"] = timeout + PARTITION_SLACK_S
    # Each side's device after the fault: the store's side probes it before its fresh group, the cut-off
    # side before it stops (None: that side did not get there).
    lost_context = []
    for role, key, x in (("survivor", "context_ok", survivor), ("peer", "peer_context_ok", peer)):
        fig[key] = False if x.event("CONTEXT_LOST") else (True if x.event("GPU_OK") else None)
        if fig[key] is False:
            lost_context.append(role)
    if lost_context:
        return False, f"(d) the device was lost on the {' and the '.join(lost_context)} side"
    fresh = survivor.event("FRESH_OK")
    fig["fresh_group_s"] = round(fresh[0] - fault_at, 4) if fresh else None
    if case.kind == "brief-cut":
        ok, fig["outcome"], reason = judge_brief_cut(_side(survivor), _side(peer))
        done = [fields(x.event("LOOP_DONE")[1]) for x in (survivor, peer) if x.event("LOOP_DONE")]  # type: ignore[index]
        if done:
            fig["iterations"] = int(done[0]["iterations"])
        return ok, f"cut {fig['cut_s']} s: {reason}"

    def took(x: WorkerProcess, error: str) -> bool:
        caught = x.event("CAUGHT")
        return bool(caught and caught[1].startswith(error))

    def why(role: str, x: WorkerProcess) -> str:
        caught = x.event("CAUGHT")
        if caught:
            return f"the {role} raised {caught[1][:160]}"
        return f"the {role} {describe_exit(x.proc.returncode) if not x.alive() else 'raised nothing in time'}"

    if case.kind == "lossy-link":
        done = [fields(x.event("LOOP_DONE")[1]) if x.event("LOOP_DONE") else None for x in (survivor, peer)]  # type: ignore[index]
        if not all(done):
            return False, f"a link with {fig['link']} broke the job: {why('survivor', survivor)}; {why('peer', peer)}"
        fig["iterations"] = int(done[0]["iterations"])  # type: ignore[index]
        fig["losses"] = sum(int(d["losses"]) for d in done)  # type: ignore[union-attr]
        fig["inexact"] = sum(int(d["inexact"]) for d in done)  # type: ignore[union-attr]
        # The longest all_reduce on either side: what the slow link cost one call.
        fig["slowest_all_reduce_s"] = max(float(d.get("slowest", 0)) for d in done)  # type: ignore[union-attr]
        if fig["losses"] or fig["inexact"]:
            return False, f"the slow link was declared dead ({fig['losses']} losses) or a result was inexact ({fig['inexact']})"
        return True, (f"{fig['link']} for {2 * timeout:g} s: {fig['iterations']} exact all_reduces (the "
                      f"slowest {fig['slowest_all_reduce_s']:g} s), no peer declared lost")  # fmt: skip
    if case.kind == "store-lost":
        if not (took(peer, "PartitionedError") and peer.event("PARTITIONED")):
            return False, f"node {lost_node} (the store's host) was lost, yet {why('peer', peer)}, not PartitionedError"
        return True, (f"store's node lost: the peer stopped with PartitionedError after {fig['peer_exception_s']} s "
                      f"(verdict {fig['peer_detected_s']} s); nobody trains on without the store")  # fmt: skip
    survivor_ok = took(survivor, "PeerLostError") and bool(fresh)
    if case.kind == "node-kill":
        if not survivor_ok:
            return False, f"node {lost_node} killed whole: {why('survivor', survivor)}; fresh group: {'exact' if fresh else 'none'}"
        return True, (f"node {lost_node} killed whole: (a) {fig['exception_s']} s PeerLostError, "
                      f"(b) fresh group exact {fig['fresh_group_s']} s")  # fmt: skip
    # partition
    peer_stopped = took(peer, "PartitionedError") and bool(peer.event("PARTITIONED"))
    if peer.event("TRAINS_ON") and survivor_ok:
        return False, f"split brain: both sides of the cut train on ({why('peer', peer)})"
    if not survivor_ok or not peer_stopped:
        return False, f"after the cut: {why('survivor', survivor)}, fresh group {'exact' if fresh else 'none'}; {why('peer', peer)}"
    late = [f"{role} {fig[key]} s" for role, key in (("survivor", "detected_s"), ("peer", "peer_detected_s"))
            if fig[key] is None or fig[key] > fig["detect_goal_s"]]  # fmt: skip
    fig["detected_within_goal"] = not late
    if late and settings.enforce_goals:
        return False, f"partition seen later than the heartbeat timeout + {PARTITION_SLACK_S} s ({fig['detect_goal_s']} s): {', '.join(late)}"
    return True, (f"link cut: the store's side saw it in {fig['detected_s']} s and trains on (fresh group exact "
                  f"{fig['fresh_group_s']} s); the cut side saw it in {fig['peer_detected_s']} s and stopped with "
                  f"PartitionedError (goal {fig['detect_goal_s']:g} s)")  # fmt: skip


@dataclass(frozen=True)
class Side:
    """What one side of a brief cut recorded: its marker events (name: (unix time, rest of the line)) and
    its exit status (None: still running when judged)."""

    events: Mapping[str, tuple[float, str]]
    exit: int | None


# The markers judge_brief_cut reads (peerloss_worker.node_case and fresh_group).
_CUT_MARKERS = ("CAUGHT", "INEXACT", "LOOP_DONE", "PARTITIONED", "TRAINS_ON", "FRESH_OK", "FRESH_FAILED", "FRESH_INEXACT")


def _side(x: WorkerProcess) -> Side:
    events = {name: e for name in _CUT_MARKERS if (e := x.event(name)) is not None}
    return Side(events, None if x.alive() else x.proc.returncode)


def _cut_state(role: str, side: Side) -> tuple[str, str]:
    """Where one side ended: ``loop`` (ran its all_reduces to the end), ``trains`` (PeerLostError, then the
    survivor's fresh group exact or the peer's TRAINS_ON), ``stopped`` (PartitionedError), ``failed`` or
    ``hung``; and the words that say so."""
    e = side.events
    caught = e.get("CAUGHT")
    exception = caught[1].split(":", 1)[0] if caught else None
    if "LOOP_DONE" in e:
        return "loop", f"the {role} ran its all_reduces to the end ({e['LOOP_DONE'][1]})"
    if exception == "PartitionedError" and "PARTITIONED" in e:
        return "stopped", f"the {role} stopped with PartitionedError"
    if exception == "PeerLostError":
        if role == "peer" and "TRAINS_ON" in e:
            return "trains", "the peer raised PeerLostError and trains on"
        if role == "survivor" and "FRESH_OK" in e:
            return "trains", "the survivor raised PeerLostError and its fresh group was exact"
        if "FRESH_FAILED" in e or "FRESH_INEXACT" in e:
            failed = e.get("FRESH_FAILED") or e["FRESH_INEXACT"]
            return "failed", f"the survivor raised PeerLostError, then its fresh group failed ({failed[1][:160] or 'inexact'})"
        if role == "survivor" and side.exit is None:
            return "hung", "the survivor raised PeerLostError, then its fresh group did not finish in time"
    if caught:
        still = "; still running" if side.exit is None else ""
        return "failed", f"the {role} raised {caught[1][:200]}{still}"
    if side.exit is None:
        return "hung", f"the {role} raised nothing and ran no loop to its end in time"
    return "failed", f"the {role} ended ({describe_exit(side.exit)}) without a result"


def judge_brief_cut(survivor: Side, peer: Side) -> tuple[bool, str, str]:
    """A cut that healed: (passed, outcome, reason). It passes if it was tolerated (no verdict on either
    side, every all_reduce exact) or left exactly one side training: the survivor (rank 0, the store's
    host) with PeerLostError and an exact fresh group, the peer stopped with PartitionedError. The outcome
    is one of :data:`CUT_OUTCOMES`."""
    (s_state, s_why), (p_state, p_why) = _cut_state("survivor", survivor), _cut_state("peer", peer)
    both = f"{s_why}; {p_why}"
    # A side that stopped with PartitionedError writes nothing: the step its stop cut short is void (on NCCL
    # the other side's abort can end it with partial data and no error before this side's verdict settles).
    inexact = [role for role, side, state in (("survivor", survivor, s_state), ("peer", peer, p_state))
               if "FRESH_INEXACT" in side.events or ("INEXACT" in side.events and state != "stopped")
               or ("LOOP_DONE" in side.events and fields(side.events["LOOP_DONE"][1]).get("inexact", "0") != "0")]  # fmt: skip
    if inexact:
        return False, "inexact", f"an all_reduce was inexact on the {' and the '.join(inexact)} side: {both}"
    if s_state == "trains" and p_state == "trains":
        return False, "split brain", f"split brain: both sides train on ({both})"
    if p_state == "trains":
        return False, "wrong side", f"the peer trains on while the store's host does not: {both}"
    if s_state == "stopped":
        return False, "nobody", f"nobody trains on while the store's host lives: {both}"
    if s_state == "loop" and p_state == "loop":
        losses = sum(int(fields(side.events["LOOP_DONE"][1]).get("losses", "0")) for side in (survivor, peer))
        if losses:
            return False, "late verdict", f"both loops ran to the end, yet {losses} verdict(s) came after: {both}"
        return True, "tolerated", "tolerated: no verdict on either side, every all_reduce exact"
    if s_state == "trains" and p_state == "stopped":
        return True, "one side", "one side trains on: the survivor (the store's host) PeerLostError and an exact fresh group, the peer PartitionedError"
    if "hung" in (s_state, p_state):
        return False, "hang", both
    return False, "error", both


def _judge_shrink(settings: PeerLossSettings, run: _Run) -> tuple[bool, str]:
    """Both survivors caught PeerLostError and ran an exact all_reduce on the shrunk group."""
    w, fig = run.workers, run.figures
    survivor, partner, victim = w["survivor"], w["partner"], w["victim"]
    if not wait_until(lambda: bool(victim.event("KILL")), settings.kill_after_s + 30):
        return False, "stage 'kill': the victim did not reach its kill point"
    death = victim.event("KILL")[0]  # type: ignore[index]

    def done(x: WorkerProcess) -> bool:
        return bool(x.event("SHRUNK_OK") or x.event("SHRUNK_INEXACT") or x.event("SHRINK_FAILED") or x.event("NO_ERROR")
                    or not x.alive())  # fmt: skip

    wait_until(lambda: done(survivor) and done(partner), max(0.0, death + settings.recover_timeout_s - time.time()))
    caught = survivor.event("CAUGHT")
    fig["exception_s"] = round(caught[0] - death, 4) if caught else None
    fig["exception"] = caught[1] if caught else None
    loss = survivor.event("LOSS")
    if loss:
        fig["detected_s"] = round(float(loss[1].split()[0]) - death, 4)
        fig.update({k: v for k, v in fields(loss[1]).items() if k in ("abort_s", "groups", "shrunk", "errors")})
    _record_groups_closed(fig, survivor)
    got = survivor.event("SHRUNK_GOT")
    # When shrunk() handed the survivor its shrunk group; (e) less this is the group's first all_reduce.
    fig["shrink_returned_s"] = round(got[0] - death, 4) if got else None
    shrunk = survivor.event("SHRUNK_OK")
    fig["shrunk_group_s"] = round(shrunk[0] - death, 4) if shrunk else None
    if not caught:
        return False, f"(a) no exception within {settings.recover_timeout_s:.0f} s of the peer's death"
    if not caught[1].startswith("PeerLostError"):
        return False, f"(a) the survivor's op raised {caught[1][:160]}, not PeerLostError"
    for role, x in (("survivor", survivor), ("partner", partner)):
        if not x.event("SHRUNK_OK"):
            failed = x.event("SHRINK_FAILED") or x.event("SHRUNK_INEXACT")
            why = failed[1] if failed else describe_exit(x.proc.returncode) if not x.alive() else "no result"
            return False, f"(e) the {role}'s shrunk group failed: {why[:160]}"
    wait_until(lambda: not survivor.alive() and not partner.alive(), 15)
    # The survivor probes its device after SHRUNK_OK: read the mark once it has exited, not before.
    trainjudge.record_context(survivor, fig)
    if survivor.proc.returncode != 0 or partner.proc.returncode != 0:
        return False, f"survivor {describe_exit(survivor.proc.returncode)}, partner {describe_exit(partner.proc.returncode)} after the shrink"
    parts = [f"(a) {fig['exception_s']} s PeerLostError"]
    if fig.get("detected_s") is not None:
        parts.append(f"seen {fig['detected_s']} s")
    parts.append(f"(e) shrunk group exact {fig['shrunk_group_s']} s")
    parts.append("(d) context intact" if fig.get("context_survived") else "(d) cpu")
    return True, "; ".join(parts)


def _judge_train(settings: PeerLossSettings, run: _Run) -> tuple[bool, str]:
    """The survivors (and the replacement) caught PeerLostError, recovered, trained on, and agree."""
    w, fig = run.workers, run.figures
    trainers = {role: x for role, x in w.items() if role != "victim"}
    killed = trainjudge.await_trainers(settings, w["victim"], trainers, "TRAIN_DONE", fig)
    if isinstance(killed, str):
        return False, killed
    death, phase = killed
    # Modules the ranks still imported with the watcher running (its heartbeats wait for the GIL meanwhile).
    fig["imports_watched"] = max(int(fields(x.event("READY")[1]).get("imports_watched", 0)) for x in w.values())  # type: ignore[index]
    survivor = w["survivor"]
    not_caught = trainjudge.survivor_caught(settings, survivor, death, phase, fig)
    ready = survivor.event("GROUP_READY")
    fig["group_ready_s"] = round(ready[0] - death, 4) if ready else None
    if ready and "how=" in ready[1]:
        # "shrunk", or "rebuilt" (from the store) where a member's shrink failed, and why.
        fig["shrink_way"] = fields(ready[1]).get("how")
        fig["rebuilt_because"] = ready[1].split("how=rebuilt", 1)[1].strip()[:300] if fig["shrink_way"] == "rebuilt" else None
    # (f): the death to the first training step finished on the new group, the slowest rank's.
    firsts = [x.event("FIRST_STEP") for x in trainers.values()]
    fig["first_step_s"] = round(max(f[0] for f in firsts) - death, 4) if all(firsts) else None
    if not_caught:
        return False, not_caught
    results = trainjudge.results(trainers, "TRAIN_DONE", "(f) the {role} did not train on after the loss (victim died in {phase}): {why}", phase)
    if isinstance(results, str):
        return False, results
    digests = {role: r["digest"] for role, r in results.items()}
    fig["params_equal"] = len(set(digests.values())) == 1
    fig["loss_finite"] = all(r["finite"] == "True" for r in results.values())
    fig["loss_worst_rel"] = max(float(r["worst_rel"]) for r in results.values())
    fig["world_after"] = int(results["survivor"]["world"])
    fig["losses"] = {role: r["losses"] for role, r in results.items()}
    fig["reference"] = {role: r["reference"] for role, r in results.items()}
    trainjudge.record_context(survivor, fig)
    if not fig["params_equal"]:
        return False, f"the ranks' parameters differ after training on: {digests}"
    if not fig["loss_finite"] or fig["loss_worst_rel"] > LOSS_RTOL:
        return False, f"the loss left the uninterrupted run's path: finite={fig['loss_finite']}, worst relative gap {fig['loss_worst_rel']:.2e}"
    if exited := trainjudge.exits_failure(trainers):
        return False, exited
    parts = [f"victim died in {phase}", f"(a) {fig['exception_s']} s PeerLostError",
             f"(f) first step on {fig['world_after']} ranks {fig['first_step_s']} s",
             f"parameters equal, loss on the full-batch path (worst {fig['loss_worst_rel']:.1e})",
             "(d) context intact" if fig.get("context_survived") else "(d) cpu"]  # fmt: skip
    return True, "; ".join(parts)


def _judge_false_positive(settings: PeerLossSettings, run: _Run) -> tuple[bool, str]:
    survivor, busy = run.workers["survivor"], run.workers["busy"]
    fig = run.figures
    wait_until(lambda: bool(survivor.event("FP_DONE") or survivor.event("FP_FAILED") or not survivor.alive()),
               settings.busy_s + 60)  # fmt: skip
    wait_until(lambda: bool(busy.event("BUSY_DONE")) or not busy.alive(), 15)
    done, busy_done = survivor.event("FP_DONE"), busy.event("BUSY_DONE")
    if not done:
        failed = survivor.event("FP_FAILED")
        return False, f"false positive: the survivor's all_reduce failed: {failed[1][:160] if failed else 'no result'}"
    said = fields(done[1])
    fig["busy_s"] = settings.busy_s
    fig["waited_s"] = float(said["waited_s"])
    fig["exact"] = said["exact"] == "True"
    fig["losses"] = int(said["losses"]) + (int(fields(busy_done[1])["losses"]) if busy_done else 0)
    if not busy_done:
        return False, "the busy peer did not finish its all_reduce"
    if not fig["exact"] or fig["losses"]:
        return False, f"false positive: exact={fig['exact']}, losses declared={fig['losses']}"
    return True, f"peer busy {settings.busy_s:g} s, survivor waited {fig['waited_s']:.1f} s in all_reduce: exact, nothing lost"


def _summary(fig: Mapping[str, Any]) -> str:
    parts = [f"(a) {fig['exception_s']} s"]
    if fig.get("detected_s") is not None:
        parts.append(f"seen {fig['detected_s']} s")
    parts.append(f"(b) {fig['fresh_group_s']} s")
    if fig.get("idle_abort_s") is not None:
        parts.append(f"idle abort {fig['idle_abort_s']} s")
    if "b_longest_s" in fig:
        parts.append(f"(c) B longest {fig['b_longest_s']} s, exact")
    parts.append("(d) context intact" if fig.get("context_survived") else "(d) cpu")
    if fig.get("nccl_groups_closed"):
        parts.append(f"{fig['nccl_groups_closed']} NCCL group(s) a failed send/recv left open closed")
    return "; ".join(parts)


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
    if case.kind == "brief-cut":
        details["outcomes"] = {word: n for word in CUT_OUTCOMES if (n := sum(r.get("outcome") == word for r in runs))}
    elif case.watcher and case.kind != "false-positive":
        details["goals"] = goals_met(details["summary"], case)
    status = PASS if not failures else FAIL
    if status == PASS and settings.enforce_goals and details.get("goals") and case.kind not in NODE_KINDS:
        missed = [name for name, met in details["goals"].items() if met is False]
        if missed:
            status = FAIL
            failures.append("goal missed: " + ", ".join(_missed(details["summary"], case.kind, n) for n in missed))
    reason = "; ".join(failures) if failures else (runs[0]["reason"] if len(runs) == 1 else _worst_line(details["summary"]))
    if case.kind == "brief-cut" and len(runs) > 1:
        reason = _cut_line(details["outcomes"], runs) + ("; " + reason if failures else "")
    if seats is not None:
        reason += f" [placement {seats.kind}]"
    return CheckResult(case.name, status, reason, details, time.monotonic() - started)


def summarize(runs: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, float]]:
    """Median and worst of each figure over the runs that produced it."""
    summary = {}
    for name in ("exception_s", "detected_s", "idle_abort_s", "fresh_group_s", "b_longest_s", "shrink_returned_s", "shrunk_group_s",
                 "waited_s", "group_ready_s", "first_step_s", "transfer_s", "join_s", "alone_steps", "agree_after_steps",
                 "peer_exception_s", "peer_detected_s", "cut_s"):
        values = [float(r[name]) for r in runs if r.get(name) is not None]
        if values:
            summary[name] = {"median": round(statistics.median(values), 4), "worst": round(max(values), 4), "n": len(values)}
    return summary


def goals_met(summary: Mapping[str, Mapping[str, float]], case: PeerLossCase) -> dict[str, bool | None]:
    """Each goal against the worst run (None where the figure does not apply)."""
    met: dict[str, bool | None] = {}
    for name in _KIND_GOALS.get(case.kind, ()):
        met[name] = summary[name]["worst"] <= goal_for(case.kind, name) if name in summary else None
    for name, goal in MEDIAN_GOALS.get(case.kind, {}).items():
        met[f"{name}_median"] = summary[name]["median"] <= goal if name in summary else None
    return met


def _missed(summary: Mapping[str, Mapping[str, float]], kind: str, name: str) -> str:
    if name.endswith("_median"):
        figure = name.removesuffix("_median")
        return f"{figure} median {summary[figure]['median']} > {MEDIAN_GOALS[kind][figure]}"
    return f"{name} worst {summary[name]['worst']} > {goal_for(kind, name)}"


def goal_for(kind: str, name: str) -> float:
    """The goal (seconds, worst run) of figure ``name`` in a case of ``kind``."""
    return TRAIN_GOALS[kind] if name == "first_step_s" else GOALS[name]


def _worst_line(summary: Mapping[str, Mapping[str, float]]) -> str:
    return "; ".join(f"{name} median {v['median']} worst {v['worst']} (n={v['n']})" for name, v in summary.items())


def _cut_line(outcomes: Mapping[str, int], runs: Sequence[Mapping[str, Any]]) -> str:
    """'20 runs: 12 tolerated, 8 one side; cut 0.51-0.99 s'."""
    cuts = [float(r["cut_s"]) for r in runs if r.get("cut_s") is not None]
    span = f"; cut {min(cuts):.2f}-{max(cuts):.2f} s" if cuts else ""
    return f"{len(runs)} runs: " + ", ".join(f"{n} {word}" for word, n in outcomes.items()) + span


def _link_words(settings: PeerLossSettings, method: str) -> str:
    """The lossy link as the report says it: '5% loss and 50 ms delay each way (netem)'."""
    delay = f" and {settings.link_delay_ms:g} ms delay" if settings.link_delay_ms else ""
    how = {NFTABLES: "nftables, no delay: the kernel has no netem", DELAYLINE: "a delay line: the kernel has no netem"}.get(method, method)
    return f"{settings.link_loss_pct:g}% loss{delay} each way ({how})"


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
