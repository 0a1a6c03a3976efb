"""`channelsmith build --scheduler pbs` and the acceptance suite in a PBS job, against a real OpenPBS.

A session fixture starts a one-node OpenPBS (pbs_server with its PostgreSQL datastore, pbs_sched,
pbs_comm, pbs_mom) with scripts/pbs-local.sh, from an install that `bash .ci/pbs.sh` (or
`bash scripts/pbs-local.sh build`) made from OpenPBS's source in the channelsmith cache, and stops it
at the end. Without that install, or without root (the daemons run in namespaces of their own), the
PBS tests are skipped and say how to get it. The client commands are OpenPBS's own, through the
wrappers the script puts on PATH. The builds are real py-rattler-build builds run in PBS jobs.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from channelsmith import pbs as pbs_adapter
from channelsmith.cli import main
from channelsmith.pbs import job_states, parse_qstat_full, parse_qstat_json
from conftest import REPO_ROOT, SITES
from test_build import HALF_BROKEN, PAIR, PAIR_CONFIG, STAGED, make_repo, snapshot
from test_slurm import SITE_TOOL, SLOW, build_json, state_of, wait_for
from test_verify import make_prefix

SCRIPT = REPO_ROOT / "scripts" / "pbs-local.sh"
INSTALL_HINT = (
    "put OpenPBS's source into the cache (docs/records/pbs-one-node-cpu.md, 'Verification: PBS') and run bash .ci/pbs.sh"
)

PROVIDER = """\
    package:
      name: provider
      version: "1.0"
    build:
      noarch: generic
      script:
        - {provider_script}
        - mkdir -p "$PREFIX/share/provider"
        - echo made > "$PREFIX/share/provider/mark"
    """
CONSUMER = """\
    package:
      name: consumer
      version: "1.0"
    build:
      noarch: generic
      script:
        # The provider's package must be in the host environment: built by the job this one waits for.
        - test -f "$PREFIX/share/provider/mark"
        - mkdir -p "$PREFIX/share/consumer"
    requirements:
      host:
        - provider
    """


def _pbs_env(run_dir: Path) -> dict[str, str]:
    return {**os.environ, "CHANNELSMITH_PBS_DIR": str(run_dir)}


@pytest.fixture(scope="session")
def pbs_server():
    """A running one-node OpenPBS for the session; PBS_CONF_FILE and PATH point at it meanwhile."""
    if os.geteuid() != 0:
        pytest.skip("the local OpenPBS runs its daemons as root, in namespaces of their own; run the tests as root")
    installed = subprocess.run(["bash", str(SCRIPT), "installed"], capture_output=True, text=True)
    if installed.returncode != 0:
        pytest.skip(f"OpenPBS is not installed ({installed.stderr.strip()}); {INSTALL_HINT}")
    # Below /tmp, not pytest's own (mode 0700) folder: PostgreSQL runs as its own user and must reach
    # the datastore below PBS_HOME.
    run_dir = Path(tempfile.mkdtemp(prefix="channelsmith-pbs-test-"))
    env = _pbs_env(run_dir)
    started = time.monotonic()
    proc = subprocess.run(["bash", str(SCRIPT), "start"], env=env, capture_output=True, text=True, timeout=180)
    if proc.returncode != 0:
        subprocess.run(["bash", str(SCRIPT), "stop"], env=env, capture_output=True, text=True, timeout=120)
        shutil.rmtree(run_dir, ignore_errors=True)
        pytest.fail(f"the local OpenPBS did not start:\n{proc.stderr}")
    exports = dict(line.removeprefix("export ").split("=", 1) for line in proc.stdout.splitlines())
    assert set(exports) == {"PBS_CONF_FILE", "PATH"}
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PBS_CONF_FILE", exports["PBS_CONF_FILE"])
        patch.setenv("PATH", f"{run_dir / 'bin'}:{os.environ['PATH']}")
        patch.setenv("CHANNELSMITH_POLL_INTERVAL", "0.5")
        try:
            # Queues for the option checks: Derecho's `main`, and a short one with a walltime limit.
            for command in ("create queue main queue_type=execution,enabled=true,started=true",
                            "create queue short queue_type=execution,enabled=true,started=true",
                            "set queue short resources_max.walltime = 00:10:00"):  # fmt: skip
                qmgr(command)
            print(f"OpenPBS started in {time.monotonic() - started:.1f} s", file=sys.stderr)
            yield run_dir
        finally:
            subprocess.run(["bash", str(SCRIPT), "stop"], env=env, capture_output=True, text=True, timeout=120)
            shutil.rmtree(run_dir, ignore_errors=True)


def qmgr(command: str) -> str:
    return subprocess.run(["qmgr", "-c", command], capture_output=True, text=True, check=True).stdout


def job_ids() -> set[str]:
    """Every job the server knows, finished ones included."""
    document = json.loads(subprocess.run(["qstat", "-x", "-f", "-F", "json"], capture_output=True, text=True,
                                         check=True).stdout)  # fmt: skip
    return set(document.get("Jobs", {}))


def job_attributes(job_id: str) -> dict:
    out = subprocess.run(["qstat", "-x", "-f", "-F", "json", job_id], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)["Jobs"][job_id]


def finished(job_id: str, timeout: float = 60) -> dict:
    """The job's attributes once PBS has finished it (state F, its exit status set)."""
    deadline = time.monotonic() + timeout
    while (attributes := job_attributes(job_id))["job_state"] != "F":
        assert time.monotonic() < deadline, f"job {job_id} did not finish within {timeout} s: {attributes['job_state']}"
        time.sleep(0.2)
    return attributes


