#!/usr/bin/env bash
# Compile our SwitchML c10d backend (src/) as a torch C++ extension against the pytorch that $PYTHON
# imports and the switchml-client in $PREFIX, and install the package torch_switchml into $PREFIX.
# Runs under rattler-build, or by hand with PREFIX, SRC_DIR (a copy of src/), PYTHON and, optionally,
# PKG_CONFIG_PATH pointing at another switchml-client (tests/test_torch_switchml.py does that).
set -euo pipefail

export PKG_CONFIG_PATH="${PREFIX}/lib/pkgconfig${PKG_CONFIG_PATH:+:${PKG_CONFIG_PATH}}"
# Static library: its backend defines (Config layout) and every library it needs at link time.
TORCH_SWITCHML_CFLAGS="$(pkg-config --cflags switchml-client)"
TORCH_SWITCHML_LDFLAGS="$(pkg-config --libs switchml-client)"
export TORCH_SWITCHML_CFLAGS TORCH_SWITCHML_LDFLAGS
export MAX_JOBS="${CPU_COUNT:-1}"

cd "$SRC_DIR"
"$PYTHON" -m pip install . --no-deps --no-build-isolation -vv
