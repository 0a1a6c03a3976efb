"""Shared fixtures: the repository root, and a channel holding the site-env packages built for real.
Also: the default run spreads the tests over this machine's CPUs when pytest-xdist is installed.

``site_env_channel`` builds ``recipes/site-env`` once per session with channelsmith.build (the real
py-rattler-build engine, offline, about a second) into a temporary channel. It is shared: treat it as
read-only, and use ``site_env_channel_copy`` for a test that changes a channel.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import tempfile
from pathlib import Path

import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent

# A package cache of the run's own for the engines (py-rattler-build and py-rattler read
# RATTLER_CACHE_DIR). Their shared cache (~/.cache/rattler) is keyed by file name: a package rebuilt
# with other contents under the same name and build string (a recipe edited without a build-number
# bump, another checkout's build) was installed from the stale copy there, and the recipe's test then
# ran the old test files (seen here: site-env's activation test). Every package the tests install is
# built by them from local recipes, so a fresh cache costs little.
if "RATTLER_CACHE_DIR" not in os.environ:
    os.environ["RATTLER_CACHE_DIR"] = tempfile.mkdtemp(prefix="channelsmith-tests-rattler-")
    atexit.register(shutil.rmtree, os.environ["RATTLER_CACHE_DIR"], True)

# The scripts folder first on the PYTHONPATH of every process the tests start, each entry once and none
# empty (tests/suite_process.py's python_path, which the tests use where they add a folder of their own):
# processes with the same start-up variables fork from one fork server per test process.
os.environ["PYTHONPATH"] = os.pathsep.join(
    dict.fromkeys(p for p in [str(REPO_ROOT / "scripts"), *os.environ.get("PYTHONPATH", "").split(os.pathsep)] if p)
)

# One string-hash seed for every process the tests start (each as an interpreter would have it with this
# variable): harness/forkserver.py forks a process only where its seed is fixed, since a forked child shares
# its server's; where each interpreter draws its own, each is started as one (a torch import apiece).
os.environ.setdefault("PYTHONHASHSEED", "0")
# Set by the checks for their workers, by the tests for most of the processes they start, and read as an
# interpreter starts (sys.flags.unbuffered): the same for all, so that they fork from the same server.
os.environ.setdefault("PYTHONUNBUFFERED", "1")
# One OpenMP thread in every torch process the tests start, as torchrun gives each of its workers: the run
# starts a hundred such processes beside each other on 2 cores, where each one's own pool of OpenMP threads
# only cost CPU. The default run on the 2-core machine without and with it: docs/records/2026-12-06-test-run-torch-2-15-0.md,
# "A fourth round" (about 50 core-seconds less).
os.environ.setdefault("OMP_NUM_THREADS", "1")

# The site profiles recipes/site-env builds, one package each: the `site` key of the shared matrix.
SITES = tuple(yaml.safe_load((REPO_ROOT / "conda_build_config.yaml").read_text())["site"])


# Parallel by default: the suite mostly waits on the processes it starts (torch ranks, builds, batch
# jobs), so one worker per CPU and two more (pytest-xdist, which `.[test]` installs): while a worker waits
# on its processes another computes; and one for each of IDLE_UNITS, which only wait. Measured on the 2-core
# CI machine, warm cache, the whole default run before issue 22's cuts: 2 workers 215 s, 3 workers 197 s, 4 workers 186 s, its processes using about
# 355 s of CPU, so the run is bound by CPU and more workers only starve the timing tests; with the cuts
# (64 MiB CPU sweeps, fewer repeated runs), 3 workers: 168-174 s on a fresh clone (three runs in a row).
# Issue 58, with LONG_FIRST as below (CUDA wheel, warm): a fifth worker took 190.6 s against 191.0 s with
# four, the CPUs idle 10 s against 29 s and busy 371 s against 350 s: what it took from idle went to
# contention. Tests go to workers a module at
# a time: a module's fixtures are made once (the Slurm cluster of test_slurm), and the tests of a module
# never run at the same time as each other, except the tests of OWN_UNIT: long tests that need nothing
# from their module's other tests, each a unit of its own, so that it runs next to them instead of
# after them. The longest units start first (LONG_FIRST, then the rest as collected), so that none of
# them is left alone at the end of the run. Without pytest-xdist (a GPU node's bare Python), with
# `-n 0`, `-p no:xdist` or --pdb, the run stays in one process; so does a pytest that a test starts (it
# inherits PYTEST_XDIST_WORKER): a test run never starts workers from inside a worker.
DEFAULT_GLOO_RUN = "tests/test_dist_check_run.py::test_the_default_run_on_cpu_is_correct_and_sweeps_to_64_mib_with_counts_cut_to_a_short_budget"
CUDAMPI_REPEATED_RUNS = "tests/test_torch_mpi_backend.py::test_repeated_runs_all_end_cleanly_and_the_composed_path_runs_the_suite_exactly"
# Waits about 90 s for Slurm to enforce a one-minute time limit, mostly idle: beside the rest, on a cluster of its own.
SLURM_TIME_LIMIT = "tests/test_slurm.py::test_a_job_killed_for_its_time_limit_says_so_and_what_to_raise"
OWN_UNIT = (DEFAULT_GLOO_RUN, CUDAMPI_REPEATED_RUNS, SLURM_TIME_LIMIT)
# Modules that render the repository's recipes in their own process (channelsmith.recipes keeps each render
# for the process): one unit, so that each recipe is rendered once in the run, not once per worker that
# takes one of them. Alone, cold, their renders took 2.5 s (lint), 2.7 s (plan), 2.4 s (pytorch_recipes) and
# 1.1 s (conda_forge_coexistence) of CPU, 1.7 s of each for pytorch-nccl-fault (CPU wheel, 2026-11-28).
RENDERS_SHARED = "the modules that render the repository's recipes"
SHARED_RENDERS = ("tests/test_lint.py", "tests/test_plan.py", "tests/test_pytorch_recipes.py",
                  "tests/test_conda_forge_coexistence.py")  # fmt: skip
# Units that wait on a clock outside this machine's CPUs for nearly all their length: each gets a worker
# of its own beside WORKERS', which takes other work only after it (the last unit queued, a short one, is
# queued behind it at once: a worker holds back its last test until it knows the next). On the worker it
# shared, the time-limit test left two workers to compute for its 90 s; and when the Slurm module (mostly
# waiting on jobs) ran beside it, one (the CPUs 56-76 % busy for 50 s of the run). Its worker taking work
# after it, with rank 0's prefork in the same run: 238 s against 250 s warm (CUDA wheel, 2026-11-28; the
# CPUs idle 36 s in all against 45 s).
IDLE_UNITS = (SLURM_TIME_LIMIT,)
# The units that start first, in this order (the rest follow as collected): the two that mostly wait on
# Slurm first, each on a worker of its own; then the longest units that compute, then the longest that
# mostly wait on timeouts (the peer watcher's), then the rest of those over about 5 s, so that what is
# left at the end of the run is short, and units that wait run beside units that compute. Unit lengths
# on the 2-core CI machine (2026-11-28, CUDA wheel): 5-95 s.
LONG_FIRST = (
    SLURM_TIME_LIMIT,
    "tests/test_slurm.py",
    DEFAULT_GLOO_RUN,
    "tests/test_torch_mpi_backend.py",
    "tests/test_dist_check_forkserver.py",
    "tests/test_examples.py",
    CUDAMPI_REPEATED_RUNS,
    "tests/test_dist_check_run.py",
    "tests/test_bundle.py",
    *SHARED_RENDERS,
    # 45 s, a fifth of it computing: when it was not listed it ran last, alone, for the run's last 40 s.
    "tests/test_peer_watcher_strangers.py",
    "tests/test_peer_watcher.py",
    "tests/test_dist_check_nodes.py",
    "tests/test_peer_watcher_security.py",
    "tests/test_interrupts.py",
    "tests/test_peer_watcher_links.py",
    "tests/test_verify.py",
    "tests/test_test_run.py",
    "tests/test_nccl_cuda_archs.py",
    "tests/test_switchml_recipes.py",
    "tests/test_nccl_recipes.py",
    "tests/test_dist_check_train.py",
    "tests/test_progress.py",
    "tests/test_dist_check_progress.py",
    "tests/test_dist_check_plugins.py",
    "tests/test_channel.py",
    "tests/test_patches.py",
    "tests/test_peer_watcher_verdicts.py",
    "tests/test_torch_mpi_backend_2_14.py",
    "tests/test_pbs.py",
)


# A second extra worker (2026-12-06, the CUDA wheel of 2.15.0, bytecode cached as in CI, alternated runs): 186.6,
# 192.9 and 185.4 s with five against 203.3, 205.2 and 202.6 s with four, the machine busy 358 core-s either way;
# with four, four units that mostly wait on the watcher's timeouts (strangers, peer_watcher, nodes, security) ran
# at once in the middle of the run and left the CPUs idle 45 core-s in all, with five 13
# (docs/records/2026-12-06-test-run-torch-2-15-0.md, "A third round").
WORKERS = (os.cpu_count() or 1) + 2 + len(IDLE_UNITS)
# Another count of workers for the default run's scheduler (tests/test_test_run.py's nested run takes 2: one
# worker after the idle unit's is given back, where each one started costs about 0.9 s of CPU).
WORKERS_ENV = "CHANNELSMITH_TEST_WORKERS"


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    """WORKERS workers, modules and OWN_UNIT's tests as units, unless the command line chose otherwise."""
    if hasattr(config, "workerinput") or not config.pluginmanager.hasplugin("xdist"):
        return
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    if config.getoption("numprocesses", None) is not None or config.getoption("usepdb", False):
        return
    workers = os.environ.get(WORKERS_ENV) or str(WORKERS)
    if not workers.isdigit() or int(workers) < 1:
        raise pytest.UsageError(f"{WORKERS_ENV}={workers!r}: give a count of workers, 1 or more (or unset it)")
    config.option.numprocesses = int(workers)
    config.option.dist = "loadscope"
    config.stash[MODULES_AND_OWN_UNITS] = True
    # Where a worker that the per-test time limit ends leaves why (the workers inherit the environment).
    os.environ[TIMEOUT_NOTES_ENV] = tempfile.mkdtemp(prefix="channelsmith-tests-timeouts-")
    atexit.register(shutil.rmtree, os.environ[TIMEOUT_NOTES_ENV], True)


