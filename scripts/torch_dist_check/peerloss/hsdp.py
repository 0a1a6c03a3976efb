"""The peer-loss ``train-hsdp`` case, launcher side: argv of its workers and the judge of one run.

The workers are :mod:`torch_dist_check.peerloss.hsdp_worker` (the job: 2 replicas x 2 shards, the victim rank 3
SIGKILLed, replica A trains on alone, replica B comes back with a replacement). Figures per run
(seconds): (a) ``exception_s``, the survivor's PeerLostError after the death; (f) ``first_step_s``,
the death to the first step replica A finished alone (its slower rank); ``join_s``, the
replacement's start (the scheduler's cue) to the first step the four ranks finished together;
``transfer_s``, that start to the four ranks holding the shards; ``agree_after_steps``, the joint
steps after which all four digests first agreed (0: right after the transfer); ``replay_equal``,
every rank's parameters bitwise equal to the one-process replay (replica A's also at the end of its
steps alone). Goals (issue 42): (f) median <= 0.5 s and worst <= 1 s; agreement within 2 steps.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from torch_dist_check.checks.fault import WorkerProcess
from torch_dist_check.peerloss import trainjudge
from torch_dist_check.peerloss.trainjudge import fields

# The join's stages in order, as the workers mark them (hsdp_worker), each named for the work that ends
# there: the four at the fresh store (the survivors see the spare at a step boundary), the old world left
# (watcher stopped, communicators aborted), the new world's init_process_group, its four groups, the
# watcher on them, FSDP rebuilt, the shards and momentum sent, the run's history read and the check's digest of
# the model (its all-gathers are the new shard groups' first collectives: NCCL connects their peers there), the
# first joint step.
JOIN_STAGES = (("rendezvous", "J_STORE"), ("leave_old", "J_LEFT"), ("world_init", "J_WORLD"), ("groups", "J_GROUPS"),
               ("watcher", "J_WATCH"), ("fsdp_rebuild", "J_FSDP"), ("shards", "J_SHARDS"), ("digest", "JOINED"),
               ("first_step", "JOINT_STEP_1"))  # fmt: skip
ROLES = (("survivor", 0), ("peer", 1), ("partner", 2), ("victim", 3), ("replacement", 3))
TRAINERS = ("survivor", "peer", "partner", "replacement")
FIRST_STEP_MEDIAN_GOAL_S = 0.5
FIRST_STEP_WORST_GOAL_S = 1.0
AGREE_WITHIN_STEPS = 2


def argv(role: str, backend: str, rendezvous_dir: Path, device: int, phase: str, settings: Any) -> list[str]:
    """One worker's command line."""
    return [
        sys.executable, "-m", "torch_dist_check.peerloss.hsdp_worker", "--role", role, "--backend", backend,
        "--rendezvous-dir", str(rendezvous_dir), "--device", str(device),
        "--kill-step", str(settings.train_kill_step), "--kill-phase", phase,
        "--steps-after", str(settings.train_steps_after), "--width", str(settings.train_width),
        "--pg-timeout", "300", "--recover-timeout", str(settings.recover_timeout_s),
    ]  # fmt: skip


