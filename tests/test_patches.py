"""`channelsmith patches check|port` against real upstream PyTorch source (Debian's 2.6.0 source package).

The patch series here are written by the tests themselves against the real 2.6.0 file (so they are
known to be right or, when planted, known to be wrong); the tree they apply to is Debian's .orig
tarball of PyTorch 2.6.0, obtained with apt (the cache keeps it between runs).
"""

from __future__ import annotations

import json
import re
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from channelsmith.errors import PatchError, SourceError
from channelsmith.patches import (
    COMPILED,
    FAILED,
    UNVERIFIABLE,
    VERIFIED,
    check,
    compile_check,
    parse_patch,
    port,
)
from channelsmith.patches.compiling import cxx_standard
from channelsmith.sources import (
    HEADER_WHEEL_PLATFORMS,
    LINUX_WHEEL_PLATFORMS,
    SourceFinder,
    SourceTree,
    cache_root,
    cached_wheel,
    wheel_headers,
)

REPO = Path(__file__).resolve().parents[1]
MPI_FILE = "torch/csrc/distributed/c10d/ProcessGroupMPI.cpp"
NCCL_HEADER = "torch/csrc/cuda/nccl.h"
RELEASE = "https://github.com/pytorch/pytorch/releases/download/v{v}/pytorch-v{v}.tar.gz"
FAKE_SHA = "0" * 64  # the release download is never attempted: every finder here is offline

HEADER = """\
What: Let Cray MPICH's MPICH_GPU_SUPPORT_ENABLED decide CUDA awareness
Why: Cray MPICH has no MPIX_Query_cuda_support; without this every CUDA tensor is refused
Upstream: https://github.com/pytorch/pytorch/issues/97507
Versions: {versions}
---
"""

OLD_CHECK = "bool cudaAwareMpiCheck() {\n// Run time check\n"
NEW_CHECK = (
    "bool cudaAwareMpiCheck() {\n"
    "  // Cray MPICH reports CUDA awareness in its environment.\n"
    '  if (const char* gpu = std::getenv("MPICH_GPU_SUPPORT_ENABLED")) {\n'
    '    return std::string(gpu) == "1";\n'
    "  }\n"
    "// Run time check\n"
)


def debian_tree() -> SourceTree:
    """Debian's PyTorch 2.6.0 .orig tarball, from the real cache (apt downloads it there when missing)."""
    found = SourceFinder(cache_root(), offline=True).find("pytorch", "2.6.0")
    if found.tree is None:
        pytest.skip(f"Debian's PyTorch 2.6.0 source package is not obtainable here: {found.why_not}")
    return found.tree


def git_diff(base: Path, old: str | None, new: str | None) -> str:
    left = f"a/{old}" if old else "/dev/null"
    right = f"b/{new}" if new else "/dev/null"
    result = subprocess.run(
        ["git", "diff", "--no-index", "--src-prefix=", "--dst-prefix=", "--", left, right],
        cwd=base, capture_output=True, text=True,
    )
    assert result.returncode in (0, 1), result.stderr
    return result.stdout


def make_patch(tree: SourceTree, work: Path, path: str, old: str, new: str) -> str:
    """A git-style diff of one real upstream file with ``old`` replaced by ``new``."""
    tree.extract([path], work / "a")
    text = (work / "a" / path).read_text()
    assert old in text, f"{path} of {tree.version} changed; the fixture needs updating"
    (work / "b" / path).parent.mkdir(parents=True, exist_ok=True)
    (work / "b" / path).write_text(text.replace(old, new, 1))
    return git_diff(work, path, path)


