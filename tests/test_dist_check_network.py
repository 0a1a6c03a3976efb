"""env/nccl-network: the network NCCL used, from its own INFO log, never a silent fallback as success.

The logs are NCCL's own lines, recorded on the lent GPU machine (one H100, stock NCCL 2.28.9 and the
channel's 2.29.7, aws-ofi-nccl 1.6.0 and 1.19.2 over Debian's libfabric 1.17 with FI_PROVIDER=tcp)
by recipes/nccl-ofi-plugin/tests/nccl-loads-plugin.sh; docs/reference/nccl.md gives the commands.
"""

from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path

import pytest

from torch_dist_check.checks.envinfo import (NCCL_LOG_ENV, drop_nccl_logs, enable_nccl_log_capture, nccl_network_check, network_verdict,
                                             parse_nccl_log)
from torch_dist_check.report.results import FAIL, PASS, SKIPPED

# Plugin 1.19.2, NCCL_NET=Libfabric NCCL_NET_PLUGIN=ofi: loaded and used.
PLUGIN_1_19 = """\
vm:6638:6638 [0] NCCL INFO NCCL version 2.28.9+cuda13.0
vm:6638:6638 [0] NCCL INFO NET/Plugin: Loaded net plugin Libfabric (v11)
vm:6638:6638 [0] NCCL INFO NET/Plugin: Loaded gin plugin Libfabric (v11)
vm:6638:6638 [0] NCCL INFO Successfully loaded external network plugin /tmp/env-1.19.2/lib/libnccl-net-ofi.so
vm:6638:6638 [0] NCCL INFO NET/OFI Initializing aws-ofi-nccl 1.19.2
[2026-11-24 12:22:55] vm:6638:6638 [0] int nccl_net_ofi_rdma_init(const char*, nccl_net_ofi_plugin_t**, bool*, nccl_ofi_topo_t*):7116 NCCL WARN NET/OFI OFI fi_getinfo() call failed: Function not implemented
vm:6638:6638 [0] NCCL INFO NET/OFI Selected provider is tcp;ofi_rxm, fabric is 192.0.2.0/24 (found 4 nics)
vm:6638:6638 [0] NCCL INFO Initialized NET plugin Libfabric
vm:6638:6638 [0] NCCL INFO Using network Libfabric
"""
# Plugin 1.6.0 with the channel's NCCL 2.29.7, NCCL_NET="AWS Libfabric".
PLUGIN_1_6 = """\
vm:19310:19310 [0] NCCL INFO NCCL version 2.29.7+cuda13.0
vm:19310:19310 [0] NCCL INFO NET/Plugin: Loaded net plugin AWS Libfabric (v6)
vm:19310:19310 [0] NCCL INFO Successfully loaded external network plugin /tmp/env-1.6.0/lib/libnccl-net.so
vm:19310:19310 [0] NCCL INFO NET/OFI Using aws-ofi-nccl 1.6.0
vm:19310:19310 [0] NCCL INFO NET/OFI Selected Provider is tcp;ofi_rxm (found 3 nics)
vm:19310:19310 [0] NCCL INFO Initialized NET plugin AWS Libfabric
vm:19310:19310 [0] NCCL INFO Failed to initialize any GIN plugin
vm:19310:19310 [0] NCCL INFO Using network AWS Libfabric
"""
# NCCL_NET_PLUGIN=0fi (misspelled) and NCCL_NET unset: NCCL falls back to its Socket network.
FALLBACK = """\
vm:6672:6672 [0] NCCL INFO NCCL version 2.28.9+cuda13.0
vm:6672:6672 [0] NCCL INFO ENV/Plugin: Could not find: libnccl-env.so
vm:6672:6672 [0] NCCL INFO NET/Plugin: Could not find: 0fi libnccl-net-0fi.so
vm:6672:6672 [0] NCCL INFO Failed to initialize NET plugin IB
vm:6672:6672 [0] NCCL INFO Initialized NET plugin Socket
vm:6672:6672 [0] NCCL INFO Using network Socket
"""
# libfabric.so.1 missing, NCCL_NET=Libfabric: NCCL cannot open the plugin and creates no communicator.
NO_LIBFABRIC = """\
vm:11019:11019 [0] NCCL INFO NCCL version 2.28.9+cuda13.0
vm:11019:11019 [0] NCCL INFO NET/Plugin: libnccl-net-ofi.so: libfabric.so.1: cannot open shared object file: No such file or directory
vm:11019:11019 [0] NCCL INFO NET/Plugin: Could not find: ofi
[2026-11-24 12:27:01] vm:11019:11019 [0] plugin/net.cc:379 NCCL WARN Failed to initialize any NET plugin
"""
# FI_PROVIDER=no-such-provider with plugin 1.6.0: the plugin finds no provider, NCCL refuses.
NO_PROVIDER = """\
vm:10525:10525 [0] NCCL INFO NCCL version 2.28.9+cuda13.0
vm:10525:10525 [0] NCCL INFO NET/Plugin: Loaded net plugin AWS Libfabric (v6)
vm:10525:10525 [0] NCCL INFO Successfully loaded external network plugin /tmp/env-1.6.0/lib/libnccl-net.so
vm:10525:10525 [0] NCCL INFO NET/OFI Using aws-ofi-nccl 1.6.0
[2026-11-24 12:26:16] vm:10525:10525 [0] find_ofi_provider:753 NCCL WARN NET/OFI Couldn't find any optimal provider
[2026-11-24 12:26:16] vm:10525:10525 [0] nccl_net_ofi_init:1472 NCCL WARN NET/OFI aws-ofi-nccl initialization failed
vm:10525:10525 [0] NCCL INFO Failed to initialize NET plugin AWS Libfabric
[2026-11-24 12:26:16] vm:10525:10525 [0] plugin/net.cc:379 NCCL WARN Failed to initialize any NET plugin
"""