# pytest-timeout ends a stuck test by ending its process (pyproject.toml says why). In an xdist worker what
# it prints goes nowhere, and the run said only "worker 'gw0' crashed while running X". The worker writes
# the cause and every thread's stack to a file first, and the controller adds it to that test's failure.
TIMEOUT_NOTES_ENV = "CHANNELSMITH_TEST_TIMEOUT_NOTES"


def pytest_configure(config: pytest.Config) -> None:
    """In an xdist worker: a test ended by the time limit leaves its note before its worker ends."""
    notes = os.environ.get(TIMEOUT_NOTES_ENV)
    if not (hasattr(config, "workerinput") and notes and config.pluginmanager.hasplugin("timeout")):
        return
    import faulthandler

    import pytest_timeout

    end_the_worker = pytest_timeout.timeout_timer

    def note_then_end(item: pytest.Item, settings) -> None:  # noqa: ANN001 (pytest-timeout's Settings)
        with open(Path(notes) / f"{os.environ.get('PYTEST_XDIST_WORKER', 'gw')}.txt", "w") as note:
            note.write(f"it ran longer than the per-test limit of {settings.timeout:g} s "
                       "(pytest-timeout; pyproject.toml's timeout). Its threads were at:\n")  # fmt: skip
            note.flush()
            faulthandler.dump_traceback(file=note, all_threads=True)
        end_the_worker(item, settings)

    pytest_timeout.timeout_timer = note_then_end


