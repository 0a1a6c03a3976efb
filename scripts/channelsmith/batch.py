"""What every batch system adapter (channelsmith.slurm, channelsmith.pbs) shares: the state of one job
in words the rest of channelsmith understands, and running a client command with a bound.

An adapter is a module with the same functions (see channelsmith.scheduler.backend): it checks the
cluster, submits a script, reads job states and cancels jobs. Everything else of a scheduled build
(the plan, the state file, the collection, the publish) is the same for every batch system.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass

from channelsmith.errors import SchedulerError, SchedulerUnreachable

# Seconds a client command may take before the server counts as unreachable.
COMMAND_TIMEOUT_S = 60


@dataclass(frozen=True)
class JobState:
    """One job as the batch system shows it.

    ``state`` is shown to people as it is (Slurm's words, or PBS's translated to them: PENDING,
    RUNNING, COMPLETED, FAILED, CANCELLED); ``ended`` says it will never run again;
    ``dependency_failed`` that the batch system removed it because a job it waited for failed;
    ``killed`` that the batch system ended it itself (a time limit, a deletion, a node failure, a
    preemption, its memory), whatever the job wrote before; ``requeues`` how many times the batch
    system put it back in the queue after it had started (a node failure, a preemption, a requeue
    by hand): it then runs again from its start.
    """

    job_id: str
    state: str
    reason: str
    ended: bool
    dependency_failed: bool = False
    killed: bool = False
    requeues: int = 0


def run_command(args: Sequence[str], hint: str) -> subprocess.CompletedProcess[str]:
    """Run a client command; SchedulerUnreachable (with ``hint``) when it is missing or does not answer in time."""
    try:
        return subprocess.run(list(args), capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    except FileNotFoundError:
        # `--collect` from a login without the batch system's commands.
        raise SchedulerUnreachable(f"{args[0]} is not on PATH", hint=hint) from None
    except subprocess.TimeoutExpired:
        raise SchedulerUnreachable(
            f"`{' '.join(args)}` did not answer within {COMMAND_TIMEOUT_S} s", hint=hint
        ) from None


def first_message(proc: subprocess.CompletedProcess[str], prefixes: Sequence[str] = ()) -> str:
    """The first line a failed command printed, without the command's own prefix."""
    lines = [line.strip() for line in (proc.stderr + "\n" + proc.stdout).splitlines() if line.strip()]
    text = lines[0] if lines else f"exit code {proc.returncode}"
    for prefix in prefixes:
        text = text.removeprefix(prefix)
    return text


_HMS = re.compile(r"(\d+):([0-5]\d):([0-5]\d)")


def time_limit_seconds(text: str, flag: str = "--time") -> int:
    """A job's time limit given as HH:MM:SS, in seconds; SchedulerError for anything else.

    Shorter forms are refused rather than guessed: Slurm reads "02:00" as two minutes (MM:SS) and a
    bare "30" as thirty minutes, PBS reads both as seconds.
    """
    match = _HMS.fullmatch(text.strip())
    if match is None:
        raise SchedulerError(
            f"{flag} {text!r} is not HH:MM:SS (hours, minutes and seconds, minutes and seconds below 60)",
            hint=f"give e.g. {flag} 00:30:00 for 30 minutes, {flag} 02:00:00 for two hours",
        )
    hours, minutes, seconds = (int(g) for g in match.groups())
    return hours * 3600 + minutes * 60 + seconds
