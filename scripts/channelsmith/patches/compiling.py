"""`patches compile-check`: every C++ unit a PyTorch series touches, patched, compiled (-fsyntax-only)
against the matching release wheel's headers, NCCL's, CUDA's and MPI's."""

from __future__ import annotations

import fcntl
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from channelsmith.patches.applying import apply_series
from channelsmith.patches.checking import FAILED, CheckTarget, check_targets, series_names
from channelsmith.patches.parsing import PatchFile, parse_patch
from channelsmith.sources import LINUX_WHEEL_PLATFORMS, SourceFinder, SourceTree, wheel_headers

COMPILED = "compiled"
SKIPPED = "skipped"

# What the real PyTorch build defines for the distributed and CUDA units (torch/CMakeLists.txt,
# caffe2/CMakeLists.txt): every backend a series touches is switched on, as in these recipes' builds.
BUILD_DEFINES = (
    "USE_DISTRIBUTED", "USE_C10D", "USE_C10D_MPI", "USE_C10D_NCCL", "USE_CUDA", "USE_NCCL",
    "USE_RPC", "TORCH_CUDA_BUILD_MAIN_LIB", "BUILD_CAFFE2_OPS",
)
CXX_FLAGS = ("-fsyntax-only", "-fPIC", "-w", "-D_GLIBCXX_USE_CXX11_ABI=1")
# The C++ standard a release's headers demand, read from ATen/ATen.h's own guard ("C++20 or later compatible
# compiler is required" from 2.14 on, C++17 before); the release's extension builds use the same.
CXX_STANDARDS = (("C++20 or later", "-std=c++20"), ("C++17 or later", "-std=c++17"))
DEFAULT_CXX_STANDARD = "-std=c++17"
SOURCE_SUFFIXES = (".cpp", ".cc", ".cxx")
HEADER_SUFFIXES = (".h", ".hpp", ".cuh")

# The NCCL each PyTorch release was built and tested with (its CUDA 12 wheel's nvidia-nccl-cu12 pin).
NCCL_FOR_TORCH = {"2.2": "2.19.3", "2.3": "2.20.5", "2.4": "2.20.5", "2.5": "2.21.5", "2.6": "2.21.5"}
DEFAULT_NCCL = "2.21.5"

# Source-tree folders that hold headers under another include root than the tree's top.
TREE_INCLUDE_ROOTS = ("", "aten/src/", "torch/csrc/api/include/")

MAX_HEADER_ROUNDS = 60


@dataclass(frozen=True)
class UnitResult:
    """One patched translation unit (or a unit including one patched header) and how it compiled."""

    recipe: str
    series: str
    version: str
    unit: str
    status: str
    detail: str
    log: str = ""
    # The recipe's package versions built with this unit's patch list (as `patches check` shows them).
    builds: tuple[str, ...] = ()


@dataclass(frozen=True)
class Toolchain:
    """Where the compile check finds its headers."""

    torch_include: Path
    nccl_include: Path | None
    cuda_include: Path | None
    mpi_flags: tuple[str, ...]
    cxx_standard: str = DEFAULT_CXX_STANDARD


def unpack_wheel(wheel: Path, prefix: str, cache: Path) -> Path:
    """Unpack the ``prefix`` folder of a wheel once into the cache; returns where ``prefix`` lies.

    Each prefix is unpacked and marked complete on its own, so that a second folder of the same wheel
    (NCCL's lib/ after its include/) is unpacked too; one process at a time (parallel test workers
    ask for the same folder), so nobody reads a folder another is still writing.
    """
    target = cache / "unpacked" / wheel.name
    done = target / f".complete-{prefix.strip('/').replace('/', '_')}"
    target.mkdir(parents=True, exist_ok=True)
    with open(target / ".unpack.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.is_file():
            shutil.rmtree(target / prefix, ignore_errors=True)
            with zipfile.ZipFile(wheel) as archive:
                archive.extractall(target, [n for n in archive.namelist() if n.startswith(prefix)])
            done.write_text(wheel.name)
    return target / prefix


def _nccl_wheel(cache: Path, version: str) -> Path | None:
    nccl = NCCL_FOR_TORCH.get(".".join(version.split(".")[:2]), DEFAULT_NCCL)
    folder = cache / "wheels"
    found = sorted(folder.glob(f"nvidia_nccl_cu12-{nccl}-*.whl")) if folder.is_dir() else []
    if not found:
        folder.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--platform",
             "manylinux2014_x86_64", "--python-version", "3.11", "-d", str(folder), f"nvidia-nccl-cu12=={nccl}"],
            capture_output=True, text=True,
        )
        found = sorted(folder.glob(f"nvidia_nccl_cu12-{nccl}-*.whl"))
    return found[0] if found else None


