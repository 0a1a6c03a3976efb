"""Run the acceptance suite (torch_dist_check) with a deployed prefix's own Python.

The prefix is activated the way conda would (CONDA_PREFIX, PATH, and every
``etc/conda/activate.d/*.sh`` script, which is where site-env puts its NCCL/MPI settings), then
``python -m torch_dist_check --json FILE ...`` runs there, directly or under a launcher such as
``srun -n 8``. If the prefix has no torch_dist_check package of its own, the copy that ships with
channelsmith is put on PYTHONPATH: it imports nothing from channelsmith and needs only torch.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from channelsmith.deploy import prefix_records
from channelsmith.errors import VerifyError
from channelsmith.gpu import gpu_disagreement, lock_target, runs_on, solved_for

# Seconds the suite's launcher has to stop its ranks after SIGTERM (it kills them at once).
STOP_GRACE_S = 30.0
# Activates a prefix like `conda activate` (its activate.d scripts), then runs the arguments.
_ACTIVATE_AND_RUN = 'for f in "$CONDA_PREFIX"/etc/conda/activate.d/*.sh; do [ -e "$f" ] && . "$f"; done; exec "$@"'


@dataclass(frozen=True)
class VerifyOptions:
    """What to run against which prefix."""

    prefix: Path
    nproc: int | None = 2
    backends: tuple[str, ...] = ()
    launcher: tuple[str, ...] = ()
    suite_args: tuple[str, ...] = ()
    timeout_s: float = 3600.0


@dataclass(frozen=True)
class PrefixProbe:
    """What the prefix's Python has: its torch and whether it carries torch_dist_check itself."""

    python: Path
    torch_version: str
    has_suite: bool


@dataclass(frozen=True)
class CheckOutcome:
    """One check of the suite, as its JSON reported it."""

    name: str
    status: str
    reason: str
    details: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class VerifyReport:
    """The suite's verdict on a prefix, with every figure it wrote.

    ``exit_code`` is None when the suite did not finish (it was stopped from outside in
    ``incomplete_stage``, and its report is the one it wrote as that stage began): it then had no
    exit code of its own, whatever its launcher returned.
    """

    prefix: Path
    python: Path
    torch_version: str
    suite_source: str
    command: tuple[str, ...]
    exit_code: int | None
    ok: bool
    incomplete_stage: str | None
    checks: tuple[CheckOutcome, ...]
    document: dict[str, Any]
    # Which GPUs the prefix's packages were solved for (its cuda-arch and site profile).
    gpus: str = ""

    @property
    def finished(self) -> bool:
        """Whether the suite gave its own verdict (passed, failed, or named the stage that ran out of time)."""
        return self.exit_code is not None


def prefix_python(prefix: Path) -> Path:
    """The prefix's python executable; VerifyError if the prefix has none."""
    if not prefix.is_dir():
        raise VerifyError(f"{prefix} is not a directory", hint="pass the prefix of a deployed environment (channelsmith deploy)")
    for candidate in (prefix / "bin" / "python", prefix / "bin" / "python3"):
        if candidate.exists() and os.access(candidate, os.X_OK):
            return candidate
    raise VerifyError(
        f"{prefix} has no bin/python",
        hint="deploy an environment with python and pytorch into it first (channelsmith deploy)",
    )


def activated_env(prefix: Path, extra_pythonpath: Path | None) -> dict[str, str]:
    """This process's environment with the prefix activated (before its activate.d scripts run)."""
    env = dict(os.environ)
    env["CONDA_PREFIX"] = str(prefix)
    env["PATH"] = f"{prefix / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    if extra_pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(extra_pythonpath), env.get("PYTHONPATH", "")) if p)
    return env


# Without importing torch (its version from the package's metadata): the suite's ranks import it anyway,
# and an import costs 1-1.6 s of CPU. Prints null for a torch that has no metadata to read.
_LIGHT_PROBE = (
    "import importlib.metadata as m, importlib.util as u, json\n"
    "try:\n    v = m.version('torch') if u.find_spec('torch') else None\n"
    "except m.PackageNotFoundError:\n    v = None\n"
    "print(json.dumps({'torch': v, 'suite': u.find_spec('torch_dist_check') is not None}))"
)
# With the cycle collector paused and the import's objects frozen, as torch_dist_check's ranks import
# torch (scripts/torch_dist_check/harness/startup.py): a third less CPU for the import and the exit.
_IMPORT_PROBE = (
    "import gc; gc.disable(); import importlib.util, json, torch; gc.freeze(); "
    "print(json.dumps({'torch': torch.__version__, "
    "'suite': importlib.util.find_spec('torch_dist_check') is not None}))"
)


