"""recipes/nccl/tests/cuda_archs.py: the GPU code in libnccl against the site's cuda_arch_list (issue 33).

Two kinds of library: fakes made here with gcc, whose .nv_fatbin / __nv_relfatbin sections hold
fatbin headers laid out as nvcc writes them (they prove the script's logic anywhere); and, where nvcc
is installed, real CUDA libraries compiled the way NCCL's makefiles compile (-dc and -dw objects, one
-dlink) with NVCC_GENCODE from recipes/nccl/gencode.sh, which anchor that layout to nvcc's own output.
What neither shows: the real libnccl (built on a build node), and that its kernels run on each GPU.
"""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from channelsmith.sources import cache_root
from channelsmith.patches.compiling import unpack_wheel
from channelsmith.recipes import load_stage0, render_recipe, render_variants, select_recipes, variant_config

REPO = Path(__file__).resolve().parents[1]
NCCL = REPO / "recipes" / "nccl"
SCRIPT = NCCL / "tests" / "cuda_archs.py"
MATRIX = yaml.safe_load((REPO / "conda_build_config.yaml").read_text())
ARCH_OF = dict(zip(MATRIX["site"], MATRIX["cuda_arch_list"]))


def run(library: Path, expect: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), str(library), "--expect", expect, "--json", *extra],
        capture_output=True, text=True, check=False,
    )


def fatbin(*entries: tuple[int, int]) -> bytes:
    """A fatbin of (kind, sm) entries (1 PTX, 2 cubin), each with a 64-byte header and 16 payload bytes."""
    body = b""
    for kind, arch in entries:
        header = struct.pack("<HHIQIIHHI", kind, 0x101, 64, 16, 16, 0, 8, 1, arch).ljust(64, b"\0")
        body += header + bytes(16)
    return struct.pack("<IHHQ", 0xBA55ED50, 1, 16, len(body)) + body


def fake_library(tmp_path: Path, sections: dict[str, bytes], name: str = "libfake.so") -> Path:
    """A shared library (gcc) whose named sections hold the given bytes."""
    if shutil.which("gcc") is None:
        pytest.skip("gcc is not installed: the fake library cannot be made")
    source = tmp_path / "fake.c"
    arrays = []
    for index, (section, data) in enumerate(sections.items()):
        values = ", ".join(str(b) for b in data)
        arrays.append(f'__attribute__((section("{section}"), used, aligned(8))) '
                      f"const unsigned char blob{index}[] = {{{values}}};")
    source.write_text("\n".join(arrays) + "\nint fake_symbol(void) { return 0; }\n")
    library = tmp_path / name
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    return library


def found(result: subprocess.CompletedProcess[str]) -> dict:
    return json.loads(result.stdout)


# ---------------------------------------------------------------------------------------------
# The script's logic, on fakes
# ---------------------------------------------------------------------------------------------


def test_a_library_matching_its_list_passes(tmp_path: Path) -> None:
    """As NCCL links: cubins in the -dlink image (.nv_fatbin), PTX only in the -dc objects' fatbins."""
    library = fake_library(tmp_path, {
        ".nv_fatbin": fatbin((2, 80), (2, 90)),
        "__nv_relfatbin": fatbin((2, 80), (1, 90), (2, 90)),
    })
    result = run(library, "8.0;9.0+PTX")
    assert result.returncode == 0, result.stderr
    assert found(result)["sections"] == {
        ".nv_fatbin": {"sass": [80, 90], "ptx": []},
        "__nv_relfatbin": {"sass": [80, 90], "ptx": [90]},
    }
    assert "OK, the GPU code matches" in result.stderr


def test_missing_ptx_for_a_plus_ptx_entry_fails(tmp_path: Path) -> None:
    library = fake_library(tmp_path, {".nv_fatbin": fatbin((2, 80), (2, 90))})
    result = run(library, "8.0;9.0+PTX")
    assert result.returncode == 1
    assert found(result)["problems"] == [
        "no compute_90 PTX, though the list says 9.0+PTX: GPUs newer than the list cannot JIT-compile NCCL's kernels"
    ]


@pytest.mark.parametrize(
    ("entries", "expect", "problem"),
    [
        (((2, 80),), "8.0;9.0", "no sm_90 SASS in .nv_fatbin"),
        (((2, 70), (2, 80)), "8.0", "sm_70 SASS that the list does not ask for"),
        (((2, 80), (1, 80)), "8.0", "compute_80 PTX that the list does not ask for"),
    ],
)
def test_each_difference_from_the_list_is_named(tmp_path: Path, entries, expect: str, problem: str) -> None:
    result = run(fake_library(tmp_path, {".nv_fatbin": fatbin(*entries)}), expect)
    assert result.returncode == 1
    assert [p for p in found(result)["problems"] if p.startswith(problem)], found(result)["problems"]


