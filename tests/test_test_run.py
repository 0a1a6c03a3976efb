"""The default test run itself (issue 38): a stuck test fails by name within the time limit, once, and
the rest of its module still runs; the limit is the project's, set above its slowest test."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
import tomllib
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent

# The repository's conftest under another module name: the run below uses its scheduler and hooks.
USE_REPO_CONFTEST = f"""
import importlib.util, sys
sys.path.insert(0, {str(REPO_ROOT / "tests")!r})
spec = importlib.util.spec_from_file_location("repo_conftest", {str(REPO_ROOT / "tests" / "conftest.py")!r})
repo_conftest = importlib.util.module_from_spec(spec)
spec.loader.exec_module(repo_conftest)
globals().update({{k: v for k, v in vars(repo_conftest).items() if k.startswith("pytest_")}})
"""

STUCK_MODULE = """
import time
def test_before():
    assert True
def test_stuck():
    time.sleep(600)
def test_after():
    assert True
"""


def test_the_limit_is_set_above_the_slowest_test_and_stops_c_code_too() -> None:
    options = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    # The slowest default test (the gloo run, DEFAULT_GLOO_RUN in conftest.py) takes about 120 s on 2 busy cores.
    assert 300 <= options["timeout"] <= 600
    assert options["timeout_method"] == "thread"


def test_a_stuck_test_fails_by_name_once_and_its_module_goes_on(tmp_path: Path) -> None:
    pytest.importorskip("pytest_timeout", reason="pytest-timeout is not installed (`pip install -e '.[test]'`)")
    pytest.importorskip("xdist", reason="pytest-xdist is not installed (`pip install -e '.[test]'`)")
    (tmp_path / "conftest.py").write_text(USE_REPO_CONFTEST)
    (tmp_path / "test_stuck.py").write_text(textwrap.dedent(STUCK_MODULE))
    # As a user's run starts: not inside a worker (this test may run in one), the project's pytest options.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    # Two workers (the scheduler gives one back: no idle unit here); the stuck test's ends, a new one goes on.
    env["CHANNELSMITH_TEST_WORKERS"] = "2"
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-c", str(REPO_ROOT / "pyproject.toml"), "--rootdir", str(tmp_path),
         "-p", "no:cacheprovider", "-o", "timeout=3", str(tmp_path / "test_stuck.py")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    elapsed = time.monotonic() - started
    summary = [line for line in proc.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert summary == [s for s in summary if "test_stuck.py::test_stuck" in s] and len(summary) == 1, proc.stdout[-3000:]
    assert "2 passed" in proc.stdout.splitlines()[-1], proc.stdout[-3000:]
    assert "ran longer than the per-test limit of 3 s" in proc.stdout and "test_stuck.py\", line 6 in test_stuck" in proc.stdout, proc.stdout
    assert elapsed < 120


@pytest.mark.parametrize(("selection", "ran"), [
    pytest.param("time_limit", 1, id="the idle unit alone"),
    pytest.param("slurm or other", 3, id="three units, the idle one among them, for three workers"),
])  # fmt: skip
def test_a_selection_of_fewer_units_than_workers_runs(tmp_path: Path, selection: str, ran: int) -> None:
    # Issue 73: `-k "slurm and not pbs"` ended in INTERNALERROR (StopIteration in the scheduler) and ran
    # nothing: the idle unit's worker takes two units, and the last worker found the queue empty.
    pytest.importorskip("xdist", reason="pytest-xdist is not installed (`pip install -e '.[test]'`)")
    (tmp_path / "conftest.py").write_text(USE_REPO_CONFTEST)
    (tmp_path / "tests").mkdir()
    # The idle unit's test id as the repository's conftest names it (tests/test_slurm.py::...).
    (tmp_path / "tests" / "test_slurm.py").write_text(
        "def test_a_job_killed_for_its_time_limit_says_so_and_what_to_raise():\n    pass\n"
        "def test_another_slurm_test():\n    pass\n")  # fmt: skip
    (tmp_path / "tests" / "test_other.py").write_text("def test_other():\n    pass\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["CHANNELSMITH_TEST_WORKERS"] = "3"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-c", str(REPO_ROOT / "pyproject.toml"), "--rootdir", str(tmp_path),
         "-p", "no:cacheprovider", "-k", selection, "tests"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0 and "INTERNALERROR" not in proc.stdout + proc.stderr, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"{ran} passed" in proc.stdout.splitlines()[-1], proc.stdout[-3000:]
