"""scripts/build-mpich-cuda.sh: argument handling and the configure line it builds (no build here).

The build itself needs CUDA and a GPU node's minutes; tests/test_cudampi_gpu.py (marker `gpu`) runs it
there. These cases check what CI can: bad input exits 2 with a clear message and writes nothing, and
--print-configure shows the exact configure command for given library roots.
"""

from __future__ import annotations

import platform
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "build-mpich-cuda.sh"


def _touch(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()
    return path


@pytest.fixture()
def roots(tmp_path: Path) -> dict[str, Path]:
    """Library roots laid out like the real ones: CUDA's include/, Debian's usr/ with a multiarch lib folder."""
    multiarch = f"lib/{platform.machine()}-linux-gnu"
    cuda = tmp_path / "cuda"
    _touch(cuda / "include" / "cuda_runtime_api.h")
    usr = tmp_path / "debian" / "usr"
    _touch(usr / "include" / "rdma" / "fabric.h")
    _touch(usr / multiarch / "libfabric.so.1")
    _touch(usr / "include" / "hwloc.h")
    _touch(usr / multiarch / "libhwloc.so.15")
    source = tmp_path / "mpich-4.3.2"
    configure = _touch(source / "configure")
    configure.chmod(0o755)
    return {"cuda": cuda, "libfabric": usr, "hwloc": usr, "source": source, "prefix": tmp_path / "install"}


def _args(roots: dict[str, Path], **override: str | None) -> list[str]:
    values = {key: str(path) for key, path in roots.items()}
    values.update(override)
    args: list[str] = []
    for key in ("source", "prefix", "cuda", "libfabric", "hwloc"):
        if values.get(key) is not None:
            args += [f"--{key}", values[key]]
    return args


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT), *args], text=True, capture_output=True, timeout=60)


def test_print_configure_names_device_libraries_cuda_and_no_fortran(roots: dict[str, Path]) -> None:
    result = _run(*_args(roots), "--print-configure")
    assert result.returncode == 0, result.stderr
    words = shlex.split(result.stdout)
    multiarch = roots["libfabric"] / "lib" / f"{platform.machine()}-linux-gnu"
    assert words[0] == "./configure"
    assert f"--prefix={roots['prefix']}" in words
    assert "--with-device=ch4:ofi" in words and "--disable-fortran" in words
    assert f"--with-cuda={roots['cuda']}" in words
    assert f"--with-libfabric-include={roots['libfabric'] / 'include'}" in words
    assert f"--with-libfabric-lib={multiarch}" in words
    assert f"--with-hwloc-lib={multiarch}" in words
    assert f"LDFLAGS=-Wl,-rpath,{multiarch} -Wl,-rpath,{multiarch}" in words
    assert not roots["prefix"].exists()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"source": None}, "--source is required"),
        ({"hwloc": None}, "--hwloc is required"),
        ({"cuda": "/nonexistent/cuda"}, "has no include/cuda_runtime_api.h"),
        ({"source": "/nonexistent/mpich"}, "does not exist"),
    ],
)
def test_missing_or_wrong_roots_exit_2(roots: dict[str, Path], change: dict, message: str) -> None:
    result = _run(*_args(roots, **change))
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "hint:" in result.stderr
    assert result.stdout == "" and not roots["prefix"].exists()


def test_libfabric_without_its_library_exits_2(roots: dict[str, Path], tmp_path: Path) -> None:
    headers_only = tmp_path / "headers-only"
    _touch(headers_only / "include" / "rdma" / "fabric.h")
    result = _run(*_args(roots, libfabric=str(headers_only)))
    assert result.returncode == 2
    assert "has no libfabric.so under lib, lib64 or lib/" in result.stderr


def test_source_without_configure_asks_for_autogen(roots: dict[str, Path]) -> None:
    (roots["source"] / "configure").unlink()
    result = _run(*_args(roots))
    assert result.returncode == 2
    assert "has no ./configure" in result.stderr and "./autogen.sh -without-ucx" in result.stderr


def test_source_file_that_is_no_tarball_exits_2(roots: dict[str, Path], tmp_path: Path) -> None:
    result = _run(*_args(roots, source=str(_touch(tmp_path / "mpich.zip"))))
    assert result.returncode == 2
    assert "neither a folder nor a .tar.gz/.tar.xz" in result.stderr


def test_non_empty_prefix_is_refused_and_left_alone(roots: dict[str, Path]) -> None:
    kept = _touch(roots["prefix"] / "bin" / "mpicc")
    result = _run(*_args(roots))
    assert result.returncode == 2
    assert "exists and is not an empty folder" in result.stderr
    assert kept.is_file() and sorted(p.name for p in roots["prefix"].rglob("*")) == ["bin", "mpicc"]


@pytest.mark.parametrize("bad", [["--jobs", "0"], ["--jobs", "many"], ["--jobs"], ["--frobnicate"]])
def test_bad_options_exit_2(roots: dict[str, Path], bad: list[str]) -> None:
    result = _run(*_args(roots), *bad)
    assert result.returncode == 2
    assert result.stderr.startswith("build-mpich-cuda: ")
    assert not roots["prefix"].exists()


def test_help_lists_the_options() -> None:
    result = _run("--help")
    assert result.returncode == 0
    for option in ("--source", "--prefix", "--cuda", "--libfabric", "--hwloc", "--jobs", "--print-configure"):
        assert option in result.stderr


def test_script_passes_shellcheck() -> None:
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck)")
    result = subprocess.run(["shellcheck", str(SCRIPT)], text=True, capture_output=True)
    assert result.returncode == 0, result.stdout


def test_configure_sees_the_roots_on_gccs_paths_and_an_embedded_libfabric_stops_the_build(roots: dict[str, Path], tmp_path: Path) -> None:
    # MPICH 4.3.2's first libfabric probe ignores --with-libfabric-include; on the H100 machine (issue 40)
    # configure then chose the embedded libfabric, which an autogen'ed tree lacks, and make failed 90 s
    # later. The script puts the roots on CPATH/LIBRARY_PATH and stops right after such a configure.
    seen = tmp_path / "configure-env"
    multiarch_include = roots["hwloc"] / "include" / f"{platform.machine()}-linux-gnu"
    multiarch_include.mkdir(parents=True)
    (roots["source"] / "configure").write_text(
        "#!/bin/sh\n"
        f'printf "%s\\n%s\\n" "$CPATH" "$LIBRARY_PATH" > {shlex.quote(str(seen))}\n'
        'echo "configure: CH4 OFI Netmod:  Using an embedded libfabric" > config.log\n'
    )
    result = _run(*_args(roots))
    assert result.returncode == 1, result.stderr
    assert "configure did not take the libfabric of --libfabric" in result.stderr
    cpath, library_path = seen.read_text().splitlines()
    usr = roots["libfabric"]
    assert cpath.split(":")[:2] == [f"{usr}/include", str(multiarch_include)]
    assert library_path.split(":")[0] == str(usr / "lib" / f"{platform.machine()}-linux-gnu")
    assert not roots["prefix"].exists()
