"""recipes/nccl/build.sh makes NCCL's bare `ar` call use the toolchain's archiver ($AR).

NCCL's Makefile archives libnccl_static.a with a bare `ar`. The build script runs here on a small
source tree whose Makefile has NCCL's two targets (src.build, src.install) and the same bare `ar`
call on an object gcc compiles; the "toolchain" archiver is a program named like conda's
(x86_64-conda-linux-gnu-ar) that leaves a mark and runs the system's ar. No NCCL, no nvcc.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BUILD_SH = REPO / "recipes" / "nccl" / "build.sh"

# NCCL's targets as build.sh calls them; the archive rule calls a bare `ar`, as NCCL's src/Makefile does.
MAKEFILE = """\
src.build:
\tmkdir -p build/lib
\tgcc -c -fPIC -o build/x.o x.c
\tar rcs build/lib/libnccl_static.a build/x.o
\tcommand -v ar > build/ar-used

src.install:
\tmkdir -p $(PREFIX)/lib
\tcp build/lib/libnccl_static.a $(PREFIX)/lib/
"""


def _tools() -> None:
    for tool in ("gcc", "ar", "make"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed")


def _tree(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    src = tmp_path / "src"
    src.mkdir()
    (src / "Makefile").write_text(MAKEFILE)
    (src / "x.c").write_text("int nccl_stand_in(void) { return 0; }\n")
    toolchain = tmp_path / "toolchain" / "bin"
    toolchain.mkdir(parents=True)
    archiver = toolchain / "x86_64-conda-linux-gnu-ar"
    archiver.write_text(f'#!/bin/sh\necho "$@" >> "{tmp_path}/toolchain-ar.log"\nexec {shutil.which("ar")} "$@"\n')
    archiver.chmod(0o755)
    prefix, build_prefix, cuda = tmp_path / "prefix", tmp_path / "build_env", tmp_path / "cuda"
    for folder in (prefix, build_prefix, cuda):
        folder.mkdir()
    env = {
        "PATH": f"{toolchain}:{os.path.dirname(shutil.which('ar'))}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "PREFIX": str(prefix),
        "BUILD_PREFIX": str(build_prefix),
        "SRC_DIR": str(src),
        "RECIPE_DIR": str(BUILD_SH.parent),
        "CPU_COUNT": "1",
        "CUDA_HOME": str(cuda),
        "NCCL_CUDA_ARCH_LIST": "8.0",
    }
    return src, env


def _build(src: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(BUILD_SH)], cwd=src, env=env, capture_output=True, text=True, check=False)


def test_ar_is_the_toolchains_archiver_even_with_another_ar_on_path(tmp_path: Path) -> None:
    _tools()
    src, env = _tree(tmp_path)
    env["AR"] = "x86_64-conda-linux-gnu-ar"
    proc = _build(src, env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    log = tmp_path / "toolchain-ar.log"
    assert log.is_file(), f"the archive was made by {(src / 'build/ar-used').read_text().strip()}, not $AR"
    assert "rcs build/lib/libnccl_static.a" in log.read_text()
    # build.sh installs the headers and shared library only: the static archive is removed.
    assert not (Path(env["PREFIX"]) / "lib" / "libnccl_static.a").exists()


def test_without_ar_set_the_ar_on_path_is_used(tmp_path: Path) -> None:
    _tools()
    src, env = _tree(tmp_path)
    proc = _build(src, env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not (tmp_path / "toolchain-ar.log").exists()
    assert (src / "build/ar-used").read_text().strip() == shutil.which("ar", path=env["PATH"])


def test_an_ar_that_names_no_program_stops_the_build_with_its_name(tmp_path: Path) -> None:
    _tools()
    src, env = _tree(tmp_path)
    env["AR"] = "no-such-ar"
    proc = _build(src, env)
    assert proc.returncode == 1
    assert "AR='no-such-ar' names no program on PATH" in proc.stderr
    assert not (src / "build").exists()
