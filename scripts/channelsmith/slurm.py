"""Slurm, through its own commands: check the cluster, submit batch jobs, read their states, cancel them.

Nothing here knows about recipes; channelsmith.scheduler decides what each job runs. Only the client
commands every Slurm site has are used (sbatch, squeue, scontrol, scancel): no accounting database
(sacct) is assumed, so a job that has left squeue is judged by the files it wrote (its log keeps the
line slurmstepd writes when it kills a job). Where sacct answers, it names who cancelled a job.
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import subprocess
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from channelsmith.batch import JobState, first_message, run_command
from channelsmith.errors import JobOptionsRefused, SchedulerError, SchedulerUnreachable

# Shown to people: "Slurm no longer knows the job", "cancel them (scancel)".
LABEL = "Slurm"
CANCEL_COMMAND = "scancel"

# States after which a job never runs again (squeue --states=all shows them for MinJobAge seconds).
ENDED_STATES = frozenset(
    {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL", "DEADLINE"}
)

# The ended states the job's own exit status decides (0: COMPLETED, else FAILED); in every other one
# Slurm ended the job itself.
_ENDED_BY_THE_JOB = frozenset({"COMPLETED", "FAILED"})
# squeue's fields: id, state, reason, time limit and how often Slurm requeued the job (RestartCnt, which
# only --Format has), each ended by "|" ("0": no width limit, a reason is never cut short).
_SQUEUE_FIELDS = "JobID:0|,State:0|,Reason:0|,TimeLimit:0|,RestartCnt:0|"

# Why Slurm ended a job without its result, by the state squeue shows (Slurm's job_state_string()).
# TIMEOUT and CANCELLED get more words from the job itself (its time limit, who cancelled it).
_KILL_CAUSES = {
    "NODE_FAIL": "a node of the job failed (NODE_FAIL); submit it again",
    "PREEMPTED": "preempted by a job of higher priority (PREEMPTED); submit it again",
    "OUT_OF_MEMORY": "ran out of memory (OUT_OF_MEMORY); ask for more with --sbatch-arg=--mem=...",
    "BOOT_FAIL": "its node failed to boot (BOOT_FAIL); submit it again",
    "DEADLINE": "reached its deadline before it could end (DEADLINE)",
}
# The line slurmstepd writes into a job's output when it kills the job (src/slurmd/slurmstepd/req.c,
# "*** JOB %u ON %s CANCELLED AT %s DUE TO TIME LIMIT ***", "... DUE TO NODE FAILURE, SEE SLURMCTLD LOG
# FOR DETAILS ***"; a scancel has no "DUE TO"): the cause once
# squeue has forgotten the job.
_STEPD_KILL = re.compile(r"\*\*\* JOB \d+ (?:ON \S+ )?CANCELLED AT \S+(?: DUE TO ([A-Z ]*[A-Z]))?")
# srun's own line when slurmctld tells it a node of the step failed (src/api/step_launch.c, _node_fail_handler:
# error("Node failure on %s", ...)). A job whose batch script ends on its own once srun gives up on the step is
# requeued with no slurmstepd kill line in its log (seen on the test cluster: "srun: error: Node failure on vm",
# the script's last lines, then the requeue).
_SRUN_NODE_FAIL = re.compile(r"^srun: error: Node failure on \S+", re.MULTILINE)
_STEPD_CAUSES = {
    "TIME LIMIT": "exceeded its time limit; raise --time",
    "PREEMPTION": "preempted by a job of higher priority (PREEMPTED); submit it again",
    "NODE FAILURE": "a node of the job failed (NODE_FAIL); submit it again",
}

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
        tried = f"sbatch --test-only {' '.join(options.sbatch_args())}"
        raise JobOptionsRefused(
            f"Slurm refuses these job options: {_message(trial)}",
            hint=f"fix --partition/--account/--time/--cpus-per-task/--gpus/--sbatch-arg (tried: {tried})",
            tried=tried,
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
        raise JobOptionsRefused(
            f"sbatch refused {script}: {_message(proc)}",
            hint="check the job options: " + " ".join(options.sbatch_args()),
            tried=" ".join(["sbatch", *options.sbatch_args()]),
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
        proc = _run(["squeue", "--me", "--states=all", "--noheader", f"--Format={_SQUEUE_FIELDS}"])
        if proc.returncode == 0:
            break
        time.sleep(2**attempt)
    else:
        raise SchedulerUnreachable(f"squeue fails: {_message(proc)}", hint=_START_HINT)
    found = {}
    for line in proc.stdout.splitlines():
        job_id, state, reason, limit, restarts = (line.strip().split("|") + ["", "", "", ""])[:5]
        if job_id in wanted:
            state, reason = state.strip(), reason.strip()
            dependency_failed = state == "CANCELLED" and "Dependency" in reason
            if not dependency_failed:
                reason = _kill_cause(job_id, state, limit.strip()) or reason
            ended = state in ENDED_STATES
            found[job_id] = JobState(
                job_id, state, reason, ended=ended, dependency_failed=dependency_failed,
                killed=ended and state not in _ENDED_BY_THE_JOB and not dependency_failed,
                requeues=int(restarts) if restarts.strip().isdigit() else 0,
            )  # fmt: skip
    return found


def _kill_cause(job_id: str, state: str, limit: str) -> str | None:
    """Why Slurm killed the job, in words that say what to change; None unless Slurm killed it."""
    if state == "TIMEOUT":
        return f"exceeded its time limit {time_limit_hms(limit)}; raise --time"
    if state == "CANCELLED":
        user = cancelled_by(job_id)
        if user is None:
            return "deleted (scancel); Slurm names who only with accounting (sacct)"
        return f"deleted (scancel) by {user}"
    return _KILL_CAUSES.get(state)


def time_limit_hms(limit: str) -> str:
    """squeue's time limit ("1:00", "2:00:00", "1-00:00:00") as HH:MM:SS; other text unchanged."""
    match = re.fullmatch(r"(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+)", limit)
    if not match:
        return limit
    days, hours, minutes, seconds = (int(g) if g else 0 for g in match.groups())
    return f"{days * 24 + hours:02d}:{minutes:02d}:{seconds:02d}"


