"""The PyTorch recipes pytorch-nccl-fault and pytorch-cray-mpich, their patch series and test scripts.

Offline and fast: rendering, the plan's shared libtorch compiles, the patch lists per version, the
series applied to Debian's PyTorch 2.6.0 source (skipped where that source cannot be had), the patched
cudaAwareMpiCheck() compiled against MPICH's mpi.h and run under mpiexec, the recipe test scripts
run against the CPU torch installed here, and both build.sh scripts run up to the compile with a
recording `python` in a scratch prefix.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from channelsmith.plan import make_plan
from channelsmith.recipes import render_recipe, select_recipes

REPO = Path(__file__).resolve().parents[1]
PATCHES = REPO / "patches" / "pytorch"
NCCLFT = "pytorch-nccl-fault"
CRAY = "pytorch-cray-mpich"
FLAVOR = {NCCLFT: "ncclft", CRAY: "cray_mpich"}
# The CUDA each PyTorch release is built with (conda_build_config.yaml says why).
CUDA_TAGS = {"2.2.1": {"cuda124"}, "2.3.1": {"cuda124"}, "2.4.0": {"cuda124"}, "2.6.0": {"cuda126"},
             "2.15.0": {"cuda129", "cuda130"}}

# The series each recipe applies to each PyTorch version (docs/pytorch-*.md say why).
EXPECTED_PATCHES = {
    NCCLFT: {
        "2.2.1": [
            "2.2.1/nccl-fault/0001-map-ncclRemoteError.patch",
            "2.2.1/nccl-fault/0002-drop-AutoNcclGroup-from-collective-and-pointToPoint.patch",
        ],
        "2.3.1": ["2.3.1/nccl-fault/0001-map-ncclRemoteError.patch"],
        "2.6.0": [
            "2.6.0/nccl-fault/0001-collectiveCoalesced-end-group-without-terminate.patch",
            "2.6.0/nccl-fault/0002-pointToPoint-ends-its-group-before-throwing.patch",
        ],
        "2.15.0": [
            "2.15.0/nccl-fault/0001-collectiveCoalesced-end-group-without-terminate.patch",
            "2.15.0/nccl-fault/0002-NCCLComm-shrink-waits-on-the-child-communicator.patch",
            "2.15.0/nccl-fault/0003-pointToPoint-ends-its-group-before-throwing.patch",
        ],
    },
    CRAY: {
        "2.3.1": [
            "2.3.1/cuda-aware-mpi/0001-cudaAwareMpiCheck-ask-MPICH-and-Cray-MPICH.patch",
            "2.3.1/cuda-aware-mpi/0002-caffe2-CUDA-MPI-macros-for-MPICH-GPU-API.patch",
        ],
        "2.4.0": ["2.4.0/cuda-aware-mpi/0001-cudaAwareMpiCheck-ask-MPICH-and-Cray-MPICH.patch"],
        "2.6.0": ["2.6.0/cuda-aware-mpi/0001-cudaAwareMpiCheck-ask-MPICH-and-Cray-MPICH.patch"],
    },
}
# Python versions each PyTorch version supports, within the recipes' python list (3.10-3.13).
SUPPORTED_PYTHONS = {
    "2.2.1": {"3.10", "3.11", "3.12"},
    "2.3.1": {"3.10", "3.11", "3.12"},
    "2.4.0": {"3.10", "3.11", "3.12"},
    "2.6.0": {"3.10", "3.11", "3.12", "3.13"},
    "2.15.0": {"3.10", "3.11", "3.12", "3.13"},
}
SITES = {NCCLFT: {"derecho", "docker-host", "generic", "gpu-cluster"}, CRAY: {"derecho"}}


@pytest.fixture(scope="module")
def renders():
    return {name: render_recipe(REPO, select_recipes(REPO, [name])[0]) for name in (NCCLFT, CRAY)}


def _pytorch_outputs(render):
    return [o for o in render.outputs if o.name == "pytorch"]


@pytest.mark.parametrize("recipe", [NCCLFT, CRAY])
def test_build_strings_carry_flavor_cuda_site_and_python(renders, recipe):
    outputs = _pytorch_outputs(renders[recipe])
    assert outputs
    # The recipe's own build number (raised when its patches change what is built).
    number = re.search(r"^  build_number: (\d+)$", (REPO / "recipes" / recipe / "recipe.yaml").read_text(), re.M)
    assert number, "recipe.yaml has no context build_number"
    for out in outputs:
        site = out.variant["site"].replace("-", "_")
        py = out.variant["python"].replace(".", "")
        cuda = "cuda" + out.variant["cuda_compiler_version"].replace(".", "")
        assert cuda in CUDA_TAGS[out.version], (out.version, cuda)
        pattern = rf"{cuda}_{FLAVOR[recipe]}_{site}_py{py}_h[0-9a-f]{{7}}_{number.group(1)}"
        assert re.fullmatch(pattern, out.build_string), out.build_string


@pytest.mark.parametrize("recipe", [NCCLFT, CRAY])
def test_each_version_and_site_gets_a_metapackage_selecting_the_flavor(renders, recipe):
    metas = [o for o in renders[recipe].outputs if o.name == recipe]
    got = {(o.version, o.variant["site"], o.variant["cuda_compiler_version"]) for o in metas}
    assert got == {(v, s, c[4:6] + "." + c[6:]) for v in EXPECTED_PATCHES[recipe] for s in SITES[recipe] for c in CUDA_TAGS[v]}
    assert all(o.noarch == "generic" and "python" not in o.variant for o in metas)
    text = (REPO / "recipes" / recipe / "recipe.yaml").read_text()
    assert "- pytorch ==${{ version }} ${{ cuda }}_${{ flavor }}_${{ site_tag }}_*" in text


@pytest.mark.parametrize("recipe", [NCCLFT, CRAY])
def test_python_versions_follow_what_each_pytorch_supports(renders, recipe):
    seen: dict[str, set[str]] = {}
    for out in _pytorch_outputs(renders[recipe]):
        seen.setdefault(out.version, set()).add(out.variant["python"])
    assert seen == {v: SUPPORTED_PYTHONS[v] for v in EXPECTED_PATCHES[recipe]}


def test_cray_mpich_builds_only_for_cray_mpich_sites(renders):
    assert {o.variant["site"] for o in renders[CRAY].outputs} == {"derecho"}
    assert {o.variant["site"] for o in renders[NCCLFT].outputs} == SITES[NCCLFT]


@pytest.mark.parametrize("recipe", [NCCLFT, CRAY])
def test_patch_lists_per_version_are_as_intended(renders, recipe):
    for out in _pytorch_outputs(renders[recipe]):
        got = [str(p.relative_to(PATCHES)) for p in out.patches]
        assert got == EXPECTED_PATCHES[recipe][out.version], (out.version, got)


@pytest.mark.parametrize("recipe", [NCCLFT, CRAY])
def test_libtorch_compiles_once_per_version_and_site_for_every_python(recipe):
    plan = make_plan(REPO, [recipe]).recipes[0]
    staging = [c for c in plan.compiles if c.kind == "staging"]
    assert {(c.variant["pytorch_version"], c.variant.get("site", "derecho"), c.variant["cuda_compiler_version"])
            for c in staging} == {
        (v, s, c[4:6] + "." + c[6:]) for v in EXPECTED_PATCHES[recipe] for s in SITES[recipe] for c in CUDA_TAGS[v]
    }
    # py-rattler-build 0.73 re-runs a staging compile once per output name that inherits it
    # (channelsmith/plan.py): libtorch gets its own run of the compile, every Python's pytorch shares one.
    assert {c.name.split("(for ")[1].rstrip(")") for c in staging} == {"libtorch", "pytorch"}
    for compile_ in staging:
        if compile_.name.endswith("(for libtorch)"):
            assert len(compile_.outputs) == 1 and compile_.outputs[0].startswith("libtorch "), compile_
            continue
        pythons = {o.split("_py")[1].split("_")[0] for o in compile_.outputs}
        wanted = {p.replace(".", "") for p in SUPPORTED_PYTHONS[compile_.variant["pytorch_version"]]}
        assert pythons == wanted, compile_


# ---------------------------------------------------------------- patches against real upstream source


def test_every_2_6_0_series_applies_to_debian_pytorch_source():
    from channelsmith.patches import check
    from channelsmith.sources import SourceFinder, cache_root

    results = check(REPO, SourceFinder(cache_root(), offline=True), [NCCLFT, CRAY], ["2.6.0"])
    assert {r.series for r in results} == {"pytorch/nccl-fault", "pytorch/cuda-aware-mpi"}
    if any(r.status == "unverifiable" for r in results):
        pytest.skip("Debian's PyTorch 2.6.0 source is not available: " + results[0].reason)
    assert [(r.series, r.status, r.failures) for r in results if r.status != "verified"] == []


def _debian_file(member: str, dest: Path) -> Path:
    """One file of Debian's PyTorch 2.6.0 source, patched with nothing; skips when unobtainable."""
    from channelsmith.sources import SourceFinder, cache_root

    obtained = SourceFinder(cache_root(), offline=True).find("pytorch", "2.6.0")
    if obtained.tree is None:
        pytest.skip(f"Debian's PyTorch 2.6.0 source is not available: {obtained.why_not}")
    obtained.tree.extract([member], dest)
    return dest / member


