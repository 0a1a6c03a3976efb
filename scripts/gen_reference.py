"""Write the generated references: docs/reference/cli.md (every command and option, from the parsers) and
docs/reference/packages.md (the packages each recipe makes, from `channelsmith plan --json`).

Run from anywhere, with channelsmith's dependencies importable (the repository's virtual environment):
``python3 scripts/gen_reference.py`` rewrites both; ``--check`` writes nothing and exits 1 naming each file that
differs from what the code gives now (tests/test_reference.py does the same). The output depends on the code
and the recipes alone: no terminal width, Python version's usage layout, home directory or clock.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CLI_MD = Path("docs/reference/cli.md")
PACKAGES_MD = Path("docs/reference/packages.md")
COMMAND = "python3 scripts/gen_reference.py"


def parsers() -> list[tuple[str, argparse.ArgumentParser]]:
    """Every command a user runs, with its parser: channelsmith's and each of its subcommands, the acceptance
    suite, and the suite's tables."""
    from channelsmith.cli import build_parser as channelsmith_parser
    from torch_dist_check.cli import build_parser as suite_parser
    from torch_dist_check.report.tables import parser as tables_parser

    found: list[tuple[str, argparse.ArgumentParser]] = []
    for top in (channelsmith_parser(), suite_parser(), tables_parser()):
        found += list(_walk(top.prog, top))
    return found


def _walk(name: str, parser: argparse.ArgumentParser) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _walk(f"{name} {sub_name}", sub)


def options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The options and arguments a parser documents: not the subcommand list, not hidden aliases."""
    return [
        a for a in parser._actions if not isinstance(a, argparse._SubParsersAction) and a.help is not argparse.SUPPRESS
    ]


def deprecated(parser: argparse.ArgumentParser) -> list[tuple[str, str]]:
    """(old spelling, the one to use) of each hidden alias that still parses."""
    return [
        (option, action.replacement)
        for action in parser._actions
        if getattr(action, "replacement", None)
        for option in action.option_strings
    ]


def synopsis(parser: argparse.ArgumentParser) -> str:
    """The command's shape: its required options, the others as [OPTION ...], its arguments. Made here rather
    than by argparse, whose usage lines differ between Python versions (and are coloured from 3.14)."""
    words = [parser.prog]
    shown = [a for a in parser._actions if a.help is not argparse.SUPPRESS]
    words += [_spelling(a, code=False) for a in shown if a.option_strings and a.required]
    if any(a.option_strings and not a.required for a in shown):
        words.append("[OPTION ...]")
    for action in shown:
        if action.option_strings:
            continue
        name = action.metavar or action.dest
        if isinstance(action, argparse._SubParsersAction):
            words.append(f"{name} ...")
        elif action.nargs == "*":
            words.append(f"[{name} ...]")
        elif action.nargs == argparse.REMAINDER:
            words.append("[-- ARGUMENT ...]")
        else:
            words.append(name)
    return " ".join(words)


def help_text(action: argparse.Action) -> str:
    """An option's help with its %(default)s-style fields filled in, as argparse fills them."""
    fields = {name: value for name, value in vars(action).items() if value is not argparse.SUPPRESS}
    if fields.get("choices") is not None:
        fields["choices"] = ", ".join(str(c) for c in fields["choices"])
    return (action.help or "") % fields


def _cell(text: str) -> str:
    """Text for a Markdown table cell: no pipe, emphasis or tag read into it."""
    for raw, escaped in (("\\", "\\\\"), ("|", "\\|"), ("*", "\\*"), ("__", "\\_\\_"), ("<", "&lt;")):
        text = text.replace(raw, escaped)
    return " ".join(text.split())


def _code(text: str) -> str:
    """Text as a code span in a Markdown table cell: only a pipe needs escaping there."""
    return "`" + " ".join(text.split()).replace("|", "\\|") + "`"


def _default(action: argparse.Action) -> str:
    value = action.default
    if value is None or value is False or value == [] or value is argparse.SUPPRESS or action.nargs == 0:
        return ""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, (list, tuple)):
        value = ",".join(str(v) for v in value)
    return _code(str(value))


def _spelling(action: argparse.Action, code: bool = True) -> str:
    """How an option or argument is written: its flags and its value's name (as a code span for the table)."""
    shape = _code if code else str
    if not action.option_strings:
        return shape(action.metavar or action.dest)
    flags = ", ".join(action.option_strings) if code else max(action.option_strings, key=len)
    if action.nargs == 0:
        return shape(flags)
    metavar = action.metavar or action.dest.upper()
    if isinstance(metavar, tuple):
        metavar = " ".join(metavar)
    if action.choices is not None and action.metavar is None:
        metavar = "{" + ",".join(str(c) for c in action.choices) + "}"
    shown = f"[{metavar}]" if action.nargs == "?" else metavar
    return shape(f"{flags} {shown}")


