"""What every batch system adapter (channelsmith.slurm, channelsmith.pbs) shares: the state of one job
in words the rest of channelsmith understands, and running a client command with a bound.

An adapter is a module with the same functions (see channelsmith.scheduler.backend): it checks the
cluster, submits a script, reads job states and cancels jobs. Everything else of a scheduled build
(the plan, the state file, the collection, the publish) is the same for every batch system.
"""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from dataclasses import dataclass

from channelsmith.errors import SchedulerUnreachable

# Seconds a client command may take before the server counts as unreachable.
COMMAND_TIMEOUT_S = 60


@dataclass(frozen=True)
class JobState:
    """One job as the batch system shows it.

    ``state`` is shown to people as it is (Slurm's words, or PBS's translated to them: PENDING,
    RUNNING, COMPLETED, FAILED, CANCELLED); ``ended`` says it will never run again;
    ``dependency_failed`` that the batch system removed it because a job it waited for failed.
    """

    job_id: str
    state: str
    reason: str
    ended: bool
    dependency_failed: bool = False


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
