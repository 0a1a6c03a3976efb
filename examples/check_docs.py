"""Check that every code block the docs show as an example equals its file, and count the docs' blocks.

Run from the repository root: ``python examples/check_docs.py [--update]``. It prints the counts CONTRIBUTING.md states,
lists the blocks that are neither an example nor marked (each one a user might run that no test runs), and
exits 1 when a marked block differs from its file or names a file that does not exist, when a figure's
command or output is outside the verification records, or when a relative link is dead; ``--update`` first
rewrites every example block from its file. The convention
(examples/README.md):

- ``<!-- example: examples/NAME -->`` on the line before a fence: the block is that file, whole and exact;
- ``<!-- excerpt: PATH -->`` on the line before a fence: a fragment shown in prose; each of its lines (each
  command of a line joined with `` && ``) is a line of PATH (an example file, or ``.ci/run``), in order, with
  the same indentation relative to each other;
- info string ``text``: output, a file tree, a format or a command's synopsis (``[...]`` optional parts),
  not something to run as it stands;
- ``<!-- figure -->`` on the line before a fence: the command behind figures in the docs, run on the
  machine the figures name (GPU nodes, or a CPU host for the gloo figures), not by the tests;
- ``<!-- output -->`` on the line before a fence: what such a command printed.

Figures live in the verification records (docs/records/): a ``figure`` or ``output`` block anywhere else
is a problem, as is a relative link (``[text](path#anchor)``) to a file or heading that does not exist.

An example that needs what a machine may lack says so in a line of its own, ``# needs: WORD, WORD``
(WORDs from ``NEEDS``); its test skips with that reason where one is missing, and the count says how many
blocks need what.
"""

from __future__ import annotations

import re
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
EXAMPLE = re.compile(r"^<!-- example: (\S+) -->$")
EXCERPT = re.compile(r"^<!-- excerpt: (\S+) -->$")
FIGURE = "<!-- figure -->"
OUTPUT = "<!-- output -->"
RECORDS = "docs/records/"
LINK = re.compile(r"\]\(([^)\s]+)\)")
NEEDS_LINE = re.compile(r"^# needs: (.+)$", re.MULTILINE)
# What an example may need that a machine may lack: the word its `# needs:` line uses, and the words a
# skipped test and the count say.
NEEDS = {
    "conda-forge": "conda-forge and GitHub",
    "rattler-build": "the rattler-build CLI",
    "conda": "conda",
    "pixi": "pixi",
    "gpus": "NVIDIA GPUs",
    "cray-mpich": "Cray MPICH",
    "mpiexec": "mpiexec and torch_mpi_backend",
    "namespaces": "network namespaces (root, or unprivileged user namespaces)",
    "switchml": "torch_switchml",
    "github": "GitHub",
}


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
        """``example``, ``excerpt``, ``output``, ``figure`` or ``unmarked``."""
        if EXAMPLE.match(self.marker):
            return "example"
        if EXCERPT.match(self.marker):
            return "excerpt"
        if self.info == "text" or self.marker == OUTPUT:
            return "output"
        if self.marker == FIGURE:
            return "figure"
        return "unmarked"

    @property
    def example(self) -> str | None:
        """The file an example block is, or an excerpt block is taken from."""
        match = EXAMPLE.match(self.marker) or EXCERPT.match(self.marker)
        return match.group(1) if match else None


def docs() -> list[Path]:
    """The README, CONTRIBUTING.md and every page under docs/, its folders included."""
    return [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").rglob("*.md"))]


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
    """Whether a test module under tests/ names the example file (the tests run what they name); .ci/run
    is what CI runs."""
    return example == ".ci/run" or any(example in test.read_text() for test in (ROOT / "tests").glob("test_*.py"))


def needs(example: str) -> list[str]:
    """The words of an example file's ``# needs:`` line (none: it runs on any machine the tests run on)."""
    path = ROOT / example
    match = NEEDS_LINE.search(path.read_text()) if path.is_file() else None
    return [word.strip() for word in match.group(1).split(",")] if match else []


def _commands(text: str) -> list[tuple[int, str]]:
    """Each line's commands (a line joined with `` && `` is several), with the line's indentation."""
    found = []
    for line in textwrap.dedent(text).splitlines():
        if line.strip():
            indent = len(line) - len(line.lstrip())
            found.extend((indent, command.strip()) for command in line.split(" && "))
    return found


def drift(block: Block) -> str | None:
    """Why an example block is not its file, or an excerpt is not in its file; None when it is."""
    assert block.example is not None
    path = ROOT / block.example
    if not path.is_file():
        return f"{block.doc}:{block.line}: {block.example} does not exist"
    unknown = [word for word in needs(block.example) if word not in NEEDS]
    if unknown:
        return f"{block.doc}:{block.line}: {block.example} needs {', '.join(unknown)}: not a word of NEEDS ({', '.join(NEEDS)})"
    if block.kind == "example":
        if path.read_text() != block.text:
            return f"{block.doc}:{block.line}: the block differs from {block.example}"
        return None
    lines = path.read_text().splitlines()
    at, offset = 0, None
    for indent, command in _commands(block.text):
        for i in range(at, len(lines)):
            line = lines[i]
            if line.strip() == command and offset in (None, len(line) - len(line.lstrip()) - indent):
                offset = len(line) - len(line.lstrip()) - indent
                at = i + 1
                break
        else:
            return f"{block.doc}:{block.line}: {command!r} is not a line of {block.example} (in this order)"
    return None


def misplaced(block: Block) -> str | None:
    """Why a block marked as a figure's command or output is out of place (outside the verification records);
    None when it is not such a block or is in a record."""
    if block.marker not in (FIGURE, OUTPUT) or block.doc.startswith(RECORDS):
        return None
    what = "a figure's command" if block.marker == FIGURE else "a figure's output"
    return f"{block.doc}:{block.line}: {what} outside {RECORDS} (move it into a record there and link to it)"


def anchors(path: Path) -> set[str]:
    """The anchors a Markdown renderer makes for the headings of ``path`` (GitHub's rule: lower case, spaces
    to hyphens, punctuation other than hyphens and underscores dropped; a repeated one gets -1, -2, ...)."""
    found: set[str] = set()
    fenced = False
    for line in path.read_text().splitlines():
        if FENCE.match(line) or line.strip() == "```":
            fenced = not fenced
            continue
        heading = re.match(r"^#{1,6} (.+)$", line)
        if fenced or not heading:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
        unique, n = slug, 0
        while unique in found:
            n += 1
            unique = f"{slug}-{n}"
        found.add(unique)
    return found


def dead_links(path: Path) -> list[str]:
    """The relative links of ``path`` (outside code blocks) whose file or heading does not exist."""
    dead, fenced = [], False
    doc = str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if FENCE.match(line) or line.strip() == "```":
            fenced = not fenced
            continue
        if fenced:
            continue
        for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):
                continue  # a URL
            file, _, anchor = target.partition("#")
            linked = (path.parent / file).resolve() if file else path
            if not linked.exists():
                dead.append(f"{doc}:{number}: {target}: no such file")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                dead.append(f"{doc}:{number}: {target}: no such heading")
    return dead


