"""Where this process sits in the job: rank discovery for every launcher, and self-spawning.

Launchers announce ranks in their own variables. :func:`discover_rank` reads them in a fixed order,
so the same command works under torchrun, mpiexec/mpirun (MPICH Hydra, Open MPI, Cray PALS), srun,
or alone. :func:`spawn_local` starts N local ranks itself (``--nproc N``) and waits for them with a
bound, so a verdict never hangs on a stuck child.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from torch_dist_check.harness import forkserver
from torch_dist_check.harness.progress import StageProgress
from torch_dist_check.nodes.namespaces import NETWORK_ENV, NodeNetwork

# Default rendezvous port when the launcher sets none (torchrun's default is 29500; differ from it
# so a stale torchrun job on the node cannot answer).
DEFAULT_PORT = 29517

# Set in the environment of ranks that --nproc started, so they never spawn again.
SPAWNED_ENV = "TORCH_DIST_CHECK_SPAWNED"
# Folder where spawned ranks write the stage they are in, for the parent's timeout report.
STATUS_DIR_ENV = "TORCH_DIST_CHECK_STATUS_DIR"
# File where spawned rank 0 publishes the port its rendezvous store got from the kernel; the other
# ranks read it there (a port chosen by the launcher could be taken before rank 0 bound it).
PORT_FILE_ENV = "TORCH_DIST_CHECK_PORT_FILE"


class LaunchError(Exception):
    """The launcher's variables are incomplete or contradict each other."""


@dataclass(frozen=True)
class RankInfo:
    """This process's place in the job, as the launcher described it."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    launcher: str
    master_addr: str | None
    master_port: int

    @property
    def is_mpi_launch(self) -> bool:
        """True when an MPI launcher started the ranks (so torch's MPI backend can work)."""
        return self.launcher in ("openmpi", "mpich", "cray-pals")


def _int(env: Mapping[str, str], name: str) -> int:
    value = env[name]
    try:
        return int(value)
    except ValueError:
        raise LaunchError(f"{name}={value!r} is not an integer") from None


def _first_int(env: Mapping[str, str], names: Sequence[str], default: int) -> int:
    for name in names:
        if name in env and env[name] != "":
            return _int(env, name)
    return default


def tasks_on_node(tasks_per_node: str, node_index: int) -> int:
    """Ranks on node ``node_index`` from Slurm's compressed SLURM_STEP_TASKS_PER_NODE ("4(x2),3")."""
    counts: list[int] = []
    for part in tasks_per_node.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not match:
            raise LaunchError(f"cannot read SLURM_STEP_TASKS_PER_NODE={tasks_per_node!r}")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    if not 0 <= node_index < len(counts):
        raise LaunchError(f"SLURM_NODEID={node_index} is outside SLURM_STEP_TASKS_PER_NODE={tasks_per_node!r}")
    return counts[node_index]


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list ("nid[001-004,007]" gives "nid001")."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?([^,]*)", nodelist.strip())
    if not match:
        raise LaunchError(f"cannot read the Slurm node list {nodelist!r}")
    prefix, ranges, suffix = match.groups()
    if not ranges:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return f"{prefix}{first}{suffix}"


def pbs_hosts(env: Mapping[str, str]) -> list[str]:
    """The hosts of a PBS job, one line per MPI process slot (``mpiprocs`` of each chunk), from the
    file PBS_NODEFILE names; empty outside a PBS job. LaunchError when the file cannot be read."""
    path = env.get("PBS_NODEFILE")
    if not path:
        return []
    try:
        with open(path) as handle:
            return [line.strip() for line in handle if line.strip()]
    except OSError as exc:
        raise LaunchError(f"cannot read PBS_NODEFILE={path}: {exc.strerror}") from None


