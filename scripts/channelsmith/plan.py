"""What a build would make: every recipe x variant combination, rendered offline.

The plan names every package each recipe produces, the variant values that tell its builds apart,
the patches applied, and the heavy compiles: a staging output (e.g. the libtorch compile) that
several outputs share is listed once, with the outputs that reuse it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from channelsmith.recipes import (
    PER_PYTHON_KEYS,
    RecipeRender,
    RenderedOutput,
    render_recipe,
    select_recipes,
)


@dataclass(frozen=True)
class Compile:
    """One heavy compile: a staging output, or an output that builds on its own."""

    recipe: str
    id: str
    kind: str  # "staging" (shared compile) or "output" (compiled for that package alone)
    name: str
    variant: dict[str, str]
    outputs: tuple[str, ...]


@dataclass(frozen=True)
class PlanRow:
    """One package of the plan."""

    recipe: str
    package: str
    version: str
    build_string: str
    distinguishing: dict[str, str]
    patches: int
    compile: str | None
    offline: bool


@dataclass
class RecipePlan:
    """The plan of one recipe."""

    recipe: str
    combinations: int
    rows: list[PlanRow] = field(default_factory=list)
    compiles: list[Compile] = field(default_factory=list)

    @property
    def offline(self) -> bool:
        """True when every package builds with no channel and no download."""
        return all(row.offline for row in self.rows)


@dataclass
class Plan:
    """The plan of every requested recipe."""

    recipes: list[RecipePlan]

    @property
    def packages(self) -> int:
        return sum(len(r.rows) for r in self.recipes)

    @property
    def heavy_compiles(self) -> int:
        return sum(len(r.compiles) for r in self.recipes)


def _distinguishing_keys(outputs: Iterable[RenderedOutput]) -> list[str]:
    """Variant keys whose value differs between the recipe's outputs."""
    outputs = list(outputs)
    keys = {k for o in outputs for k in o.variant}
    return sorted(k for k in keys if len({o.variant.get(k) for o in outputs}) > 1)


def _is_compiled(output: RenderedOutput) -> bool:
    """An output compiles code of its own when it is not noarch and has a build-time toolchain."""
    return output.noarch is None and bool(output.requirements.get("build"))


def plan_recipe(rendered: RecipeRender) -> RecipePlan:
    """The plan rows and heavy compiles of one rendered recipe."""
    outputs = rendered.outputs
    sibling_names = {o.name for o in outputs}
    # A pin on a sibling output (pytorch -> libtorch) follows from the other keys; it distinguishes nothing.
    keys = [k for k in _distinguishing_keys(outputs) if k not in sibling_names]
    plan = RecipePlan(recipe=rendered.recipe.name, combinations=len(rendered.combinations))
    # py-rattler-build 0.73 keys a staging cache on the build prefix, which holds the output's name:
    # every output name that inherits a staging output re-runs its compile once, and the outputs of
    # that name (one per Python version) share it. So one compile per (staging identity, output name).
    staging_ids: dict[tuple[str, str], str] = {}
    staging_members: dict[tuple[str, str], list[RenderedOutput]] = {}
    for output in outputs:
        for staging in output.staging:
            staging_members.setdefault((staging.key, output.name), []).append(output)
    for index, (key, members) in enumerate(staging_members.items(), start=1):
        compile_id = f"{rendered.recipe.name}#S{index}"
        staging_ids[key] = compile_id
        first = members[0]
        shared = {k: v for k, v in sorted(first.variant.items()) if k in keys and k not in PER_PYTHON_KEYS}
        plan.compiles.append(
            Compile(
                recipe=rendered.recipe.name,
                id=compile_id,
                kind="staging",
                name=f"{first.staging[0].name} (for {first.name})",
                variant=shared,
                outputs=tuple(f"{o.name} {o.build_string}" for o in members),
            )
        )
    for output in outputs:
        compile_ref: str | None = None
        if output.staging:
            compile_ref = ", ".join(staging_ids[(s.key, output.name)] for s in output.staging)
        elif _is_compiled(output):
            compile_id = f"{rendered.recipe.name}#C{len(plan.compiles) + 1}"
            plan.compiles.append(
                Compile(
                    recipe=rendered.recipe.name,
                    id=compile_id,
                    kind="output",
                    name=output.name,
                    variant={k: output.variant[k] for k in keys if k in output.variant},
                    outputs=(f"{output.name} {output.build_string}",),
                )
            )
            compile_ref = compile_id
        plan.rows.append(
            PlanRow(
                recipe=rendered.recipe.name,
                package=output.name,
                version=output.version,
                build_string=output.build_string,
                distinguishing={k: output.variant[k] for k in keys if k in output.variant},
                patches=len(output.patches),
                compile=compile_ref,
                offline=not output.needs_channels and not output.remote_sources,
            )
        )
    return plan


def make_plan(root: Path, recipe_names: Iterable[str] = (), overrides: Mapping[str, str] | None = None) -> Plan:
    """Render every requested recipe (all when none is named) and plan its builds; needs no network."""
    recipes = select_recipes(root, recipe_names)
    return Plan(recipes=[plan_recipe(render_recipe(root, recipe, overrides)) for recipe in recipes])
