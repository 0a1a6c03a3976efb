"""Long work shows progress (issue 34, point 6): `channelsmith patches compile-check` and
`scripts/install-test-deps.sh`. (`python -m torch_dist_check --nproc` has its own: test_dist_check_progress.py.)

On a terminal (a pty here) rich's live progress line; in a pipe or a log one plain line per stage, on
stderr, so that stdout and `--json` stay the results'.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ptyrun import plain, run_in_pty

REPO = Path(__file__).resolve().parents[1]
# rich's bar is drawn with this character; the plain lines never use it.
BAR = "\u2501"
# A compile-check that ends in a second: PyTorch 2.4.0 has no Debian source package and --offline
# downloads nothing, so every unit is reported skipped after the tree was looked for. One recipe: each
# recipe named is rendered to find its patched sources (all of them: 2.5 s of CPU; this one: 0.3 s).
QUICK_COMPILE_CHECK = ["patches", "compile-check", "--offline", "--version", "2.4.0", "torch-mpi-backend"]


def channelsmith(*args: str) -> list[str]:
    return [sys.executable, "-m", "channelsmith", "--root", str(REPO), *args]


def test_compile_check_shows_a_live_progress_line_on_a_terminal(tmp_path):
    code, shown = run_in_pty(channelsmith(*QUICK_COMPILE_CHECK), cwd=tmp_path)
    text = plain(shown)
    assert code == 0, text
    assert "compile-check: torch-mpi-backend (pytorch 2.4.0): finding the upstream tree" in text
    assert BAR in text
    assert "(at " not in text  # not the plain lines
    assert "patched translation units compiled" in text  # then the table


def test_compile_check_prints_a_line_per_step_in_a_pipe_and_keeps_json_on_stdout(tmp_path):
    proc = subprocess.run(channelsmith(*QUICK_COMPILE_CHECK, "--json"), cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    document = json.loads(proc.stdout)
    assert {u["version"] for u in document["units"]} == {"2.4.0"}
    steps = [line for line in proc.stderr.splitlines() if line.startswith("compile-check: ")]
    assert "compile-check: torch-mpi-backend (pytorch 2.4.0): finding the upstream tree (at " in "\n".join(steps)
    assert BAR not in proc.stderr


@functools.cache
def _install_script_would_change_the_machine() -> str | None:
    """Why the install script would install something here (then the test is skipped), else None."""
    text = (REPO / "scripts" / "install-test-deps.sh").read_text()
    packages = re.search(r"^apt_packages=\((.*)\)$", text, re.MULTILINE).group(1).split()
    status = [subprocess.run(["dpkg-query", "-W", "-f=${Status}", p], capture_output=True, text=True) for p in packages]
    missing = [p for p, s in zip(packages, status) if "install ok installed" not in s.stdout]
    if missing:
        return f"Debian packages missing ({', '.join(missing)}): the script would install them"
    if not subprocess.run(["apt-cache", "showsrc", "pytorch"], capture_output=True, text=True).stdout:
        return "no Debian source index for pytorch: the script would run apt-get update"
    return None


@pytest.fixture
def python_without_pip(tmp_path):
    """PATH with a python3 first that has no pip: the script stops before installing anything into the
    interpreter that runs these tests (it would replace channelsmith's editable install under them)."""
    if shutil.which("dpkg-query") is None:
        pytest.skip("not a Debian system (no dpkg-query)")
    why = _install_script_would_change_the_machine()
    if why:
        pytest.skip(why)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "venv")], check=True)
    return dict(os.environ, PATH=f"{tmp_path / 'venv' / 'bin'}{os.pathsep}{os.environ['PATH']}")


def test_install_test_deps_shows_each_stage_on_a_terminal(python_without_pip):
    code, shown = run_in_pty(["bash", str(REPO / "scripts" / "install-test-deps.sh")], env=python_without_pip)
    text = plain(shown)
    assert re.search(r"install-test-deps: \[1/3\] Debian packages: all \d+ installed \(at \d+ s\)", text), text
    assert "install-test-deps: [2/3] Debian source index" in text
    # Then it stops, saying why, before pip could touch anything.
    assert code == 2
    assert "has no pip; run in the virtual environment" in text


def test_install_test_deps_prints_its_stages_on_stderr_in_a_pipe(python_without_pip):
    proc = subprocess.run(["bash", str(REPO / "scripts" / "install-test-deps.sh")], env=python_without_pip,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2
    assert proc.stdout == ""
    stages = [line for line in proc.stderr.splitlines() if line.startswith("install-test-deps: [")]
    assert [line.split("]")[0] for line in stages] == ["install-test-deps: [1/3", "install-test-deps: [2/3"]


@pytest.fixture
def pip_recorder(tmp_path):
    """PATH with a python3 first that only records its arguments (one line per call) and succeeds, and that
    record's path: what the script would ask pip for, with nothing installed."""
    if shutil.which("dpkg-query") is None:
        pytest.skip("not a Debian system (no dpkg-query)")
    why = _install_script_would_change_the_machine()
    if why:
        pytest.skip(why)
    record = tmp_path / "python3-calls.txt"
    fake = tmp_path / "bin" / "python3"
    fake.parent.mkdir()
    fake.write_text(f'#!/bin/sh\necho "$*" >> {record}\n')
    fake.chmod(0o755)
    return dict(os.environ, PATH=f"{fake.parent}{os.pathsep}{os.environ['PATH']}"), record


@pytest.mark.parametrize(("asked", "installed"), [(None, "2.15.0"), ("2.13.0+cpu", "2.13.0+cpu")])
def test_install_test_deps_installs_torch_2_15_0_unless_told_another_release(pip_recorder, asked, installed):
    env, record = pip_recorder
    env.pop("CHANNELSMITH_TEST_TORCH", None)
    if asked is not None:
        env["CHANNELSMITH_TEST_TORCH"] = asked
    proc = subprocess.run(["bash", str(REPO / "scripts" / "install-test-deps.sh")], env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    installs = [line.split() for line in record.read_text().splitlines() if line.startswith("-m pip install")]
    assert len(installs) == 1, record.read_text()
    assert [arg for arg in installs[0] if arg.startswith("torch")] == [f"torch=={installed}"]
    assert f"with torch=={installed} into" in proc.stderr