def ranks_on_pbs_node(hosts: Sequence[str], node_index: int) -> int:
    """Slots on the job's node ``node_index`` (its hosts numbered in the order PBS_NODEFILE first names them)."""
    nodes = list(dict.fromkeys(hosts))
    if not 0 <= node_index < len(nodes):
        raise LaunchError(f"PALS_NODEID={node_index} is outside the {len(nodes)} nodes of PBS_NODEFILE")
    return hosts.count(nodes[node_index])


def batch_job(env: Mapping[str, str]) -> dict[str, object] | None:
    """The batch job this process runs in (PBS or Slurm): its id and hosts, for the report."""
    if env.get("PBS_JOBID"):
        return {"system": "pbs", "job_id": env["PBS_JOBID"], "queue": env.get("PBS_QUEUE"), "hosts": pbs_hosts(env)}
    if env.get("SLURM_JOB_ID"):
        return {"system": "slurm", "job_id": env["SLURM_JOB_ID"], "nodelist": env.get("SLURM_JOB_NODELIST")}
    return None


def discover_rank(env: Mapping[str, str]) -> RankInfo:
    """Read rank, world size and local rank from whichever launcher started this process.

    Order: torchrun (and ``--nproc``) variables, Open MPI, Cray PALS, MPICH/PMI, Slurm's srun,
    then a single process. MASTER_ADDR/MASTER_PORT win where set; otherwise a job on one node
    rendezvous on 127.0.0.1, a Slurm step on its first node and a PBS job on the first host of
    PBS_NODEFILE (Derecho's `mpiexec` is Cray PALS: PALS_RANKID, PALS_LOCAL_RANKID, PALS_NODEID).
    """
    hosts = pbs_hosts(env)
    if "RANK" in env and "WORLD_SIZE" in env:
        launcher = "spawn" if env.get(SPAWNED_ENV) == "1" else "torchrun"
        rank, size = _int(env, "RANK"), _int(env, "WORLD_SIZE")
        local_rank = _first_int(env, ["LOCAL_RANK"], rank)
        local_size = _first_int(env, ["LOCAL_WORLD_SIZE"], size)
    elif "OMPI_COMM_WORLD_RANK" in env:
        launcher = "openmpi"
        rank, size = _int(env, "OMPI_COMM_WORLD_RANK"), _int(env, "OMPI_COMM_WORLD_SIZE")
        local_rank = _first_int(env, ["OMPI_COMM_WORLD_LOCAL_RANK"], rank)
        local_size = _first_int(env, ["OMPI_COMM_WORLD_LOCAL_SIZE"], size)
    elif "PALS_RANKID" in env:
        # Cray PALS names the rank itself; the size comes from Cray PMI, which PALS always starts.
        launcher = "cray-pals"
        if "PMI_SIZE" not in env:
            raise LaunchError("PALS_RANKID is set but PMI_SIZE is not; set WORLD_SIZE (and RANK) yourself")
        rank, size = _int(env, "PALS_RANKID"), _int(env, "PMI_SIZE")
        local_rank = _first_int(env, ["PALS_LOCAL_RANKID", "PMI_LOCAL_RANK"], rank)
        local_size = _first_int(env, ["PALS_LOCAL_SIZE", "PMI_LOCAL_SIZE"], -1)
        if local_size < 0:
            # Without a local size, a PBS job's node file says how many slots this node has.
            node = _first_int(env, ["PALS_NODEID"], -1)
            local_size = ranks_on_pbs_node(hosts, node) if hosts and node >= 0 else size
    elif "PMI_RANK" in env and "PMI_SIZE" in env:
        launcher = "mpich"
        rank, size = _int(env, "PMI_RANK"), _int(env, "PMI_SIZE")
        local_rank = _first_int(env, ["MPI_LOCALRANKID", "PMI_LOCAL_RANK"], rank)
        local_size = _first_int(env, ["MPI_LOCALNRANKS", "PMI_LOCAL_SIZE"], size)
    elif "SLURM_PROCID" in env and "SLURM_STEP_NUM_TASKS" in env:
        # SLURM_STEP_NUM_TASKS exists only inside an srun step; a batch script also has
        # SLURM_PROCID=0, and must not mistake itself for rank 0 of a multi-rank job.
        launcher = "slurm"
        rank, size = _int(env, "SLURM_PROCID"), _int(env, "SLURM_STEP_NUM_TASKS")
        local_rank = _first_int(env, ["SLURM_LOCALID"], rank)
        if "SLURM_STEP_TASKS_PER_NODE" in env:
            local_size = tasks_on_node(env["SLURM_STEP_TASKS_PER_NODE"], _first_int(env, ["SLURM_NODEID"], 0))
        else:
            local_size = size
    else:
        launcher, rank, size, local_rank, local_size = "single", 0, 1, 0, 1

    if size < 1 or not 0 <= rank < size:
        raise LaunchError(f"rank {rank} is outside world size {size} (launcher: {launcher})")
    if not 0 <= local_rank < max(local_size, 1):
        raise LaunchError(f"local rank {local_rank} is outside local size {local_size} (launcher: {launcher})")

    master_addr = env.get("MASTER_ADDR") or None
    if master_addr is None:
        if local_size >= size:
            master_addr = "127.0.0.1"
        elif launcher == "slurm" and (env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")):
            master_addr = first_host(env.get("SLURM_STEP_NODELIST") or env["SLURM_JOB_NODELIST"])
        elif hosts:
            master_addr = hosts[0]
    master_port = _first_int(env, ["MASTER_PORT"], DEFAULT_PORT)
    return RankInfo(rank, size, local_rank, local_size, launcher, master_addr, master_port)


# Lines of each spawned rank's stderr kept for the report (the rest went to the terminal).
TAIL_LINES = 20


@dataclass(frozen=True)
class RankEnd:
    """How one rank that --nproc started ended, and what it said last.

    ``verdict`` is the exit status the rank recorded when it reached its verdict (``record_verdict``);
    a rank whose process status differs, or that recorded none, ended abnormally: killed by a
    signal, or ended by a crash handler that calls ``exit(1)`` (libinfinipath's does), which
    without the record looks like a verdict of "failed". ``status_unknown`` says why the exit status
    cannot be known (a forked rank whose fork server was lost: harness/forkserver.py), ``exit_code`` is
    then None: such a rank that recorded its verdict ended with it as far as anyone can tell.
    """

    rank: int
    pid: int
    exit_code: int | None
    verdict: int | None
    stage: str
    killed: bool
    tail: tuple[str, ...]
    status_unknown: str | None = None

    @property
    def abnormal(self) -> bool:
        """True when the rank did not end with the verdict it recorded (or, its status unknown, recorded none)."""
        if self.status_unknown is not None and not self.killed:
            return self.verdict is None
        return self.verdict is None or self.exit_code != self.verdict

    @property
    def status(self) -> int:
        """The status the launcher counts for this rank: its exit status, or where that is unknown its
        verdict (1 without one)."""
        if self.exit_code is not None:
            return self.exit_code
        return self.verdict if self.verdict is not None else 1

    def describe(self) -> str:
        """One line for the report: how the rank ended, in which stage, its last words if abnormal."""
        stage = f"in stage '{self.stage or 'start'}'"
        if self.killed:
            how = f"killed by this launcher {stage}"
        elif self.status_unknown is not None:
            verdict = "no verdict recorded" if self.verdict is None else f"its verdict {self.verdict}"
            how = f"{verdict}, then ended {stage}; {self.status_unknown}"
            if self.verdict is not None:
                return f"rank {self.rank}: {how}"
        elif self.exit_code is not None and self.exit_code < 0:
            how = f"killed by {_signal_name(-self.exit_code)} {stage}"
        elif self.verdict is None:
            how = f"exit {self.exit_code} {stage} before its verdict"
        elif self.exit_code != self.verdict:
            how = f"exit {self.exit_code} {stage} after its verdict {self.verdict}"
        else:
            return f"rank {self.rank}: exit {self.exit_code} (its verdict)"
        words = [line for line in self.tail if line.strip()][-3:]
        said = "; last words: " + " | ".join(_clip(line.strip()) for line in words) if words else ""
        return f"rank {self.rank}: {how}{said}"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _clip(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass(frozen=True)
class SpawnOutcome:
    """How the ranks that --nproc started ended."""

    exit_code: int
    timed_out: bool
    ranks: tuple[RankEnd, ...]

    @property
    def abnormal(self) -> bool:
        """True when a rank ended without the verdict it recorded, or the deadline passed."""
        return self.timed_out or any(r.abnormal for r in self.ranks)


def _relay(stream: IO[bytes], tail: deque[str] | None, out: IO[bytes], progress: StageProgress | None) -> None:
    """Copy a rank's output to ``out`` as it comes (through the live progress line when there is one),
    keeping its last lines in ``tail``."""
    target: IO[bytes] | None = out
    for line in iter(stream.readline, b""):
        if tail is not None:
            tail.append(line.decode(errors="replace").rstrip("\n"))
        if target is None:
            continue
        try:
            if progress is None or not progress.write(line.decode(errors="replace")):
                target.write(line)
                target.flush()
        except OSError:
            # Our stream is gone (a closed pipe): keep draining, so the rank never blocks on a full pipe.
            target = None
    stream.close()


def spawn_local(
    nproc: int, argv: Sequence[str], deadline_s: float, status_dir: Path, progress: StageProgress | None = None,
    network: NodeNetwork | None = None,
) -> SpawnOutcome:
    """Run ``python -m torch_dist_check ARGV`` as ``nproc`` local ranks and wait at most ``deadline_s``.

    With ``network`` (``--nodes``), the ranks are spread over its nodes in blocks (``nproc`` divided
    by the node count per node, rank 0 on node 0), each run inside its node's namespace with the
    node's address, interface and ``NCCL_HOSTID``; rank 0's store is reached at node 0's address.

    Ranks inherit stdout (rank 0 prints the report); their stderr passes through this process, which
    keeps its last lines for the report of a rank that ended abnormally. If one rank fails, the
    others get a grace period and are then killed, so a dead rank cannot leave the rest waiting forever.
    ``progress`` is shown each stage rank 0 enters (read from its stage file while waiting); while its
    live line is up on the terminal that is also stdout, the ranks' stdout (the report) passes through
    it too, so that neither overwrites the other.
    """
    status_dir.mkdir(parents=True, exist_ok=True)
    through_progress = progress is not None and progress.live and sys.stdout.isatty()
    procs: list[subprocess.Popen[bytes] | forkserver.ForkedProcess] = []
    tails: list[deque[str]] = []
    relays: list[threading.Thread] = []
    per_node = nproc // len(network.nodes) if network is not None else nproc
    for rank in range(nproc):
        env = dict(os.environ)
        env.update(
            RANK=str(rank),
            WORLD_SIZE=str(nproc),
            LOCAL_RANK=str(rank % per_node),
            LOCAL_WORLD_SIZE=str(per_node),
            MASTER_ADDR="127.0.0.1" if network is None else network.nodes[0].address,
            # Known once rank 0 bound it: published in the port file.
            MASTER_PORT="0",
            **{SPAWNED_ENV: "1", STATUS_DIR_ENV: str(status_dir), PORT_FILE_ENV: str(status_dir / "master.port")},
        )
        command = [sys.executable, "-m", "torch_dist_check", *argv]
        where: dict[str, Any] = {}
        if network is not None:
            node = network.nodes[rank // per_node]
            env.update(node.env())
            env[NETWORK_ENV] = network.to_json()
            command, where = network.node_start(node.index, command)
        # Forked from the fork server (one torch import for all ranks; harness/forkserver.py).
        proc = forkserver.start(command, env, stdout=subprocess.PIPE if through_progress else None,
                                stderr=subprocess.PIPE, **where)  # fmt: skip
        procs.append(proc)
        tails.append(deque(maxlen=TAIL_LINES))
        # Daemons: a grandchild (a fault worker) that outlives its rank may hold a pipe open.
        streams = [(proc.stderr, tails[-1], sys.stderr.buffer)]
        if through_progress:
            streams.append((proc.stdout, None, sys.stdout.buffer))
        for stream, tail, out in streams:
            relays.append(threading.Thread(target=_relay, args=(stream, tail, out, progress), daemon=True))
            relays[-1].start()

    start = time.monotonic()
    first_failure: float | None = None
    timed_out = False
    killed = [False] * nproc
    # A rank that failed normally makes its peers fail within their own stage timeouts; this grace
    # only bounds the case where they do not.
    grace_s = 60.0
    # A batch system's SIGTERM ends this launcher through SystemExit, and the finally below takes
    # the ranks with it instead of leaving them orphaned.
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        while any(p.poll() is None for p in procs):
            if progress is not None:
                progress.stage(read_stage(status_dir, 0))
            now = time.monotonic()
            if first_failure is None and any(_failed(p, status_dir, rank) for rank, p in enumerate(procs)):
                first_failure = now
            if now - start > deadline_s or (first_failure is not None and now - first_failure > grace_s):
                timed_out = now - start > deadline_s
                break
            time.sleep(0.1)
    finally:
        if progress is not None:
            progress.close()
        signal.signal(signal.SIGTERM, previous)
        for rank, p in enumerate(procs):
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                killed[rank] = True
        for p in procs:
            p.wait()
        for relay in relays:
            relay.join(timeout=5)

    ends = tuple(
        RankEnd(
            rank=rank,
            pid=p.pid,
            exit_code=None if getattr(p, "status_unknown", None) else p.returncode,
            verdict=read_verdict(status_dir, rank),
            stage=read_stage(status_dir, rank),
            killed=killed[rank],
            tail=tuple(tails[rank]),
            status_unknown=getattr(p, "status_unknown", None),
        )
        for rank, p in enumerate(procs)
    )
    codes = [end.status for end in ends]
    if timed_out:
        exit_code = 3
    elif all(code == 0 for code in codes):
        exit_code = 0
    else:
        exit_code = max((code for code in codes if code and code > 0), default=1)
    return SpawnOutcome(exit_code, timed_out, ends)


def _failed(proc: subprocess.Popen[bytes] | forkserver.ForkedProcess, status_dir: Path, rank: int) -> bool:
    """Whether the rank ended and failed: a status other than 0, or where its status is unknown (its fork
    server lost) no verdict of 0."""
    if proc.poll() is None:
        return False
    if getattr(proc, "status_unknown", None):
        return read_verdict(status_dir, rank) != 0
    return proc.returncode != 0


def stage_file(status_dir: Path, rank: int) -> Path:
    """The file where a spawned rank records the stage it is in."""
    return status_dir / f"rank{rank}.stage"


def read_stage(status_dir: Path, rank: int) -> str:
    """The last stage a spawned rank entered ("" if it never wrote one)."""
    path = stage_file(status_dir, rank)
    return path.read_text().strip() if path.exists() else ""


def verdict_file(status_dir: Path, rank: int) -> Path:
    """The file where a spawned rank records the exit status it reached its verdict with."""
    return status_dir / f"rank{rank}.verdict"


def record_verdict(rank: int, code: int) -> None:
    """Tell the --nproc launcher that this rank reached its verdict and exits with ``code``.

    Called last, just before the rank exits (rank 0 after writing its report); under any other
    launcher (no status folder) it does nothing.
    """
    status_dir = os.environ.get(STATUS_DIR_ENV)
    if status_dir:
        verdict_file(Path(status_dir), rank).write_text(f"{code}\n")


def read_verdict(status_dir: Path, rank: int) -> int | None:
    """The exit status a spawned rank recorded with its verdict, or None if it recorded none."""
    path = verdict_file(status_dir, rank)
    return int(path.read_text()) if path.exists() else None