def command_section(name: str, parser: argparse.ArgumentParser) -> list[str]:
    """One command's part of cli.md: what it does, its usage, its options, its examples and exit statuses."""
    lines = [f"## `{name}`", ""]
    if parser.description:
        lines += [" ".join(parser.description.split()), ""]
    lines += ["```text", synopsis(parser), "```", ""]
    shown = options(parser)
    if shown:
        lines += ["| option | default | meaning |", "| --- | --- | --- |"]
        lines += [f"| {_spelling(a)} | {_default(a)} | {_cell(help_text(a))} |" for a in shown]
        lines.append("")
    old = deprecated(parser)
    if old:
        lines += ["Deprecated spellings, still accepted with a warning on stderr: "
                  + "; ".join(f"`{o}` (use `{n}`)" for o, n in old) + ".", ""]  # fmt: skip
    if parser.epilog:
        lines += ["```text", parser.epilog.strip("\n"), "```", ""]
    return lines


def cli_reference() -> str:
    """docs/reference/cli.md."""
    commands = parsers()
    lines = [
        "# Command-line reference",
        "",
        f"Generated from the parsers by `{COMMAND}`; do not edit it by hand (tests/test_reference.py fails when "
        "it differs from what the code gives). Each command's `--help` says the same; `python -m "
        "torch_dist_check --help` shows its common options only, `--help-all` every one, as here.",
        "",
    ]
    lines += [f"- [`{name}`](#{_anchor(name)})" for name, _ in commands]
    lines.append("")
    for name, parser in commands:
        lines += command_section(name, parser)
    return "\n".join(lines).rstrip("\n") + "\n"


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but hyphens dropped, spaces to hyphens."""
    kept = "".join(c for c in heading.lower() if c.isalnum() or c in " -_")
    return kept.replace(" ", "-")


def packages_reference(root: Path = ROOT) -> str:
    """docs/reference/packages.md, from the document `channelsmith plan --json` prints."""
    from channelsmith.cli.plan import plan_document
    from channelsmith.plan import make_plan

    document = plan_document(make_plan(root, [], {}))
    lines = [
        "# Packages each recipe makes",
        "",
        f"Generated from `channelsmith plan --json` by `{COMMAND}`; do not edit it by hand (tests/test_reference.py "
        "fails when it differs from what the recipes give). Every recipe x variant combination of "
        "conda_build_config.yaml and the recipes' variants.yaml, rendered offline for linux-64: "
        f"{document['packages']} packages, {document['heavy_compiles']} heavy compiles. `channelsmith plan RECIPE "
        "--variant KEY=VALUE` shows a part of it.",
        "",
        "| recipe | packages | names | variant combinations | heavy compiles | builds offline |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for recipe in document["recipes"]:
        names = ", ".join(f"`{n}`" for n in sorted({row["package"] for row in recipe["rows"]}))
        offline = "yes" if all(row["offline"] for row in recipe["rows"]) else "no: needs conda-forge and the network"
        lines.append(f"| [{recipe['recipe']}](#{_anchor(recipe['recipe'])}) | {len(recipe['rows'])} | {names} | "
                     f"{recipe['combinations']} | {len(recipe['compiles'])} | {offline} |")  # fmt: skip
    lines.append("")
    for recipe in document["recipes"]:
        lines += [f"## {recipe['recipe']}", ""]
        lines += ["| package | version | build string | variant | patches | compile |", "| --- | --- | --- | --- | --- | --- |"]
        rows = sorted(recipe["rows"], key=lambda r: (r["package"], _version_key(r["version"]), _variant(r), r["build_string"]))
        for row in rows:
            lines.append(f"| `{row['package']}` | {row['version']} | `{row['build_string']}` | {_code(_variant(row))} | "
                         f"{row['patches']} | {row['compile'] or '-'} |")  # fmt: skip
        lines.append("")
    return "\n".join(lines).rstrip("\n") + "\n"


def _variant(row: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in row["distinguishing"].items())


def _version_key(version: str) -> tuple[tuple[int, str], ...]:
    """2.6.0 before 2.15.0: numbers compare as numbers."""
    return tuple((int(part), "") if part.isdigit() else (-1, part) for part in version.split("."))


def generated(root: Path = ROOT) -> dict[Path, str]:
    """Each generated file (relative to the repository root) and the text it must hold."""
    return {CLI_MD: cli_reference(), PACKAGES_MD: packages_reference(root)}


def stale(root: Path, texts: dict[Path, str]) -> list[Path]:
    """The files of ``texts`` (relative to ``root``) that are missing or hold another text."""
    return [
        path for path, text in texts.items()
        if not (root / path).is_file() or (root / path).read_text() != text
    ]  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=COMMAND,
        description="Write docs/reference/cli.md and docs/reference/packages.md from the code.",
        epilog=f"examples:\n  {COMMAND}\n  {COMMAND} --check\n\nexit status:\n  0    written (--check: up to date)\n"
        "  1    --check: a file differs (named on stderr)\n  2    bad input (an unknown option)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 when a file differs (default: write)")
    args = parser.parse_args(argv)
    if args.check:
        differ = stale(ROOT, generated())
        for path in differ:
            print(f"{path} differs from what the code gives: run {COMMAND}", file=sys.stderr)
        return 1 if differ else 0
    for path, text in generated().items():
        target = ROOT / path
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(target.name + ".tmp")
        tmp.write_text(text)
        tmp.replace(target)
        print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
