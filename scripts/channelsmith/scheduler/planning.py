"""Planning: the engine calls of a build grouped into units (one batch job each), with the units each
one waits for, in dependency order."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

from rattler import BuildString, MatchSpec, PackageRecord

from channelsmith.build import BuildJob, channel_identities, channel_in_use, plan_jobs, shared_output
from channelsmith.errors import SchedulerError
from channelsmith.scheduler.state import BuildRequest, Identity, Unit

# Requirements that must exist before a unit runs: build and host ones to build, run ones for the tests.
REQUIREMENT_KINDS = ("build", "host", "run")


def plan_units(request: BuildRequest, jobs: Sequence[BuildJob] | None = None) -> list[Unit]:
    """The batch jobs of a build, in an order where every unit comes after the units it depends on.

    ``jobs`` are the request's engine calls when the caller has planned them already. Raises what
    plan_jobs raises for bad recipes or variants, and SchedulerError when recipes of the call require
    each other's packages in a cycle.
    """
    if jobs is None:
        jobs = plan_jobs(request.root, request.recipes, request.overrides)
    listed = channel_identities(request.channel_dir) if channel_in_use(request.channel_dir) else set()
    groups: dict[tuple[str, str], list[BuildJob]] = {}
    for index, job in enumerate(jobs):
        groups.setdefault((job.recipe.name, shared_output(job) or f"job-{index}"), []).append(job)

    owner: dict[Identity, int] = {}
    reported: set[Identity] = set()
    units: list[Unit] = []
    needs: list[set[int]] = []
    for members in groups.values():
        rendered = list(dict.fromkeys(o.identity for job in members for o in job.outputs))
        builds = [i for i in rendered if i not in listed and i not in owner]
        elsewhere = [i for i in rendered if i not in listed and i in owner]
        in_channel = [i for i in rendered if i in listed and i not in reported]
        reported.update(in_channel)
        for identity in builds:
            owner[identity] = len(units)
        needs.append({owner[i] for i in elsewhere})
        recipe = members[0].recipe.name
        variants = [dict(job.variant) for job in members]
        key = json.dumps([recipe, variants, builds], sort_keys=True)
        units.append(
            Unit(
                id=f"{recipe}-{hashlib.sha256(key.encode()).hexdigest()[:10]}",
                recipe=recipe,
                label=_unit_label(members),
                variants=variants,
                distinguishing=[dict(job.distinguishing) for job in members],
                builds=builds,
                built_elsewhere=elsewhere,
                in_channel=in_channel,
                depends_on=[],
            )
        )

    providers = [(index, _record(identity)) for identity, index in owner.items()]
    for index, members in enumerate(groups.values()):
        for spec in _requirement_specs(members):
            needs[index].update(j for j, record in providers if j != index and spec.matches(record))
    order = _dependency_order(units, needs)
    for index, unit in enumerate(units):
        unit.depends_on = [units[j].id for j in sorted(needs[index])]
    return [units[i] for i in order]


def _unit_label(members: Sequence[BuildJob]) -> str:
    """``recipe [k=v ...]``; a key whose value differs between the unit's calls lists every value."""
    values: dict[str, list[str]] = {}
    for job in members:
        for key, value in job.distinguishing.items():
            values.setdefault(key, [])
            if value not in values[key]:
                values[key].append(value)
    recipe = members[0].recipe.name
    if not values:
        return recipe
    shown = " ".join(f"{key}={','.join(found)}" for key, found in sorted(values.items()))
    return f"{recipe} [{shown}]"


def _record(identity: Identity) -> PackageRecord:
    name, version, build_string = identity
    return PackageRecord(name=name, version=version, build=BuildString(build_string), build_number=0, subdir="noarch")


def _requirement_specs(members: Sequence[BuildJob]) -> list[MatchSpec]:
    """Every plain requirement of the unit's outputs as a match spec.

    Pins (``pin_subpackage``, ``pin_compatible``) are left out: they name a sibling output, which the
    unit renders itself, or a host requirement, which is listed on its own.
    """
    specs: dict[str, MatchSpec] = {}
    for job in members:
        for output in job.outputs:
            for kind in REQUIREMENT_KINDS:
                for text in output.requirements.get(kind, ()):
                    if text.startswith("{") or text in specs:
                        continue
                    try:
                        specs[text] = MatchSpec(text)
                    except Exception:  # rattler raises its own parse error types; the engine reports them
                        continue
    return list(specs.values())


def _dependency_order(units: Sequence[Unit], needs: Sequence[set[int]]) -> list[int]:
    """Unit indices, each after every unit it needs (Kahn's algorithm); SchedulerError on a cycle."""
    waiting = {i: set(n) for i, n in enumerate(needs)}
    order: list[int] = []
    while waiting:
        ready = sorted(i for i, n in waiting.items() if not n - set(order))
        if not ready:
            stuck = ", ".join(units[i].label for i in sorted(waiting))
            raise SchedulerError(
                f"recipes of this build require each other's packages in a cycle (among: {stuck})",
                hint="build one of them first on its own, then the others against the channel",
            )
        for i in ready:
            order.append(i)
            del waiting[i]
    return order
