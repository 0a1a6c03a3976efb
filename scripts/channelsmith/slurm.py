"""Slurm, through its own commands: check the cluster, submit batch jobs, read their states, cancel them.

Nothing here knows about recipes; channelsmith.scheduler decides what each job runs. Only the client
commands every Slurm site has are used (sbatch, squeue, scontrol, scancel): no accounting database
(sacct) is assumed, so a job that has left squeue is judged by the files it wrote.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from channelsmith.batch import JobState, first_message, run_command
from channelsmith.errors import SchedulerError, SchedulerUnreachable

# Shown to people: "Slurm no longer knows the job", "cancel them (scancel)".
LABEL = "Slurm"
CANCEL_COMMAND = "scancel"

# States after which a job never runs again (squeue --states=all shows them for MinJobAge seconds).
ENDED_STATES = frozenset(
    {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL", "DEADLINE"}
)

_START_HINT = (
    "start Slurm or point SLURM_CONF at the cluster's slurm.conf; for the test cluster on this machine: "
    'eval "$(bash scripts/slurm-local.sh start)"'
)


@dataclass(frozen=True)
class SlurmOptions:
    """What every batch job of one build asks Slurm for."""

    partition: str | None = None
    account: str | None = None
    time_limit: str | None = None
    cpus_per_task: int | None = None
    gpus: int | None = None
    extra: tuple[str, ...] = ()

    def sbatch_args(self) -> list[str]:
        """The options as sbatch arguments, the user's own (--sbatch-arg) last so that they win."""
        args = []
        if self.partition:
            args.append(f"--partition={self.partition}")
        if self.account:
            args.append(f"--account={self.account}")
        if self.time_limit:
            args.append(f"--time={self.time_limit}")
        if self.cpus_per_task is not None:
            args.append(f"--cpus-per-task={self.cpus_per_task}")
        if self.gpus is not None:
            args.append(f"--gpus={self.gpus}")
        return args + list(self.extra)


# The adapter's options type, under the name every adapter uses (channelsmith.scheduler.backend).
Options = SlurmOptions


def _run(args: Sequence[str]) -> subprocess.CompletedProcess[str]:
    return run_command(args, _START_HINT)


def _message(proc: subprocess.CompletedProcess[str]) -> str:
    return first_message(proc, ("sbatch: error: ", "scontrol: error: ", "squeue: error: ", "scancel: error: "))


def check_cluster(options: SlurmOptions) -> None:
    """Raise SchedulerError unless Slurm answers and would accept jobs with ``options``; submits nothing."""
    missing = [tool for tool in ("sbatch", "squeue", "scontrol", "scancel", "sinfo") if shutil.which(tool) is None]
    if missing:
        raise SchedulerUnreachable(
            f"Slurm's commands are not on PATH: {', '.join(missing)} not found",
            hint="run on a login node of the cluster, or install Slurm's client commands (Debian: slurm-wlm)",
        )
    # A missing configuration file makes every Slurm command retry for a minute before it gives up.
    conf = os.environ.get("SLURM_CONF")
    if conf and not Path(conf).is_file():
        raise SchedulerUnreachable(f"SLURM_CONF names {conf}, which does not exist", hint=_START_HINT)
    ping = _run(["scontrol", "ping"])
    if ping.returncode != 0 or " is UP" not in ping.stdout:
        raise SchedulerUnreachable(f"Slurm's controller does not answer: {_message(ping)}", hint=_START_HINT)
    if options.partition:
        shown = _run(["scontrol", "show", "partition", options.partition])
        if shown.returncode != 0:
            listed = _run(["sinfo", "-h", "-o", "%R"]).stdout.split()
            raise SchedulerError(
                f"Slurm has no partition {options.partition!r}",
                hint=f"partitions of this cluster: {', '.join(sorted(set(listed))) or '(none)'}",
            )
    # sbatch itself judges every other option (account, time limit, GPUs, the user's own arguments).
    trial = _run(["sbatch", "--test-only", *options.sbatch_args(), "--wrap", "true"])
    if trial.returncode != 0:
        raise SchedulerError(
            f"Slurm refuses these job options: {_message(trial)}",
            hint="fix --partition/--account/--time/--cpus-per-task/--gpus/--sbatch-arg "
            f"(tried: sbatch --test-only {' '.join(options.sbatch_args())})",
        )


def submit(
    script: Path, options: SlurmOptions, log: Path, after_ok: Iterable[str] = (), name: str | None = None
) -> str:
    """Submit a batch script writing its output to ``log``; it starts only after every job in
    ``after_ok`` completed successfully.

    When one of those fails, Slurm cancels this job (``--kill-on-invalid-dep``) rather than leaving it
    pending for ever. Returns the job id; SchedulerError when sbatch refuses.
    """
    args = ["sbatch", "--parsable", f"--output={log}"]
    if name:
        args.append(f"--job-name={name}")
    waits = list(after_ok)
    if waits:
        args += [f"--dependency=afterok:{':'.join(waits)}", "--kill-on-invalid-dep=yes"]
    proc = _run([*args, *options.sbatch_args(), str(script)])
    if proc.returncode != 0:
        raise SchedulerError(
            f"sbatch refused {script}: {_message(proc)}",
            hint="check the job options: " + " ".join(options.sbatch_args()),
        )
    # --parsable prints "jobid" or "jobid;cluster".
    return proc.stdout.strip().split(";")[0]


def job_states(job_ids: Iterable[str], attempts: int = 5) -> dict[str, JobState]:
    """The jobs among ``job_ids`` that squeue still knows (ended ones stay there for MinJobAge seconds).

    squeue is asked for all of the user's jobs in every state, since naming a job Slurm has already
    forgotten makes it fail. A failing squeue (a controller restart) is retried a few times.
    """
    wanted = set(job_ids)
    if not wanted:
        return {}
    for attempt in range(attempts):
        proc = _run(["squeue", "--me", "--states=all", "--noheader", "--format=%i|%T|%r"])
        if proc.returncode == 0:
            break
        time.sleep(2**attempt)
    else:
        raise SchedulerUnreachable(f"squeue fails: {_message(proc)}", hint=_START_HINT)
    found = {}
    for line in proc.stdout.splitlines():
        job_id, _, rest = line.strip().partition("|")
        state, _, reason = rest.partition("|")
        if job_id in wanted:
            state, reason = state.strip(), reason.strip()
            found[job_id] = JobState(
                job_id, state, reason, ended=state in ENDED_STATES,
                dependency_failed=state == "CANCELLED" and "Dependency" in reason,
            )  # fmt: skip
    return found


def cancel(job_ids: Iterable[str]) -> None:
    """Cancel jobs (pending or running); SchedulerError when scancel fails."""
    ids = list(job_ids)
    if not ids:
        return
    proc = _run(["scancel", *ids])
    if proc.returncode != 0:
        raise SchedulerError(f"scancel {' '.join(ids)} failed: {_message(proc)}", hint="cancel them by hand (scancel)")
