"""A multi-package environment built from small local recipes, for the bundle tests and benchmark.

``python`` (a venv-style interpreter: the host's python3 behind a pyvenv.cfg, so a prefix can import
what it installs), ``libgreet`` (a script whose build prefix is replaced on install, an activation
script), ``greet-py`` (noarch: python, depends on both, one entry point), ``oldformat`` (a .tar.bz2
package with its build prefix in a text file), ``binprefix`` (its build prefix inside a binary file)
and ``bigdata`` (1 MiB that does not compress, to fill a small disk). py-rattler-build builds each
offline in well under a second.
"""

from __future__ import annotations

import os
import tempfile
import sys
from pathlib import Path

from channelsmith import channel
from rattler_build import Stage0Recipe, ToolConfiguration, VariantConfig

PYTHON = f"{sys.version_info.major}.{sys.version_info.minor}"
# The interpreter behind this test run (not its venv's link), which the python package points at.
SYSTEM_PYTHON = os.path.realpath(getattr(sys, "_base_executable", sys.executable))

MULTI_RECIPES = {
    "python": f"""
package: {{name: python, version: "{PYTHON}.0"}}
build:
  number: 0
  script:
    - mkdir -p $PREFIX/bin $PREFIX/lib/python{PYTHON}/site-packages
    - ln -s {SYSTEM_PYTHON} $PREFIX/bin/python{PYTHON}
    - ln -s python{PYTHON} $PREFIX/bin/python
    - printf 'home = {Path(SYSTEM_PYTHON).parent}\\ninclude-system-site-packages = false\\n' > $PREFIX/pyvenv.cfg
  prefix_detection:
    ignore: true
about: {{license: Apache-2.0, summary: the host's python as a venv (channelsmith test package)}}
""",
    "libgreet": """
package: {name: libgreet, version: "1.0.0"}
build:
  number: 0
  script:
    - mkdir -p $PREFIX/bin $PREFIX/share/libgreet $PREFIX/etc/conda/activate.d
    - printf '#!/bin/sh\\necho "hello from %s"\\n' "$PREFIX" > $PREFIX/bin/greet
    - chmod 755 $PREFIX/bin/greet
    - echo greeting > $PREFIX/share/libgreet/greeting.txt
    - printf 'export GREET_HOME="$CONDA_PREFIX/share/libgreet"\\n' > $PREFIX/etc/conda/activate.d/libgreet.sh
about: {license: Apache-2.0, summary: channelsmith test package libgreet}
""",
    "greet-py": """
package: {name: greet-py, version: "1.0.0"}
build:
  number: 0
  noarch: python
  script:
    - mkdir -p $PREFIX/site-packages/greet_py
    - printf 'def main():\\n    print("greet-py says hi")\\n    return 0\\n' > $PREFIX/site-packages/greet_py/__init__.py
  python:
    entry_points:
      - greet-py = greet_py:main
requirements:
  run: [python >=3.10, libgreet ==1.0.0]
about: {license: Apache-2.0, summary: channelsmith test package greet-py}
""",
    "oldformat": """
package: {name: oldformat, version: "1.0.0"}
build:
  number: 0
  noarch: generic
  script:
    - mkdir -p $PREFIX/etc
    - echo "prefix=$PREFIX" > $PREFIX/etc/oldformat.conf
about: {license: Apache-2.0, summary: channelsmith test package oldformat}
""",
    "binprefix": """
package: {name: binprefix, version: "1.0.0"}
build:
  number: 0
  script:
    - mkdir -p $PREFIX/share/binprefix
    - printf 'prefix=%s\\000end' "$PREFIX" > $PREFIX/share/binprefix/data.bin
about: {license: Apache-2.0, summary: channelsmith test package binprefix}
""",
    "bigdata": """
package: {name: bigdata, version: "1.0.0"}
build:
  number: 0
  noarch: generic
  script:
    - mkdir -p $PREFIX/share/bigdata
    - head -c 1048576 /dev/urandom > $PREFIX/share/bigdata/blob.bin
about: {license: Apache-2.0, summary: channelsmith test package bigdata}
""",
}


# Built in the older package format, so every install route meets a .tar.bz2 too.
TAR_BZ2 = {"oldformat"}


def build_packages(recipe: str, work: Path, package_format: str = "conda") -> list[Path]:
    """The packages py-rattler-build makes of the v1 recipe text ``recipe``, offline (its tests skipped), in
    ``work``/output."""
    work.mkdir(parents=True, exist_ok=True)
    results = Stage0Recipe.from_yaml(recipe, recipe_dir=tempfile.mkdtemp(prefix="recipe-", dir=work)).run_build(
        package_format=package_format,
        variant_config=VariantConfig(),
        tool_config=ToolConfiguration(test_strategy="skip"),
        output_dir=str(work / "output"),
        channels=[channel.channel_url(channel.ensure_channel(work / "empty-channel"))],
        no_include_recipe=True,
    )
    return [Path(p) for r in results for p in r.packages]


def build_multi_packages(work: Path) -> list[Path]:
    """Build every MULTI_RECIPES entry with py-rattler-build, offline; the .conda files."""
    packages = []
    for key, text in MULTI_RECIPES.items():
        packages += build_packages(text, work, "tar.bz2" if key in TAR_BZ2 else "conda")
    return packages