@pytest.hookimpl(hookwrapper=True)
def pytest_collection(session: pytest.Session):  # noqa: ANN201 (a hook wrapper)
    """Collection with the cycle collector paused, then what the process holds frozen (``gc.freeze``).

    Collecting makes objects that stay to the end of the process: the tests, the rewritten test modules,
    torch (which test modules import as they are collected; 250,000 objects alone). The collector's full
    passes walked them again and again while they were made, and would all run long: each test process
    collected in 1.55 s of CPU instead of 1.9 s, and with a fresh clone's cold caches (every module's
    assertions rewritten) in 2.3 s instead of 3.6 s (PyPI's CUDA wheel, the 2-core CI machine). As the
    suite's ranks freeze their imports (scripts/torch_dist_check/harness/startup.py)."""
    from torch_dist_check.harness.startup import collector_paused

    with collector_paused():
        yield


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem: str, report: pytest.TestReport, sched) -> None:  # noqa: ANN001
    """The failure of a test whose worker ended says why, where the time limit ended it."""
    notes = os.environ.get(TIMEOUT_NOTES_ENV)
    note = Path(notes) / f"{report.node.gateway.id}.txt" if notes else None
    if note is not None and note.exists():
        report.longrepr = f"{report.longrepr}: {note.read_text()}"
        note.unlink()


