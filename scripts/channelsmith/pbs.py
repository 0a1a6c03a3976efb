"""PBS Pro and OpenPBS, through their own commands: check the server, submit batch jobs, read their
states, cancel them. The same interface as channelsmith.slurm (channelsmith.scheduler.backend).

Only the client commands every PBS site has are used (qsub, qstat, qdel, qmgr). A finished job stays
in ``qstat -x`` while the server keeps job history (``job_history_enable``); without it, a job that
has left qstat is judged by the files it wrote, as with Slurm.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from channelsmith.batch import JobState, first_message, run_command
from channelsmith.errors import JobOptionsRefused, SchedulerError, SchedulerUnreachable

LABEL = "PBS"
CANCEL_COMMAND = "qdel"

COMMANDS = ("qsub", "qstat", "qdel", "qmgr")

_START_HINT = (
    "start the PBS server or point PBS_CONF_FILE at the cluster's pbs.conf; for the test server on this "
    'machine: eval "$(bash scripts/pbs-local.sh start)"'
)

# PBS's one-letter job states, in the words the live table uses for Slurm's (and the rest of channelsmith).
_STATES = {
    "Q": "PENDING",  # queued
    "H": "PENDING",  # held (a dependency not yet met, or a user hold)
    "W": "PENDING",  # waiting for its start time
    "T": "PENDING",  # being moved
    "B": "RUNNING",  # an array job with subjobs running
    "R": "RUNNING",
    "E": "RUNNING",  # exiting: the job's processes ended, the MoM is cleaning up
    "S": "SUSPENDED",
    "U": "SUSPENDED",
}
_REASONS = {"H": "held", "W": "waiting for its start time", "T": "moving"}
# The states of a job waiting in the queue (to run, or to run again after a requeue).
_QUEUED = frozenset({"Q", "H", "W", "T"})

# Exit_status values of PBS: negative ones are the MoM's own (the job never ran properly, or PBS killed
# it), above 256 the job was killed by signal (status - 256).
_KILLED_BY_SIGNAL = 256
# Substates of a finished job (OpenPBS's src/include/job.h): deleted (qdel), ended, ended with an error.
_SUBSTATE_TERMINATED = 91
_SUBSTATE_FAILED = 93
# The MoM's exit statuses for a job PBS itself killed or lost (JOB_EXEC_* in OpenPBS's
# src/include/job.h; src/server/svr_jobfunc.c, update_job_finish_comment(), words them "exceeded
# resource walltime" etc.), as (Slurm's word for the state, why, what to change). The walltime's own
# words come from the job's Resource_List.walltime (_kill_cause).
_JOB_EXEC_KILL_WALLTIME = -29
_KILLED_BY_PBS = {
    -14: ("NODE_FAIL", "a node of the job failed (JOB_EXEC_RERUN_SIS_FAIL)", "submit it again"),
    -20: ("NODE_FAIL", "the job's first node lost its MoM (JOB_EXEC_RERUN_MS_FAIL)", "submit it again"),
    -24: ("FAILED", "used more CPUs than it asked for (JOB_EXEC_KILL_NCPUS_BURST)", "raise ncpus in --select"),
    -25: ("FAILED", "used more CPU than it asked for (JOB_EXEC_KILL_NCPUS_SUM)", "raise ncpus in --select"),
    -26: ("OUT_OF_MEMORY", "exceeded its virtual memory (JOB_EXEC_KILL_VMEM)", "ask for more: --qsub-arg=-lvmem=..."),
    -27: ("OUT_OF_MEMORY", "exceeded its memory (JOB_EXEC_KILL_MEM)", "ask for more: --qsub-arg=-lmem=..."),
    -28: ("TIMEOUT", "exceeded its CPU time (JOB_EXEC_KILL_CPUT)", "ask for more: --qsub-arg=-lcput=..."),
}
# Who deleted a job: the server appends " and terminated by USER@HOST" to the job's comment
# (update_job_finish_comment(), called by req_delete.c with the request's user and host).
_TERMINATED_BY = re.compile(r"terminated by ([^@\s]+)(?:@\S+)?")
# What the MoM writes into a job's error stream when it kills the job for a limit (src/resmom/mom_main.c:
# "=>> PBS: job killed: walltime 26 exceeded limit 15", "mem 2048kb exceeded limit 1024kb"): the
# cause once qstat has forgotten the job.
_MOM_KILL = re.compile(r"PBS: job killed: (\w+) (\d+)\w* exceeded limit (\d+)")

# A select statement: chunks joined by "+", each "N" or "[N:]res=value[:res=value...]".
_RESOURCE = r"[A-Za-z_][A-Za-z0-9_]*=[^:+=\s]+"
_CHUNK = rf"(?:\d+|(?:\d+:)?{_RESOURCE}(?::{_RESOURCE})*)"
_SELECT = re.compile(rf"{_CHUNK}(?:\+{_CHUNK})*")
_WALLTIME = re.compile(r"(?:(?:(\d+):)?(\d+):)?(\d+)")

# Site profiles: what a site's build jobs ask for unless the options say otherwise, chosen by the
# build's `--variant site=NAME`. Derecho (NCAR): the `main` queue, 64 cores per job, and every job
# charged to a project (`-A`), which Derecho requires (as its users' scripts in issue 43 do).
SITE_PROFILES = {"derecho": {"queue": "main", "select": "1:ncpus=64", "account_required": True}}


@dataclass(frozen=True)
class PbsOptions:
    """What every batch job of one build asks PBS for."""

    queue: str | None = None
    account: str | None = None
    walltime: str | None = None
    select: str | None = None
    extra: tuple[str, ...] = ()

    def qsub_args(self) -> list[str]:
        """The options as qsub arguments, the user's own (--qsub-arg) last so that they win."""
        args = []
        if self.queue:
            args += ["-q", self.queue]
        if self.account:
            args += ["-A", self.account]
        if self.walltime:
            args += ["-l", f"walltime={self.walltime}"]
        if self.select:
            args += ["-l", f"select={self.select}"]
        return args + list(self.extra)


