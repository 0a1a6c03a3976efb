"""torch_dist_check run for real on CPU: two gloo ranks, and the fault harness with planted failures.

These start real processes (``python -m torch_dist_check``, most forked from the test process's fork
server: tests/suite_process.py) and read the JSON they write. They need
PyTorch (CI installs torch 2.15.0, scripts/install-test-deps.sh); the NCCL and GPU fault cases run on GPU nodes
(docs/records/suite-fault-and-bandwidth-two-h200.md has those figures).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="torch is not installed (bash scripts/install-test-deps.sh installs it)")

import suite_process  # noqa: E402

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_check(args: list[str], tmp_path: Path, timeout: float = 400) -> tuple[subprocess.CompletedProcess[str], dict]:
    """Run ``python -m torch_dist_check ARGS --json FILE``; return the process and the parsed JSON."""
    out = tmp_path / "result.json"
    env = dict(os.environ, PYTHONPATH=suite_process.python_path())
    # A one-rank run without a launcher would take the suite's fixed default port: another run on the
    # same machine at the same time (a second checkout's tests) must not collide with it.
    env.setdefault("MASTER_PORT", str(_free_port()))
    # Forked from this test process's fork server: one torch import for all its runs (tests/suite_process.py).
    proc = suite_process.run([*args, "--json", str(out)], env, timeout=timeout, cwd=tmp_path)
    assert out.exists(), f"no JSON written; rc={proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc, json.loads(out.read_text())


def checks_by_name(document: dict) -> dict[str, dict]:
    return {c["name"]: c for c in document["checks"]}


def test_fault_harness_passes_when_the_survivor_catches_the_error(tmp_path):
    proc, doc = run_check(["--checks", "fault", "--backends", "gloo", "--fault-backend", "gloo"], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name in ("fault/gloo/allreduce", "fault/gloo/sendrecv"):
        details = checks_by_name(doc)[name]["details"]
        assert details["exception_caught"] and details["cpu_alive"] and details["gpu_usable"]
        assert 0 <= details["exception_s"] <= details["gpu_usable_s"] < 30
        assert details["victim_exit"] == "killed by SIGKILL"


def test_planted_abort_after_the_exception_is_a_failure(tmp_path):
    proc, doc = run_check(
        ["--checks", "fault", "--backends", "gloo", "--fault-backend", "gloo", "--fault-ops", "allreduce", "--fault-plant", "abort"],
        tmp_path,
    )
    assert proc.returncode == 1
    check = checks_by_name(doc)["fault/gloo/allreduce"]
    assert check["status"] == "fail"
    assert "SIGABRT" in check["reason"] and check["details"]["survivor_exit"] == "killed by SIGABRT"
    assert check["details"]["exception_caught"] is True and check["details"]["cpu_alive"] is False


def test_planted_hang_is_a_bounded_failure_naming_the_stage(tmp_path):
    proc, doc = run_check(
        ["--checks", "fault", "--backends", "gloo", "--fault-backend", "gloo", "--fault-ops", "sendrecv",
         "--fault-plant", "hang", "--fault-exception-timeout", "4"],
        tmp_path,
    )  # fmt: skip
    assert proc.returncode == 1
    check = checks_by_name(doc)["fault/gloo/sendrecv"]
    assert check["status"] == "fail" and "stage 'exception' did not complete within 4 s" in check["reason"]
    assert check["duration_s"] < 60


def test_a_stage_that_outlives_its_bound_ends_the_run_with_a_report(tmp_path):
    # 0.5 s is too short for a real gloo correctness pass on two ranks; the watchdog must say so.
    proc, doc = run_check(["--nproc", "2", "--backends", "gloo", "--checks", "correctness", "--stage-timeout", "0.5"], tmp_path)
    assert proc.returncode == 3
    assert doc["incomplete_stage"] is not None and doc["summary"]["ok"] is False
    # The suite's own verdict on the stage, not the copy it wrote as the stage began.
    assert doc["in_progress"] is False
    assert "did not complete within" in proc.stderr


def test_a_run_stopped_from_outside_leaves_a_report_naming_the_stage_in_progress(tmp_path):
    import signal
    import time

    out = tmp_path / "partial.json"
    env = dict(os.environ, PYTHONPATH=suite_process.python_path())
    proc = suite_process.start(
        ["--nproc", "2", "--backends", "gloo", "--checks", "env,bandwidth", "--max-bytes", "1G", "--json", str(out)],
        env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 180
    stage = None
    while time.monotonic() < deadline and stage != "bandwidth/gloo/cpu":
        time.sleep(0.5)
        if out.exists():
            stage = json.loads(out.read_text())["incomplete_stage"]
    # As a batch system's time limit would: SIGTERM to the launcher.
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    assert stage == "bandwidth/gloo/cpu"
    document = json.loads(out.read_text())
    assert document["incomplete_stage"] == "bandwidth/gloo/cpu" and document["summary"]["ok"] is False
    # What the stopped run left is the copy written as the stage began: no verdict.
    assert document["in_progress"] is True
    assert [c["name"] for c in document["checks"]][:1] == ["env/torch"]


# Planted in every rank with --import: rank 0's first correctness stage ends its process as a
# crash inside NCCL's init did on one H100 (aws-ofi-nccl 1.6.0, FI_PROVIDER=no-such-provider, NCCL
# 2.28.9): NCCL logged the plugin's failure, then the process died, either of the signal itself or
# through libinfinipath's SIGSEGV handler, which prints a backtrace and calls exit(1). HOW (a line the
# fixture writes above this text) says which.
CRASH_PLANT = """
import os, resource, signal, socket, sys
from torch_dist_check.checks import correctness

