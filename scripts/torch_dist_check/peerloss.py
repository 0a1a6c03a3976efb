"""Peer loss: how fast and how cleanly a process recovers when a peer of one of its groups dies.

Cases (each started fresh, workers from :mod:`torch_dist_check.peerloss_worker`):
- ``single``: survivor and victim in one group; the victim dies (SIGKILL, or SIGSTOP: alive but
  stuck) while both run the op (all_reduce, send/recv, or one coalesced all_reduce) in the
  survivor's pattern (``wait``, ``enqueue``, ``poll``: :func:`peerloss_worker._op`). NCCL runs
  it over each transport: ``p2p`` (nothing forced), ``shm`` (NCCL_P2P_DISABLE=1), ``net``
  (sockets over loopback); gloo has one transport (TCP).
- ``two-world``: the survivor is in group A with the victim and in group B with a live peer; B's
  loop runs in a second thread of the survivor while A fails.
- ``false-positive``: the peer computes for ``busy_s`` while the survivor waits inside an
  all_reduce; the all_reduce must complete exactly and nothing may be declared lost.
Every case but the false positive runs with and without torch_peer_watcher.

Figures per run (seconds from the victim's death): (a) ``exception_s``, the exception in the
survivor; ``detected_s``, the watcher's verdict; (b) ``fresh_group_s``, a fresh group with a
replacement process ran an exact all_reduce; (c) ``b_longest_s`` and ``b_exact``, group B's longest
iteration and whether every B result was exact; (d) ``context_survived``, the survivor's device
still computes (None on CPU). The issue's goals (with the watcher: (a) <= 0.1 s, (b) <= 1 s,
(c) <= 1 s) are reported per case; ``enforce_goals`` makes a miss a failure.
"""

from __future__ import annotations

import importlib.util
import os
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch_dist_check.fault import WorkerProcess, describe_exit, wait_until
from torch_dist_check.launch import free_port
from torch_dist_check.peerloss_worker import OPS, PATTERNS
from torch_dist_check.report import FAIL, PASS, CheckResult

TRANSPORTS = ("p2p", "shm", "net")
KINDS = ("single", "two-world", "false-positive")
WATCHER_MODES = ("on", "off")

# The goals for the cases with the watcher (seconds).
GOALS = {"exception_s": 0.1, "fresh_group_s": 1.0, "b_longest_s": 1.0}

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
    extra_env: Mapping[str, str] = field(default_factory=dict)


def cases_for(
    backend: str, kinds: Sequence[str], transports: Sequence[str], ops: Sequence[str], watcher_modes: Sequence[str]
) -> list[PeerLossCase]:
    """The cases to run, in a stable order: single (transport x op x watcher), two-world, false positive."""
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
    return cases


def watcher_missing() -> str | None:
    """Why the watcher cases cannot run here, or None."""
    if importlib.util.find_spec("torch_peer_watcher") is None:
        return "torch_peer_watcher is not installed (conda install torch-peer-watcher)"
    return None


def worker_env(case: PeerLossCase, base: Mapping[str, str], port: int, settings: PeerLossSettings) -> dict[str, str]:
    """The environment of every worker of a case."""
    env = {k: v for k, v in base.items() if k not in _DROP_FROM_WORKER_ENV}
    # The worker starts the watcher itself when the case says so; auto-start would blur "without".
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONUNBUFFERED="1", TORCH_PEER_WATCHER="0")
    if settings.heartbeat_s is not None:
        env["TORCH_PEER_WATCHER_INTERVAL_S"] = str(settings.heartbeat_s)
    if settings.heartbeat_timeout_s is not None:
        env["TORCH_PEER_WATCHER_TIMEOUT_S"] = str(settings.heartbeat_timeout_s)
    if case.backend == "nccl":
        for key in _TRANSPORT_ENV:
            env.pop(key, None)
        for key, value in _NCCL_DEFAULTS.items():
            env.setdefault(key, value)
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


def _b_iters(settings: PeerLossSettings) -> int:
    return max(1, int((settings.kill_after_s + settings.b_window_s) / settings.b_period_s))