# The adapter's options type, under the name every adapter uses (channelsmith.scheduler.backend).
Options = PbsOptions


def with_site_profile(options: PbsOptions, site: str | None) -> PbsOptions:
    """The options with the site profile's values where the options leave them open.

    SchedulerError when the profile requires an account and none is given.
    """
    profile = SITE_PROFILES.get(site or "")
    if profile is None:
        return options
    filled = replace(
        options, queue=options.queue or profile["queue"], select=options.select or profile["select"]
    )
    if profile["account_required"] and not options.account:
        raise SchedulerError(
            f"{site} charges every job to a project, and no --account was given",
            hint=f"add --account PROJECT (the project {site}'s jobs are charged to: the -A of your qsub scripts)",
        )
    return filled


def walltime_seconds(text: str) -> int:
    """``[[HH:]MM:]SS`` in seconds; SchedulerError when it is not a walltime."""
    match = _WALLTIME.fullmatch(text.strip())
    if not match:
        raise SchedulerError(f"walltime {text!r} is not [[HH:]MM:]SS", hint="give e.g. --time 08:00:00")
    hours, minutes, seconds = (int(g) if g else 0 for g in match.groups())
    return hours * 3600 + minutes * 60 + seconds


def check_select(text: str) -> None:
    """SchedulerError unless ``text`` is a PBS select statement (``1:ncpus=64``, ``2:ncpus=64:ngpus=4``)."""
    if text.startswith("select="):
        raise SchedulerError(
            f"--select {text!r} is not a PBS select statement: it starts with 'select='",
            hint=f"give the chunks alone: --select {text.removeprefix('select=')}",
        )
    if not _SELECT.fullmatch(text):
        raise SchedulerError(
            f"--select {text!r} is not a PBS select statement",
            hint="give chunks as [N:]resource=value[:resource=value...], joined by '+', e.g. 1:ncpus=64 "
            "(without the leading select=)",
        )


def _run(args: Sequence[str]) -> subprocess.CompletedProcess[str]:
    return run_command(args, _START_HINT)


