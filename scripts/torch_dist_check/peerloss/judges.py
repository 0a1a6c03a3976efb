"""The judges of the peer-loss cases: from what a run's processes printed and how they ended, whether
the case passed and why (:func:`judge`; a node case's sides by :func:`judge_node`, a cut that heals by
:func:`judge_brief_cut`). The cases themselves are :mod:`torch_dist_check.peerloss.cases`.
"""

from __future__ import annotations

import random
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch_dist_check.checks.fault import WorkerProcess, describe_exit, wait_until
from torch_dist_check.nodes.namespaces import DELAYLINE, NFTABLES, NodeNetwork, degrade_method, nftables_reason
from torch_dist_check.peerloss import hsdp, trainjudge
from torch_dist_check.peerloss.cases import (
    CUT_MOMENT_JITTER_S,
    HEAL_STOP_ONE_WAY_S,
    PARTITION_SLACK_S,
    VERDICT_SETTLE_S,
    CaseRun,
    PeerLossCase,
    PeerLossSettings,
    b_iters,
    brief_cut_loop_s,
    cut_length_s,
    heartbeat_timeout_s,
)
from torch_dist_check.peerloss.train_worker import LOSS_RTOL
from torch_dist_check.peerloss.trainjudge import fields, record_hang

_RANDOM = random.SystemRandom()


def _record_groups_closed(fig: dict[str, Any], survivor: WorkerProcess) -> None:
    """How many NCCL groups a failed send/recv had left open in the survivor's thread (closed by
    torch_peer_watcher.ncclgroups before it built another group)."""
    closed = survivor.event("NCCL_GROUPS")
    if closed:
        fig["nccl_groups_closed"] = int(fields(closed[1])["closed"])


def judge(case: PeerLossCase, settings: PeerLossSettings, run: CaseRun) -> tuple[bool | None, str]:
    w, fig = run.workers, run.figures
    survivor = w["survivor"]

    def all_ready() -> bool:
        return all(x.event("READY") for x in w.values())

    def unsupported() -> bool:
        return bool(survivor.event("UNSUPPORTED"))

    # A READY marker may reach its reader a moment after another worker's exit was seen (a busy machine).
    if not wait_until(lambda: all_ready() or unsupported() or not all(x.alive() for x in w.values()), settings.init_timeout_s) \
            or not wait_until(all_ready, 1.0):  # fmt: skip
        # The marker may reach the reader a moment after the survivor's exit was seen.
        if wait_until(unsupported, 2.0):
            return None, survivor.event("UNSUPPORTED")[1]  # type: ignore[index]
        dead = [f"{role} {describe_exit(x.proc)}" for role, x in w.items() if not x.alive()]
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
            return False, f"(a) the survivor died ({describe_exit(survivor.proc)})"
        return False, f"(a) no exception within {settings.exception_timeout_s:.0f} s of the peer's death"

    wait_until(lambda: bool(survivor.event("FRESH_OK") or survivor.event("FRESH_FAILED") or survivor.event("FRESH_INEXACT")
                            or survivor.event("CONTEXT_LOST") or not survivor.alive()),
               max(0.0, death + settings.recover_timeout_s - time.time()))  # fmt: skip
    loss = survivor.event("LOSS")
    if loss:
        words = loss[1].split()
        fig["detected_s"] = round(float(words[0]) - death, 4)
        fig.update({k: v for k, v in fields(loss[1]).items() if k in ("abort_s", "groups", "cut", "silent_s")})
    if settings.signal == "kill":  # (a SIGSTOPped victim has not ended)
        wait_until(lambda: victim.ended_at is not None, 2.0)  # long since, as a rule: the survivor has recovered by now
    if victim.ended_at is not None:
        # When the victim ended, its files (its connections) closed just before: a SIGKILLed process's only once the
        # kernel has torn it down, which on a busy host can take a second; the closed connection's verdict counts from here.
        fig["closed_s"] = round(victim.ended_at - death, 4)
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
        fig["b_exact"] = b["inexact"] == "0" and b["error"] == "-" and fig["b_iterations"] == b_iters(settings)
        if not fig["b_exact"]:
            return False, f"(c) group B broke: {b_done[1][:160]}"

    wait_until(lambda: not survivor.alive(), 15)
    if survivor.proc.returncode != 0:
        return False, f"survivor {describe_exit(survivor.proc)} after recovering"
    return True, _summary(fig)


