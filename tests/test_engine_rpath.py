"""Why aws-ofi-nccl keeps an old-style DT_RPATH to a host libfabric: the build engine writes one.

recipes/nccl-ofi-plugin/build.sh records a Cray site's libfabric directory with -Wl,-rpath. Asking
the linker for a RUNPATH instead (--enable-new-dtags) would not reach the package: py-rattler-build
relinks every shared library it packages and stores its search path as DT_RPATH (its relinker turns
a RUNPATH into an RPATH, so that the environment's libraries come before LD_LIBRARY_PATH), as
conda-build does with patchelf --force-rpath. This builds a one-library package with the real
engine, offline, and reads the packaged library's dynamic section. If an engine release ever keeps
RUNPATH, this fails and the choice in build.sh can be made again (docs/reference/nccl.md).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from rattler.package_streaming import extract
from rattler_build import RenderConfig, Stage0Recipe, ToolConfiguration, VariantConfig

RECIPE = """\
package:
  name: runpath-probe
  version: "1.0"
build:
  number: 0
  script:
    - mkdir -p $PREFIX/lib
    - printf 'int probe(void) { return 0; }\\n' > probe.c
    - gcc -shared -fPIC -o $PREFIX/lib/libprobe.so probe.c -Wl,--enable-new-dtags -Wl,-rpath,/opt/cray/libfabric/1.15.2.0/lib64 -Wl,-rpath,$PREFIX/lib
  dynamic_linking:
    rpath_allowlist:
      - /opt/cray/libfabric/**
"""


def test_the_engine_packages_a_runpath_as_an_rpath_and_keeps_the_allowlisted_host_entry(tmp_path: Path) -> None:
    for tool in ("gcc", "readelf"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed")
    (tmp_path / "recipe").mkdir()
    (tmp_path / "recipe" / "recipe.yaml").write_text(RECIPE)
    recipe = Stage0Recipe.from_file(str(tmp_path / "recipe" / "recipe.yaml"))
    [variant] = recipe.render(variant_config=VariantConfig({}), render_config=RenderConfig())
    result = variant.run_build(tool_config=ToolConfiguration(test_strategy="skip"), output_dir=tmp_path / "out",
                               channels=[], no_build_id=True)  # fmt: skip
    extract(result.packages[0], tmp_path / "pkg")
    dynamic = subprocess.run(["readelf", "-d", str(tmp_path / "pkg/lib/libprobe.so")], capture_output=True,
                             text=True, check=True).stdout  # fmt: skip
    assert "(RUNPATH)" not in dynamic
    assert "(RPATH)" in dynamic and "/opt/cray/libfabric/1.15.2.0/lib64" in dynamic, dynamic
