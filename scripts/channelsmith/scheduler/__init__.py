"""Builds as batch jobs of the cluster's scheduler (Slurm or PBS), published all at once when every job succeeded.

The engine calls are the ones a direct build makes (channelsmith.build.plan_jobs), grouped into units:
the calls that share one engine output directory (a staging compile and every Python version reusing
it) form one unit, every other call a unit of its own. Each unit is one batch job that builds into its
own directory below the build directory and publishes nothing; the build directory, the repository and
the channel directory must therefore be on a file system the compute nodes share. A unit waits
(afterok) for every unit that builds a package one of its outputs requires (a build, host or run
requirement the package matches: nccl before the PyTorch flavors), and for the unit that builds an
output it renders too (a noarch library every Python version pins); their output directories are its
channels, right after the local channel.

The build directory holds ``state.json`` (the request and every unit with its job id) and, per unit,
``units/<id>/`` with the job script, its log, and the job's ``result.json``. Whoever can read it can
collect: the command that submitted, or ``channelsmith build --collect DIR`` after a logout. Collecting
waits until no job is pending or running; when every unit has a successful result, all their packages
are published with channelsmith.channel.publish in one go, as a direct build publishes; otherwise the
channel is not touched. Submitting the same build again keeps the units that succeeded or still run
and submits the others afresh.

One module per concern, each importing only the ones above it in this list:

- ``backend``: the batch systems (channelsmith.slurm, channelsmith.pbs: the one place they differ);
- ``state``: the build directory (state file, each unit's files, the lock);
- ``planning``: the engine calls grouped into units, in dependency order;
- ``status``: where each unit stands (squeue or qstat, then its files);
- ``submitting``: one batch job per unit;
- ``collecting``: waiting for the jobs (``watch``, which verifying uses too), then one publish; cancelling;
- ``job``: the batch job itself, run as ``python -m channelsmith.scheduler BUILD_DIR UNIT_ID``;
- ``verifying``: the acceptance suite as one batch job (``channelsmith verify --scheduler``), its state in a run
  directory, waited for as a unit is and judged by the batch system's account first (a kill, a requeue), then by
  the suite's report; run as ``python -m channelsmith.scheduler --verify RUN_DIR``.
"""

from channelsmith.scheduler.collecting import ScheduledReport, StatusObserver, cancel, collect, poll_interval
from channelsmith.scheduler.job import run_unit
from channelsmith.scheduler.planning import plan_units
from channelsmith.scheduler.state import DEFAULT_BUILD_DIR, BuildRequest, ScheduledBuild, Unit, load
from channelsmith.scheduler.status import IN_CHANNEL, UnitStatus, unit_statuses
from channelsmith.scheduler.submitting import submit

__all__ = [
    "DEFAULT_BUILD_DIR",
    "IN_CHANNEL",
    "BuildRequest",
    "ScheduledBuild",
    "ScheduledReport",
    "StatusObserver",
    "Unit",
    "UnitStatus",
    "cancel",
    "collect",
    "load",
    "plan_units",
    "poll_interval",
    "run_unit",
    "submit",
    "unit_statuses",
]