@pytest.fixture
def pbs(pbs_server: Path):
    """The session's server; the jobs a test leaves queued or running are deleted after it."""
    yield pbs_server
    active = subprocess.run(["qselect"], capture_output=True, text=True, check=True).stdout.split()
    if active:
        subprocess.run(["qdel", "-W", "force", *active], capture_output=True, text=True, check=False)


# ------------------------------------------------------------------------------------------------
# The whole path: submit, wait, publish


@pytest.mark.pbs
def test_two_chained_recipes_build_through_pbs_with_no_wait_then_collect(pbs, tmp_path, capsys):
    """The consumer's job waits (-W depend=afterok) for the provider's; collected later, then one publish."""
    root = make_repo(tmp_path, {"provider": PROVIDER.format(provider_script="true"), "consumer": CONSUMER},
                     config="{}\n")  # fmt: skip
    channel, build_dir = tmp_path / "channel", tmp_path / "jobs"
    code, document, err = build_json(
        capsys, "--root", str(root), "build", "consumer", "provider", "--scheduler", "pbs", "--no-wait",
        "--channel-dir", str(channel), "--build-dir", str(build_dir), "--time", "00:05:00",
    )  # fmt: skip
    assert code == 0, err
    assert document["collect"] == f"channelsmith build --collect {build_dir}"
    jobs = {j["recipe"]: j for j in document["jobs"]}
    assert not channel.exists()
    # What PBS holds: the consumer depends on the provider, both with the walltime asked for.
    consumer = job_attributes(jobs["consumer"]["job_id"])
    assert consumer["depend"].startswith(f"afterok:{jobs['provider']['job_id']}")
    assert consumer["Resource_List"]["walltime"] == "00:05:00"
    assert state_of(build_dir)["scheduler"] == "pbs"

    # --collect, as after a logout: the live table's lines (no terminal: one per change), then the publish.
    code, document, err = build_json(capsys, "build", "--collect", str(build_dir))
    assert code == 0, err
    assert f"job {jobs['provider']['job_id']} provider: COMPLETED" in err
    assert sorted(Path(p).name.rsplit("-", 2)[0] for p in document["published"]) == ["consumer", "provider"]
    units = {u["recipe"]: u for u in state_of(build_dir)["units"]}
    started = float((build_dir / "units" / units["consumer"]["id"] / "started").read_text())
    provider_done = json.loads((build_dir / "units" / units["provider"]["id"] / "result.json").read_text())["finished"]
    assert started >= provider_done
    # Each ran as a PBS job: its log (the job's output file) names the node the job ran on.
    log = Path(jobs["consumer"]["log"]).read_text()
    assert "on pbsnode" in log and "channelsmith: done" in log
    # The job itself ended with 0 once PBS finished it (it writes its result just before it exits).
    assert finished(jobs["consumer"]["job_id"])["Exit_status"] == 0
    # qstat's text output (servers without JSON) reads the same as its JSON, long lines wrapped and all.
    text = subprocess.run(["qstat", "-x", "-f"], capture_output=True, text=True, check=True).stdout
    as_json = subprocess.run(["qstat", "-x", "-f", "-F", "json"], capture_output=True, text=True, check=True).stdout
    assert parse_qstat_full(text) == parse_qstat_json(as_json)
    assert parse_qstat_json(as_json)[jobs["consumer"]["job_id"]].state == "COMPLETED"
    # Both jobs at once: this OpenPBS prints only the first of several jobs as JSON (openpbs issue 2672);
    # the rest is read from its text output.
    ids = [jobs["provider"]["job_id"], jobs["consumer"]["job_id"]]
    as_json = subprocess.run(["qstat", "-x", "-f", "-F", "json", *ids], capture_output=True, text=True).stdout
    assert list(parse_qstat_json(as_json)) == ids[:1]
    assert {job_id: state.state for job_id, state in job_states([*ids, "999.pbsnode"]).items()} == {
        ids[0]: "COMPLETED", ids[1]: "COMPLETED"
    }


