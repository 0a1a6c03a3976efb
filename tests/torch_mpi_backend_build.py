"""The real build of recipes/torch-mpi-backend that tests/test_torch_mpi_backend*.py run against, kept between runs.

``build(...)`` does what the conda engine would: extracts the files the recipe's filter keeps from the
PyTorch source tarball, applies the recipe's patches without fuzz, and runs the recipe's build.sh with
the engine's variables (PREFIX, SRC_DIR, RECIPE_DIR, PYTHON, ...) against a real torch and the site's
MPICH. Nothing is mocked: the compiler compiles ProcessGroupMPI.cpp, build.sh links and imports it.

The installed prefix is then kept in ``$CHANNELSMITH_CACHE/torch-mpi-backend-builds/`` (default
~/.cache/channelsmith, where .ci/torch-mpi-backend.sh keeps the torch venvs and the source), under a key
that hashes everything the build reads: build.sh, the recipe's src/ tree, the recipe's source block
(filter and patches) and the patches' bytes, the source tarball's bytes, the torch and Python that
$PYTHON imports, the C++ compiler, ``mpicc -show`` and the MPI library it names, and this file. A
later run with the same inputs reuses that prefix instead of compiling the same bytes again (about a
minute of CPU per variant); a change to any input is a new key, so a new real build. A lock per key
makes concurrent test processes (pytest-xdist workers, another checkout) wait for one build instead of
running two. ``TORCH_MPI_BACKEND_REBUILD=1`` builds anew and replaces the kept prefix.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from channelsmith.sources import cache_root, sha256_of  # noqa: E402

RECIPE_DIR = ROOT / "recipes" / "torch-mpi-backend"
# Builds not used for this long are removed when another build is kept (each is a few MB).
KEEP_UNUSED_S = 14 * 24 * 3600


@dataclass(frozen=True)
class Build:
    """An installed torch-mpi-backend prefix and how it came to be."""

    prefix: Path
    site_packages: Path
    build_seconds: float  # wall time of build.sh when it ran (in this run or the one that kept it)
    reused: bool  # True when this run took a kept prefix instead of running build.sh


def recipe_source(version: str) -> dict:
    """The recipe's source block for the pytorch_version variant ``version``: url, sha256, filter, patches."""
    recipe = yaml.safe_load((RECIPE_DIR / "recipe.yaml").read_text())
    for entry in recipe["source"]:
        if f'pytorch_version == "{version}"' in entry["if"]:
            return entry["then"]
    raise AssertionError(f"recipe.yaml has no source for pytorch {version}")


def _mpi_identity(mpicc: str) -> list[str]:
    """``mpicc -show`` and, for each library it links, the file's path, size and mtime."""
    words = subprocess.run([mpicc, "-show"], text=True, capture_output=True, check=True).stdout.split()
    libdirs = [w[2:] for w in words if w.startswith("-L")]
    identity = [" ".join(words)]
    for word in words:
        if word.startswith("-l"):
            for directory in libdirs:
                library = Path(directory) / f"lib{word[2:]}.so"
                if library.exists():
                    real = library.resolve()
                    stat = real.stat()
                    identity.append(f"{real} {stat.st_size} {stat.st_mtime_ns}")
                    break
    return identity


def _torch_identity(python: Path) -> list[str]:
    """The interpreter's version and the torch it would import (version, git revision), without importing torch."""
    probe = (
        "import importlib.metadata as m, importlib.util, pathlib, sys; "
        "spec = importlib.util.find_spec('torch'); "
        "print(sys.version.replace(chr(10), ' ')); print(m.version('torch')); "
        "print(pathlib.Path(spec.origin).parent)"
    )
    version, torch_version, torch_dir = subprocess.run(
        [str(python), "-c", probe], text=True, capture_output=True, check=True
    ).stdout.splitlines()
    return [str(python.resolve()), version, torch_version, torch_dir, (Path(torch_dir) / "version.py").read_text()]