def toolchain(cache: Path, version: str) -> Toolchain:
    """The headers for compiling PyTorch ``version`` units: its release wheel's torch/include, NCCL, CUDA, MPI."""
    # The Linux x86-64 wheel, not the smaller macOS one: the units include ATen/ops/*_native.h, which differ
    # between them, and c10/cuda's and ATen/cuda's generated headers, which only the Linux wheel has
    # (docs/howto/newer-pytorch.md, "Which wheel's headers").
    torch_wheel = wheel_headers(cache, version, LINUX_WHEEL_PLATFORMS).location
    nccl_wheel = _nccl_wheel(cache, version)
    nvcc = shutil.which("nvcc")
    cuda_candidates = [Path("/usr/local/cuda/include")]
    if nvcc:
        cuda_candidates.append(Path(nvcc).resolve().parent.parent / "include")
    cuda = next((c for c in cuda_candidates if (c / "cuda_runtime_api.h").is_file()), None)
    mpi = subprocess.run(["pkg-config", "--cflags", "mpich"], capture_output=True, text=True)
    if mpi.returncode != 0:
        mpi = subprocess.run(["pkg-config", "--cflags", "ompi"], capture_output=True, text=True)
    torch_include = unpack_wheel(torch_wheel, "torch/include/", cache)
    return Toolchain(
        torch_include=torch_include,
        nccl_include=unpack_wheel(nccl_wheel, "nvidia/nccl/include/", cache) if nccl_wheel else None,
        cuda_include=cuda,
        mpi_flags=tuple(mpi.stdout.split()) if mpi.returncode == 0 else (),
        cxx_standard=cxx_standard(torch_include),
    )


def cxx_standard(torch_include: Path) -> str:
    """The -std= flag the headers under ``torch_include`` require (ATen/ATen.h says which)."""
    aten = torch_include / "ATen" / "ATen.h"
    text = aten.read_text(errors="replace") if aten.is_file() else ""
    return next((flag for marker, flag in CXX_STANDARDS if marker in text), DEFAULT_CXX_STANDARD)


class MissingHeader(Exception):
    """A header neither the upstream tree nor the toolchain here provides (e.g. cusparse.h)."""


def _compile_unit(unit: Path, patched: Path, extra: Path, tree: SourceTree, tools: Toolchain) -> tuple[bool, str]:
    """-fsyntax-only of one unit; headers the wheel lacks are taken from the upstream tree as they are asked for."""
    includes = [patched, patched / "aten/src", extra, extra / "aten/src", extra / "torch/csrc/api/include",
                tools.torch_include, tools.torch_include / "torch/csrc/api/include"]
    includes += [p for p in (tools.nccl_include, tools.cuda_include) if p is not None]
    command = ["g++", tools.cxx_standard, *CXX_FLAGS, *(f"-D{d}" for d in BUILD_DEFINES), *tools.mpi_flags,
               *(f"-I{p}" for p in includes), str(unit)]
    output = ""
    for _round in range(MAX_HEADER_ROUNDS):
        result = subprocess.run(command, capture_output=True, text=True)
        output = result.stderr
        if result.returncode == 0:
            return True, output
        missing = re.search(r"fatal error: (\S+): No such file or directory", output)
        if not missing:
            return False, output
        header = missing.group(1)
        candidates = [root + header for root in TREE_INCLUDE_ROOTS if tree.has(root + header)]
        if not candidates:
            raise MissingHeader(header)
        tree.extract(candidates[:1], extra)
    return False, output


