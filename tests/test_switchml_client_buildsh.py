"""recipes/switchml-client/build.sh, run outside the conda engine, builds a working client library.

The source is a p4app-switchML checkout at the recipe's commit named by CHANNELSMITH_SWITCHML_SRC
(optionally with the vcl submodule in dev_root/third_party/vcl). The test copies it, applies the
recipe's patches with no fuzz, runs build.sh with the variables rattler-build provides, then
compiles upstream's hello_world and our allreduce_check against the result and runs them with the
dummy backend and num_workers=2: every output element must be twice its input. It also links a
toy CMake target with the exact lines patch 0001 adds to PyTorch's c10d, fed by the recipe's
switchml-env.sh, to show the ;-separated lists work with real CMake.

Toolchain: Debian's g++, make, pkg-config, libgoogle-glog-dev, libboost-program-options-dev (and
for the rdma case libibverbs-dev, libgrpc++-dev, protobuf-compiler-grpc); cmake for the CMake case.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from channelsmith.recipes import render_recipe, select_recipes

REPO = Path(__file__).resolve().parents[1]
CLIENT_RECIPE = REPO / "recipes" / "switchml-client"
TORCH_RECIPE = REPO / "recipes" / "pytorch-switchml"
CMAKE_PATCH = REPO / "patches" / "pytorch" / "1.7.1" / "switchml-gloo" / "0001-c10d-cmake-link-switchml-client.patch"
SOURCE_ENV = "CHANNELSMITH_SWITCHML_SRC"

pytestmark = pytest.mark.buildsh


def _missing_tools(*tools: str) -> list[str]:
    return [tool for tool in tools if shutil.which(tool) is None]


def _source() -> Path:
    value = os.environ.get(SOURCE_ENV)
    if not value:
        pytest.skip(f"{SOURCE_ENV} is not set (a p4app-switchML checkout at the recipe's commit)")
    source = Path(value)
    if not (source / "dev_root" / "client_lib" / "Makefile").is_file():
        pytest.skip(f"{SOURCE_ENV}={source} is not a p4app-switchML checkout (no dev_root/client_lib/Makefile)")
    return source


def _recipe_patches(backend: str) -> tuple[Path, ...]:
    (recipe,) = select_recipes(REPO, ["switchml-client"])
    outputs = [o for o in render_recipe(REPO, recipe).outputs if o.variant.get("switchml_backend") == backend]
    assert outputs, f"switchml-client renders no {backend} variant"
    return outputs[0].patches


def _require_toolchain(backend: str) -> None:
    missing = _missing_tools("g++", "make", "pkg-config", "patch")
    headers = {"glog/logging.h": "libgoogle-glog-dev", "boost/program_options.hpp": "libboost-program-options-dev"}
    if backend == "rdma":
        missing += _missing_tools("protoc", "grpc_cpp_plugin")
        headers["infiniband/verbs.h"] = "libibverbs-dev"
        if subprocess.run(["pkg-config", "--exists", "grpc++", "protobuf"], check=False).returncode != 0:
            missing.append("grpc++/protobuf pkg-config files (libgrpc++-dev, libprotobuf-dev)")
    missing += [package for header, package in headers.items() if not Path("/usr/include", header).exists()]
    if missing:
        pytest.skip(f"toolchain for the {backend} build is missing: {', '.join(missing)}")


def _build(tmp: Path, backend: str) -> tuple[Path, Path, str]:
    """Patch a copy of the source, run build.sh; returns (source copy, prefix, build log)."""
    upstream = _source()
    _require_toolchain(backend)
    source = tmp / "src"
    shutil.copytree(upstream, source, symlinks=True)
    for patch in _recipe_patches(backend):
        applied = subprocess.run(["patch", "-p1", "--fuzz=0", "-i", str(patch)], cwd=source,
                                 capture_output=True, text=True, check=False)
        assert applied.returncode == 0, f"{patch.name} does not apply with no fuzz:\n{applied.stdout}{applied.stderr}"
    prefix = tmp / "prefix"
    prefix.mkdir()
    env = dict(os.environ, PREFIX=str(prefix), SRC_DIR=str(source), RECIPE_DIR=str(CLIENT_RECIPE),
               CPU_COUNT=str(os.cpu_count() or 1), SWITCHML_BACKEND=backend, PKG_VERSION="0.0.20220714")
    built = subprocess.run(["bash", str(CLIENT_RECIPE / "build.sh")], env=env, capture_output=True,
                           text=True, check=False, timeout=1800)
    assert built.returncode == 0, f"build.sh failed:\n{built.stdout[-4000:]}{built.stderr[-4000:]}"
    return source, prefix, built.stdout


def _run_allreduce(source: Path, prefix: Path) -> str:
    env = dict(os.environ, PREFIX=str(prefix), CXX="g++")
    ran = subprocess.run(
        ["bash", str(CLIENT_RECIPE / "tests" / "dummy_allreduce.sh"),
         str(source / "dev_root" / "examples" / "hello_world" / "main.cc"),
         str(CLIENT_RECIPE / "tests" / "allreduce_check.cc")],
        env=env, capture_output=True, text=True, check=False, timeout=600,
    )
    assert ran.returncode == 0, f"dummy allreduce failed:\n{ran.stdout}{ran.stderr[-4000:]}"
    return ran.stdout


def _assert_doubled(stdout: str) -> None:
    assert "Data verified successfully" in stdout  # upstream's hello_world
    assert "num_workers=2 backend=dummy" in stdout
    floats = re.search(r"float32: in\[7\]=(\S+) out\[7\]=(\S+) ratio=(\S+)", stdout)
    ints = re.search(r"int32: in\[7\]=(-?\d+) out\[7\]=(-?\d+)", stdout)
    assert floats and ints, stdout
    assert float(floats.group(2)) == pytest.approx(2 * float(floats.group(1)), rel=0.01)
    assert int(ints.group(2)) == 2 * int(ints.group(1))
    assert "allreduce_check: PASS" in stdout


@pytest.fixture(scope="module")
def dummy_build(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    source, prefix, _ = _build(tmp_path_factory.mktemp("switchml-dummy"), "dummy")
    return source, prefix


def test_dummy_build_installs_library_headers_config_and_pkgconfig(dummy_build: tuple[Path, Path]) -> None:
    _, prefix = dummy_build
    for relative in ("lib/libswitchml-client.a", "include/switchml/context.h",
                     "include/switchml/backends/dummy/dummy_backend.h", "share/switchml/switchml.cfg"):
        assert (prefix / relative).is_file(), relative
    pc = (prefix / "lib" / "pkgconfig" / "switchml-client.pc").read_text()
    assert "Cflags: -I${includedir} -DDUMMY -DTIMEOUTS" in pc
    assert "-lswitchml-client -lglog -lboost_program_options -lpthread" in pc


def test_dummy_backend_with_two_workers_doubles_every_element(dummy_build: tuple[Path, Path]) -> None:
    _assert_doubled(_run_allreduce(*dummy_build))


def test_c10d_cmake_lines_of_patch_0001_link_the_client(dummy_build: tuple[Path, Path], tmp_path: Path) -> None:
    """The lines patch 0001 adds to c10d's CMakeLists.txt, on a toy c10d, with switchml-env.sh's lists."""
    if shutil.which("cmake") is None:
        pytest.skip("cmake is not installed")
    source, prefix = dummy_build
    added = [line[1:] for line in CMAKE_PATCH.read_text().splitlines()
             if line.startswith("+") and not line.startswith("+++")]
    project = tmp_path / "toy"
    project.mkdir()
    (project / "CMakeLists.txt").write_text(
        "cmake_minimum_required(VERSION 3.13)\nproject(toy CXX)\n"
        "add_library(c10d STATIC probe.cpp)\n"
        "set_property(TARGET c10d PROPERTY POSITION_INDEPENDENT_CODE ON)\n"
        "set_property(TARGET c10d PROPERTY CXX_STANDARD 14)\n"
        + "\n".join(added) + "\n"
        "add_executable(probe main.cpp)\ntarget_link_libraries(probe c10d)\n"
    )
    # c10d's side: compiled only when the patch's USE_SWITCHML reached it.
    (project / "probe.cpp").write_text(
        "#ifndef USE_SWITCHML\n#error USE_SWITCHML did not reach c10d\n#endif\n"
        "#include <switchml/context.h>\n#include <vector>\n"
        "float probe_allreduce(float value) {\n"
        "  auto& ctx = switchml::Context::GetInstance();\n  ctx.Start();\n"
        "  std::vector<float> data(1024, value);\n"
        "  ctx.AllReduce(data.data(), data.data(), data.size(), switchml::FLOAT32, switchml::AllReduceOperation::SUM);\n"
        "  ctx.Stop();\n  return data[7];\n}\n"
    )
    (project / "main.cpp").write_text(
        "#include <cstdio>\nfloat probe_allreduce(float);\n"
        "int main() { std::printf(\"probe: %g\\n\", probe_allreduce(1.5f)); return 0; }\n"
    )
    lists = subprocess.run([str(TORCH_RECIPE / "switchml-env.sh"), str(prefix)], capture_output=True,
                           text=True, check=True).stdout
    env = dict(os.environ, **dict(line.split("=", 1) for line in lists.splitlines()))
    assert env["SWITCHML_LINK_LIB"] == "switchml-client;glog;boost_program_options;pthread"
    build = tmp_path / "build"
    for command in (["cmake", "-S", str(project), "-B", str(build)], ["cmake", "--build", str(build)]):
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
        assert done.returncode == 0, f"{' '.join(command)}:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
    config = (prefix / "share" / "switchml" / "switchml.cfg").read_text()
    (build / "switchml.cfg").write_text(re.sub(r"(?m)^num_workers = .*$", "num_workers = 2", config))
    probe = subprocess.run([str(build / "probe")], cwd=build, capture_output=True, text=True, check=False)
    assert probe.returncode == 0, probe.stderr[-3000:]
    assert "probe: 3" in probe.stdout


def test_rdma_build_links_and_still_runs_the_dummy_backend(tmp_path: Path) -> None:
    source, prefix, _ = _build(tmp_path, "rdma")
    assert (prefix / "include" / "switchml" / "backends" / "rdma" / "rdma_backend.h").is_file()
    pc = (prefix / "lib" / "pkgconfig" / "switchml-client.pc").read_text()
    assert "-DRDMA" in pc and "Requires: grpc++ protobuf" in pc and "-libverbs" in pc
    _assert_doubled(_run_allreduce(source, prefix))