def test_sass_only_in_the_relocatable_objects_is_not_enough(tmp_path: Path) -> None:
    """The runtime registers the linked image; a cubin left in __nv_relfatbin alone does not run."""
    library = fake_library(tmp_path, {".nv_fatbin": fatbin((2, 80)), "__nv_relfatbin": fatbin((2, 80), (2, 90))})
    result = run(library, "8.0;9.0")
    assert result.returncode == 1
    assert found(result)["problems"][0].startswith("no sm_90 SASS in .nv_fatbin")


@pytest.mark.parametrize(("cuda", "code"), [("12.4", 1), ("12.6", 1), ("12.7", 0), ("12.9", 0), ("13.0", 0)])
def test_nccls_own_sm100_fp8_kernels_are_allowed_from_cuda_12_7(tmp_path: Path, cuda: str, code: int) -> None:
    library = fake_library(tmp_path, {".nv_fatbin": fatbin((2, 90), (2, 100))})
    assert run(library, "9.0", "--cuda-version", cuda).returncode == code


def test_bad_input_exits_2_with_the_reason(tmp_path: Path) -> None:
    text = tmp_path / "libnot.so"
    text.write_text("not an ELF file\n")
    assert "not a 64-bit little-endian ELF" in run(text, "8.0").stderr
    assert run(text, "8.0").returncode == 2
    plain = fake_library(tmp_path, {".data.other": b"\0" * 8}, "libplain.so")
    result = run(plain, "8.0")
    assert result.returncode == 2 and "holds no GPU code" in result.stderr
    gpu = fake_library(tmp_path, {".nv_fatbin": fatbin((2, 80))}, "libgpu.so")
    result = run(gpu, "sm_80")
    assert result.returncode == 2 and "'sm_80' is not a CUDA architecture" in result.stderr
    assert run(tmp_path / "missing.so", "8.0").returncode == 2


