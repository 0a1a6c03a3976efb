"""`channelsmith plan`: every recipe x variant, rendered offline, with the compiles it needs."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from channelsmith.cli._help import INTERRUPTED, add_command
from channelsmith.cli._output import Output, to_jsonable
from channelsmith.plan import Plan, make_plan
from channelsmith.recipes import find_root, parse_overrides


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(
        subparsers,
        "plan",
        summary="show every package each recipe builds, per variant, and the heavy compiles (offline)",
        description="Render every recipe x variant combination offline from conda_build_config.yaml "
        "and each recipe's variants.yaml; show packages, build strings, distinguishing variant values, "
        "patch counts and the heavy compiles (a staging compile shared by several outputs is listed once). "
        "Writes nothing.",
        examples=(
            "channelsmith plan pytorch-nccl-fault",
            "channelsmith plan --variant site=derecho --json > plan.json",
        ),
        statuses=(
            (0, "the plan was shown"),
            (2, "bad input: an unknown recipe, a --variant key or value the matrix does not have, a recipe "
             "that does not render"),
            INTERRUPTED,
        ),
    )
    parser.add_argument("recipes", nargs="*", metavar="RECIPE", help="recipes to plan (default: all)")
    parser.add_argument(
        "--variant", action="append", default=[], metavar="KEY=VALUE",
        help="keep only the combinations where KEY is VALUE (repeatable; default: the whole matrix)",
    )  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print the plan as JSON on stdout")
    parser.set_defaults(handler=run, interrupted=interrupted)


def run(args: argparse.Namespace, out: Output) -> int:
    root = Path(args.root).resolve() if args.root else find_root()
    plan = make_plan(root, args.recipes, parse_overrides(args.variant))
    if out.json_mode:
        out.json(plan_document(plan))
        return 0
    present(plan, out)
    return 0


def plan_document(plan: Plan) -> dict[str, Any]:
    """The --json document: the counts, then every recipe's rows and compiles (docs/reference/packages.md
    is generated from it)."""
    return {"packages": plan.packages, "heavy_compiles": plan.heavy_compiles, "recipes": to_jsonable(plan.recipes)}


def compile_order(compile_id: str | None) -> tuple[str, int]:
    """Sort key of a compile id in number order (recipe#C2 before recipe#C10); rows without one first."""
    if not compile_id:
        return ("", -1)
    stem = compile_id.rstrip("0123456789")
    return (stem, int(compile_id[len(stem) :] or 0))


def interrupted(args: argparse.Namespace) -> str:
    """What a Ctrl-C left: plan renders in memory and writes nothing."""
    return "interrupted; plan writes nothing, so nothing changed"


def present(plan: Plan, out: Output) -> None:
    """Tables for people: one per recipe, then its heavy compiles, then a summary line."""
    for recipe in plan.recipes:
        out.table(
            f"{recipe.recipe}: {len(recipe.rows)} packages from {recipe.combinations} variant combinations",
            ("package", "version", "build string", "variant", "patches", "compile"),
            (
                (
                    row.package,
                    row.version,
                    row.build_string,
                    " ".join(f"{k}={v}" for k, v in row.distinguishing.items()),
                    row.patches,
                    row.compile or "-",
                )
                for row in sorted(recipe.rows, key=lambda r: (compile_order(r.compile), r.package, r.build_string))
            ),
        )
        if recipe.compiles:
            out.table(
                f"{recipe.recipe}: heavy compiles",
                ("compile", "what", "variant", "reused by"),
                (
                    (
                        c.id,
                        f"{c.kind} {c.name}",
                        " ".join(f"{k}={v}" for k, v in c.variant.items()),
                        f"{len(c.outputs)} package(s)",
                    )
                    for c in recipe.compiles
                ),
            )
        where = "builds offline (no channel, no download)" if recipe.offline else "needs conda-forge and network access to build"
        out.note(f"{recipe.recipe}: {where}")
    out.note(f"{plan.packages} packages, {plan.heavy_compiles} heavy compiles")
