"""The one error family for user mistakes.

Every mistake a user can make (bad recipe, unknown recipe, patch that does not apply, corrupt
package, ...), and every failure of the environment (unreachable channel, full disk), raises a
:class:`UserError` with a message saying what is wrong and where, and a hint saying what to change. The CLI prints it in a few lines and exits with the error's
``exit_code``: 2 for a mistake in the input, 3 for an :class:`EnvironmentFailure` (the machine, its
network or its disk stop the command, not what the user asked for). Tracebacks are for bugs only.
"""

from __future__ import annotations

EXIT_USER_ERROR = 2
EXIT_ENVIRONMENT = 3


class UserError(Exception):
    """A mistake the user can fix; never a bug in channelsmith."""

    exit_code = EXIT_USER_ERROR

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message}\nhint: {self.hint}"


class RecipeError(UserError):
    """A recipe is missing, malformed or does not render."""


class VariantError(UserError):
    """A variant key or value is unknown or malformed."""


class PatchError(UserError):
    """A patch is missing, has no header, or does not apply."""


class SourceError(UserError):
    """An upstream source tree could not be obtained or is the wrong one."""


class ChannelError(UserError):
    """A channel directory is not a channel, is corrupt, or holds a corrupt package."""


class SolveError(UserError):
    """Specs do not solve against the channels given."""


class DeployError(UserError):
    """A prefix cannot be written or a lock file is unusable."""


class ExpansionError(UserError):
    """A package archive expands past what it records (a decompression bomb), or cannot be read."""


class BuildError(UserError):
    """A recipe failed to build or its tests failed."""


class VerifyError(UserError):
    """The acceptance suite could not be run against a prefix."""


class SchedulerError(UserError):
    """The cluster's scheduler is unreachable, refuses the job options, or holds an unfinished build."""


class JobOptionsRefused(SchedulerError):
    """The batch system refuses a job's options (sbatch --test-only, qsub); ``tried`` is the batch
    system's own arguments, so that a command can name which of its options they came from."""

    def __init__(self, message: str, hint: str | None = None, tried: str = "") -> None:
        super().__init__(message, hint)
        self.tried = tried


class EnvironmentFailure(UserError):
    """The environment stops the command, not its input: a channel, a source or the scheduler that cannot
    be reached, a disk without room. The same command may succeed elsewhere or later (exit code 3)."""

    exit_code = EXIT_ENVIRONMENT


class UnreachableError(EnvironmentFailure):
    """A channel, an upstream source or the scheduler does not answer from this machine."""


class DiskSpaceError(EnvironmentFailure):
    """A file system lacks the room the planned work needs."""


class SchedulerUnreachable(SchedulerError, UnreachableError):
    """The scheduler's commands are missing or its controller does not answer (exit code 3)."""