NCCL_LOG = (
    "vm:1:1 [0] NCCL INFO NET/Plugin: Loaded net plugin AWS Libfabric (v6)\\n"
    "[2026-11-25 06:02:58] vm:1:1 [0] find_ofi_provider:753 NCCL WARN NET/OFI Couldn't find any optimal provider\\n"
    "vm:1:1 [0] NCCL INFO Failed to initialize NET plugin AWS Libfabric\\n"
)
run_correctness = correctness.run_correctness


def crash(backend, device, group, rank, world_size, plan):
    if rank != 0:
        return run_correctness(backend, device, group, rank, world_size, plan)
    path = os.environ["NCCL_DEBUG_FILE"].replace("%h", socket.gethostname()).replace("%p", str(os.getpid()))
    with open(path, "a") as log:
        log.write(NCCL_LOG)
    if HOW == "signal":
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        signal.signal(signal.SIGSEGV, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGSEGV)
    sys.stderr.write(f"\\npython3:{os.getpid()} terminated with signal 11 at PC=0 SP=7ffd07613ec8.  Backtrace:\\n")
    sys.stderr.flush()
    os._exit(1)


correctness.run_correctness = crash
"""


def crash_plant(how: str) -> str:
    """The module name of the plant that dies ``how``."""
    return "tdc_crash_plant_" + how.replace("-", "_")


@pytest.fixture(scope="module")
def crash_plant_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder of the plants, one module for each way to die: one PYTHONPATH, and no variable that says which.
    Both runs fork from the module's fork server (tests/suite_process.py); with a variable of their own each
    took a server of its own (a variable that is not read late, harness/forkserver.py), a torch import apiece
    (1.3 s of CPU with PyPI's CUDA build on the 2-core CI machine)."""
    folder = tmp_path_factory.mktemp("crash-plant")
    for how in ("exit-1", "signal"):
        (folder / f"{crash_plant(how)}.py").write_text(f"HOW = {how!r}\n{CRASH_PLANT}")
    return folder