def test_log_names_the_plugin_file_nccl_loaded_and_its_network() -> None:
    facts = parse_nccl_log(PLUGIN_1_19)
    assert facts.networks == ("Libfabric",)
    assert "/tmp/env-1.19.2/lib/libnccl-net-ofi.so" in facts.plugin_loaded
    assert facts.plugin_failures == ()


def test_log_of_a_fallback_keeps_why_the_plugin_was_not_used_but_not_the_missing_ib() -> None:
    facts = parse_nccl_log(FALLBACK)
    assert facts.networks == ("Socket",)
    assert facts.plugin_loaded == ()
    assert facts.plugin_failures == ("NET/Plugin: Could not find: 0fi libnccl-net-0fi.so",)


@pytest.mark.parametrize(("log", "expect", "env"), [
    (PLUGIN_1_19, "Libfabric", {}),
    (PLUGIN_1_19, "libfabric", {}),  # NCCL compares network names case-insensitively
    (PLUGIN_1_6, "AWS Libfabric", {}),
    (PLUGIN_1_19, None, {"NCCL_NET": "Libfabric", "NCCL_NET_PLUGIN": "ofi"}),
    (PLUGIN_1_6, None, {"NCCL_NET": "AWS Libfabric"}),
    (FALLBACK, None, {}),  # nothing asked for: Socket is what NCCL chose, reported as such
    (FALLBACK, None, {"NCCL_NET_PLUGIN": "none"}),
], ids=["expected", "case", "1.6.0", "NCCL_NET", "NCCL_NET-1.6.0", "no-expectation", "plugins-off"])
def test_the_expected_network_passes(log: str, expect: str | None, env: dict[str, str]) -> None:
    ok, reason = network_verdict(parse_nccl_log(log), expect, env)
    assert ok, reason


def test_a_fallback_to_socket_fails_the_expectation_with_nccls_reason() -> None:
    ok, reason = network_verdict(parse_nccl_log(FALLBACK), "Libfabric", {})
    assert not ok
    assert reason == (
        "NCCL used network Socket, expected Libfabric (--expect-nccl-net): "
        "NET/Plugin: Could not find: 0fi libnccl-net-0fi.so"
    )


def test_a_requested_plugin_that_did_not_load_fails_without_any_expectation() -> None:
    ok, reason = network_verdict(parse_nccl_log(FALLBACK), None, {"NCCL_NET_PLUGIN": "0fi"})
    assert not ok
    assert reason.startswith("NCCL_NET_PLUGIN=0fi asks for an external plugin, but NCCL used its built-in network Socket")
    assert "Could not find: 0fi" in reason


