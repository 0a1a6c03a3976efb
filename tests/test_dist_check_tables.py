"""torch_dist_check.tables: the GPU runs' tables (MPI against host staging and NCCL; NCCL's networks
against Socket) from the suite's JSON documents, as the suite writes them (report.build_document).

Pure parsing and arithmetic, so no GPU: the documents are built with the suite's own result and row types.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
sys.path.insert(0, str(SCRIPTS))

from torch_dist_check.report import tables  # noqa: E402
from torch_dist_check.checks.bandwidth import SweepRow, bus_factor  # noqa: E402
from torch_dist_check.report.results import FAIL, PASS, CheckResult, build_document  # noqa: E402

MiB = 1 << 20


def _rows(collective: str, busbw: dict[int, float], world: int = 2) -> list[dict]:
    rows = []
    for size, bus in busbw.items():
        algbw = bus / bus_factor(collective, world)
        rows.append(asdict(SweepRow(collective, size, size // 4, "float32", 10, size / algbw / 1e3, algbw, bus)))
    return rows


def _sweep(name: str, per_collective: dict[str, dict[int, float]], world: int = 2) -> CheckResult:
    rows = [row for collective, figures in per_collective.items() for row in _rows(collective, figures, world)]
    return CheckResult(name, PASS, "", {"rows": rows}, ranks=list(range(world)))


def _correct(name: str, failures: list | None = None, world: int = 2) -> CheckResult:
    status = FAIL if failures else PASS
    return CheckResult(name, status, "1 case wrong" if failures else "", {"cases": 73, "failures": failures or []}, ranks=list(range(world)))


def _write(path: Path, results: list[CheckResult], world: int = 2) -> str:
    path.write_text(json.dumps(build_document(results, {"launcher": "mpi", "world_size": world}, None, {}), default=str))
    return str(path)


SIZES = [1 * MiB, 64 * MiB, 1024 * MiB]


@pytest.fixture
def mpi_docs(tmp_path: Path) -> tuple[str, str]:
    every = {c: dict.fromkeys(SIZES, 10.0) for c in ("all_gather", "reduce_scatter", "broadcast")}
    cuda = _write(tmp_path / "cuda.json", [
        _correct("correctness/cudampi/cuda"), _correct("correctness/nccl/cuda"),
        _sweep("bandwidth/cudampi/cuda", {"all_reduce": {1 * MiB: 0.8, 64 * MiB: 150.0, 1024 * MiB: 200.0}, **every}),
        _sweep("bandwidth/nccl/cuda", {"all_reduce": {1 * MiB: 20.0, 64 * MiB: 280.0, 1024 * MiB: 360.0}}),
    ])  # fmt: skip
    cpu = _write(tmp_path / "cpu.json", [
        _correct("correctness/cudampi/cpu"),
        _sweep("bandwidth/cudampi/cpu", {c: dict.fromkeys(SIZES, 1.0) for c in ("all_reduce", "all_gather", "reduce_scatter", "broadcast")}),
    ])  # fmt: skip
    return cuda, cpu


def test_mpi_table_pairs_cuda_host_and_nccl_rows_and_reads_the_goals(mpi_docs):
    cuda, cpu = mpi_docs
    result = tables.mpi_table((cuda, tables.load(cuda)), (cpu, tables.load(cpu)), "cudampi", MiB, 64 * MiB, 0.5)
    rows = {(r["collective"], r["bytes"]): r for r in result["rows"]}
    assert len(rows) == 12 and result["world_size"] == 2
    assert rows[("all_reduce", MiB)]["cuda_over_host"] == pytest.approx(0.8)
    assert rows[("all_reduce", 64 * MiB)]["cuda_over_nccl"] == pytest.approx(150 / 280)
    assert rows[("broadcast", 64 * MiB)]["nccl"] is None
    goals = {g["goal"]: g for g in result["goals"]}
    host = goals["CUDA >= host staging at every size from 1 MiB"]
    assert not host["met"] and host["misses"] == ["all_reduce 1 MiB: 0.80x"]
    share = goals["all_reduce >= 50% of NCCL's busbw from 64 MiB"]
    assert share["met"] and share["misses"] == []
    (exact,) = [g for g in result["goals"] if g["goal"].startswith("every case exact")]
    assert exact["met"] and "correctness/nccl/cuda 73 cases" in exact["goal"]


def test_mpi_table_renders_markdown_with_times_and_verdicts(mpi_docs):
    cuda, cpu = mpi_docs
    text = tables.render_mpi(tables.mpi_table((cuda, tables.load(cuda)), (cpu, tables.load(cpu)), "cudampi", MiB, 64 * MiB, 0.5))
    assert "| collective | size | cudampi, CUDA tensors | host staging (CPU tensors) | NCCL | CUDA / host | CUDA / NCCL |" in text
    # 64 MiB all_reduce at 150 GB/s busbw on 2 ranks: algbw 150, 0.447 ms a call.
    assert "| all_reduce | 64 MiB | 150.00 (0.447 ms) | 1.00 (67.1 ms) | 280.00 (0.24 ms) | 150.00x | 0.54x |" in text
    assert "- CUDA >= host staging at every size from 1 MiB: MISSED: all_reduce 1 MiB: 0.80x" in text
    assert "- all_reduce >= 50% of NCCL's busbw from 64 MiB: met" in text


def test_a_share_below_the_goal_is_missed_and_the_floor_moves_the_host_goal(mpi_docs):
    cuda, cpu = mpi_docs
    result = tables.mpi_table((cuda, tables.load(cuda)), (cpu, tables.load(cpu)), "cudampi", 2 * MiB, 64 * MiB, 0.6)
    goals = {g["goal"]: g for g in result["goals"]}
    assert goals["CUDA >= host staging at every size from 2 MiB"]["met"]
    assert goals["all_reduce >= 60% of NCCL's busbw from 64 MiB"]["misses"] == ["all_reduce 64 MiB: 0.54x", "all_reduce 1 GiB: 0.56x"]


def test_four_ranks_without_a_cpu_run_give_cuda_against_nccl_only(tmp_path):
    cuda = _write(tmp_path / "four.json", [
        _correct("correctness/cudampi/cuda", world=4), _correct("correctness/nccl/cuda", world=4),
        _sweep("bandwidth/cudampi/cuda", {"all_reduce": {64 * MiB: 100.0}}, world=4),
        _sweep("bandwidth/nccl/cuda", {"all_reduce": {64 * MiB: 300.0}}, world=4),
    ], world=4)  # fmt: skip
    result = tables.mpi_table((cuda, tables.load(cuda)), None, "cudampi", MiB, 64 * MiB, 0.5)
    assert result["world_size"] == 4 and [r["host"] for r in result["rows"]] == [None]
    goals = [g["goal"] for g in result["goals"]]
    assert not any("host staging" in g for g in goals)
    assert "4 ranks" in tables.render_mpi(result)


def test_a_wrong_case_misses_the_exactness_goal(tmp_path):
    cuda = _write(tmp_path / "c.json", [
        _correct("correctness/cudampi/cuda", failures=[{"case": "all_reduce int32 1023"}]),
        _sweep("bandwidth/cudampi/cuda", {"all_reduce": {MiB: 1.0}}),
    ])  # fmt: skip
    result = tables.mpi_table((cuda, tables.load(cuda)), None, "cudampi", MiB, 64 * MiB, 0.5)
    (exact,) = result["goals"]
    assert not exact["met"] and exact["misses"] == ["correctness/cudampi/cuda: fail: 1 case wrong"]


def _net_doc(tmp_path: Path, name: str, figures: dict[int, float], network: str = PASS, failures: list | None = None) -> str:
    return _write(tmp_path / f"{name}.json", [
        CheckResult("env/nccl-network", network, f"NCCL used network {name}", {}),
        _correct("correctness/nccl/cuda", failures),
        _sweep("bandwidth/nccl/cuda", {"all_reduce": figures}),
    ])  # fmt: skip


def test_net_table_ratios_to_the_baseline_from_the_start_size(tmp_path):
    socket = _net_doc(tmp_path, "socket", {MiB: 0.5, 64 * MiB: 4.0, 1024 * MiB: 4.0})
    good = _net_doc(tmp_path, "good", {MiB: 0.1, 64 * MiB: 3.9, 1024 * MiB: 4.2})
    slow = _net_doc(tmp_path, "slow", {MiB: 0.5, 64 * MiB: 3.7, 1024 * MiB: 4.0}, network=FAIL)
    runs = [(label, path, tables.load(path)) for label, path in (("socket", socket), ("good", good), ("slow", slow))]
    result = tables.net_table(runs, "socket", 64 * MiB, 0.95)
    rows = {r["label"]: r for r in result["rows"]}
    # 1 MiB is below the start: good's 0.2x there does not count.
    assert rows["good"]["lowest_ratio_from_start"] == pytest.approx(3.9 / 4.0)
    assert rows["slow"]["lowest_ratio_from_start"] == pytest.approx(3.7 / 4.0)
    goals = result["goals"]
    assert goals[0]["misses"] == ["slow: lowest 0.93x"] and not goals[0]["met"]
    assert goals[1]["met"]
    assert goals[2]["misses"] == ["slow: fail: NCCL used network slow"]
    text = tables.render_net(result)
    assert "| run | 1 MiB | 64 MiB | 1 GiB | lowest ratio to socket | correctness |" in text
    assert "| good | 0.10 | 3.90 | 4.20 | 0.97x | pass: 73 cases |" in text


def test_runs_that_share_a_label_make_one_row_of_medians(tmp_path):
    # Issue 40's rounds: Socket before and after each round, each plugin once a round.
    (tmp_path / "r1").mkdir()
    (tmp_path / "r2").mkdir()
    (tmp_path / "r3").mkdir()
    s1 = _net_doc(tmp_path / "r1", "socket", {MiB: 2.0, 64 * MiB: 2.8})
    s2 = _net_doc(tmp_path / "r2", "socket", {MiB: 1.8, 64 * MiB: 2.6})
    s3 = _net_doc(tmp_path / "r3", "socket", {MiB: 1.9, 64 * MiB: 3.0})
    p1 = _net_doc(tmp_path / "r1", "ofi", {MiB: 1.0, 64 * MiB: 2.5})
    p2 = _net_doc(tmp_path / "r2", "ofi", {MiB: 1.4, 64 * MiB: 2.9})
    runs = [(label, path, tables.load(path)) for label, path in
            (("Socket", s1), ("Socket", s2), ("Socket", s3), ("ofi", p1), ("ofi", p2))]  # fmt: skip
    result = tables.net_table(runs, "Socket", 64 * MiB, 0.95)
    rows = {r["label"]: r for r in result["rows"]}
    assert list(rows) == ["Socket", "ofi"] and rows["Socket"]["runs"] == 3 and rows["ofi"]["runs"] == 2
    assert rows["Socket"]["busbw"][64 * MiB] == pytest.approx(2.8)  # the median of three
    assert rows["ofi"]["busbw"][64 * MiB] == pytest.approx(2.7)  # of two: their mean
    assert rows["ofi"]["busbw_range"][64 * MiB] == [2.5, 2.9]
    assert rows["ofi"]["lowest_ratio_from_start"] == pytest.approx(2.7 / 2.8)
    assert result["goals"][0]["met"]
    text = tables.render_net(result)
    assert "median of a label's runs, lowest-highest" in text
    assert "| ofi (2 runs) | 1.20 (1.00-1.40) | 2.70 (2.50-2.90) | 0.96x | pass: 73 cases x 2 runs |" in text


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "torch_dist_check.tables", *args], cwd=SCRIPTS, text=True,
                          capture_output=True, env={"PYTHONPATH": str(SCRIPTS), "PATH": "/usr/bin:/bin"})  # fmt: skip


def test_the_cli_prints_the_table_or_json(mpi_docs):
    cuda, cpu = mpi_docs
    text = _cli("mpi", "--cuda", cuda, "--cpu", cpu)
    assert text.returncode == 0, text.stderr
    assert text.stdout.startswith("Bus bandwidth, GB/s (time a call), 2 ranks:")
    as_json = _cli("mpi", "--cuda", cuda, "--cpu", cpu, "--json")
    assert as_json.returncode == 0 and json.loads(as_json.stdout)["table"] == "mpi"


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["mpi", "--cuda", "/nonexistent/x.json"], "/nonexistent/x.json: no such file"),
        (["net", "--run", "a"], "--run takes LABEL=FILE"),
        (["mpi", "--cuda", "CUDA", "--floor", "lots"], "not a size: 'lots'"),
    ],
)
def test_bad_input_exits_2_with_a_hint_and_prints_nothing_on_stdout(args, words, mpi_docs):
    cuda, _ = mpi_docs
    result = _cli(*[cuda if a == "CUDA" else a for a in args])
    assert result.returncode == 2 and result.stdout == ""
    assert words in result.stderr


def test_documents_that_are_not_the_suites_or_lack_a_check_are_refused(tmp_path, mpi_docs):
    cuda, cpu = mpi_docs
    other = tmp_path / "other.json"
    other.write_text('{"tool": "nccl-tests"}')
    result = _cli("mpi", "--cuda", str(other))
    assert result.returncode == 2 and "not a torch_dist_check document" in result.stderr and "hint:" in result.stderr
    # The CPU document as --cuda: it has no bandwidth/cudampi/cuda.
    missing = _cli("mpi", "--cuda", cpu)
    assert missing.returncode == 2 and "no check bandwidth/cudampi/cuda" in missing.stderr
    twice = _cli("net", "--run", f"a={cuda}", "--run", f"a={cuda}", "--baseline", "a")
    assert twice.returncode == 2 and f"--run a={cuda} given twice" in twice.stderr
    unknown = _cli("net", "--run", f"a={cuda}", "--baseline", "b")
    assert unknown.returncode == 2 and "--baseline b is none of the runs" in unknown.stderr


def test_rows_below_min_bytes_are_left_out(tmp_path):
    cuda = _write(tmp_path / "small.json", [
        _correct("correctness/cudampi/cuda"),
        _sweep("bandwidth/cudampi/cuda", {"all_reduce": {1024: 0.01, MiB: 1.0}}),
    ])  # fmt: skip
    assert [r["bytes"] for r in tables.mpi_table((cuda, tables.load(cuda)), None, "cudampi", MiB, 64 * MiB, 0.5, MiB)["rows"]] == [MiB]
    result = _cli("mpi", "--cuda", cuda)
    assert result.returncode == 0 and "| 1 KiB |" not in result.stdout and "| all_reduce | 1 MiB |" in result.stdout


def _peerloss_doc(path: Path, runs: list[dict]) -> str:
    check = CheckResult("peerloss/nccl/train-hsdp/watcher", PASS, "", {"kind": "train-hsdp", "runs": runs}, ranks=[0])
    return _write(path, [check], world=1)


def test_peerloss_rows_pool_a_labels_runs_with_median_worst_and_the_join_split(tmp_path: Path) -> None:
    split = {"rendezvous": 0.2, "leave_old": 0.5}
    a = _peerloss_doc(tmp_path / "a.json", [{"ok": True, "join_s": 1.0, "first_step_s": 0.2, "join_split": split},
                                            {"ok": False, "join_s": 3.0, "first_step_s": None}])  # fmt: skip
    b = _peerloss_doc(tmp_path / "b.json", [{"ok": True, "join_s": 2.0, "first_step_s": 0.4,
                                             "join_split": {"rendezvous": 0.4, "leave_old": 0.1}}])  # fmt: skip
    result = tables.peerloss_table([("stock", a, tables.load(a)), ("stock", b, tables.load(b))])
    [row] = result["rows"]
    assert (row["runs"], row["passed"]) == (3, 2)
    assert row["join_s"] == {"median": 2.0, "worst": 3.0, "n": 3}
    assert row["first_step_s"] == {"median": 0.3, "worst": 0.4, "n": 2}
    assert row["join_split"] == {"rendezvous": 0.3, "leave_old": 0.3}
    text = tables.render_peerloss(result)
    assert "| stock | 3 | 2 |" in text and "join_s median / worst" in text and "leave_old (median)" in text


def test_peerloss_table_of_a_document_without_peerloss_checks_exits_2_naming_it(tmp_path: Path) -> None:
    other = _write(tmp_path / "other.json", [_correct("correctness/nccl/cuda")])
    proc = subprocess.run([sys.executable, "-m", "torch_dist_check.tables", "peerloss", "--run", f"x={other}"],
                          capture_output=True, text=True, env={"PYTHONPATH": str(SCRIPTS), "PATH": "/usr/bin:/bin"})  # fmt: skip
    assert proc.returncode == 2 and f"{other} has no peerloss check" in proc.stderr and proc.stdout == ""