def probe_prefix(prefix: Path, import_torch: bool = True) -> PrefixProbe:
    """Ask the prefix's Python for its torch version and whether torch_dist_check is installed there.

    With ``import_torch`` False, torch is only looked up (its version read from its metadata), unless
    it has no metadata; a torch that is there but fails to import is then the suite's to find.
    """
    python = prefix_python(prefix)
    if not import_torch:
        facts = _run_probe(prefix, python, _LIGHT_PROBE)
        if facts is not None and facts["torch"] is not None:
            return PrefixProbe(python, facts["torch"], bool(facts["suite"]))
    facts = _run_probe(prefix, python, _IMPORT_PROBE, raise_error=True)
    assert facts is not None
    return PrefixProbe(python, facts["torch"], bool(facts["suite"]))


def _run_probe(prefix: Path, python: Path, code: str, raise_error: bool = False) -> dict[str, Any] | None:
    proc = subprocess.run(
        ["bash", "-c", _ACTIVATE_AND_RUN, "activate", str(python), "-c", code],
        env=activated_env(prefix, None), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    if proc.returncode != 0:
        if not raise_error:
            return None
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise VerifyError(
            f"the Python in {prefix} cannot import torch: {last}",
            hint="install pytorch into the prefix (channelsmith deploy ... pytorch)",
        )
    facts: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return facts


def suite_command(python: Path, options: VerifyOptions, json_path: Path) -> list[str]:
    """The command line that runs the suite (under the launcher, if one is given)."""
    command = [*options.launcher, str(python), "-m", "torch_dist_check", "--json", str(json_path)]
    if options.nproc is not None and not options.launcher:
        command += ["--nproc", str(options.nproc)]
    if options.backends:
        command += ["--backends", ",".join(options.backends)]
    return command + list(options.suite_args)


def _bundled_suite_root() -> Path:
    """The folder holding the torch_dist_check package that ships with channelsmith."""
    import importlib.util

    spec = importlib.util.find_spec("torch_dist_check")
    if spec is None or spec.origin is None:
        raise VerifyError(
            "the prefix has no torch_dist_check, and none ships with this channelsmith",
            hint="install the torch-dist-check package into the prefix, or reinstall channelsmith (pip install -e .)",
        )
    return Path(spec.origin).resolve().parent.parent


@dataclass(frozen=True)
class SuiteRun:
    """The suite ready to run in a prefix: the prefix's Python and torch, where the suite comes from,
    the command (which names where its JSON report goes) and the activated environment."""

    prefix: Path
    python: Path
    torch_version: str
    suite_source: str
    command: tuple[str, ...]
    report_path: Path
    env: dict[str, str]
    gpus: str


def prepare_suite(options: VerifyOptions, report_path: Path) -> SuiteRun:
    """Check the prefix (python, torch looked up, GPUs it was solved for) and make the suite's command,
    its JSON report written to ``report_path``; VerifyError when the prefix cannot run it."""
    prefix = options.prefix.resolve()
    gpus = check_prefix_gpus(prefix)
    probe = probe_prefix(prefix, import_torch=False)
    extra = None if probe.has_suite else _bundled_suite_root()
    source = "prefix" if probe.has_suite else f"channelsmith ({extra})"
    command = tuple(suite_command(probe.python, options, report_path))
    return SuiteRun(prefix, probe.python, probe.torch_version, source, command, report_path,
                    activated_env(prefix, extra), gpus)  # fmt: skip


def run_suite(suite: SuiteRun, timeout_s: float, pass_output: bool = False) -> VerifyReport:
    """Run a prepared suite and read its verdict.

    ``pass_output``: the suite writes to this process's stdout and stderr as it runs (a batch job's
    log: its stage lines as they happen) instead of into pipes read at its end. Rank 0 rewrites its
    report as each stage begins, so a run killed from outside leaves one naming its stage.

    Raises VerifyError when the suite does not end within ``timeout_s`` or ends without writing its
    report; a failing check is a report with ``ok`` False, not an error.
    """
    suite.report_path.unlink(missing_ok=True)
    piped = None if pass_output else subprocess.PIPE
    proc = subprocess.Popen(
        ["bash", "-c", _ACTIVATE_AND_RUN, "activate", *suite.command],
        env=suite.env, stdout=piped, stderr=piped, text=True,
    )  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _stop_suite(proc)
        raise VerifyError(
            f"the acceptance suite did not finish within {timeout_s:.0f} s",
            hint="raise --timeout, or pass the suite a smaller sweep (-- --max-bytes 64M)",
        ) from None
    except KeyboardInterrupt:
        _stop_suite(proc)
        raise
    if not suite.report_path.exists():
        # A torch that fails to import is said as such (the preparation only looked it up).
        probe_prefix(suite.prefix)
        shown = "its output is above" if pass_output else "\n".join((stderr or stdout).strip().splitlines()[-8:])
        raise VerifyError(
            f"the acceptance suite ended with exit code {proc.returncode} and wrote no report:\n{shown}",
            hint="run the command by hand to see all of its output: " + shlex.join(suite.command),
        )
    document = json.loads(suite.report_path.read_text())
    return report_of(suite.prefix, suite.python, suite.torch_version, suite.suite_source, suite.command,
                     proc.returncode, document, suite.gpus)  # fmt: skip


def verify_prefix(options: VerifyOptions) -> VerifyReport:
    """Run the acceptance suite in the prefix and read its verdict.

    Raises VerifyError when the prefix cannot run it (no python, no torch) or when the suite ends
    without writing its report; a failing check is a report with ``ok`` False, not an error.
    """
    with tempfile.TemporaryDirectory(prefix="channelsmith-verify-") as tmp:
        return run_suite(prepare_suite(options, Path(tmp) / "report.json"), options.timeout_s)


def suite_finished(document: Mapping[str, Any], exit_code: int | None) -> bool:
    """Whether a report of the suite is its verdict, not the copy it wrote as a stage began (a run
    stopped from outside in that stage: a batch system's kill, a rank's launcher that went away).

    A suite older than the report's ``in_progress`` field is judged by what it does: a run that names
    an incomplete stage gives exit status 3 (or 1, a rank lost), never 0.
    """
    if exit_code is None:
        return False
    if "in_progress" in document:
        return not document["in_progress"]
    return document.get("incomplete_stage") is None or exit_code != 0


def report_of(
    prefix: Path, python: Path, torch_version: str, source: str, command: tuple[str, ...], exit_code: int | None,
    document: dict[str, Any], gpus: str = "",
) -> VerifyReport:
    """The verdict in a suite's JSON report; ``exit_code``: its launcher's (None: it never returned one)."""
    checks = tuple(
        CheckOutcome(c["name"], c["status"], c.get("reason", ""), c.get("details", {})) for c in document["checks"]
    )
    finished = suite_finished(document, exit_code)
    return VerifyReport(
        prefix=prefix,
        python=python,
        torch_version=torch_version,
        suite_source=source,
        command=command,
        exit_code=exit_code if finished else None,
        ok=finished and bool(document["summary"]["ok"]) and exit_code == 0,
        incomplete_stage=document.get("incomplete_stage"),
        checks=checks,
        document=document,
        gpus=gpus,
    )


def check_prefix_gpus(prefix: Path) -> str:
    """Which GPUs the prefix was solved for and runs on; VerifyError where this machine's GPUs disagree.

    A prefix whose builds carry sm_80 code only has no code for an H100: the suite would fail there
    with "no kernel image is available", which says nothing about the network it verifies. One solved
    for A100 nodes with builds that also carry sm_90 (generic's) runs there, and is verified.
    """
    if not (prefix / "conda-meta").is_dir():
        return ""
    records = prefix_records(prefix)
    arch, profile = lock_target(records)
    reason = gpu_disagreement(records, f"{prefix}" + (f" ({profile})" if profile else ""))
    if reason:
        raise VerifyError(
            reason, hint="verify on the nodes the environment was deployed for, or deploy one for these GPUs"
        )
    return solved_for(arch, profile, runs_on(records))


def report_document(report: VerifyReport) -> dict[str, Any]:
    """The verdict as `channelsmith verify --json` prints it."""
    return {
        "prefix": report.prefix,
        "python": report.python,
        "torch_version": report.torch_version,
        "suite_source": report.suite_source,
        "command": report.command,
        "exit_code": report.exit_code,
        "finished": report.finished,
        "ok": report.ok,
        "gpus": report.gpus,
        "report": report.document,
    }


def _stop_suite(proc: subprocess.Popen[str]) -> None:
    """End the suite as a batch system would: SIGTERM to its launcher, which takes its ranks with it
    (torch_dist_check's --nproc launcher, srun and mpiexec all do), then SIGKILL if it is still there.
    A bare SIGKILL would leave the ranks of --nproc running, orphaned, until their own timeouts."""
    proc.terminate()
    try:
        proc.communicate(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()


def split_launcher(text: str | None) -> tuple[str, ...]:
    """A launcher command given as one string ("srun -n 8 --gpus-per-task 1") split like a shell."""
    return tuple(shlex.split(text)) if text else ()


def backends_from_csv(text: str | None) -> tuple[str, ...]:
    """'gloo,nccl' to ('gloo', 'nccl')."""
    return tuple(t.strip() for t in text.split(",") if t.strip()) if text else ()


def summary_rows(checks: Sequence[CheckOutcome]) -> list[tuple[str, str, str]]:
    """(check, status, one-line detail) rows for a table."""
    return [(c.name, c.status, " ".join(c.reason.split())[:120]) for c in checks]
