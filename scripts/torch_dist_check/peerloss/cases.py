"""Peer loss: how fast and how cleanly a process recovers when a peer of one of its groups dies.

This module says which cases there are, what they take (settings, roles, time bounds) and their goals;
:mod:`torch_dist_check.peerloss.runner` starts their processes, :mod:`torch_dist_check.peerloss.judges` judges a run.

Cases (each started fresh, workers from :mod:`torch_dist_check.peerloss.worker`):
- ``single``: survivor and victim in one group; the victim dies (SIGKILL, or SIGSTOP: alive but
  stuck) while both run the op (all_reduce, send/recv, or one coalesced all_reduce) in the
  survivor's pattern (``wait``, ``enqueue``, ``poll``: :func:`torch_dist_check.peerloss.worker._op`). NCCL runs
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
survivor; ``detected_s``, the watcher's verdict; ``closed_s``, when the victim ended (its files, its connections, closed
just before; a SIGKILLed process's once the kernel has torn it down); (b) ``fresh_group_s``, a fresh group with a
replacement process ran an exact all_reduce, and ``idle_abort_s``, how long aborting that idle
communicator then took; (c) ``b_longest_s`` and ``b_exact``, group B's longest iteration and
whether every B result was exact; (d) ``context_survived``, the survivor's device still computes
(None on CPU); (e) ``shrunk_group_s``, an exact all_reduce on the shrunk group. Issue 20's goals
(with the watcher, worst run: (a) <= 0.1 s, idle abort <= 0.02 s, (b) <= 1 s, (c) <= 0.1 s,
(e) <= 0.2 s) are reported per case; ``enforce_goals`` makes a miss a failure.
"""

from __future__ import annotations

import importlib.util
import socket
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch_dist_check.checks.fault import WorkerProcess
from torch_dist_check.harness import placement
from torch_dist_check.peerloss import hsdp
# The workers' choices, for the command line's options: NODE_KINDS, OPS, PATTERNS.
from torch_dist_check.peerloss.worker import NODE_KINDS, OPS, PATTERNS  # noqa: F401

TRANSPORTS = ("p2p", "shm", "net")
KINDS = ("single", "two-world", "false-positive", "shrink", "train-shrink", "train-fresh", "train-hsdp")
# --peerloss-cases train: both ways a DDP job recovers.
KIND_ALIASES = {"train": ("train-shrink", "train-fresh")}
# The train cases' victim dies in one of these phases of a step, a different one each run.
TRAIN_PHASES = ("forward", "backward", "optimizer", "between")
WATCHER_MODES = ("on", "off")
# flavor: the workers get pytorch-nccl-fault's activation defaults (TORCH_NCCL_ASYNC_ERROR_HANDLING=2 and the
# rest, where the environment does not name them); pytorch: those variables are taken out of the workers'
# environment, so that PyTorch's defaults hold until the watcher (imported before the first group) sets its own.
NCCL_SETTINGS = ("flavor", "pytorch")

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
    "heal-stop": (("survivor", 0), ("peer", 1), ("replacement", 1)),
}
# heal-stop (issue 68): node 1's sends are lost this long before its link is cut both ways, so that the
# store's side judges first and the peer's own deadline comes later; the cut heals as the store's side
# raises, and that side stops its watcher before its fresh group.
HEAL_STOP_ONE_WAY_S = 0.45
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
    # Whose NCCL settings the NCCL workers run under (NCCL_SETTINGS): the flavor's activation defaults, or
    # PyTorch's own, as a torch-peer-watcher user next to a stock PyTorch has them.
    nccl_settings: str = "flavor"


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


def b_iters(settings: PeerLossSettings) -> int:
    return max(1, int((settings.kill_after_s + settings.b_window_s) / settings.b_period_s))


@dataclass
class CaseRun:
    """One run's workers and figures."""

    workers: dict[str, WorkerProcess]
    figures: dict[str, Any] = field(default_factory=dict)

    def kill_all(self) -> None:
        for worker in self.workers.values():
            worker.kill()


def summarize(runs: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, float]]:
    """Median and worst of each figure over the runs that produced it."""
    summary = {}
    for name in ("exception_s", "detected_s", "idle_abort_s", "fresh_group_s", "b_longest_s", "shrink_returned_s", "shrunk_group_s",
                 "waited_s", "group_ready_s", "ddp_ready_s", "state_shared_s", "first_step_s", "transfer_s", "join_s", "alone_steps", "agree_after_steps",
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


def missed_goal(summary: Mapping[str, Mapping[str, float]], kind: str, name: str) -> str:
    if name.endswith("_median"):
        figure = name.removesuffix("_median")
        return f"{figure} median {summary[figure]['median']} > {MEDIAN_GOALS[kind][figure]}"
    return f"{name} worst {summary[name]['worst']} > {goal_for(kind, name)}"


def goal_for(kind: str, name: str) -> float:
    """The goal (seconds, worst run) of figure ``name`` in a case of ``kind``."""
    return TRAIN_GOALS[kind] if name == "first_step_s" else GOALS[name]