def judge_node(
    case: PeerLossCase, settings: PeerLossSettings, run: CaseRun, network: NodeNetwork | None, where: Mapping[str, int]
) -> tuple[bool, str]:
    """Bring the fault between the nodes, then: only the side that keeps the store trains on."""
    assert network is not None
    w, fig = run.workers, run.figures
    survivor, peer = w["survivor"], w["peer"]
    ready = wait_until(lambda: all(x.event("READY") for x in w.values()) or not all(x.alive() for x in w.values()),
                       settings.init_timeout_s)  # fmt: skip
    if not ready or not all(x.event("READY") for x in w.values()):
        dead = [f"{role} {describe_exit(x.proc)}" for role, x in w.items() if not x.alive()]
        return False, f"stage 'init' did not complete within {settings.init_timeout_s:.0f} s ({', '.join(dead) or 'no READY'})"
    time.sleep(settings.kill_after_s)
    if case.kind == "brief-cut":
        moment = _RANDOM.uniform(0.0, CUT_MOMENT_JITTER_S)
        fig["cut_after_s"] = round(settings.kill_after_s + moment, 4)
        time.sleep(moment)
    timeout = heartbeat_timeout_s(settings)
    fig["heartbeat_timeout_s"] = timeout
    lost_node = where["survivor"] if case.kind == "store-lost" else where["peer"]
    if case.kind == "heal-stop":
        return _heal_stop(case, settings, run, network, where, lost_node)
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


def _heal_stop(
    case: PeerLossCase, settings: PeerLossSettings, run: CaseRun, network: NodeNetwork, where: Mapping[str, int], lost_node: int
) -> tuple[bool, str]:
    """Issue 68's targeted healed cut: node ``lost_node``'s sends are lost, its link is cut both ways
    :data:`HEAL_STOP_ONE_WAY_S` later, and the cut heals as the store's side raises (that side then stops its
    watcher): exactly one side must train on."""
    why_not = nftables_reason(network)
    if why_not:
        return False, f"node {lost_node}'s sends cannot be dropped alone here: {why_not}"
    survivor, fig = run.workers["survivor"], run.figures
    moment = _RANDOM.uniform(0.0, CUT_MOMENT_JITTER_S)
    fig["cut_after_s"] = round(settings.kill_after_s + moment, 4)
    time.sleep(moment)
    fault_at = time.time()
    network.drop_sent_by(lost_node)
    dropped, cut = True, False
    try:
        time.sleep(HEAL_STOP_ONE_WAY_S)
        network.cut(lost_node)
        cut = True
        wait_until(lambda: bool(survivor.event("CAUGHT")) or not survivor.alive(),
                   heartbeat_timeout_s(settings) + VERDICT_SETTLE_S + settings.exception_timeout_s)  # fmt: skip
        network.heal(lost_node)
        cut = False
        network.undrop_sent_by(lost_node)
        dropped = False
        fig["cut_s"] = round(time.time() - fault_at, 4)
        return _node_outcome(case, settings, run, where, lost_node, fault_at)
    finally:
        # The next case gets the network whole again.
        if cut:
            network.heal(lost_node)
        if dropped:
            network.undrop_sent_by(lost_node)


