"""torch_dist_check with an out-of-tree backend: --import, --plugin, and ops a backend does not implement.

The backends under test are registered from Python (torch.distributed.Backend.register_backend) by a
module this file writes; they are gloo underneath but, like torch's built-in ProcessGroupMPI, raise
"no support for _allgather_base in MPI process group" (and _reduce_scatter_base); one of them also
computes wrong sums. The real suite runs them on two CPU ranks (--nproc 2); nothing of the check logic
is replaced.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="torch is not installed (bash scripts/install-test-deps.sh installs it)")

import suite_process  # noqa: E402
from torch_dist_check.harness.backends import BackendError, parse_plugin  # noqa: E402
from torch_dist_check.checks.collectives import ALL_GATHER_NAMES, says_unsupported  # noqa: E402

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"

FAKEMPI_MODULE = '''
"""Two CPU backends, gloo underneath, without the flat collectives (as ProcessGroupMPI): ``fakempi``, and
``brokenmpi``, whose all_reduce adds 1 to its result and whose flat all_gather raises an error that says
nothing about support.
"""

import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroupGloo


class FakeMpi(dist.ProcessGroup):
    corrupt = False
    broken_allgather = False

    def __init__(self, store, rank, size, timeout):
        super().__init__(rank, size)
        self.gloo = ProcessGroupGloo(store, rank, size, timeout)

    def getBackendName(self):
        return "fakempi"

    def allreduce(self, tensors, opts):
        work = self.gloo.allreduce(tensors, opts)
        if self.corrupt:
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
        if self.broken_allgather:
            raise RuntimeError("fakempi: connection reset by peer")
        raise RuntimeError("no support for _allgather_base in MPI process group")

    all_gather_single = _allgather_base

    def _reduce_scatter_base(self, output, full, opts):
        raise RuntimeError("no support for _reduce_scatter_base in MPI process group")

    reduce_scatter_single = _reduce_scatter_base


class BrokenMpi(FakeMpi):
    corrupt = True
    broken_allgather = True

    def getBackendName(self):
        return "brokenmpi"


dist.Backend.register_backend("fakempi", FakeMpi, devices=["cpu"])
dist.Backend.register_backend("brokenmpi", BrokenMpi, devices=["cpu"])
'''


@functools.cache
def plugin_dir() -> Path:
    """A folder holding the fakempi module, one for the module's runs (so one PYTHONPATH: one fork server)."""
    folder = Path(tempfile.mkdtemp(prefix="channelsmith-tests-fakempi-"))
    atexit.register(shutil.rmtree, folder, True)
    (folder / "fakempi_backend.py").write_text(FAKEMPI_MODULE)
    return folder


def run_suite(args: list[str], tmp_path: Path) -> tuple[subprocess.CompletedProcess[str], dict | None]:
    """``python -m torch_dist_check ARGS --json FILE`` with the fakempi module importable (tests/suite_process.py).

    The command forks from the test process's fork server; with ``--import`` its ``--nproc`` launcher starts its
    ranks' fork server as an interpreter of its own (a torch import per run), as a user's launcher does: the ranks
    import the plug-in themselves (torch_dist_check/harness/run.py, run_spawned), which is what these runs prove."""
    out = tmp_path / "result.json"
    path = suite_process.python_path(SCRIPTS, plugin_dir())
    proc = suite_process.run([*args, "--json", str(out)], dict(os.environ, PYTHONPATH=path), timeout=300, cwd=tmp_path)
    return proc, json.loads(out.read_text()) if out.exists() else None


def by_name(document: dict) -> dict[str, dict]:
    return {c["name"]: c for c in document["checks"]}


FAKEMPI_RUN = ["--nproc", "2", "--import", "fakempi_backend", "--quick", "--max-bytes", "64K"]


@pytest.fixture(scope="module")
def fake_and_broken(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], dict]:
    """One run of both plug-ins, correctness and bandwidth (each run of the suite costs a torch import)."""
    proc, doc = run_suite([*FAKEMPI_RUN, "--backends", "fakempi,brokenmpi", "--checks", "correctness,bandwidth"],
                          tmp_path_factory.mktemp("fake-and-broken"))  # fmt: skip
    assert doc is not None, proc.stdout + proc.stderr
    return proc, doc


