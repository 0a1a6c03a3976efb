"""Activation scripts of nccl-ofi-plugin and pytorch-nccl-fault: stacked levels, zsh, csh/tcsh and fish.

Each recipe's own install script puts its activate.d / deactivate.d files into a prefix (no build
engine needed: they are plain files); site-env's built packages are covered in test_site_env.py.
A scenario is a list of steps that is written out for sh (and zsh), tcsh and fish in their own syntax and run
in the real shell, following conda's order (conda/activate.py, and mamba's activation.cpp alike):
CONDA_SHLVL is the level being activated while activate.d is sourced and the level being left while
deactivate.d is sourced; after leaving a stacked level conda sources the activate.d of the level
below again, unless a scenario leaves that out.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
OFI = REPO / "recipes" / "nccl-ofi-plugin"
NCCLFT = REPO / "recipes" / "pytorch-nccl-fault"
BASE_ENV = {"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", "LC_ALL": "C"}
EXTENSION = {"sh": "sh", "zsh": "sh", "tcsh": "csh", "fish": "fish"}
NCCLFT_DEFAULTS = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
    "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "0",
    "TORCH_NCCL_TRACE_BUFFER_SIZE": "0",
    "NCCL_CUMEM_ENABLE": "0",
    "TORCH_PEER_WATCHER": "1",
    "TORCH_DIST_USE_NCCL2": "0",
}


def ofi_prefix(root: Path, version: str) -> Path:
    prefix = root / f"ofi-{version}"
    env = dict(os.environ, PREFIX=str(prefix), RECIPE_DIR=str(OFI), PKG_VERSION=version)
    subprocess.run(["bash", str(OFI / "install-activation.sh")], env=env, check=True)
    return prefix


def ncclft_prefix(root: Path) -> Path:
    prefix = root / "ncclft"
    env = dict(os.environ, PREFIX=str(prefix), RECIPE_DIR=str(NCCLFT))
    subprocess.run(["bash", str(NCCLFT / "install-activation.sh")], env=env, check=True)
    return prefix


def _line(shell: str, step: tuple[str, ...], out: Path) -> str:
    kind, *args = step
    # zsh sources the POSIX scripts as they are (conda does not wrap them), in zsh's own mode, where an
    # unquoted $var is not split into words.
    shell = "sh" if shell == "zsh" else shell
    if kind == "snap":
        return f'env -0 > "{out / args[0]}"'
    if kind == "set":
        name, value = args
        return {"sh": f"{name}='{value}'; export {name}", "tcsh": f"setenv {name} '{value}'",
                "fish": f"set -gx {name} '{value}'"}[shell]  # fmt: skip
    if kind == "unset":
        return {"sh": f"unset {args[0]}", "tcsh": f"unsetenv {args[0]}", "fish": f"set -e {args[0]}"}[shell]
    # activate / deactivate PREFIX PACKAGE: source that package's script for this shell, with
    # CONDA_PREFIX pointing at the environment as conda has it then.
    prefix, package = args
    script = Path(prefix) / "etc/conda" / f"{kind}.d" / f"{package}.{EXTENSION[shell]}"
    assign = _line(shell, ("set", "CONDA_PREFIX", prefix), out)
    return f'{assign}\n{"." if shell == "sh" else "source"} "{script}"'


def run_scenario(shell: str, steps: list[tuple[str, ...]], tmp_path: Path, env: dict[str, str] | None = None):
    """Snapshot name -> environment, after running ``steps`` in ``shell``."""
    if shutil.which(shell) is None:
        pytest.skip(f"{shell} is not installed (apt-get install {shell}; scripts/install-test-deps.sh does)")
    out = tmp_path / f"out-{shell}"
    out.mkdir()
    script = tmp_path / f"scenario.{EXTENSION[shell]}"
    script.write_text("\n".join(_line(shell, step, out) for step in steps) + "\n")
    proc = subprocess.run([shell, str(script)], env={**BASE_ENV, **(env or {})}, capture_output=True, text=True,
                          check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    snaps = {}
    for path in sorted(out.iterdir()):
        entries = [e for e in path.read_bytes().decode().split("\0") if e]
        snaps[path.name] = dict(e.split("=", 1) for e in entries)
    return snaps


def changes(snaps: dict[str, dict[str, str]]) -> dict[str, dict[str, str | None]]:
    """Per snapshot, what differs from "0-before" (so variables a shell sets for itself drop out)."""
    before = snaps["0-before"]
    return {
        name: {k: now.get(k) for k in set(before) | set(now) if before.get(k) != now.get(k)}
        for name, now in snaps.items()
    }


def stacked(a: tuple[Path, str], b: tuple[Path, str], conda_reactivates: bool = True) -> list[tuple[str, ...]]:
    """`conda activate A; conda activate --stack B; conda deactivate; conda deactivate`."""
    steps = [("snap", "0-before"), ("set", "CONDA_SHLVL", "1"), ("activate", str(a[0]), a[1]), ("snap", "1-A"),
             ("set", "CONDA_SHLVL", "2"), ("activate", str(b[0]), b[1]), ("snap", "2-B"),
             ("deactivate", str(b[0]), b[1]), ("set", "CONDA_SHLVL", "1"), ("set", "CONDA_PREFIX", str(a[0])),
             ("snap", "3-B-left")]  # fmt: skip
    if conda_reactivates:
        steps += [("activate", str(a[0]), a[1])]
    steps += [("snap", "4-A-again"), ("deactivate", str(a[0]), a[1]), ("set", "CONDA_SHLVL", "0"),
              ("unset", "CONDA_PREFIX"), ("snap", "5-after")]  # fmt: skip
    return steps


def without_conda(change: dict[str, str | None]) -> dict[str, str | None]:
    return {k: v for k, v in change.items() if k not in ("CONDA_SHLVL", "CONDA_PREFIX")}


@pytest.mark.parametrize("conda_reactivates", [True, False], ids=["conda", "no-reactivation"])
def test_ofi_plugin_stacked_on_another_plugin_version_gives_the_level_below_back(tmp_path, conda_reactivates):
    a, b = (ofi_prefix(tmp_path, "1.6.0"), "nccl-ofi-plugin"), (ofi_prefix(tmp_path, "1.19.2"), "nccl-ofi-plugin")
    snaps = run_scenario("sh", stacked(a, b, conda_reactivates), tmp_path, env={"NCCL_NET_PLUGIN": "mine"})
    assert snaps["1-A"]["NCCL_NET"] == "AWS Libfabric" and snaps["1-A"]["NCCL_NET_PLUGIN"] == "mine"
    assert snaps["2-B"]["NCCL_NET"] == "Libfabric" and snaps["2-B"]["NCCL_NET_PLUGIN"] == "ofi"
    assert snaps["3-B-left"] == snaps["1-A"]
    assert snaps["4-A-again"] == snaps["1-A"]
    assert without_conda(changes(snaps)["5-after"]) == {}


@pytest.mark.parametrize("conda_reactivates", [True, False], ids=["conda", "no-reactivation"])
def test_ncclft_stacked_twice_keeps_what_the_user_set_at_the_level_below(tmp_path, conda_reactivates):
    """A user's own value set while level 1 is active survives a stacked level 2 coming and going."""
    env = (ncclft_prefix(tmp_path), "pytorch-nccl-fault")
    steps = stacked(env, env, conda_reactivates)
    steps.insert(steps.index(("snap", "1-A")), ("set", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "3"))
    snaps = run_scenario("sh", steps, tmp_path)
    assert {k: snaps["1-A"].get(k) for k in NCCLFT_DEFAULTS} == {**NCCLFT_DEFAULTS, "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}
    assert snaps["3-B-left"] == snaps["1-A"]
    assert snaps["4-A-again"]["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    assert not any(k.startswith("_PYTORCH_NCCLFT") for k in snaps["5-after"])


@pytest.mark.parametrize("shell", ["zsh", "tcsh", "fish"])
@pytest.mark.parametrize("package", ["nccl-ofi-plugin 1.6.0", "nccl-ofi-plugin 1.19.2", "pytorch-nccl-fault"])
def test_zsh_and_the_csh_and_fish_wrappers_make_the_posix_scripts_changes_at_every_step(tmp_path, shell, package):
    if package == "pytorch-nccl-fault":
        prefix = ncclft_prefix(tmp_path)
    else:
        package, version = package.split()
        prefix = ofi_prefix(tmp_path, version)
    steps = stacked((prefix, package), (prefix, package))
    # Values that need quoting in both shells: blanks, a quote, a backslash, a dollar sign, csh's
    # history character.
    env = {"NCCL_NET": "it's \\ $HOME !x", "NCCL_NET_PLUGIN": "", "NCCL_CUMEM_ENABLE": "1"}
    posix = changes(run_scenario("sh", steps, tmp_path, env))
    theirs = changes(run_scenario(shell, steps, tmp_path, env))
    assert theirs == posix
    assert without_conda(theirs["5-after"]) == {}
    assert without_conda(theirs["1-A"]), "activation changed nothing"