def _node_outcome(
    case: PeerLossCase, settings: PeerLossSettings, run: CaseRun, where: Mapping[str, int], lost_node: int, fault_at: float
) -> tuple[bool, str]:
    """Judge what each side did after the fault."""
    w, fig = run.workers, run.figures
    survivor, peer = w["survivor"], w["peer"]
    timeout = heartbeat_timeout_s(settings)

    def settled(x: WorkerProcess) -> bool:
        return bool(x.event("FRESH_OK") or x.event("FRESH_FAILED") or x.event("PARTITIONED") or x.event("TRAINS_ON")
                    or x.event("LOOP_DONE") or not x.alive())  # fmt: skip

    alive = [x for role, x in (("survivor", survivor), ("peer", peer))
             if where[role] != lost_node or case.kind in ("partition", "lossy-link", "brief-cut", "heal-stop")]  # fmt: skip
    bound = settings.recover_timeout_s + (2 * timeout + 1 if case.kind == "lossy-link" else 0)
    if case.kind in ("brief-cut", "heal-stop"):
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
    ready = survivor.event("READY")
    # The world's op timeout: on gloo, what ends an op gloo never wakes (worker.NODE_GLOO_TIMEOUT_S).
    fig["group_timeout_s"] = fields(ready[1]).get("group_timeout_s") if ready else None
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
    if case.kind in ("brief-cut", "heal-stop"):
        ok, fig["outcome"], reason = judge_brief_cut(_side(survivor), _side(peer))
        if fig["outcome"] == "hang":
            fig["waited_s"] = round(bound, 3)
            record_hang(fig, {"survivor": survivor, "peer": peer}, fault_at)
            reason += f" (waited {bound:.1f} s; each side's markers, last lines and threads' stacks are in the run's details)"
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
        return f"the {role} {describe_exit(x.proc) if not x.alive() else 'raised nothing in time'}"

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


def _judge_shrink(settings: PeerLossSettings, run: CaseRun) -> tuple[bool, str]:
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
            why = failed[1] if failed else describe_exit(x.proc) if not x.alive() else "no result"
            return False, f"(e) the {role}'s shrunk group failed: {why[:160]}"
    wait_until(lambda: not survivor.alive() and not partner.alive(), 15)
    # The survivor probes its device after SHRUNK_OK: read the mark once it has exited, not before.
    trainjudge.record_context(survivor, fig)
    if survivor.proc.returncode != 0 or partner.proc.returncode != 0:
        return False, f"survivor {describe_exit(survivor.proc)}, partner {describe_exit(partner.proc)} after the shrink"
    parts = [f"(a) {fig['exception_s']} s PeerLostError"]
    if fig.get("detected_s") is not None:
        parts.append(f"seen {fig['detected_s']} s")
    parts.append(f"(e) shrunk group exact {fig['shrunk_group_s']} s")
    parts.append("(d) context intact" if fig.get("context_survived") else "(d) cpu")
    return True, "; ".join(parts)


def _judge_train(settings: PeerLossSettings, run: CaseRun) -> tuple[bool, str]:
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
    standby = w["replacement"].event("READY") if "replacement" in w else None  # train-fresh: warmed up, then READY
    if standby:
        fig["standby_warm_s"] = float(fields(standby[1]).get("warm_s", "nan"))
        fig["standby_ready_before_death_s"] = round(death - standby[0], 4)
    not_caught = trainjudge.survivor_caught(settings, survivor, death, phase, fig)
    ready = survivor.event("GROUP_READY")
    fig["group_ready_s"] = round(ready[0] - death, 4) if ready else None
    # DDP rebuilt on the new group: its construction's broadcast made the group's communicator (NCCL's setup).
    ddp_ready = survivor.event("DDP_READY")
    fig["ddp_ready_s"] = round(ddp_ready[0] - death, 4) if ddp_ready else None
    shared = survivor.event("STATE_SHARED")  # train-fresh: the momentum and the step broadcast to the replacement
    fig["state_shared_s"] = round(shared[0] - death, 4) if shared else None
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
    fig["release_wakes"] = int(results["survivor"].get("release_wakes", 0))
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


def _judge_false_positive(settings: PeerLossSettings, run: CaseRun) -> tuple[bool, str]:
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


def _link_words(settings: PeerLossSettings, method: str) -> str:
    """The lossy link as the report says it: '5% loss and 50 ms delay each way (netem)'."""
    delay = f" and {settings.link_delay_ms:g} ms delay" if settings.link_delay_ms else ""
    how = {NFTABLES: "nftables, no delay: the kernel has no netem", DELAYLINE: "a delay line: the kernel has no netem"}.get(method, method)
    return f"{settings.link_loss_pct:g}% loss{delay} each way ({how})"
