"""Issue 67's campaign on a GPU machine: the DDP and HSDP examples and the suite's train cases over NCCL's network
transport, with PyTorch's own settings (as next to a stock PyTorch) and with the flavor's activation defaults.

Each example run is the project's own GPU test of that example (``tests/test_examples.py``, ``-m gpu``): with fewer
GPUs than ranks every rank has its own ``NCCL_HOSTID``, so NCCL joins them through its network, as between nodes.
Each suite run is ``python -m torch_dist_check --checks peerloss --peerloss-transports net`` for one train case.
The runs of every row are interleaved and ``--parallel`` of them run at once (several fit on one GPU; a shared
GPU slows every rank, so the timings are those of a loaded GPU, not a GPU per rank).

Usage, from the repository root, on the GPU machine:
    OUT=DIR python3 benchmarks/peer_loss_net.py [--rows ROW,...] [--runs N] [--parallel K] [--budget-s S]
Rows: ddp-pytorch, ddp-flavor, hsdp-pytorch, hsdp-flavor (the examples) and train-shrink-pytorch, ...,
train-hsdp-flavor (the suite). A row's runs: ``--runs`` (default: 20 for the examples with PyTorch's settings, else 10).
A row named with ``+wake`` (``train-fresh-pytorch+wake``) runs with TORCH_PEER_WATCHER_WAKE_NCCL_PROXY=1, one with
``+nowake`` with it 0, the others with it unset, as a user runs (the watcher's default: on for the NCCL releases it was
proven on): list ``+wake`` and ``+nowake`` rows to compare them interleaved (issue 74). One named with ``+slowjudge``
runs with ``tests/slow_judging`` on PYTHONPATH: every watcher judges a verdict JUDGING_S seconds late (default 1),
so that PyTorch's watchdog aborts the communicator first (issue 74: no step may apply that aborted all-reduce).
A row named with ``@ARM`` (``train-fresh-pytorch@new``) runs from the tree that ``--arm ARM=DIR`` names, another
build of this repository (``git archive REV | tar -x -C DIR``; carried to the GPU machine in an ignored folder), the
others from this one: list a row with and without it to compare two builds interleaved in one run (a hot-path A/B).
``--arm ARM=FILE``, FILE a ``libnccl.so.2``: rows named ``@ARM`` run from this tree with that NCCL preloaded
(``LD_PRELOAD``: PyTorch's reference to ``libnccl.so.2`` resolves to it), to compare two NCCLs interleaved.
Writes $OUT/summary.txt (a line a row: runs, failures, seconds; the suite's exception and first step after the
death, median and worst) and $OUT/logs.tar.gz (every run's output and JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from ports import free_port  # noqa: E402  (a port no concurrent run's sockets can take meanwhile)
EXAMPLE_TESTS = {
    "ddp": "tests/test_examples.py::test_ddp_example_trains_on_after_a_sigkilled_rank_to_the_replay[nccl]",
    "hsdp": "tests/test_examples.py::test_hsdp_example_trains_on_alone_after_a_sigkilled_rank_and_takes_the_replica_back[nccl]",
}
SUITE_CASES = ("train-shrink", "train-fresh", "train-hsdp")
# pytorch-nccl-fault's activation defaults (recipes/pytorch-nccl-fault/activate.sh), and every name PyTorch reads
# them by: "pytorch" takes all of them out, "flavor" sets the defaults.
FLAVOR = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "0",
          "TORCH_NCCL_TRACE_BUFFER_SIZE": "0", "TORCH_NCCL_ENABLE_MONITORING": "0"}  # fmt: skip
ALL_NAMES = (*FLAVOR, "NCCL_ASYNC_ERROR_HANDLING", "TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT")
ROWS = tuple(f"{what}-{settings}" for what in (*EXAMPLE_TESTS, *SUITE_CASES) for settings in ("pytorch", "flavor"))
# The watcher wakes the proxy threads of the NCCL communicators it aborts (torch_peer_watcher.proxywake).
WAKE_ENV = "TORCH_PEER_WATCHER_WAKE_NCCL_PROXY"
SLOW_JUDGING = ROOT / "tests" / "slow_judging"
# What a row's suffix adds to its environment (PYTHONPATH's entry goes first).
SUFFIXES = {"+wake": {WAKE_ENV: "1"}, "+nowake": {WAKE_ENV: "0"},
            "+slowjudge": {"PYTHONPATH": str(SLOW_JUDGING), "TORCH_PEER_WATCHER_TEST_JUDGING_S": os.environ.get("JUDGING_S", "1")}}  # fmt: skip
# The suite's figures a row's summary gives (seconds from the death, and the proxy threads woken).
FIGURES = ("exception_s", "first_step_s", "detected_s", "judged_s", "abort_s", "proxy_wakes", "group_ready_s", "ddp_ready_s",
           "state_shared_s", "release_wakes", "join_s")


@dataclass
class Row:
    name: str
    runs: int
    tree: Path = ROOT
    nccl: Path | None = None  # a libnccl.so.2 the row's processes preload
    results: list[dict] = field(default_factory=list)

    @property
    def base(self) -> str:
        """The name without its arm and its suffix."""
        return base_name(self.name)

    @property
    def what(self) -> str:
        return self.base.rsplit("-", 1)[0]

    @property
    def settings(self) -> str:
        return self.base.rsplit("-", 1)[1]

    @property
    def extra_env(self) -> dict[str, str]:
        """What the row's suffix sets."""
        return next((v for k, v in SUFFIXES.items() if self.name.partition("@")[0].endswith(k)), {})