@pytest.mark.pbs
def test_a_failing_compile_publishes_nothing_and_its_dependents_never_run(pbs, tmp_path, capsys):
    root = make_repo(tmp_path, {"provider": PROVIDER.format(provider_script="exit 3"), "consumer": CONSUMER},
                     config="{}\n")  # fmt: skip
    channel = tmp_path / "channel"
    code = main(["--root", str(root), "build", "consumer", "provider", "--scheduler", "pbs",
                 "--channel-dir", str(channel), "--build-dir", str(tmp_path / "jobs")])  # fmt: skip
    assert code == 1
    err = " ".join(capsys.readouterr().err.split())
    assert "provider: FAILED" in err
    assert "consumer: CANCELLED (a job it depends on failed); it never ran" in err
    assert "nothing was published" in err
    assert not channel.exists()


@pytest.mark.pbs
def test_a_job_killed_by_qdel_fails_the_build_and_names_its_log(pbs, tmp_path, capsys):
    started = tmp_path / "build-started"
    root = make_repo(tmp_path, {"slow": SLOW.format(started=started)}, config="{}\n")
    build_dir, channel = tmp_path / "jobs", tmp_path / "channel"
    code, document, _ = build_json(
        capsys, "--root", str(root), "build", "slow", "--scheduler", "pbs", "--no-wait",
        "--channel-dir", str(channel), "--build-dir", str(build_dir),
    )  # fmt: skip
    assert code == 0
    [job] = document["jobs"]
    wait_for(started)
    subprocess.run(["qdel", job["job_id"]], check=True)

    code, document, err = build_json(capsys, "build", "--collect", str(build_dir))
    assert code == 1
    err = " ".join(err.split())
    # PBS keeps who deleted the job in its comment ("... and terminated by root@pbsnode").
    cause = f"deleted (qdel) by {pwd.getpwuid(os.getuid()).pw_name}"
    assert f"job {job['job_id']} slow: CANCELLED ({cause}); its log: {job['log']}" in err
    [shown] = document["jobs"]
    assert (shown["state"], shown["reason"]) == ("CANCELLED", cause)
    assert not channel.exists()


@pytest.mark.pbs
def test_a_job_killed_for_its_walltime_says_so_and_what_to_raise(pbs, tmp_path, capsys):
    """PBS's MoM enforces walltime in seconds (the issue saw a 15 s limit enforced at 26 s)."""
    started = tmp_path / "build-started"
    root = make_repo(tmp_path, {"slow": SLOW.format(started=started)}, config="{}\n")
    build_dir, channel = tmp_path / "jobs", tmp_path / "channel"
    code, document, err = build_json(
        capsys, "--root", str(root), "build", "slow", "--scheduler", "pbs", "--time", "00:00:15",
        "--channel-dir", str(channel), "--build-dir", str(build_dir),
    )  # fmt: skip
    assert code == 1
    [job] = document["jobs"]
    cause = "exceeded its time limit 00:00:15 (walltime); raise --time"
    assert (job["state"], job["reason"]) == ("TIMEOUT", cause)
    assert finished(job["job_id"])["Exit_status"] == -29  # JOB_EXEC_KILL_WALLTIME
    err = " ".join(err.split())
    assert f"job {job['job_id']} slow: TIMEOUT ({cause}); its log: {job['log']}" in err
    assert "nothing was published" in err and not channel.exists()
    # Once qstat has forgotten the job, the line the MoM wrote into its log still says it.
    assert pbs_adapter.kill_cause_in_log(Path(job["log"]).read_text()) == cause


@pytest.mark.pbs
def test_ctrl_c_with_cancel_on_interrupt_deletes_the_jobs(pbs, tmp_path):
    started = tmp_path / "build-started"
    root = make_repo(tmp_path, {"slow": SLOW.format(started=started)}, config="{}\n")
    build_dir, channel = tmp_path / "jobs", tmp_path / "channel"
    command = [sys.executable, "-m", "channelsmith", "--root", str(root), "build", "slow", "--scheduler", "pbs",
               "--channel-dir", str(channel), "--build-dir", str(build_dir), "--cancel-on-interrupt"]  # fmt: skip
    proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(started, proc)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130
    err = " ".join(err.split())
    [unit] = state_of(build_dir)["units"]
    assert f"cancelled the build's jobs ({unit['job_id']})" in err and "nothing was published" in err
    assert finished(unit["job_id"])["substate"] == 91  # deleted (qdel)
    assert not channel.exists()