def _message(proc: subprocess.CompletedProcess[str]) -> str:
    return first_message(proc, ("qsub: ", "qstat: ", "qdel: ", "qmgr: "))


def _attributes(qmgr_output: str) -> dict[str, str]:
    """``name = value`` lines of `qmgr -c 'list ...'` as a mapping (continuation lines joined)."""
    found: dict[str, str] = {}
    last = None
    for line in qmgr_output.splitlines():
        if line.startswith(("Queue ", "Server ")) or not line.strip():
            continue
        if line.startswith("\t") and last:
            found[last] += line.strip()  # qmgr wraps long values onto lines starting with a tab
            continue
        name, sep, value = line.strip().partition(" = ")
        if sep:
            found[name] = value
            last = name
    return found


def _server_attributes() -> dict[str, str]:
    proc = _run(["qmgr", "-c", "list server"])
    if proc.returncode != 0:
        raise SchedulerUnreachable(f"the PBS server does not answer: {_message(proc)}", hint=_START_HINT)
    return _attributes(proc.stdout)


def _queues() -> list[str]:
    proc = _run(["qstat", "-Q"])
    return [line.split()[0] for line in proc.stdout.splitlines()[2:] if line.strip()]


def check_cluster(options: PbsOptions) -> None:
    """Raise SchedulerError unless the PBS server answers and would take jobs with ``options``; submits nothing.

    PBS has no trial submission (Slurm's ``sbatch --test-only``): the queue, the select statement and
    the walltime against the queue's (or server's) limit are checked here; qsub judges the rest at
    the first submission, which then submits nothing.
    """
    missing = [tool for tool in COMMANDS if shutil.which(tool) is None]
    if missing:
        raise SchedulerError(
            f"PBS's commands are not on PATH: {', '.join(missing)} not found",
            hint="run on a login node of the PBS cluster (Derecho: module load pbs, or /opt/pbs/bin on PATH); "
            "for the test server on this machine: eval \"$(bash scripts/pbs-local.sh start)\"",
        )
    if options.select is not None:
        check_select(options.select)
    walltime = walltime_seconds(options.walltime) if options.walltime else None
    server = _server_attributes()
    queue = options.queue or server.get("default_queue")
    limits = server
    if queue:
        listed = _run(["qmgr", "-c", f"list queue {queue}"])
        if listed.returncode != 0:
            raise SchedulerError(
                f"PBS has no queue {queue!r}",
                hint=f"queues of this server: {', '.join(sorted(_queues())) or '(none)'}",
            )
        attributes = _attributes(listed.stdout)
        if attributes.get("enabled", "True") != "True":
            raise SchedulerError(f"PBS's queue {queue!r} takes no jobs (enabled = False)", hint="pick another --queue")
        # The queue's limits, the server's where the queue sets none.
        limits = {**server, **{k: v for k, v in attributes.items() if k.startswith("resources_max.")}}
    limit = limits.get("resources_max.walltime")
    if walltime is not None and limit and walltime > walltime_seconds(limit):
        raise SchedulerError(
            f"walltime {options.walltime} is over the limit of queue {queue!r} ({limit})",
            hint=f"give --time {limit} or less, or pick a queue with a longer limit (qstat -Qf)",
        )


def submit(
    script: Path, options: PbsOptions, log: Path, after_ok: Iterable[str] = (), name: str | None = None
) -> str:
    """Submit a batch script writing its output to ``log``; it starts only after every job in
    ``after_ok`` completed successfully (``-W depend=afterok:...``).

    When one of those fails, PBS deletes this job rather than leaving it held for ever. The submitting
    environment is passed on (``-V``, what sbatch does by default), and the log is written where it
    is while the job runs (``-k oed``: output and error joined, kept, written directly). Returns the
    job id; SchedulerError when qsub refuses.
    """
    args = ["qsub", "-V", "-S", "/bin/bash", "-j", "oe", "-k", "oed", "-o", str(log)]
    if name:
        # PBS job names start with a letter and have no spaces.
        args += ["-N", re.sub(r"[^A-Za-z0-9_.-]", "_", name)]
    waits = list(after_ok)
    if waits:
        args += ["-W", f"depend=afterok:{':'.join(waits)}"]
    proc = _run([*args, *options.qsub_args(), str(script)])
    if proc.returncode != 0:
        raise JobOptionsRefused(
            f"qsub refused {script}: {_message(proc)}",
            hint="check the job options: " + " ".join(options.qsub_args()),
            tried=" ".join(["qsub", *options.qsub_args()]),
        )
    return proc.stdout.strip().splitlines()[-1].strip()


