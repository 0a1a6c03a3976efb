"""The nccl and nccl-ofi-plugin build scripts, run outside the conda engine on a system toolchain.

Each test gives a recipe's build.sh what rattler-build would give it (PREFIX, SRC_DIR, RECIPE_DIR,
BUILD_PREFIX, CPU_COUNT, PKG_VERSION and the variant values the recipe passes as env) and a copy
of upstream source named by an environment variable:

  CHANNELSMITH_NCCL_SRC   an NVIDIA/nccl release tree (e.g. v2.21.5-1); needs nvcc (CUDA_HOME,
                          default /usr/local/cuda); builds for one architecture
                          (CHANNELSMITH_NCCL_ARCH, default 8.0: Derecho's A100s)
  CHANNELSMITH_OFI_SRC    an aws/aws-ofi-nccl release tree (e.g. v1.6.0, v1.19.2); needs
                          libfabric and hwloc headers (Debian: libfabric-dev, libhwloc-dev;
                          CHANNELSMITH_OFI_LIBFABRIC_ROOT / CHANNELSMITH_OFI_HWLOC_ROOT,
                          default /usr), autoconf, automake, libtool and a CUDA toolkit

Run with: pytest -m buildsh -s tests/test_buildsh_nccl.py

A full NCCL build compiles about 150 kernel files; NCCL's own make knob ONLY_FUNCS (read from the
environment, e.g. ONLY_FUNCS="AllReduce Sum f32 RING SIMPLE") narrows that to a few for a quicker
end-to-end check of the build script on a small machine. Packages are never built with it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.buildsh

REPO = Path(__file__).resolve().parents[1]
NCCL_RECIPE = REPO / "recipes" / "nccl"
OFI_RECIPE = REPO / "recipes" / "nccl-ofi-plugin"


def _source(var: str) -> Path:
    value = os.environ.get(var)
    if not value:
        pytest.skip(f"{var} is not set: point it at an upstream source tree to run this build script")
    path = Path(value)
    if not path.is_dir():
        pytest.fail(f"{var}={value} is not a directory")
    return path


def _cuda_home() -> Path:
    home = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda"))
    if not (home / "bin" / "nvcc").exists():
        pytest.skip(f"no CUDA toolkit at {home} (set CUDA_HOME)")
    return home


def _engine_env(tmp_path: Path, recipe: Path, src: Path, **variant: str) -> dict[str, str]:
    """The variables rattler-build exports to build.sh, with the recipe's variant env on top."""
    prefix, build_prefix = tmp_path / "prefix", tmp_path / "build_env"
    prefix.mkdir()
    build_prefix.mkdir()
    env = dict(os.environ)
    env.update(
        PREFIX=str(prefix),
        BUILD_PREFIX=str(build_prefix),
        SRC_DIR=str(src),
        RECIPE_DIR=str(recipe),
        CPU_COUNT=str(os.cpu_count() or 1),
        target_platform="linux-64",
        **variant,
    )
    return env


def _run_build(env: dict[str, str], src: Path, log: Path) -> float:
    """Run build.sh in the source tree (as the engine does); the full log goes to ``log``."""
    start = time.monotonic()
    with log.open("w") as out:
        result = subprocess.run(["bash", f"{env['RECIPE_DIR']}/build.sh"], cwd=src, env=env,
                                stdout=out, stderr=subprocess.STDOUT, check=False)
    elapsed = time.monotonic() - start
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-60:])
    assert result.returncode == 0, f"build.sh failed after {elapsed:.0f} s; log {log}:\n{tail}"
    return elapsed


def _unresolved(library: Path) -> list[str]:
    out = subprocess.run(["ldd", str(library)], capture_output=True, text=True, check=True).stdout
    return [line.strip() for line in out.splitlines() if "not found" in line]