# ------------------------------------------------------------------------------------------------
# The paths test_slurm.py proves for Slurm, through PBS


@pytest.mark.pbs
def test_site_env_builds_through_pbs_then_deploys_and_a_rebuild_submits_nothing(pbs, repo_root, tmp_path, capsys):
    channel, build_dir = tmp_path / "channel", tmp_path / "jobs"
    code, document, err = build_json(
        capsys, "--root", str(repo_root), "build", "site-env", "--scheduler", "pbs",
        "--channel-dir", str(channel), "--build-dir", str(build_dir),
    )  # fmt: skip
    assert code == 0, err
    jobs = document["jobs"]
    assert sorted(j["variants"][0]["site"] for j in jobs) == sorted(SITES)
    assert all(j["state"] == "COMPLETED" and "on pbsnode" in Path(j["log"]).read_text() for j in jobs)
    assert sorted(Path(p).name.rsplit("-", 2)[0] for p in document["published"]) == sorted(
        f"site-env-{site}" for site in SITES
    )
    prefix = tmp_path / "env"
    assert main(["deploy", "site-env-derecho", "--prefix", str(prefix), "--channel-dir", str(channel)]) == 0
    assert (prefix / "etc/conda/activate.d/site-env-derecho.sh").is_file()
    capsys.readouterr()

    # Built again: everything is in the channel, nothing is submitted, the channel stays as it is.
    before, known = snapshot(channel), job_ids()
    code, document, _ = build_json(
        capsys, "--root", str(repo_root), "build", "site-env", "--scheduler", "pbs",
        "--channel-dir", str(channel), "--build-dir", str(build_dir),
    )  # fmt: skip
    assert code == 0 and document["published"] == []
    assert {j["state"] for j in document["jobs"]} == {"IN CHANNEL"}
    assert job_ids() == known and snapshot(channel) == before


@pytest.mark.pbs
def test_a_recipe_that_needs_another_waits_for_the_pbs_job_that_builds_it(pbs, tmp_path, capsys):
    root = make_repo(tmp_path, {"site-tool": SITE_TOOL}, config=("site:\n  - derecho\n  - generic\n"
                                                                 # site-env declares each site's GPUs (issue 53)
                                                                 'site_cuda_arch:\n  - "8.0"\n  - ""\n'
                                                                 'site_cuda_driver:\n  - "12.4"\n  - ""\n'
                                                                 "zip_keys:\n  - [site, site_cuda_arch, site_cuda_driver]\n"))
    shutil.copytree(REPO_ROOT / "recipes" / "site-env", root / "recipes" / "site-env")
    build_dir = tmp_path / "jobs"
    code, document, err = build_json(
        capsys, "--root", str(root), "build", "site-tool", "site-env", "--scheduler", "pbs",
        "--channel-dir", str(tmp_path / "channel"), "--build-dir", str(build_dir),
    )  # fmt: skip
    assert code == 0, err
    units = {u["id"]: u for u in state_of(build_dir)["units"]}
    for unit in units.values():
        if unit["recipe"] == "site-tool":
            [provider] = [units[d] for d in unit["depends_on"]]
            assert provider["variants"][0]["site"] == unit["variants"][0]["site"]
            # It started only after its provider's job had written its result (PBS drops `depend` once met).
            started = float((build_dir / "units" / unit["id"] / "started").read_text())
            provider_done = json.loads((build_dir / "units" / provider["id"] / "result.json").read_text())["finished"]
            assert started >= provider_done
    names = sorted(Path(p).name.rsplit("-", 2)[0] for p in document["published"])
    assert names == ["site-env-derecho", "site-env-generic", "site-tool-derecho", "site-tool-generic"]


@pytest.mark.pbs
def test_a_staging_compile_and_every_python_reusing_it_are_one_pbs_job(pbs, tmp_path, capsys):
    compile_log = tmp_path / "compiles.log"
    config = 'python:\n  - "3.10"\n  - "3.11"\nflavor:\n  - x\n'
    root = make_repo(tmp_path, {"toy": STAGED.format(compile_log=compile_log)}, config=config)
    channel = tmp_path / "channel"
    code, document, err = build_json(
        capsys, "--root", str(root), "build", "toy", "--scheduler", "pbs",
        "--channel-dir", str(channel), "--build-dir", str(tmp_path / "jobs"),
    )  # fmt: skip
    assert code == 0, err
    assert [j["variant"] for j in document["jobs"]] == ["toy [python=3.10,3.11]"]
    assert compile_log.read_text().split().count("x") == 2
    assert len(list(channel.glob("linux-64/py-toy-*.conda"))) == 2


