"""scripts/mpi-gpu-bench.c, compiled with the MPI compiler wrapper and run under `mpiexec -n 2`.

On a machine without CUDA (CI: Debian's MPICH) the host-buffer build runs for real; the CUDA build
compiles only where a CUDA toolkit is found (CUDA_HOME, default /usr/local/cuda), and runs on device
buffers only where a GPU is visible (the GPU node: docs/records/2026-11-25-cudampi-one-h100.md has its figures).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "scripts" / "mpi-gpu-bench.c"
MPICC = shutil.which("mpicc")
MPIEXEC = shutil.which("mpiexec")
CUDA_ROOT = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda"))
COLLECTIVES = ["all_reduce", "broadcast", "all_gather", "reduce_scatter", "reduce_local"]
TIMEOUT_S = 120

pytestmark = pytest.mark.skipif(
    MPICC is None or MPIEXEC is None, reason="no mpicc/mpiexec on PATH (apt-get install mpich libmpich-dev)"
)


def _env() -> dict[str, str]:
    # Open MPI refuses root without these; MPICH ignores them.
    return dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")


@pytest.fixture(scope="module")
def bench(tmp_path_factory: pytest.TempPathFactory) -> Path:
    program = tmp_path_factory.mktemp("bench") / "mpi-gpu-bench"
    assert MPICC is not None
    subprocess.run([MPICC, "-O2", "-Wall", "-Werror", "-o", str(program), str(SOURCE)], check=True, timeout=TIMEOUT_S)
    return program


def _run(bench: Path, *args: str, ranks: int = 2) -> subprocess.CompletedProcess[str]:
    assert MPIEXEC is not None
    return subprocess.run(
        [MPIEXEC, "-n", str(ranks), str(bench), *args], text=True, capture_output=True, timeout=TIMEOUT_S, env=_env()
    )


def test_every_collective_on_host_buffers_is_exact_with_nccl_tests_bandwidth(bench: Path) -> None:
    result = _run(bench, "--mem", "host", "--min-bytes", "64K", "--max-bytes", "256K", "--iters", "3",
                  "--collectives", ",".join(COLLECTIVES), "--label", "ci", "--json")  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    # 5 collectives x 3 sizes (64, 128, 256 KiB), one JSON object per row, rank 0 only.
    assert [(r["collective"], r["bytes"]) for r in rows] == [
        (c, b << 10) for c in COLLECTIVES for b in (64, 128, 256)
    ]
    factors = {"all_reduce": 1.0, "broadcast": 1.0, "all_gather": 0.5, "reduce_scatter": 0.5, "reduce_local": 1.0}
    for row in rows:
        assert row["exact"] is True and row["wrong_elements"] == 0, row
        assert row["label"] == "ci" and row["memory"] == "host" and row["ranks"] == 2 and row["iters"] == 3
        assert 0 < row["median_s"] <= row["max_s"]
        assert row["algbw_GBps"] == pytest.approx(row["bytes"] / row["median_s"] / 1e9, rel=1e-4)
        assert row["busbw_GBps"] == pytest.approx(row["algbw_GBps"] * factors[row["collective"]], rel=1e-4)
    # The human table goes to stderr, with the MPI library named.
    assert "MPI" in result.stderr and "exact" in result.stderr


def test_three_ranks_and_sizes_not_divisible_by_them_stay_exact(bench: Path) -> None:
    result = _run(bench, "--mem", "host", "--min-bytes", "100K", "--max-bytes", "100K", "--iters", "1",
                  "--json", ranks=3)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(rows) == 4 and all(r["exact"] and r["ranks"] == 3 for r in rows)


def test_a_slow_size_ends_that_collectives_sweep_with_a_skipped_row(bench: Path) -> None:
    # Any call takes longer than 1 ns: every collective stops after its first size.
    result = _run(bench, "--mem", "host", "--min-bytes", "64K", "--max-bytes", "256K", "--iters", "1",
                  "--collectives", "all_reduce,broadcast", "--max-call-s", "1e-9", "--json")  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [(r["collective"], r["bytes"], "skipped" in r) for r in rows] == [
        ("all_reduce", 64 << 10, False), ("all_reduce", 128 << 10, True),
        ("broadcast", 64 << 10, False), ("broadcast", 128 << 10, True),
    ]  # fmt: skip


@pytest.mark.parametrize("ranks", [2, 3])
def test_all_to_all_at_listed_sizes_is_exact(bench: Path, ranks: int) -> None:
    # The calls cudampi's all_reduce is made of (MPI_Alltoall, MPI_Allgather) or replaced by, at the sizes
    # --sizes lists in its order (issue 57's 1/16/64/256 MiB, scaled down); 3 ranks: blocks of sizes not
    # divisible by them.
    result = _run(bench, "--mem", "host", "--sizes", "96K,32K,1M", "--iters", "2",
                  "--collectives", "all_to_all,all_gather", "--json", ranks=ranks)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [(r["collective"], r["bytes"]) for r in rows] == [
        (c, b << 10) for c in ("all_gather", "all_to_all") for b in (96, 32, 1024)
    ]
    for row in rows:
        assert row["exact"] is True and row["wrong_elements"] == 0 and row["ranks"] == ranks, row
        assert row["busbw_GBps"] == pytest.approx(row["algbw_GBps"] * (ranks - 1) / ranks, rel=1e-4)


def test_listed_sizes_stop_at_a_slow_one_with_a_skipped_row_naming_the_next(bench: Path) -> None:
    result = _run(bench, "--mem", "host", "--sizes", "64K,1M,16M", "--iters", "1",
                  "--collectives", "all_to_all", "--max-call-s", "1e-9", "--json")  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [(r["bytes"], "skipped" in r) for r in rows] == [(64 << 10, False), (1 << 20, True)]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--max-bytes", "lots"], "a byte size must be a positive number"),
        (["--sizes", "1M,,big"], "--sizes takes up to 32 comma-separated byte sizes"),
        (["--sizes", ",".join(["1M"] * 33)], "--sizes takes up to 32 comma-separated byte sizes"),
        (["--mem", "disk"], "--mem takes host, cuda or both"),
        (["--collectives", "all_reduce,alltoal"], "--collectives takes a comma-separated list"),
        (["--iters", "0"], "--iters needs an integer >= 1"),
        (["--min-bytes", "2M", "--max-bytes", "1M"], "--min-bytes is larger than --max-bytes"),
        (["--mem", "cuda"], "this build has no CUDA"),
        (["--frobnicate", "1"], "unknown option"),
    ],
)
def test_bad_arguments_exit_2_with_a_hint_and_no_rows(bench: Path, args: list[str], message: str) -> None:
    result = _run(bench, *args, "--json")
    assert result.returncode == 2, result.stderr[-2000:]
    assert message in result.stderr and "hint:" in result.stderr
    assert result.stdout == ""


def test_the_cuda_build_compiles_where_a_cuda_toolkit_exists(tmp_path: Path) -> None:
    if not (CUDA_ROOT / "include" / "cuda_runtime_api.h").is_file():
        pytest.skip(f"no CUDA toolkit at {CUDA_ROOT} (set CUDA_HOME): the CUDA build compiles on a GPU node")
    assert MPICC is not None
    lib = CUDA_ROOT / "lib64"
    subprocess.run(
        [MPICC, "-O2", "-Wall", "-Werror", "-DMPI_GPU_BENCH_CUDA", f"-I{CUDA_ROOT / 'include'}",
         "-o", str(tmp_path / "mpi-gpu-bench-cuda"), str(SOURCE), f"-L{lib}", "-lcudart", f"-Wl,-rpath,{lib}"],
        check=True, timeout=TIMEOUT_S,
    )  # fmt: skip