MODULES_AND_OWN_UNITS = pytest.StashKey[bool]()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """The default run's scheduler (ModulesAndOwnUnits); None for a --dist the command line chose."""
    if not config.stash.get(MODULES_AND_OWN_UNITS, False):
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModulesAndOwnUnits(LoadScopeScheduling):
        """Units of work: each test of OWN_UNIT alone, the modules of SHARED_RENDERS together, every other test
        with its module; in collection order.
        A worker that takes a unit of IDLE_UNITS takes the last unit queued with it; without such a unit one worker less."""

        def _split_scope(self, nodeid: str) -> str:
            if nodeid in OWN_UNIT:
                return nodeid
            module = nodeid.split("::", 1)[0]
            return RENDERS_SHARED if module in SHARED_RENDERS else module

        def schedule(self) -> None:
            if self.collection is None and self.collection_is_completed and len(self.nodes) > 1:
                collected = next(iter(self.registered_collections.values()))
                for _ in range(len(IDLE_UNITS) - len(set(IDLE_UNITS) & set(collected))):
                    node, _work = self.assigned_work.popitem()
                    node.shutdown()
                # A selection (-k, a few files) may have fewer units than workers, and the worker of an idle
                # unit takes two: the workers no unit would reach are shut down now, as xdist does its own.
                units = {self._split_scope(nodeid) for nodeid in collected}
                idle = len(set(IDLE_UNITS) & units) if len(units) > 1 else 0
                while len(self.nodes) > max(1, len(units) - idle):
                    node, _work = self.assigned_work.popitem()
                    node.shutdown()
            super().schedule()

        def _assign_work_unit(self, node) -> None:  # noqa: ANN001 (xdist's WorkerController)
            if not self.workqueue:
                return
            scope = next(iter(self.workqueue))
            super()._assign_work_unit(node)
            if scope in IDLE_UNITS and self.workqueue:
                # A worker holds back its last test until it knows the next one: the last unit queued (a
                # short one) follows at once, and after it the worker takes work as the others do.
                last = next(reversed(self.workqueue))
                self.workqueue.move_to_end(last, last=False)
                super()._assign_work_unit(node)

        def remove_node(self, node):  # noqa: ANN001, ANN202 (xdist's signature)
            """As LoadScopeScheduling's, but the test that was running when the worker died is not run again.

            pytest-timeout ends a stuck test by ending its worker (pyproject.toml says why); xdist's own
            version puts the whole unit back, the stuck test included, so each replacement worker ran it
            again until xdist gave up (seen: one stuck test failed 13 times and held the run 80 s).
            The rest of its module runs on another worker.
            """
            workload = self.assigned_work.pop(node)
            pending = [(unit, nodeid) for unit in workload.values() for nodeid, done in unit.items() if not done]
            if not pending:
                return None
            crashed_unit, crashitem = pending[0]
            crashed_unit[crashitem] = True
            self.workqueue.update({scope: unit for scope, unit in workload.items() if not all(unit.values())})
            for other in self.assigned_work:
                self._reschedule(other)
            return crashitem

    config.option.loadscopereorder = False  # collection order, which puts LONG_FIRST first
    return ModulesAndOwnUnits(config, log)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """LONG_FIRST's tests first, in that order; the rest after them, as collected (a stable sort)."""

    def rank(item: pytest.Item) -> int:
        for index, prefix in enumerate(LONG_FIRST):
            if item.nodeid == prefix or item.nodeid.startswith((prefix + "::", prefix + "[")):
                return index
        return len(LONG_FIRST)

    items.sort(key=rank)


@pytest.fixture(scope="session", autouse=True)
def sigint_reaches_child_processes() -> None:
    """Ctrl-C tests send SIGINT to the commands they start; a command inherits SIGINT *ignored* when the
    test run itself was started as a background job of a non-interactive shell (`cmd &` in a script),
    and Python then installs no KeyboardInterrupt handler. A handler here is reset to the default in
    every child at exec, so the children see SIGINT as a user's terminal would send it."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    """The repository root (the folder holding conda_build_config.yaml and recipes/)."""
    return REPO_ROOT


@pytest.fixture(scope="session")
def site_env_build(tmp_path_factory: pytest.TempPathFactory, repo_root: Path):
    """The BuildReport of building every site-env package into a fresh temporary channel."""
    from channelsmith.build import build

    channel_dir = tmp_path_factory.mktemp("site-env-channel") / "channel"
    return build(repo_root, ["site-env"], channel_dir)


@pytest.fixture(scope="session")
def site_env_channel(site_env_build) -> Path:
    """A channel directory (indexed) holding site-env-derecho, -docker-host and -generic. Read-only."""
    return site_env_build.channel


@pytest.fixture
def site_env_channel_copy(site_env_channel: Path, tmp_path: Path) -> Path:
    """A private copy of ``site_env_channel`` that a test may change."""
    copy = tmp_path / "channel"
    shutil.copytree(site_env_channel, copy, symlinks=True)
    return copy


@pytest.fixture(scope="session")
def site_env_packages(site_env_build) -> dict[str, Path]:
    """Package name -> the .conda file published in ``site_env_channel``."""
    return {p.name: site_env_build.channel / p.subdir / p.file.name for r in site_env_build.results for p in r.packages}
