#!/usr/bin/env bash
# Print the SWITCHML_INC_DIR, SWITCHML_LINK_DIR and SWITCHML_LINK_LIB lines (KEY=VALUE) that c10d's
# CMake (patch 0001) reads, from the switchml-client.pc installed in PREFIX (first argument).
# CMake splits an unquoted $ENV{...} into arguments only at ';', so every list is ;-separated; the
# libraries are what the static library needs for its backend (rdma adds ibverbs, gRPC, protobuf).
set -euo pipefail

prefix="${1:?usage: switchml-env.sh PREFIX}"
export PKG_CONFIG_PATH="${prefix}/lib/pkgconfig${PKG_CONFIG_PATH:+:${PKG_CONFIG_PATH}}"

read -r -a libs <<<"$(pkg-config --libs-only-l switchml-client)"
read -r -a dirs <<<"$(pkg-config --libs-only-L switchml-client)"
read -r -a incs <<<"$(pkg-config --cflags-only-I switchml-client)"
if ((${#libs[@]} == 0 || ${#incs[@]} == 0)); then
    echo "switchml-env.sh: switchml-client.pc in ${prefix}/lib/pkgconfig names no libraries or headers" >&2
    exit 1
fi

join() {
    local IFS=';'
    echo "$*"
}
echo "SWITCHML_INC_DIR=$(join "${incs[@]#-I}")"
echo "SWITCHML_LINK_DIR=$(join "${dirs[@]#-L}")"
echo "SWITCHML_LINK_LIB=$(join "${libs[@]#-l}")"
