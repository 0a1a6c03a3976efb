"""torch_dist_check with an out-of-tree backend: --import, --plugin, and ops a backend does not implement.

The backend under test is registered from Python (torch.distributed.Backend.register_backend) by a
module this file writes; it is gloo underneath but, like torch's built-in ProcessGroupMPI, raises
"no support for _allgather_base in MPI process group" (and _reduce_scatter_base). The real suite
runs it on two CPU ranks (--nproc 2); nothing of the check logic is replaced.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="torch is not installed (pip install torch==2.13.0)")

from torch_dist_check.harness.backends import BackendError, parse_plugin  # noqa: E402
from torch_dist_check.checks.collectives import ALL_GATHER_NAMES, says_unsupported  # noqa: E402

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"

FAKEMPI_MODULE = '''
"""A CPU backend ``fakempi``: gloo underneath, without the flat collectives (as ProcessGroupMPI).

FAKEMPI_CORRUPT=1 makes all_reduce add 1 to its result; FAKEMPI_BROKEN_ALLGATHER=1 makes the flat
all_gather raise an error that says nothing about support.
"""

import os

import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroupGloo


class FakeMpi(dist.ProcessGroup):
    def __init__(self, store, rank, size, timeout):
        super().__init__(rank, size)
        self.gloo = ProcessGroupGloo(store, rank, size, timeout)

    def getBackendName(self):
        return "fakempi"

    def allreduce(self, tensors, opts):
        work = self.gloo.allreduce(tensors, opts)
        if os.environ.get("FAKEMPI_CORRUPT") == "1":
            work.wait()
            for tensor in tensors:
                tensor.add_(1)
        return work

    def broadcast(self, tensors, opts):
        return self.gloo.broadcast(tensors, opts)

    def send(self, tensors, dst, tag):
        return self.gloo.send(tensors, dst, tag)

    def recv(self, tensors, src, tag):
        return self.gloo.recv(tensors, src, tag)

    def barrier(self, opts):
        return self.gloo.barrier(opts)

    def _allgather_base(self, output, local, opts):
        if os.environ.get("FAKEMPI_BROKEN_ALLGATHER") == "1":
            raise RuntimeError("fakempi: connection reset by peer")
        raise RuntimeError("no support for _allgather_base in MPI process group")

    all_gather_single = _allgather_base

    def _reduce_scatter_base(self, output, full, opts):
        raise RuntimeError("no support for _reduce_scatter_base in MPI process group")

    reduce_scatter_single = _reduce_scatter_base


dist.Backend.register_backend("fakempi", FakeMpi, devices=["cpu"])
'''


def run_suite(args: list[str], tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess[str], dict | None]:
    """``python -m torch_dist_check ARGS --json FILE`` with the fakempi module importable."""
    (tmp_path / "fakempi_backend.py").write_text(FAKEMPI_MODULE)
    out = tmp_path / "result.json"
    path = os.pathsep.join([str(SCRIPTS), str(tmp_path), os.environ.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-m", "torch_dist_check", *args, "--json", str(out)],
        env=dict(os.environ, PYTHONPATH=path, **env), capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    return proc, json.loads(out.read_text()) if out.exists() else None


def by_name(document: dict) -> dict[str, dict]:
    return {c["name"]: c for c in document["checks"]}


FAKEMPI_RUN = ["--nproc", "2", "--import", "fakempi_backend", "--backends", "fakempi", "--quick", "--max-bytes", "64K"]


def test_ops_a_plugin_does_not_implement_are_skipped_and_the_rest_pass(tmp_path):
    proc, doc = run_suite([*FAKEMPI_RUN, "--checks", "correctness,bandwidth"], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    checks = by_name(doc)
    correct = checks["correctness/fakempi/cpu"]
    assert correct["status"] == "pass" and correct["ranks"] == [0, 1]
    # all_reduce x2, broadcast and send/recv per dtype and count, plus the barrier; the flat
    # collectives are not counted as cases.
    details = correct["details"]
    assert details["cases"] == 4 * len(details["dtypes"]) * len(details["counts"]) + 1
    assert details["dtypes"] == ["int32", "int64", "float32", "float64"]  # the plug-in default
    for check in ("correctness", "bandwidth"):
        for collective, op in (("all_gather", "all_gather"), ("reduce_scatter", "reduce_scatter")):
            skipped = checks[f"{check}/fakempi/cpu/{collective}"]
            assert skipped["status"] == "skipped"
            assert skipped["reason"].startswith(f"fakempi does not implement {op}_")  # _single or _tensor
            assert "no support for _" in skipped["details"]["error"]
    rows = checks["bandwidth/fakempi/cpu"]["details"]["rows"]
    assert {r["collective"] for r in rows} == {"all_reduce", "broadcast"}
    assert doc["job"]["backends"]["fakempi"] == {
        "devices": ["cpu"], "mpi_launch": False, "dtypes": ["int32", "int64", "float32", "float64"], "plugin": True
    }  # fmt: skip
    assert "SKIPPED  fakempi does not implement" in proc.stdout


def test_wrong_results_and_other_errors_still_fail_next_to_a_skipped_op(tmp_path):
    proc, doc = run_suite(
        [*FAKEMPI_RUN, "--checks", "correctness"], tmp_path, FAKEMPI_CORRUPT="1", FAKEMPI_BROKEN_ALLGATHER="1"
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    checks = by_name(doc)
    failures = checks["correctness/fakempi/cpu"]["details"]["failures"]
    assert checks["correctness/fakempi/cpu"]["status"] == "fail"
    assert "all_reduce(sum) int32 n=1: element 0: got 4, expected 3" in failures
    assert "all_gather int32 n=1: raised RuntimeError: fakempi: connection reset by peer" in failures
    # An error that does not say the op is unsupported is never a skip.
    assert "correctness/fakempi/cpu/all_gather" not in checks
    assert checks["correctness/fakempi/cpu/reduce_scatter"]["status"] == "skipped"


def test_unknown_backend_is_a_usage_error_naming_the_registered_ones(tmp_path):
    proc, doc = run_suite(["--nproc", "2", "--backends", "fakempi"], tmp_path)
    assert proc.returncode == 2 and doc is None
    assert "unknown backend fakempi: torch.distributed has gloo, nccl" in proc.stderr
    assert "add --import MODULE" in proc.stderr


def test_a_plugin_whose_profile_needs_mpi_is_skipped_without_an_mpi_launch(tmp_path):
    proc, doc = run_suite(
        ["--nproc", "2", "--import", "fakempi_backend", "--plugin", "fakempi:launch=mpi", "--checks", "correctness"],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    checks = by_name(doc)
    # Without --backends: the built-ins and every --plugin.
    assert checks["correctness/fakempi"]["status"] == "skipped"
    assert "not started by mpiexec/mpirun" in checks["correctness/fakempi"]["reason"]
    assert checks["correctness/gloo/cpu"]["status"] == "pass"


def test_plugin_profiles_parse_with_defaults_and_refuse_nonsense():
    profile = parse_plugin("cudampi:devices=cpu+cuda:launch=mpi")
    assert (profile.devices, profile.mpi_launch, profile.dtypes) == (("cpu", "cuda"), True, ("int32", "int64", "float32", "float64"))
    plain = parse_plugin("switchml")
    assert (plain.devices, plain.mpi_launch) == (None, False)  # resolved against what it registered
    assert parse_plugin("x:dtypes=float32+bfloat16").dtypes == ("float32", "bfloat16")
    for bad, message in (
        ("x:devices=tpu", "unknown devices tpu"),
        ("x:launch=slurm", "unknown launch slurm"),
        ("x:color=blue", "unknown key 'color'"),
        ("x:devices", "expected KEY=VALUE"),
        ("mpi:devices=cpu", "mpi is built in"),
    ):
        with pytest.raises(BackendError, match=message):
            parse_plugin(bad)


def test_only_runtime_errors_that_say_the_op_is_unsupported_count():
    assert says_unsupported(RuntimeError("no support for _allgather_base in MPI process group"), ALL_GATHER_NAMES)
    assert says_unsupported(NotImplementedError("Backend x does not support _allgather_base"), ALL_GATHER_NAMES)
    # Unsupported, but another op (a dtype, or a different collective), or not a RuntimeError.
    assert not says_unsupported(RuntimeError("Unsupported data type for MPI backend"), ALL_GATHER_NAMES)
    assert not says_unsupported(RuntimeError("no support for _reduce_scatter_base"), ALL_GATHER_NAMES)
    assert not says_unsupported(ValueError("no support for _allgather_base"), ALL_GATHER_NAMES)
    assert not says_unsupported(RuntimeError("_allgather_base: connection reset"), ALL_GATHER_NAMES)


def test_builtin_backends_resolve_without_importing_torch():
    # The --nproc launcher resolves --backends before it starts its ranks; for the built-in names it
    # needs no torch (every torch.distributed lists gloo, nccl and mpi), so it does not pay a torch
    # import (1.4 s of CPU) on top of its ranks'. A plug-in name or --import still asks torch.
    code = (
        "import sys\n"
        "from torch_dist_check.harness import backends\n"
        "profiles = backends.resolve(['gloo', 'nccl', 'mpi'], [], [])\n"
        "assert [p.name for p in profiles] == ['gloo', 'nccl', 'mpi'], profiles\n"
        "assert profiles[0] is backends.BUILTIN_PROFILES['gloo']\n"
        "print('torch' in sys.modules)\n"
    )
    env = dict(os.environ, PYTHONPATH=f"{SCRIPTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"
