"""`python -m torch_dist_check --nproc 2` shows its stages while it runs (issue 34, point 6).

On a terminal (a pty here), rich's live progress line on stderr, with the report table intact above
it; in a pipe or a log, one plain line per stage on stderr; without rich, plain lines on a terminal
too. stdout keeps only the report (and `--json -` stays one JSON document).

The first test starts the command on the terminal as a user's shell does, an interpreter of its own; the others
fork it from the test process's fork server, which imported torch once (``forked=True``; tests/suite_process.py):
what the terminal shows is the same either way (the three commands run both ways showed the same report lines,
the same escape sequences and the same stage lines, but for the stages a faster start passed while drawn), and
each fresh start cost a torch import (1.4-2.2 s of CPU with PyPI's CUDA build on the 2-core CI machine).
"""

from __future__ import annotations

import json
import os
import socket
import sys

import pytest

from ptyrun import plain, run_in_pty

pytest.importorskip("torch", reason="torch is not installed (bash scripts/install-test-deps.sh installs it)")

import suite_process  # noqa: E402

QUICK = ["--nproc", "2", "--backends", "gloo", "--checks", "env,correctness", "--quick"]
# rich's bar is drawn with this character; the plain lines never use it.
BAR = "\u2501"


def suite_env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=suite_process.python_path())


def test_a_terminal_gets_a_live_progress_line_and_the_report_intact(tmp_path):
    # An interpreter of its own, as a user's shell starts the command on a terminal (the launcher then starts a
    # fork server of its own for its ranks): this module's one proof of that start.
    code, shown = run_in_pty([sys.executable, "-m", "torch_dist_check", *QUICK], env=suite_env(), cwd=tmp_path)
    assert code == 0, shown
    text = plain(shown)
    assert "torch_dist_check: stage correctness/gloo/cpu" in text
    assert BAR in text
    assert "(at " not in text  # not the plain lines
    # The report's lines came through whole, above the live line.
    assert "correctness/gloo/cpu  PASS     91 cases correct" in text
    assert "checks: 2 pass, 0 fail, 4 skipped" in text


def test_without_rich_a_terminal_gets_one_plain_line_per_stage(tmp_path):
    """A cluster node with PyTorch alone: rich cannot be imported, the suite still shows its stages."""
    no_rich = "import sys; sys.modules['rich'] = None; from torch_dist_check.cli import main; sys.exit(main())"
    code, shown = run_in_pty([sys.executable, "-c", no_rich, *QUICK], env=suite_env(), cwd=tmp_path, forked=True)
    assert code == 0, shown
    text = plain(shown)
    assert "torch_dist_check: stage correctness/gloo/cpu (at " in text
    assert BAR not in text
    assert "checks: 2 pass, 0 fail, 4 skipped" in text


def test_a_pipe_gets_plain_stage_lines_on_stderr_and_json_alone_on_stdout(tmp_path):
    proc = suite_process.run([*QUICK, "--json", "-"], suite_env(), cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    document = json.loads(proc.stdout)  # nothing but the document on stdout
    assert document["summary"]["ok"]
    stages = [line for line in proc.stderr.splitlines() if line.startswith("torch_dist_check: stage ")]
    assert any("correctness/gloo/cpu" in line for line in stages), proc.stderr
    assert all(line.endswith(" s)") for line in stages)
    assert BAR not in proc.stderr


def test_rank_0_under_another_launcher_shows_its_own_stages(tmp_path):
    """As torchrun or srun would start it (their variables, one rank): rank 0 draws the line itself."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = dict(suite_env(), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
    code, shown = run_in_pty([sys.executable, "-m", "torch_dist_check", *QUICK[2:]], env=env, cwd=tmp_path, forked=True)
    assert code == 0, shown
    text = plain(shown)
    assert "torch_dist_check: stage correctness/gloo/cpu" in text and BAR in text
    assert "checks: 2 pass, 0 fail, 4 skipped" in text
