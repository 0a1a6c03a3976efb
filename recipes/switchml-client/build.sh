#!/usr/bin/env bash
# Build SwitchML's client library (dev_root/client_lib) for one backend and install the static
# library, its headers, a switchml.cfg template and a pkg-config file into $PREFIX.
# Runs under rattler-build, or by hand with PREFIX, SRC_DIR, CPU_COUNT and SWITCHML_BACKEND set
# (tests/test_switchml_client_buildsh.py does that against Debian's glog and boost).
set -euo pipefail

backend="${SWITCHML_BACKEND:?SWITCHML_BACKEND is set by recipe.yaml from the switchml_backend variant}"
client="${SRC_DIR}/dev_root/client_lib"
vcl="${SRC_DIR}/dev_root/third_party/vcl"
builddir="${SRC_DIR}/build"

# The dummy backend is compiled into every variant: it needs no hardware, so the package test
# (and a site checking its install) can run an allreduce anywhere; general.backend picks at run time.
make_flags=(DEBUG=0 DUMMY=1 DPDK=0 TIMEOUTS=1 "BUILDDIR=${builddir}")
# Consumers must see the same backend defines: they change the layout of switchml::Config.
defines="-DDUMMY -DTIMEOUTS"
libs="-lswitchml-client -lglog -lboost_program_options -lpthread"
requires=""
case "$backend" in
    dummy)
        make_flags+=(RDMA=0)
        ;;
    rdma)
        # gRPC talks to the switch controller; protoc and the gRPC plugin come from the build tools.
        make_flags+=(RDMA=1 "GRPC_HOME=${PREFIX}")
        PROTOC="$(command -v protoc)"
        GRPC_CPP_PLUGIN="$(command -v grpc_cpp_plugin)"
        export PROTOC GRPC_CPP_PLUGIN
        defines="${defines} -DRDMA"
        libs="${libs} -libverbs"
        requires="grpc++ protobuf"
        ;;
    *)
        echo "switchml-client: unknown backend '${backend}' (dummy or rdma; dpdk is not packaged, see docs/reference/switchml.md)" >&2
        exit 1
        ;;
esac

# The vector class library speeds up the float quantizer; it is header-only (a second source).
if [[ -f "${vcl}/vectorclass.h" ]]; then
    make_flags+=(VCL=1 "VCL_HOME=${vcl}")
else
    make_flags+=(VCL=0)
fi

# The Makefile appends its own flags (-std=c++17 -fPIC -O3) to whatever the toolchain exports.
# Some RDMA sources include glog before common.h, and glog 0.7 refuses that without this define.
export CXXFLAGS="${CXXFLAGS:-} -DGLOG_USE_GLOG_EXPORT"
# The gRPC stubs must exist before make reads the object list (a parallel make races otherwise).
if [[ "$backend" == rdma ]]; then
    make -C "$client" "${make_flags[@]}" protos
fi
make -C "$client" -j"${CPU_COUNT:-1}" "${make_flags[@]}"

install -d "${PREFIX}/lib/pkgconfig" "${PREFIX}/include" "${PREFIX}/share/switchml"
install -m 0644 "${builddir}/lib/libswitchml-client.a" "${PREFIX}/lib/"
cp -R "${builddir}/include/switchml" "${PREFIX}/include/"
install -m 0644 "${builddir}/switchml.cfg" "${PREFIX}/share/switchml/switchml.cfg"

cat >"${PREFIX}/lib/pkgconfig/switchml-client.pc" <<EOF
prefix=${PREFIX}
libdir=\${prefix}/lib
includedir=\${prefix}/include
backend=${backend}

Name: switchml-client
Description: SwitchML in-network aggregation client library (${backend} backend, dummy always built in; C++17)
Version: ${PKG_VERSION:-0}
Requires: ${requires}
Cflags: -I\${includedir} ${defines}
Libs: -L\${libdir} ${libs}
EOF
