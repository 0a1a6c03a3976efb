"""Check that every code block the docs show as an example equals its file, and count the docs' blocks.

Run from the repository root: ``python examples/check_docs.py [--update]``. It prints the counts the README states,
lists the blocks that are neither an example nor marked (each one a user might run that no test runs), and
exits 1 when a marked block differs from its file or names a file that does not exist; ``--update`` first
rewrites every example block from its file. The convention
(examples/README.md):

- ``<!-- example: examples/NAME -->`` on the line before a fence: the block is that file, whole and exact;
- info string ``text``: output, a file tree or a format, not something to run;
- ``<!-- figure -->`` on the line before a fence: the command behind a figure in the docs, run on the
  machine the figure names (GPU nodes), not by the tests.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
EXAMPLE = re.compile(r"^<!-- example: (\S+) -->$")
FIGURE = "<!-- figure -->"


@dataclass(frozen=True)
class Block:
    """One fenced code block of a Markdown file."""

    doc: str  # path relative to the repository root
    line: int  # the opening fence's line, from 1
    info: str
    marker: str  # the line before the fence
    text: str  # the block's lines, each with its newline

    @property
    def kind(self) -> str:
        """``example``, ``output``, ``figure`` or ``unmarked``."""
        if EXAMPLE.match(self.marker):
            return "example"
        if self.info == "text":
            return "output"
        if self.marker == FIGURE:
            return "figure"
        return "unmarked"

    @property
    def example(self) -> str | None:
        match = EXAMPLE.match(self.marker)
        return match.group(1) if match else None


def docs() -> list[Path]:
    """The README and every page under docs/."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of ``path``, in order."""
    lines = path.read_text().splitlines(keepends=True)
    found, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i].rstrip("\n"))
        if not opening:
            i += 1
            continue
        end = i + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        marker = lines[i - 1].strip() if i > 0 else ""
        doc = str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)
        found.append(Block(doc, i + 1, opening.group(2), marker, "".join(lines[i + 1 : end])))
        i = end + 1
    return found


def run_by_tests(example: str) -> bool:
    """Whether a test module under tests/ names the example file (the tests run what they name)."""
    return any(example in test.read_text() for test in (ROOT / "tests").glob("test_*.py"))


def drift(block: Block) -> str | None:
    """Why an example block is not its file; None when it is."""
    assert block.example is not None
    path = ROOT / block.example
    if not path.is_file():
        return f"{block.doc}:{block.line}: {block.example} does not exist"
    if path.read_text() != block.text:
        return f"{block.doc}:{block.line}: the block differs from {block.example}"
    return None


def update(path: Path) -> int:
    """Rewrite every example block of ``path`` from its file (an existing file only); how many changed."""
    lines = path.read_text().splitlines(keepends=True)
    changed = 0
    for block in reversed(blocks(path)):
        if block.example is None or not (ROOT / block.example).is_file() or drift(block) is None:
            continue
        body = (ROOT / block.example).read_text().splitlines(keepends=True)
        start = block.line  # the line after the opening fence, from 0
        lines[start : start + len(block.text.splitlines())] = body
        changed += 1
    if changed:
        path.write_text("".join(lines))
    return changed


@dataclass(frozen=True)
class Counts:
    runnable: int  # examples + unmarked: what a user is meant to run or copy
    run_by_tests: int
    figures: int
    output: int
    unmarked: list[Block]


def count(all_blocks: list[Block]) -> Counts:
    """The counts the README's status states."""
    examples = [b for b in all_blocks if b.kind == "example"]
    unmarked = [b for b in all_blocks if b.kind == "unmarked"]
    return Counts(
        runnable=len(examples) + len(unmarked),
        run_by_tests=sum(1 for b in examples if b.example is not None and run_by_tests(b.example)),
        figures=sum(1 for b in all_blocks if b.kind == "figure"),
        output=sum(1 for b in all_blocks if b.kind == "output"),
        unmarked=unmarked,
    )


def status_line(counts: Counts) -> str:
    """The sentence the README carries (a test compares the two)."""
    return (f"{counts.run_by_tests} of the {counts.runnable} runnable code blocks in README.md and docs/ are examples "
            f"that the tests run; {counts.figures} more are the commands behind GPU figures and {counts.output} are "
            "output.")  # fmt: skip


def main(argv: list[str]) -> int:
    if argv == ["--update"]:
        for path in docs():
            if update(path):
                print(f"updated: {path.relative_to(ROOT)}")
    elif argv:
        print("usage: python examples/check_docs.py [--update]  (--update: rewrite example blocks from their files)")
        return 2
    all_blocks = [b for path in docs() for b in blocks(path)]
    problems = [p for b in all_blocks if b.kind == "example" for p in [drift(b)] if p]
    counts = count(all_blocks)
    print(status_line(counts))
    for b in counts.unmarked:
        first = b.text.splitlines()[0] if b.text else ""
        print(f"unmarked: {b.doc}:{b.line}: {first[:90]}")
    for problem in problems:
        print(f"drift: {problem}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