def build_key(*, torch_version: str, source_version: str, python: Path, torch_source: Path, mpicc: str) -> str:
    """A hash of every input of the build (see the module docstring)."""
    source = recipe_source(torch_version)
    digest = hashlib.sha256()

    def add(label: str, data: bytes | str) -> None:
        data = data.encode() if isinstance(data, str) else data
        digest.update(f"{label}\0{len(data)}\0".encode() + data)

    add("variant", f"{torch_version} {source_version}")
    add("helper", Path(__file__).read_bytes())
    add("build.sh", (RECIPE_DIR / "build.sh").read_bytes())
    for path in sorted(p for p in (RECIPE_DIR / "src").rglob("*") if p.is_file() and "__pycache__" not in p.parts):
        add(f"src/{path.relative_to(RECIPE_DIR / 'src')}", path.read_bytes())
    add("source block", json.dumps(source, sort_keys=True))
    for patch in source["patches"]:
        add(f"patch {patch}", (RECIPE_DIR / patch).resolve().read_bytes())
    add("source tarball", sha256_of(torch_source))
    add("torch", "\n".join(_torch_identity(python)))
    cxx = os.environ.get("CXX", "c++")
    add("compiler", cxx + "\n" + subprocess.run([cxx, "--version"], text=True, capture_output=True, check=True).stdout)
    for var in ("CC", "CFLAGS", "CXXFLAGS", "LDFLAGS", "CPPFLAGS"):
        add(f"env {var}", os.environ.get(var, ""))
    add("mpi", "\n".join(_mpi_identity(mpicc)))
    add("machine", os.uname().machine)
    return digest.hexdigest()[:20]


def site_packages(python: Path, prefix: Path) -> Path:
    """Where ``python`` installs packages under ``prefix`` (build.sh's pip install target)."""
    probe = "import sys, sysconfig; print(sysconfig.get_path('platlib', vars={'base': sys.argv[1], 'platbase': sys.argv[1]}))"
    return Path(subprocess.check_output([str(python), "-c", probe, str(prefix)], text=True).strip())


def prepare_source(src_dir: Path, source: dict, torch_source: Path) -> None:
    """Extract from ``torch_source`` the files the recipe's filter keeps and apply its patches, as the engine would."""
    # Only the files the recipe's filter keeps, as rattler-build would extract them.
    subprocess.run(
        ["tar", "-xf", str(torch_source), "-C", str(src_dir), "--strip-components=1", "--wildcards"]
        + [f"*/{path}" for path in source["filter"]],
        check=True,
    )
    for patch in source["patches"]:
        # No fuzz, like the engine; a patch that does not apply fails the build here.
        subprocess.run(
            ["patch", "-p1", "-F0", "--no-backup-if-mismatch", "-i", str((RECIPE_DIR / patch).resolve())],
            cwd=src_dir, check=True, capture_output=True,
        )  # fmt: skip


def _run_build(
    work: Path, prefix: Path, *, torch_version: str, source_version: str, python: Path, torch_source: Path, mpicc: str
) -> float:
    """Extract, patch and run build.sh as the engine would; the wall seconds build.sh took."""
    src_dir = work / "src"
    src_dir.mkdir(parents=True)
    prefix.mkdir(parents=True)
    prepare_source(src_dir, recipe_source(torch_version), torch_source)
    env = dict(
        os.environ,
        PREFIX=str(prefix),
        SRC_DIR=str(src_dir),
        RECIPE_DIR=str(RECIPE_DIR),
        CPU_COUNT=str(os.cpu_count() or 1),
        PYTHON=str(python),
        TORCH_MPI_BACKEND_TORCH_VERSION=torch_version,
        TORCH_MPI_BACKEND_SITE_MPI="mpich",
        TORCH_MPI_BACKEND_MPI_ROOT="",
        MPICC=mpicc,
    )
    if source_version != torch_version:
        env["TORCH_MPI_BACKEND_SOURCE_VERSION"] = source_version
    start = time.monotonic()
    result = subprocess.run(["bash", str(RECIPE_DIR / "build.sh")], env=env, text=True, capture_output=True, timeout=1200)
    seconds = time.monotonic() - start
    assert result.returncode == 0, f"build.sh failed:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    return seconds


def _prune(builds: Path, keep: Path) -> None:
    """Remove kept builds unused for KEEP_UNUSED_S (never one another process holds the lock of)."""
    now = time.time()
    for entry in builds.iterdir():
        if entry == keep or not entry.is_dir():
            continue
        marker = entry / "build.json"
        used = marker.stat().st_mtime if marker.exists() else entry.stat().st_mtime
        if now - used < KEEP_UNUSED_S:
            continue
        with open(builds / f"{entry.name}.lock", "w") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue
            shutil.rmtree(entry, ignore_errors=True)