def update(path: Path) -> int:
    """Rewrite every example block of ``path`` from its file (an existing file only); how many changed."""
    lines = path.read_text().splitlines(keepends=True)
    changed = 0
    for block in reversed(blocks(path)):
        if block.kind != "example" or not (ROOT / block.example).is_file() or drift(block) is None:
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
    runnable: int  # examples, excerpts and unmarked: what a user is meant to run or copy
    run_by_tests: int
    needing: dict[str, int]  # of those the tests run: how many need each NEEDS word (skipped where it is missing)
    needing_any: int  # of those the tests run: how many need anything
    figures: int
    output: int
    unmarked: list[Block]

    @property
    def run_anywhere(self) -> int:
        return self.run_by_tests - self.needing_any


def count(all_blocks: list[Block]) -> Counts:
    """The counts CONTRIBUTING.md states."""
    marked = [b for b in all_blocks if b.kind in ("example", "excerpt")]
    unmarked = [b for b in all_blocks if b.kind == "unmarked"]
    run = [b for b in marked if b.example is not None and run_by_tests(b.example)]
    needing: dict[str, int] = {}
    for b in run:
        for word in needs(b.example or ""):
            needing[word] = needing.get(word, 0) + 1
    return Counts(
        runnable=len(marked) + len(unmarked),
        run_by_tests=len(run),
        needing={word: needing[word] for word in NEEDS if word in needing},
        needing_any=sum(1 for b in run if needs(b.example or "")),
        figures=sum(1 for b in all_blocks if b.kind == "figure"),
        output=sum(1 for b in all_blocks if b.kind == "output"),
        unmarked=unmarked,
    )


def status_line(counts: Counts) -> str:
    """The sentence CONTRIBUTING.md carries (a test compares the two)."""
    needing = "; ".join(f"{NEEDS[word]}: {n}" for word, n in counts.needing.items())
    return (f"{counts.run_by_tests} of the {counts.runnable} runnable code blocks in README.md, CONTRIBUTING.md and docs/ are examples "
            f"(or excerpts of them) that the tests or CI run: {counts.run_anywhere} on this machine, "
            f"{counts.needing_any} only where what they need is there ({needing or 'none'}), skipped here; "
            f"{counts.figures} more are the commands behind figures and {counts.output} are output.")  # fmt: skip


def main(argv: list[str]) -> int:
    if argv == ["--update"]:
        for path in docs():
            if update(path):
                print(f"updated: {path.relative_to(ROOT)}")
    elif argv:
        print("usage: python examples/check_docs.py [--update]  (--update: rewrite example blocks from their files)")
        return 2
    all_blocks = [b for path in docs() for b in blocks(path)]
    problems = [p for b in all_blocks if b.kind in ("example", "excerpt") for p in [drift(b)] if p]
    out_of_place = [p for b in all_blocks for p in [misplaced(b)] if p]
    links = [p for path in docs() for p in dead_links(path)]
    counts = count(all_blocks)
    print(status_line(counts))
    for b in counts.unmarked:
        first = b.text.splitlines()[0] if b.text else ""
        print(f"unmarked: {b.doc}:{b.line}: {first[:90]}")
    for problem in problems:
        print(f"drift: {problem}")
    for problem in out_of_place:
        print(f"misplaced: {problem}")
    for problem in links:
        print(f"dead link: {problem}")
    return 1 if problems or out_of_place or links else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
