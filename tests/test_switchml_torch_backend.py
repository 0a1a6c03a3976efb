"""recipes/torch-switchml builds against a stock PyTorch 2.x and aggregates with SwitchML's dummy backend.

Outside the conda engine: switchml-client is built from CHANNELSMITH_SWITCHML_SRC by its build.sh
(dummy backend), then torch-switchml's build.sh compiles our C++ extension against the torch this
Python imports (scripts/install-test-deps.sh installs 2.15.0) into a virtual environment, and the
recipe's own check script runs there: world size 1 with num_workers=2 doubles float32/int32
allreduces, leaves gloo's results unchanged for the rest, and warns and falls back without a config.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from test_switchml_client_buildsh import _build, _source

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "torch-switchml"

pytestmark = pytest.mark.buildsh


def test_switchml_backend_on_stock_torch_doubles_sums_and_falls_back_to_gloo(tmp_path: Path) -> None:
    _source()  # skips first when no SwitchML source is given: importing torch takes seconds
    pytest.importorskip("torch", reason="torch is not installed (bash scripts/install-test-deps.sh installs it)")
    _, client_prefix, _ = _build(tmp_path / "client", "dummy")
    env_dir = tmp_path / "venv"
    # No pip/setuptools of its own: this interpreter's (setuptools with bdist_wheel) serve the venv.
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(env_dir)], check=True)
    python = env_dir / "bin" / "python"
    # The environment layout the recipe test sees: switchml-client's template under share/.
    shutil.copytree(client_prefix / "share", env_dir / "share")
    source = tmp_path / "src"
    shutil.copytree(RECIPE / "src", source)
    env = dict(os.environ, PREFIX=str(client_prefix), SRC_DIR=str(source), PYTHON=str(python),
               CPU_COUNT=str(os.cpu_count() or 1), PKG_VERSION="1.0.0")
    built = subprocess.run(["bash", str(RECIPE / "build.sh")], env=env, capture_output=True, text=True,
                           check=False, timeout=1800)
    assert built.returncode == 0, f"build.sh failed:\n{built.stdout[-4000:]}{built.stderr[-4000:]}"
    checked = subprocess.run([str(python), str(RECIPE / "tests" / "switchml_backend_checks.py")],
                             cwd=tmp_path, capture_output=True, text=True, check=False, timeout=600)
    output = checked.stdout + checked.stderr
    assert checked.returncode == 0, output[-6000:]
    assert "with-config: float32 SUM: [2.0, 4.0, 6.0] for input [1, 2, 3]" in output
    assert "with-config: int32 SUM: [2, 4, 6] for input [1, 2, 3]" in output
    assert "with-config: float64 SUM (gloo): [1.0, 2.0, 3.0]" in output
    assert "no-config: float32 SUM: [1.0, 2.0, 3.0]" in output
    assert "switchml_backend_checks: PASS" in output