@pytest.mark.pbs
def test_an_output_every_python_renders_is_built_by_one_pbs_job_and_awaited_by_the_others(pbs, tmp_path, capsys):
    root = make_repo(tmp_path, {"pair": PAIR}, config=PAIR_CONFIG)
    channel, build_dir = tmp_path / "channel", tmp_path / "jobs"
    code, _, err = build_json(
        capsys, "--root", str(root), "build", "pair", "--scheduler", "pbs",
        "--channel-dir", str(channel), "--build-dir", str(build_dir),
    )  # fmt: skip
    assert code == 0, err
    assert sorted(p.name.rsplit("-", 2)[0] for p in channel.rglob("*.conda")) == ["libpair", "py-pair", "py-pair"]
    first, second = state_of(build_dir)["units"]
    assert second["depends_on"] == [first["id"]] and second["built_elsewhere"]


@pytest.mark.pbs
def test_a_failing_pbs_job_names_its_log_and_a_rerun_submits_only_that_job(pbs, tmp_path, capsys):
    root = make_repo(tmp_path, {"half-broken": HALF_BROKEN})
    build_dir, channel = tmp_path / "jobs", tmp_path / "channel"
    args = ["--root", str(root), "build", "half-broken", "--scheduler", "pbs",
            "--channel-dir", str(channel), "--build-dir", str(build_dir)]  # fmt: skip
    assert main(args) == 1
    err = " ".join(capsys.readouterr().err.split())
    failed = next(u for u in state_of(build_dir)["units"] if u["variants"] == [{"site": "b"}])
    log = build_dir / "units" / failed["id"] / "job.log"
    assert f"half-broken [site=b]: FAILED: PyRattlerBuildError: Script failed to execute; its log: {log}" in err
    assert "nothing was published" in err and not channel.exists()

    (root / "recipes/half-broken/recipe.yaml").write_text(textwrap.dedent(HALF_BROKEN).replace("exit 3", "true"))
    jobs_before = {u["id"]: u["job_id"] for u in state_of(build_dir)["units"]}
    code, document, err = build_json(capsys, *args)
    assert code == 0, err
    jobs_after = {j["unit"]: j["job_id"] for j in document["jobs"]}
    assert jobs_after[failed["id"]] != jobs_before[failed["id"]]
    [kept] = [unit for unit in jobs_before if unit != failed["id"]]
    assert jobs_after[kept] == jobs_before[kept]


@pytest.mark.pbs
def test_ctrl_c_without_cancel_leaves_the_pbs_jobs_running(pbs, tmp_path):
    started = tmp_path / "build-started"
    root = make_repo(tmp_path, {"slow": SLOW.format(started=started)}, config="{}\n")
    build_dir, channel = tmp_path / "jobs", tmp_path / "channel"
    command = [sys.executable, "-m", "channelsmith", "--root", str(root), "build", "slow", "--scheduler", "pbs",
               "--channel-dir", str(channel), "--build-dir", str(build_dir)]  # fmt: skip
    proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(started, proc)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130
    err = " ".join(err.split())
    assert "the jobs go on" in err and f"channelsmith build --collect {build_dir}" in err
    [unit] = state_of(build_dir)["units"]
    assert job_attributes(unit["job_id"])["job_state"] == "R"
    assert not channel.exists()


@pytest.mark.pbs
def test_a_channel_that_cannot_be_written_is_refused_before_anything_is_submitted_to_pbs(pbs, repo_root, tmp_path, capsys):
    (tmp_path / "a-file").write_text("not a folder\n")
    channel = tmp_path / "a-file" / "channel"
    err = _refused(["--root", str(repo_root), "build", "site-env", "--scheduler", "pbs",
                    "--channel-dir", str(channel), "--build-dir", str(tmp_path / "jobs")], capsys)  # fmt: skip
    assert f"cannot write the channel at {channel}" in err
    assert not (tmp_path / "jobs").exists()


def test_recipes_that_need_each_other_are_refused_before_pbs_is_asked(tmp_path, capsys):
    """No server needed: the cycle is found while planning, before any PBS command runs."""
    recipe = """\
        package:
          name: {name}
          version: "1.0"
        build:
          noarch: generic
          script:
            - true
        requirements:
          host:
            - {other}
        """
    root = make_repo(tmp_path, {"ping": recipe.format(name="ping", other="pong"),
                                "pong": recipe.format(name="pong", other="ping")}, config="{}\n")  # fmt: skip
    code = main(["--root", str(root), "build", "ping", "pong", "--scheduler", "pbs",
                 "--channel-dir", str(tmp_path / "channel"), "--build-dir", str(tmp_path / "jobs")])  # fmt: skip
    assert code == 2
    assert "require each other's packages in a cycle (among: ping, pong)" in " ".join(capsys.readouterr().err.split())
    assert not (tmp_path / "jobs").exists()


