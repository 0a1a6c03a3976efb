"""The scripts a fresh machine runs before the tests: what they print where, and which mirror they use.

``.ci/run`` evaluates the stdout of ``.ci/torch-mpi-backend.sh``: that stdout must hold nothing but
``export`` lines, also on a cold cache, where apt-get and pip print pages of progress.
``scripts/debian-archive-uri.sh`` takes the Debian mirror from the machine's own apt configuration,
so the repository names no host.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PREP = ROOT / ".ci" / "torch-mpi-backend.sh"
ARCHIVE_URI = ROOT / "scripts" / "debian-archive-uri.sh"


def _warm_torch_venvs() -> list[Path] | None:
    cache = Path(os.environ.get("CHANNELSMITH_CACHE", Path.home() / ".cache" / "channelsmith"))
    venvs = [cache / "venv-torch-2.6.0", cache / "venv-torch-2.14.1"]
    return venvs if all((venv / "bin" / "python").exists() for venv in venvs) else None


def test_prep_script_prints_only_export_lines_on_stdout_from_a_cold_source_cache(tmp_path: Path) -> None:
    # The Debian source download runs for real into an empty cache; the 3 GB torch venvs are taken
    # from the warm cache (links), so the test costs one 27 MB download instead of 6 GB.
    venvs = _warm_torch_venvs()
    if venvs is None:
        pytest.skip("no warm torch 2.6.0 and 2.14.1 venvs: run `bash .ci/torch-mpi-backend.sh` once (CI does, before pytest)")
    if not shutil.which("apt-get") or not subprocess.run(
        ["apt-cache", "showsrc", "pytorch"], capture_output=True, text=True
    ).stdout:
        pytest.skip("no Debian source index for pytorch: run `bash scripts/install-test-deps.sh`")
    cache = tmp_path / "cache"
    cache.mkdir()
    for venv in venvs:
        (cache / venv.name).symlink_to(venv)
    result = subprocess.run(
        ["bash", str(PREP)], env=dict(os.environ, CHANNELSMITH_CACHE=str(cache)),
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines and all(line.startswith("export ") for line in lines), result.stdout[:2000]
    # apt-get's own progress went to stderr, where people read it.
    assert "Reading package lists" in result.stderr or "Get:" in result.stderr or "Fetched" in result.stderr
    exported = subprocess.run(
        ["bash", "-c", f'eval "$1"; printf "%s" "$TORCH_MPI_BACKEND_TORCH_SOURCE"', "-", result.stdout],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert Path(exported).is_file() and Path(exported).is_relative_to(cache)
    # Each venv carries the mark of an import that worked: later runs read torch's metadata instead.
    assert all((venv / ".torch-imports").is_file() for venv in venvs)


def _root(tmp_path: Path, codename: str, files: dict[str, str]) -> Path:
    (tmp_path / "etc" / "apt" / "sources.list.d").mkdir(parents=True)
    (tmp_path / "etc" / "os-release").write_text(f'NAME="Debian GNU/Linux"\nVERSION_CODENAME={codename}\n')
    for name, text in files.items():
        (tmp_path / "etc" / "apt" / name).write_text(text)
    return tmp_path


def _archive_uri(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(ARCHIVE_URI), str(root)], capture_output=True, text=True, timeout=30)


# A site's own mirror (a reserved example domain: nothing is contacted).
MIRROR = "http://mirror.site.example/debian"
OTHER = "http://other.example/debian"
DEB822 = f"""Types: deb
URIs: {MIRROR}-security
Suites: bookworm-security
Components: main

