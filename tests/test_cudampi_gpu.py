"""CUDA tensors through cudampi on a CUDA-built MPICH, for real, on a GPU node (marker `gpu`).

What runs, in order (docs/records/2026-11-25-cudampi-one-h100.md, "CUDA tensors through a CUDA-aware MPICH"):
1. MPICH with CUDA: scripts/build-mpich-cuda.sh builds it into CUDAMPI_GPU_MPICH_PREFIX, or an MPICH
   already installed there is used. A small C program checks MPIX_GPU_query_support there.
2. The recipe's build.sh builds torch-mpi-backend for the installed torch (its variant's source block of
   recipe.yaml, patch list applied with no fuzz) with site_mpi=mpich-cuda, and once more with
   site_mpi=openmpi against a non-CUDA Open MPI where one is installed.
3. `mpiexec -n 2 python -m torch_dist_check --import torch_mpi_backend --plugin cudampi:launch=mpi:devices=D`,
   first on CUDA tensors (with NCCL in the same job where there are two GPUs), then on CPU tensors (the
   host-staging figures): every correctness case exact on both ranks, a bandwidth sweep on both.
4. Negative cases: a CUDA tensor with MPICH's GPU support off (MPIR_CVAR_ENABLE_GPU=0), and on the
   non-CUDA Open MPI, raises the clear "no CUDA-aware MPI" error instead of crashing.

With ONE GPU both ranks use cuda:0 (torch_dist_check gives rank r the GPU local_rank % device_count):
two processes on one device, so MPICH moves the data between two CUDA contexts of one GPU. NCCL
refuses two ranks on one device, so its comparison needs two GPUs and is skipped with that reason.

Inputs (environment):
  CUDAMPI_GPU_MPICH_PREFIX   an MPICH built with CUDA, or where to build one (required)
  CUDAMPI_GPU_MPICH_SOURCE   MPICH source (autogen'ed folder or tarball), only to build one
  CUDAMPI_GPU_LIBFABRIC, CUDAMPI_GPU_HWLOC   library roots, only to build one
  CUDAMPI_GPU_TORCH_SOURCE   tarball of the PyTorch source the variant compiles (one top folder; at
                             least the files of the recipe's filter)
  CUDAMPI_GPU_REPORT_DIR     optional: where the suite's JSON and the logs are copied
  CUDAMPI_GPU_MAX_BYTES      largest bandwidth size on CUDA tensors (default 1G)
  CUDAMPI_GPU_CPU_MAX_BYTES  largest bandwidth size on CPU tensors (default 64M)
  CUDAMPI_GPU_STAGE_TIMEOUT_S  torch_dist_check's limit per stage (default 600; MPICH 4.3.2's CUDA
                             all_reduce ran at 0.03 GB/s from 16 MiB on one H100, so a sweep to 1 GiB
                             takes minutes)
  FI_PROVIDER                libfabric provider for MPICH's ch4:ofi (default here: tcp)
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch_mpi_backend_build
import yaml

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[1]
RECIPE_DIR = ROOT / "recipes" / "torch-mpi-backend"
BUILD_MPICH = ROOT / "scripts" / "build-mpich-cuda.sh"
CUDA_ERROR = "CUDA tensor detected and the MPI used doesn't have CUDA-aware MPI support"
ENV = os.environ
MPICH_PREFIX = Path(ENV["CUDAMPI_GPU_MPICH_PREFIX"]) if ENV.get("CUDAMPI_GPU_MPICH_PREFIX") else None
TORCH_SOURCE = Path(ENV["CUDAMPI_GPU_TORCH_SOURCE"]) if ENV.get("CUDAMPI_GPU_TORCH_SOURCE") else None
REPORT_DIR = Path(ENV["CUDAMPI_GPU_REPORT_DIR"]) if ENV.get("CUDAMPI_GPU_REPORT_DIR") else None
CUDA_ROOT = Path(ENV.get("CUDA_HOME", "/usr/local/cuda"))
OPENMPI_MPICC = shutil.which("mpicc.openmpi")
OPENMPI_MPIRUN = shutil.which("mpirun.openmpi")
# A hang must fail the test, not hold the GPU node: the 1 GiB sweep takes minutes.
JOB_TIMEOUT_S = 1800

GPU_QUERY_C = r"""
#include <mpi.h>
#include <stdio.h>
int main(int argc, char **argv) {
    int supported = -1;
    MPI_Init(&argc, &argv);
    MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA, &supported);
    printf("MPIX_GPU_SUPPORT_CUDA=%d\n", supported);
    MPI_Finalize();
    return 0;
}
"""

# One rank: an all_reduce of a real CUDA tensor. Where the MPI cannot take device memory the backend
# must refuse it with its error (a RuntimeError), not hand a device pointer to MPI.
CUDA_TENSOR_PROBE = """
import os
from datetime import timedelta