# ------------------------------------------------------------------------------------------------
# Options: the site profile, and what is refused before anything is submitted


@pytest.mark.pbs
def test_derechos_profile_asks_for_queue_main_a_whole_node_and_the_project(pbs, repo_root, tmp_path, capsys):
    args = ["--root", str(repo_root), "build", "site-env", "--variant", "site=derecho", "--scheduler", "pbs",
            "--channel-dir", str(tmp_path / "channel"), "--build-dir", str(tmp_path / "jobs"), "--no-wait"]  # fmt: skip
    known = job_ids()
    assert main(args) == 2
    assert "derecho charges every job to a project, and no --account was given" in capsys.readouterr().err
    assert job_ids() == known

    code, document, err = build_json(capsys, *args, "--account", "NCAR0001")
    assert code == 0, err
    [job] = document["jobs"]
    attributes = job_attributes(job["job_id"])
    assert attributes["queue"] == "main" and attributes["Account_Name"] == "NCAR0001"
    assert attributes["Resource_List"]["select"] == "1:ncpus=64"
    # A 64-core chunk never fits the 2-CPU test node: the job waits, PBS says why.
    assert attributes["job_state"] == "Q"


def _refused(args: list[str], capsys) -> str:
    known = job_ids()
    code = main(args)
    err = " ".join(capsys.readouterr().err.split())
    assert code == 2, err
    assert job_ids() == known
    return err


@pytest.mark.pbs
@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--queue", "nope"], "PBS has no queue 'nope' hint: queues of this server: main, short, workq"),
        (["--select", "1:ncpus"], "--select '1:ncpus' is not a PBS select statement"),
        (["--select", "select=1:ncpus=2"], "it starts with 'select=' hint: give the chunks alone: --select 1:ncpus=2"),
        # Well-formed, but a resource the server does not know: qsub refuses the first job.
        (["--select", "1:nosuch=2"], 'qsub refused'),
        (["--queue", "short", "--time", "01:00:00"], "walltime 01:00:00 is over the limit of queue 'short' (00:10:00)"),
        (["--time", "1h"], "walltime '1h' is not [[HH:]MM:]SS"),
        (["--partition", "debug"], "options for slurm given with --scheduler pbs: --partition"),
    ],
    ids=[
        "unknown-queue", "malformed-select", "select-prefix", "unknown-resource", "walltime-over-limit",
        "malformed-walltime", "slurm-option",
    ],
)
def test_bad_pbs_options_are_refused_before_anything_is_submitted(pbs, repo_root, tmp_path, capsys, options, message):
    err = _refused(["--root", str(repo_root), "build", "site-env", "--scheduler", "pbs", *options,
                    "--channel-dir", str(tmp_path / "channel"), "--build-dir", str(tmp_path / "jobs")], capsys)  # fmt: skip
    assert message in err
    assert not (tmp_path / "jobs").exists() and not (tmp_path / "channel").exists()


