#!/usr/bin/env bash
# Compile two programs against the installed switchml-client (through its pkg-config file) and run
# them with the dummy backend and num_workers=2: upstream's hello_world example and our
# allreduce_check, which requires every output element to be twice its input.
# Usage: dummy_allreduce.sh HELLO_WORLD_MAIN_CC ALLREDUCE_CHECK_CC   (PREFIX and CXX from the environment)
set -euo pipefail

hello_src="${1:?path to dev_root/examples/hello_world/main.cc}"
check_src="${2:?path to allreduce_check.cc}"
prefix="${PREFIX:?PREFIX is the environment holding switchml-client}"
cxx="${CXX:-c++}"

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

export PKG_CONFIG_PATH="${prefix}/lib/pkgconfig${PKG_CONFIG_PATH:+:${PKG_CONFIG_PATH}}"
read -r -a cflags <<<"$(pkg-config --cflags switchml-client)"
read -r -a libs <<<"$(pkg-config --libs switchml-client)"

# The toolchain's own flags (conda's compiler activation sets them) come first.
read -r -a extra_cxxflags <<<"${CXXFLAGS:-}"
read -r -a extra_ldflags <<<"${LDFLAGS:-}"
for program in hello_world allreduce_check; do
    src="$hello_src"
    [[ "$program" == allreduce_check ]] && src="$check_src"
    "$cxx" "${extra_cxxflags[@]}" -std=c++17 -O2 "${cflags[@]}" "$src" -o "$work/$program" \
        "${extra_ldflags[@]}" "${libs[@]}" -Wl,-rpath,"${prefix}/lib"
done

# The shipped template with two workers: the dummy backend then doubles every element.
template="${prefix}/share/switchml/switchml.cfg"
sed -e 's/^num_workers = .*/num_workers = 2/' -e 's/^backend = .*/backend = dummy/' "$template" >"$work/switchml.cfg"
grep -q '^num_workers = 2$' "$work/switchml.cfg"

cd "$work"
./hello_world
./allreduce_check
