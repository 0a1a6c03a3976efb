"""The modules of scripts/channelsmith import in layers: no import circle, and only `cli` looks at `cli`.

Every `import` statement counts, also one inside a function: a deferred import hides a circle from
Python's loader but not from a reader, and it is how the circle between `cli.build` and
`cli._scheduled` had been kept working.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "scripts" / "channelsmith"


def module_files(package_dir: Path) -> dict[str, Path]:
    """Every module of the package under ``package_dir``, by dotted name (a package by its own name)."""
    top = package_dir.name
    modules = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = [top, *path.relative_to(package_dir).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def imported_modules(path: Path, known: set[str]) -> set[str]:
    """The package's modules that one file imports, wherever the import statement stands."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in known)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                # `from pkg import mod` imports the module pkg.mod; `from mod import name` the module mod.
                submodule = f"{node.module}.{alias.name}"
                if submodule in known:
                    found.add(submodule)
                elif node.module in known:
                    found.add(node.module)
    return found


def import_graph(package_dir: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (itself left out)."""
    modules = module_files(package_dir)
    known = set(modules)
    return {name: imported_modules(path, known) - {name} for name, path in modules.items()}


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every group of modules that import each other, directly or round a circle (Tarjan's components)."""
    index: dict[str, int] = {}
    lowlink: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = lowlink[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in sorted(graph.get(module, ())):
            if target not in index:
                visit(target)
                lowlink[module] = min(lowlink[module], lowlink[target])
            elif target in on_stack:
                lowlink[module] = min(lowlink[module], index[target])
        if lowlink[module] == index[module]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == module:
                    break
            if len(group) > 1:
                circles.append(sorted(group))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return circles


def test_channelsmith_has_no_import_circle():
    graph = import_graph(PACKAGE_DIR)
    assert "channelsmith.cli.build" in graph and "channelsmith.patches.parsing" in graph  # the walk saw the package
    assert import_circles(graph) == []


def test_only_the_command_line_imports_the_command_line():
    graph = import_graph(PACKAGE_DIR)
    upward = {
        module: sorted(t for t in targets if t.startswith("channelsmith.cli"))
        for module, targets in graph.items()
        if not module.startswith("channelsmith.cli") and module != "channelsmith.__main__"
    }
    assert {module: targets for module, targets in upward.items() if targets} == {}


def test_a_circle_through_a_deferred_import_is_found(tmp_path):
    package = tmp_path / "pkg"
    (package / "cli").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "cli" / "__init__.py").write_text("")
    (package / "cli" / "build.py").write_text("from pkg.cli import _scheduled\n")
    (package / "cli" / "_scheduled.py").write_text("def present():\n    from pkg.cli.build import run\n")
    (package / "errors.py").write_text("import os\n")
    assert import_circles(import_graph(package)) == [["pkg.cli._scheduled", "pkg.cli.build"]]


def _reached(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module ``start`` imports, directly or through others."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        for target in graph.get(todo.pop(), ()):
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def test_the_lock_lies_below_deploy_and_the_bundle_and_packing_does_not_go_through_deploy():
    graph = import_graph(PACKAGE_DIR)
    assert "channelsmith.lock" in graph["channelsmith.deploy"]
    assert "channelsmith.lock" in graph["channelsmith.bundle.packing"]
    assert "channelsmith.lock" in graph["channelsmith.cli.pack"]
    above = {m for m in graph if m.startswith(("channelsmith.deploy", "channelsmith.bundle", "channelsmith.cli"))}
    assert _reached(graph, "channelsmith.lock") & above == set()
    # pack's walk goes one way: the command line, the bundle, the lock; deploy is not on it.
    assert "channelsmith.deploy" not in _reached(graph, "channelsmith.bundle.packing")
    assert "channelsmith.deploy" not in graph["channelsmith.cli.pack"]


def test_the_command_line_imports_its_modules_with_the_collector_paused_then_frozen():
    # main() builds its parser (every command module and the libraries they use) with the cycle collector
    # paused, then freezes what is alive; the collector runs again for what the command makes.
    code = (
        "import gc, json\nimport channelsmith.cli as cli\nfrozen = gc.get_freeze_count()\n"
        "try:\n    cli.main(['--version'])\nexcept SystemExit:\n    pass\n"
        "print(json.dumps([frozen, gc.get_freeze_count(), gc.isenabled()]))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    before, after, collecting = json.loads(done.stdout.splitlines()[-1])
    assert before == 0 and after > 10_000 and collecting is True
