"""`channelsmith verify`: the acceptance suite run with a prefix's own Python, for real.

Prefixes here are virtual environments made by `python -m venv`: one with no torch (must be refused
with a hint) and one that sees this interpreter's torch (the suite runs two gloo ranks in it). CI
installs torch (2.15.0, scripts/install-test-deps.sh); without it the runs are skipped. The tests themselves may run
inside a venv, whose packages `--system-site-packages` would not show (it shows the base
interpreter's): the stand-in prefix adds this interpreter's own site directories instead.
"""

from __future__ import annotations

import json
import site
import subprocess
import sys
from pathlib import Path

import pytest

from channelsmith.batch import time_limit_seconds
from channelsmith.cli import main
from channelsmith.cli._output import Output
from channelsmith.cli.verify import present
from channelsmith.errors import VerifyError
from channelsmith.verify import VerifyOptions, report_of, suite_command, verify_prefix
from conftest import REPO_ROOT


def make_prefix(path: Path, with_torch: bool) -> Path:
    """A venv as a stand-in prefix; with_torch makes it see this interpreter's site-packages."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    if with_torch:
        # addsitedir (not a bare path) so the .pth files there (editable installs) are read too.
        lines = [f"import site; site.addsitedir({d!r})" for d in site.getsitepackages()]
        (next(path.glob("lib/python*/site-packages")) / "tests-parent-site.pth").write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def torch_prefix(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("torch", reason="torch is not installed (bash scripts/install-test-deps.sh installs it)")
    prefix = make_prefix(tmp_path_factory.mktemp("verify") / "env", with_torch=True)
    activate_d = prefix / "etc" / "conda" / "activate.d"
    activate_d.mkdir(parents=True)
    # A site setting, as site-env installs one: the suite must run with it in force.
    (activate_d / "site-env.sh").write_text("export GLOO_SOCKET_IFNAME=lo\nexport NCCL_SOCKET_IFNAME=^docker\n")
    return prefix


def test_a_directory_without_python_is_refused_with_a_hint(tmp_path):
    with pytest.raises(VerifyError, match="has no bin/python") as info:
        verify_prefix(VerifyOptions(prefix=tmp_path))
    assert "deploy" in (info.value.hint or "")


def test_a_prefix_without_torch_is_refused_with_a_hint(tmp_path):
    prefix = make_prefix(tmp_path / "env", with_torch=False)
    with pytest.raises(VerifyError, match="cannot import torch") as info:
        verify_prefix(VerifyOptions(prefix=prefix))
    assert "pytorch" in (info.value.hint or "")


def test_a_torch_that_is_there_but_fails_to_import_is_named_after_the_suite_finds_it(tmp_path):
    # The probe before the suite only looks torch up (no second import of it); a torch whose import
    # breaks (a shared library gone) is then found by the suite, and said as such, not as a missing report.
    prefix = make_prefix(tmp_path / "env", with_torch=False)
    site_dir = next(prefix.glob("lib/python*/site-packages"))
    (site_dir / "torch").mkdir()
    (site_dir / "torch" / "__init__.py").write_text(
        "raise ImportError('libtorch_cpu.so: cannot open shared object file: No such file or directory')\n"
    )
    (site_dir / "torch-2.13.0.dist-info").mkdir()
    (site_dir / "torch-2.13.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.13.0\n")
    with pytest.raises(VerifyError, match="cannot import torch: ImportError: libtorch_cpu.so: cannot open") as info:
        verify_prefix(VerifyOptions(prefix=prefix, suite_args=("--quick",), timeout_s=120))
    assert "pytorch" in (info.value.hint or "")


def test_cli_exits_2_for_a_prefix_that_is_not_a_directory(tmp_path, capsys):
    assert main(["verify", "--prefix", str(tmp_path / "missing")]) == 2
    assert "is not a directory" in capsys.readouterr().err


def test_suite_command_uses_the_launcher_instead_of_nproc(tmp_path):
    options = VerifyOptions(prefix=tmp_path, nproc=2, launcher=("srun", "-n", "8"), backends=("nccl",), suite_args=("--quick",))
    command = suite_command(Path("/p/bin/python"), options, Path("/t/r.json"))
    assert command[:3] == ["srun", "-n", "8"] and "--nproc" not in command
    assert command[3:] == ["/p/bin/python", "-m", "torch_dist_check", "--json", "/t/r.json", "--backends", "nccl", "--quick"]


# The runs of the suite below are the prefix's own Python, started by verify after the prefix's activation
# scripts, each with the fork server of its own --nproc launcher (a torch import per run): that the suite runs
# so is what they prove, and no fork of this test process's interpreter is that Python.
def test_verify_runs_the_suite_in_the_prefix_and_reads_its_verdict(torch_prefix):
    report = verify_prefix(
        VerifyOptions(prefix=torch_prefix, nproc=2, backends=("gloo",), suite_args=("--quick", "--checks", "env,correctness,bandwidth"))
    )
    assert report.ok and report.exit_code == 0
    assert report.python == torch_prefix.resolve() / "bin" / "python"
    # The venv sees this interpreter's packages, so torch_dist_check comes from there or from channelsmith.
    assert report.suite_source == "prefix" or report.suite_source.startswith("channelsmith")
    by_name = {c.name: c for c in report.checks}
    assert by_name["correctness/gloo/cpu"].status == "pass"
    assert by_name["bandwidth/gloo/cpu"].details["rows"]
    # The prefix's activate.d script was sourced before the suite ran.
    assert report.document["job"]["network_env"]["GLOO_SOCKET_IFNAME"] == "lo"
    assert report.document["job"]["world_size"] == 2


def test_cli_json_carries_the_suite_report_and_a_failing_check_exits_1(torch_prefix, capsys):
    # --expect-busbw 1e6 GB/s cannot be met: the bandwidth check must fail and verify must say so.
    code = main(
        ["verify", "--prefix", str(torch_prefix), "--backends", "gloo", "--json", "--",
         "--quick", "--checks", "bandwidth", "--collectives", "all_reduce", "--expect-busbw", "1000000"]
    )  # fmt: skip
    document = json.loads(capsys.readouterr().out)
    assert code == 1 and document["ok"] is False
    check = {c["name"]: c for c in document["report"]["checks"]}["bandwidth/gloo/cpu"]
    assert check["status"] == "fail" and "expected 1000000" in check["reason"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--nodes", "2"], "options for a scheduler given without --scheduler: --nodes"),
        (["--time", "00:10:00", "--no-wait"], "given without --scheduler: --time, --no-wait"),
        (["--cancel-on-interrupt"], "given without --scheduler: --cancel-on-interrupt"),
        (["--scheduler", "slurm", "--launcher", "srun -n 2"], "--launcher given with --scheduler"),
        (["--scheduler", "pbs", "--nproc", "4"], "--nproc given with --scheduler"),
        (["--scheduler", "slurm", "--queue", "main"], "options for pbs given with --scheduler slurm: --queue"),
        (["--scheduler", "pbs", "--partition", "gpu"], "options for slurm given with --scheduler pbs: --partition"),
        (["--scheduler", "slurm", "--nodes", "0"], "--nodes 0 is not a valid count"),
        (["--scheduler", "slurm", "--ntasks-per-node", "0"], "--ntasks-per-node 0 is not a valid count"),
        (["--scheduler", "pbs", "--time", "ten minutes"], "--time 'ten minutes' is not HH:MM:SS"),
        # Slurm would take 99:99 as 100 minutes 39 seconds, and 02:00 as two minutes (MM:SS): neither is HH:MM:SS.
        (["--scheduler", "slurm", "--time", "99:99"], "--time '99:99' is not HH:MM:SS"),
        (["--scheduler", "slurm", "--time", "02:00"], "--time '02:00' is not HH:MM:SS"),
        (["--scheduler", "pbs", "--time", "01:60:00"], "--time '01:60:00' is not HH:MM:SS"),
        (["--collect", "run"], "--collect takes no --prefix"),
        (["--collect", "run", "--nodes", "2"], "--collect takes no --prefix, --nodes"),
    ],
)
def test_verify_job_options_that_mean_nothing_are_refused_before_anything_is_submitted(tmp_path, capsys, args, message):
    code = main(["verify", "--prefix", str(tmp_path / "env"), *args])
    assert code == 2
    assert message in " ".join(capsys.readouterr().err.split())
    assert not (tmp_path / "channelsmith-verify").exists()


def test_a_time_limit_is_read_as_hours_minutes_seconds_as_the_help_shows_it(capsys):
    assert time_limit_seconds("02:00:00") == 7200 and time_limit_seconds("100:00:30") == 360030
    with pytest.raises(SystemExit):
        main(["verify", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert "--time HH:MM:SS the job's time limit, as hours:minutes:seconds (00:30:00: 30 minutes)" in shown
    # The help names where the scheduler section lives.
    assert "(docs/howto/verify.md, 'Acceptance through the scheduler')" in shown
    assert "Acceptance through the scheduler: `channelsmith verify --scheduler`" in (REPO_ROOT / "docs" / "howto" / "verify.md").read_text()


def test_a_report_the_suite_wrote_as_a_stage_began_is_no_verdict_and_has_no_exit_code(tmp_path):
    """A suite stopped from outside (a batch system's kill) leaves the copy it wrote as its stage began; its
    launcher may still return 0 (srun did, for a node set down under it): that is no exit code of the suite's."""
    from torch_dist_check.report.results import FAIL, CheckResult, build_document

    passed = [CheckResult("correctness/gloo/cpu", "pass", "91 cases correct")]
    in_progress = json.loads(json.dumps(build_document(passed, {}, "bandwidth/gloo/cpu", {}, in_progress=True)))
    stopped = report_of(tmp_path, tmp_path / "bin" / "python", "2.13.0", "prefix", ("srun",), 0, in_progress)
    assert (stopped.exit_code, stopped.finished, stopped.ok) == (None, False, False)
    assert stopped.incomplete_stage == "bandwidth/gloo/cpu" and [c.name for c in stopped.checks] == ["correctness/gloo/cpu"]
    # The suite's own verdict on a stage that ran out of its time keeps its exit code (3).
    timed_out = build_document([*passed, CheckResult("bandwidth/gloo/cpu", FAIL, "did not complete")], {},
                               "bandwidth/gloo/cpu", {})  # fmt: skip
    verdict = report_of(tmp_path, tmp_path / "bin" / "python", "2.13.0", "prefix", ("srun",), 3, timed_out)
    assert (verdict.exit_code, verdict.finished, verdict.ok) == (3, True, False)
    # A suite older than the in_progress field: a stage named with exit status 0 cannot be a verdict.
    older = {k: v for k, v in in_progress.items() if k != "in_progress"}
    assert report_of(tmp_path, tmp_path, "2.13.0", "prefix", ("srun",), 0, older).exit_code is None
    assert report_of(tmp_path, tmp_path, "2.13.0", "prefix", ("srun",), 3, older).exit_code == 3


def test_a_suite_stopped_mid_run_is_shown_with_its_stage_and_without_an_exit_code(tmp_path, capsys):
    from torch_dist_check.report.results import build_document

    document = json.loads(json.dumps(build_document([], {}, "bandwidth/gloo/cpu", {}, in_progress=True)))
    report = report_of(tmp_path, tmp_path / "bin" / "python", "2.13.0", "prefix", ("srun",), 0, document)
    present(report, Output())
    out = capsys.readouterr().out
    # No empty table whose title wraps: one line says no check completed.
    assert f"acceptance suite in {tmp_path} (torch 2.13.0): no check completed\n" in out
    assert ("NOT verified: 0 pass, 0 fail, 0 skipped; the suite did not finish: it was stopped in stage "
            "'bandwidth/gloo/cpu' (suite from prefix)") in " ".join(out.split())  # fmt: skip
    assert "exit code" not in out and "┏" not in out


def test_verify_job_for_a_prefix_without_python_is_refused_before_anything_is_submitted(tmp_path, capsys):
    """No batch system is asked: the prefix is judged first (here, with no Slurm running at all)."""
    (tmp_path / "env").mkdir()
    code = main(["verify", "--scheduler", "slurm", "--prefix", str(tmp_path / "env"), "--run-dir", str(tmp_path / "run")])
    assert code == 2
    assert f"{tmp_path / 'env'} has no bin/python" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_verify_without_a_prefix_uses_the_active_environment_or_says_what_to_pass(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("CONDA_PREFIX", raising=False)
    assert main(["verify", "--scheduler", "slurm"]) == 2
    assert "no --prefix given and no environment is active" in " ".join(capsys.readouterr().err.split())
    monkeypatch.setenv("CONDA_PREFIX", str(tmp_path / "active"))
    assert main(["verify"]) == 2
    assert f"{tmp_path / 'active'} is not a directory" in capsys.readouterr().err


def test_collecting_a_folder_without_a_verify_job_is_refused(tmp_path, capsys):
    assert main(["verify", "--collect", str(tmp_path)]) == 2
    assert "holds no verify job" in capsys.readouterr().err