def make_repo(tmp_path: Path, patches: dict[str, str], versions: tuple[str, ...] = ("2.6.0",)) -> Path:
    """A repository with one recipe whose source at each version lists that version's demo patches.

    ``patches`` maps 'VERSION/NAME.patch' to the patch text.
    """
    root = tmp_path / "repo"
    (root / "recipes" / "toy").mkdir(parents=True)
    shutil.copy(REPO / "conda_build_config.yaml", root / "conda_build_config.yaml")
    blocks = []
    for version in versions:
        names = sorted(p.split("/", 1)[1] for p in patches if p.startswith(version + "/"))
        listed = "".join(f"        - ../../patches/pytorch/{version}/demo/{n}\n" for n in names)
        blocks.append(
            f'  - if: pytorch_version == "{version}"\n    then:\n'
            f"      # sha256: a test fixture, never downloaded\n"
            f"      url: {RELEASE.format(v=version)}\n      sha256: {FAKE_SHA}\n"
            + (f"      patches:\n{listed}" if listed else "")
        )
    (root / "recipes" / "toy" / "recipe.yaml").write_text(
        "context:\n  version: ${{ pytorch_version }}\npackage:\n  name: toy-torch\n  version: ${{ version }}\n"
        "source:\n" + "".join(blocks) + "build:\n  number: 0\n  noarch: generic\nabout:\n  license: MIT\n"
    )
    (root / "recipes" / "toy" / "variants.yaml").write_text(
        "pytorch_version:\n" + "".join(f'  - "{v}"\n' for v in versions)
    )
    for rel, text in patches.items():
        target = root / "patches" / "pytorch" / rel.split("/", 1)[0] / "demo" / rel.split("/", 1)[1]
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    return root


def finder(tmp_path: Path, given: SourceTree | None = None) -> SourceFinder:
    """An offline finder whose cache holds only Debian's source packages (the real ones, shared) and the
    files already unpacked from them."""
    cache = tmp_path / "cache"
    cache.mkdir(exist_ok=True)
    for shared in ("debian", "unpacked"):
        (cache_root() / shared).mkdir(parents=True, exist_ok=True)
        if not (cache / shared).exists():
            (cache / shared).symlink_to(cache_root() / shared)
    return SourceFinder(cache, given=given, offline=True)


def run_cli(root: Path, *args: str, cache: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, CHANNELSMITH_OFFLINE="1")
    if cache is not None:
        env["CHANNELSMITH_CACHE"] = str(cache)
    return subprocess.run(
        [sys.executable, "-m", "channelsmith", "--root", str(root), *args],
        capture_output=True, text=True, env=env,
    )


@pytest.fixture(scope="module")
def tree() -> SourceTree:
    return debian_tree()