MPI_CHECK_START = "#if !defined(MPIX_CUDA_AWARE_SUPPORT) && defined(MPICH_NUMVERSION)\n"
MPI_CHECK_END = "#endif // MPIX_CUDA_AWARE_SUPPORT\n}\n"
HARNESS = r"""
#include <mpi.h>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#ifdef FAKE_CRAY_MPICH
// Interposes libmpi's MPI_Get_library_version: what Cray MPICH 8.1.29 answers.
extern "C" int MPI_Get_library_version(char* version, int* length) {
  const char* text = "MPI VERSION    : CRAY MPICH version 8.1.29.2 (ANL base 3.4a2)";
  std::strcpy(version, text);
  *length = static_cast<int>(std::strlen(text));
  return MPI_SUCCESS;
}
#endif
namespace {
@FUNCTION@
} // namespace
int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  std::printf("cuda_aware=%d\n", cudaAwareMpiCheck() ? 1 : 0);
  MPI_Finalize();
  return 0;
}
"""


@pytest.fixture(scope="module")
def cuda_aware_programs(tmp_path_factory):
    """The patched 2.6.0 cudaAwareMpiCheck() compiled with MPICH's mpicxx: as is, and as on Cray MPICH."""
    if not (shutil.which("mpicxx") and shutil.which("mpiexec")):
        pytest.skip("needs MPICH's mpicxx and mpiexec (apt-get install mpich libmpich-dev)")
    work = tmp_path_factory.mktemp("cuda-aware")
    member = "torch/csrc/distributed/c10d/ProcessGroupMPI.cpp"
    source = _debian_file(member, work / "tree")
    series = PATCHES / "2.6.0" / "cuda-aware-mpi" / "0001-cudaAwareMpiCheck-ask-MPICH-and-Cray-MPICH.patch"
    subprocess.run(["git", "apply", str(series)], cwd=work / "tree", check=True, capture_output=True)
    text = source.read_text()
    function = text[text.index(MPI_CHECK_START): text.index(MPI_CHECK_END) + len(MPI_CHECK_END)]
    (work / "harness.cpp").write_text(HARNESS.replace("@FUNCTION@", function))
    programs = {}
    for kind, flags in (("mpich", []), ("cray", ["-DFAKE_CRAY_MPICH"])):
        exe = work / f"check-{kind}"
        subprocess.run(["mpicxx", "-std=c++17", "-Wall", "-Werror", *flags, "harness.cpp", "-o", str(exe)],
                       cwd=work, check=True, capture_output=True, text=True)
        programs[kind] = exe
    return programs