import torch
import torch.distributed as dist

import torch_mpi_backend

dist.init_process_group("cudampi", rank=0, world_size=1, timeout=timedelta(seconds=60))
tensor = torch.arange(8, dtype=torch.float32, device="cuda")
try:
    dist.all_reduce(tensor)
    torch.cuda.synchronize()
except RuntimeError as exc:
    print("REFUSED:", str(exc).splitlines()[0])
else:
    print("ACCEPTED", tensor.tolist())
dist.destroy_process_group()
"""


def _torch_facts() -> tuple[str, int] | None:
    try:
        import torch
    except ImportError:
        return None
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return torch.__version__.split("+")[0], count


def _missing() -> str | None:
    facts = _torch_facts()
    if facts is None:
        return f"{sys.executable} has no torch"
    version, gpus = facts
    if gpus == 0:
        return "no CUDA device visible to torch (this test runs on a GPU node)"
    if not (CUDA_ROOT / "include" / "cuda_runtime_api.h").is_file():
        return f"no CUDA toolkit at {CUDA_ROOT} (set CUDA_HOME)"
    if MPICH_PREFIX is None:
        return "CUDAMPI_GPU_MPICH_PREFIX is not set (an MPICH built with CUDA, or where to build one)"
    if not (MPICH_PREFIX / "bin" / "mpicc").is_file():
        needed = [v for v in ("CUDAMPI_GPU_MPICH_SOURCE", "CUDAMPI_GPU_LIBFABRIC", "CUDAMPI_GPU_HWLOC") if not ENV.get(v)]
        if needed:
            return f"no MPICH at {MPICH_PREFIX} and {', '.join(needed)} not set to build one"
    if TORCH_SOURCE is None or not TORCH_SOURCE.is_file():
        return "CUDAMPI_GPU_TORCH_SOURCE is not set to a PyTorch source tarball"
    if _recipe_source(version) is None:
        return f"recipes/torch-mpi-backend has no variant for the installed torch {version}"
    if shutil.which("patch") is None:
        return "no patch(1) on PATH"
    return None


def _recipe_source(version: str) -> dict | None:
    recipe = yaml.safe_load((RECIPE_DIR / "recipe.yaml").read_text())
    for entry in recipe["source"]:
        if entry["if"] == f'pytorch_version == "{version}"':
            return entry["then"]
    return None


def _source_version(version: str) -> str:
    """The release whose ProcessGroupMPI.cpp the variant compiles: where its patches live
    (patches/pytorch/<release>/<series>/), which is 2.6.0 for the reconstructed 2.11.0 variant."""
    source = _recipe_source(version)
    assert source is not None
    (release,) = {Path(patch).parts[Path(patch).parts.index("pytorch") + 1] for patch in source["patches"]}
    return release


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _run(cmd: list[str], env: dict[str, str], timeout: float = JOB_TIMEOUT_S, **kwargs) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, env=env, text=True, capture_output=True, timeout=timeout, **kwargs)


def _keep(name: str, text: str) -> None:
    if REPORT_DIR is not None:
        REPORT_DIR.mkdir(parents=True, exist_ok=True)
        (REPORT_DIR / name).write_text(text)


@pytest.fixture(scope="module")
def mpich() -> Path:
    """An MPICH built with CUDA: the one at CUDAMPI_GPU_MPICH_PREFIX, built there first if absent."""
    reason = _missing()
    if reason:
        pytest.skip(reason)
    assert MPICH_PREFIX is not None
    if not (MPICH_PREFIX / "bin" / "mpicc").is_file():
        start = time.monotonic()
        result = _run(
            ["bash", str(BUILD_MPICH), "--source", ENV["CUDAMPI_GPU_MPICH_SOURCE"], "--prefix", str(MPICH_PREFIX),
             "--cuda", str(CUDA_ROOT), "--libfabric", ENV["CUDAMPI_GPU_LIBFABRIC"], "--hwloc", ENV["CUDAMPI_GPU_HWLOC"]],
            dict(ENV), timeout=1800,
        )  # fmt: skip
        _keep("mpich-build.log", result.stderr)
        assert result.returncode == 0, result.stderr[-4000:]
        print(f"\nbuild-mpich-cuda.sh: {time.monotonic() - start:.0f} s")
    version = _run([str(MPICH_PREFIX / "bin" / "mpichversion")], dict(ENV)).stdout
    assert "--with-cuda" in version, version
    return MPICH_PREFIX


@dataclass(frozen=True)
class Built:
    """torch-mpi-backend as build.sh installed it, and the environment to run it in."""

    site_packages: Path
    env: dict[str, str]
    seconds: float


def _build(work: Path, site_mpi: str, mpicc: str, mpi_root: str) -> Built:
    """The recipe's build.sh for the installed torch, as the engine would run it."""
    import torch

    version = torch.__version__.split("+")[0]
    source = _recipe_source(version)
    assert source is not None
    src_dir, prefix = work / "src", work / "prefix"
    src_dir.mkdir(parents=True)
    prefix.mkdir()
    torch_mpi_backend_build.prepare_source(src_dir, source, TORCH_SOURCE)
    env = dict(
        ENV,
        PREFIX=str(prefix),
        SRC_DIR=str(src_dir),
        RECIPE_DIR=str(RECIPE_DIR),
        CPU_COUNT=str(os.cpu_count() or 1),
        PYTHON=sys.executable,
        TORCH_MPI_BACKEND_TORCH_VERSION=version,
        TORCH_MPI_BACKEND_SOURCE_VERSION=_source_version(version),
        TORCH_MPI_BACKEND_SITE_MPI=site_mpi,
        TORCH_MPI_BACKEND_MPI_ROOT=mpi_root,
        MPICC=mpicc,
    )
    start = time.monotonic()
    result = _run(["bash", str(RECIPE_DIR / "build.sh")], env, timeout=1200)
    seconds = time.monotonic() - start
    _keep(f"torch-mpi-backend-{site_mpi}.log", result.stdout + result.stderr)
    assert result.returncode == 0, f"build.sh failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    print(f"\ntorch-mpi-backend build.sh ({site_mpi}, torch {version}): {seconds:.0f} s")
    site_packages = torch_mpi_backend_build.site_packages(Path(sys.executable), prefix)
    run_env = dict(ENV, PYTHONPATH=os.pathsep.join([str(site_packages), str(ROOT / "scripts")]))
    run_env.setdefault("FI_PROVIDER", "tcp")
    return Built(site_packages, run_env, seconds)