def _argv(role: str, case: PeerLossCase, settings: PeerLossSettings, fresh_port: int) -> list[str]:
    return [
        sys.executable, "-m", "torch_dist_check.peerloss_worker",
        "--role", role, "--kind", case.kind, "--backend", case.backend, "--op", case.op,
        "--watcher", "on" if case.watcher else "off", "--fresh-port", str(fresh_port),
        "--kill-after", str(settings.kill_after_s), "--signal", settings.signal, "--pattern", settings.pattern,
        "--issue-for", str(settings.exception_timeout_s + settings.kill_after_s + 30),
        "--b-iters", str(_b_iters(settings)), "--b-period", str(settings.b_period_s),
        "--busy-s", str(settings.busy_s), "--pg-timeout", str(max(300.0, settings.busy_s + 120)),
    ]  # fmt: skip


def _fields(rest: str) -> dict[str, str]:
    """key=value words of a marker line."""
    return dict(word.split("=", 1) for word in rest.split() if "=" in word)


@dataclass
class _Run:
    """One run's workers and figures."""

    workers: dict[str, WorkerProcess]
    figures: dict[str, Any] = field(default_factory=dict)

    def kill_all(self) -> None:
        for worker in self.workers.values():
            worker.kill()


def run_once(case: PeerLossCase, settings: PeerLossSettings) -> tuple[bool, str, dict[str, Any]]:
    """Run the case once: (passed, reason, figures)."""
    port, fresh_port = free_port(), free_port()
    env = worker_env(case, os.environ, port, settings)
    if case.kind == "false-positive":
        roles = ["survivor", "busy"]
    else:
        roles = ["survivor", "victim", *(["live"] if case.kind == "two-world" else []), "replacement"]
    run = _Run({role: WorkerProcess(i, _argv(role, case, settings, fresh_port), env) for i, role in enumerate(roles)})
    try:
        ok, reason = _judge(case, settings, run)
    finally:
        run.kill_all()
    if not ok:
        run.figures["survivor_tail"] = run.workers["survivor"].tail()
        for role, worker in run.workers.items():
            if role != "survivor":
                run.figures[f"{role}_tail"] = worker.tail(10)
    return ok, reason, run.figures


def _judge(case: PeerLossCase, settings: PeerLossSettings, run: _Run) -> tuple[bool, str]:
    w, fig = run.workers, run.figures
    survivor = w["survivor"]

    def all_ready() -> bool:
        return all(x.event("READY") for x in w.values())

    if not wait_until(lambda: all_ready() or not all(x.alive() for x in w.values()), settings.init_timeout_s) or not all_ready():
        dead = [f"{role} {describe_exit(x.proc.returncode)}" for role, x in w.items() if not x.alive()]
        return False, f"stage 'init' did not complete within {settings.init_timeout_s:.0f} s ({', '.join(dead) or 'no READY'})"
    if case.kind == "false-positive":
        return _judge_false_positive(settings, run)

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
        fig.update({k: v for k, v in _fields(loss[1]).items() if k in ("abort_s", "groups", "cut")})
    gpu = survivor.event("GPU_OK")
    fig["context_survived"] = (gpu[1].split()[-1] == "cuda" or None) if gpu else False
    if survivor.event("CONTEXT_LOST"):
        fig["context_error"] = survivor.event("CONTEXT_LOST")[1]  # type: ignore[index]
        return False, f"(d) the CUDA context was lost: {fig['context_error'][:120]}"
    fresh = survivor.event("FRESH_OK")
    fig["fresh_group_s"] = round(fresh[0] - death, 4) if fresh else None
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
        b = _fields(b_done[1])
        fig["b_longest_s"] = round(float(b["longest_s"]), 4)
        fig["b_iterations"] = int(b["iterations"])
        fig["b_exact"] = b["inexact"] == "0" and b["error"] == "-" and fig["b_iterations"] == _b_iters(settings)
        if not fig["b_exact"]:
            return False, f"(c) group B broke: {b_done[1][:160]}"

    wait_until(lambda: not survivor.alive(), 15)
    if survivor.proc.returncode != 0:
        return False, f"survivor {describe_exit(survivor.proc.returncode)} after recovering"
    return True, _summary(fig)


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
    fields = _fields(done[1])
    fig["busy_s"] = settings.busy_s
    fig["waited_s"] = float(fields["waited_s"])
    fig["exact"] = fields["exact"] == "True"
    fig["losses"] = int(fields["losses"]) + (int(_fields(busy_done[1])["losses"]) if busy_done else 0)
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
    if "b_longest_s" in fig:
        parts.append(f"(c) B longest {fig['b_longest_s']} s, exact")
    parts.append("(d) context intact" if fig.get("context_survived") else "(d) cpu")
    return "; ".join(parts)