def test_a_name_inside_another_is_no_match() -> None:
    # "ib" is a substring of "Libfabric": an expectation of IB must not pass on Libfabric.
    ok, reason = network_verdict(parse_nccl_log(PLUGIN_1_19), "IB", {})
    assert not ok and "expected IB" in reason


def test_every_communicator_must_use_the_expected_network() -> None:
    mixed = PLUGIN_1_19 + "vm:6638:6638 [0] NCCL INFO Using network Socket\n"
    ok, reason = network_verdict(parse_nccl_log(mixed), "Libfabric", {})
    assert not ok and reason.startswith("NCCL used network Libfabric, Socket, expected Libfabric")


@pytest.mark.parametrize(("log", "why"), [
    (NO_LIBFABRIC, "NET/Plugin: libnccl-net-ofi.so: libfabric.so.1: cannot open shared object file"),
    (NO_PROVIDER, "Failed to initialize NET plugin AWS Libfabric"),
], ids=["libfabric-missing", "provider-missing"])
def test_nccl_refusing_every_network_fails_with_its_own_words(log: str, why: str) -> None:
    ok, reason = network_verdict(parse_nccl_log(log), None, {"NCCL_NET": "Libfabric"})
    assert not ok
    assert reason.startswith("NCCL's log names no network ('Using network ...' missing): ")
    assert why in reason and "Failed to initialize any NET plugin" in reason


def _rank_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    """Put ``text`` where this process's NCCL log would be, as enable_nccl_log_capture arranges."""
    pattern = str(tmp_path / "nccl.%h.%p.log")
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    monkeypatch.setenv("NCCL_DEBUG_FILE", pattern)
    monkeypatch.setenv(NCCL_LOG_ENV, pattern)
    path = pattern.replace("%h", socket.gethostname()).replace("%p", str(os.getpid()))
    Path(path).write_text(text)


def test_check_reads_this_ranks_log_and_fails_the_planted_fallback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NCCL_NET", raising=False)
    monkeypatch.setenv("NCCL_NET_PLUGIN", "0fi")
    _rank_log(tmp_path, monkeypatch, FALLBACK)
    result = nccl_network_check(nccl_ran=True, expect_net=None)
    assert result.status == FAIL
    assert result.details["networks"] == ["Socket"]
    assert result.details["plugin_failures"] == ["NET/Plugin: Could not find: 0fi libnccl-net-0fi.so"]


def test_check_passes_the_plugin_and_records_its_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NCCL_NET", "Libfabric")
    monkeypatch.setenv("NCCL_NET_PLUGIN", "ofi")
    _rank_log(tmp_path, monkeypatch, PLUGIN_1_19)
    result = nccl_network_check(nccl_ran=True, expect_net="Libfabric")
    assert result.status == PASS, result.reason
    assert "/tmp/env-1.19.2/lib/libnccl-net-ofi.so" in result.details["plugin_loaded"]


def test_check_is_skipped_when_nccl_did_not_run() -> None:
    assert nccl_network_check(nccl_ran=False, expect_net="Libfabric").status == SKIPPED


def test_the_log_folder_goes_after_a_pass_and_stays_named_after_a_failure_if_nccl_wrote_in_it(tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # TMPDIR, as tempfile read it
    folders = []
    for keep, wrote in ((False, True), (True, False), (True, True)):
        env: dict[str, str] = {}
        folder = os.path.dirname(enable_nccl_log_capture(env) or "")
        assert Path(folder).parent == tmp_path and env["NCCL_DEBUG_FILE"].startswith(folder + "/")
        if wrote:
            (Path(folder) / "nccl.host.1.log").write_text("NCCL INFO NET/Socket\n")
        drop_nccl_logs(folder, keep=keep)
        folders.append(folder)
    passed, failed_empty, failed = folders
    assert not os.path.exists(passed) and not os.path.exists(failed_empty) and os.path.isdir(failed)
    assert capsys.readouterr().err == f"torch_dist_check: NCCL's logs of this run are kept in {failed}\n"
    # The user's own NCCL_DEBUG_FILE: no folder is made, so none is dropped.
    assert enable_nccl_log_capture({"NCCL_DEBUG_FILE": "/x/nccl.log"}) is None