@pytest.fixture(scope="module")
def built(mpich: Path, tmp_path_factory: pytest.TempPathFactory) -> Built:
    return _build(tmp_path_factory.mktemp("cudampi-mpich"), "mpich-cuda", str(mpich / "bin" / "mpicc"), str(mpich))


def _mpiexec(mpich: Path, built: Built, nproc: int, args: list[str], extra_env: dict[str, str] | None = None):
    env = dict(built.env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), **(extra_env or {}))
    return _run([str(mpich / "bin" / "mpiexec"), "-n", str(nproc), *args], env)


def test_mpich_answers_the_gpu_query_and_follows_its_switch(mpich: Path, built: Built, tmp_path: Path) -> None:
    source = tmp_path / "gpu_query.c"
    source.write_text(GPU_QUERY_C)
    program = tmp_path / "gpu_query"
    subprocess.run([str(mpich / "bin" / "mpicc"), str(source), "-o", str(program)], check=True)
    on = _mpiexec(mpich, built, 1, [str(program)])
    off = _mpiexec(mpich, built, 1, [str(program)], {"MPIR_CVAR_ENABLE_GPU": "0"})
    assert "MPIX_GPU_SUPPORT_CUDA=1" in on.stdout, on.stdout + on.stderr
    assert "MPIX_GPU_SUPPORT_CUDA=0" in off.stdout, off.stdout + off.stderr


