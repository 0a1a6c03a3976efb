"""`channelsmith build --scheduler slurm` and `verify --launcher srun`, against a real Slurm.

A module fixture starts a one-node cluster on this machine with scripts/slurm-local.sh (munged,
slurmctld and slurmd from Debian's slurm-wlm and munge; all files in a temporary folder) and stops it
after the module's tests (in a parallel run, after those of the test process that started it); without
those packages, or without root, the cluster tests are skipped and say why. Each test gets the node free
of jobs and leaves it so (what it left running is cancelled after it). The builds are real
py-rattler-build builds run inside Slurm batch jobs. Option checks that need no cluster run without it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from channelsmith import slurm
from channelsmith.cli import main
from channelsmith.cli._verify_job import state_text
from channelsmith.scheduler import verifying
from conftest import REPO_ROOT, SITES
from test_build import HALF_BROKEN, PAIR, PAIR_CONFIG, STAGED, make_repo, snapshot
from test_verify import make_prefix

SLURM_TOOLS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel", "sinfo", "srun")


def _free_port_pair() -> int:
    """A port whose next one is free too (slurmctld and slurmd), away from the default 6817/6818.

    Free on every address, not only 127.0.0.1: the daemons listen on all of them, and a port another
    process holds on one address would fail their bind.
    """
    for _ in range(50):
        with socket.socket() as first:
            first.bind(("", 0))
            port = first.getsockname()[1]
        if port >= 65535:
            continue
        with socket.socket() as second:
            try:
                second.bind(("", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no free pair of ports")


# Module, not session: stopping the daemons takes seconds (slurmctld saves its state), which a session
# fixture spent at the very end of a parallel run, with nothing left to run beside it.
@pytest.fixture(scope="module")
def slurm_daemons(tmp_path_factory: pytest.TempPathFactory):
    """A running one-node Slurm for the module; SLURM_CONF points at it until the module's tests end."""
    # Where scripts/slurm-local.sh looks too: the daemons live in /usr/sbin, off a clean PATH (env -i, as CI runs).
    search = f"{os.environ.get('PATH', '')}:/usr/local/sbin:/usr/sbin:/sbin"
    missing = [tool for tool in SLURM_TOOLS if shutil.which(tool, path=search) is None]
    if missing:
        pytest.skip(f"Slurm is not installed ({', '.join(missing)} not found; bash scripts/install-test-deps.sh)")
    if os.geteuid() != 0:
        pytest.skip("the local test cluster runs its daemons as root (SlurmUser=root); run the tests as root")
    env = {
        **os.environ,
        "CHANNELSMITH_SLURM_DIR": str(tmp_path_factory.mktemp("slurm")),
        "CHANNELSMITH_SLURM_PORT": str(_free_port_pair()),
        # As many HPC shells set it: GNU nproc honors it (test_the_clusters_node_has_every_cpu_whatever_openmp_is_told).
        "OMP_NUM_THREADS": "1",
    }
    script = REPO_ROOT / "scripts" / "slurm-local.sh"
    # Stops the cluster when this process ends however it ends (a run that ends badly: an INTERNALERROR, a
    # worker killed), not only at the module's end: four clusters were once left running by four such runs.
    guard = stop_at_exit(script, env)
    try:
        started = time.monotonic()
        proc = subprocess.run(["bash", str(script), "start"], env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert time.monotonic() - started < 30, "the cluster took longer than 30 s to start"
        conf = proc.stdout.strip().removeprefix("export SLURM_CONF=")
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("SLURM_CONF", conf)
            patch.setenv("CHANNELSMITH_POLL_INTERVAL", "0.5")
            yield Path(conf)
    finally:
        guard.stop()


class stop_at_exit:  # noqa: N801 (used as a call)
    """``slurm-local.sh stop-at-eof`` for the cluster of ``env``: it stops the cluster when :meth:`stop` is
    called, or when this process ends without calling it (its end of the pipe closes with it)."""

    def __init__(self, script: Path, env: dict[str, str]) -> None:
        read_end, self._write_end = os.pipe()  # not inherited by the processes the tests start
        self._proc = subprocess.Popen(["bash", str(script), "stop-at-eof"], stdin=read_end, env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
        os.close(read_end)

    def stop(self) -> None:
        """Stop the cluster now and wait until it is stopped."""
        os.close(self._write_end)
        self._proc.wait(timeout=120)


# A cancelled job holds its CPUs while Slurm ends its processes (KillWait, 30 s, before SIGKILL).
NODE_FREE_TIMEOUT_S = 90


def _wait_until_the_node_is_free(conf: Path, when: str) -> None:
    """Every job of the cluster gone and its node idle; a clear failure naming what holds it otherwise.

    The node has this machine's CPUs and nothing more: a job an earlier test left pending, running or
    completing would keep a later `srun -n 2` waiting for CPUs until its own timeout.
    """
    env = {**os.environ, "SLURM_CONF": str(conf)}
    deadline = time.monotonic() + NODE_FREE_TIMEOUT_S
    while True:
        jobs = subprocess.run(["squeue", "-h", "-o", "%i %T %j"], env=env, capture_output=True, text=True).stdout
        node = subprocess.run(["sinfo", "-h", "-N", "-o", "%t"], env=env, capture_output=True, text=True).stdout
        if not jobs.strip() and node.split() == ["idle"]:
            return
        if time.monotonic() > deadline:
            shown = subprocess.run(["scontrol", "show", "node"], env=env, capture_output=True, text=True).stdout
            pytest.fail(f"the test cluster's node is not free {when} after {NODE_FREE_TIMEOUT_S} s: "
                        f"node state {node.strip()!r}; jobs:\n{jobs}\n{shown}")  # fmt: skip
        time.sleep(0.2)


@pytest.fixture
def slurm_cluster(slurm_daemons: Path):
    """The session's cluster with its node free when the test starts; the jobs the test leaves behind
    (a build it interrupted, a job it let run on) are cancelled after it, and the node freed again."""
    _wait_until_the_node_is_free(slurm_daemons, "before the test")
    yield slurm_daemons
    env = {**os.environ, "SLURM_CONF": str(slurm_daemons)}
    subprocess.run(["scancel", "--user", str(os.getuid())], env=env, capture_output=True, text=True, check=True)
    _wait_until_the_node_is_free(slurm_daemons, "after the test")


def squeue_ids() -> set[str]:
    """The ids of the jobs slurmctld still lists (ended ones for MinJobAge, 300 s by default, then no more): a
    test that submitted nothing finds no id it did not know (ids only grow), where a job of an earlier test
    may have left the list meanwhile (seen in a loaded full run)."""
    out = subprocess.run(["squeue", "--states=all", "-h", "-o", "%i"], capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def build_json(capsys, *args: str) -> tuple[int, dict, str]:
    code = main([*args, "--json"])
    captured = capsys.readouterr()
    return code, json.loads(captured.out), captured.err


def state_of(build_dir: Path) -> dict:
    return json.loads((build_dir / "state.json").read_text())


# ------------------------------------------------------------------------------------------------
# The whole path: submit, wait, publish, deploy


@pytest.mark.slurm
def test_site_env_builds_through_slurm_then_deploys(slurm_cluster, repo_root, tmp_path, capsys):
    channel, build_dir = tmp_path / "channel", tmp_path / "jobs"
    code, document, err = build_json(
        capsys, "--root", str(repo_root), "build", "site-env", "--scheduler", "slurm",
        "--channel-dir", str(channel), "--build-dir", str(build_dir), "--cpus-per-task", "1",
    )  # fmt: skip
    assert code == 0, err
    assert document["ok"] is True
    jobs = document["jobs"]
    assert sorted(j["variants"][0]["site"] for j in jobs) == sorted(SITES)
    for job in jobs:
        assert job["state"] == "COMPLETED" and job["job_id"].isdigit()
        # Each ran as a Slurm batch job (its log is the job's output) and built into its own folder.
        log = Path(job["log"]).read_text()
        assert f"on {socket.gethostname()}" in log and "channelsmith: done" in log
    assert len({Path(j["log"]).parent for j in jobs}) == len(SITES)
    assert sorted(Path(p).name.rsplit("-", 2)[0] for p in document["published"]) == sorted(
        f"site-env-{site}" for site in SITES
    )
    # The output folders are freed once their packages are in the channel; the logs stay.
    assert not list(build_dir.glob("units/*/out"))

    prefix = tmp_path / "env"
    assert main(["deploy", "site-env-derecho", "--prefix", str(prefix), "--channel-dir", str(channel)]) == 0
    assert (prefix / "etc/conda/activate.d/site-env-derecho.sh").is_file()
    capsys.readouterr()

    # Built again: everything is in the channel, nothing is submitted, the channel stays as it is.
    before, known = snapshot(channel), squeue_ids()
    code, document, _ = build_json(
        capsys, "--root", str(repo_root), "build", "site-env", "--scheduler", "slurm",
        "--channel-dir", str(channel), "--build-dir", str(build_dir),
    )  # fmt: skip
    assert code == 0 and document["published"] == []
    assert {j["state"] for j in document["jobs"]} == {"IN CHANNEL"}
    assert not squeue_ids() - known
    assert snapshot(channel) == before


SITE_TOOL = """\
    package:
      name: site-tool-${{ site }}
      version: "1.0"
    build:
      noarch: generic
      script:
        # The site's settings package must be in the host environment: built by another job of this call.
        - test -f "$PREFIX/etc/conda/activate.d/site-env-${{ site }}.sh"
        - mkdir -p "$PREFIX/share/site-tool"
        - echo "${{ site }}" > "$PREFIX/share/site-tool/site.txt"
    requirements:
      host:
        - site-env-${{ site }}
      run:
        - site-env-${{ site }}
    tests:
      - script:
          - test "$(cat "$PREFIX/share/site-tool/site.txt")" = "${{ site }}"
          - test -f "$PREFIX/etc/conda/activate.d/site-env-${{ site }}.sh"
    """


@pytest.mark.slurm
def test_a_recipe_that_needs_another_waits_for_the_job_that_builds_it(slurm_cluster, tmp_path, capsys):
    """site-tool-<site> needs site-env-<site>: each of its jobs waits (afterok) for that site's job only."""
    root = make_repo(tmp_path, {"site-tool": SITE_TOOL}, config=("site:\n  - derecho\n  - generic\n"
                                                                 # site-env declares each site's GPUs (issue 53)
                                                                 'site_cuda_arch:\n  - "8.0"\n  - ""\n'
                                                                 'site_cuda_driver:\n  - "12.4"\n  - ""\n'
                                                                 "zip_keys:\n  - [site, site_cuda_arch, site_cuda_driver]\n"))
    shutil.copytree(REPO_ROOT / "recipes" / "site-env", root / "recipes" / "site-env")
    channel, build_dir = tmp_path / "channel", tmp_path / "jobs"
    # The consumer first on the command line: the order comes from the requirements, not from it.
    code, document, err = build_json(
        capsys, "--root", str(root), "build", "site-tool", "site-env", "--scheduler", "slurm",
        "--channel-dir", str(channel), "--build-dir", str(build_dir),
    )  # fmt: skip
    assert code == 0, err
    units = {u["id"]: u for u in state_of(build_dir)["units"]}
    for unit in units.values():
        site = unit["variants"][0]["site"]
        if unit["recipe"] == "site-tool":
            [provider] = [units[d] for d in unit["depends_on"]]
            assert provider["recipe"] == "site-env" and provider["variants"][0]["site"] == site
            # It started only after its provider's job had written its result.
            started = float((build_dir / "units" / unit["id"] / "started").read_text())
            provider_done = json.loads((build_dir / "units" / provider["id"] / "result.json").read_text())["finished"]
            assert started >= provider_done
        else:
            assert unit["depends_on"] == []
    names = sorted(Path(p).name.rsplit("-", 2)[0] for p in document["published"])
    assert names == ["site-env-derecho", "site-env-generic", "site-tool-derecho", "site-tool-generic"]


@pytest.mark.slurm
def test_when_a_job_fails_the_jobs_waiting_for_it_are_cancelled(slurm_cluster, tmp_path, capsys):
    root = make_repo(tmp_path, {"provider": """\
        package:
          name: provider
          version: "1.0"
        build:
          noarch: generic
          script:
            - exit 3
        """, "consumer": """\
        package:
          name: consumer
          version: "1.0"
        build:
          noarch: generic
          script:
            - true
        requirements:
          host:
            - provider
        """}, config="{}\n")
    code = main(["--root", str(root), "build", "consumer", "provider", "--scheduler", "slurm",
                 "--channel-dir", str(tmp_path / "channel"), "--build-dir", str(tmp_path / "jobs")])  # fmt: skip
    assert code == 1
    err = " ".join(capsys.readouterr().err.split())
    assert "provider: FAILED" in err
    assert "consumer: CANCELLED (a job it depends on failed); it never ran" in err
    assert not (tmp_path / "channel").exists()


@pytest.mark.slurm
def test_a_staging_compile_and_every_python_reusing_it_are_one_job(slurm_cluster, tmp_path, capsys):
    compile_log = tmp_path / "compiles.log"
    config = 'python:\n  - "3.10"\n  - "3.11"\n  - "3.12"\nflavor:\n  - x\n  - y\n'
    root = make_repo(tmp_path, {"toy": STAGED.format(compile_log=compile_log)}, config=config)
    channel, build_dir = tmp_path / "channel", tmp_path / "jobs"
    code, document, err = build_json(
        capsys, "--root", str(root), "build", "toy", "--scheduler", "slurm",
        "--channel-dir", str(channel), "--build-dir", str(build_dir),
    )  # fmt: skip
    assert code == 0, err
    # One job per flavor, holding its three Python versions; the compile count is a direct build's.
    jobs = document["jobs"]
    assert sorted(j["variant"] for j in jobs) == ["toy [flavor=x python=3.10,3.11,3.12]",
                                                  "toy [flavor=y python=3.10,3.11,3.12]"]  # fmt: skip
    compiles = compile_log.read_text().split()
    assert compiles.count("x") == compiles.count("y") == 2
    assert len(list(channel.glob("linux-64/py-toy-*.conda"))) == 6


@pytest.mark.slurm
def test_an_output_every_python_renders_is_built_by_one_job_and_awaited_by_the_others(slurm_cluster, tmp_path, capsys):
    root = make_repo(tmp_path, {"pair": PAIR}, config=PAIR_CONFIG)
    channel, build_dir = tmp_path / "channel", tmp_path / "jobs"
    code, document, err = build_json(
        capsys, "--root", str(root), "build", "pair", "--scheduler", "slurm",
        "--channel-dir", str(channel), "--build-dir", str(build_dir),
    )  # fmt: skip
    assert code == 0, err
    names = sorted(p.name.rsplit("-", 2)[0] for p in channel.rglob("*.conda"))
    assert names == ["libpair", "py-pair", "py-pair"]
    first, second = state_of(build_dir)["units"]
    assert second["depends_on"] == [first["id"]] and second["built_elsewhere"]


# ------------------------------------------------------------------------------------------------
# Failures: the channel is never touched


@pytest.mark.slurm
def test_a_failing_job_names_its_log_and_a_rerun_submits_only_that_job(
    slurm_cluster, tmp_path, site_env_channel_copy, capsys
):
    root = make_repo(tmp_path, {"half-broken": HALF_BROKEN})
    build_dir = tmp_path / "jobs"
    before = snapshot(site_env_channel_copy)
    args = ["--root", str(root), "build", "half-broken", "--scheduler", "slurm",
            "--channel-dir", str(site_env_channel_copy), "--build-dir", str(build_dir)]  # fmt: skip
    assert main(args) == 1
    err = " ".join(capsys.readouterr().err.split())
    failed = next(u for u in state_of(build_dir)["units"] if u["variants"] == [{"site": "b"}])
    log = build_dir / "units" / failed["id"] / "job.log"
    assert f"half-broken [site=b]: FAILED: PyRattlerBuildError: Script failed to execute; its log: {log}" in err
    assert "about to fail on purpose" in log.read_text()
    assert "nothing was published" in err
    assert snapshot(site_env_channel_copy) == before

    # Fixed, and run again: site=a's job succeeded and is kept; only site=b's is submitted again.
    (root / "recipes/half-broken/recipe.yaml").write_text(textwrap.dedent(HALF_BROKEN).replace("exit 3", "true"))
    jobs_before = {u["id"]: u["job_id"] for u in state_of(build_dir)["units"]}
    code, document, err = build_json(capsys, *args)
    assert code == 0, err
    jobs_after = {j["unit"]: j["job_id"] for j in document["jobs"]}
    assert jobs_after[failed["id"]] != jobs_before[failed["id"]]
    [kept] = [unit for unit in jobs_before if unit != failed["id"]]
    assert jobs_after[kept] == jobs_before[kept]
    assert sorted(Path(p).name.rsplit("-", 2)[0] for p in document["published"]) == ["half-broken-a", "half-broken-b"]


SLOW = """\
    package:
      name: slow
      version: "1.0"
    build:
      noarch: generic
      script:
        - touch "{started}"
        - sleep 300
    """


def wait_for(path: Path, proc: subprocess.Popen | None = None, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc is not None:
            assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.2)


def wait_for_line(path: Path, text: str, timeout: float = 60, after: str = "") -> None:
    """Until ``path`` (a job's log) holds ``text`` (after the last ``after`` in it, where given)."""
    def shown() -> str:
        whole = path.read_text(errors="replace") if path.exists() else ""
        if not after:
            return whole
        return whole.rpartition(after)[2] if after in whole else ""

    deadline = time.monotonic() + timeout
    while text not in shown():
        assert time.monotonic() < deadline, f"{path} never showed {text!r}: " + (path.read_text() if path.exists() else "")
        time.sleep(0.1)


def stop_processes_naming(marker: str, but_not: str) -> list[int]:
    """SIGSTOP every process whose command line names ``marker``, except those run by ``but_not``; their pids."""
    stopped = []
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0") if proc.name.isdigit() else []
        except OSError:  # ended meanwhile
            continue
        if marker.encode() in argv and Path(argv[0].decode()).name != but_not:
            os.kill(int(proc.name), signal.SIGSTOP)
            stopped.append(int(proc.name))
    return stopped


@pytest.mark.slurm
def test_a_job_cancelled_mid_build_fails_the_build_and_names_its_log(
    slurm_cluster, tmp_path, site_env_channel_copy, capsys
):
    started = tmp_path / "build-started"
    root = make_repo(tmp_path, {"slow": SLOW.format(started=started)}, config="{}\n")
    build_dir = tmp_path / "jobs"
    before = snapshot(site_env_channel_copy)
    code, document, _ = build_json(
        capsys, "--root", str(root), "build", "slow", "--scheduler", "slurm", "--no-wait",
        "--channel-dir", str(site_env_channel_copy), "--build-dir", str(build_dir),
    )  # fmt: skip
    assert code == 0
    [job] = document["jobs"]
    assert document["collect"] == f"channelsmith build --collect {build_dir}"
    wait_for(started)
    subprocess.run(["scancel", job["job_id"]], check=True)

    code, document, err = build_json(capsys, "build", "--collect", str(build_dir))
    assert code == 1
    err = " ".join(err.split())
    # Without accounting (sacct), Slurm does not say who cancelled a job; the test cluster has none.
    cause = "deleted (scancel); Slurm names who only with accounting (sacct)"
    assert f"job {job['job_id']} slow: CANCELLED ({cause}); its log: {job['log']}" in err
    [shown] = document["jobs"]
    assert (shown["state"], shown["reason"]) == ("CANCELLED", cause)
    assert snapshot(site_env_channel_copy) == before
    # Once squeue has forgotten the job, the line slurmstepd wrote into its log still says it.
    assert slurm.kill_cause_in_log(Path(job["log"]).read_text()) == "deleted (scancel)"


@pytest.mark.slurm
def test_a_job_killed_for_its_time_limit_says_so_and_what_to_raise(slurm_cluster, tmp_path, capsys):
    """Slurm's time limits are whole minutes, and slurmctld ends the job some seconds past it (about 90 s here).
    A build job and a verify job (one rank, one CPU each on the 2-CPU node) run out of their time side by side:
    the verify job's suite hangs in its bandwidth stage (its ranks stopped, as a hung collective would leave
    them), and its report names that stage."""
    pytest.importorskip("torch", reason="torch is not installed (bash scripts/install-test-deps.sh installs it)")
    prefix = make_prefix(tmp_path / "env", with_torch=True)
    run_dir = tmp_path / "run"
    assert main(["verify", "--scheduler", "slurm", "--ntasks-per-node", "1", "--time", "00:01:00", "--prefix", str(prefix),
                 "--backends", "gloo", "--run-dir", str(run_dir), "--no-wait", "--", "--checks", "bandwidth"]) == 0  # fmt: skip
    capsys.readouterr()
    wait_for_line(run_dir / "job.log", "torch_dist_check: stage bandwidth/gloo/cpu (at ")
    assert stop_processes_naming(str(run_dir / "suite.json"), but_not="srun")

    started = tmp_path / "build-started"
    root = make_repo(tmp_path, {"slow": SLOW.format(started=started)}, config="{}\n")
    build_dir, channel = tmp_path / "jobs", tmp_path / "channel"
    code, document, err = build_json(
        capsys, "--root", str(root), "build", "slow", "--scheduler", "slurm", "--time", "00:01:00",
        "--channel-dir", str(channel), "--build-dir", str(build_dir),
    )  # fmt: skip
    assert code == 1
    [job] = document["jobs"]
    cause = "exceeded its time limit 00:01:00; raise --time"
    assert (job["state"], job["reason"]) == ("TIMEOUT", cause)
    err = " ".join(err.split())
    assert f"job {job['job_id']} slow: TIMEOUT ({cause}); its log: {job['log']}" in err
    assert "nothing was published" in err and not channel.exists()
    [build] = document["builds"]
    assert f"ended TIMEOUT ({cause})" in build["error"]
    assert slurm.kill_cause_in_log(Path(job["log"]).read_text()) == "exceeded its time limit; raise --time"

    code, verified, err = build_json(capsys, "verify", "--collect", str(run_dir))
    assert code == 1
    assert (verified["job"]["state"], verified["job"]["reason"]) == ("TIMEOUT", cause)
    # The job was killed before the suite's verdict: its report is the one written as the stage began.
    assert (verified["ok"], verified["finished"], verified["exit_code"]) == (False, False, None)
    assert verified["report"]["incomplete_stage"] == "bandwidth/gloo/cpu"
    assert main(["verify", "--collect", str(run_dir)]) == 1
    captured = capsys.readouterr()
    assert "the suite did not finish: it was stopped in stage 'bandwidth/gloo/cpu'" in " ".join(captured.out.split())
    assert f"verify job {verified['job']['job_id']}: TIMEOUT ({cause})" in " ".join(captured.err.split())


def job_state(job_id: str, settled: bool = False) -> str:
    """The job's state in squeue; with ``settled``, once it is past COMPLETING (cancelled jobs pass it)."""
    deadline = time.monotonic() + 30
    while True:
        out = subprocess.run(["squeue", "--states=all", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True)
        state = out.stdout.strip()
        if not settled or state != "COMPLETING" or time.monotonic() > deadline:
            return state
        time.sleep(0.2)


@pytest.mark.slurm
@pytest.mark.parametrize("cancel", [True, False], ids=["cancel-on-interrupt", "keep-running"])
def test_ctrl_c_while_waiting_publishes_nothing(slurm_cluster, tmp_path, site_env_channel_copy, cancel):
    started = tmp_path / "build-started"
    root = make_repo(tmp_path, {"slow": SLOW.format(started=started)}, config="{}\n")
    build_dir = tmp_path / "jobs"
    before = snapshot(site_env_channel_copy)
    command = [sys.executable, "-m", "channelsmith", "--root", str(root), "build", "slow", "--scheduler", "slurm",
               "--channel-dir", str(site_env_channel_copy), "--build-dir", str(build_dir)]  # fmt: skip
    if cancel:
        command.append("--cancel-on-interrupt")
    proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(started, proc)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130
    [unit] = state_of(build_dir)["units"]
    err = " ".join(err.split())
    if cancel:
        assert "cancelled the build's jobs" in err and "nothing was published" in err
        assert job_state(unit["job_id"], settled=True) == "CANCELLED"
    else:
        assert "the jobs go on" in err and f"channelsmith build --collect {build_dir}" in err
        assert job_state(unit["job_id"]) == "RUNNING"
        subprocess.run(["scancel", unit["job_id"]], check=True)
    assert snapshot(site_env_channel_copy) == before


@pytest.mark.slurm
def test_ctrl_c_at_a_terminal_asks_before_cancelling(slurm_cluster, tmp_path, site_env_channel_copy):
    """With a terminal on stdin, Ctrl-C asks; the answer "y" cancels the jobs."""
    import pty

    started = tmp_path / "build-started"
    root = make_repo(tmp_path, {"slow": SLOW.format(started=started)}, config="{}\n")
    build_dir = tmp_path / "jobs"
    before = snapshot(site_env_channel_copy)
    controller, terminal = pty.openpty()
    command = [sys.executable, "-m", "channelsmith", "--root", str(root), "build", "slow", "--scheduler", "slurm",
               "--channel-dir", str(site_env_channel_copy), "--build-dir", str(build_dir)]  # fmt: skip
    proc = subprocess.Popen(command, stdin=terminal, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    os.close(terminal)
    try:
        wait_for(started, proc)
        proc.send_signal(signal.SIGINT)
        os.write(controller, b"y\n")
        _, err = proc.communicate(timeout=60)
    finally:
        os.close(controller)
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130
    err = " ".join(err.split())
    assert "cancel the build's pending and running jobs?" in err
    assert "cancelled the build's jobs" in err
    [unit] = state_of(build_dir)["units"]
    assert job_state(unit["job_id"], settled=True) == "CANCELLED"
    assert snapshot(site_env_channel_copy) == before


@pytest.mark.slurm
def test_an_unknown_partition_is_refused_before_anything_is_submitted(slurm_cluster, repo_root, tmp_path, capsys):
    known = squeue_ids()
    code = main(["--root", str(repo_root), "build", "site-env", "--scheduler", "slurm", "--partition", "nope",
                 "--channel-dir", str(tmp_path / "channel"), "--build-dir", str(tmp_path / "jobs")])  # fmt: skip
    assert code == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "Slurm has no partition 'nope'" in err and "partitions of this cluster: debug" in err
    assert not squeue_ids() - known
    assert not (tmp_path / "jobs").exists() and not (tmp_path / "channel").exists()


@pytest.mark.slurm
def test_a_channel_that_cannot_be_written_is_refused_before_anything_is_submitted(slurm_cluster, repo_root, tmp_path, capsys):
    """The publish after the jobs would fail: found before the first job, not hours later."""
    known = squeue_ids()
    (tmp_path / "a-file").write_text("not a folder\n")
    channel = tmp_path / "a-file" / "channel"
    code = main(["--root", str(repo_root), "build", "site-env", "--scheduler", "slurm",
                 "--channel-dir", str(channel), "--build-dir", str(tmp_path / "jobs")])  # fmt: skip
    assert code == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"cannot write the channel at {channel}" in err
    assert not squeue_ids() - known
    assert not (tmp_path / "jobs").exists()


@pytest.mark.slurm
def test_the_clusters_node_has_every_cpu_whatever_openmp_is_told(slurm_cluster):
    # The module's cluster was started with OMP_NUM_THREADS=1, which GNU nproc honors: slurm-local.sh then made a
    # node of one CPU, and `srun -n 2` stayed pending (PartitionConfig) until its caller's timeout.
    shown = subprocess.run(["scontrol", "show", "node"], env={**os.environ, "SLURM_CONF": str(slurm_cluster)},
                           capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert f"CPUTot={len(os.sched_getaffinity(0))} " in shown, shown


@pytest.mark.slurm
def test_slurm_not_running_is_refused_before_anything_is_submitted(slurm_cluster, repo_root, tmp_path, capsys, monkeypatch):
    """A slurm.conf naming a controller port nobody listens on: the controller is down."""
    dead = tmp_path / "slurm.conf"
    lines = slurm_cluster.read_text().splitlines()
    dead.write_text("\n".join(f"SlurmctldPort={_free_port_pair()}" if l.startswith("SlurmctldPort=") else l for l in lines))
    monkeypatch.setenv("SLURM_CONF", str(dead))
    code = main(["--root", str(repo_root), "build", "site-env", "--scheduler", "slurm",
                 "--channel-dir", str(tmp_path / "channel"), "--build-dir", str(tmp_path / "jobs")])  # fmt: skip
    assert code == 3  # the environment, not the command: exit 3
    err = " ".join(capsys.readouterr().err.split())
    assert "Slurm's controller does not answer" in err and "slurm-local.sh start" in err
    assert not (tmp_path / "jobs").exists() and not (tmp_path / "channel").exists()


# ------------------------------------------------------------------------------------------------
# The acceptance suite under srun


@pytest.mark.slurm
def test_verify_runs_the_suite_under_srun_with_gloo(slurm_cluster, tmp_path, capsys, monkeypatch):
    pytest.importorskip("torch", reason="torch is not installed (bash scripts/install-test-deps.sh installs it)")
    prefix = make_prefix(tmp_path / "env", with_torch=True)
    # srun passes the environment on. No rendezvous port is chosen ahead: a port picked free here can
    # be taken before rank 0's store binds it (srun and two torch imports later), and rank 0 then
    # fails with EADDRINUSE. Rank 0's store binds a port the kernel gives it and publishes it in this
    # file, which both ranks see on the one node (torch_dist_check.harness.rendezvous).
    monkeypatch.setenv("TORCH_DIST_CHECK_PORT_FILE", str(tmp_path / "rendezvous.port"))
    # A rank that fails ends the step at once, with its error, instead of leaving the other one
    # waiting at the rendezvous until verify's timeout.
    code = main(["verify", "--prefix", str(prefix), "--launcher", "srun -n 2 --kill-on-bad-exit=1",
                 "--backends", "gloo", "--json", "--timeout", "300", "--", "--quick", "--checks", "env,correctness"])  # fmt: skip
    captured = capsys.readouterr()
    assert code == 0, captured.err
    document = json.loads(captured.out)
    job = document["report"]["job"]
    assert job["world_size"] == 2 and job["launcher"] == "slurm"
    assert job["master_port"] == int((tmp_path / "rendezvous.port").read_text().split()[0])  # "PORT HOST"
    statuses = {c["name"]: c["status"] for c in document["report"]["checks"]}
    assert statuses["correctness/gloo/cpu"] == "pass"


@pytest.mark.slurm
def test_verify_through_slurm_runs_the_suite_as_one_job_and_reports_as_if_local(slurm_cluster, tmp_path, capsys):
    """The issue's acceptance: `verify --scheduler slurm --nodes 1 --ntasks-per-node 2 --backends gloo`."""
    pytest.importorskip("torch", reason="torch is not installed (bash scripts/install-test-deps.sh installs it)")
    prefix = make_prefix(tmp_path / "env", with_torch=True)
    run_dir = tmp_path / "run"
    code = main(["verify", "--scheduler", "slurm", "--nodes", "1", "--ntasks-per-node", "2", "--backends", "gloo",
                 "--prefix", str(prefix), "--run-dir", str(run_dir), "--json", "--timeout", "300",
                 "--", "--quick", "--checks", "env,correctness"])  # fmt: skip
    captured = capsys.readouterr()
    assert code == 0, captured.err
    document = json.loads(captured.out)
    shown = document["job"]
    assert (shown["state"], shown["log"]) == ("COMPLETED", str(run_dir / "job.log"))
    job = document["report"]["job"]
    assert job["world_size"] == 2 and job["launcher"] == "slurm"
    assert job["batch_job"]["system"] == "slurm" and job["batch_job"]["job_id"] == shown["job_id"]
    assert document["command"][0] == "srun" and document["ok"] is True
    statuses = {c["name"]: c["status"] for c in document["report"]["checks"]}
    assert statuses["correctness/gloo/cpu"] == "pass"
    # The live line (one line per change of state, stderr being no terminal here), then the log.
    err = " ".join(captured.err.split())
    assert f"verify job {shown['job_id']}: RUNNING" in err and f"verify job {shown['job_id']}: COMPLETED" in err
    assert f"its log: {run_dir / 'job.log'}" in err


@pytest.mark.slurm
def test_a_verify_job_whose_check_fails_shows_the_table_and_exits_1(slurm_cluster, tmp_path, capsys):
    """--expect-busbw 1e6 GB/s cannot be met: the suite's verdict in the job is "not verified", shown here as locally.
    One task: what is shown is the verdict the job wrote, whatever its count of ranks (the suite's two tasks under srun
    are the acceptance test's, above); a second task was one more torch import in the job, 1.6 s of CPU."""
    pytest.importorskip("torch", reason="torch is not installed (bash scripts/install-test-deps.sh installs it)")
    prefix = make_prefix(tmp_path / "env", with_torch=True)
    run_dir = tmp_path / "run"
    code = main(["verify", "--scheduler", "slurm", "--ntasks-per-node", "1", "--backends", "gloo", "--prefix", str(prefix),
                 "--run-dir", str(run_dir), "--", "--quick", "--checks", "bandwidth", "--collectives", "all_reduce",
                 "--expect-busbw", "1000000"])  # fmt: skip
    captured = capsys.readouterr()
    assert code == 1, captured.err
    out, err = " ".join(captured.out.split()), " ".join(captured.err.split())
    assert "bandwidth/gloo/cpu │ fail" in out and "NOT verified: 0 pass, 1 fail" in out
    assert "verify job" in err and ": FAILED (checks failed)" in err and f"its log: {run_dir / 'job.log'}" in err


def stand_in_prefix(path: Path) -> Path:
    """A prefix for a verify job that never runs (held back, then deleted or left pending; or refused before it is
    submitted): a venv whose torch is a module that says its version, nothing more. Before it submits, verify
    imports the prefix's torch (on purpose: a broken torch is said before the job waits in a queue), 1.3-1.5 s of
    CPU with PyPI's CUDA build (process accounting, a run of this module); what these tests prove starts after it,
    and their jobs never import torch. The tests that run the suite in a job use make_prefix's real torch."""
    prefix = make_prefix(path, with_torch=False)
    torch = next(prefix.glob("lib/python*/site-packages")) / "torch"
    torch.mkdir()
    (torch / "__init__.py").write_text('__version__ = "0.0+stand-in"  # tests/test_slurm.py: a job that never runs\n')
    return prefix


def _pending_verify_job(prefix: Path, run_dir: Path, capsys) -> str:
    """A verify job submitted with --no-wait that Slurm holds back for an hour (--begin): it stays pending."""
    code = main(["verify", "--scheduler", "slurm", "--prefix", str(prefix), "--run-dir", str(run_dir), "--no-wait",
                 "--sbatch-arg=--begin=now+1hour", "--json"])  # fmt: skip
    captured = capsys.readouterr()
    assert code == 0, captured.err
    document = json.loads(captured.out)
    assert document["collect"] == f"channelsmith verify --collect {run_dir}"
    assert document["log"] == str(run_dir / "job.log")
    return document["job_id"]


@pytest.mark.slurm
def test_a_deleted_verify_job_says_so_when_collected(slurm_cluster, tmp_path, capsys):
    prefix = stand_in_prefix(tmp_path / "env")  # the job is deleted before it runs
    run_dir = tmp_path / "run"
    job_id = _pending_verify_job(prefix, run_dir, capsys)
    subprocess.run(["scancel", job_id], check=True)

    assert main(["verify", "--collect", str(run_dir)]) == 1
    err = " ".join(capsys.readouterr().err.split())
    cause = "deleted (scancel); Slurm names who only with accounting (sacct)"
    assert f"verify job {job_id}: CANCELLED ({cause}); the suite wrote no report; its log: {run_dir / 'job.log'}" in err


def the_node() -> str:
    return subprocess.run(["sinfo", "-h", "-N", "-o", "%N"], capture_output=True, text=True, check=True).stdout.split()[0]


def set_the_node_down() -> None:
    subprocess.run(["scontrol", "update", f"nodename={the_node()}", "state=down", "reason=test"], check=True)


def resume_the_node() -> None:
    """The node back in service (ReturnToService=2 may have brought it back already), so that later tests run."""
    deadline = time.monotonic() + 30
    while True:
        state = subprocess.run(["sinfo", "-h", "-N", "-o", "%t"], capture_output=True, text=True).stdout.strip()
        if state.rstrip("*") in ("idle", "mix", "alloc"):
            return
        if state.startswith(("down", "drain")):
            subprocess.run(["scontrol", "update", f"nodename={the_node()}", "state=resume"], capture_output=True)
        assert time.monotonic() < deadline, f"the node stays {state!r}"
        time.sleep(0.2)


def submit_a_long_verify_job(prefix: Path, run_dir: Path, capsys, *sbatch_args: str) -> str:
    """A verify job whose bandwidth stage runs for minutes, once that stage has begun (its line in the job's log:
    the suite's stage lines reach the log as they happen). One task: what its tests prove is Slurm's account of
    the job against what the job wrote, not the suite's ranks (a second task was one more torch import in each
    run of the job, 1.4-1.6 s of CPU)."""
    code = main(["verify", "--scheduler", "slurm", "--ntasks-per-node", "1", "--time", "00:10:00",
                 "--prefix", str(prefix), "--backends", "gloo", *sbatch_args, "--run-dir", str(run_dir), "--no-wait",
                 "--json", "--", "--checks", "bandwidth", "--iters", "1000000"])  # fmt: skip
    captured = capsys.readouterr()
    assert code == 0, captured.err
    wait_for_line(run_dir / "job.log", "torch_dist_check: stage bandwidth/gloo/cpu (at ")
    return json.loads(captured.out)["job_id"]


NODE_FAIL = "a node of the job failed (NODE_FAIL)"


@pytest.mark.slurm
def test_a_node_set_down_under_a_verify_job_is_reported_as_node_fail_with_the_stage_it_was_in(slurm_cluster, tmp_path,
                                                                                               capsys):  # fmt: skip
    """The job's own report (written as the suite was killed, its launcher saying exit code 0) loses to Slurm's
    NODE_FAIL, in --json, the report and every --collect."""
    pytest.importorskip("torch", reason="torch is not installed (bash scripts/install-test-deps.sh installs it)")
    prefix = make_prefix(tmp_path / "env", with_torch=True)
    run_dir = tmp_path / "run"
    try:
        job_id = submit_a_long_verify_job(prefix, run_dir, capsys, "--sbatch-arg=--no-requeue")
        set_the_node_down()
        code, document, err = build_json(capsys, "verify", "--collect", str(run_dir))
    finally:
        resume_the_node()
    assert code == 1
    assert (document["job"]["state"], document["job"]["reason"]) == ("NODE_FAIL", f"{NODE_FAIL}; submit it again")
    assert document["job"]["requeues"] == 0
    assert (document["ok"], document["finished"], document["exit_code"]) == (False, False, None)
    assert document["report"]["incomplete_stage"] == "bandwidth/gloo/cpu"
    assert f"error: verify job {job_id}: NODE_FAIL ({NODE_FAIL}; submit it again)" in " ".join(err.split())
    for _ in range(2):
        assert main(["verify", "--collect", str(run_dir)]) == 1
        captured = capsys.readouterr()
        out, err = " ".join(captured.out.split()), " ".join(captured.err.split())
        assert "NOT verified: 0 pass, 0 fail, 0 skipped; the suite did not finish: it was stopped in stage " \
               "'bandwidth/gloo/cpu'" in out and "exit code" not in out  # fmt: skip
        assert f"verify job {job_id}: NODE_FAIL ({NODE_FAIL}; submit it again)" in err


@pytest.mark.slurm
def test_a_verify_job_requeued_after_a_node_failure_says_so_how_often_and_why(slurm_cluster, tmp_path, capsys):
    """With Slurm's default requeue, the node set down sends the job back to the queue (held 2 minutes, which
    the test cuts short); waiting, running again and at its end, the job says it was requeued once, and why."""
    pytest.importorskip("torch", reason="torch is not installed (bash scripts/install-test-deps.sh installs it)")
    prefix = make_prefix(tmp_path / "env", with_torch=True)
    run_dir = tmp_path / "run"
    try:
        job_id = submit_a_long_verify_job(prefix, run_dir, capsys)
        set_the_node_down()
        scheduled = verifying.load(run_dir)
        deadline = time.monotonic() + 30
        # Until Slurm holds the requeued job back (its begin time): an earlier StartTime=now is overridden. And
        # until slurmstepd's kill line is in the log: slurmctld may requeue the job before it lands there (seen
        # once in a loaded full run: "no cause in its log" at the first look).
        no_cause = (verifying.NO_CAUSE,)
        while (waiting := verifying.status(scheduled)).reason != "BeginTime" or waiting.requeue_causes == no_cause:
            assert time.monotonic() < deadline, waiting
            time.sleep(0.2)
        # And until the first run's slurmstepd processes are gone: a run started while they are still there makes
        # slurmctld drain the node ("Duplicate jobid", seen once srun's node failure line named the cause early).
        while subprocess.run(["pgrep", "-f", rf"^slurmstepd: \[{job_id}\."], capture_output=True).returncode == 0:
            assert time.monotonic() < deadline, f"the first run of job {job_id} is still on the node"
            time.sleep(0.2)
    finally:
        resume_the_node()
    assert (waiting.state, waiting.ended, waiting.requeue_causes) == ("PENDING", False, (NODE_FAIL,))
    assert state_text(waiting) == f"PENDING (BeginTime; requeued once: {NODE_FAIL})"
    subprocess.run(["scontrol", "update", f"jobid={job_id}", "StartTime=now"], check=True)
    second = f"(run 2: requeued after {NODE_FAIL})"
    wait_for_line(run_dir / "job.log", "torch_dist_check: stage bandwidth/gloo/cpu (at ", after=second)
    collect = subprocess.Popen([sys.executable, "-m", "channelsmith", "verify", "--collect", str(run_dir), "--json"],
                               stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert collect.stderr is not None
        # Its live line, on its first look at the job running again (for minutes, had it not been cancelled).
        first = collect.stderr.readline()
        subprocess.run(["scancel", job_id], check=True)
        out, err = collect.communicate(timeout=60)
    finally:
        if collect.poll() is None:
            collect.kill()
    assert first.strip() == f"verify job {job_id}: RUNNING (requeued once: {NODE_FAIL})", first + err
    assert collect.returncode == 1, err
    document = json.loads(out)
    shown = document["job"]
    assert (shown["state"], shown["requeues"], shown["requeue_causes"]) == ("CANCELLED", 1, [NODE_FAIL])
    # The second run's report, stopped in its stage.
    assert document["report"]["incomplete_stage"] == "bandwidth/gloo/cpu" and document["exit_code"] is None
    # Elapsed from the job's first start (to its end: its log's last line), not from its second.
    starts = [float(line) for line in (run_dir / "started").read_text().split()]
    assert len(starts) == 2 and starts[1] - starts[0] > 1
    assert abs(shown["elapsed_s"] - ((run_dir / "job.log").stat().st_mtime - starts[0])) < 1
    assert f"requeued once: {NODE_FAIL}" in " ".join(err.split())


@pytest.mark.slurm
@pytest.mark.parametrize("cancel", [True, False], ids=["cancel-on-interrupt", "keep-running"])
def test_ctrl_c_while_a_verify_job_waits(slurm_cluster, tmp_path, capsys, cancel):
    prefix = stand_in_prefix(tmp_path / "env")  # the job waits until it is cancelled (or this test's end)
    run_dir = tmp_path / "run"
    job_id = _pending_verify_job(prefix, run_dir, capsys)
    command = [sys.executable, "-m", "channelsmith", "verify", "--collect", str(run_dir)]
    if cancel:
        command.append("--cancel-on-interrupt")
    proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        lines = [proc.stderr.readline() for _ in range(1)]
        while lines[-1] and "PENDING" not in lines[-1]:
            lines.append(proc.stderr.readline())
        # Slurm gives the reason it holds the job back: its begin time.
        assert lines[-1].strip() == f"verify job {job_id}: PENDING (BeginTime)", lines
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130
    err = " ".join(err.split())
    if cancel:
        assert f"cancelled the verify job ({job_id})" in err
        assert job_state(job_id, settled=True) == "CANCELLED"
    else:
        assert f"the verify job goes on; collect its report later with: channelsmith verify --collect {run_dir}" in err
        assert job_state(job_id) == "PENDING"


@pytest.mark.slurm
def test_the_venv_example_verifies_a_virtual_environment_through_slurm(slurm_cluster, tmp_path):
    """examples/verify_venv_slurm.sh (docs/howto/verify.md, "A prefix without conda-forge"), run from the checkout as its
    header says, given a virtual environment that imports torch as $1."""
    pytest.importorskip("torch", reason="torch is not installed (bash scripts/install-test-deps.sh installs it)")
    if shutil.which("channelsmith") is None:
        pytest.skip("the channelsmith command is not on PATH (pip install -e .)")
    prefix = make_prefix(tmp_path / "env", with_torch=True)
    done = subprocess.run(["bash", str(REPO_ROOT / "examples" / "verify_venv_slurm.sh"), str(prefix)], cwd=REPO_ROOT,
                          env={**os.environ, "TMPDIR": str(tmp_path)}, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    out = " ".join(done.stdout.split())
    assert "correctness/gloo/cpu │ pass" in out and "verified: 2 pass, 0 fail" in out
    assert f"its log: {tmp_path / 'verify-venv' / 'job.log'}" in " ".join(done.stderr.split())


@pytest.mark.slurm
def test_a_verify_job_slurm_cannot_place_is_refused_before_anything_is_submitted(slurm_cluster, tmp_path, capsys):
    prefix = stand_in_prefix(tmp_path / "env")  # nothing is submitted
    known = squeue_ids()
    for shape, tried in ((["--nodes", "2"], "--nodes=2"), (["--gpus-per-node", "1"], "--gpus-per-node=1")):
        code = main(["verify", "--scheduler", "slurm", *shape, "--prefix", str(prefix), "--run-dir", str(tmp_path / "run")])
        assert code == 2
        err = " ".join(capsys.readouterr().err.split())
        assert "Slurm refuses these job options" in err and tried in err
        # The hint names verify's own options, not a build's (--cpus-per-task, --gpus).
        assert "fix --nodes/--ntasks-per-node/--gpus-per-node/--time/--partition/--account/--sbatch-arg" in err
        assert "--cpus-per-task" not in err
        assert not squeue_ids() - known and not (tmp_path / "run").exists()


# ------------------------------------------------------------------------------------------------
# Option checks (no cluster needed)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["build", "site-env", "--partition", "debug"], "options for a scheduler given without --scheduler: --partition"),
        (["build", "site-env", "--no-wait"], "options for a scheduler given without --scheduler: --no-wait"),
        (["build", "site-env", "--cancel-on-interrupt"], "given without --scheduler: --cancel-on-interrupt"),
        (["build", "site-env", "--collect", "jobs"], "--collect takes no recipes"),
        (["build", "--scheduler", "slurm", "--collect", "jobs"], "--collect and --scheduler exclude each other"),
        (["build", "site-env", "--scheduler", "slurm", "--cpus-per-task", "0"], "--cpus-per-task 0 is not a valid count"),
        (["build"], "no recipe named"),
    ],
)
def test_scheduler_options_that_mean_nothing_are_refused(repo_root, tmp_path, capsys, args, message):
    code = main(["--root", str(repo_root), *args])
    assert code == 2
    assert message in " ".join(capsys.readouterr().err.split())
    assert not (tmp_path / "jobs").exists()


@pytest.mark.parametrize(
    ("line", "cause"),
    [
        ("slurmstepd: error: *** JOB 9 ON n1 CANCELLED AT 2026-11-28T04:51:43 DUE TO TIME LIMIT ***",
         "exceeded its time limit; raise --time"),
        ("slurmstepd: error: *** JOB 9 ON n1 CANCELLED AT 2026-11-28T04:51:43 DUE TO PREEMPTION ***",
         "preempted by a job of higher priority (PREEMPTED); submit it again"),
        ("slurmstepd: error: *** JOB 9 ON n1 CANCELLED AT 2026-11-28T04:51:43 DUE TO NODE FAILURE, SEE SLURMCTLD LOG "
         "FOR DETAILS ***", "a node of the job failed (NODE_FAIL); submit it again"),
        ("slurmstepd: error: *** JOB 9 ON n1 CANCELLED AT 2026-11-28T04:51:43 ***", "deleted (scancel)"),
        # A batch script that ended on its own once srun gave up on its step: no slurmstepd line, srun's own.
        ("srun: error: Node failure on n1\nsrun: Job step aborted: Waiting up to 32 seconds for job step to finish.\n"
         "channelsmith: NOT verified", "a node of the job failed (NODE_FAIL); submit it again"),
        ("an ordinary last line", None),
        ("a job that printed srun: error: Node failure on n1 inside a line of its own", None),
    ],
    ids=["time-limit", "preemption", "node-failure", "scancel", "srun-node-failure", "none", "quoted"],
)
def test_a_forgotten_jobs_log_still_says_why_slurm_killed_it(line, cause):
    """No cluster needed: the lines slurmstepd writes (src/slurmd/slurmstepd/req.c) and srun's node failure line
    (src/api/step_launch.c); the test cluster makes the time-limit and scancel ones for real (above), and the node
    failure ones where the node is set down under a verify job."""
    assert slurm.kill_cause_in_log(f"building...\n{line}\n") == cause
    assert slurm.time_limit_hms("1-02:03:04") == "26:03:04"


def test_a_cancelled_job_that_wrote_a_failed_result_is_judged_by_its_kill(tmp_path):
    """No cluster needed. A scancel on a busy node can kill the build's script before the job's own process: the
    job then writes that its build failed ("Script failed") before it ends (1 of 15 cancels of
    test_a_job_cancelled_mid_build_fails_the_build_and_names_its_log's job under load). The kill is the cause."""
    from channelsmith.batch import JobState
    from channelsmith.build import JobResult
    from channelsmith.scheduler import load
    from channelsmith.scheduler.state import result_document, write_json
    from channelsmith.scheduler.status import unit_statuses

    unit = {"id": "slow-1", "recipe": "slow", "label": "slow", "variants": [{}], "distinguishing": [{}], "builds": [],
            "built_elsewhere": [], "in_channel": [], "depends_on": [], "channels": [], "job_id": "27"}
    document = {
        "version": 1,
        "request": {"root": str(tmp_path), "recipes": ["slow"], "overrides": {}, "channel_dir": str(tmp_path / "c"),
                    "extra_channels": [], "run_tests": True},
        "slurm": {"partition": None, "account": None, "time_limit": None, "cpus_per_task": 1, "gpus": None, "extra": []},
        "units": [unit],
        "published": None,
    }  # fmt: skip
    (tmp_path / "state.json").write_text(json.dumps(document))
    scheduled = load(tmp_path)
    files = scheduled.files(scheduled.units[0])
    files.dir.mkdir(parents=True)
    failed = JobResult("slow", {}, {}, ok=False, seconds=0.2, error="PyRattlerBuildError: Script failed to execute")
    write_json(files.result, {"ok": False, "finished": time.time(), "results": [result_document(failed)]})
    build_log = "+ sleep 300\nScript failed with status 1\n== channelsmith: slow FAILED: PyRattlerBuildError\n"
    kill_line = "slurmstepd-vm: error: *** JOB 27 ON vm CANCELLED AT 2026-11-28T10:25:22 ***\n"
    cause = "deleted (scancel); Slurm names who only with accounting (sacct)"
    cancelled = {"27": JobState("27", "CANCELLED", cause, ended=True)}

    files.log.write_text(build_log)
    [status] = unit_statuses(scheduled, cancelled)
    assert (status.state, status.ended, status.ok) == ("FAILED", True, False)  # the build failed of itself
    files.log.write_text(kill_line + build_log)
    [status] = unit_statuses(scheduled, cancelled)
    assert (status.state, status.reason, status.ended, status.ok) == ("CANCELLED", cause, True, False)
    [status] = unit_statuses(scheduled, {})  # squeue has forgotten the job: its log says it
    assert (status.state, status.reason, status.ended) == ("ENDED", "deleted (scancel)", True)


def _verify_run(run_dir: Path, result: dict | None, log: str, runs: int = 1) -> verifying.ScheduledVerify:
    """A verify job's run directory as its job leaves it: ``runs`` starts, the log, the result (if any)."""
    from channelsmith.scheduler.state import write_json

    scheduled = verifying.ScheduledVerify(run_dir, verifying.VerifyRequest(prefix=run_dir / "env"), "slurm",
                                          slurm.SlurmOptions(), job_id="41")  # fmt: skip
    run_dir.mkdir()
    verifying.save(scheduled)
    (run_dir / "started").write_text("".join(f"{1000.0 + 60 * run}\n" for run in range(runs)))
    (run_dir / "job.log").write_text(log)
    if result is not None:
        write_json(run_dir / "result.json", {"finished": 1100.0, "error": None, "document": None, **result})
    return scheduled


KILLED_BY_NODE_FAILURE = ("slurmstepd: error: *** JOB 41 ON n1 CANCELLED AT 2026-12-06T07:19:15 DUE TO NODE FAILURE, "
                          "SEE SLURMCTLD LOG FOR DETAILS ***\n")
RUN = f"{verifying.RUN_MARK}/env on n1\n"


def test_the_batch_systems_account_of_a_verify_job_wins_over_the_verdict_it_wrote(tmp_path):
    """No cluster needed: the judgement of a verify job from squeue's answer (``known``) and its files. The test
    cluster produces the node failure itself (above); here, every order in which the two can be seen."""
    from channelsmith.batch import JobState

    scheduled = _verify_run(tmp_path / "run", {"ok": True}, RUN + "verified\n")
    node_fail = JobState("41", "NODE_FAIL", "a node of the job failed (NODE_FAIL); submit it again", True, killed=True)
    shown = verifying.status(scheduled, {"41": node_fail})
    assert (shown.state, shown.reason, shown.ended) == ("NODE_FAIL", node_fail.reason, True)
    # Still running in squeue's eyes: not ended, whatever the job wrote (the collecting side asks again).
    shown = verifying.status(scheduled, {"41": JobState("41", "RUNNING", "None", False)})
    assert (shown.state, shown.ended) == ("RUNNING", False)
    assert verifying.status(scheduled, {"41": JobState("41", "COMPLETED", "None", True)}).state == "COMPLETED"
    # Forgotten by squeue: the kill line of the last run decides; one of an earlier run (a requeue) does not.
    killed = _verify_run(tmp_path / "killed", {"ok": True}, RUN + KILLED_BY_NODE_FAILURE)
    assert (verifying.status(killed, {}).state, verifying.status(killed, {}).reason) == (
        "ENDED", "a node of the job failed (NODE_FAIL); submit it again")
    rerun = _verify_run(tmp_path / "rerun", {"ok": True}, RUN + KILLED_BY_NODE_FAILURE + RUN + "verified\n", runs=2)
    shown = verifying.status(rerun, {})
    assert (shown.state, shown.requeues, shown.requeue_causes) == ("COMPLETED", 1, ("no cause in its log",))
    # Elapsed from the first start (1000) to the verdict (1100).
    assert shown.elapsed_s == 100.0


def test_a_requeued_verify_job_says_why_while_it_waits_and_once_it_runs_again(tmp_path):
    """No cluster needed: the cause of a requeue is the kill line the last run's log ends with while the job waits,
    and what the next run recorded (``requeues``) once it runs; a node that died outright wrote none."""
    from channelsmith.batch import JobState

    waiting = _verify_run(tmp_path / "waiting", {"ok": False, "running": True}, RUN + KILLED_BY_NODE_FAILURE)
    shown = verifying.status(waiting, {"41": JobState("41", "PENDING", "BeginTime", False, requeues=1)})
    assert shown.requeue_causes == ("a node of the job failed (NODE_FAIL)",)
    assert state_text(shown) == "PENDING (BeginTime; requeued once: a node of the job failed (NODE_FAIL))"
    again = _verify_run(tmp_path / "again", {"ok": False, "running": True}, RUN + KILLED_BY_NODE_FAILURE + RUN, runs=2)
    (again.run_dir / "requeues").write_text("a node of the job failed (NODE_FAIL)\n")
    shown = verifying.status(again, {"41": JobState("41", "RUNNING", "None", False, requeues=1)})
    assert state_text(shown) == "RUNNING (requeued once: a node of the job failed (NODE_FAIL))"
    silent = _verify_run(tmp_path / "silent", None, RUN)
    shown = verifying.status(silent, {"41": JobState("41", "PENDING", "BeginTime", False, requeues=2)})
    assert state_text(shown) == "PENDING (BeginTime; requeued 2 times: no cause in its log, then no cause in its log)"


def test_collecting_a_folder_without_a_scheduled_build_is_refused(tmp_path, capsys):
    assert main(["build", "--collect", str(tmp_path)]) == 2
    assert "holds no scheduled build" in capsys.readouterr().err


def test_recipes_that_need_each_other_are_refused_before_slurm_is_asked(tmp_path, capsys):
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
    code = main(["--root", str(root), "build", "ping", "pong", "--scheduler", "slurm",
                 "--channel-dir", str(tmp_path / "channel"), "--build-dir", str(tmp_path / "jobs")])  # fmt: skip
    assert code == 2
    assert "require each other's packages in a cycle (among: ping, pong)" in " ".join(capsys.readouterr().err.split())
    assert not (tmp_path / "jobs").exists()


def test_a_state_file_of_the_slurm_only_version_is_read_as_a_slurm_build(tmp_path):
    """Version 1 (before PBS) kept the job options under "slurm"; a build submitted then can still be collected."""
    from channelsmith.scheduler import load

    document = {
        "version": 1,
        "request": {"root": str(tmp_path), "recipes": ["site-env"], "overrides": {}, "channel_dir": str(tmp_path / "c"),
                    "extra_channels": [], "run_tests": True},
        "slurm": {"partition": "cpu", "account": None, "time_limit": "01:00:00", "cpus_per_task": 4, "gpus": None,
                  "extra": ["--mem=1G"]},
        "units": [],
        "published": None,
    }  # fmt: skip
    (tmp_path / "state.json").write_text(json.dumps(document))
    scheduled = load(tmp_path)
    assert scheduled.scheduler == "slurm" and scheduled.backend.LABEL == "Slurm"
    assert scheduled.options.partition == "cpu" and scheduled.options.extra == ("--mem=1G",)


def job_end(job_id: str) -> tuple[str, str] | None:
    """(JobState, ExitCode) from scontrol once the job has ended (ExitCode is STATUS:SIGNAL), else None (also
    while scontrol gets no answer: a busy slurmctld; the caller's deadline bounds the wait)."""
    shown = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True)
    fields = dict(field.split("=", 1) for field in shown.stdout.split() if "=" in field)
    if shown.returncode != 0 or fields.get("JobState") in (None, "PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED"):
        return None
    return fields["JobState"], fields["ExitCode"]


def _runs_of(script: str) -> Iterator[tuple[int, list[bytes]]]:
    """Each process running ``script``: its pid and its environment's entries."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            env = (proc / "environ").read_bytes().split(b"\0")
        except OSError:  # ended meanwhile, or not ours to read
            continue
        if any(arg.endswith(script.encode()) for arg in argv):
            yield int(proc.name), env


def _processes_of(script: str) -> str:
    """Each process running ``script``: its pid and the RANK in its environment (what a failure shows)."""
    found = [f"pid {pid} {[e.decode(errors='replace') for e in env if e.startswith(b'RANK=')] or 'no RANK'}"
             for pid, env in _runs_of(script)]  # fmt: skip
    return f"processes of {script}: {', '.join(found) or 'none'}"


def _pid_of_rank(script: str, rank: int, folder: Path) -> int | None:
    """The process running ``script`` with RANK=``rank`` in its environment in ``folder`` (a task of this test's job),
    if any: not another test run's. With this module run twice at once, one run's test SIGKILLed the other's rank 2
    (seen here: both failed, one job ended before its rank 2's step 3, the other lost no task)."""

    def runs_in_folder(pid: int) -> bool:
        try:
            return Path(os.readlink(f"/proc/{pid}/cwd")) == folder.resolve()
        except OSError:  # ended meanwhile
            return False

    return next((pid for pid, env in _runs_of(script) if f"RANK={rank}".encode() in env and runs_in_folder(pid)), None)


@pytest.mark.slurm
def test_the_ddp_job_script_example_trains_on_after_a_task_is_sigkilled(slurm_cluster, tmp_path):
    """examples/ddp_recovery.sbatch submitted as its header says, from a folder holding ddp_recovery.py: one
    task SIGKILLed mid-run, the other two finish every step (one job: 7.5 s alone, 10.4 s beside three busy loops)."""
    pytest.importorskip("torch", reason="torch is not installed (bash scripts/install-test-deps.sh installs it)")
    for name in ("ddp_recovery.sbatch", "ddp_recovery.py"):
        shutil.copy(REPO_ROOT / "examples" / name, tmp_path / name)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
           "PYTHONPATH": str(REPO_ROOT / "scripts"), "MASTER_PORT": str(_free_port_pair())}  # fmt: skip
    env = {k: v for k, v in env.items() if not k.startswith("TORCH_PEER_WATCHER")}
    # Steps enough that the kill lands mid-run (56 after it): with 8, the task's output reached the job's log
    # late enough on a busy machine that all eight steps were done before the SIGKILL (a fresh-clone CI run).
    steps, log = 60, tmp_path / "job.log"
    # --overcommit: three tasks on this machine's node, which may have fewer CPUs. Submitted as the header says;
    # the job's end is read from scontrol, not waited for with `sbatch --wait`, which looks at growing intervals
    # (here after 2 s and 10 s, then at 42 s): a job that took a little over 10 s held the test 42 s.
    submitted = subprocess.run(["sbatch", "--parsable", "--overcommit", "-o", str(log), "ddp_recovery.sbatch",
                                "--steps", str(steps), "--save", "rank{rank}.pt"], cwd=tmp_path, env=env,
                               capture_output=True, text=True, timeout=60)  # fmt: skip
    assert submitted.returncode == 0, submitted
    job_id = submitted.stdout.strip().split(";")[0]
    deadline = time.monotonic() + 240
    while not (log.exists() and "rank 2 step 3 " in log.read_text()):
        assert job_end(job_id) is None, f"the job ended before rank 2's step 3:\n{log.read_text() if log.exists() else ''}"
        assert time.monotonic() < deadline, f"rank 2 never reached step 3:\n{log.read_text() if log.exists() else ''}"
        time.sleep(0.05)
    pid = _pid_of_rank("ddp_recovery.py", 2, tmp_path)
    # Seen once with another test run's one-node Slurm on the same machine: no process found. Say what was there.
    assert pid is not None, (f"no process of rank 2 (the job: {job_end(job_id) or 'running'}; "
                             f"{_processes_of('ddp_recovery.py')}):\n{log.read_text()}")  # fmt: skip
    os.kill(pid, signal.SIGKILL)
    while (end := job_end(job_id)) is None:
        assert time.monotonic() < deadline, f"the job did not end:\n{log.read_text()}"
        time.sleep(0.1)
    text = log.read_text()
    # srun let the step run on, and then returned the killed task's status: so does the job (its header says).
    assert end == ("FAILED", f"{128 + signal.SIGKILL}:0") and "task 2: Killed" in text, f"{end}\n{text}"
    for r in (0, 1):
        assert f"rank {r} lost rank 2: on with 2 ranks" in text, text
        assert f"rank {r} step {steps - 1} world 2 " in text and f"rank {r} done" in text, text
    assert "rank 2 done" not in text
    s0, s1 = (torch_load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    assert s0.keys() == s1.keys() and all((s0[k] == s1[k]).all() for k in s0)


def torch_load(path: Path) -> dict:
    import torch

    return torch.load(path, map_location="cpu")


GUARDED = """
import os, subprocess, sys, time
read_end, write_end = os.pipe()
subprocess.Popen(["bash", sys.argv[1], "stop-at-eof"], stdin=read_end, start_new_session=True)
os.close(read_end)
print("guarded", flush=True)
time.sleep(300)
"""


def test_the_clusters_daemons_stop_when_the_process_that_started_them_is_killed(tmp_path):
    # What the module's cluster does (stop_at_exit) when its test process dies without its teardown: daemons
    # named by the cluster's pid files (stand-ins here: sleeps; no Slurm needed) end, and the folder goes.
    folder = tmp_path / "slurm"
    (folder / "munge").mkdir(parents=True)
    daemons = [subprocess.Popen(["sleep", "300"]) for _ in range(3)]
    for daemon, pid_file in zip(daemons, ("slurmd.pid", "slurmctld.pid", "munge/munged.pid"), strict=True):
        (folder / pid_file).write_text(f"{daemon.pid}\n")
    env = {**os.environ, "CHANNELSMITH_SLURM_DIR": str(folder)}
    starter = subprocess.Popen([sys.executable, "-c", GUARDED, str(REPO_ROOT / "scripts" / "slurm-local.sh")], env=env,
                               stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert starter.stdout.readline() == "guarded\n"
    starter.kill()
    starter.wait(timeout=30)
    assert [daemon.wait(timeout=30) for daemon in daemons] == [-signal.SIGTERM] * 3
    deadline = time.monotonic() + 30
    while folder.exists():
        assert time.monotonic() < deadline, "the cluster's folder was not removed"
        time.sleep(0.05)