def compile_check(
    root: Path,
    finder: SourceFinder,
    cache: Path,
    recipe_names: Iterable[str] = (),
    versions: Iterable[str] = (),
    progress: Callable[[str], None] | None = None,
) -> list[UnitResult]:
    """Compile every unit the PyTorch series touch, patched, against the matching release headers.

    ``progress`` is told each step as it starts (finding a tree, applying, fetching headers, each
    compile: the steps that take seconds to minutes).
    """
    show = progress or _quiet
    results: list[UnitResult] = []
    # Recipes that share a version and a patch list share the verdict: each unit compiles once (~30 s).
    verdicts: dict[tuple, UnitResult] = {}
    for target in check_targets(root, recipe_names, versions):
        if target.project != "pytorch":
            continue
        names = series_names(root, target)
        parsed = [parse_patch(p) for p in target.patches]
        label = f"{target.recipe} (pytorch {target.version})"
        show(f"{label}: finding the upstream tree")
        obtained = finder.find(target.project, target.version, target.release)

        if obtained.tree is None or obtained.tree.partial:
            results.extend(_skipped(target, names, parsed, f"no upstream tree: {obtained.why_not}"))
            continue
        # A reconstructed series may adapt one release's files to other releases' headers, each of which
        # it must compile against.
        releases = next((p.header.compiles_against for p in parsed if p.header.compiles_against), (target.version,))
        with tempfile.TemporaryDirectory(prefix="channelsmith-compile-") as scratch_name:
            scratch = Path(scratch_name)
            show(f"{label}: applying {len(parsed)} patch(es) to the {obtained.tree.kind} tree")
            outcome = apply_series(obtained.tree, parsed, scratch / "tree")
            if outcome.failures or outcome.missing:
                results.extend(_skipped(target, names, parsed, "the series does not apply; run `channelsmith patches check`"))
                continue
            for headers in releases:
                show(f"{label}: torch {headers} headers (its release wheel, downloaded once into the cache)")
                tools = toolchain(cache, headers)
                done: set[str] = set()
                for patch in parsed:
                    for path in sorted(patch.touched - done):
                        done.add(path)
                        key = (target.version, tuple(p.read_bytes() for p in target.patches), path, headers)
                        if key not in verdicts:
                            show(f"{label}: compiling {path} against torch {headers} headers")
                            verdicts[key] = _unit_result(target, names[patch.path], path, scratch, obtained.tree,
                                                         tools, headers)
                        shared = verdicts[key]
                        results.append(UnitResult(target.recipe, names[patch.path], target.version, path,
                                                  shared.status, shared.detail, shared.log, target.builds))
    return results


def _quiet(message: str) -> None:
    return None


def _skipped(target: CheckTarget, names: Mapping[Path, str], parsed: list[PatchFile], detail: str) -> list[UnitResult]:
    return [
        UnitResult(target.recipe, names[patch.path], target.version, path, SKIPPED, detail, builds=target.builds)
        for patch in parsed
        for path in sorted(patch.touched)
    ]


def _unit_result(target: CheckTarget, series: str, path: str, scratch: Path, tree: SourceTree,
                 tools: Toolchain, headers: str) -> UnitResult:
    patched = scratch / "tree"
    if path.endswith(SOURCE_SUFFIXES):
        unit = patched / path
    elif path.endswith(HEADER_SUFFIXES):
        unit = scratch / "units" / (path.replace("/", "_") + ".cpp")
        unit.parent.mkdir(parents=True, exist_ok=True)
        unit.write_text(f'#include "{patched / path}"\n')
    else:
        return UnitResult(target.recipe, series, target.version, path, SKIPPED, "not C++ (no unit to compile)")
    if not (patched / path).is_file():
        return UnitResult(target.recipe, series, target.version, path, SKIPPED, "deleted by the series")
    try:
        ok, log = _compile_unit(unit, patched, scratch / "extra", tree, tools)
    except MissingHeader as missing:
        return UnitResult(target.recipe, series, target.version, path, SKIPPED,
                          f"needs {missing}, which neither the upstream tree nor the headers here provide")
    if ok:
        kind = "unit" if path.endswith(SOURCE_SUFFIXES) else "header, through a unit including it"
        wheel = tools.torch_include.parent.parent.name  # <cache>/unpacked/<wheel>/torch/include
        return UnitResult(target.recipe, series, target.version, path, COMPILED,
                          f"{kind}; torch {headers} headers of {wheel}")
    first = next((line for line in log.splitlines() if "error" in line), log.strip()[:200])
    return UnitResult(target.recipe, series, target.version, path, FAILED, first, log)
