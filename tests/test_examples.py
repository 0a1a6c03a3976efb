"""The examples the docs show, run as a user runs them; and the docs' blocks equal to their files.

Each recipe under examples/ is started as its docstring says: one ``python examples/X.py`` process per
rank with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set (what srun or a shell loop gives), the
watcher's secret exported as docs/howto/survive-a-dead-rank.md's "Setting the secret" asks; rank 0 as an interpreter of
its own (where no other test starts the example so), the others forked with the same file and arguments
from one that imported torch (start_rank).
One rank is SIGKILLed from outside once it has printed a given step, and the survivors are judged by
what they print, their exit status and the parameters they save: equal to a one-process replay of
full-batch training (every step's global batch is the same at any world size, so the applied steps are
the replay's steps whatever rank died and whenever). On CPU the examples run on gloo (CUDA hidden); under the ``gpu`` marker on NCCL.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import IO

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch_peer_watcher")

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
sys.path.insert(0, str(EXAMPLES))
import check_docs  # noqa: E402
from ports import free_port  # noqa: E402
from torch_dist_check.harness import forkserver  # noqa: E402

STEPS = 20
KILL_AT = 4  # the victim is killed once it has printed this step: the survivors are mid-run


def load(name: str) -> ModuleType:
    """An example as a module (its main() does not run), for its model and data."""
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# Examples whose start as interpreters of their own another test shows: there rank 0 forks as well.
STARTED_FRESH_ELSEWHERE = {
    "ddp_recovery": "tests/test_slurm.py submits examples/ddp_recovery.sbatch: srun starts its ranks",
    "peer_watcher_minimal": "test_peer_watcher_minimal_example_ends_cleanly_when_no_rank_dies_with_the_secret_in_a_file "
                            "starts both ranks from examples/peer_watcher_secret_file.sh",
}  # fmt: skip


def start_rank(index: int, argv: list[str], cwd: Path, env: dict[str, str], out: IO[str]) -> subprocess.Popen[str] | forkserver.ForkedProcess:
    """Rank 0 as a user's shell starts it: an interpreter of its own, which imports torch (unless another
    test starts the example so: STARTED_FRESH_ELSEWHERE). The other ranks fork from a fork server of this
    test process that imported torch once (tests/suite_process.py), with the example's own file, arguments,
    environment, directory and output: they need no second proof of how the example starts, and each would
    cost a torch import (1.1-1.5 s of CPU with PyPI's CUDA build on the 2-core CI machine).
    ``TORCH_DIST_CHECK_FORK=0`` starts them all as rank 0 is."""
    if index == 0 and Path(argv[1]).stem not in STARTED_FRESH_ELSEWHERE:
        return subprocess.Popen(argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
    return forkserver.start(argv, env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, text=True)


def stalled(procs: dict, logs: dict[int, Path], what: str) -> str:
    """The message of a run that stalled: ``what``, then every rank's last lines, after a SIGABRT to each live
    rank (with PYTHONFAULTHANDLER set, as on GPUs, each prints every thread's Python stack first)."""
    for p in procs.values():
        if p.poll() is None:
            p.send_signal(signal.SIGABRT)
    for p in procs.values():
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
    tails = "\n".join(f"--- rank {r} ---\n" + "\n".join(log.read_text(errors="replace").splitlines()[-80:]) for r, log in logs.items())
    return f"{what}\n{tails}"


def run_ranks(example: str, nranks: int, victim: int, kill_after: str, tmp: Path, gpu: bool = False,
              args: tuple[str, ...] = (), extra_env: dict[str, str] | None = None, timeout_s: float = 120.0,
              replace_when: tuple[int, str] | None = None) -> tuple[dict[int, int], dict[int, str], float]:  # fmt: skip
    """Start ``nranks`` ranks of ``examples/<example>``; SIGKILL ``victim`` (-1: none) once its output has a
    line matching ``kill_after``; with ``replace_when`` (rank, pattern), once that rank's output matches,
    start the victim's replacement (its RANK, ``--replacement``), reported as rank ``nranks``. Returns each
    rank's exit status, its output, and the seconds from the kill to the last rank's exit."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCH_PEER_WATCHER", "MASTER_", "RANK"))}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(nranks),
               TORCH_PEER_WATCHER_SECRET=os.urandom(32).hex(), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")  # fmt: skip
    if not gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""  # the examples take NCCL wherever CUDA is visible
    else:
        # A GPU run that stalls shows where: the SIGABRT of stalled() makes each rank print every thread's stack.
        env["PYTHONFAULTHANDLER"] = "1"
    env.update(extra_env or {})
    logs = {r: tmp / f"rank{r}.log" for r in range(nranks)}
    procs = {}
    devices = torch.cuda.device_count() if gpu else nranks
    for r in range(nranks):
        rank_env = {**env, "RANK": str(r), "LOCAL_RANK": str(r % devices)}
        if devices < nranks:
            # Ranks share a GPU: one NCCL host id per process, so NCCL joins them through its network
            # (docs/reference/nccl.md), as the suite's [placement host-ids] does.
            rank_env["NCCL_HOSTID"] = f"examples-rank{r}"
        with logs[r].open("w") as out:
            procs[r] = start_rank(r, [sys.executable, str(EXAMPLES / f"{example}.py"), *args], tmp, rank_env, out)
    deadline = time.monotonic() + timeout_s
    killed_at = time.monotonic()
    try:
        if victim >= 0:
            while not re.search(kill_after, logs[victim].read_text(), re.MULTILINE):
                assert procs[victim].poll() is None, f"rank {victim} ended first:\n{logs[victim].read_text()}"
                assert time.monotonic() < deadline, stalled(procs, logs, f"rank {victim} never printed {kill_after!r}")
                time.sleep(0.02)
            procs[victim].send_signal(signal.SIGKILL)
            killed_at = time.monotonic()
        if replace_when is not None:
            watched, pattern = replace_when
            while not re.search(pattern, logs[watched].read_text(), re.MULTILINE):
                assert procs[watched].poll() is None, f"rank {watched} ended first:\n{logs[watched].read_text()}"
                assert time.monotonic() < deadline, stalled(procs, logs, f"rank {watched} never printed {pattern!r}")
                time.sleep(0.02)
            logs[nranks] = tmp / "replacement.log"
            with logs[nranks].open("w") as out:
                procs[nranks] = start_rank(nranks, [sys.executable, str(EXAMPLES / f"{example}.py"), *args, "--replacement"], tmp,
                                           {**env, "RANK": str(victim), "LOCAL_RANK": str(victim % devices),
                                            **({"NCCL_HOSTID": "examples-replacement"} if devices < nranks else {})},
                                           out)  # fmt: skip
        codes = {r: p.wait(timeout=max(1.0, deadline - time.monotonic())) for r, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    return codes, {r: logs[r].read_text() for r in logs}, time.monotonic() - killed_at


def replay(module: ModuleType, steps: int, width: int) -> dict[str, object]:
    """Full-batch training in one process, as the examples' ranks do it together: their final parameters."""
    torch.manual_seed(0)
    model = module.make_model(width)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    for step in range(steps):
        x, y = module.global_batch(step, width)
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return model.state_dict()


def assert_replayed(saved: Path, expected: dict[str, object]) -> None:
    # The ranks saved from their devices (cuda:N on NCCL); the replay ran on the CPU.
    state = torch.load(saved, map_location="cpu")
    assert state.keys() == expected.keys()
    for name, value in expected.items():
        # The same sums in another order (across ranks): float32 rounding, not a different step.
        torch.testing.assert_close(state[name], value, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


def steps_done(out: str, rank: int) -> list[int]:
    return [int(s) for s in re.findall(rf"^rank {rank} step (\d+) ", out, re.MULTILINE)]


def needs_a_gpu() -> None:
    """Skip without CUDA; with fewer GPUs than ranks the ranks share them (run_ranks)."""
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        pytest.skip("needs a CUDA GPU for NCCL (torch sees none)")


@pytest.mark.parametrize("gpu", [False, pytest.param(True, marks=pytest.mark.gpu)], ids=["gloo", "nccl"])
def test_ddp_example_trains_on_after_a_sigkilled_rank_to_the_replay(gpu: bool, tmp_path: Path) -> None:
    if gpu:
        needs_a_gpu()
    codes, out, _ = run_ranks("ddp_recovery", 3, 2, rf"^rank 2 step {KILL_AT} ", tmp_path, gpu,
                              ("--steps", str(STEPS), "--save", "rank{rank}.pt"))  # fmt: skip
    assert codes[2] == -signal.SIGKILL
    for r in (0, 1):
        assert codes[r] == 0, out[r]
        assert f"rank {r} lost rank 2: on with 2 ranks" in out[r]
        assert steps_done(out[r], r)[-1] == STEPS - 1
        assert re.search(rf"^rank {r} step {STEPS - 1} world 2 ", out[r], re.MULTILINE), out[r]
    # The survivors hold one model: bitwise equal, and equal to full-batch training.
    s0, s1 = (torch.load(tmp_path / f"rank{r}.pt", map_location="cpu") for r in (0, 1))
    assert all(torch.equal(s0[k], s1[k].to(s0[k].device)) for k in s0)
    assert_replayed(tmp_path / "rank0.pt", replay(load("ddp_recovery"), STEPS, 256))


@pytest.mark.parametrize("gpu", [False, pytest.param(True, marks=pytest.mark.gpu)], ids=["gloo", "nccl"])
def test_hsdp_example_trains_on_alone_after_a_sigkilled_rank_and_takes_the_replica_back(gpu: bool, tmp_path: Path) -> None:
    if gpu:
        needs_a_gpu()
    if tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) < (2, 7):
        # Seen on 2.6.0 (CI's oldest release, gloo): FSDP2's fully_shard raised "'Stream' object has no attribute
        # 'record_event'" in the first forward on CPU; 2.13.0 and 2.15.0 run it.
        pytest.skip(f"FSDP2 (fully_shard) does not train on CPU in PyTorch {torch.__version__}: the HSDP example needs a later release")
    rejoin_at = 10
    codes, out, _ = run_ranks("hsdp_recovery", 4, 3, rf"^rank 3 step {KILL_AT} ", tmp_path, gpu,
                              ("--steps", str(STEPS), "--rejoin-at", str(rejoin_at), "--save", "rank{rank}.pt"),
                              replace_when=(2, r"^rank 2: replica lost \(rank 3\), waiting for a replacement$"))  # fmt: skip
    assert codes[3] == -signal.SIGKILL
    for r in (0, 1, 2, 4):
        assert codes[r] == 0, out[r]
    # Replica A trained on alone (the issue-54 recipe stopped here: every step alone raised again) ...
    for r in (0, 1):
        assert f"rank {r} lost rank 3: this replica on alone" in out[r]
        alone = [int(s) for s in re.findall(rf"^rank {r} step (\d+) alone True ", out[r], re.MULTILINE)]
        assert alone and alone[-1] == rejoin_at, out[r]
        assert f"rank {r}: the lost replica is back at step {rejoin_at + 1}, four ranks again" in out[r]
    # ... replica B came back, its partner and the replacement at the step replica A had reached ...
    assert f"rank 2: back in at step {rejoin_at + 1}, four ranks again" in out[2]
    assert f"rank 3: replacement in at step {rejoin_at + 1}, four ranks again" in out[4]
    # ... and all four trained together to the end, holding one model: full-batch training's.
    for r in (0, 1, 2, 4):
        assert re.search(rf"^rank {r if r < 4 else 3} step {STEPS - 1} alone False ", out[r], re.MULTILINE), out[r]
    saved = [torch.load(tmp_path / f"rank{r}.pt", map_location="cpu") for r in range(4)]
    assert all(torch.equal(saved[0][k], other[k]) for other in saved[1:] for k in saved[0])
    assert_replayed(tmp_path / "rank0.pt", replay(load("hsdp_recovery"), STEPS, 256))


@pytest.mark.parametrize("gpu", [False, pytest.param(True, marks=pytest.mark.gpu)], ids=["gloo", "nccl"])
def test_peer_watcher_minimal_example_raises_peer_lost_error_within_seconds(gpu: bool, tmp_path: Path) -> None:
    if gpu:
        needs_a_gpu()
    codes, out, after_kill_s = run_ranks("peer_watcher_minimal", 2, 1, r"^rank 1 all_reduce 100$", tmp_path, gpu)
    assert codes[1] == -signal.SIGKILL
    assert codes[0] == 3, out[0]
    assert "rank 0 PeerLostError: peer rank 1 lost: rank 1 closed its connection" in out[0]
    assert after_kill_s < 10.0  # gloo's own timeout is 30 minutes: the watcher ended the wait


@pytest.mark.parametrize("gpu", [False, pytest.param(True, marks=pytest.mark.gpu)], ids=["gloo", "nccl"])
def test_peer_watcher_shrink_example_trains_on_in_the_shrunk_group_or_says_why_not(gpu: bool, tmp_path: Path) -> None:
    """examples/peer_watcher_shrink.py, the two recovery fragments of docs/howto/survive-a-dead-rank.md and docs/explain/peer-watcher.md: rank 2 of 3
    SIGKILLed. On NCCL the survivors finish in a group of 2; gloo cannot shrink (torch 2.13), so there the
    loss records the shrink's error, the group is aborted and the survivors stop (exit 4)."""
    if gpu:
        needs_a_gpu()
    codes, out, _ = run_ranks("peer_watcher_shrink", 3, 2, r"^rank 2 step 100 ", tmp_path, gpu,
                              extra_env={"STEPS": "2000"})  # fmt: skip
    assert codes[2] == -signal.SIGKILL
    for r in (0, 1):
        if gpu:
            assert codes[r] == 0, out[r]
            assert f"rank {r} lost [2]: on in a group of 2" in out[r] and f"rank {r} done at step 2000" in out[r]
        else:
            assert codes[r] == 4, out[r]
            assert f"rank {r} lost [2]: no shrink, the group is aborted: (" in out[r] and "shrink" in out[r]


def test_peer_watcher_minimal_example_ends_cleanly_when_no_rank_dies_with_the_secret_in_a_file(tmp_path: Path) -> None:
    """examples/peer_watcher_secret_file.sh (docs/howto/survive-a-dead-rank.md, "Setting the secret"): the secret
    written to a file in $HOME readable by its owner only, the two ranks started with only its name."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCH_PEER_WATCHER", "MASTER_", "RANK"))}
    env.update(HOME=str(tmp_path), MASTER_PORT=str(free_port()), ALL_REDUCES="50", CUDA_VISIBLE_DEVICES="",
               OMP_NUM_THREADS="1", PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}")  # fmt: skip
    done = subprocess.run(["bash", str(EXAMPLES / "peer_watcher_secret_file.sh")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    for r in (0, 1):
        assert f"rank {r} done" in done.stdout and "PeerLoss" not in done.stdout
    secret = tmp_path / ".torch_peer_watcher_secret"
    assert secret.stat().st_mode & 0o777 == 0o600 and len(secret.read_text().strip()) == 64


def test_every_example_block_in_the_docs_equals_its_file() -> None:
    all_blocks = [b for path in check_docs.docs() for b in check_docs.blocks(path)]
    examples = [b for b in all_blocks if b.kind in ("example", "excerpt")]
    assert {b.example for b in examples} >= {"examples/ddp_recovery.py", "examples/hsdp_recovery.py",
                                              "examples/peer_watcher_minimal.py", "examples/ddp_recovery.sbatch",
                                              ".ci/run"}  # fmt: skip
    assert [check_docs.drift(b) for b in examples] == [None] * len(examples)


def test_an_excerpt_is_found_line_by_line_in_order_in_its_file_and_reported_where_it_is_not(tmp_path: Path) -> None:
    doc = tmp_path / "page.md"
    doc.write_text("<!-- excerpt: examples/ddp_recovery.sbatch -->\n```\n"
                   "  TORCH_PEER_WATCHER_SECRET=$(python3 -c 'import secrets; print(secrets.token_hex(32))')\n"
                   "  export TORCH_PEER_WATCHER_SECRET\n```\n\n"
                   "<!-- excerpt: examples/ddp_recovery.sbatch -->\n```\n"
                   "export TORCH_PEER_WATCHER_SECRET\nset -euo pipefail\n```\n\n"
                   "<!-- excerpt: .ci/run -->\n```\nbash scripts/install-test-deps.sh && python3 -m pytest\n```\n\n"
                   "<!-- excerpt: .ci/run -->\n```\npython3 -m pytest && bash scripts/install-test-deps.sh\n```\n")  # fmt: skip
    found = check_docs.blocks(doc)
    assert [b.kind for b in found] == ["excerpt"] * 4
    # Indented as a whole (a list item's block): still its lines.
    assert check_docs.drift(found[0]) is None
    # Every line is in the file, but not in this order.
    assert check_docs.drift(found[1]) == f"{doc}:8: 'set -euo pipefail' is not a line of examples/ddp_recovery.sbatch (in this order)"
    # Commands joined with && are the file's lines, one after the other.
    assert check_docs.drift(found[2]) is None
    assert check_docs.drift(found[3]) == f"{doc}:19: 'bash scripts/install-test-deps.sh' is not a line of .ci/run (in this order)"


def test_the_count_says_how_many_examples_run_only_where_what_they_need_is_there() -> None:
    assert check_docs.needs("examples/pytorch_cray_mpich.sh") == ["conda-forge", "rattler-build", "conda", "cray-mpich"]
    assert check_docs.needs("examples/ddp_recovery.py") == []
    all_blocks = [b for path in check_docs.docs() for b in check_docs.blocks(path)]
    counts = check_docs.count(all_blocks)
    assert counts.needing["cray-mpich"] == 1 and counts.needing_any >= 5
    assert counts.run_anywhere + counts.needing_any == counts.run_by_tests


def test_a_block_that_drifts_from_its_file_or_names_none_is_reported(tmp_path: Path) -> None:
    doc = tmp_path / "page.md"
    doc.write_text("<!-- example: examples/ddp_recovery.py -->\n```python\nprint('an older recipe')\n```\n\n"
                   "<!-- example: examples/gone.py -->\n```python\n```\n\n```text\nsome output\n```\n")  # fmt: skip
    found = check_docs.blocks(doc)
    assert [b.kind for b in found] == ["example", "example", "output"]
    assert check_docs.drift(found[0]) == f"{doc}:2: the block differs from examples/ddp_recovery.py"
    assert check_docs.drift(found[1]) == f"{doc}:7: examples/gone.py does not exist"


def test_update_rewrites_a_drifted_example_block_from_its_file_and_nothing_else(tmp_path: Path) -> None:
    doc = tmp_path / "page.md"
    before, after = "Before.\n<!-- figure -->\n```\nkeep me\n```\n", "\nAfter.\n"
    doc.write_text(f"{before}<!-- example: examples/airgap_pack.sh -->\n```bash\nan older script\n```\n{after}")
    assert check_docs.update(doc) == 1
    assert doc.read_text() == (f"{before}<!-- example: examples/airgap_pack.sh -->\n```bash\n"
                               f"{(EXAMPLES / 'airgap_pack.sh').read_text()}```\n{after}")  # fmt: skip
    assert [check_docs.drift(b) for b in check_docs.blocks(doc) if b.kind == "example"] == [None]
    assert check_docs.update(doc) == 0


def test_contributing_states_the_counts_the_docs_check_computes() -> None:
    counts = check_docs.count([b for path in check_docs.docs() for b in check_docs.blocks(path)])
    print(check_docs.status_line(counts))
    for b in counts.unmarked:
        print(f"unmarked: {b.doc}:{b.line}")
    contributing = " ".join((ROOT / "CONTRIBUTING.md").read_text().split())
    assert check_docs.status_line(counts) in contributing


def test_a_figure_or_its_output_outside_the_records_is_reported_and_fails_the_check(tmp_path: Path, monkeypatch,
                                                                                      capsys) -> None:  # fmt: skip
    doc = tmp_path / "guide.md"
    doc.write_text("<!-- figure -->\n```\npython3 bench.py\n```\n<!-- output -->\n```\n1.5 GB/s\n```\n"
                   "```text\na file tree\n```\n")  # fmt: skip
    found = check_docs.blocks(doc)
    assert [b.kind for b in found] == ["figure", "output", "output"]
    assert check_docs.misplaced(found[0]) == f"{doc}:2: a figure's command outside docs/records/ (move it into a record there and link to it)"
    assert check_docs.misplaced(found[1]) == f"{doc}:6: a figure's output outside docs/records/ (move it into a record there and link to it)"
    assert check_docs.misplaced(found[2]) is None  # plain output (info string text) is not a figure's
    in_a_record = check_docs.Block("docs/records/2026-12-06-x.md", 2, "", check_docs.FIGURE, "python3 bench.py\n")
    assert check_docs.misplaced(in_a_record) is None
    monkeypatch.setattr(check_docs, "docs", lambda: [doc])
    assert check_docs.main([]) == 1
    shown = capsys.readouterr().out
    assert f"misplaced: {doc}:2: a figure's command" in shown and f"misplaced: {doc}:6: a figure's output" in shown
    doc.write_text("```text\na file tree\n```\n")
    assert check_docs.main([]) == 0


def test_a_relative_link_to_a_missing_file_or_heading_is_reported_and_fails_the_check(tmp_path: Path, monkeypatch,
                                                                                        capsys) -> None:  # fmt: skip
    (tmp_path / "howto").mkdir()
    target = tmp_path / "howto" / "verify.md"
    target.write_text("# Verify\n## Acceptance through the scheduler: `channelsmith verify --scheduler`\n"
                      "## Several nodes on one host (`--nodes N`)\n```\n## not a heading\n```\n")  # fmt: skip
    assert check_docs.anchors(target) == {"verify", "acceptance-through-the-scheduler-channelsmith-verify---scheduler",
                                          "several-nodes-on-one-host---nodes-n"}  # fmt: skip
    page = tmp_path / "README.md"
    page.write_text("[ok](howto/verify.md) [ok](howto/verify.md#several-nodes-on-one-host---nodes-n) [url](https://x.org/a)\n"
                    "[gone](howto/deploy.md) [no heading](howto/verify.md#not-a-heading) `[code](nowhere.md)`\n"
                    "```\n[in a block](nowhere.md)\n```\n")  # fmt: skip
    assert check_docs.dead_links(page) == [f"{page}:2: howto/deploy.md: no such file",
                                           f"{page}:2: howto/verify.md#not-a-heading: no such heading"]  # fmt: skip
    monkeypatch.setattr(check_docs, "docs", lambda: [page])
    assert check_docs.main([]) == 1
    assert f"dead link: {page}:2: howto/deploy.md: no such file" in capsys.readouterr().out


def test_no_figure_command_or_output_in_the_docs_outside_the_records() -> None:
    all_blocks = [b for path in check_docs.docs() for b in check_docs.blocks(path)]
    assert sum(1 for b in all_blocks if b.kind == "figure") > 0  # the records' own are found
    assert [p for b in all_blocks for p in [check_docs.misplaced(b)] if p] == []


# The references generated from the code (written by their own generator, checked by their own tests).
GENERATED = ("docs/reference/cli.md", "docs/reference/packages.md")


def test_every_relative_link_in_the_docs_leads_to_a_file_and_heading_that_exist() -> None:
    dead = [p for path in check_docs.docs() for p in check_docs.dead_links(path)]
    absent = [name for name in GENERATED if not (ROOT / name).is_file()]
    waiting = [d for d in dead if any(f"{Path(name).name}: no such file" in d for name in absent)]
    assert [d for d in dead if d not in waiting] == []
    if waiting:
        pytest.skip(f"{', '.join(absent)} not generated in this checkout; the links to them: {len(waiting)}")


def test_every_docs_page_the_code_names_exists() -> None:
    """A pointer such as `(docs/howto/verify.md, 'Acceptance through the scheduler')` in a message, a comment or an
    example names a page that is there (this module's own made-up pages aside)."""
    named = re.compile(r"docs/[\w./-]+?\.md")
    where = [*(ROOT / "scripts").rglob("*"), *(ROOT / "tests").glob("*.py"), *EXAMPLES.iterdir(),
             *(ROOT / "recipes").rglob("*"), *(ROOT / "benchmarks").rglob("*"), *(ROOT / ".ci").iterdir()]  # fmt: skip
    missing = set()
    for path in where:
        if not path.is_file() or path.suffix in (".pyc", ".png", ".gz", ".patch") or path.name == "test_examples.py":
            continue
        if any(part.endswith(".egg-info") or part == "__pycache__" for part in path.relative_to(ROOT).parts):
            continue  # made by pip install -e and by Python, not written by us
        for name in named.findall(path.read_text(errors="replace")):
            if not (ROOT / name).is_file() and name not in GENERATED:
                missing.add(f"{path.relative_to(ROOT)}: {name}")
    assert sorted(missing) == []


def test_the_records_index_lists_every_record_and_the_readme_stays_short() -> None:
    index = (ROOT / "docs" / "records" / "README.md").read_text()
    records = sorted(p.name for p in (ROOT / "docs" / "records").glob("*.md") if p.name != "README.md")
    assert records and [name for name in records if f"]({name})" not in index] == []
    assert len((ROOT / "README.md").read_text().splitlines()) <= 150


@pytest.mark.heavy
@pytest.mark.timeout(1500)
def test_the_quick_start_example_builds_and_deploys_in_a_fresh_checkout(tmp_path: Path) -> None:
    """examples/quick_start.sh, the README's main job, run as its line says in a copy of this checkout with
    no .venv, under `env -i` with only PATH, HOME and LANG (as CI runs it). Heavy: it makes a virtual
    environment and installs channelsmith's dependencies into it (minutes, PyPI or pip's cache)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")  # fmt: skip
    checkout = tmp_path / "checkout"
    for name in filter(None, listed):
        if (ROOT / name).is_file():
            (checkout / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, checkout / name)
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": os.environ.get("HOME", str(tmp_path)), "LANG": "C.UTF-8"}
    proc = subprocess.run(["bash", "examples/quick_start.sh"], cwd=checkout, env=env, capture_output=True, text=True,
                          timeout=1400)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (checkout / ".venv" / "bin" / "channelsmith").is_file()
    assert any(p.name.startswith("site-env-derecho-") for p in (checkout / "channel").rglob("*.conda"))
    assert (checkout / "env" / "channelsmith.lock").is_file()
    assert (checkout / "env" / "conda-meta").is_dir()


@pytest.mark.heavy
@pytest.mark.timeout(1500)
def test_the_tutorial_goes_from_a_fresh_checkout_to_a_verified_pytorch(tmp_path: Path) -> None:
    """examples/tutorial.sh (docs/tutorial.md), run as its header says in a copy of this checkout with no .venv,
    under `env -i` with PATH, HOME and LANG, and TORCH_ENV naming the virtual environment the tests run in (its
    python imports torch, so the tutorial downloads no PyTorch). Heavy: it makes a virtual environment and
    installs channelsmith's dependencies into it (minutes, PyPI or pip's cache)."""
    if not (Path(sys.prefix) / "pyvenv.cfg").is_file():
        pytest.skip("the tests do not run in a virtual environment that could stand for the tutorial's torch-env")
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")  # fmt: skip
    checkout = tmp_path / "checkout"
    for name in filter(None, listed):
        if (ROOT / name).is_file():
            (checkout / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, checkout / name)
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": os.environ.get("HOME", str(tmp_path)), "LANG": "C.UTF-8",
           "TORCH_ENV": sys.prefix}  # fmt: skip
    proc = subprocess.run(["bash", "examples/tutorial.sh"], cwd=checkout, env=env, capture_output=True, text=True,
                          timeout=1400)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "site-env: builds offline" in proc.stdout
    assert any(p.name.startswith("site-env-generic-") for p in (checkout / "channel").rglob("*.conda"))
    assert (checkout / "env" / "channelsmith.lock").is_file()
    assert "correctness/gloo/cpu" in proc.stdout and " 0 fail," in proc.stdout
    assert not (checkout / "torch-env").exists()


def _namespaces_here() -> bool:
    from torch_dist_check.nodes import namespaces

    return namespaces.unavailable_reason() is None


def _reaches(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=5).close()
        return True
    except OSError:
        return False


@pytest.mark.heavy
@pytest.mark.timeout(900)
def test_the_acceptance_example_runs_the_suite_on_two_local_ranks(tmp_path: Path) -> None:
    """examples/acceptance_local.sh (docs/howto/verify.md's first block): every check of the suite, then CI's quick
    gloo run, with this python first on PATH. Heavy: the full run measures bandwidth to 1 GiB (20-30 s here)."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONPATH": str(ROOT / "scripts"), "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}  # fmt: skip
    done = subprocess.run(["bash", str(EXAMPLES / "acceptance_local.sh")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=850)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count("correctness/gloo/cpu        PASS") == 2, done.stdout[-3000:]


def missing(needs: list[str]) -> list[str]:
    """Which of an example's needs (check_docs.NEEDS words) this machine lacks, in the words a skip says."""
    from channelsmith.preflight import unreachable_channels

    probes = {
        "conda-forge": lambda: not unreachable_channels(["conda-forge"]),
        "rattler-build": lambda: shutil.which("rattler-build") is not None,
        "conda": lambda: shutil.which("conda") is not None,
        "pixi": lambda: shutil.which("pixi") is not None,
        "gpus": lambda: torch.cuda.is_available(),
        "cray-mpich": lambda: Path("/opt/cray/pe/mpich").is_dir(),
        "mpiexec": lambda: shutil.which("mpiexec") is not None and importlib.util.find_spec("torch_mpi_backend") is not None,
        "namespaces": lambda: _namespaces_here(),
        "switchml": lambda: importlib.util.find_spec("torch_switchml") is not None,
        "github": lambda: _reaches("github.com", 443),
    }
    return [check_docs.NEEDS[word] for word in needs if not probes[word]()]


# The examples that need what a machine may lack, with the arguments and environment a user gives them; they
# run from the repository root, or where CWD says ("tmp": an empty folder; "copy": a copy of this checkout,
# for one that writes into the repository).
NEEDY = {
    "examples/build_without_channelsmith.sh": (["rattler-build"], {}),
    "examples/cudampi_acceptance_gpus.sh": ([], {}),
    "examples/acceptance_nodes.sh": ([], {}),
    "examples/verify_ncclft.sh": ([], {}),
    "examples/switchml_init.py": ([], {}),
    "examples/cuda_arch_channel.sh": ([], {"CHANNEL": "{tmp}/channel", "ARCH_CHANNEL": "{tmp}/cuda-arch", "PREFIX": "{tmp}/env"}),
    "examples/patches_port.sh": ([], {"SRC": "{tmp}/pytorch-v2.7.1"}),
    "examples/openpbs_source.sh": ([], {"CHANNELSMITH_CACHE": "{tmp}/cache"}),
    "examples/pytorch_cray_mpich.sh": ([], {"CHANNEL": "{tmp}/channel"}),
    "examples/pytorch_nccl_fault.sh": ([], {"CHANNEL": "{tmp}/channel"}),
    "examples/pytorch_switchml.sh": ([], {}),
    "examples/torch_mpi_backend_build.sh": ([], {}),
}
CWD = {"examples/patches_port.sh": "copy", "examples/openpbs_source.sh": "tmp", "examples/acceptance_nodes.sh": "tmp",
       "examples/verify_ncclft.sh": "tmp", "examples/cudampi_acceptance_gpus.sh": "tmp"}  # fmt: skip


# The examples that need something and are not run with bash: the test of each.
NEEDY_OWN_TEST = {
    "examples/condarc.yaml": "test_examples.py::test_the_condarc_example_gives_conda_strict_priority_with_the_site_channel_first",
    "examples/cudampi_acceptance.sh": "test_torch_mpi_backend.py::test_torch_dist_check_cli_is_exact_over_cudampi_on_two_ranks",
    "examples/torch_mpi_backend_init.py": "test_torch_mpi_backend.py::test_the_docs_init_example_all_reduces_over_cudampi_under_mpiexec",
    # against the test's channel of records the recipes render, instead of conda-forge
    "examples/two_gpu_generations.sh": "test_gpu_target.py::test_one_environment_for_two_gpu_generations_is_accepted_on_both",
}


def test_every_example_that_needs_something_has_a_test_here() -> None:
    needy = {f"examples/{p.name}" for p in EXAMPLES.iterdir() if p.is_file() and check_docs.needs(f"examples/{p.name}")}
    assert needy == set(NEEDY) | set(NEEDY_OWN_TEST)
    for example, test in NEEDY_OWN_TEST.items():
        module, name = test.split("::")
        assert f"def {name}(" in (ROOT / "tests" / module).read_text() and example in (ROOT / "tests" / module).read_text()


def test_the_condarc_example_says_strict_priority_with_the_site_channel_first() -> None:
    """examples/condarc.yaml as YAML (here, without conda): the settings docs/howto/deploy.md names."""
    yaml = pytest.importorskip("yaml")
    rc = yaml.safe_load((EXAMPLES / "condarc.yaml").read_text())
    assert rc["channel_priority"] == "strict" and rc["channels"] == ["internal", "conda-forge"]
    assert rc["custom_channels"] == {"internal": "file:///srv/conda"}  # conda appends the name: /srv/conda/internal


def test_the_condarc_example_gives_conda_strict_priority_with_the_site_channel_first() -> None:
    """examples/condarc.yaml read by conda itself (CONDARC), where conda is installed."""
    lacking = missing(check_docs.needs("examples/condarc.yaml"))
    if lacking:
        pytest.skip(f"examples/condarc.yaml needs {', '.join(lacking)}: not on this machine")
    shown = subprocess.run(["conda", "config", "--show", "channel_priority", "channels", "custom_channels", "--json"],
                           env={**os.environ, "CONDARC": str(EXAMPLES / "condarc.yaml")}, capture_output=True,
                           text=True, check=True).stdout  # fmt: skip
    config = json.loads(shown)
    assert config["channel_priority"] == "strict" and config["channels"][0] == "internal"
    assert config["custom_channels"]["internal"].rstrip("/") == "file:///srv/conda"


@pytest.mark.heavy
@pytest.mark.network
@pytest.mark.timeout(6 * 3600)
@pytest.mark.parametrize("name", sorted(NEEDY))
def test_an_example_that_needs_conda_forge_runs_where_it_has_what_it_needs(name: str, tmp_path: Path) -> None:
    """Each example with a `# needs:` line, run from the repository root as its header says; skipped with
    what is missing where something is (here: conda-forge and GitHub, the builders, Cray MPICH). Builds of
    PyTorch take hours: heavy."""
    lacking = missing(check_docs.needs(name))
    if lacking:
        pytest.skip(f"{name} needs {', '.join(lacking)}: not on this machine")
    args, extra = NEEDY[name]
    env = {**os.environ, **{k: v.format(tmp=tmp_path) for k, v in extra.items()}}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    cwd = {"tmp": tmp_path / "work", "copy": tmp_path / "checkout"}.get(CWD.get(name, ""), ROOT)
    if cwd == tmp_path / "checkout":
        shutil.copytree(ROOT, cwd, ignore=shutil.ignore_patterns(".venv", ".git", "__pycache__"))
    cwd.mkdir(exist_ok=True)
    runner = [sys.executable] if name.endswith(".py") else ["bash"]
    proc = subprocess.run([*runner, str(ROOT / name), *args], cwd=cwd, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