Types: deb
# a comment line inside the stanza
URIs: {MIRROR}
Suites: bookworm bookworm-updates
Components: main
"""


def test_archive_uri_comes_from_the_deb822_stanza_of_this_release(tmp_path: Path) -> None:
    root = _root(tmp_path, "bookworm", {"sources.list.d/debian.sources": DEB822})
    result = _archive_uri(root)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == MIRROR


def test_archive_uri_reads_one_line_entries_with_options(tmp_path: Path) -> None:
    root = _root(
        tmp_path, "trixie",
        {"sources.list": f"# deb {OTHER} trixie main\n"
         f"deb [arch=amd64 signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] {MIRROR} trixie main\n"},
    )  # fmt: skip
    assert _archive_uri(root).stdout.strip() == MIRROR


def test_a_disabled_stanza_and_disabled_files_are_not_used(tmp_path: Path) -> None:
    root = _root(
        tmp_path, "bookworm",
        {"sources.list.d/off.sources": f"Types: deb\nURIs: {OTHER}\nSuites: bookworm\nEnabled: no\n",
         "sources.list.d/vendor.list.disabled": f"deb {OTHER} bookworm main\n",
         "sources.list.d/debian.sources": DEB822},
    )  # fmt: skip
    assert _archive_uri(root).stdout.strip() == MIRROR


def test_no_source_for_this_release_is_exit_1_with_the_reason(tmp_path: Path) -> None:
    root = _root(tmp_path, "noble", {"sources.list.d/debian.sources": DEB822})
    result = _archive_uri(root)
    assert result.returncode == 1 and result.stdout == ""
    assert "no apt source for 'noble'" in result.stderr


def test_the_installer_names_no_mirror_host() -> None:
    text = (ROOT / "scripts" / "install-test-deps.sh").read_text()
    assert not re.search(r"https?://", text), "install-test-deps.sh names a host; take it from apt's configuration"
    assert "debian-archive-uri.sh" in text



@pytest.mark.parametrize("asked", ["latest", "torch==2.15.0", "2.15.0; rm -rf /", "2.15.0 "])
def test_the_installer_refuses_a_torch_that_is_not_a_release_before_installing_anything(asked: str) -> None:
    """CHANNELSMITH_TEST_TORCH picks the release the tests run on (issue 72); anything else than a version is
    exit 2 with what to give, before apt or pip is asked anything."""
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "install-test-deps.sh")], capture_output=True, text=True,
                          env=dict(os.environ, CHANNELSMITH_TEST_TORCH=asked), timeout=60)  # fmt: skip
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == (f"install-test-deps: CHANNELSMITH_TEST_TORCH='{asked}' is not a PyTorch release: give one "
                           "such as 2.15.0 or 2.13.0+cpu, or unset it for 2.15.0\n")  # fmt: skip

RUNTIME_OLDEST = ROOT / ".ci" / "runtime-oldest.sh"


def test_the_oldest_release_run_refuses_a_python_without_torch_2_6_0_and_runs_nothing(tmp_path: Path) -> None:
    """.ci/runtime-oldest.sh runs the runtime packages' tests on torch 2.6.0 (issue 72): with no python,
    or one whose torch is another release, it says what is wrong and exits 2 before installing anything."""
    pytest.importorskip("torch")
    import sys

    import torch

    missing = subprocess.run(["bash", str(RUNTIME_OLDEST)], capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "usage: bash .ci/runtime-oldest.sh PYTHON" in missing.stderr
    if torch.__version__.split("+")[0] == "2.6.0":
        pytest.skip("this python's torch is 2.6.0: the refusal needs another release")
    other = subprocess.run(["bash", str(RUNTIME_OLDEST), sys.executable], capture_output=True, text=True, timeout=60)
    assert other.returncode == 2, other.stderr
    assert f"has torch {torch.__version__.split('+')[0]}, not 2.6.0" in other.stderr
    assert "passed" not in other.stdout


def test_ci_runs_the_runtime_packages_tests_on_2_6_0_after_the_readme_run() -> None:
    script = (ROOT / ".ci" / "run").read_text()
    readme_run = script.index("python3 -m pytest\n")
    assert script.index('bash .ci/runtime-oldest.sh "$TORCH_MPI_BACKEND_PYTHON"') > readme_run