def test_ops_a_plugin_does_not_implement_are_skipped_and_the_rest_pass(fake_and_broken):
    proc, doc = fake_and_broken
    checks = by_name(doc)
    # Only brokenmpi's checks fail (the next test): a skipped op fails nothing (a run with skips alone
    # exits 0: test_a_plugin_whose_profile_needs_mpi_is_skipped_without_an_mpi_launch).
    assert proc.returncode == 1, proc.stdout + proc.stderr
    failed = [name for name, c in checks.items() if c["status"] == "fail"]
    assert failed and all("/brokenmpi/" in name for name in failed), failed
    correct = checks["correctness/fakempi/cpu"]
    assert correct["status"] == "pass" and correct["ranks"] == [0, 1]
    # all_reduce x2, broadcast and send/recv per dtype and count, plus the barrier; the flat
    # collectives are not counted as cases.
    details = correct["details"]
    assert details["cases"] == 4 * len(details["dtypes"]) * len(details["counts"]) + 1
    assert details["dtypes"] == ["int32", "int64", "float32", "float64"]  # the plug-in default
    # A plug-in that is its own ProcessGroup has no per-device backend: its sends are posted one by one (PyTorch
    # 2.15.0's batch_isend_irecv raised "No backend type associated with device type cpu" for it).
    assert details["send_recv"] == "isend/irecv" and details["backend_class"] == "FakeMpi"
    for check in ("correctness", "bandwidth"):
        for collective, op in (("all_gather", "all_gather"), ("reduce_scatter", "reduce_scatter")):
            skipped = checks[f"{check}/fakempi/cpu/{collective}"]
            assert skipped["status"] == "skipped"
            assert skipped["reason"].startswith(f"fakempi does not implement {op}_")  # _single or _tensor
            assert "no support for _" in skipped["details"]["error"]
    assert checks["bandwidth/fakempi/cpu"]["status"] == "pass"
    rows = checks["bandwidth/fakempi/cpu"]["details"]["rows"]
    assert {r["collective"] for r in rows} == {"all_reduce", "broadcast"}
    assert doc["job"]["backends"]["fakempi"] == {
        "devices": ["cpu"], "mpi_launch": False, "dtypes": ["int32", "int64", "float32", "float64"], "plugin": True
    }  # fmt: skip
    assert "SKIPPED  fakempi does not implement" in proc.stdout


def test_wrong_results_and_other_errors_still_fail_next_to_a_skipped_op(fake_and_broken):
    _, doc = fake_and_broken
    checks = by_name(doc)
    failures = checks["correctness/brokenmpi/cpu"]["details"]["failures"]
    assert checks["correctness/brokenmpi/cpu"]["status"] == "fail"
    assert "all_reduce(sum) int32 n=1: element 0: got 4, expected 3" in failures
    assert "all_gather int32 n=1: raised RuntimeError: fakempi: connection reset by peer" in failures
    # An error that does not say the op is unsupported is never a skip.
    assert "correctness/brokenmpi/cpu/all_gather" not in checks
    assert checks["correctness/brokenmpi/cpu/reduce_scatter"]["status"] == "skipped"


def test_unknown_backend_is_a_usage_error_naming_the_registered_ones(tmp_path):
    proc, doc = run_suite(["--nproc", "2", "--backends", "fakempi"], tmp_path)
    assert proc.returncode == 2 and doc is None
    assert "unknown backend fakempi: torch.distributed has gloo, nccl" in proc.stderr
    assert "add --import MODULE" in proc.stderr


def test_a_plugin_whose_profile_needs_mpi_is_skipped_without_an_mpi_launch(tmp_path):
    proc, doc = run_suite(
        ["--nproc", "2", "--import", "fakempi_backend", "--plugin", "fakempi:launch=mpi", "--checks", "correctness", "--quick"],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    checks = by_name(doc)
    # Without --backends: the built-ins and every --plugin.
    assert checks["correctness/fakempi"]["status"] == "skipped"
    assert "not started by mpiexec/mpirun" in checks["correctness/fakempi"]["reason"]
    assert checks["correctness/gloo/cpu"]["status"] == "pass"
    gloo = checks["correctness/gloo/cpu"]["details"]
    assert gloo["send_recv"] == "batch_isend_irecv" and gloo["backend_class"] == "ProcessGroupGloo"


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
    env = dict(os.environ, PYTHONPATH=suite_process.python_path())
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"
