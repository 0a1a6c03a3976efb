"""Fault tolerance: does a job survive a dead peer? (the design of multiworld-nccl-fault.md §5)

Each case starts two fresh worker processes (:mod:`torch_dist_check.checks.fault_worker`) on two GPUs of
this node. After a warm-up, rank 1 SIGKILLs itself; rank 0 keeps issuing the collective and must
(a) catch a Python exception and stay alive, checked on the CPU side, then (b) use its GPU again.
The verdict gives the seconds from the peer's death to (a) and to (b). Every wait is bounded here,
in the launcher: a stage that does not complete in time is named in the failure.

NCCL is forced onto its socket transport over the loopback interface, as across hosts: a dead peer
then gives ncclRemoteError, where the intra-node P2P/SHM transports would just hang.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch_dist_check.checks.fault_worker import STACKS_SIGNAL
from torch_dist_check.harness import forkserver
from torch_dist_check.report.results import FAIL, PASS, CheckResult

# Text in the survivor's output that means the C++ side terminated the process (an unpatched build).
FORBIDDEN_OUTPUT = ("terminate called after throwing", "Unconvertible NCCL type")

# Variables that must never reach a worker from this process's own environment.
_DROP_FROM_WORKER_ENV = ("NCCL_DEBUG_FILE", "TORCH_DIST_CHECK_NCCL_LOG", "RANK", "WORLD_SIZE", "LOCAL_RANK")


@dataclass(frozen=True)
class FaultCase:
    """One fault case: backend, TORCH_NCCL_ASYNC_ERROR_HANDLING mode (NCCL only) and operation."""

    backend: str
    mode: int | None
    op: str

    @property
    def name(self) -> str:
        """The check name, e.g. fault/nccl/mode2/sendrecv."""
        if self.mode is None:
            return f"fault/{self.backend}/{self.op}"
        return f"fault/{self.backend}/mode{self.mode}/{self.op}"


@dataclass(frozen=True)
class FaultSettings:
    """Bounds and options of the fault check (seconds)."""

    init_timeout_s: float = 120.0
    kill_after_s: float = 2.0
    exception_timeout_s: float = 60.0
    gpu_timeout_s: float = 90.0
    exit_timeout_s: float = 15.0
    plant: str = "none"
    recover: str = "none"
    extra_env: Mapping[str, str] = field(default_factory=dict)


def cases_for(backend: str, modes: Sequence[int], ops: Sequence[str]) -> list[FaultCase]:
    """The cases to run: modes x ops for NCCL; ops alone for gloo (it has no error-handling modes)."""
    if backend == "gloo":
        return [FaultCase("gloo", None, op) for op in ops]
    return [FaultCase(backend, mode, op) for mode in modes for op in ops]


def worker_env(case: FaultCase, base: Mapping[str, str], extra: Mapping[str, str]) -> dict[str, str]:
    """The environment of both workers of a case (design table in multiworld-nccl-fault.md §5)."""
    env = {k: v for k, v in base.items() if k not in _DROP_FROM_WORKER_ENV}
    # PyTorch's own error handling is under test: the peer watcher (on in the ncclft flavor) stays off.
    env.update(PYTHONUNBUFFERED="1", TORCH_PEER_WATCHER="0")
    if case.backend == "nccl":
        env.update(
            TORCH_NCCL_ASYNC_ERROR_HANDLING=str(case.mode),
            # The heartbeat monitor would std::abort a process whose watchdog looks stuck.
            TORCH_NCCL_ENABLE_MONITORING="0",
            # Sockets over loopback, as between hosts: a dead peer gives ncclRemoteError, not a hang.
            NCCL_P2P_DISABLE="1",
            NCCL_SHM_DISABLE="1",
            NCCL_IB_DISABLE="1",
            NCCL_NET="Socket",
            NCCL_SOCKET_IFNAME="lo",
            # NVLink multicast stays off on shared multi-GPU hosts.
            NCCL_NVLS_ENABLE="0",
            NCCL_DEBUG="WARN",
        )
        env.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        env.setdefault("NVSHMEM_DISABLE_NVLS", "1")
    else:
        env["GLOO_SOCKET_IFNAME"] = "lo"
    env.update(extra)
    return env


# How long a worker seen ended may still take to have its last lines read (a reading thread that lags).
READ_AFTER_END_S = 5.0


class WorkerProcess:
    """A worker process whose output lines are collected, with marker events parsed as they arrive."""

    def __init__(self, rank: int, argv: list[str], env: dict[str, str], netns: int | None = None,
                 fallback: Sequence[str] | None = None) -> None:  # fmt: skip
        self.rank = rank
        # Forked from this process's fork server when argv is `python -m MODULE` (no second torch import);
        # netns and fallback: a namespace node's (NodeNetwork.node_start).
        self.proc = forkserver.start(argv, env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     netns=netns, fallback=fallback)  # fmt: skip
        self.lines: list[str] = []
        self.events: dict[str, tuple[float, str]] = {}
        self.exit_seen_at: float | None = None
        # When it ended, its files (its sockets, its stdout) closed just before: when its peers could first see its
        # connections closed (a SIGKILLed process's, once the kernel tore it down, late on a busy host). Taken from a
        # pidfd (whoever else holds its stdout); where none can be opened, from the end of its output.
        self.ended_at: float | None = None
        self._pidfd: int | None = None
        try:
            self._pidfd = os.pidfd_open(self.proc.pid)
        except (AttributeError, OSError):  # Python < 3.9, Linux < 5.3
            pass
        else:
            threading.Thread(target=self._watch_end, daemon=True).start()
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            with self._lock:
                self.lines.append(line)
                parts = line.split(" ", 3)
                if len(parts) >= 3 and parts[0] == "TDC":
                    try:
                        stamp = float(parts[2])
                    except ValueError:
                        continue
                    self.events.setdefault(parts[1], (stamp, parts[3] if len(parts) > 3 else ""))
        if self._pidfd is None:
            self.ended_at = time.time()

    def _watch_end(self) -> None:
        assert self._pidfd is not None
        try:
            poller = select.poll()  # not select(): a pidfd numbered 1024 or more is out of its range
            poller.register(self._pidfd, select.POLLIN)
            poller.poll()  # readable once the process has ended
            self.ended_at = time.time()
        finally:
            os.close(self._pidfd)

    def event(self, name: str) -> tuple[float, str] | None:
        """(unix time, rest of line) of a marker, if it was printed."""
        with self._lock:
            return self.events.get(name)

    def alive(self) -> bool:
        """True while the process runs; records when it was first seen dead.

        Seen dead, it has had the lines it wrote before its end read first: its end and its output come
        by different ways (a forked worker's end over its server's socket), and a judge reading the
        events at once missed the last ones. Bounded, once: a process it left behind may hold the pipe."""
        running = self.proc.poll() is None
        if not running and self.exit_seen_at is None:
            self.exit_seen_at = time.time()
            self._reader.join(timeout=READ_AFTER_END_S)
        return running

    def kill(self) -> None:
        """SIGKILL the worker (if still running) and reap it."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        self._reader.join(timeout=5)

    def markers(self) -> dict[str, tuple[float, str]]:
        """Every marker printed so far (the first of each name)."""
        with self._lock:
            return dict(self.events)

    def stacks(self, within_s: float = 2.0, quiet_s: float = 0.3) -> list[str]:
        """Where each thread of a running worker is: the lines it prints on :data:`STACKS_SIGNAL` (a worker that
        called ``fault_worker.stacks_on_request``; any other ends by that signal), read until none came for
        ``quiet_s``, ``within_s`` at most."""
        with self._lock:
            start = len(self.lines)
        try:
            self.proc.send_signal(STACKS_SIGNAL)
        except OSError as exc:
            return [f"(no stacks: {exc})"]
        deadline = time.monotonic() + within_s
        seen, last = start, time.monotonic()
        while time.monotonic() < deadline:
            time.sleep(0.05)
            with self._lock:
                now = len(self.lines)
            if now != seen:
                seen, last = now, time.monotonic()
            elif now > start and time.monotonic() - last >= quiet_s:
                break
        with self._lock:
            return self.lines[start:]

    def tail(self, n: int = 25) -> list[str]:
        """The last ``n`` output lines."""
        with self._lock:
            return self.lines[-n:]

    def output(self) -> str:
        """All output so far."""
        with self._lock:
            return "\n".join(self.lines)


