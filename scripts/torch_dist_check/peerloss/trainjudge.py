"""What the judges of the training cases share: the DDP ``train`` cases (:mod:`torch_dist_check.peerloss.cases`)
and ``train-hsdp`` (:mod:`torch_dist_check.peerloss.hsdp`).

Each waits for the victim's death, then for every trainer's result marker; reads the survivor's
exception; collects the results; and, once the trainers have exited, checks their exit codes and
whether the survivor's GPU context survived (:func:`record_context`, which the other peer-loss judges
use too). The case-specific figures and checks stay in each judge.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from torch_dist_check.checks.fault import WorkerProcess, describe_exit, wait_until

FAILED_MARKERS = ("RECOVER_FAILED", "TRAIN_FAILED", "NO_ERROR")


def fields(rest: str) -> dict[str, str]:
    """key=value words of a marker line."""
    return dict(word.split("=", 1) for word in rest.split() if "=" in word)


def await_trainers(settings: Any, victim: WorkerProcess, trainers: Mapping[str, WorkerProcess], done_marker: str,
                   fig: dict[str, Any]) -> tuple[float, str] | str:  # fmt: skip
    """The victim's death (time, phase; ``fig["phase"]``), once every trainer wrote ``done_marker`` or a
    failure or ended (bounded by the recovery timeout); or why the victim never died."""
    # A victim that ended without its kill (train-fresh's never saw the standby warm: NO_STANDBY) is not waited for.
    if not wait_until(lambda: bool(victim.event("KILL")) or not victim.alive(), settings.init_timeout_s + 30) \
            or not wait_until(lambda: bool(victim.event("KILL")), 2.0):  # fmt: skip
        no_standby = victim.event("NO_STANDBY")
        return "stage 'kill': the victim did not reach its kill point" + (f" ({no_standby[1]})" if no_standby else "")
    death, phase = victim.event("KILL")  # type: ignore[misc]
    fig["phase"] = phase

    def done(x: WorkerProcess) -> bool:
        return bool(x.event(done_marker) or any(x.event(m) for m in FAILED_MARKERS) or not x.alive())

    wait_until(lambda: all(done(x) for x in trainers.values()), max(0.0, death + settings.recover_timeout_s - time.time()))
    if not all(done(x) for x in trainers.values()):  # a trainer hung: where each one is, before the judge kills them
        record_hang(fig, trainers, death)
    return death, phase


def record_hang(fig: dict[str, Any], workers: Mapping[str, WorkerProcess], since: float) -> None:
    """What the judge knows of a run in which a side hung, into its figures: each side's markers (seconds
    after ``since``, the fault; the rest of the line), how it ended, its last lines and, if it still runs,
    where each of its threads is (the stacks it prints when asked: ``fault_worker.stacks_on_request``)."""
    for role, x in workers.items():
        fig[f"{role}_markers"] = {name: [round(at - since, 3), rest[:300]] for name, (at, rest) in x.markers().items()}
        fig[f"{role}_tail"] = x.tail()
        running = x.alive()
        fig[f"{role}_exit"] = "still running" if running else describe_exit(x.proc)
        if running:
            fig[f"{role}_stacks"] = x.stacks()[:400]


def survivor_caught(settings: Any, survivor: WorkerProcess, death: float, phase: str, fig: dict[str, Any]) -> str | None:
    """Records (a), the survivor's exception (``exception_s``, ``exception``), and where the worker reports the
    watcher's verdict, its time (``detected_s``), the abort's length and the proxy threads woken; why it fails, or None."""
    caught = survivor.event("CAUGHT")
    fig["exception_s"] = round(caught[0] - death, 4) if caught else None
    fig["exception"] = caught[1] if caught else None
    loss = survivor.event("LOSS")  # the watcher's verdict, where the worker reports it
    if loss:
        said = fields(loss[1])
        fig["detected_s"] = round(float(loss[1].split()[0]) - death, 4)  # the verdict's own time, before its abort
        fig.update({k: float(said[k]) for k in ("abort_s", "judged_s", "proxy_wakes") if k in said})
    if not caught:
        return f"(a) no exception within {settings.recover_timeout_s:.0f} s of the peer's death (victim died in {phase})"
    if not caught[1].startswith("PeerLostError"):
        return f"(a) the survivor's step raised {caught[1][:160]}, not PeerLostError"
    return None


def results(trainers: Mapping[str, WorkerProcess], done_marker: str, failure: str, phase: str) -> dict[str, dict[str, str]] | str:
    """Each trainer's ``done_marker`` fields, once they exited (or 15 s passed); or, for the first without
    one, ``failure`` formatted with its ``role``, the victim's ``phase`` and ``why`` (its failure marker, its
    exit, or no result in time)."""
    found = {}
    for role, x in trainers.items():
        result = x.event(done_marker)
        if not result:
            failed = next((e for e in (x.event(m) for m in FAILED_MARKERS) if e), None)
            why = failed[1] if failed else describe_exit(x.proc.returncode) if not x.alive() else "no result in time"
            return failure.format(role=role, phase=phase, why=why[:200])
        found[role] = fields(result[1])
    wait_until(lambda: not any(x.alive() for x in trainers.values()), 15)
    return found


def record_context(survivor: WorkerProcess, fig: dict[str, Any]) -> None:
    """(d) ``context_survived``: True on a GPU that still computes, None on the CPU, False without an answer."""
    gpu = survivor.event("GPU_OK")
    fig["context_survived"] = (gpu[1].split()[-1] == "cuda" or None) if gpu else False


def exits_failure(trainers: Mapping[str, WorkerProcess]) -> str | None:
    """Why the trainers' exits fail the case (one not 0), or None."""
    codes = {role: x.proc.returncode for role, x in trainers.items()}
    if any(code != 0 for code in codes.values()):
        return "after training on: " + ", ".join(f"{role} {describe_exit(c)}" for role, c in codes.items())
    return None