def judge(settings: Any, workers: dict[str, WorkerProcess], fig: dict[str, Any], steps_after: int) -> tuple[bool, str]:
    """Replica A trained on alone and replica B came back; every rank equals the replay bitwise."""
    trainers = {role: workers[role] for role in TRAINERS}
    killed = trainjudge.await_trainers(settings, workers["victim"], trainers, "HSDP_DONE", fig)
    if isinstance(killed, str):
        return False, killed
    death, phase = killed
    survivor = workers["survivor"]
    not_caught = trainjudge.survivor_caught(settings, survivor, death, phase, fig)
    firsts = [workers[r].event("FIRST_STEP") for r in ("survivor", "peer")]
    fig["first_step_s"] = round(max(f[0] for f in firsts) - death, 4) if all(firsts) else None
    started = workers["replacement"].event("STARTED")
    joined = [x.event("JOINED") for x in trainers.values()]
    joint = [x.event("JOINT_STEP_1") for x in trainers.values()]
    fig["transfer_s"] = round(max(j[0] for j in joined) - started[0], 4) if started and all(joined) else None
    fig["join_s"] = round(max(j[0] for j in joint) - started[0], 4) if started and all(joint) else None
    fig["join_split"] = join_split(trainers, started[0]) if started else None
    fig["join_by_role"] = {  # each rank's stage ends, seconds from the spare's start: who was last where
        role: {name: round(m[0] - started[0], 4) for name, event in JOIN_STAGES if (m := x.event(event))}
        for role, x in trainers.items()
    } if started else None  # fmt: skip
    alone = survivor.event("ALONE_DONE")
    fig["alone_steps"] = int(fields(alone[1])["steps"]) if alone else None
    if not_caught:
        return False, not_caught
    results = trainjudge.results(trainers, "HSDP_DONE", "the {role} did not train on (victim died in {phase}): {why}", phase)
    if isinstance(results, str):
        return False, results
    # The four digests after the transfer and after each joint step: when did they first agree?
    stages = [[fields(x.event("JOINED")[1])["digest"] for x in trainers.values()]]  # type: ignore[index]
    for i in range(1, steps_after + 1):
        marks = [x.event(f"JOINT_STEP_{i}") for x in trainers.values()]
        stages.append([fields(m[1])["digest"] if m else f"missing-{role}" for m, role in zip(marks, trainers)])
    agreed = [i for i, digests in enumerate(stages) if len(set(digests)) == 1]
    fig["agree_after_steps"] = agreed[0] if agreed else None
    fig["params_equal"] = len({r["digest"] for r in results.values()}) == 1
    fig["replay_equal"] = all(r["digest"] == r["replay"] for r in results.values())
    alone_digests = [fields(workers[r].event("ALONE_DONE")[1])["digest"] for r in ("survivor", "peer")]  # type: ignore[index]
    fig["alone_replay_equal"] = all(d == results["survivor"]["alone_replay"] for d in alone_digests)
    fig["loss_finite"] = all(r["finite"] == "True" for r in results.values())
    fig["loss_worst_rel"] = max(float(r["worst_rel"]) for r in results.values())
    trainjudge.record_context(survivor, fig)
    if not fig["alone_replay_equal"]:
        return False, f"replica A's parameters alone differ from the replay: {alone_digests} vs {results['survivor']['alone_replay']}"
    if not fig["params_equal"] or not fig["replay_equal"]:
        return False, f"the ranks' parameters differ from each other or from the replay: {results}"
    if fig["agree_after_steps"] is None or fig["agree_after_steps"] > AGREE_WITHIN_STEPS:
        return False, f"the four ranks did not agree within {AGREE_WITHIN_STEPS} steps of the join: {stages}"
    if not fig["loss_finite"]:
        return False, "a loss was not finite"
    if exited := trainjudge.exits_failure(trainers):
        return False, exited
    parts = [f"victim died in {phase}", f"(a) {fig['exception_s']} s PeerLostError",
             f"(f) replica A's first step alone {fig['first_step_s']} s", f"{fig['alone_steps']} steps alone",
             f"join {fig['join_s']} s (shards in {fig['transfer_s']} s, all agree after {fig['agree_after_steps']} steps)",
             f"parameters bitwise equal to the replay, loss worst {fig['loss_worst_rel']:.1e}",
             "(d) context intact" if fig.get("context_survived") else "(d) cpu"]  # fmt: skip
    return True, "; ".join(parts)


def join_split(trainers: dict[str, WorkerProcess], started: float) -> dict[str, float] | None:
    """Seconds of the join spent in each stage: when the last of the four ended it, less when the last ended
    the stage before (the first from the spare's start). None when a rank did not mark every stage."""
    split, before = {}, started
    for name, event in JOIN_STAGES:
        marks = [x.event(event) for x in trainers.values()]
        if not all(marks):
            return None
        last = max(m[0] for m in marks)  # type: ignore[index]
        split[name] = round(last - before, 4)
        before = last
    return split