@pytest.mark.parametrize("script", ["pbs-local.sh", "slurm-local.sh"])
def test_stopping_a_local_cluster_that_is_not_running_says_so(tmp_path, script):
    """No server needed (nor OpenPBS built): a stop where nothing runs says there was nothing to stop, not "stopped"."""
    run_dir = tmp_path / "never-started"
    env = {**os.environ, "CHANNELSMITH_PBS_DIR": str(run_dir), "CHANNELSMITH_SLURM_DIR": str(run_dir)}
    done = subprocess.run(["bash", str(REPO_ROOT / "scripts" / script), "stop"], env=env, capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip().endswith(f"not running (no {'node in' if script == 'pbs-local.sh' else 'daemon of'} "
                                        f"{run_dir}); nothing to stop")  # fmt: skip
    assert "stopped" not in done.stderr


def test_no_qsub_on_path_is_refused_with_a_hint(repo_root, tmp_path, capsys, monkeypatch):
    """No server needed: with no PBS command on PATH, nothing can have been submitted."""
    monkeypatch.setenv("PATH", str(Path(sys.executable).parent))
    code = main(["--root", str(repo_root), "build", "site-env", "--scheduler", "pbs",
                 "--channel-dir", str(tmp_path / "channel"), "--build-dir", str(tmp_path / "jobs")])  # fmt: skip
    assert code == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "PBS's commands are not on PATH: qsub, qstat, qdel, qmgr not found" in err
    assert "pbs-local.sh start" in err
    assert not (tmp_path / "jobs").exists()


@pytest.mark.pbs
def test_an_unreachable_server_is_caught_before_any_job(pbs, repo_root, tmp_path, capsys, monkeypatch):
    """A pbs.conf naming a server port nobody listens on: the server is down."""
    conf = os.environ["PBS_CONF_FILE"]
    dead = tmp_path / "pbs.conf"
    dead.write_text(Path(conf).read_text() + "PBS_BATCH_SERVICE_PORT=15999\n")
    known = job_ids()
    monkeypatch.setenv("PBS_CONF_FILE", str(dead))
    code = main(["--root", str(repo_root), "build", "site-env", "--scheduler", "pbs",
                 "--channel-dir", str(tmp_path / "channel"), "--build-dir", str(tmp_path / "jobs")])  # fmt: skip
    assert code == 3  # the environment, not the command
    err = " ".join(capsys.readouterr().err.split())
    assert "the PBS server does not answer" in err and "pbs-local.sh start" in err
    monkeypatch.setenv("PBS_CONF_FILE", conf)
    assert job_ids() == known
    assert not (tmp_path / "jobs").exists() and not (tmp_path / "channel").exists()


# ------------------------------------------------------------------------------------------------
# The acceptance suite in a PBS job


@pytest.mark.pbs
def test_verify_through_pbs_runs_the_suite_as_one_job_under_mpiexec(pbs, tmp_path, capsys):
    """`verify --scheduler pbs`: two ranks by MPICH's mpiexec inside a job of select=1:ncpus=2:mpiprocs=2,
    the way Derecho's users run it with Cray PALS; the suite reads PBS's environment and passes gloo."""
    pytest.importorskip("torch", reason="torch is not installed (bash scripts/install-test-deps.sh installs it)")
    if shutil.which("mpiexec") is None:
        pytest.skip("mpiexec is not installed (Debian's mpich: bash scripts/install-test-deps.sh)")
    prefix = make_prefix(tmp_path / "env", with_torch=True)
    run_dir = tmp_path / "run"
    code = main(["verify", "--scheduler", "pbs", "--nodes", "1", "--ntasks-per-node", "2", "--backends", "gloo",
                 "--time", "00:05:00", "--prefix", str(prefix), "--run-dir", str(run_dir), "--json",
                 "--timeout", "240", "--", "--quick", "--checks", "env,correctness"])  # fmt: skip
    captured = capsys.readouterr()
    assert code == 0, captured.err
    document = json.loads(captured.out)
    shown = document["job"]
    assert (shown["state"], shown["log"]) == ("COMPLETED", str(run_dir / "job.log"))
    attributes = job_attributes(shown["job_id"])
    assert attributes["Resource_List"]["select"] == "1:ncpus=2:mpiprocs=2"
    job = document["report"]["job"]
    assert job["world_size"] == 2 and job["launcher"] == "mpich"
    assert job["batch_job"] == {"system": "pbs", "job_id": shown["job_id"], "queue": "workq",
                                "hosts": ["pbsnode", "pbsnode"]}  # fmt: skip
    assert document["command"][:5] == ["mpiexec", "-n", "2", "-ppn", "2"]
    statuses = {c["name"]: c["status"] for c in document["report"]["checks"]}
    assert statuses["correctness/gloo/cpu"] == "pass"
    assert f"verify job {shown['job_id']}: COMPLETED" in " ".join(captured.err.split())


@pytest.mark.pbs
def test_a_verify_job_deleted_while_it_runs_says_so_and_by_whom(pbs, tmp_path, capsys):
    """PBS names who deleted a job that had started (it appends "terminated by USER@HOST" to the job's
    comment); a job deleted before it ran has no comment to append to, and says "deleted (qdel)" alone."""
    pytest.importorskip("torch", reason="torch is not installed (bash scripts/install-test-deps.sh installs it)")
    prefix = make_prefix(tmp_path / "env", with_torch=True)
    run_dir = tmp_path / "run"
    code = main(["verify", "--scheduler", "pbs", "--prefix", str(prefix), "--run-dir", str(run_dir), "--no-wait",
                 "--backends", "gloo", "--json"])  # fmt: skip
    captured = capsys.readouterr()
    assert code == 0, captured.err
    job_id = json.loads(captured.out)["job_id"]
    wait_for(run_dir / "started")
    subprocess.run(["qdel", job_id], check=True)

    assert main(["verify", "--collect", str(run_dir), "--json"]) == 1
    captured = capsys.readouterr()
    cause = f"deleted (qdel) by {pwd.getpwuid(os.getuid()).pw_name}"
    assert f"verify job {job_id}: CANCELLED ({cause}); the suite wrote no report" in " ".join(captured.err.split())
    document = json.loads(captured.out)
    assert document["ok"] is False and (document["job"]["state"], document["job"]["reason"]) == ("CANCELLED", cause)


@pytest.mark.pbs
def test_a_verify_job_qsub_refuses_leaves_nothing_behind(pbs, tmp_path, capsys):
    """PBS has no trial submission: what only qsub judges is refused at the submission, and the run
    directory this command made is removed again."""
    pytest.importorskip("torch", reason="torch is not installed (bash scripts/install-test-deps.sh installs it)")
    prefix = make_prefix(tmp_path / "env", with_torch=True)
    err = _refused(["verify", "--scheduler", "pbs", "--prefix", str(prefix), "--run-dir", str(tmp_path / "run"),
                    "--qsub-arg=-lnosuch=2"], capsys)  # fmt: skip
    assert "qsub refused" in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--queue", "main"], "options for a scheduler given without --scheduler: --queue"),
        (["--select", "1:ncpus=64"], "options for a scheduler given without --scheduler: --select"),
        (["--scheduler", "slurm", "--queue", "main"], "options for pbs given with --scheduler slurm: --queue"),
        (["--scheduler", "slurm", "--qsub-arg=-lmem=1GB"], "options for pbs given with --scheduler slurm: --qsub-arg"),
        (["--scheduler", "pbs", "--select", "1:ncpus=2+"], "--select '1:ncpus=2+' is not a PBS select statement"),
    ],
)
def test_pbs_options_that_mean_nothing_are_refused_without_asking_a_server(repo_root, tmp_path, capsys, args, message):
    code = main(["--root", str(repo_root), "build", "site-env", *args, "--build-dir", str(tmp_path / "jobs")])
    assert code == 2
    assert message in " ".join(capsys.readouterr().err.split())
    assert not (tmp_path / "jobs").exists()