@pytest.mark.parametrize("keep", [40, 100, "half"])
def test_a_truncated_library_exits_2_saying_so(tmp_path: Path, keep: int | str) -> None:
    """`head -c 100 libnccl.so.2`: a cut copy is bad input (2) with a reason, not a traceback (1 is "mismatch")."""
    library = fake_library(tmp_path, {".nv_fatbin": fatbin((2, 80))})
    data = library.read_bytes()
    cut = tmp_path / "libcut.so"
    cut.write_bytes(data[: len(data) // 2 if keep == "half" else keep])
    result = run(cut, "8.0")
    assert result.returncode == 2, result.stderr
    assert f"cuda_archs: {cut} is truncated" in result.stderr and "Traceback" not in result.stderr


def test_a_relative_library_is_read_from_the_environment(tmp_path: Path) -> None:
    library = fake_library(tmp_path, {".nv_fatbin": fatbin((2, 80))})
    result = subprocess.run(
        [sys.executable, str(SCRIPT), library.name, "--expect", "8.0"],
        capture_output=True, text=True, check=False, env={"PREFIX": str(tmp_path), "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr


# ---------------------------------------------------------------------------------------------
# The recipe runs it with the site's list
# ---------------------------------------------------------------------------------------------


def test_the_nccl_recipe_checks_its_library_against_the_sites_list() -> None:
    (recipe,) = select_recipes(REPO, ["nccl"])
    outputs = render_recipe(REPO, recipe, {"nccl_version": "2.29.7-1"}).outputs
    assert {o.variant["site"] for o in outputs} == set(ARCH_OF)
    for variant in render_variants(recipe, load_stage0(recipe), variant_config(REPO, recipe)):
        tests = variant.recipe.to_dict()["tests"]
        (check,) = [t for t in tests if isinstance(t.get("script"), dict) and "cuda_archs.py" in str(t["script"])]
        assert check["script"]["env"]["NCCL_CUDA_ARCH_LIST"] == ARCH_OF[variant.variant["site"]]
        assert check["files"]["recipe"] == ["tests/cuda_archs.py"]


# ---------------------------------------------------------------------------------------------
# Real CUDA code from nvcc, compiled the way NCCL's makefiles compile
# ---------------------------------------------------------------------------------------------


def nvcc_library(tmp_path: Path, arch_list: str) -> Path:
    """A shared library of one -dc and one -dw kernel, device-linked, with the site's NVCC_GENCODE."""
    nvcc, cxx = shutil.which("nvcc"), shutil.which("g++")
    if nvcc is None or cxx is None:
        pytest.skip("nvcc or g++ is not installed: no real fatbin to read (the fakes above still run)")
    gencode = subprocess.run(
        ["bash", "-c", f'source "{NCCL / "gencode.sh"}" && nccl_gencode "$1"', "gencode", arch_list],
        capture_output=True, text=True, check=True,
    ).stdout.split()
    (tmp_path / "dc.cu").write_text("__global__ void dc(int *x) { x[threadIdx.x] += 1; }\n"
                                    'extern "C" void launch_dc(int *x) { dc<<<1, 32>>>(x); }\n')
    (tmp_path / "dw.cu").write_text("__global__ void dw(int *x) { x[threadIdx.x] *= 2; }\n"
                                    'extern "C" void launch_dw(int *x) { dw<<<1, 32>>>(x); }\n')
    flags = [*gencode, "-Xfatbin", "-compress-all", "-Xcompiler", "-fPIC"]
    steps = [
        [nvcc, *flags, "-dc", "dc.cu", "-o", "dc.o"],
        [nvcc, *flags, "-dw", "dw.cu", "-o", "dw.o"],
        [nvcc, *flags, "-dlink", "dc.o", "dw.o", "-o", "dlink.o"],
        # NCCL links libnccl with the host compiler (src/Makefile), not nvcc, which would device-link
        # again for its own default architecture.
        [cxx, "-shared", "dc.o", "dw.o", "dlink.o", "-o", "libreal.so"],
    ]
    for step in steps:
        done = subprocess.run(step, cwd=tmp_path, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            why = done.stderr.strip()[-300:]
            pytest.skip(f"nvcc could not build the test library ({' '.join(step[1:3])}...): {why}")
    return tmp_path / "libreal.so"


def test_nvcc_output_has_the_layout_the_script_reads(tmp_path: Path) -> None:
    library = nvcc_library(tmp_path, "8.0;9.0+PTX")
    result = run(library, "8.0;9.0+PTX")
    assert result.returncode == 0, result.stderr
    sections = found(result)["sections"]
    assert sections[".nv_fatbin"]["sass"] == [80, 90]
    assert sections["__nv_relfatbin"] == {"sass": [80, 90], "ptx": [90]}
    # The same real library against other lists: each difference is caught.
    assert run(library, "8.0;9.0").returncode == 1
    assert run(library, "9.0+PTX").returncode == 1
    assert run(library, "8.0;9.0;10.0+PTX").returncode == 1


def test_generic_site_nccl_carries_ptx_for_its_newest_architecture(tmp_path: Path) -> None:
    """The generic site must run on GPUs it does not know: its newest architecture's PTX is built in."""
    arch_list = ARCH_OF["generic"]
    result = run(nvcc_library(tmp_path, arch_list), arch_list)
    assert result.returncode == 0, result.stderr
    sections = found(result)["sections"]
    newest = max(a for kinds in sections.values() for a in kinds["sass"])
    assert newest in {a for kinds in sections.values() for a in kinds["ptx"]}


def test_nvidias_own_libnccl_reads_as_nccls_default_architectures() -> None:
    """A real libnccl: NVIDIA's release wheel, built with NCCL's default NVCC_GENCODE, which ends in the
    PTX of its newest architecture (makefiles/common.mk: CUDA12_PTX / CUDA13_PTX)."""
    wheels = sorted((cache_root() / "wheels").glob("nvidia_nccl_cu1[23]-*.whl"))
    if not wheels:
        pytest.skip(f"no nvidia-nccl-cu12/cu13 wheel in {cache_root() / 'wheels'} (`channelsmith patches "
                    "compile-check` fetches one)")
    library = unpack_wheel(wheels[-1], "nvidia/nccl/lib/", cache_root()) / "libnccl.so.2"
    sections = found(run(library, "8.0"))["sections"]
    linked = sections[".nv_fatbin"]["sass"]
    assert linked and max(linked) >= 90
    assert {a for kinds in sections.values() for a in kinds["ptx"]} == {max(linked)}
    as_list = ";".join(f"{a // 10}.{a % 10}" for a in linked) + "+PTX"
    assert run(library, as_list).returncode == 0
