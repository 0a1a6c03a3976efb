"""Which stage the run is in, shown on stderr while it runs (stdout and --json stay the report's).

On a terminal, with rich importable, a live line: a spinner, rich's (pulsing) progress bar, the stage
and the time spent. Elsewhere (a batch log, a pipe, a cluster without rich), one plain line per stage.
rich is optional: the suite needs PyTorch and NumPy only.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any, TextIO


class StageProgress:
    """Shows each new stage; ``write`` shows other text (a rank's output) without breaking the line.

    Safe to call from several threads (the --nproc launcher relays its ranks' output from threads).
    """

    def __init__(self, stream: TextIO | None = None, label: str = "torch_dist_check") -> None:
        self.stream = stream or sys.stderr
        self.label = label
        self.current = ""
        self.lock = threading.Lock()
        self.started = time.monotonic()
        self.progress: Any = None
        self.task: Any = None
        if _is_terminal(self.stream):
            try:
                from rich.console import Console
                from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
            except ImportError:
                return
            self.progress = Progress(
                SpinnerColumn(),
                TextColumn("{task.description}"),
                BarColumn(),
                TimeElapsedColumn(),
                console=Console(file=self.stream),
                transient=True,
            )

    @property
    def live(self) -> bool:
        """Whether the live line is up (or will be at the first stage)."""
        return self.progress is not None

    def stage(self, name: str) -> None:
        """The run entered stage ``name`` (repeats and empty names are ignored)."""
        with self.lock:
            if not name or name == self.current:
                return
            self.current = name
            if self.progress is None:
                elapsed = time.monotonic() - self.started
                self.stream.write(f"{self.label}: stage {name} (at {elapsed:.1f} s)\n")
                self.stream.flush()
                return
            description = f"{self.label}: stage {name}"
            if self.task is None:
                self.task = self.progress.add_task(description, total=None)
                self.progress.start()
            else:
                # Drawn now, not at the next of rich's refreshes (4 a second): a stage shorter than that was
                # never shown (seen: a one-rank correctness stage with PyPI's CUDA torch).
                self.progress.update(self.task, description=description, refresh=True)

    def write(self, text: str) -> bool:
        """Print text from elsewhere above the live line; False when no line is up (the caller prints it)."""
        with self.lock:
            if self.progress is None:
                return False
            self.progress.console.print(text, end="", markup=False, highlight=False, soft_wrap=True)
            return True

    def close(self) -> None:
        """End the live line (it leaves nothing behind); later stages print plain lines."""
        with self.lock:
            if self.progress is not None and self.task is not None:
                self.progress.stop()
            self.progress = None


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