def _job_state(job_id: str, attributes: Mapping[str, object]) -> JobState:
    state = _job_state_once(job_id, attributes)
    # run_count: how often the server started the job. One that is queued again after it started was
    # requeued (a node failure, a preemption, qrerun) as often as it ran; one that runs or ran, once less.
    runs = _integer(attributes.get("run_count")) or 0
    queued = str(attributes.get("job_state", "?")) in _QUEUED
    return replace(state, requeues=max(0, runs if queued else runs - 1))


def _job_state_once(job_id: str, attributes: Mapping[str, object]) -> JobState:
    letter = str(attributes.get("job_state", "?"))
    comment = str(attributes.get("comment", "") or "")
    if letter in _STATES:
        return JobState(job_id, _STATES[letter], _REASONS.get(letter, comment if letter == "Q" else ""), ended=False)
    # F (finished, kept as job history), X (a finished subjob), M (moved to another server): the
    # substate says how. A job deleted with qdel is TERMINATED, whether it ran or not (its exit
    # status, when it ran, is the signal's or even 0); one that never ran and has no exit status was
    # deleted by the server because a job it depended on failed.
    substate = _integer(attributes.get("substate"))
    exit_status = _integer(attributes.get("Exit_status"))
    if substate == _SUBSTATE_TERMINATED:
        deleter = _TERMINATED_BY.search(comment)
        return JobState(job_id, "CANCELLED", f"deleted (qdel) by {deleter.group(1)}" if deleter else "deleted (qdel)",
                        ended=True, killed=True)  # fmt: skip
    if exit_status is None and "after" in str(attributes.get("depend", "")):
        return JobState(job_id, "CANCELLED", "a job it depends on failed", ended=True, dependency_failed=True)
    if exit_status == 0 and substate != _SUBSTATE_FAILED:
        return JobState(job_id, "COMPLETED", "", ended=True)
    if exit_status == _JOB_EXEC_KILL_WALLTIME:
        walltime = _resource(attributes, "walltime")
        limit = f" {walltime}" if walltime else ""
        return JobState(job_id, "TIMEOUT", f"exceeded its time limit{limit} (walltime); raise --time", ended=True,
                        killed=True)  # fmt: skip
    if exit_status in _KILLED_BY_PBS:
        state, why, change = _KILLED_BY_PBS[exit_status]
        return JobState(job_id, state, f"{why}; {change}", ended=True, killed=True)
    if exit_status is not None and exit_status > _KILLED_BY_SIGNAL:
        return JobState(job_id, "CANCELLED", f"killed by signal {exit_status - _KILLED_BY_SIGNAL}", ended=True,
                        killed=True)  # fmt: skip
    shown = "never ran" if exit_status is None else f"exit status {exit_status}"
    return JobState(job_id, "FAILED", shown, ended=True)


def _resource(attributes: Mapping[str, object], name: str) -> str | None:
    """A job's requested resource: nested in qstat's JSON, ``Resource_List.NAME`` in its text."""
    listed = attributes.get("Resource_List")
    value = listed.get(name) if isinstance(listed, Mapping) else attributes.get(f"Resource_List.{name}")
    return str(value) if value else None


def kill_cause_in_log(text: str) -> str | None:
    """Why PBS killed a job, from the line its MoM wrote into the job's log; None when there is none."""
    match = _MOM_KILL.search(text)
    if match is None:
        return None
    resource, limit = match.group(1), int(match.group(3))
    if resource == "walltime":
        hours, rest = divmod(limit, 3600)
        return f"exceeded its time limit {hours:02d}:{rest // 60:02d}:{rest % 60:02d} (walltime); raise --time"
    return f"exceeded its {resource} limit; ask for more (--qsub-arg=-l{resource}=...)"