def describe_exit(code: int | None | subprocess.Popen[Any] | forkserver.ForkedProcess) -> str:
    """How a worker ended, from its exit status or its process (whose status may be unknown: a forked
    worker whose fork server was lost)."""
    if not isinstance(code, int) and code is not None:
        if getattr(code, "status_unknown", None):
            return f"ended ({code.status_unknown})"
        code = code.returncode
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def wait_until(predicate: Any, timeout_s: float, poll_s: float = 0.01) -> bool:
    """Poll ``predicate`` until it is true or ``timeout_s`` passes."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(poll_s)
    return bool(predicate())


def run_case(case: FaultCase, settings: FaultSettings) -> CheckResult:
    """Run one case and judge it: pass only if (a) and (b) both happened within their bounds."""
    started = time.monotonic()
    env = worker_env(case, os.environ, settings.extra_env)
    # Rank 0 publishes its store's port here (no port chosen before it is bound; rendezvous.py).
    rendezvous_dir = Path(tempfile.mkdtemp(prefix="fault-"))
    # The workers' own loop must outlast every bound below, so the launcher decides the verdict.
    issue_for = settings.exception_timeout_s + settings.kill_after_s + 30
    workers = []
    for rank in (0, 1):
        argv = [
            sys.executable, "-m", "torch_dist_check.checks.fault_worker",
            "--rank", str(rank), "--backend", case.backend, "--op", case.op,
            "--kill-after", str(settings.kill_after_s), "--issue-for", str(issue_for),
            "--plant", settings.plant if rank == 0 else "none", "--recover", settings.recover,
            "--rendezvous-dir", str(rendezvous_dir),
        ]  # fmt: skip
        workers.append(WorkerProcess(rank, argv, env))
    survivor, victim = workers
    details: dict[str, Any] = {
        "backend": case.backend,
        "mode": case.mode,
        "op": case.op,
        "plant": settings.plant,
        "recover": settings.recover,
        "bounds_s": {
            "init": settings.init_timeout_s,
            "exception": settings.exception_timeout_s,
            "gpu": settings.gpu_timeout_s,
        },
        "env": {k: env[k] for k in sorted(env) if k.startswith(("TORCH_NCCL_", "NCCL_", "GLOO_"))},
        "exception_caught": False,
        "cpu_alive": False,
        "exception_s": None,
        "gpu_usable": False,
        "gpu_usable_s": None,
    }

    def finish(status: str, reason: str) -> CheckResult:
        for w in workers:
            w.kill()
        shutil.rmtree(rendezvous_dir)
        details["survivor_exit"] = describe_exit(survivor.proc)
        output = survivor.output()
        hits = [text for text in FORBIDDEN_OUTPUT if text in output]
        if hits and status == PASS:
            status, reason = FAIL, f"survivor printed {hits[0]!r}"
        details["survivor_tail"] = survivor.tail()
        if status != PASS:
            details["victim_tail"] = victim.tail()
        return CheckResult(case.name, status, reason, details, time.monotonic() - started)

    # Stage init: both ranks built their communicators and ran the warm-up.
    if not wait_until(lambda: (survivor.event("READY") and victim.event("READY")) or not (survivor.alive() and victim.alive()), settings.init_timeout_s):
        return finish(FAIL, f"stage 'init' did not complete within {settings.init_timeout_s:.0f} s (no READY from both ranks)")
    if not (survivor.event("READY") and victim.event("READY")):
        dead = survivor if not survivor.alive() else victim
        return finish(FAIL, f"stage 'init': rank {dead.rank} {describe_exit(dead.proc)} before the warm-up finished")

    # Stage kill: the victim killed itself.
    if not wait_until(lambda: not victim.alive(), settings.kill_after_s + 30):
        return finish(FAIL, "stage 'kill' did not complete: rank 1 did not die")
    kill_event = victim.event("KILL")
    death = kill_event[0] if kill_event else float(victim.exit_seen_at or time.time())
    details["victim_exit"] = describe_exit(victim.proc)

    # Stage exception, (a): the survivor caught an exception, and its CPU side still runs.
    def exception_settled() -> bool:
        return bool(survivor.event("CPU_OK") or survivor.event("NO_ERROR") or not survivor.alive())

    wait_until(exception_settled, max(0.0, death + settings.exception_timeout_s - time.time()))
    caught = survivor.event("CAUGHT")
    if caught:
        details["exception_caught"] = True
        details["exception_s"] = round(caught[0] - death, 3)
        details["exception"] = caught[1]
    cpu_ok = survivor.event("CPU_OK")
    if not cpu_ok:
        if survivor.event("NO_ERROR"):
            return finish(FAIL, "(a) no exception reached Python: the survivor saw no error")
        if not survivor.alive():
            after = "after the exception" if caught else "before any exception reached Python"
            return finish(FAIL, f"(a) the survivor died ({describe_exit(survivor.proc)}) {after}")
        return finish(
            FAIL,
            f"(a) stage 'exception' did not complete within {settings.exception_timeout_s:.0f} s of the peer's death",
        )
    details["cpu_alive"] = True

    # Stage gpu, (b): the survivor's device is idle and computes correctly again.
    wait_until(lambda: bool(survivor.event("GPU_OK")) or not survivor.alive(), max(0.0, death + settings.gpu_timeout_s - time.time()))
    gpu_ok = survivor.event("GPU_OK")
    if not gpu_ok:
        if not survivor.alive():
            return finish(FAIL, f"(b) the survivor died ({describe_exit(survivor.proc)}) while probing its device")
        return finish(
            FAIL,
            f"(a) exception after {details['exception_s']} s; (b) stage 'gpu' did not complete within "
            f"{settings.gpu_timeout_s:.0f} s of the peer's death (device still busy)",
        )
    details["gpu_usable"] = True
    details["gpu_usable_s"] = round(gpu_ok[0] - death, 3)
    aborted = survivor.event("ABORTED")
    if aborted:
        details["abort_done_s"] = round(aborted[0] - death, 3)
    if survivor.event("ABORT_FAILED"):
        details["abort_failed"] = survivor.event("ABORT_FAILED")[1]  # type: ignore[index]

    # Stage exit: the survivor ends cleanly.
    wait_until(lambda: not survivor.alive(), settings.exit_timeout_s)
    if survivor.proc.returncode != 0:
        return finish(FAIL, f"survivor {describe_exit(survivor.proc)} after its device probe")
    return finish(PASS, f"(a) exception after {details['exception_s']} s; (b) device usable after {details['gpu_usable_s']} s")


def run_cases(cases: Sequence[FaultCase], settings: FaultSettings, jobs: int = 1) -> list[CheckResult]:
    """Run the cases, ``jobs`` at a time (each case uses the same two devices), in case order."""
    if jobs <= 1:
        return [run_case(case, settings) for case in cases]
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(lambda c: run_case(c, settings), cases))


def case_bound_s(settings: FaultSettings) -> float:
    """The longest one case can take: every stage's bound added up, plus the kill."""
    return (
        settings.init_timeout_s
        + settings.kill_after_s
        + 30
        + max(settings.exception_timeout_s, settings.gpu_timeout_s)
        + settings.exit_timeout_s
        + 10
    )