def run_case(case: PeerLossCase, settings: PeerLossSettings) -> CheckResult:
    """Run the case ``settings.runs`` times; fail if any run failed (or missed a goal, if enforced)."""
    started = time.monotonic()
    runs = []
    failures = []
    for index in range(settings.runs):
        ok, reason, figures = run_once(case, settings)
        runs.append({"ok": ok, "reason": reason, **figures})
        if not ok:
            failures.append(f"run {index + 1}: {reason}")
    details: dict[str, Any] = {
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
    if case.watcher and case.kind != "false-positive":
        details["goals"] = goals_met(details["summary"], case)
    status = PASS if not failures else FAIL
    if status == PASS and settings.enforce_goals and details.get("goals"):
        missed = [name for name, met in details["goals"].items() if met is False]
        if missed:
            status = FAIL
            failures.append("goal missed: " + ", ".join(f"{n} worst {details['summary'][n]['worst']} > {GOALS[n]}" for n in missed))
    reason = "; ".join(failures) if failures else (runs[0]["reason"] if len(runs) == 1 else _worst_line(details["summary"]))
    return CheckResult(case.name, status, reason, details, time.monotonic() - started)


def summarize(runs: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, float]]:
    """Median and worst of each figure over the runs that produced it."""
    summary = {}
    for name in ("exception_s", "detected_s", "fresh_group_s", "b_longest_s", "waited_s"):
        values = [float(r[name]) for r in runs if r.get(name) is not None]
        if values:
            summary[name] = {"median": round(statistics.median(values), 4), "worst": round(max(values), 4), "n": len(values)}
    return summary


def goals_met(summary: Mapping[str, Mapping[str, float]], case: PeerLossCase) -> dict[str, bool | None]:
    """Each goal against the worst run (None where the figure does not apply)."""
    met: dict[str, bool | None] = {}
    for name, bound in GOALS.items():
        if name == "b_longest_s" and case.kind != "two-world":
            continue
        met[name] = summary[name]["worst"] <= bound if name in summary else None
    return met


def _worst_line(summary: Mapping[str, Mapping[str, float]]) -> str:
    return "; ".join(f"{name} median {v['median']} worst {v['worst']} (n={v['n']})" for name, v in summary.items())


def run_cases(cases: Sequence[PeerLossCase], settings: PeerLossSettings) -> list[CheckResult]:
    """Run the cases one after the other (they share the devices)."""
    missing = watcher_missing()
    results = []
    for case in cases:
        if case.watcher and missing:
            results.append(CheckResult.skipped(case.name, missing))
        elif settings.pattern == "poll" and case.backend == "gloo" and case.op == "sendrecv" and case.kind == "single":
            # Measured with torch 2.13.0: gloo's isend/irecv work stays not completed until wait().
            results.append(CheckResult.skipped(case.name, "gloo's send/recv work never reports is_completed() before wait()"))
        else:
            results.append(run_case(case, settings))
    return results


def case_bound_s(settings: PeerLossSettings) -> float:
    """The longest one case can take (all its runs)."""
    one = settings.init_timeout_s + settings.kill_after_s + 30 + max(settings.recover_timeout_s, settings.busy_s + 60)
    return settings.runs * (one + settings.b_window_s + 60)
