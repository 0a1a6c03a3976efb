"""Recipe tests of the ncclft flavor: python nccl_fault_checks.py header|nccl-library|activation|fault|watcher.

Each check prints one line and exits 0 when it passes, 1 when it fails. A check that needs hardware
this machine lacks prints "SKIP: <what is missing>" and exits 0, so the same tests run on a build
node (no GPU) and on a GPU node. The prefix under test is $PREFIX (rattler-build's test environment)
or else $CONDA_PREFIX.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

# NCCL's ncclResult_t numbering from 2.13.4 on; the unpatched 2.2/2.3 enum says NumResults = 6.
EXPECTED_ENUM = {"RemoteError": 6, "InProgress": 7, "NumResults": 8}
MIN_NCCL = (2, 13, 4)
# What the activation script defaults to (docs/explain/nccl-fault-tolerance.md).
ACTIVATION_DEFAULTS = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
    "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "0",
    "TORCH_NCCL_TRACE_BUFFER_SIZE": "0",
    "NCCL_CUMEM_ENABLE": "0",
    "TORCH_PEER_WATCHER": "1",
    "TORCH_DIST_USE_NCCL2": "0",
}
FAULT_OPS = ("allreduce", "sendrecv")


def prefix() -> Path:
    """The environment under test."""
    value = os.environ.get("PREFIX") or os.environ.get("CONDA_PREFIX")
    if not value:
        raise SystemExit("FAIL: neither PREFIX nor CONDA_PREFIX is set")
    return Path(value)


def enum_values(header_text: str) -> dict[str, int]:
    """The members of ``enum class ncclResult`` with their values."""
    match = re.search(r"enum class ncclResult\s*\{(.*?)\};", header_text, re.S)
    if match is None:
        return {}
    return {name: int(value) for name, value in re.findall(r"(\w+)\s*=\s*(\d+)", match.group(1))}


def check_header() -> tuple[bool, str]:
    """The installed torch/csrc/cuda/nccl.h numbers ncclResult as NCCL does (RemoteError = 6)."""
    import torch

    header = Path(torch.__file__).parent / "include" / "torch" / "csrc" / "cuda" / "nccl.h"
    if not header.is_file():
        return False, f"{header} is missing"
    values = enum_values(header.read_text())
    wrong = {k: values.get(k) for k, v in EXPECTED_ENUM.items() if values.get(k) != v}
    if wrong:
        return False, f"{header}: ncclResult has {wrong}, expected {EXPECTED_ENUM}"
    return True, f"{header}: RemoteError = 6, InProgress = 7, NumResults = 8"


def check_nccl_library() -> tuple[bool, str]:
    """The libnccl torch loads is the channel's, in this prefix, and at least NCCL 2.13.4."""
    import torch  # noqa: F401  (loads libtorch_cuda and with it libnccl)
    from torch_dist_check.checks.envinfo import loaded_libraries, nccl_library_check, nccl_version_of

    lib_dir = os.path.realpath(prefix() / "lib")
    if torch.version.cuda is None:
        return False, f"torch {torch.__version__} is a CPU build: no CUDA, no NCCL"
    paths = loaded_libraries(r"^libnccl\.so")
    if not paths:
        return False, "torch loaded no libnccl.so: NCCL is linked statically (USE_SYSTEM_NCCL was not honoured)"
    real = [os.path.realpath(p) for p in paths]
    outside = [p for p in real if not p.startswith(lib_dir + os.sep)]
    if outside or len(set(real)) != 1:
        return False, f"loaded {real}, expected exactly one libnccl under {lib_dir}"
    version = nccl_version_of(paths[0])
    if version < MIN_NCCL:
        return False, f"{real[0]} is NCCL {version}, older than 2.13.4 (no ncclRemoteError)"
    summary = f"loaded {real[0]} (NCCL {'.'.join(map(str, version))})"
    if torch.cuda.is_available():
        # With a GPU, torch_dist_check also compares it with the headers torch was built against.
        result = nccl_library_check(expect_version=None, expect_under=lib_dir)
        if result.status != "pass":
            return False, f"{result.name}: {result.reason}"
        summary += f"; {result.reason}"
    return True, summary


def check_activation() -> tuple[bool, str]:
    """Activation sets the recovery defaults only where the user set nothing; deactivation undoes it."""
    root = prefix() / "etc" / "conda"
    activate = root / "activate.d" / "pytorch-nccl-fault.sh"
    deactivate = root / "deactivate.d" / "pytorch-nccl-fault.sh"
    for script in (activate, deactivate):
        if not script.is_file():
            return False, f"{script} is missing"
    names = " ".join(ACTIVATION_DEFAULTS)
    probe = (
        f'. "{activate}"; for v in {names}; do eval "echo A:$v=\\${{$v-unset}}"; done; '
        f'. "{deactivate}"; for v in {names}; do eval "echo D:$v=\\${{$v-unset}}"; done'
    )
    clean = {k: v for k, v in os.environ.items() if k not in ACTIVATION_DEFAULTS and k != "NCCL_ASYNC_ERROR_HANDLING"}
    out = subprocess.run(["sh", "-c", probe], env=clean, capture_output=True, text=True, check=True).stdout
    expected = [f"A:{k}={v}" for k, v in ACTIVATION_DEFAULTS.items()] + [f"D:{k}=unset" for k in ACTIVATION_DEFAULTS]
    if out.split() != expected:
        return False, f"activation/deactivation gave {out.split()}, expected {expected}"
    user = dict(clean, NCCL_ASYNC_ERROR_HANDLING="3")
    kept = subprocess.run(
        ["sh", "-c", f'. "{activate}"; echo "${{TORCH_NCCL_ASYNC_ERROR_HANDLING-unset}}"'],
        env=user, capture_output=True, text=True, check=True,
    ).stdout.strip()
    if kept != "unset":
        return False, f"a user's legacy NCCL_ASYNC_ERROR_HANDLING=3 was overridden (TORCH_NCCL_ASYNC_ERROR_HANDLING={kept})"
    return True, "defaults " + ", ".join(f"{k}={v}" for k, v in ACTIVATION_DEFAULTS.items()) + " set and undone"


