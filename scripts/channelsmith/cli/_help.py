"""What every command's `--help` shares: examples and exit statuses after the options, and old option
spellings that still work.

A command's epilog is built by :func:`epilog` from its examples and its exit statuses, so that each
`--help` ends the same way and a test can read both back. :class:`HelpFormatter` wraps the description
as argparse does but keeps the epilog's lines (a command line must not be re-flowed).
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from collections.abc import Sequence
from typing import Any

EXAMPLES_HEADING = "examples:"
EXIT_HEADING = "exit status:"
# The statuses every channelsmith command shares (channelsmith.errors): a user mistake, an environment
# failure, an interrupt. Each command adds 0 and 1 with what they mean for it.
USER_ERROR = (2, "bad input (an unknown recipe, a bad option or value, ...): a message and a hint, nothing written")
ENVIRONMENT = (3, "the environment failed (a channel, source or batch system that does not answer, a full disk)")
INTERRUPTED = (130, "interrupted (Ctrl-C): the message says what was left as it was")
# Exit status lines are wrapped to this width: the epilog is printed as written, whatever the terminal.
_EPILOG_WIDTH = 79


class HelpFormatter(argparse.HelpFormatter):
    """argparse's formatter, except that an epilog or description paragraph whose lines are indented is
    printed as written (examples, the exit status table); other paragraphs are wrapped as usual."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        paragraphs = []
        for paragraph in text.split("\n\n"):
            if paragraph.startswith(" ") or "\n " in paragraph:
                paragraphs.append("\n".join(indent + line for line in paragraph.splitlines()))
            else:
                paragraphs.append(super()._fill_text(paragraph, width, indent))
        return "\n\n".join(paragraphs)


def epilog(examples: Sequence[str], statuses: Sequence[tuple[int, str]]) -> str:
    """The text after a command's options: its example command lines, then each exit status and its meaning
    (wrapped under the meaning's first word: the epilog is printed as written)."""
    lines = [EXAMPLES_HEADING]
    lines += [f"  {example}" for example in examples]
    lines += ["", EXIT_HEADING]
    for code, meaning in statuses:
        lines += textwrap.wrap(meaning, width=_EPILOG_WIDTH, initial_indent=f"  {code:<5}", subsequent_indent=" " * 7)
    return "\n".join(lines)


def add_command(
    subparsers: argparse._SubParsersAction,
    name: str,
    *,
    summary: str,
    description: str,
    examples: Sequence[str],
    statuses: Sequence[tuple[int, str]],
) -> argparse.ArgumentParser:
    """A command's parser: ``summary`` in the list of commands, ``description`` above its options, and the
    epilog made of ``examples`` and ``statuses`` below them."""
    return subparsers.add_parser(
        name,
        help=summary,
        description=description,
        epilog=epilog(examples, statuses),
        formatter_class=HelpFormatter,
    )


class DeprecatedAlias(argparse.Action):
    """An old spelling of an option: stores into the new option's destination and says on stderr, once
    per use, which spelling to use instead. Hidden from `--help`; the new option's help names it."""

    def __init__(self, option_strings: list[str], dest: str, *, replacement: str, **kwargs: Any) -> None:
        self.replacement = replacement
        kwargs.setdefault("help", argparse.SUPPRESS)
        super().__init__(option_strings, dest, **kwargs)

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option_string: str | None = None
    ) -> None:
        sys.stderr.write(
            f"{parser.prog}: warning: {option_string} is deprecated and will be removed; use {self.replacement}\n"
        )
        setattr(namespace, self.dest, values)

