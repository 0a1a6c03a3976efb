"""torch_dist_check's figures and parsers: bus-bandwidth factors, sizes, NCCL log, result merging."""

from __future__ import annotations

import io

import pytest

from torch_dist_check.checks.bandwidth import bus_factor, parse_size, sweep_sizes
from torch_dist_check.checks.envinfo import decode_nccl_version, loaded_libraries, nccl_log_path, parse_nccl_log
from torch_dist_check.report.results import FAIL, PASS, SKIPPED, CheckResult, merge_rank_results, render_table, summarize


@pytest.mark.parametrize(
    "collective, n, factor",
    [("all_reduce", 2, 1.0), ("all_reduce", 8, 1.75), ("all_gather", 4, 0.75), ("reduce_scatter", 2, 0.5), ("broadcast", 8, 1.0)],
)
def test_bus_factors_are_those_of_nccl_tests(collective, n, factor):
    assert bus_factor(collective, n) == pytest.approx(factor)


def test_sweep_sizes_double_from_min_to_max_inclusive():
    assert sweep_sizes(8, 64) == [8, 16, 32, 64]
    assert sweep_sizes(8, 1 << 30)[-1] == 1 << 30


@pytest.mark.parametrize("text, value", [("8", 8), ("64K", 65536), ("256M", 256 << 20), ("1G", 1 << 30), ("4MB", 4 << 20)])
def test_sizes_read_like_nccl_tests_options(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("code, version", [(22105, (2, 21, 5)), (22707, (2, 27, 7)), (2708, (2, 7, 8))])
def test_nccl_version_codes_decode_across_the_2_9_format_change(code, version):
    assert decode_nccl_version(code) == version


NCCL_LOG = """\
host:1:1 [0] NCCL INFO cudaDriverVersion 13000
host:1:1 [0] NCCL INFO NCCL version 2.27.7+cuda13.0
host:1:1 [0] NCCL INFO NET/Plugin: Could not find: libnccl-net.so.
host:1:1 [0] NCCL INFO NET/OFI Initializing aws-ofi-nccl 1.6.0
host:1:1 [0] NCCL INFO Using network AWS Libfabric
host:1:1 [0] NCCL WARN NET/OFI Only EFA provider is supported
host:1:1 [0] NCCL INFO Using network AWS Libfabric
"""


def test_nccl_log_names_version_network_plugin_and_warnings():
    facts = parse_nccl_log(NCCL_LOG)
    assert facts.version_line == "2.27.7+cuda13.0"
    assert facts.networks == ("AWS Libfabric",)
    assert any("aws-ofi-nccl 1.6.0" in line for line in facts.plugin_lines)
    assert facts.warnings == ("NET/OFI Only EFA provider is supported",)


def test_nccl_log_path_expands_host_and_pid():
    assert nccl_log_path({"NCCL_DEBUG_FILE": "/tmp/x/nccl.%h.%p.log"}, 42, "nid1") == "/tmp/x/nccl.nid1.42.log"
    assert nccl_log_path({}, 42, "nid1") is None


def test_nccl_log_path_takes_the_host_name_up_to_its_first_dot_as_nccl_does():
    # NCCL expands %h with getHostName(..., '.'): a cluster's fully qualified names lose their domain.
    env = {"NCCL_DEBUG_FILE": "/tmp/x/nccl.%h.%p.%%.%t.log"}
    assert nccl_log_path(env, 7, "nid001.hsn.example.org") == "/tmp/x/nccl.nid001.7.%.%t.log"


def test_loaded_libraries_reads_proc_maps_lines():
    maps = (
        "7f00-7f01 r-xp 00000000 08:01 1 /opt/env/lib/libnccl.so.2.21.5\n"
        "7f01-7f02 r--p 00001000 08:01 1 /opt/env/lib/libnccl.so.2.21.5\n"
        "7f02-7f03 rw-p 00000000 00:00 0 [heap]\n"
        "7f03-7f04 r-xp 00000000 08:01 2 /opt/env/lib/libnccl-net.so\n"
    )
    assert loaded_libraries(r"^libnccl\.so", maps) == ["/opt/env/lib/libnccl.so.2.21.5"]


def test_loaded_libraries_of_this_process_include_libc():
    assert any("libc" in path for path in loaded_libraries(r"^libc[.-]"))


def test_merge_fails_a_check_that_failed_on_any_rank_and_names_the_rank():
    rank0 = [CheckResult("correctness/gloo/cpu", PASS, "91 cases correct", {"cases": 91}), CheckResult("env/mpi", SKIPPED, "no MPI")]
    rank1 = [CheckResult("correctness/gloo/cpu", FAIL, "all_reduce wrong", {"cases": 91}), CheckResult("env/mpi", SKIPPED, "no MPI")]
    merged = merge_rank_results([rank0, rank1])
    assert [(m.name, m.status) for m in merged] == [("correctness/gloo/cpu", FAIL), ("env/mpi", SKIPPED)]
    assert merged[0].reason == "rank 1: all_reduce wrong"
    assert merged[0].ranks == [0, 1]


def test_merge_keeps_details_that_differ_between_ranks():
    rank0 = [CheckResult("env/nccl-network", PASS, "Socket", {"networks": ["Socket"]})]
    rank1 = [CheckResult("env/nccl-network", PASS, "IB", {"networks": ["IB"]})]
    merged = merge_rank_results([rank0, rank1])[0]
    assert merged.details["networks"] == ["Socket"]
    assert merged.details["per_rank"] == {"1": {"networks": ["IB"]}}


def test_checks_run_on_rank_0_only_merge_as_they_are():
    merged = merge_rank_results([[CheckResult("fault/gloo/allreduce", PASS, "ok")], []])
    assert merged[0].status == PASS and merged[0].ranks == [0]


def test_summary_is_ok_only_without_failures_and_skips_do_not_count():
    assert summarize([CheckResult("a", PASS), CheckResult("b", SKIPPED)])["ok"] is True
    assert summarize([CheckResult("a", PASS), CheckResult("b", FAIL)])["ok"] is False


def test_table_has_a_row_per_check_and_a_count_line():
    stream = io.StringIO()
    render_table([CheckResult("env/torch", PASS, "torch 2.13"), CheckResult("env/mpi", SKIPPED, "no MPI")], stream)
    lines = stream.getvalue().splitlines()
    assert lines[1].split()[:2] == ["env/torch", "PASS"]
    assert lines[-1] == "checks: 1 pass, 0 fail, 1 skipped"
