"""recipes/torch-mpi-backend/tests/cuda_allreduce.py, the four-GPU check of issue 40, where no GPU is.

On a node with fewer GPUs than the launcher put ranks on it the script must say so and exit 2 before
it starts the process group (it ran on four H100s: docs/records/2026-11-26-cudampi-four-h100.md, "four GPUs").
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "recipes" / "torch-mpi-backend" / "tests" / "cuda_allreduce.py"
torch = pytest.importorskip("torch")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: the refusal needs fewer GPUs than ranks")
def test_more_ranks_than_gpus_exit_2_with_a_hint_before_any_process_group():
    # Rank 1 of a 4-rank MPICH/Hydra job; torch_mpi_backend is not importable here, so a run that went
    # past the GPU count would fail with ModuleNotFoundError instead.
    env = dict(os.environ, PMI_RANK="1", PMI_SIZE="4", MPI_LOCALRANKID="1", MPI_LOCALNRANKS="4", PYTHONUNBUFFERED="1")
    result = subprocess.run([sys.executable, str(SCRIPT)], env=env, text=True, capture_output=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "rank 1: 4 ranks on this node but 0 GPU(s) visible" in result.stderr
    assert "hint: start one rank per GPU" in result.stderr
    assert result.stdout == ""
