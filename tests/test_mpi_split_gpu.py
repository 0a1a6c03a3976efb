"""benchmarks/mpi_split_gpu.sh, the issue 57 run on a machine of two GPUs: what can be checked without one.

The run itself (MPICH built with CUDA, the backend, the raw calls and the profiled backend on two GPUs) needs
the GPU machine and the carried inputs; its driver, benchmarks/mpi_split_gpu.py, runs on CPU tensors in
tests/test_torch_mpi_backend.py. Here: the script is ShellCheck-clean, and without its carried inputs it
stops at once with exit 2, naming the missing one, and writes nothing.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "mpi_split_gpu.sh"


def test_the_script_is_shellcheck_clean() -> None:
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        pytest.skip("no shellcheck on PATH (apt-get install shellcheck)")
    result = subprocess.run([shellcheck, str(SCRIPT)], text=True, capture_output=True)
    assert result.returncode == 0, result.stdout


@pytest.mark.parametrize("present", [[], ["mpich-4.3.2-autogen.tar.xz", "debs"]])
def test_missing_carried_inputs_exit_2_and_write_nothing(tmp_path: Path, present: list[str]) -> None:
    carry = tmp_path / "carry"
    carry.mkdir()
    for name in present:
        (carry / name).mkdir() if name == "debs" else (carry / name).write_bytes(b"")
    out, work = tmp_path / "out", tmp_path / "work"
    result = subprocess.run(
        ["bash", str(SCRIPT)], cwd=ROOT, text=True, capture_output=True, timeout=60,
        env={"PATH": "/usr/bin:/bin", "OUT": str(out), "CARRY": str(carry), "WORK": str(work)},
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    missing = "mpich-4.3.2-autogen.tar.xz" if not present else "pytorch-2.6.0-pgmpi.tar.gz"
    assert f"missing {carry}/{missing}" in result.stderr
    assert not out.exists() and not work.exists()


def test_without_out_it_says_what_to_set() -> None:
    result = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, text=True, capture_output=True, timeout=60,
                            env={"PATH": "/usr/bin:/bin"})  # fmt: skip
    assert result.returncode == 2 and "set OUT to the folder for the results" in result.stderr