def build(
    work: Path, *, torch_version: str, python: Path, torch_source: Path, mpicc: str, source_version: str | None = None
) -> Build:
    """The installed prefix of the variant: a kept one with the same key, else a fresh real build (then kept).

    ``work`` is a private temporary folder, used when no cache folder can be written.
    """
    source_version = source_version or torch_version
    inputs = dict(torch_version=torch_version, source_version=source_version, python=python,
                  torch_source=torch_source, mpicc=mpicc)  # fmt: skip
    builds = cache_root() / "torch-mpi-backend-builds"
    try:
        builds.mkdir(parents=True, exist_ok=True)
    except OSError:
        prefix = work / "prefix"
        seconds = _run_build(work, prefix, **inputs)
        return Build(prefix, site_packages(python, prefix), seconds, reused=False)
    entry = builds / f"{torch_version}-{build_key(**inputs)}"
    marker = entry / "build.json"
    prefix = entry / "prefix"
    with open(builds / f"{entry.name}.lock", "w") as lock:
        # One build per key at a time; the others wait for it and reuse it.
        fcntl.flock(lock, fcntl.LOCK_EX)
        if marker.exists() and os.environ.get("TORCH_MPI_BACKEND_REBUILD") != "1":
            seconds = float(json.loads(marker.read_text())["build_seconds"])
            marker.touch()
            return Build(prefix, site_packages(python, prefix), seconds, reused=True)
        # Absent, half-made (a build that died) or asked for again: build it here, mark it kept last.
        shutil.rmtree(entry, ignore_errors=True)
        try:
            seconds = _run_build(entry / "work", prefix, **inputs)
        except BaseException:
            shutil.rmtree(entry, ignore_errors=True)
            raise
        shutil.rmtree(entry / "work", ignore_errors=True)
        marker.write_text(json.dumps({"build_seconds": round(seconds, 1), "torch_version": torch_version,
                                      "source_version": source_version, "built_at": time.time()}) + "\n")  # fmt: skip
    _prune(builds, entry)
    return Build(prefix, site_packages(python, prefix), seconds, reused=False)


# The variants the tests build: (torch version, the variable naming its Python, the source version it compiles).
VARIANTS = (("2.6.0", "TORCH_MPI_BACKEND_PYTHON", None), ("2.14.1", "TORCH_MPI_BACKEND_PYTHON_2_14", "2.6.0"))


def main() -> int:
    """``python3 tests/torch_mpi_backend_build.py``: build (or find kept) every variant the tests use, with the
    variables ``eval "$(bash .ci/torch-mpi-backend.sh)"`` exports, before the test run: CI runs it so that
    a cold cache's compiles (about a minute of CPU each) are not part of the test run's time. The tests
    then take the kept prefixes; without this step they build them themselves. Exit 2 when a variable
    or mpicc is missing."""
    import tempfile

    source = os.environ.get("TORCH_MPI_BACKEND_TORCH_SOURCE", "")
    mpicc = shutil.which("mpicc")
    for torch_version, variable, source_version in VARIANTS:
        python = os.environ.get(variable, "")
        if not python or not source or mpicc is None:
            print(f"torch_mpi_backend_build: {variable}, TORCH_MPI_BACKEND_TORCH_SOURCE and mpicc are needed; "
                  f'run eval "$(bash .ci/torch-mpi-backend.sh)" first', file=sys.stderr)  # fmt: skip
            return 2
        print(f"torch_mpi_backend_build: torch-mpi-backend for torch {torch_version} ...", file=sys.stderr, flush=True)
        with tempfile.TemporaryDirectory(prefix="torch-mpi-backend-") as work:
            made = build(Path(work), torch_version=torch_version, python=Path(python), torch_source=Path(source),
                         mpicc=mpicc, source_version=source_version)  # fmt: skip
        how = "kept from an earlier run" if made.reused else f"built in {made.build_seconds:.0f} s"
        print(f"torch_mpi_backend_build: torch {torch_version}: {how} ({made.prefix})", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