@pytest.mark.parametrize(
    ("attributes", "state", "reason"),
    [
        ({"Exit_status": -29, "Resource_List": {"walltime": "00:10:00"}}, "TIMEOUT",
         "exceeded its time limit 00:10:00 (walltime); raise --time"),
        ({"Exit_status": -27}, "OUT_OF_MEMORY", "exceeded its memory (JOB_EXEC_KILL_MEM); ask for more: --qsub-arg=-lmem=..."),
        ({"Exit_status": -20}, "NODE_FAIL", "the job's first node lost its MoM (JOB_EXEC_RERUN_MS_FAIL); submit it again"),
        ({"substate": 91, "Exit_status": 271, "comment": "Job run at Fri Nov 27 at 10:00 on (pbsnode:ncpus=1) and "
          "terminated by alice@login1"}, "CANCELLED", "deleted (qdel) by alice"),
    ],
    ids=["walltime", "memory", "node-failure", "deleted"],
)
def test_the_causes_this_server_cannot_produce_read_as_openpbs_defines_them(attributes, state, reason):
    """No server needed: qstat's JSON as OpenPBS writes it for causes a one-node test server cannot bring about
    (a node failure, a memory limit, another user's qdel); the codes are OpenPBS's src/include/job.h."""
    document = {"Jobs": {"7.server": {"job_state": "F", "substate": 93, **attributes}}}
    [shown] = parse_qstat_json(json.dumps(document)).values()
    assert (shown.state, shown.reason, shown.ended) == (state, reason, True)
    # PBS ended each of them itself: its account wins over a verdict the job wrote on its way out.
    assert shown.killed is True


@pytest.mark.parametrize(
    ("attributes", "state", "requeues", "killed"),
    [
        ({"job_state": "Q", "run_count": 1, "comment": "Not Running: Host set host=pbsnode has too few free resources"},
         "PENDING", 1, False),
        ({"job_state": "R", "run_count": 2}, "RUNNING", 1, False),
        ({"job_state": "R", "run_count": 1}, "RUNNING", 0, False),
        ({"job_state": "F", "substate": 92, "Exit_status": 0, "run_count": 3}, "COMPLETED", 2, False),
        ({"job_state": "F", "substate": 93, "Exit_status": 1, "run_count": 1}, "FAILED", 0, False),
        ({"job_state": "Q"}, "PENDING", 0, False),
    ],
    ids=["queued-again", "running-again", "first-run", "completed-after-two", "failed-by-itself", "never-ran"],
)
def test_a_requeued_pbs_job_counts_its_runs(attributes, state, requeues, killed):
    """No server needed: run_count is how often the server started the job (OpenPBS's ATTR_runcount); one
    queued again after it ran was requeued as often as it ran, one running or done once less."""
    [shown] = parse_qstat_json(json.dumps({"Jobs": {"8.server": attributes}})).values()
    assert (shown.state, shown.requeues, shown.killed) == (state, requeues, killed)