def test_nccl_build_sh_builds_one_architecture_and_drops_the_static_library(tmp_path: Path) -> None:
    upstream = _source("CHANNELSMITH_NCCL_SRC")
    cuda_home = _cuda_home()
    arch = os.environ.get("CHANNELSMITH_NCCL_ARCH", "8.0")
    src = tmp_path / "src"
    shutil.copytree(upstream, src, symlinks=True)
    env = _engine_env(tmp_path, NCCL_RECIPE, src, NCCL_CUDA_ARCH_LIST=arch, CUDA_HOME=str(cuda_home))
    log = tmp_path / "build.log"
    elapsed = _run_build(env, src, log)
    prefix = Path(env["PREFIX"])
    text = log.read_text(errors="replace")

    wanted = subprocess.run(
        ["bash", "-c", f'source "{NCCL_RECIPE / "gencode.sh"}" && nccl_gencode "$1"', "gencode", arch],
        capture_output=True, text=True, check=True,
    ).stdout.strip()
    gencodes = set(re.findall(r"NVCC_GENCODE is (.*)", text))
    assert gencodes == {wanted}, gencodes
    libs = sorted(p.name for p in (prefix / "lib").glob("libnccl*"))
    assert "libnccl.so" in libs and "libnccl.so.2" in libs, libs
    assert not (prefix / "lib" / "libnccl_static.a").exists()
    assert (prefix / "include" / "nccl.h").is_file()
    assert (prefix / "lib" / "pkgconfig" / "nccl.pc").is_file()
    assert _unresolved(prefix / "lib" / "libnccl.so.2") == []
    # The recipe's architecture test, on the library this build made.
    nvcc_version = subprocess.run([str(cuda_home / "bin" / "nvcc"), "--version"], capture_output=True, text=True).stdout
    cuda = re.search(r"release (\d+\.\d+)", nvcc_version).group(1)
    archs = subprocess.run(
        [sys.executable, str(NCCL_RECIPE / "tests" / "cuda_archs.py"), str(prefix / "lib" / "libnccl.so.2"),
         "--expect", arch, "--cuda-version", cuda],
        capture_output=True, text=True, check=False,
    )
    assert archs.returncode == 0, archs.stderr
    size_mb = (prefix / "lib" / "libnccl.so.2").resolve().stat().st_size / 2**20
    print(f"\nnccl {upstream.name}: built for {arch} in {elapsed:.0f} s; libnccl.so {size_mb:.1f} MiB\n{archs.stderr}")


def test_ofi_build_sh_builds_the_plugin_and_runs_its_unit_tests(tmp_path: Path) -> None:
    upstream = _source("CHANNELSMITH_OFI_SRC")
    cuda_home = _cuda_home()
    version = os.environ.get("CHANNELSMITH_OFI_VERSION") or upstream.name.rsplit("-", 1)[-1].lstrip("v")
    libfabric = os.environ.get("CHANNELSMITH_OFI_LIBFABRIC_ROOT", "/usr")
    hwloc = os.environ.get("CHANNELSMITH_OFI_HWLOC_ROOT", "/usr")
    if not (Path(libfabric) / "include" / "rdma" / "fabric.h").is_file():
        pytest.skip(f"no libfabric headers under {libfabric} (apt-get install libfabric-dev)")
    for tool in ("autoreconf", "libtoolize", "automake"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is missing (apt-get install autoconf automake libtool)")
    src = tmp_path / "src"
    shutil.copytree(upstream, src, symlinks=True)
    env = _engine_env(tmp_path, OFI_RECIPE, src, PKG_VERSION=version, OFI_LIBFABRIC_ROOT=libfabric,
                      OFI_HWLOC_ROOT=hwloc, CUDA_HOME=str(cuda_home))
    log = tmp_path / "build.log"
    elapsed = _run_build(env, src, log)
    prefix = Path(env["PREFIX"])
    text = log.read_text(errors="replace")

    net = prefix / "lib" / "libnccl-net.so"
    assert net.exists()
    assert not list((prefix / "lib").glob("*.la"))
    assert _unresolved(net) == []
    assert not (prefix / "bin").exists(), "functional test programs (MPI) were installed"
    if _version_tuple(version) >= (1, 15):
        assert (prefix / "lib" / "libnccl-net-ofi.so").exists()
    unit = re.findall(r"^# (TOTAL|PASS|FAIL|SKIP|XFAIL|ERROR): *(\d+)", text, flags=re.M)
    if (src / "tests" / "unit").is_dir():
        counts = dict(unit)
        assert int(counts.get("TOTAL", 0)) > 0 and counts.get("FAIL") == "0" and counts.get("ERROR") == "0", unit
        summary = ", ".join(f"{k} {v}" for k, v in unit)
    else:
        assert "no tests/unit in this release" in text
        summary = "none shipped"
    print(f"\naws-ofi-nccl {version}: built in {elapsed:.0f} s; unit tests: {summary}")


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version)[:2])
