"""recipes/torch-mpi-backend's 2.14.1 variant, built for real outside the conda engine and run under mpiexec.

The variant compiles 2.6.0's ProcessGroupMPI.cpp (Debian trixie's PyTorch 2.6.0 source package) with the
cuda-aware-mpi series and the reconstructed torch-2.14-compat series, exactly as the recipe lists them,
against the torch 2.14.1 release wheel and Debian's MPICH. Then torch_dist_check's CLI runs its
correctness cases over `cudampi` with `mpiexec -n 2` on CPU tensors, and a probe runs what the series
adds over 2.6.0 (the list-form reduce_scatter and the renamed all_to_all_single on MPI, half precision).

It runs only when TORCH_MPI_BACKEND_PYTHON_2_14 (a Python with torch 2.14.1) and
TORCH_MPI_BACKEND_TORCH_SOURCE (the PyTorch 2.6.0 source tarball) are set, as
`eval "$(bash .ci/torch-mpi-backend.sh)"` does; otherwise every case is skipped with the missing piece
named. One build (about a minute of CPU) serves every case of the file, and later runs with the same
inputs (tests/torch_mpi_backend_build.py).

    eval "$(bash .ci/torch-mpi-backend.sh)" && python3 -m pytest -m buildsh tests/test_torch_mpi_backend_2_14.py -s
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
from pathlib import Path

import pytest
import torch_mpi_backend_build

pytestmark = pytest.mark.buildsh

ROOT = Path(__file__).resolve().parents[1]
TORCH_VERSION = "2.14.1"
SOURCE_VERSION = "2.6.0"
PREPARE = 'eval "$(bash .ci/torch-mpi-backend.sh)"'
PYTHON = Path(os.environ.get("TORCH_MPI_BACKEND_PYTHON_2_14", ""))
TORCH_SOURCE = Path(os.environ.get("TORCH_MPI_BACKEND_TORCH_SOURCE", ""))
MPICC = shutil.which("mpicc")
MPIEXEC = shutil.which("mpiexec")
# Bound on any one launched job: a hang must fail the test, not stall CI.
JOB_TIMEOUT_S = 300


def _missing() -> str | None:
    for var, path in (("TORCH_MPI_BACKEND_PYTHON_2_14", PYTHON), ("TORCH_MPI_BACKEND_TORCH_SOURCE", TORCH_SOURCE)):
        if not os.environ.get(var):
            return f"{var} is not set: run {PREPARE} to prepare torch {TORCH_VERSION} and the 2.6.0 source"
        if not path.is_file():
            return f"{var}={path} does not exist: run {PREPARE}"
    if MPICC is None or MPIEXEC is None:
        return f"no mpicc/mpiexec on PATH (apt-get install mpich libmpich-dev, or {PREPARE})"
    if shutil.which("patch") is None:
        return "no patch(1) on PATH"
    return None


def _job_env(env: dict[str, str]) -> dict[str, str]:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return dict(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


@pytest.fixture(scope="module")
def run_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The variant built once with the recipe's build.sh (or the prefix an earlier run built from the
    very same inputs, tests/torch_mpi_backend_build.py); the environment that imports the result."""
    reason = _missing()
    if reason:
        pytest.skip(reason)
    made = torch_mpi_backend_build.build(
        tmp_path_factory.mktemp("torch-mpi-backend-2.14"), torch_version=TORCH_VERSION, source_version=SOURCE_VERSION,
        python=PYTHON, torch_source=TORCH_SOURCE, mpicc=MPICC,
    )  # fmt: skip
    how = "reused the build of an earlier run with the same inputs; its" if made.reused else "this run's"
    print(f"\ntorch-mpi-backend {TORCH_VERSION}: {how} build.sh took {made.build_seconds:.1f} s wall")
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(made.site_packages), str(ROOT / "scripts")]))


def test_build_records_the_reconstructed_source_and_the_torch_it_runs_on(series_job: subprocess.CompletedProcess[str]) -> None:
    # Rank 0 of the series job says which torch it imported and which source the package was built from.
    (line,) = [line for line in series_job.stdout.splitlines() if line.startswith("VERSIONS ")]
    torch_version, source_version = json.loads(line.removeprefix("VERSIONS "))
    assert torch_version.split("+")[0] == TORCH_VERSION and source_version == SOURCE_VERSION


