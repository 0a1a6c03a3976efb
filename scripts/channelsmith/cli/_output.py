"""Presentation shared by every command: rich for people, JSON for scripts."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from channelsmith.errors import UserError


def to_jsonable(value: Any) -> Any:
    """Dataclasses, paths, tuples and sets turned into plain JSON values."""
    if is_dataclass(value) and not isinstance(value, type):
        return {k: to_jsonable(v) for k, v in asdict(value).items()}
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


class Output:
    """Where a command's results go: a rich console, or one JSON document on stdout with --json.

    In JSON mode, human-oriented messages (progress, notes) go to stderr so stdout stays parseable.
    """

    def __init__(self, json_mode: bool = False) -> None:
        self.json_mode = json_mode
        self.console = self._console(stderr=json_mode)
        self.err_console = self._console(stderr=True)

    @staticmethod
    def _console(stderr: bool) -> Console:
        # Logs and pipes get wide tables instead of rich's 80-column default, so cells are not cut.
        console = Console(stderr=stderr, highlight=False)
        if not console.is_terminal:
            console = Console(stderr=stderr, highlight=False, width=200)
        return console

    def json(self, document: Any) -> None:
        """Print one JSON document on stdout."""
        sys.stdout.write(json.dumps(to_jsonable(document), indent=2, sort_keys=False) + "\n")
        sys.stdout.flush()

    def table(self, title: str, columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> None:
        """A summary table for people (goes to stderr in JSON mode)."""
        # At least as wide as its title (up to the console's width): a narrow table would wrap it.
        table = Table(title=title, show_lines=False, min_width=len(title))
        for column in columns:
            table.add_column(column)
        for row in rows:
            table.add_row(*("" if cell is None else str(cell) for cell in row))
        self.console.print(table)

    def note(self, message: str) -> None:
        """An informational line for people."""
        self.console.print(Text(message))

    def error(self, message: str) -> None:
        """An error line on stderr."""
        self.err_console.print(Text.assemble(("error: ", "bold red"), message))

    def user_error(self, exc: UserError) -> None:
        """A user mistake: the message, then the hint saying what to change."""
        self.err_console.print(Text.assemble(("error: ", "bold red"), exc.message))
        if exc.hint:
            self.err_console.print(Text.assemble(("hint: ", "bold"), exc.hint))

    @contextmanager
    def steps(self, title: str) -> Iterator[Callable[[str], None]]:
        """Long work shown step by step on stderr (stdout and --json stay the results'): rich's live
        progress line where stderr is a terminal, one line per step elsewhere (a log, CI).

        Yields the function to call with each step as it starts.
        """
        if not self.err_console.is_terminal:
            started = time.monotonic()

            def line(step: str) -> None:
                self.err_console.print(Text(f"{title}: {step} (at {time.monotonic() - started:.1f} s)"))

            yield line
            return
        progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            TimeElapsedColumn(),
            console=self.err_console,
            transient=True,
        )
        task = progress.add_task(escape(title), total=None)
        with progress:
            yield lambda step: progress.update(task, description=escape(f"{title}: {step}"))