def test_the_build_says_which_source_it_compiled(built: Built) -> None:
    import torch

    probe = "import json, torch_mpi_backend as m; print(json.dumps([m.SOURCE_VERSION, m.mpi_library_version()]))"
    result = _run([sys.executable, "-c", probe], built.env)
    assert result.returncode == 0, result.stderr
    source_version, library = json.loads(result.stdout.strip().splitlines()[-1])
    assert source_version == _source_version(torch.__version__.split("+")[0])
    assert "MPICH Version:" in library and "--with-cuda" in library


# The negative cases run before the suite: they are quick, and a hung sweep must not hide them.
def test_gpu_support_switched_off_raises_the_clear_error(mpich: Path, built: Built, tmp_path: Path) -> None:
    # MPICH's own switch: with MPIR_CVAR_ENABLE_GPU=0 an MPI_Allreduce on device memory crashes the
    # program; the patched cudaAwareMpiCheck() asks MPIX_GPU_query_support first and refuses.
    script = tmp_path / "cuda_probe.py"
    script.write_text(CUDA_TENSOR_PROBE)
    result = _mpiexec(mpich, built, 1, [sys.executable, str(script)], {"MPIR_CVAR_ENABLE_GPU": "0"})
    _keep("probe-gpu-off.log", result.stdout + result.stderr)
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    assert f"REFUSED: {CUDA_ERROR}" in result.stdout, result.stdout
    # And with GPU support on, the same tensor goes through.
    accepted = _mpiexec(mpich, built, 1, [sys.executable, str(script)])
    assert "ACCEPTED [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]" in accepted.stdout, accepted.stdout + accepted.stderr


