"""torch_dist_check/harness/startup.py: torch imported with the cycle collector paused, what it made frozen.

A rank of the suite's command imports torch that way once its options and launch are known good, and its
``--import`` modules the same way; the fork server's preload is held to it in tests/test_dist_check_forkserver.py.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import suite_process

from torch_dist_check.harness import startup

pytest.importorskip("torch")

# An --import module that says how the process stood when it was imported, and again at the rank's exit.
PROBE_MODULE = """import atexit, gc, json, os, sys

def state():
    return {"torch": "torch" in sys.modules, "frozen": gc.get_freeze_count(), "collecting": gc.isenabled()}

said = {"imported": state()}

def at_exit():
    said["exit"] = state()
    with open(os.environ["STARTUP_PROBE_OUT"], "w") as out:
        json.dump(said, out)

atexit.register(at_exit)
"""


def test_import_all_freezes_what_it_imported_and_leaves_the_collector_as_it_found_it(tmp_path, monkeypatch):
    (tmp_path / "startup_probe_a.py").write_text("CYCLE = []\nCYCLE.append(CYCLE)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    frozen = gc.get_freeze_count()
    try:
        startup.import_all(["startup_probe_a"])
        assert gc.isenabled() and gc.get_freeze_count() > frozen
        assert not any(obj is sys.modules["startup_probe_a"].CYCLE for obj in gc.get_objects())
        # A collector switched off stays off; a failing import raises as ``import`` does, and unpauses it too.
        gc.disable()
        startup.import_all([])
        assert not gc.isenabled()
        gc.enable()
        with pytest.raises(ModuleNotFoundError, match="startup_probe_missing"):
            startup.import_all(["startup_probe_missing"])
        assert gc.isenabled()
    finally:
        # Not unfrozen: that would hand back to the collector what this test process froze before (torch).
        gc.enable()
        sys.modules.pop("startup_probe_a", None)


def test_a_rank_imports_its_modules_and_torch_with_the_collector_paused_and_frozen(tmp_path):
    """One rank as its own interpreter (no launcher): its --import module is imported with the collector
    paused, and by its exit torch is in and frozen (about 250,000 objects; nothing else freezes)."""
    (tmp_path / "startup_probe.py").write_text(PROBE_MODULE)
    out = tmp_path / "probe.json"
    env = dict(os.environ, PYTHONPATH=suite_process.python_path(tmp_path), STARTUP_PROBE_OUT=str(out))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "OMPI_COMM_WORLD_RANK",
                 "PMI_RANK", "SLURM_PROCID", "PALS_RANKID", "PBS_NODEFILE"):  # fmt: skip
        env.pop(name, None)
    done = subprocess.run(
        [sys.executable, "-m", "torch_dist_check", "--import", "startup_probe", "--backends", "gloo",
         "--checks", "env", "--quick", "--json", str(tmp_path / "report.json")],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    said = json.loads(out.read_text())
    assert said["imported"]["collecting"] is False
    assert said["exit"]["torch"] is True and said["exit"]["frozen"] > 100_000 and said["exit"]["collecting"] is True


def test_a_usage_error_of_a_rank_is_said_before_torch_is_imported(tmp_path):
    """A rank whose options are wrong says so without importing torch (a broken torch cannot hide it)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = suite_process.python_path(tmp_path)
    # A torch that cannot be imported, first on the path.
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("raise ImportError('planted: this torch is broken')\n")
    done = subprocess.run([sys.executable, "-m", "torch_dist_check", "--nproc-per-node", "2", "--backends", "gloo"],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "--nproc-per-node needs --nodes" in done.stderr and "planted" not in done.stderr