def base_name(name: str) -> str:
    """The name without its arm and its suffix."""
    name = name.partition("@")[0]
    return next((name.removesuffix(k) for k in SUFFIXES if name.endswith(k)), name)


def env_for(settings: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (*ALL_NAMES, WAKE_ENV)}
    env.update({k: v for k, v in (extra or {}).items() if k != "PYTHONPATH"})
    if settings == "flavor":
        env.update(FLAVOR)
    env.update(PYTHONUNBUFFERED="1", NCCL_NVLS_ENABLE="0")
    return env


def run_one(row: Row, index: int, logs: Path) -> dict:
    name = f"{row.name.replace('@', '.')}-{index:02d}"
    log = logs / f"{name}.log"
    started = time.monotonic()
    if row.what in EXAMPLE_TESTS:
        argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", "-m", "gpu",
                EXAMPLE_TESTS[row.what], f"--basetemp={tempfile.mkdtemp(prefix=name + '-')}"]  # fmt: skip
        limit = 240
    else:
        argv = [sys.executable, "-m", "torch_dist_check", "--checks", "peerloss", "--backends", "nccl",
                "--peerloss-backend", "nccl", "--peerloss-cases", row.what, "--peerloss-transports", "net",
                "--peerloss-runs", "1", "--peerloss-settings", row.settings, "--json", str(logs / f"{name}.json")]  # fmt: skip
        limit = 300
    extra = row.extra_env
    env = env_for(row.settings, extra)
    env["MASTER_PORT"] = str(free_port())  # the suite's launcher hosts its store there: one port per run at once
    paths = (extra.get("PYTHONPATH", ""), str(row.tree / "scripts"), env.get("PYTHONPATH", ""))
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    if row.nccl is not None:
        env["LD_PRELOAD"] = os.pathsep.join(p for p in (str(row.nccl), env.get("LD_PRELOAD", "")) if p)
    with log.open("w") as out:
        try:
            rc = subprocess.run(argv, cwd=row.tree, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=limit).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    result = {"run": name, "rc": rc, "seconds": round(time.monotonic() - started, 1)}
    if row.what in SUITE_CASES:
        result.update(suite_figures(logs / f"{name}.json"))
        result["ok"] = rc == 0 and str(result.get("status")).lower() == "pass"
    else:
        result["ok"] = rc == 0 and re.search(r"^1 passed\b", log.read_text(), re.MULTILINE) is not None  # a skip is no run
    row.results.append(result)
    print(f"[{time.strftime('%H:%M:%S')}] {name}: {'ok' if result['ok'] else 'FAILED'} rc={rc} {result['seconds']} s "
          f"{ {k: v for k, v in result.items() if k.endswith('_s')} }", file=sys.stderr, flush=True)  # fmt: skip
    why = result.pop("why", None)
    if not result["ok"]:
        # Why, on stderr too: the logs' archive may not come back from a GPU machine (a session lost one so).
        why = why or {"log": log.read_text(errors="replace")[-3000:]}
        print(f"  {name} failed: {json.dumps(why)[:6000]}", file=sys.stderr, flush=True)
    return result


def suite_figures(path: Path) -> dict:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        return {"status": f"no JSON: {exc}"}
    for check in doc.get("checks", []):
        runs = (check.get("details") or {}).get("runs") or []
        if runs:
            run = runs[0]
            why = {k: v for k, v in run.items() if k == "reason" or k.endswith(("_tail", "_stacks", "_markers"))}
            return {"status": check.get("status"), "reason": str(run.get("reason", ""))[:300], "why": why,
                    "join_split": run.get("join_split"), **{k: run.get(k) for k in FIGURES}}  # fmt: skip
    return {"status": "no peerloss run in the JSON"}