def _cuda_aware(program: Path, gpu_support: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "MPICH_GPU_SUPPORT_ENABLED"}
    if gpu_support is not None:
        env["MPICH_GPU_SUPPORT_ENABLED"] = gpu_support
    out = subprocess.run(["mpiexec", "-n", "1", str(program)], env=env, capture_output=True, text=True, timeout=60, check=True)
    return out.stdout.strip()


@pytest.mark.parametrize("gpu_support", [None, "1"])
def test_mpich_without_cuda_is_not_cuda_aware_whatever_crays_switch_says(cuda_aware_programs, gpu_support):
    # Debian's MPICH is built without CUDA: MPIX_GPU_query_support answers 0, and Cray's switch is not its own.
    assert _cuda_aware(cuda_aware_programs["mpich"], gpu_support) == "cuda_aware=0"


@pytest.mark.parametrize(("gpu_support", "expected"), [("1", "cuda_aware=1"), (None, "cuda_aware=0"), ("0", "cuda_aware=0")])
def test_cray_mpich_is_cuda_aware_exactly_with_mpich_gpu_support_enabled(cuda_aware_programs, gpu_support, expected):
    assert _cuda_aware(cuda_aware_programs["cray"], gpu_support) == expected


def test_patched_ncclresult_header_matches_nccl_numbering():
    # The 2.2.1/2.3.1 nccl.h hunk's post-image is NCCL's ncclResult_t numbering from 2.13.4 on.
    for version in ("2.2.1", "2.3.1"):
        text = (PATCHES / version / "nccl-fault" / "0001-map-ncclRemoteError.patch").read_text()
        header_part = text.split("diff --git a/torch/csrc/cuda/nccl.h")[1].split("diff --git")[0]
        added = [line[1:].strip() for line in header_part.splitlines() if line.startswith("+  ")]
        assert added == ["RemoteError = 6,", "InProgress = 7,", "NumResults = 8"], version


