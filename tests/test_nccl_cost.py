"""benchmarks/nccl_cost.py without a GPU: its arithmetic (nccl-tests' busbw), the alternation of the
variants, the ratio report, and its errors on bad input. The timings themselves need GPUs (docs/records/2026-11-25-abort-wakeup-one-h100-and-two-h200.md)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

import nccl_cost  # noqa: E402


def test_bus_bandwidth_is_nccl_tests_formula() -> None:
    # 1 GiB in 10 ms: algbw 107.37 GB/s; all_reduce x 2(n-1)/n, the others x (n-1)/n.
    algbw = (1 << 30) / 0.01 / 1e9
    assert nccl_cost.bus_bandwidth("all_reduce", 1 << 30, 0.01, 2) == pytest.approx(algbw)
    assert nccl_cost.bus_bandwidth("all_reduce", 1 << 30, 0.01, 8) == pytest.approx(algbw * 14 / 8)
    assert nccl_cost.bus_bandwidth("all_gather", 1 << 30, 0.01, 4) == pytest.approx(algbw * 3 / 4)
    assert nccl_cost.bus_bandwidth("reduce_scatter", 1 << 30, 0.01, 2) == pytest.approx(algbw / 2)


def test_sizes_double_and_divide_among_the_ranks() -> None:
    sizes = nccl_cost.sizes_between(1024, 1 << 30, 2)
    assert sizes[0] == 1024 and sizes[-1] == 1 << 30 and len(sizes) == 21
    assert all(b == 2 * a for a, b in zip(sizes, sizes[1:]))
    assert all(s % (4 * 3) == 0 for s in nccl_cost.sizes_between(1 << 20, 1 << 24, 3))
    assert nccl_cost.parse_size("64M") == 64 << 20 and nccl_cost.parse_size("1GiB") == 1 << 30


def test_rounds_alternate_the_order_of_the_variants() -> None:
    assert nccl_cost.round_orders(["stock", "patched"], 3) == [["stock", "patched"], ["patched", "stock"], ["stock", "patched"]]


def test_summary_takes_the_median_over_rounds_and_the_report_ends_with_the_ratios() -> None:
    mib = 1 << 20
    samples = {
        "stock": {c: {4096: [10e-6, 11e-6, 12e-6], mib: [20e-6, 21e-6, 40e-6]} for c in nccl_cost.COLLECTIVES},
        "patched": {c: {4096: [11e-6, 11e-6, 30e-6], mib: [21e-6, 20e-6, 22e-6]} for c in nccl_cost.COLLECTIVES},
    }
    rows = nccl_cost.summarize(samples, "stock", 2)
    row = next(r for r in rows if r["variant"] == "patched" and r["bytes"] == 4096 and r["collective"] == "all_reduce")
    assert row["median_us"] == pytest.approx(11.0) and row["ratio"] == pytest.approx(1.0) and row["delta_us"] == pytest.approx(0.0)
    big = next(r for r in rows if r["variant"] == "patched" and r["bytes"] == mib and r["collective"] == "all_gather")
    assert big["ratio"] == pytest.approx(21 / 21) and big["busbw_gbps"] == pytest.approx(mib / 21e-6 / 1e9 / 2, rel=1e-3)
    table = nccl_cost.ratio_table(rows, "stock").splitlines()
    assert table[0].startswith("patched / stock")
    assert table[-2].startswith("4K") and "(+0.00 us)" in table[-2]
    assert table[-1].startswith("1M") and "us" not in table[-1]


def test_bad_input_exits_2_and_names_what_to_change(tmp_path: Path) -> None:
    lib = tmp_path / "libnccl.so.2"
    lib.write_bytes(b"")
    cases = [
        (["--variant", f"a={tmp_path}/missing.so"], "does not exist"),
        (["--variant", f"a={lib}"], "at least two --variant"),
        (["--variant", f"a={lib}", "--variant", f"a={lib}"], "labels must differ"),
        (["--variant", f"a={lib}", "--variant", f"b={lib}:NOEQUALS"], "is not KEY=VALUE"),
        (["--variant", f"a={lib}", "--variant", f"b={lib}", "--min-bytes", "2G"], "larger than"),
        (["--variant", f"a={lib}", "--variant", f"b={lib}", "--json", str(tmp_path / "no" / "r.json")], "does not exist"),
    ]
    for argv, words in cases:
        done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "nccl_cost.py"), *argv], capture_output=True, text=True)
        assert done.returncode == 2, argv
        assert words in done.stderr and done.stdout == ""