def line(row: Row) -> str:
    done = row.results
    failed = [r for r in done if not r["ok"]]
    parts = [f"{row.name}: {len(done)} runs, {len(failed)} failed"]
    secs = [r["seconds"] for r in done]
    if secs:
        parts.append(f"run {min(secs)}-{max(secs)} s")
    for figure in FIGURES:
        values = [float(r[figure]) for r in done if r.get(figure) is not None]
        if values:
            parts.append(f"{figure} median {statistics.median(values):.3f} worst {max(values):.3f} (n={len(values)})")
    splits = [r["join_split"] for r in done if isinstance(r.get("join_split"), dict)]
    if splits:  # the HSDP join's stages (torch_dist_check.peerloss.hsdp.join_split), median of each
        stages = dict.fromkeys(stage for split in splits for stage in split)
        parts.append("join_split medians " + " ".join(
            f"{stage}={statistics.median(float(s[stage]) for s in splits if stage in s):.3f}" for stage in stages))
    if failed:
        parts.append("failed: " + ", ".join(f"{r['run']} rc={r['rc']}" for r in failed))
    return "; ".join(parts)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default=",".join(ROWS), help="comma-separated rows (default: all)")
    p.add_argument("--runs", type=int, default=None, help="runs per row (default: 20 for examples with PyTorch's settings, else 10)")
    p.add_argument("--parallel", type=int, default=6, help="runs at once (default 6)")
    p.add_argument("--budget-s", type=float, default=540.0, help="start no run after this many seconds (default 540)")
    p.add_argument("--arm", action="append", default=[], metavar="ARM=DIR",
                   help="a tree of this repository that rows named ROW@ARM run from, or a libnccl.so.2 they preload (repeatable)")
    args = p.parse_args()
    arms: dict[str, Path] = {}
    for spec in args.arm:
        arm, _, tree = spec.partition("=")
        if not arm or not tree or not ((Path(tree) / "scripts" / "torch_dist_check").is_dir() or Path(tree).is_file()):
            p.error(f"--arm {spec!r}: expected ARM=DIR, DIR a tree of this repository (DIR/scripts/torch_dist_check), "
                    "or ARM=FILE, FILE a libnccl.so.2")  # fmt: skip
        arms[arm] = Path(tree).resolve()
    out = Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="peer-loss-net-"))
    out.mkdir(parents=True, exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="peer-loss-net-logs-"))
    names = [n for n in args.rows.split(",") if n]
    unknown = [n for n in names if base_name(n) not in ROWS]
    if unknown:
        p.error(f"unknown rows {unknown}; choose from {', '.join(ROWS)}")
    no_arm = sorted({n.partition("@")[2] for n in names if "@" in n} - set(arms))
    if no_arm:
        p.error(f"rows name arms {no_arm} that no --arm ARM=DIR gives")
    rows = []
    for n in names:
        arm = arms.get(n.partition("@")[2], ROOT)
        runs = args.runs or (20 if n.split("-")[0] in EXAMPLE_TESTS and base_name(n).endswith("pytorch") else 10)
        rows.append(Row(n, runs, ROOT, arm) if arm.is_file() else Row(n, runs, arm))
    # Interleaved: a row's k-th run comes after every row's (k-1)-th, so that a budget cut leaves every row with runs.
    queue = [(row, i) for i in range(max(r.runs for r in rows)) for row in rows if i < row.runs]
    start = time.monotonic()

    def job(item: tuple[Row, int]) -> None:
        row, index = item
        if time.monotonic() - start > args.budget_s:
            return
        run_one(row, index, logs)

    with ThreadPoolExecutor(args.parallel) as pool:
        list(pool.map(job, queue))
    header = subprocess.run([sys.executable, "-c", "import torch; print('torch', torch.__version__, 'NCCL', "
                             "torch.cuda.nccl.version(), torch.cuda.get_device_name(0), 'GPUs', torch.cuda.device_count())"],
                            capture_output=True, text=True).stdout.strip()  # fmt: skip
    trees = [f"rows without @ARM: {ROOT}", *(f"rows @{arm}: {tree}" + (" (preloaded)" if tree.is_file() else "")
                                             for arm, tree in arms.items())]  # fmt: skip
    summary = "\n".join([header, *trees, f"parallel {args.parallel}, {time.monotonic() - start:.0f} s", *map(line, rows)])
    (out / "summary.txt").write_text(summary + "\n")
    (out / "results.json").write_text(json.dumps({r.name: r.results for r in rows}, indent=1))
    with tarfile.open(out / "logs.tar.gz", "w:gz") as tar:
        tar.add(logs, arcname="logs")
    print(summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