def test_open_mpi_without_cuda_raises_the_clear_error(mpich: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    if OPENMPI_MPICC is None or OPENMPI_MPIRUN is None:
        pytest.skip("no Open MPI (mpicc.openmpi, mpirun.openmpi) installed")
    ompi_info = shutil.which("ompi_info")
    facts = _run([ompi_info, "--parsable", "--all"], dict(ENV)).stdout if ompi_info else ""
    if "mpi_built_with_cuda_support:value:true" in facts:
        pytest.skip("this Open MPI is built with CUDA: not the negative case")
    work = tmp_path_factory.mktemp("cudampi-openmpi")
    openmpi = _build(work, "openmpi", OPENMPI_MPICC, "")
    script = work / "cuda_probe.py"
    script.write_text(CUDA_TENSOR_PROBE)
    env = dict(openmpi.env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")  # fmt: skip
    result = _run([OPENMPI_MPIRUN, "-n", "1", sys.executable, str(script)], env)
    _keep("probe-openmpi.log", result.stdout + result.stderr)
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    assert f"REFUSED: {CUDA_ERROR}" in result.stdout, result.stdout


def _suite_run(mpich: Path, built: Built, work: Path, device: str, max_bytes: str) -> dict:
    """One torch_dist_check job over cudampi on ``device`` tensors (and NCCL where there are two GPUs)."""
    import torch

    report = work / f"cudampi-gpu-{device}.json"
    backends = "cudampi,nccl" if device == "cuda" and torch.cuda.device_count() >= 2 else "cudampi"
    # 2 warm-ups and at most 10 timed calls (at least 3, within 1 s) per size, to bound node time.
    args = [sys.executable, "-m", "torch_dist_check", "--import", "torch_mpi_backend",
            "--plugin", f"cudampi:launch=mpi:devices={device}", "--backends", backends,
            "--checks", "correctness,bandwidth", "--max-bytes", max_bytes, "--warmup", "2", "--iters", "10",
            "--size-budget-s", "1", "--stage-timeout", ENV.get("CUDAMPI_GPU_STAGE_TIMEOUT_S", "600"),
            "--json", str(report)]  # fmt: skip
    # Written as it runs, so that a run cut short still leaves its log.
    log = (REPORT_DIR or work) / f"suite-{device}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    env = dict(built.env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), NCCL_NVLS_ENABLE="0")
    start = time.monotonic()
    with log.open("w") as stream:
        stream.write(" ".join(args) + "\n")
        stream.flush()
        result = subprocess.run([str(mpich / "bin" / "mpiexec"), "-n", "2", *args], env=env, text=True,
                                stdout=stream, stderr=subprocess.STDOUT, timeout=JOB_TIMEOUT_S)  # fmt: skip
    seconds = time.monotonic() - start
    output = log.read_text()
    assert report.is_file(), output[-4000:]
    _keep(report.name, report.read_text())
    print(f"\n{output}\nsuite on {device}: {seconds:.0f} s")
    return json.loads(report.read_text())


@pytest.fixture(scope="module")
def suite(mpich: Path, built: Built, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The suite on CUDA tensors, then on CPU tensors (the host-staging path), as two jobs back to back.

    Two jobs rather than one: the suite tests a job's CPU tensors first, and a slow CPU sweep must not
    keep the CUDA case (the point of this test) from running within the node's time.
    """
    work = tmp_path_factory.mktemp("suite")
    cuda = _suite_run(mpich, built, work, "cuda", ENV.get("CUDAMPI_GPU_MAX_BYTES", "1G"))
    cpu = _suite_run(mpich, built, work, "cpu", ENV.get("CUDAMPI_GPU_CPU_MAX_BYTES", "64M"))
    return {"checks": cuda["checks"] + cpu["checks"]}


def _check(document: dict, name: str) -> dict:
    checks = {c["name"]: c for c in document["checks"]}
    assert name in checks, sorted(checks)
    return checks[name]


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_every_correctness_case_is_exact(suite: dict, device: str) -> None:
    correct = _check(suite, f"correctness/cudampi/{device}")
    assert correct["status"] == "pass", correct["reason"]
    assert correct["ranks"] == [0, 1]
    details = correct["details"]
    # all_reduce, broadcast, all_gather, reduce_scatter, send/recv per dtype and count, then a barrier.
    assert details["cases"] == 6 * len(details["dtypes"]) * len(details["counts"]) + 1
    assert details["failures"] == [] and details["unsupported"] == {}


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_bandwidth_sweep_covers_every_collective(suite: dict, device: str) -> None:
    # The CPU rows are the host-staging figures: what a user falls back to without a CUDA-aware MPI.
    sweep = _check(suite, f"bandwidth/cudampi/{device}")
    assert sweep["status"] == "pass", sweep["reason"]
    rows = sweep["details"]["rows"]
    assert {r["collective"] for r in rows} == {"all_reduce", "all_gather", "reduce_scatter", "broadcast"}
    assert all(r["busbw_GBps"] > 0 for r in rows)


def test_nccl_figures_next_to_mpi(suite: dict) -> None:
    import torch

    if torch.cuda.device_count() < 2:
        # Two ranks can share one GPU for NCCL (one NCCL_HOSTID each, or NCCL_MULTI_RANK_GPU_ENABLE=1
        # with NCCL >= 2.30), but this mpiexec job gives both ranks one environment and the node's NCCL.
        pytest.skip("this mpiexec job runs NCCL only with one GPU per rank and this node has 1; NCCL on one "
                    "shared GPU was measured in its own run (docs/records/2026-11-25-cudampi-one-h100.md, the NCCL row)")
    assert _check(suite, "bandwidth/nccl/cuda")["status"] == "pass"
    assert _check(suite, "correctness/nccl/cuda")["status"] == "pass"
