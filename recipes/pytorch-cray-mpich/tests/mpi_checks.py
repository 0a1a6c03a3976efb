"""Recipe tests of the cray_mpich flavor.

    python mpi_checks.py mpi-available | nccl-library | allreduce-cpu | allreduce-cuda | cuda-aware

Each check prints one line and exits 0 when it passes, 1 when it fails. A check that needs what this
machine lacks (an MPI launcher, GPUs, Cray MPICH) prints "SKIP: <what is missing>" and exits 0, so the
same tests run on a build node and on a GPU node. The checks that need ranks launch this script under
``mpiexec -n 2`` (MPIEXEC overrides the launcher, e.g. "srun" or "mpiexec --ppn 2") in worker mode.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

RANKS = 2
LAUNCH_TIMEOUT_S = 300
# The clear error of ProcessGroupMPI's tensor check when MPI is not CUDA-aware.
NOT_CUDA_AWARE = "CUDA tensor detected and the MPI used doesn't have CUDA-aware MPI support"


def prefix() -> Path:
    """The environment under test."""
    value = os.environ.get("PREFIX") or os.environ.get("CONDA_PREFIX")
    if not value:
        raise SystemExit("FAIL: neither PREFIX nor CONDA_PREFIX is set")
    return Path(value)


def expected_sum(rank_count: int, count: int) -> list[int]:
    """all_reduce(SUM) of rank r contributing (r + 1) * [1, 2, ..., count]: exact in int64 and float64."""
    factor = rank_count * (rank_count + 1) // 2
    return [factor * (i + 1) for i in range(count)]


# ---------------------------------------------------------------- worker side (under mpiexec)


def worker(device_kind: str) -> int:
    """One rank: all_reduce int64 and float64 tensors on ``device_kind`` and print the verdict."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("mpi")
    rank, world = dist.get_rank(), dist.get_world_size()
    if device_kind == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    count = 1 << 12
    problems = []
    for dtype in (torch.int64, torch.float64):
        mine = torch.arange(1, count + 1, dtype=dtype, device=device) * (rank + 1)
        try:
            dist.all_reduce(mine)
        except RuntimeError as exc:
            print(f"RANK {rank} RAISED {str(exc).splitlines()[0]}", flush=True)
            return 3
        got = mine.cpu().tolist()
        want = [dtype_value(v, dtype) for v in expected_sum(world, count)]
        if got != want:
            first = next(i for i, (g, w) in enumerate(zip(got, want)) if g != w)
            problems.append(f"{dtype}: element {first} is {got[first]}, expected {want[first]}")
    dist.destroy_process_group()
    if problems:
        print(f"RANK {rank} WRONG {'; '.join(problems)}", flush=True)
        return 1
    print(f"RANK {rank} EXACT {device_kind} world={world}", flush=True)
    return 0


def dtype_value(value: int, dtype: object) -> float | int:
    """The Python value torch's tolist() gives for ``value`` in ``dtype``."""
    import torch

    return float(value) if dtype == torch.float64 else value


# ---------------------------------------------------------------- launcher side


def launcher() -> list[str] | None:
    """The command that starts RANKS ranks (MPIEXEC, else mpiexec on PATH), or None."""
    configured = os.environ.get("MPIEXEC")
    if configured:
        return shlex.split(configured)
    found = shutil.which("mpiexec")
    return [found, "-n", str(RANKS)] if found else None


def launch(device_kind: str, env_changes: dict[str, str | None]) -> tuple[int, str]:
    """Run the worker on RANKS ranks; returns the launcher's exit code and the ranks' output."""
    command = launcher()
    assert command is not None
    env = dict(os.environ)
    for key, value in env_changes.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    proc = subprocess.run(
        [*command, sys.executable, os.path.abspath(__file__), "worker", device_kind],
        env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S,
    )
    return proc.returncode, proc.stdout + proc.stderr


def verdict(code: int, output: str, device_kind: str) -> tuple[bool, str]:
    """PASS when every rank reported exact results."""
    exact = [line for line in output.splitlines() if line.startswith("RANK ") and " EXACT " in line]
    if code == 0 and len(exact) == RANKS:
        return True, f"{RANKS}-rank all_reduce(SUM) on {device_kind} tensors (int64, float64) is exact"
    lines = [line for line in output.splitlines() if line.startswith("RANK ")] or output.strip().splitlines()[-5:]
    return False, f"launcher exit {code}: " + " | ".join(lines)


def cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_mpi_available() -> tuple[bool | None, str]:
    import torch.distributed as dist

    if dist.is_mpi_available():
        return True, "torch.distributed.is_mpi_available() is True"
    return False, "torch.distributed.is_mpi_available() is False: the MPI backend was not built"


def check_nccl_library() -> tuple[bool | None, str]:
    """The libnccl torch loads is the channel's (in this prefix)."""
    import torch
    from torch_dist_check.checks.envinfo import loaded_libraries, nccl_version_of

    if torch.version.cuda is None:
        return False, f"torch {torch.__version__} is a CPU build: no CUDA, no NCCL"
    lib_dir = os.path.realpath(prefix() / "lib")
    real = sorted({os.path.realpath(p) for p in loaded_libraries(r"^libnccl\.so")})
    if len(real) != 1 or not real[0].startswith(lib_dir + os.sep):
        return False, f"loaded {real or 'no libnccl.so'}, expected exactly one libnccl under {lib_dir}"
    return True, f"loaded {real[0]} (NCCL {'.'.join(map(str, nccl_version_of(real[0])))})"


def check_allreduce(device_kind: str) -> tuple[bool | None, str]:
    if launcher() is None:
        return None, "no MPI launcher: set MPIEXEC or put mpiexec on PATH (run on a compute node)"
    if device_kind == "cuda" and cuda_devices() == 0:
        return None, "no CUDA device is visible"
    # CUDA tensors go through MPI only with Cray MPICH's GPU support on (site-env sets it).
    changes = {"MPICH_GPU_SUPPORT_ENABLED": "1"} if device_kind == "cuda" else {}
    return verdict(*launch(device_kind, changes), device_kind)


def check_cuda_aware() -> tuple[bool | None, str]:
    """Cray MPICH: CUDA tensors pass with MPICH_GPU_SUPPORT_ENABLED=1 and raise the clear error without."""
    from torch_dist_check.checks.envinfo import mpi_facts

    import torch.distributed as dist

    if not dist.is_mpi_available():
        return False, "torch has no MPI backend"
    if launcher() is None:
        return None, "no MPI launcher: set MPIEXEC or put mpiexec on PATH (run on a compute node)"
    if cuda_devices() == 0:
        return None, "no CUDA device is visible"
    facts = mpi_facts(mpi_initialized=False)
    version = facts.library_version if facts else ""
    if "CRAY MPICH" not in version:
        return None, f"the MPI library is not Cray MPICH ({version.splitlines()[0] if version else 'unknown'})"
    on_ok, on_message = verdict(*launch("cuda", {"MPICH_GPU_SUPPORT_ENABLED": "1"}), "cuda")
    code, output = launch("cuda", {"MPICH_GPU_SUPPORT_ENABLED": None})
    refused = NOT_CUDA_AWARE in output
    if on_ok and refused:
        return True, "MPICH_GPU_SUPPORT_ENABLED=1: exact CUDA all_reduce; unset: the clear CUDA-aware error"
    problems = []
    if not on_ok:
        problems.append(f"with MPICH_GPU_SUPPORT_ENABLED=1: {on_message}")
    if not refused:
        problems.append(f"without it, no '{NOT_CUDA_AWARE}' (exit {code})")
    return False, "; ".join(problems)


CHECKS = {
    "mpi-available": check_mpi_available,
    "nccl-library": check_nccl_library,
    "allreduce-cpu": lambda: check_allreduce("cpu"),
    "allreduce-cuda": lambda: check_allreduce("cuda"),
    "cuda-aware": check_cuda_aware,
}


def main(argv: list[str]) -> int:
    """Run the named check (or, under a launcher, one worker rank)."""
    if len(argv) == 2 and argv[0] == "worker" and argv[1] in ("cpu", "cuda"):
        return worker(argv[1])
    if len(argv) != 1 or argv[0] not in CHECKS:
        print(f"usage: mpi_checks.py {{{'|'.join(CHECKS)}}}", file=sys.stderr)
        return 2
    ok, message = CHECKS[argv[0]]()
    if ok is None:
        print(f"SKIP: {argv[0]}: {message}")
        return 0
    print(f"{'PASS' if ok else 'FAIL'}: {argv[0]}: {message}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