def test_torch_dist_check_correctness_is_exact_over_cudampi_on_two_ranks(run_env: dict[str, str], tmp_path: Path) -> None:
    report = tmp_path / "dist-check.json"
    result = subprocess.run(
        [MPIEXEC, "-n", "2", str(PYTHON), "-m", "torch_dist_check", "--import", "torch_mpi_backend",
         "--plugin", "cudampi:launch=mpi", "--backends", "cudampi", "--checks", "correctness",
         "--quick", "--json", str(report)],
        env=_job_env(run_env), text=True, capture_output=True, timeout=JOB_TIMEOUT_S,
    )  # fmt: skip
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    document = json.loads(report.read_text())
    correct = {c["name"]: c for c in document["checks"]}["correctness/cudampi/cpu"]
    assert correct["status"] == "pass", correct["reason"]
    assert correct["ranks"] == [0, 1]
    # all_reduce, broadcast, all_gather, reduce_scatter, send/recv for every dtype and count, then a
    # barrier: 6 x 4 dtypes x 3 counts + 1 = 73 cases, none failed, none skipped as unsupported.
    details = correct["details"]
    assert details["cases"] == 6 * len(details["dtypes"]) * len(details["counts"]) + 1 == 73
    assert details["failures"] == [] and details["unsupported"] == {}
    print(f"\n{result.stdout}")


# What torch-2.14-compat runs on MPI where 2.6.0's file refused ("does not support reduce_scatter") or
# named it otherwise (alltoall_base, now all_to_all_single), and the half-precision type it maps.
# torch first, as the suite's ranks import it (scripts/torch_dist_check/harness/startup.py: the cycle
# collector paused, the import's objects frozen; about 0.4 s of CPU less per rank).
SERIES_PROBE = """from torch_dist_check.harness import startup
startup.import_all(startup.TORCH)

import json
import os
from datetime import timedelta

import torch
import torch.distributed as dist

import torch_mpi_backend

rank, world = int(os.environ["PMI_RANK"]), int(os.environ["PMI_SIZE"])
if rank == 0:
    print("VERSIONS " + json.dumps([torch.__version__, torch_mpi_backend.SOURCE_VERSION]), flush=True)
dist.init_process_group("cudampi", rank=rank, world_size=world, timeout=timedelta(seconds=60))

# reduce_scatter, list form: rank r receives the sum over ranks of their r-th input.
inputs = [torch.full((5,), float(10 * rank + peer)) for peer in range(world)]
output = torch.empty(5)
dist.reduce_scatter(output, inputs)
assert torch.equal(output, torch.full((5,), float(sum(10 * r + rank for r in range(world))))), output

# all_to_all_single with uneven splits: rank r sends r + 1 + peer elements to each peer.
send_splits = [rank + 1 + peer for peer in range(world)]
recv_splits = [peer + 1 + rank for peer in range(world)]
sent = torch.cat([torch.full((n,), 100 * rank + peer, dtype=torch.int64) for peer, n in enumerate(send_splits)])
received = torch.empty(sum(recv_splits), dtype=torch.int64)
dist.all_to_all_single(received, sent, recv_splits, send_splits)
expected = torch.cat([torch.full((n,), 100 * peer + rank, dtype=torch.int64) for peer, n in enumerate(recv_splits)])
assert torch.equal(received, expected), received

# half precision through MPIX_C_FLOAT16 (Debian's MPICH defines it): a broadcast moves the bytes.
half = torch.arange(8, dtype=torch.float16) * (rank + 1)
dist.broadcast(half, src=1)
assert torch.equal(half, torch.arange(8, dtype=torch.float16) * 2), half

print(f"rank {rank}: reduce_scatter, all_to_all_single, float16 broadcast exact")
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def series_job(run_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> subprocess.CompletedProcess[str]:
    """SERIES_PROBE under ``mpiexec -n 2``, once for the tests that read it."""
    script = tmp_path_factory.mktemp("series") / "series_probe.py"
    script.write_text(SERIES_PROBE)
    result = subprocess.run(
        [MPIEXEC, "-n", "2", str(PYTHON), str(script)],
        env=_job_env(run_env), text=True, capture_output=True, timeout=JOB_TIMEOUT_S,
    )  # fmt: skip
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


def test_series_collectives_run_on_mpi(series_job: subprocess.CompletedProcess[str]) -> None:
    for rank in (0, 1):
        assert f"rank {rank}: reduce_scatter, all_to_all_single, float16 broadcast exact" in series_job.stdout