@pytest.fixture(scope="module")
def good_patch(tree: SourceTree, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A patch written against the real 2.6.0 ProcessGroupMPI.cpp: it must apply."""
    work = tmp_path_factory.mktemp("diff")
    return HEADER.format(versions="2.6.0") + make_patch(tree, work, MPI_FILE, OLD_CHECK, NEW_CHECK)


def test_series_that_applies_is_verified_from_debian(tmp_path: Path, good_patch: str) -> None:
    new_file = HEADER.format(versions="2.6.0") + (
        "diff --git a/torch/csrc/distributed/c10d/CrayEnv.hpp b/torch/csrc/distributed/c10d/CrayEnv.hpp\n"
        "new file mode 100644\n--- /dev/null\n+++ b/torch/csrc/distributed/c10d/CrayEnv.hpp\n"
        "@@ -0,0 +1 @@\n+#pragma once\n"
    )
    root = make_repo(tmp_path, {"2.6.0/0001-cray-gpu-env.patch": good_patch, "2.6.0/0002-new-header.patch": new_file})
    results = check(root, finder(tmp_path))
    assert [(r.series, r.version, r.status, r.patches) for r in results] == [("pytorch/demo", "2.6.0", VERIFIED, 2)]
    assert results[0].source.startswith("debian: Debian pytorch 2.6.0")


def test_planted_bad_hunk_is_failed_with_the_hunk(tmp_path: Path, good_patch: str) -> None:
    bad = good_patch.replace(" // Run time check\n", " // Run-time check (planted)\n", 1)
    root = make_repo(tmp_path, {"2.6.0/0001-cray-gpu-env.patch": bad})
    [result] = check(root, finder(tmp_path))
    assert result.status == FAILED
    [failure] = result.failures
    assert failure.file == MPI_FILE
    assert failure.hunk.startswith("@@ -49,6 +49,10 @@")
    assert "-// Run-time check (planted)" in "\n".join(failure.mismatches)
    assert "+// Run time check" in "\n".join(failure.mismatches)


def test_later_patches_are_not_reached_after_a_failure(tmp_path: Path, good_patch: str) -> None:
    bad = good_patch.replace(" // Run time check\n", " // changed\n", 1)
    root = make_repo(tmp_path, {"2.6.0/0001-bad.patch": bad})
    other = root / "patches" / "pytorch" / "2.6.0" / "other" / "0001-good.patch"
    other.parent.mkdir(parents=True)
    other.write_text(good_patch)
    recipe = root / "recipes" / "toy" / "recipe.yaml"
    recipe.write_text(recipe.read_text().replace(
        "0001-bad.patch\n", "0001-bad.patch\n        - ../../patches/pytorch/2.6.0/other/0001-good.patch\n"))
    statuses = {r.series: r.status for r in check(root, finder(tmp_path))}
    assert statuses == {"pytorch/demo": FAILED, "pytorch/other": UNVERIFIABLE}


def test_version_without_obtainable_source_is_unverifiable(tmp_path: Path, good_patch: str) -> None:
    patch_240 = good_patch.replace("Versions: 2.6.0", "Versions: 2.4.0")
    root = make_repo(
        tmp_path, {"2.6.0/0001-cray-gpu-env.patch": good_patch, "2.4.0/0001-cray-gpu-env.patch": patch_240},
        versions=("2.6.0", "2.4.0"),
    )
    results = {r.version: r for r in check(root, finder(tmp_path))}
    assert results["2.6.0"].status == VERIFIED
    assert results["2.4.0"].status == UNVERIFIABLE
    assert "offline" in results["2.4.0"].reason
    assert "not 2.4.0" in results["2.4.0"].reason  # Debian lists other versions only


def test_cli_check_table_json_and_strict(tmp_path: Path, good_patch: str) -> None:
    patch_240 = good_patch.replace("Versions: 2.6.0", "Versions: 2.4.0")
    root = make_repo(
        tmp_path, {"2.6.0/0001-a.patch": good_patch, "2.4.0/0001-a.patch": patch_240}, versions=("2.6.0", "2.4.0")
    )
    finder(tmp_path)
    cache = tmp_path / "cache"
    table = run_cli(root, "patches", "check", cache=cache)
    assert table.returncode == 0, table.stderr
    assert "verified" in table.stdout and "unverifiable" in table.stdout
    strict = run_cli(root, "patches", "check", "--strict", cache=cache)
    assert strict.returncode == 1
    data = json.loads(run_cli(root, "patches", "check", "--json", "--version", "2.6.0", cache=cache).stdout)
    assert [r["status"] for r in data["results"]] == [VERIFIED]


def test_reconstructed_series_is_marked_in_table_and_json(tmp_path: Path, good_patch: str) -> None:
    # A series whose header says Reconstructed: applies to real source like any other, and every report
    # of it says that what it produces is not the release's file.
    marked = good_patch.replace(
        "---\n", "Reconstructed: not the 9.9.9 release's file; 2.6.0's adapted to its header\n---\n", 1
    )
    assert parse_patch_text(tmp_path, marked).header.reconstructed.startswith("not the 9.9.9 release's file")
    root = make_repo(tmp_path, {"2.6.0/0001-a.patch": marked})
    [result] = check(root, finder(tmp_path))
    assert result.status == VERIFIED
    assert result.reconstructed == "not the 9.9.9 release's file; 2.6.0's adapted to its header"
    cache = tmp_path / "cache"
    table = run_cli(root, "patches", "check", cache=cache)
    assert table.returncode == 0, table.stderr
    assert "pytorch/demo (reconstructed)" in table.stdout
    assert "RECONSTRUCTED pytorch/demo 2.6.0 (toy): not the 9.9.9 release's file" in table.stdout
    data = json.loads(run_cli(root, "patches", "check", "--json", cache=cache).stdout)
    assert data["results"][0]["reconstructed"].startswith("not the 9.9.9 release's file")
    plain = make_repo(tmp_path / "plain", {"2.6.0/0001-a.patch": good_patch})
    [ordinary] = check(plain, finder(tmp_path))
    assert ordinary.reconstructed == ""


def test_compiles_against_names_the_headers_of_a_reconstructed_series(tmp_path: Path, good_patch: str) -> None:
    # compile-check reads it to pick the release wheel's headers (the repository's torch-2.11-compat series
    # compiles against 2.11.0's; against its source's 2.6.0 headers it fails: "abort() marked override").
    marked = good_patch.replace("---\n", "Compiles-Against: 2.11.0\n---\n", 1)
    assert parse_patch_text(tmp_path, marked).header.compiles_against == ("2.11.0",)
    assert parse_patch_text(tmp_path, good_patch).header.compiles_against == ()
    compat = sorted((REPO / "patches/pytorch/2.6.0/torch-2.11-compat").glob("*.patch"))
    assert compat and {parse_patch(p).header.compiles_against for p in compat} == {("2.11.0",)}
    # One series may serve several releases that share its header: each is compiled against.
    shared = good_patch.replace("---\n", "Compiles-Against: 2.14.1 2.15.0\n---\n", 1)
    assert parse_patch_text(tmp_path, shared).header.compiles_against == ("2.14.1", "2.15.0")
    compat = sorted((REPO / "patches/pytorch/2.6.0/torch-2.14-compat").glob("*.patch"))
    assert compat and {parse_patch(p).header.compiles_against for p in compat} == {("2.14.1", "2.15.0")}


def parse_patch_text(tmp_path: Path, text: str):
    path = tmp_path / "one.patch"
    path.write_text(text)
    return parse_patch(path)


def test_source_dir_of_wrong_version_is_refused(tmp_path: Path, tree: SourceTree, good_patch: str) -> None:
    fake = tmp_path / "tree"
    tree.extract([MPI_FILE], fake)
    (fake / "version.txt").write_text("2.4.0a0\n")
    root = make_repo(tmp_path, {"2.6.0/0001-a.patch": good_patch})
    result = run_cli(root, "patches", "check", "--source", str(fake), cache=tmp_path / "cache")
    assert result.returncode == 2
    assert "2.4.0" in result.stderr and "2.6.0" in result.stderr


def test_source_dir_of_right_version_is_used(tmp_path: Path, tree: SourceTree, good_patch: str) -> None:
    given = tmp_path / "tree"
    tree.extract([MPI_FILE, "version.txt"], given)
    root = make_repo(tmp_path, {"2.6.0/0001-a.patch": good_patch})
    result = run_cli(root, "patches", "check", "--json", "--source", str(given), cache=tmp_path / "empty")
    assert result.returncode == 0, result.stderr
    [row] = json.loads(result.stdout)["results"]
    assert row["status"] == VERIFIED and row["source"] == f"directory: {given}"


def test_tarball_with_wrong_sha256_is_refused(tmp_path: Path, good_patch: str) -> None:
    root = make_repo(tmp_path, {"2.6.0/0001-a.patch": good_patch})
    tarballs = tmp_path / "cache" / "tarballs"
    tarballs.mkdir(parents=True)
    (tarballs / "pytorch-v2.6.0.tar.gz").write_bytes(b"not the release")
    result = run_cli(root, "patches", "check", cache=tmp_path / "cache")
    assert result.returncode == 2
    assert "refusing it" in result.stderr and FAKE_SHA in result.stderr


def test_malformed_header_is_exit_2(tmp_path: Path, good_patch: str) -> None:
    headless = good_patch.replace("Why: ", "Reason: ", 1)
    root = make_repo(tmp_path, {"2.6.0/0001-a.patch": headless})
    result = run_cli(root, "patches", "check", cache=tmp_path / "cache")
    assert result.returncode == 2
    assert "Why:" in result.stderr
    with pytest.raises(PatchError):
        parse_patch(root / "patches" / "pytorch" / "2.6.0" / "demo" / "0001-a.patch")


def test_unknown_version_and_series_are_exit_2(tmp_path: Path, good_patch: str) -> None:
    root = make_repo(tmp_path, {"2.6.0/0001-a.patch": good_patch})
    version = run_cli(root, "patches", "check", "--version", "9.9.9", cache=tmp_path / "cache")
    assert version.returncode == 2 and "2.6.0" in version.stderr
    series = run_cli(root, "patches", "port", "pytorch/nosuch", "--from", "2.6.0", "--to", "2.4.0")
    assert series.returncode == 2 and "pytorch/demo" in series.stderr
    from_version = run_cli(root, "patches", "port", "pytorch/demo", "--from", "1.0.0", "--to", "2.6.0")
    assert from_version.returncode == 2 and "versions of pytorch/demo: 2.6.0" in from_version.stderr


def test_port_regenerates_diffs_on_a_shifted_tree_and_reports_rejects(
    tmp_path: Path, tree: SourceTree, good_patch: str
) -> None:
    """Port onto a tree derived from the real 2.6.0 one: lines moved (offset) and one hunk's context changed."""
    other = HEADER.format(versions="2.6.0") + make_patch(
        tree, tmp_path / "diff2", NCCL_HEADER, "  InProgress = 7,\n", "  InProgress = 7,\n  Reserved = 8,\n"
    )
    root = make_repo(tmp_path, {"2.6.0/0001-cray-gpu-env.patch": good_patch, "2.6.0/0002-nccl.patch": other})
    derived = tmp_path / "derived"
    tree.extract([MPI_FILE, NCCL_HEADER, "version.txt"], derived)
    (derived / "version.txt").write_text("2.6.1\n")
    mpi = derived / MPI_FILE
    mpi.write_text("// three\n// new\n// lines\n" + mpi.read_text())
    nccl = derived / NCCL_HEADER
    nccl.write_text(nccl.read_text().replace("  RemoteError = 6,\n", "  RemoteError = 6, // moved\n"))
    given = SourceTree("pytorch", "2.6.1", "directory", derived, str(derived))
    result = port(root, "pytorch/demo", "2.6.0", "2.6.1", finder(tmp_path, given), tmp_path / "report")
    assert not result.clean
    clean, rejected = result.patches
    assert clean.rejected == () and rejected.rejected[0].file == NCCL_HEADER
    written = (root / clean.written).read_text()
    assert "Versions: 2.6.1\n---\n" in written and "@@ -52,6 +52,10 @@" in written
    assert written.startswith("What: Let Cray MPICH")
    assert Path(rejected.rejects_file).is_file() and rejected.written is None
    assert not (root / "patches" / "pytorch" / "2.6.1" / "demo" / "0002-nccl.patch").exists()
    assert (tmp_path / "report" / "0002-nccl.patch.partial").is_file()
    assert "pytorch_version == \"2.6.1\"" in result.recipe_block
    assert "patches/pytorch/2.6.1/demo/0001-cray-gpu-env.patch" in result.recipe_block
    # The ported patch applies to the tree it was made for: check it there.
    recipe = root / "recipes" / "toy" / "recipe.yaml"
    recipe.write_text(recipe.read_text().replace("2.6.0", "2.6.1").replace(
        "        - ../../patches/pytorch/2.6.1/demo/0002-nccl.patch\n", ""))
    (root / "recipes" / "toy" / "variants.yaml").write_text('pytorch_version:\n  - "2.6.1"\n')
    [checked] = check(root, finder(tmp_path, given))
    assert checked.status == VERIFIED
    assert not list((root / "patches").rglob("*.rej"))


def test_port_between_two_real_versions(tmp_path: Path, tree: SourceTree) -> None:
    """A header series written against the real 2.6.0 tree (Debian) ported onto the real 2.4.0 headers
    (PyTorch's 2.4.0 release wheel carries torch/include): regenerated, re-checked, applied."""
    try:
        headers_240 = wheel_headers(cache_root(), "2.4.0")
    except SourceError as exc:
        pytest.skip(f"the torch 2.4.0 wheel is not obtainable here: {exc.message}")
    series = HEADER.format(versions="2.6.0") + make_patch(
        tree, tmp_path / "diff", NCCL_HEADER, "  InProgress = 7,\n", "  InProgress = 7,\n  Reserved = 8,\n"
    )
    root = make_repo(tmp_path, {"2.6.0/0001-nccl-reserved.patch": series})
    result = port(root, "pytorch/demo", "2.6.0", "2.4.0", finder(tmp_path, headers_240), tmp_path / "report")
    assert result.clean, result.patches
    assert result.source.startswith("wheel headers: torch-2.4.0-")
    ported = root / "patches" / "pytorch" / "2.4.0" / "demo" / "0001-nccl-reserved.patch"
    text = ported.read_text()
    assert "Versions: 2.4.0\n---\ndiff --git a/torch/csrc/cuda/nccl.h b/torch/csrc/cuda/nccl.h\n" in text
    assert "+  Reserved = 8,\n" in text
    # The regenerated diff applies to the 2.4.0 headers with no offset and yields the intended line.
    scratch = tmp_path / "apply"
    headers_240.extract([NCCL_HEADER], scratch)
    applied = subprocess.run(["git", "apply", "-p1", "--verbose", str(ported)], cwd=scratch,
                             capture_output=True, text=True, env=dict(os.environ, GIT_CEILING_DIRECTORIES=str(tmp_path)))
    assert applied.returncode == 0 and "offset" not in applied.stderr, applied.stderr
    assert "  InProgress = 7,\n  Reserved = 8,\n" in (scratch / NCCL_HEADER).read_text()
    assert sorted(p.relative_to(root).as_posix() for p in (root / "patches").rglob("*.patch")) == [
        "patches/pytorch/2.4.0/demo/0001-nccl-reserved.patch", "patches/pytorch/2.6.0/demo/0001-nccl-reserved.patch"]


@pytest.mark.heavy
def test_compile_check_compiles_patched_unit_and_catches_a_broken_one(tmp_path: Path, good_patch: str) -> None:
    """-fsyntax-only of the patched ProcessGroupMPI.cpp against torch 2.6.0's Linux x86-64 wheel headers and
    mpi.h (~30 s each; the 731 MiB wheel is downloaded once into the cache)."""
    if shutil.which("g++") is None or subprocess.run(["pkg-config", "--exists", "mpich"]).returncode != 0:
        pytest.skip("needs g++ and MPICH's headers (apt-get install g++ libmpich-dev)")
    broken = good_patch.replace('+    return std::string(gpu) == "1";\n', '+    return std::string(gpu) == ;\n')
    root = make_repo(tmp_path, {"2.6.0/0001-a.patch": good_patch})
    [unit] = compile_check(root, finder(tmp_path), cache_root(), ["toy"])
    assert (unit.unit, unit.status) == (MPI_FILE, COMPILED), unit.log
    assert unit.detail.endswith("torch 2.6.0 headers of torch-2.6.0-cp311-cp311-manylinux1_x86_64.whl"), unit.detail
    (root / "patches" / "pytorch" / "2.6.0" / "demo" / "0001-a.patch").write_text(broken)
    [unit] = compile_check(root, finder(tmp_path), cache_root(), ["toy"])
    assert unit.status == FAILED
    assert "ProcessGroupMPI.cpp" in unit.detail and "expected primary-expression" in unit.log


def test_port_of_a_real_series_onto_real_2_6_0(tmp_path: Path) -> None:
    """The repository's cuda-aware-mpi series for 2.4.0 (written against real 2.4.0) ported onto Debian's
    real 2.6.0 tree: it regenerates cleanly and the result is verified against 2.6.0."""
    real = REPO / "patches" / "pytorch" / "2.4.0" / "cuda-aware-mpi"
    if not list(real.glob("*.patch")):
        pytest.skip("the repository has no pytorch/cuda-aware-mpi series for 2.4.0")
    debian_tree()
    root = make_repo(tmp_path, {})
    shutil.copytree(real, root / "patches" / "pytorch" / "2.4.0" / "cuda-aware-mpi")
    result = port(root, "pytorch/cuda-aware-mpi", "2.4.0", "2.6.0", finder(tmp_path), tmp_path / "report")
    assert result.clean, result.patches
    written = [root / p.written for p in result.patches]
    assert all("Versions: 2.6.0\n---\n" in p.read_text() for p in written)
    listed = "".join(f"        - ../../{p.relative_to(root).as_posix()}\n" for p in written)
    recipe = root / "recipes" / "toy" / "recipe.yaml"
    recipe.write_text(recipe.read_text().replace(f"      sha256: {FAKE_SHA}\n", f"      sha256: {FAKE_SHA}\n      patches:\n{listed}"))
    [checked] = check(root, finder(tmp_path))
    assert (checked.series, checked.status) == ("pytorch/cuda-aware-mpi", VERIFIED)


def test_compile_standard_is_the_one_the_release_headers_demand(tmp_path: Path) -> None:
    # 2.14's ATen.h refuses anything older than C++20 ("#error C++20 or later compatible compiler is
    # required"), 2.11's asks for C++17: compile-check must pass what the headers ask for.
    for marker, flag in (("C++20 or later", "-std=c++20"), ("C++17 or later", "-std=c++17")):
        include = tmp_path / flag / "include"
        (include / "ATen").mkdir(parents=True)
        (include / "ATen" / "ATen.h").write_text(f"#error {marker} compatible compiler is required to use ATen.\n")
        assert cxx_standard(include) == flag
    assert cxx_standard(tmp_path / "no-headers") == "-std=c++17"


@pytest.mark.heavy
def test_compile_check_compiles_a_shared_series_against_every_release_it_names() -> None:
    """The repository's torch-2.14-compat series names 2.14.1 and 2.15.0: each release wheel's headers
    compile its units (about a minute; downloads two Linux x86-64 wheels of about 530 MB once)."""
    if shutil.which("g++") is None or subprocess.run(["pkg-config", "--exists", "mpich"]).returncode != 0:
        pytest.skip("needs g++ and MPICH's headers (apt-get install g++ libmpich-dev)")
    debian_tree()
    try:
        units = compile_check(REPO, SourceFinder(cache_root(), offline=True), cache_root(), ["torch-mpi-backend"],
                              ["2.6.0"])
    except SourceError as exc:
        pytest.skip(f"a release wheel is not obtainable here: {exc.message}")
    shared = [u for u in units if u.series == "pytorch/torch-2.14-compat"]
    # Rows say which builds of the backend they are for, as `patches check` does.
    assert {u.builds for u in shared} == {("2.14.1", "2.15.0")}
    assert {u.builds for u in units if u.series == "pytorch/cuda-aware-mpi"} == {
        ("2.6.0",), ("2.11.0",), ("2.14.1", "2.15.0")}
    assert {re.search(r"torch (\S+) headers", u.detail).group(1) for u in shared} == {"2.14.1", "2.15.0"}
    # Every unit was compiled against the Linux x86-64 wheel's headers, the platform the recipes build.
    assert all(re.search(r"headers of torch-\S+-(manylinux\w+_x86_64)\.whl$", u.detail) for u in units), units
    assert all(u.status == COMPILED for u in units if u.version == "2.6.0"), [u.log for u in units if u.log]


def test_check_says_which_package_versions_each_row_is_for(tmp_path: Path) -> None:
    """One release's series in several builds' patch lists (as torch-mpi-backend 2.11.0 and 2.14.1 patch
    2.6.0's source): each row names the package versions it is for, instead of repeating itself."""
    root = tmp_path / "repo"
    (root / "recipes" / "toy").mkdir(parents=True)
    shutil.copy(REPO / "conda_build_config.yaml", root / "conda_build_config.yaml")
    work = tmp_path / "diff"
    for side, text in (("a", "one\n"), ("b", "two\n")):
        (work / side).mkdir(parents=True)
        (work / side / "f.txt").write_text(text)
    for series in ("base", "compat"):
        patch = root / "patches" / "toyproj" / "1.0" / series / "0001-x.patch"
        patch.parent.mkdir(parents=True)
        patch.write_text(HEADER.format(versions="1.0") + git_diff(work, "f.txt", "f.txt"))
    listed = {"1.0": ["base"], "1.1": ["base"], "1.2": ["base", "compat"]}
    blocks = "".join(
        f'  - if: toy_version == "{version}"\n    then:\n'
        f"      # sha256: a test fixture, never downloaded (offline)\n"
        f"      url: https://example.invalid/toyproj-1.0.tar.gz\n      sha256: {FAKE_SHA}\n      patches:\n"
        + "".join(f"        - ../../patches/toyproj/1.0/{s}/0001-x.patch\n" for s in series)
        for version, series in listed.items()
    )
    (root / "recipes" / "toy" / "recipe.yaml").write_text(
        "package:\n  name: toy\n  version: ${{ toy_version }}\nsource:\n" + blocks
        + "build:\n  number: 0\n  noarch: generic\nabout:\n  license: MIT\n"
    )
    (root / "recipes" / "toy" / "variants.yaml").write_text('toy_version:\n  - "1.2"\n  - "1.0"\n  - "1.1"\n')
    result = run_cli(root, "patches", "check", "toy", "--json", cache=tmp_path / "cache")
    rows = [(r["series"], r["version"], r["builds"]) for r in json.loads(result.stdout)["results"]]
    assert rows == [
        ("toyproj/base", "1.0", ["1.0", "1.1"]),
        ("toyproj/base", "1.0", ["1.2"]),
        ("toyproj/compat", "1.0", ["1.2"]),
    ], result.stderr
    table = run_cli(root, "patches", "check", "toy", cache=tmp_path / "cache").stdout
    assert "for package version" in table
    assert [" ".join(line.split("│")[2].split()) for line in table.splitlines() if "toyproj/" in line] == [
        "1.0, 1.1", "1.2", "1.2"
    ]


def test_the_compile_check_takes_the_linux_wheel_even_when_the_macos_one_is_cached(tmp_path: Path) -> None:
    """The macOS arm64 wheel of a release differs from the Linux x86-64 one in headers the patched units
    include (docs/howto/newer-pytorch.md): a cached macOS wheel of the release is not taken for the compile check."""
    folder = tmp_path / "wheels"
    folder.mkdir()
    mac = folder / "torch-2.6.0-cp311-none-macosx_11_0_arm64.whl"
    mac.touch()
    assert cached_wheel(folder, "torch", "2.6.0", LINUX_WHEEL_PLATFORMS) is None
    assert cached_wheel(folder, "torch", "2.6.0", HEADER_WHEEL_PLATFORMS) == mac
    linux = folder / "torch-2.6.0-cp311-cp311-manylinux1_x86_64.whl"
    linux.touch()
    assert cached_wheel(folder, "torch", "2.6.0", LINUX_WHEEL_PLATFORMS) == linux
    assert "manylinux1_x86_64" in LINUX_WHEEL_PLATFORMS and "manylinux_2_28_x86_64" in LINUX_WHEEL_PLATFORMS