def _integer(value: object) -> int | None:
    text = str(value) if value is not None else ""
    return int(text) if text.lstrip("-").isdigit() else None


def parse_qstat_json(text: str) -> dict[str, JobState]:
    """The jobs of `qstat -f -F json` output."""
    return {job_id: _job_state(job_id, attrs) for job_id, attrs in json.loads(text).get("Jobs", {}).items()}


def parse_qstat_full(text: str) -> dict[str, JobState]:
    """The jobs of `qstat -f` text output (servers whose qstat has no JSON: PBS Pro before 18)."""
    jobs: dict[str, dict[str, str]] = {}
    current: dict[str, str] | None = None
    last = ""
    for line in text.splitlines():
        if line.startswith("Job Id: "):
            current = jobs.setdefault(line.removeprefix("Job Id: ").strip(), {})
        elif current is not None and line.startswith("\t") and last:
            current[last] += line.strip()  # qstat wraps long values onto lines starting with a tab
        elif current is not None and " = " in line:
            last, _, value = line.strip().partition(" = ")
            current[last] = value
    return {job_id: _job_state(job_id, attrs) for job_id, attrs in jobs.items()}


def job_states(job_ids: Iterable[str], attempts: int = 5) -> dict[str, JobState]:
    """The jobs among ``job_ids`` that the server still knows, finished ones included (``-x``).

    qstat is asked for these jobs only (a site's whole queue is thousands), as JSON where its qstat has
    it (``-F json``, OpenPBS and PBS Pro 18 on). A job the server has forgotten makes qstat say
    "Unknown Job Id" and exit 153 while it still prints the others. The jobs its JSON leaves out
    without saying so are asked again as text: OpenPBS's main branch prints only the first of several
    jobs as JSON (openpbs/openpbs issue 2672; seen here), and JSON that does not parse (issue 2541:
    exported shell functions in a job's environment) is read as text too. A failing qstat (a server
    restart) is retried a few times.
    """
    wanted = sorted(set(job_ids))
    if not wanted:
        return {}
    found: dict[str, JobState] = {}
    for extra, parse in ((["-F", "json"], parse_qstat_json), ([], parse_qstat_full)):
        asked = [job_id for job_id in wanted if job_id not in found]
        proc = _qstat([*extra, *asked], attempts)
        if proc is None:
            continue  # this qstat has no JSON: the text below
        forgotten = {line.rsplit(" ", 1)[-1] for line in proc.stderr.splitlines() if "Unknown Job Id" in line}
        try:
            found.update(parse(proc.stdout))
        except ValueError:
            continue
        if all(job_id in found or job_id in forgotten for job_id in wanted):
            break
    return {job_id: state for job_id, state in found.items() if job_id in wanted}


def _qstat(args: Sequence[str], attempts: int) -> subprocess.CompletedProcess[str] | None:
    """`qstat -x -f ARGS`, retried while the server does not answer; None when qstat refuses the options."""
    for attempt in range(attempts):
        proc = _run(["qstat", "-x", "-f", *args])
        complaints = [line for line in proc.stderr.splitlines() if line.strip()]
        if proc.returncode == 0 or all("Unknown Job Id" in line for line in complaints):
            return proc
        if any(word in proc.stderr.lower() for word in ("invalid option", "usage")):
            return None
        time.sleep(2**attempt)
    raise SchedulerUnreachable(f"qstat fails: {_message(proc)}", hint=_START_HINT)


def cancel(job_ids: Iterable[str]) -> None:
    """Delete jobs (queued, held or running); one that finished meanwhile is no error."""
    ids = list(job_ids)
    if not ids:
        return
    proc = _run(["qdel", *ids])
    if proc.returncode != 0:
        lines = [line for line in (proc.stderr + proc.stdout).splitlines() if line.strip()]
        real = [line for line in lines if "has finished" not in line and "Unknown Job Id" not in line]
        if real:
            raise SchedulerError(f"qdel {' '.join(ids)} failed: {real[0]}", hint="delete them by hand (qdel)")