# ---------------------------------------------------------------- the recipes' own test scripts


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


NCCLFT_CHECKS = REPO / "recipes" / NCCLFT / "tests" / "nccl_fault_checks.py"
MPI_CHECKS = REPO / "recipes" / CRAY / "tests" / "mpi_checks.py"


def _run_check(script: Path, check: str, prefix: Path, **env: str) -> subprocess.CompletedProcess:
    environ = dict(os.environ, PREFIX=str(prefix), PYTHONPATH=str(REPO / "scripts"), **env)
    return subprocess.run([sys.executable, str(script), check], env=environ, capture_output=True, text=True, timeout=240)


def test_enum_reader_tells_patched_from_unpatched_headers():
    checks = _load(NCCLFT_CHECKS)
    unpatched = "enum class ncclResult {\n  Success = 0,\n  InvalidUsage = 5,\n  NumResults = 6,\n  InProgress = 7\n};"
    patched = unpatched.replace("NumResults = 6,\n  InProgress = 7", "RemoteError = 6,\n  InProgress = 7,\n  NumResults = 8")
    assert checks.enum_values(unpatched) == {"Success": 0, "InvalidUsage": 5, "NumResults": 6, "InProgress": 7}
    assert {k: v for k, v in checks.enum_values(patched).items() if k in checks.EXPECTED_ENUM} == checks.EXPECTED_ENUM


def test_header_check_passes_on_a_torch_that_maps_remote_error(monkeypatch, tmp_path):
    pytest.importorskip("torch")
    monkeypatch.setenv("PREFIX", str(tmp_path))
    ok, message = _load(NCCLFT_CHECKS).check_header()
    assert ok, message


