"""The layout of scripts/ (issue 58): no module too long to read, and torch_dist_check in folders named for
their concerns, whose documented commands still run.

`python -m torch_dist_check` is the options and the dispatch (cli); the harness (launch, rendezvous,
placement, backends, progress, the run of the checks), the checks, the peer-loss lab, the stand-in nodes
and the report each have a folder. `python -m torch_dist_check.tables` stays where the docs name it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from test_imports import import_circles, import_graph

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
SUITE = SCRIPTS / "torch_dist_check"
MAX_LINES = 700
CONCERNS = {"harness", "checks", "peerloss", "nodes", "report"}


def long_modules(root: Path, limit: int) -> dict[str, int]:
    """Every Python file under ``root`` longer than ``limit`` lines, by its path relative to ``root``."""
    counts = {str(path.relative_to(root)): len(path.read_text().splitlines()) for path in sorted(root.rglob("*.py"))}
    return {name: count for name, count in counts.items() if count > limit}


def suite_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(SCRIPTS), os.environ.get("PYTHONPATH", "")])}


def test_no_module_under_scripts_is_over_700_lines():
    too_long = long_modules(SCRIPTS, MAX_LINES)
    assert too_long == {}, "split by concern: " + ", ".join(f"scripts/{name} has {n} lines" for name, n in too_long.items())


def test_a_module_over_the_limit_is_named(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "short.py").write_text("x = 1\n" * 3)
    (tmp_path / "pkg" / "long.py").write_text("x = 1\n" * 4)
    assert long_modules(tmp_path, 3) == {os.path.join("pkg", "long.py"): 4}


def test_torch_dist_check_keeps_each_concern_in_its_own_package():
    folders = {p.name for p in SUITE.iterdir() if p.is_dir() and any(p.glob("*.py"))}
    assert folders == CONCERNS
    # A package each (setuptools' find and the recipe's imports see only folders with an __init__.py).
    assert all((SUITE / name / "__init__.py").is_file() for name in CONCERNS)
    top = sorted(p.name for p in SUITE.glob("*.py"))
    assert top == ["__init__.py", "__main__.py", "cli.py", "tables.py"]


def test_only_the_command_line_imports_the_command_line_and_nothing_imports_in_a_circle():
    graph = import_graph(SUITE)
    assert "torch_dist_check.harness.run" in graph and "torch_dist_check.peerloss.judges" in graph
    assert import_circles(graph) == []
    upward = {module for module, targets in graph.items() if "torch_dist_check.cli" in targets}
    assert upward == {"torch_dist_check.__main__"}


def test_the_documented_commands_still_start():
    for module in ("torch_dist_check", "torch_dist_check.tables"):
        done = subprocess.run([sys.executable, "-m", module, "--help"], env=suite_env(), capture_output=True, text=True,
                              timeout=120)  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert f"usage: python -m {module} " in done.stdout


def test_the_peerloss_workers_start_as_the_modules_their_launchers_name():
    # The launchers start them with `python -m NAME`; --help parses and exits before torch is needed.
    for module in ("torch_dist_check.checks.fault_worker", "torch_dist_check.peerloss.worker",
                   "torch_dist_check.peerloss.train_worker", "torch_dist_check.peerloss.hsdp_worker"):  # fmt: skip
        done = subprocess.run([sys.executable, "-m", module, "--help"], env=suite_env(), capture_output=True, text=True,
                              timeout=120)  # fmt: skip
        assert done.returncode == 0, (module, done.stderr)
        assert f"usage: python -m {module}" in done.stdout


def test_the_test_extras_declare_numpy_that_the_peerloss_workers_need_and_torch_does_not_bring():
    """The peer-loss workers hash through ``Tensor.numpy()`` (tests call ``hsdp_worker.replay`` in process), and
    PyTorch's wheels do not require NumPy (2.15.0's run raised "Numpy is not available" without it, issue 72)."""
    import importlib.metadata
    import re
    import tomllib

    uses = sorted(str(p.relative_to(SUITE)) for p in (SUITE / "peerloss").glob("*.py") if ".numpy()" in p.read_text())
    assert uses, "no worker uses Tensor.numpy(): drop numpy from the test extras"
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    declared = {re.split(r"[\s;<>=!~\[]", requirement)[0].lower() for requirement in extras}
    try:
        torch_requires = [r for r in importlib.metadata.requires("torch") or [] if "extra ==" not in r]
    except importlib.metadata.PackageNotFoundError:
        torch_requires = []
    brought = {re.split(r"[\s;<>=!~\[]", requirement)[0].lower() for requirement in torch_requires}
    assert "numpy" in declared | brought, f"{uses} need numpy; add it to pyproject.toml's test extras"