# Who cancelled each ended job, once sacct has said it (a waiting command asks squeue every few seconds).
_CANCELLED_BY: dict[str, str] = {}


def cancelled_by(job_id: str) -> str | None:
    """Who cancelled the job, from Slurm's accounting ("CANCELLED by UID" in sacct); None without it."""
    if job_id in _CANCELLED_BY:
        return _CANCELLED_BY[job_id]
    try:
        proc = subprocess.run(["sacct", "--noheader", "--parsable2", "--allocations", "--jobs", job_id,
                               "--format=State"], capture_output=True, text=True, timeout=30)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.search(r"CANCELLED by (\d+)", proc.stdout) if proc.returncode == 0 else None
    if match is None:
        return None
    uid = int(match.group(1))
    try:
        user = pwd.getpwuid(uid).pw_name
    except KeyError:
        user = f"uid {uid}"
    _CANCELLED_BY[job_id] = user
    return user


def kill_cause_in_log(text: str) -> str | None:
    """Why Slurm killed a job, from the line slurmstepd wrote into its log, else srun's node failure line; None
    when there is neither."""
    match = _STEPD_KILL.search(text)
    if match is None:
        return _STEPD_CAUSES["NODE FAILURE"] if _SRUN_NODE_FAIL.search(text) else None
    cause = match.group(1)
    if cause is None:
        return "deleted (scancel)"
    return _STEPD_CAUSES.get(cause, f"killed by Slurm ({cause.lower()})")


def cancel(job_ids: Iterable[str]) -> None:
    """Cancel jobs (pending or running); SchedulerError when scancel fails."""
    ids = list(job_ids)
    if not ids:
        return
    proc = _run(["scancel", *ids])
    if proc.returncode != 0:
        raise SchedulerError(f"scancel {' '.join(ids)} failed: {_message(proc)}", hint="cancel them by hand (scancel)")
