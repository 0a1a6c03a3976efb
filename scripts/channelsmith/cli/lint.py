"""`channelsmith lint`: check the recipe rules of docs/reference/recipes.md."""

from __future__ import annotations

import argparse
from pathlib import Path

from channelsmith.cli._help import INTERRUPTED, add_command
from channelsmith.cli._output import Output
from channelsmith.lint import lint_all
from channelsmith.recipes import find_root

EXIT_FINDINGS = 1


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(
        subparsers,
        "lint",
        summary="check sources, checksums, patch headers, tests, licenses and shell scripts of recipes",
        description="Check every rule of docs/reference/recipes.md; a rule that needs upstream source missing from the "
        "source cache is listed as not checked, not as a finding. Writes nothing.",
        examples=("channelsmith lint", "channelsmith lint pytorch-cray-mpich --json"),
        statuses=(
            (0, "clean (the checks not made are listed)"),
            (EXIT_FINDINGS, "a rule is broken: each finding says where and what to change"),
            (2, "bad input: an unknown recipe, a recipe that cannot be read, shellcheck not installed"),
            INTERRUPTED,
        ),
    )
    parser.add_argument("recipes", nargs="*", metavar="RECIPE", help="recipes to lint (default: all)")
    parser.add_argument("--json", action="store_true", help="print the findings as JSON on stdout")
    parser.set_defaults(handler=run, interrupted=interrupted)


def run(args: argparse.Namespace, out: Output) -> int:
    root = Path(args.root).resolve() if args.root else find_root()
    result = lint_all(root, args.recipes)
    findings = result.findings
    if out.json_mode:
        out.json({"clean": not findings, "findings": findings, "unchecked": result.unchecked})
        return EXIT_FINDINGS if findings else 0
    if result.unchecked:
        # Not findings: these rules need upstream source that is not in the source cache here.
        out.table(
            f"{len(result.unchecked)} check(s) not made",
            ("recipe", "rule", "why not"),
            ((u.recipe, u.rule, u.reason) for u in result.unchecked),
        )
    if findings:
        out.table(
            f"{len(findings)} finding(s)",
            ("recipe", "where", "rule", "what to change"),
            (
                (f.recipe, f"{_relative(f.file, root)}{':' + str(f.line) if f.line else ''}", f.rule, f.message)
                for f in findings
            ),
        )
    else:
        out.note("lint: clean" + (" (except the checks not made above)" if result.unchecked else ""))
    return EXIT_FINDINGS if findings else 0


def interrupted(args: argparse.Namespace) -> str:
    """What a Ctrl-C left: lint reads the recipes and writes nothing."""
    return "interrupted; lint writes nothing, so nothing changed"


def _relative(file: str, root: Path) -> str:
    path = Path(file)
    return str(path.relative_to(root)) if path.is_relative_to(root) else file