def check_fault() -> tuple[bool | None, str]:
    """With two GPUs: torch_dist_check's fault check, NCCL modes 0 and 2 x allreduce and send/recv."""
    import torch
    from torch_dist_check.checks.fault import FaultSettings, cases_for, run_cases

    if torch.cuda.device_count() < 2:
        return None, f"the fault check needs 2 GPUs, {torch.cuda.device_count()} visible"
    # Mode 2 is the flavor's own path (the watchdog frees the GPU); in mode 0 nothing aborts the
    # communicator, so the survivor does what an application must: abort its process group.
    results = [
        *run_cases(cases_for("nccl", (2,), FAULT_OPS), FaultSettings()),
        *run_cases(cases_for("nccl", (0,), FAULT_OPS), FaultSettings(recover="abort")),
    ]
    lines = [f"{r.name}: {r.status} {r.reason}" for r in results]
    return all(r.status == "pass" for r in results), "; ".join(lines)


def nccl_class_selected(torch_version: str, env: dict[str, str]) -> str:
    """The class ``init_process_group("nccl")`` builds under ``env``: 2.15.0 made nccl2 the default
    (``TORCH_DIST_USE_NCCL2=0``, which the activation sets, keeps the legacy one); 2.14 took nccl2 only with
    ``TORCH_DIST_USE_NCCL2=1``; older releases have only the legacy one."""
    major, minor = (int(part) for part in torch_version.split("+")[0].split(".")[:2])
    use = env.get("TORCH_DIST_USE_NCCL2")
    nccl2 = use != "0" if (major, minor) >= (2, 15) else (major, minor) >= (2, 14) and use == "1"
    return "ProcessGroupNCCL2" if nccl2 else "ProcessGroupNCCL"


def check_watcher() -> tuple[bool | None, str]:
    """With a GPU: the peer watcher recovers a rank from its peer's SIGKILL on the NCCL backend the activation
    selects (two ranks, sharing one GPU through NCCL's network if there is one), and that is the backend that ran."""
    import torch

    if torch.cuda.device_count() < 1:
        return None, "the watcher check needs a GPU, none visible"
    try:
        import torch_peer_watcher  # noqa: F401
    except ImportError:
        return None, f"torch-peer-watcher is not installed (it needs PyTorch >= 2.6; this is {torch.__version__})"
    expected = nccl_class_selected(torch.__version__, dict(os.environ))
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "result.json"
        subprocess.run(
            [sys.executable, "-m", "torch_dist_check", "--nproc", "2", "--backends", "nccl", "--quick",
             "--checks", "correctness,peerloss", "--peerloss-cases", "single", "--peerloss-ops", "allreduce",
             "--peerloss-watcher", "on", "--json", str(out)],
            check=False, timeout=900,
        )  # fmt: skip
        if not out.is_file():
            return False, "torch_dist_check wrote no result"
        checks = {c["name"]: c for c in json.loads(out.read_text())["checks"]}
    ran = checks.get("correctness/nccl/cuda", {}).get("details", {}).get("backend_class")
    watched = {name: c for name, c in checks.items() if name.startswith("peerloss/nccl") and name.endswith("/watcher")}
    lines = [f"{name}: {c['status']} {c.get('reason', '')}".strip() for name, c in watched.items()]
    ok = ran == expected and bool(watched) and all(c["status"] == "pass" for c in watched.values())
    return ok, f'"nccl" ran on {ran} (the activation selects {expected}); ' + ("; ".join(lines) or "no watcher case ran")


CHECKS = {
    "header": check_header,
    "nccl-library": check_nccl_library,
    "activation": check_activation,
    "fault": check_fault,
    "watcher": check_watcher,
}


def main(argv: list[str]) -> int:
    """Run the named check and report it in one line."""
    if len(argv) != 1 or argv[0] not in CHECKS:
        print(f"usage: nccl_fault_checks.py {{{'|'.join(CHECKS)}}}", file=sys.stderr)
        return 2
    ok, message = CHECKS[argv[0]]()
    if ok is None:
        print(f"SKIP: {argv[0]}: {message}")
        return 0
    print(f"{'PASS' if ok else 'FAIL'}: {argv[0]}: {message}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