@pytest.mark.parametrize(
    ("how", "ended"),
    [("exit-1", "exit 1 in stage 'correctness/gloo/cpu' before its verdict"), ("signal", "killed by SIGSEGV in stage 'correctness/gloo/cpu'")],
)
def test_a_rank_that_dies_in_a_stage_leaves_a_report_saying_how_and_what_nccl_logged(crash_plant_dir, tmp_path, monkeypatch,
                                                                                     how, ended):  # fmt: skip
    monkeypatch.setenv("PYTHONPATH", suite_process.python_path(crash_plant_dir))
    monkeypatch.delenv("NCCL_DEBUG_FILE", raising=False)
    scratch = tmp_path / "tmpdir"
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))
    proc, doc = run_check(
        ["--nproc", "2", "--backends", "gloo,nccl", "--checks", "env,correctness", "--quick", "--stage-timeout", "60",
         "--import", crash_plant(how), "--expect-nccl-net", "AWS Libfabric"],
        tmp_path,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    # The run failed: the folder of NCCL's logs stays, named on stderr (a passing run's goes).
    [kept] = scratch.glob("torch-dist-check-nccl-*")
    assert list(kept.glob("nccl.*.log")) and f"NCCL's logs of this run are kept in {kept}" in proc.stderr, proc.stderr[-2000:]
    assert doc["summary"]["ok"] is False and doc["incomplete_stage"] == "correctness/gloo/cpu"
    checks = checks_by_name(doc)
    ranks = checks["harness/ranks"]
    assert ranks["status"] == "fail"
    assert f"rank 0: {ended}" in ranks["reason"]
    if how == "exit-1":
        assert "last words: python3:" in ranks["reason"] and "terminated with signal 11" in ranks["reason"]
    network = checks["env/nccl-network"]
    assert network["status"] == "fail" and network["ranks"] == [0]
    assert "Failed to initialize NET plugin AWS Libfabric" in network["reason"]
    assert "NET/OFI Couldn't find any optimal provider" in network["reason"]
    assert "harness/ranks" in proc.stdout and "FAIL" in proc.stdout


def test_a_run_of_local_ranks_leaves_nothing_in_tmpdir(tmp_path):
    # The ranks' stage and verdict files went to a folder of TMPDIR that nothing removed: one per run; so did
    # the folder of NCCL's logs, made wherever "nccl" is asked for (here it is skipped: no GPU, or no NCCL).
    scratch = tmp_path / "tmpdir"
    scratch.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("NCCL_")}
    env.update(PYTHONPATH=suite_process.python_path(), TMPDIR=str(scratch))
    proc = suite_process.run(["--nproc", "2", "--backends", "gloo,nccl", "--checks", "env", "--quick"], env, timeout=120,
                             cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert sorted(scratch.iterdir()) == []


# Every size of a sweep costs the same calls on every rank; a 2-core CPU machine must see the default
# run (no --quick: sizes to 1 GiB) end within this bound.
DEFAULT_RUN_BOUND_S = 180


def assert_a_passing_default_sweep(proc: subprocess.CompletedProcess[str], doc: dict, plot: Path,
                                   max_call_s: float = 0.5) -> dict:
    """What a default gloo run on two CPU ranks must show: correct, every collective swept from 8 B to 64 MiB
    with nccl-tests' figures, the plot written; the bandwidth check's details."""
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    checks = checks_by_name(doc)
    assert doc["summary"]["ok"] is True and doc["job"]["world_size"] == 2
    # --nproc: rank 0's store took a port from the kernel and published it (no port picked beforehand).
    assert doc["job"]["master_port"] > 0
    correctness = checks["correctness/gloo/cpu"]
    assert correctness["status"] == "pass" and correctness["details"]["failures"] == []
    assert correctness["ranks"] == [0, 1] and correctness["details"]["cases"] > 50
    # Without GPUs the NCCL cases are skipped with a reason, and do not fail the run.
    assert checks["fault/nccl/mode2/allreduce"]["status"] == "skipped"
    assert "checks:" in proc.stdout and "correctness/gloo/cpu" in proc.stdout
    if doc.get("plot", {}).get("written"):
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert "matplotlib" in doc["plot"]["reason"]
    sweep = checks["bandwidth/gloo/cpu"]
    details = sweep["details"]
    assert sweep["status"] == "pass" and details["max_call_s"] == max_call_s
    for row in details["rows"]:
        assert row["busbw_GBps"] > 0 and row["time_us"] > 0
        assert row["algbw_GBps"] == pytest.approx(row["bytes"] / (row["time_us"] / 1e6) / 1e9)
    allreduce = [r for r in details["rows"] if r["collective"] == "all_reduce"]
    assert all(r["busbw_GBps"] == pytest.approx(r["algbw_GBps"]) for r in allreduce)  # 2(n-1)/n = 1 for n = 2
    # CPU tensors sweep to 64 MiB unless told (GPUs to 1 GiB): gloo's bus bandwidth has levelled off there.
    assert details["max_bytes"] == 64 << 20
    rows = details["rows"]
    for collective in ("all_reduce", "all_gather", "reduce_scatter", "broadcast"):
        sizes = [r["bytes"] for r in rows if r["collective"] == collective]
        assert sizes[0] == 8, (collective, sizes)
        if sizes[-1] < details["max_bytes"]:
            # Ended early only because one call of its largest size was over the bound, and says so (a loaded
            # 2-core machine: reduce_scatter's 32 MiB call took over 0.5 s once in a full test run).
            assert f"stopped after {sizes[-1]} B: one call took" in details["stopped"].get(collective, ""), details
        else:
            assert sizes[-1] == 64 << 20 and collective not in details["stopped"], (collective, sizes)
    # Warm-ups and timed iterations were cut to the per-size budget: never fewer than 3 timed.
    assert all(r["iters"] >= 3 for r in rows)
    return details


def test_the_default_run_on_cpu_is_correct_and_sweeps_to_64_mib_with_counts_cut_to_a_short_budget(tmp_path):
    # The default run's checks and sizes with a per-size budget of 50 ms and one warm-up: the counts of every
    # large size are cut to the budget from timings, so the ranks must agree on them (before they did, ranks
    # that timed a size differently issued different numbers of calls and the run never ended), down to the
    # floor of 3. 12 s of CPU instead of 19 s (2-core machine, torch 2.15.0); the run with the default budget
    # and its time bound is the heavy test below. A call's bound of 30 s: every size is swept however loaded the
    # machine is (the bound's own stop is the test after the next).
    proc, doc = run_check(["--nproc", "2", "--backends", "gloo", "--plot", str(tmp_path / "sweep.png"),
                           "--size-budget-s", "0.05", "--warmup", "1", "--max-call-s", "30"], tmp_path,
                          timeout=DEFAULT_RUN_BOUND_S + 60)  # fmt: skip
    details = assert_a_passing_default_sweep(proc, doc, tmp_path / "sweep.png", max_call_s=30)
    assert details["size_budget_s"] == 0.05
    assert all(max(r["bytes"] for r in details["rows"] if r["collective"] == c) == 64 << 20
               for c in ("all_reduce", "all_gather", "reduce_scatter", "broadcast")), details["stopped"]
    assert any(r["iters"] == 3 for r in details["rows"]), "no size was cut to the floor of 3 timed iterations"


@pytest.mark.heavy
def test_the_default_run_on_cpu_is_correct_and_sweeps_what_gloo_can_within_three_minutes(tmp_path):
    # The default run as a user starts it (per-size budget 2 s, 5 warm-ups): within DEFAULT_RUN_BOUND_S on a
    # 2-core machine (17-33 s there; 19 s of CPU). Heavy: the test above runs the same checks, sizes and
    # agreement with a short budget in the default run.
    started = time.monotonic()
    proc, doc = run_check(["--nproc", "2", "--backends", "gloo", "--plot", str(tmp_path / "sweep.png")], tmp_path,
                          timeout=DEFAULT_RUN_BOUND_S + 60)  # fmt: skip
    elapsed = time.monotonic() - started
    details = assert_a_passing_default_sweep(proc, doc, tmp_path / "sweep.png")
    assert elapsed < DEFAULT_RUN_BOUND_S, f"default gloo run took {elapsed:.0f} s"
    assert details["size_budget_s"] == 2.0
    rows = details["rows"]
    print(f"\ndefault gloo run: {elapsed:.1f} s; largest sizes: "
          f"{ {c: max(r['bytes'] for r in rows if r['collective'] == c) >> 20 for c in details['peak_busbw_GBps']} } MiB")  # fmt: skip


def test_a_sweep_ends_after_the_first_size_whose_call_is_over_max_call_s(tmp_path):
    # The bound that ends a default run's sweep where one call gets slow (the default gloo run used to reach
    # it at 512 MiB), made to bite at small sizes: 1 ms per call, an explicit --max-bytes of 64 MiB.
    proc, doc = run_check(["--nproc", "2", "--backends", "gloo", "--checks", "bandwidth", "--max-bytes", "64M",
                           "--max-call-s", "0.001", "--size-budget-s", "0.2"], tmp_path, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    details = checks_by_name(doc)["bandwidth/gloo/cpu"]["details"]
    assert details["max_bytes"] == 64 << 20 and details["max_call_s"] == 0.001
    for collective in ("all_reduce", "all_gather", "reduce_scatter", "broadcast"):
        sizes = [r["bytes"] for r in details["rows"] if r["collective"] == collective]
        assert sizes and sizes[-1] < 64 << 20, (collective, sizes)
        why = details["stopped"][collective]
        assert why.startswith(f"stopped after {sizes[-1]} B: one call took") and "> max_call_s 0.001 s" in why, why


def test_max_call_s_must_be_positive(tmp_path):
    env = dict(os.environ, PYTHONPATH=suite_process.python_path())
    proc = subprocess.run(
        [sys.executable, "-m", "torch_dist_check", "--nproc", "2", "--max-call-s", "0"],
        env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 2 and "--max-call-s" in proc.stderr and "more than 0" in proc.stderr


@pytest.mark.parametrize("launch", [[], ["--nproc", "2"]], ids=["one-rank", "nproc"])
def test_without_numpy_the_run_stops_first_with_the_cause(tmp_path, launch):
    # A numpy that cannot be imported, as on a node with PyTorch alone: torch then works but for Tensor.numpy(),
    # which torch.distributed's all_gather_object needs.
    (tmp_path / "hide" / "numpy").mkdir(parents=True)
    (tmp_path / "hide" / "numpy" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'numpy'\", name='numpy')\n"
    )
    env = dict(os.environ, PYTHONPATH=f"{tmp_path / 'hide'}{os.pathsep}{SCRIPTS}")
    proc = subprocess.run(
        [sys.executable, "-m", "torch_dist_check", "--backends", "gloo", "--quick", *launch],
        env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "NumPy cannot be imported (No module named 'numpy')" in proc.stderr and "\nhint: install numpy" in proc.stderr
    assert "Traceback" not in proc.stderr and "CHECK" not in proc.stdout


# ---------------------------------------------------------------------------------------------
# Report files (--json, --plot): looked at before the run; a failure to write one costs no verdict
# ---------------------------------------------------------------------------------------------


def _suite_env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=suite_process.python_path())


@pytest.mark.parametrize(
    ("option", "where", "message"),
    [
        ("--plot", "missing/dir/p.png", "the folder {tmp}/missing/dir does not exist"),
        ("--json", "missing/dir/r.json", "the folder {tmp}/missing/dir does not exist"),
        ("--plot", ".", "{tmp}/. is a directory, not a file name"),
        ("--plot", "p.xyz", "matplotlib cannot write .xyz files"),
        ("--json", "x" * 300 + ".json", "File name too long"),
    ],
)
def test_a_report_path_that_cannot_be_written_is_refused_before_the_run(tmp_path, option, where, message):
    if where.endswith(".xyz"):
        pytest.importorskip("matplotlib", reason="matplotlib is not installed (it decides which file types --plot writes)")
    before = sorted(tmp_path.rglob("*"))
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "torch_dist_check", "--nproc", "2", "--backends", "gloo", "--quick",
         option, f"{tmp_path}/{where}"],
        env=_suite_env(), capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message.format(tmp=tmp_path) in proc.stderr and "\nhint: " in proc.stderr
    assert "CHECK" not in proc.stdout, "checks ran before the path was refused"
    assert time.monotonic() - started < 30
    assert sorted(tmp_path.rglob("*")) == before  # no folder made, nothing written


def test_under_a_launcher_every_rank_stops_when_rank_0_cannot_write_its_report(tmp_path):
    # As torchrun, srun or mpiexec start them: rank 0 alone writes the reports, so it alone looks at the
    # path, and the others must not wait for it at the first collective until their timeout.
    port = _free_port()
    ranks = [
        suite_process.start(
            ["--backends", "gloo", "--quick", "--json", str(tmp_path / "missing" / "r.json")],
            dict(_suite_env(), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path,
        )  # fmt: skip
        for rank in (0, 1)
    ]
    try:
        outputs = [rank.communicate(timeout=120) for rank in ranks]
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
    assert [rank.returncode for rank in ranks] == [2, 2], outputs
    assert "the folder" in outputs[0][1] and "hint:" in outputs[0][1]
    assert not (tmp_path / "missing").exists()


def test_a_report_that_cannot_be_written_at_the_end_leaves_the_verdict_as_it_was(tmp_path):
    """The folders of both reports are removed while the sweep runs (checked before the run, gone at its
    end): the run still passes with exit 0, and says which report it could not write."""
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (--plot draws nothing without it)")
    (tmp_path / "plots").mkdir()
    (tmp_path / "reports").mkdir()
    report = tmp_path / "reports" / "r.json"
    proc = suite_process.start(
        ["--nproc", "2", "--backends", "gloo", "--checks", "env,bandwidth", "--max-bytes", "4M", "--json", str(report),
         "--plot", str(tmp_path / "plots" / "p.png")],
        _suite_env(), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        stage = None
        while stage != "bandwidth/gloo/cpu":
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
            if report.exists():
                stage = json.loads(report.read_text())["incomplete_stage"]
        shutil.rmtree(tmp_path / "plots")
        shutil.rmtree(tmp_path / "reports")
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out + err
    assert "bandwidth/gloo/cpu  PASS" in out and "harness/ranks" not in out and "checks: 2 pass, 0 fail" in out
    assert f"plot not written: cannot write {tmp_path}/plots/p.png" in out
    assert f"report not written to {report}" in err