def test_activation_defaults_are_set_kept_from_users_and_undone(tmp_path):
    for change in ("activate", "deactivate"):
        target = tmp_path / "etc" / "conda" / f"{change}.d" / "pytorch-nccl-fault.sh"
        target.parent.mkdir(parents=True)
        shutil.copy(REPO / "recipes" / NCCLFT / f"{change}.sh", target)
    result = _run_check(NCCLFT_CHECKS, "activation", tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    for default in ("TORCH_NCCL_ASYNC_ERROR_HANDLING=2", "NCCL_CUMEM_ENABLE=0", "TORCH_PEER_WATCHER=1"):
        assert default in result.stdout
    # A user's own value survives activation and deactivation; TORCH_PEER_WATCHER=0 turns the watcher off.
    for name, value in (("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3"), ("TORCH_PEER_WATCHER", "0"), ("NCCL_CUMEM_ENABLE", "1")):
        script = (
            f'{name}={value}; export {name}; '
            f'. "{tmp_path}/etc/conda/activate.d/pytorch-nccl-fault.sh"; a=${name}; '
            f'. "{tmp_path}/etc/conda/deactivate.d/pytorch-nccl-fault.sh"; echo "$a ${name}"'
        )
        assert subprocess.run(["sh", "-c", script], capture_output=True, text=True, check=True).stdout.split() == [value, value]


def test_library_checks_refuse_a_cpu_torch(monkeypatch, tmp_path):
    torch = pytest.importorskip("torch")
    if torch.version.cuda is not None:
        pytest.skip("the torch installed here is a CUDA build")
    monkeypatch.setenv("PREFIX", str(tmp_path))
    for script in (NCCLFT_CHECKS, MPI_CHECKS):
        ok, message = _load(script).check_nccl_library()
        assert not ok and "is a CPU build" in message, message


def test_fault_check_skips_without_two_gpus(monkeypatch, tmp_path):
    torch = pytest.importorskip("torch")
    if torch.cuda.device_count() >= 2:
        pytest.skip("two GPUs are visible: the fault check would really run")
    monkeypatch.setenv("PREFIX", str(tmp_path))
    ok, message = _load(NCCLFT_CHECKS).check_fault()
    assert ok is None and message.startswith("the fault check needs 2 GPUs"), message


def test_the_watcher_check_expects_the_nccl_backend_the_activation_selects():
    """Issue 72: 2.15.0's "nccl" is nccl2 unless TORCH_DIST_USE_NCCL2=0, which the flavor's activation sets."""
    checks = _load(NCCLFT_CHECKS)
    assert checks.nccl_class_selected("2.15.0+cu130", {"TORCH_DIST_USE_NCCL2": "0"}) == "ProcessGroupNCCL"
    assert checks.nccl_class_selected("2.15.0", {}) == "ProcessGroupNCCL2"
    assert checks.nccl_class_selected("2.14.1", {}) == "ProcessGroupNCCL"
    assert checks.nccl_class_selected("2.14.1", {"TORCH_DIST_USE_NCCL2": "1"}) == "ProcessGroupNCCL2"
    assert checks.nccl_class_selected("2.6.0", {"TORCH_DIST_USE_NCCL2": "1"}) == "ProcessGroupNCCL"
    assert checks.ACTIVATION_DEFAULTS["TORCH_DIST_USE_NCCL2"] == "0"


def test_watcher_check_skips_without_a_gpu(monkeypatch, tmp_path):
    torch = pytest.importorskip("torch")
    if torch.cuda.device_count() >= 1:
        pytest.skip("a GPU is visible: the watcher check would really run")
    monkeypatch.setenv("PREFIX", str(tmp_path))
    ok, message = _load(NCCLFT_CHECKS).check_watcher()
    assert ok is None and message == "the watcher check needs a GPU, none visible", message


def test_expected_all_reduce_values_are_exact_sums():
    checks = _load(MPI_CHECKS)
    assert checks.expected_sum(2, 4) == [3, 6, 9, 12]
    assert checks.expected_sum(3, 2) == [6, 12]


def test_mpi_checks_launch_two_ranks_and_report_a_torch_without_mpi(tmp_path):
    torch = pytest.importorskip("torch")
    if shutil.which("mpiexec") is None:
        pytest.skip("no mpiexec (apt-get install mpich)")
    if torch.distributed.is_mpi_available():
        pytest.skip("the torch installed here has an MPI backend: see the recipe tests")
    ok, message = _load(MPI_CHECKS).check_mpi_available()
    assert not ok and "is_mpi_available() is False" in message
    # The two ranks are mpiexec's, each an interpreter that imports torch (about 2 s of CPU apiece with PyPI's
    # CUDA build): the recipe script's launch under mpiexec is what this proves, and no fork server can start
    # an MPI rank. The script's own process imports no torch for this check.
    launched = _run_check(MPI_CHECKS, "allreduce-cpu", tmp_path)
    assert launched.returncode == 1 and "launcher exit" in launched.stdout
    assert "doesn't have MPI built in" in launched.stdout, launched.stdout


# ---------------------------------------------------------------- build.sh up to the compile

RECORDING_PYTHON = """#!/usr/bin/env bash
# Stands in for the host Python: records the environment setup.py would get, then stops.
set -euo pipefail
if [[ "${1:-}" == "-c" ]]; then echo "3.11"; exit 0; fi
env > "$PREFIX/recorded-env"
echo "$*" > "$PREFIX/recorded-args"
mkdir -p build && touch build/CMakeCache.txt
"""

# Every switch the issues name, with the value the flavor must hand to setup.py.
COMMON_SWITCHES = {
    "USE_DISTRIBUTED": "1", "USE_CUDA": "1", "USE_NCCL": "1", "USE_SYSTEM_NCCL": "1", "USE_STATIC_NCCL": "0",
    "USE_GLOO": "1", "BUILD_TEST": "0", "USE_CUDNN": "1", "USE_ROCM": "0",
}


def _fake_prefix(tmp: Path, nccl: tuple[int, int, int]) -> dict[str, str]:
    prefix, build_prefix, src = tmp / "prefix", tmp / "build_prefix", tmp / "src"
    for d in (prefix / "bin", prefix / "include", build_prefix / "bin", src):
        d.mkdir(parents=True, exist_ok=True)
    (prefix / "include" / "nccl.h").write_text(
        "#define NCCL_MAJOR {}\n#define NCCL_MINOR {}\n#define NCCL_PATCH {}\n".format(*nccl)
    )
    python = prefix / "bin" / "python"
    python.write_text(RECORDING_PYTHON)
    python.chmod(0o755)
    return {"PREFIX": str(prefix), "BUILD_PREFIX": str(build_prefix), "SRC_DIR": str(src), "CPU_COUNT": "7",
            "PYTORCH_BUILD_STAGE": "build", "PYTORCH_BUILD_VERSION": "2.6.0", "PYTORCH_BUILD_NUMBER": "0",
            "TORCH_CUDA_ARCH_LIST": "8.0;9.0", "LDFLAGS": "-Wl,-O2 -Wl,-z,now", "PATH": os.environ["PATH"]}


def _run_build_sh(recipe: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    script = REPO / "recipes" / recipe / "build.sh"
    return subprocess.run(["bash", str(script)], cwd=env["SRC_DIR"], env=env, capture_output=True, text=True, timeout=60)


def _recorded(env: dict[str, str]) -> dict[str, str]:
    lines = (Path(env["PREFIX"]) / "recorded-env").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if "=" in line)


def test_ncclft_build_sh_hands_setup_py_every_switch(tmp_path):
    env = _fake_prefix(tmp_path, (2, 21, 5))
    result = _run_build_sh(NCCLFT, env)
    assert result.returncode == 0, result.stderr
    got = _recorded(env)
    assert {k: got.get(k) for k in COMMON_SWITCHES} == COMMON_SWITCHES
    assert got["USE_MPI"] == "0" and got["MAX_JOBS"] == "7" and got["TORCH_CUDA_ARCH_LIST"] == "8.0;9.0"
    assert got["PYTORCH_BUILD_VERSION"] == "2.6.0" and got["PYTORCH_BUILD_NUMBER"] == "0"
    assert got["NCCL_INCLUDE_DIR"] == f"{env['PREFIX']}/include" and "-z,lazy" in got["LDFLAGS"]
    assert (Path(env["PREFIX"]) / "recorded-args").read_text().split() == ["setup.py", "build"]


@pytest.mark.parametrize("recipe", [NCCLFT, CRAY, "pytorch-switchml"])
def test_build_sh_by_hand_compiles_one_job_per_cpu_whatever_openmp_is_told(tmp_path, recipe):
    # Without the engine's CPU_COUNT, MAX_JOBS came from nproc, which honors OMP_NUM_THREADS: a PyTorch built by
    # hand in a shell that set it to 1 (as many HPC shells do) compiled one file at a time.
    env = {k: v for k, v in _fake_prefix(tmp_path, (2, 21, 5)).items() if k != "CPU_COUNT"}
    script = (REPO / "recipes" / recipe / "build.sh").read_text()
    line = next(line for line in script.splitlines() if line.startswith("export MAX_JOBS="))
    got = subprocess.run(["bash", "-c", f"{line}; echo $MAX_JOBS"], env=dict(env, OMP_NUM_THREADS="1"),
                         capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    assert got == str(len(os.sched_getaffinity(0))), (line, got)
    if recipe == NCCLFT:  # the whole script, as a site runs it
        assert _run_build_sh(NCCLFT, dict(env, OMP_NUM_THREADS="1")).returncode == 0
        assert _recorded(env)["MAX_JOBS"] == str(len(os.sched_getaffinity(0)))


def test_ncclft_build_sh_refuses_an_nccl_without_remote_error(tmp_path):
    env = _fake_prefix(tmp_path, (2, 12, 12))
    result = _run_build_sh(NCCLFT, env)
    assert result.returncode == 1 and "older than NCCL 2.13.4" in result.stderr


def test_cray_build_sh_uses_the_hosts_mpich_and_links_its_gtl_library(tmp_path):
    env = _fake_prefix(tmp_path, (2, 21, 5))
    mpich = tmp_path / "opt" / "cray" / "pe" / "mpich" / "8.1.29"
    (mpich / "ofi" / "gnu" / "12.3" / "include").mkdir(parents=True)
    (mpich / "ofi" / "gnu" / "12.3" / "include" / "mpi.h").write_text("")
    env["SITE_MPI_ROOT"] = str(mpich / "ofi" / "gnu" / "12.3")
    missing_gtl = _run_build_sh(CRAY, env)
    assert missing_gtl.returncode == 1 and "no libmpi_gtl_cuda.so" in missing_gtl.stderr
    (mpich / "gtl" / "lib").mkdir(parents=True)
    (mpich / "gtl" / "lib" / "libmpi_gtl_cuda.so").write_text("")
    result = _run_build_sh(CRAY, env)
    assert result.returncode == 0, result.stderr
    got = _recorded(env)
    assert {k: got.get(k) for k in COMMON_SWITCHES} == COMMON_SWITCHES
    assert got["USE_MPI"] == "1" and got["MPI_HOME"] == env["SITE_MPI_ROOT"]
    assert f"-Wl,-rpath,{mpich / 'gtl' / 'lib'}" in got["LDFLAGS"] and "-lmpi_gtl_cuda" in got["LDFLAGS"]


@pytest.mark.parametrize("recipe", [NCCLFT, CRAY])
def test_build_sh_sets_every_use_switch_it_names_explicitly(recipe):
    # Every USE_*/BUILD_* the script mentions is exported with an explicit 0/1 (or a value), never left to CMake.
    text = (REPO / "recipes" / recipe / "build.sh").read_text()
    exported = dict(re.findall(r"^export ((?:USE|BUILD)_[A-Z0-9_]+)=(\S+)$", text, re.M))
    assert len(exported) >= 40
    assert all(v in ("0", "1") for v in exported.values()), exported
