#!/usr/bin/env bash
# NCCL loads this environment's aws-ofi-nccl and uses its network, in NCCL's own words.
#
# One script for the nccl-ofi-plugin package test and for a site's GPU node (by hand:
# `PREFIX=$CONDA_PREFIX bash tests/nccl-loads-plugin.sh`). With an NVIDIA GPU it
#   1. sources the package's etc/conda/activate.d script as conda does (NCCL_NET, NCCL_NET_PLUGIN);
#   2. creates a one-GPU communicator (nccl_init.py beside this file) with NCCL_DEBUG=INFO: NCCL
#      loads and initialises its network plugin for any communicator, so its log must name the
#      plugin file it loaded (under $PREFIX/lib) and "Using network $NCCL_NET";
#   3. plants failures and requires each to be reported: the plugin name misspelled (NCCL fails
#      with NCCL_NET set; without it NCCL falls back to its Socket network, which check 2 refuses),
#      a libfabric provider that is not there (the plugin finds no NIC, NCCL fails; see CRASH below),
#      and libfabric missing (NCCL cannot open the plugin);
#   4. with torch and torch_dist_check importable, runs the acceptance suite on 2 ranks with
#      --expect-nccl-net, data through the plugin on any GPU node (one GPU: the suite's placement
#      gives each rank its own NCCL_HOSTID, so NCCL connects them through its network; two or
#      more: one GPU each, P2P and SHM off). Then the three planted failures again with NCCL_NET
#      unset: NCCL falls back to its Socket network, data still moves, and env/nccl-network must fail
#      (the missing provider: or CRASH, and the suite's report must say so and why);
#   5. sources the deactivate.d script: NCCL_NET and NCCL_NET_PLUGIN must be back as they were.
# Without a GPU it says why it cannot run and succeeds (CI, build hosts).
#
# CRASH: NCCL 2.28.3 to 2.29.3 crash when a network plugin older than their v11 API (aws-ofi-nccl
# 1.6.0 is v6) fails its init: the compat layer sets the plugin's finalize only after a successful
# init, and NCCL calls it after a failed one (plugin/net.cc, "Failed to initialize NET plugin", then
# a jump to address 0; fixed in 2.29.7, which finalizes only a completed init). The process dies of
# SIGSEGV, or exits 1 through libinfinipath's handler ("terminated with signal 11 at PC=0") where
# libfabric brings the psm provider. So with a missing provider such an NCCL cannot fall back.
#
# FI_PROVIDER picks the libfabric provider (a site sets its own, e.g. cxi); unset, this test uses
# tcp, which needs no special hardware. NCCL's logs are kept in OFI_TEST_LOGS when set.
set -euo pipefail

if ! nvidia-smi -L >/dev/null 2>&1; then
    echo "nccl-loads-plugin: skipped: no NVIDIA GPU visible (nvidia-smi -L failed); run on a GPU node"
    exit 0
fi

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
prefix="${PREFIX:?set PREFIX to the environment holding nccl-ofi-plugin}"
libdir="$(readlink -f "${prefix}/lib")"
python="${PYTHON:-python}"
logs="${OFI_TEST_LOGS:-$(mktemp -d)}"
mkdir -p "$logs"
export FI_PROVIDER="${FI_PROVIDER:-tcp}"
export LD_LIBRARY_PATH="${libdir}${LD_LIBRARY_PATH:+:${LD_LIBRARY_PATH}}"
failures=0

say() { echo "nccl-loads-plugin: $*"; }
fail() {
    echo "nccl-loads-plugin: FAIL: $*" >&2
    failures=$((failures + 1))
}

# state NAME: NAME's value, or <unset>.
state() {
    if [[ -n "${!1+x}" ]]; then echo "${!1}"; else echo "<unset>"; fi
}
before_net="$(state NCCL_NET)"
before_plugin="$(state NCCL_NET_PLUGIN)"

# shellcheck source=/dev/null
source "${prefix}/etc/conda/activate.d/nccl-ofi-plugin.sh"
net="${NCCL_NET:?the activation script set no NCCL_NET}"
say "activated: NCCL_NET='${net}' NCCL_NET_PLUGIN='$(state NCCL_NET_PLUGIN)' FI_PROVIDER='${FI_PROVIDER}'"

# init NAME [VAR=VALUE...]: one-GPU communicator with NCCL's INFO log in $logs/NAME.log (the
# assignments apply to this run only; VAR= with no value unsets VAR). Returns the init status.
init() {
    local name="$1" log="${logs}/$1.log" status=0
    shift
    (
        for assignment in "$@"; do
            if [[ "$assignment" == *= ]]; then unset "${assignment%=}"; else export "${assignment?}"; fi
        done
        NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET,ENV "$python" "${here}/nccl_init.py"
    ) >"$log" 2>&1 || status=$?
    sed -e "s/^/  [${name}] /" "$log"
    return "$status"
}

# uses_network LOG NET: every "Using network" line of NCCL names NET (NCCL compares names
# case-insensitively), and there is at least one.
uses_network() {
    local used
    used="$(sed -n 's/.*NCCL INFO Using network \(.*\)$/\1/p' "$1" | sort -u)"
    [[ -n "$used" && "${used,,}" == "${2,,}" ]]
}

# loaded_plugin_file LOG: the plugin file NCCL says it loaded (NCCL >= 2.28 prints the path),
# else the libnccl-net file nccl_init.py found mapped (older NCCL names only the network).
loaded_plugin_file() {
    local file
    file="$(sed -n 's/.*NCCL INFO Successfully loaded external network plugin \(.*\)$/\1/p' "$1" | head -n 1)"
    if [[ -z "$file" ]] && grep -q "NET/Plugin: Loaded net plugin" "$1"; then
        file="$(sed -n 's/^nccl_init: mapped \(.*libnccl-net.*\)$/\1/p' "$1" | head -n 1)"
    fi
    echo "$file"
}

# --- 2. our plugin, our network ---------------------------------------------------------------
if init plugin; then
    file="$(loaded_plugin_file "${logs}/plugin.log")"
    if [[ -z "$file" ]]; then
        fail "NCCL's log names no external network plugin it loaded"
    elif [[ "$(readlink -f "$file")" != "${libdir}"/* ]]; then
        fail "NCCL loaded the plugin ${file}, not the one under ${libdir}"
    else
        say "NCCL loaded ${file}"
    fi
    if uses_network "${logs}/plugin.log" "$net"; then
        say "NCCL uses network ${net} (provider ${FI_PROVIDER})"
    else
        fail "NCCL did not use network '${net}' (see its 'Using network' line above)"
    fi
else
    fail "NCCL could not create a communicator with the plugin (FI_PROVIDER=${FI_PROVIDER}); its log is above"
fi

# --- 3. planted failures ----------------------------------------------------------------------
misspelled="$(state NCCL_NET_PLUGIN)"
[[ "$misspelled" == "<unset>" ]] && misspelled=ofi
misspelled="${misspelled/o/0}"
if init misspelled "NCCL_NET_PLUGIN=${misspelled}"; then
    fail "NCCL_NET_PLUGIN=${misspelled}: NCCL created the communicator although NCCL_NET='${net}' names a network it cannot have"
elif grep -Eq "NET/Plugin: (Could not find:|No plugin found).*${misspelled}" "${logs}/misspelled.log"; then
    say "caught: NCCL_NET_PLUGIN=${misspelled} with NCCL_NET set: NCCL said '$(grep -Em1 -o 'NET/Plugin: (Could not find:|No plugin found).*' "${logs}/misspelled.log")' and refused"
else
    fail "NCCL_NET_PLUGIN=${misspelled}: NCCL failed without saying it could not find the plugin"
fi

if init fallback "NCCL_NET_PLUGIN=${misspelled}" NCCL_NET=; then
    if uses_network "${logs}/fallback.log" "$net"; then
        fail "NCCL_NET_PLUGIN=${misspelled} without NCCL_NET: NCCL still reports network ${net}"
    else
        say "caught: without NCCL_NET NCCL fell back to '$(sed -n 's/.*NCCL INFO Using network //p' "${logs}/fallback.log" | head -n 1)', which check 2 refuses"
    fi
else
    fail "NCCL_NET_PLUGIN=${misspelled} without NCCL_NET: NCCL did not fall back to a built-in network (its log is above)"
fi

status=0
init no-provider FI_PROVIDER=no-such-provider || status=$?
if ((status == 0)); then
    fail "FI_PROVIDER=no-such-provider: NCCL still created the communicator"
elif grep -q "NCCL WARN NET/OFI" "${logs}/no-provider.log" &&
    grep -Eq "Failed to initialize NET plugin|network .* not found" "${logs}/no-provider.log"; then
    plugin_said="$(sed -n 's/.*NCCL WARN NET\/OFI //p' "${logs}/no-provider.log" | awk '!seen[$0]++' | paste -sd '|' -)"
    nccl_said="$(grep -Eo "Failed to initialize NET plugin.*|network .* not found.*" "${logs}/no-provider.log" | head -n 1)"
    # nccl_init.py prints "ncclCommInitAll failed" when NCCL returns; without it NCCL never did (CRASH).
    if grep -q "^ncclCommInitAll failed:" "${logs}/no-provider.log"; then
        ended="and refused"
    else
        ended="and the process died inside ncclCommInitAll (exit ${status}$(sed -n '/ terminated with signal [0-9]/{s/.* \(terminated with signal [0-9]*\).*/; \1/p;q}' "${logs}/no-provider.log"))"
    fi
    say "caught: FI_PROVIDER=no-such-provider: the plugin said '${plugin_said}'; NCCL said '${nccl_said}' ${ended}"
else
    fail "FI_PROVIDER=no-such-provider: NCCL failed without the plugin's warning and its own refusal"
fi

# libfabric missing: a copy of $PREFIX/lib without libfabric, the plugin files copied (their
# $ORIGIN then points there), the rest linked. A plugin that finds libfabric through an absolute
# rpath (a host libfabric, e.g. Cray's) cannot be parted from it this way. Step 4 plants it again.
shadow="$(mktemp -d)"
shadow_path=""
for entry in "${libdir}"/*; do
    case "${entry##*/}" in
        libfabric.so*) ;;
        libnccl-net*.so*) cp -L "$entry" "${shadow}/" ;;
        *) ln -s "$entry" "${shadow}/" ;;
    esac
done
plugin_file="$(find "$shadow" -maxdepth 1 -name 'libnccl-net*.so' -type f | head -n 1)"
if [[ -z "$plugin_file" ]]; then
    fail "no libnccl-net*.so under ${libdir}"
elif LD_LIBRARY_PATH="$shadow" ldd "$plugin_file" | grep -q 'libfabric\.so\.1 => /'; then
    say "libfabric-missing case skipped: $(LD_LIBRARY_PATH="$shadow" ldd "$plugin_file" | grep -m1 'libfabric\.so\.1') is found outside ${libdir}"
else
    # The search path with the shadow in place of $PREFIX/lib (which leads it, see above).
    shadow_path="${shadow}${LD_LIBRARY_PATH#"${libdir}"}"
    if init no-libfabric "LD_LIBRARY_PATH=${shadow_path}"; then
        fail "libfabric missing: NCCL still created the communicator"
    elif grep -q "NET/Plugin: .*libfabric\.so\.1: cannot open shared object file" "${logs}/no-libfabric.log"; then
        say "caught: libfabric missing: NCCL said '$(grep -m1 -o 'NET/Plugin: .*libfabric\.so\.1: cannot open shared object file.*' "${logs}/no-libfabric.log")'"
    else
        fail "libfabric missing: NCCL failed without naming libfabric.so.1"
    fi
fi

# --- 4. the acceptance suite: data through the plugin -------------------------------------------
# Two ranks on any GPU node. With one GPU the suite seats both on it with one NCCL_HOSTID each (its
# placement "host-ids", --gpu-sharing net): NCCL takes them for two hosts and connects them through
# its network, here the plugin. With two or more GPUs each rank has its own, and P2P and SHM off
# leave NCCL nothing but its network between them.

# suite NAME [VAR=VALUE|VAR=]... -- SUITE-ARGUMENTS...: the suite on 2 ranks expecting network
# $net, with the assignments applied (VAR= unsets VAR); output in $logs/suite-NAME.txt, JSON in
# $logs/suite-NAME.json. Returns the suite's exit status.
suite() {
    local name="$1" status=0
    shift
    (
        while [[ "$1" != -- ]]; do
            if [[ "$1" == *= ]]; then unset "${1%=}"; else export "${1?}"; fi
            shift
        done
        shift
        NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 "$python" -m torch_dist_check --nproc 2 --gpu-sharing net \
            --backends nccl --expect-nccl-net "$net" --json "${logs}/suite-${name}.json" "$@"
    ) >"${logs}/suite-${name}.txt" 2>&1 || status=$?
    return "$status"
}

# verdict NAME CHECK: "<status>: <reason>" of CHECK in the JSON of suite run NAME, or
# "missing: ..." when the run left no JSON or the check is not in it.
verdict() {
    local json="${logs}/suite-$1.json"
    if [[ ! -s "$json" ]]; then
        echo "missing: the suite wrote no ${json}"
        return 0
    fi
    "$python" - "$json" "$2" <<'PY'
import json
import sys

checks = {c["name"]: c for c in json.load(open(sys.argv[1]))["checks"]}
check = checks.get(sys.argv[2])
print(f"{check['status']}: {check['reason']}" if check else f"missing: no check {sys.argv[2]}")
PY
}

# planted NAME CAUSE VAR=VALUE...: a planted failure with data moving. NCCL_NET is unset, as HPE
# advises on one node, so NCCL falls back to its Socket network instead of failing: data must still
# cross between the ranks (NCCL correctness passes) and env/nccl-network must fail with a reason
# that matches CAUSE (an extended regex), i.e. quotes why from NCCL's log. The one other outcome
# taken is CRASH after a plugin's failed init, only as the suite reports it: harness/ranks fails with
# the ranks dead in the NCCL correctness stage, and env/nccl-network (read from the dead ranks' NCCL
# logs) matches CAUSE and says NCCL failed to initialize the plugin.
planted() {
    local name="$1" cause="$2" status=0 network moved ranks
    shift 2
    suite "$name" NCCL_NET= "$@" -- --checks env,correctness --quick || status=$?
    network="$(verdict "$name" env/nccl-network)"
    moved="$(verdict "$name" correctness/nccl/cuda)"
    ranks="$(verdict "$name" harness/ranks)"
    if ((status == 1)) && [[ "$network" == fail:* && "$moved" == pass:* ]] && grep -Eq -- "$cause" <<<"$network"; then
        say "caught with data moving ($*, NCCL_NET unset): env/nccl-network ${network}; correctness/nccl/cuda ${moved}"
    elif ((status == 1)) && [[ "$network" == fail:* && "$ranks" == fail:* && "$moved" != pass:* ]] &&
        grep -Eq -- "$cause" <<<"$network" && grep -q "Failed to initialize NET plugin" <<<"$network" &&
        grep -q "in stage 'correctness/nccl/" <<<"$ranks"; then
        say "caught, no data moved ($*, NCCL_NET unset): the ranks died in NCCL's init after it failed to initialize the plugin (CRASH): harness/ranks ${ranks}; env/nccl-network ${network}"
    else
        sed -e "s/^/  [suite-${name}] /" "${logs}/suite-${name}.txt"
        fail "planted $* with NCCL_NET unset: the suite did not fail env/nccl-network quoting '${cause}' with data moving, nor report CRASH (exit ${status}; env/nccl-network ${network}; correctness/nccl/cuda ${moved}; harness/ranks ${ranks})"
    fi
}

if ! "$python" -c 'import torch, torch_dist_check.harness.placement' 2>/dev/null; then
    say "suite skipped: ${python} cannot import torch and torch_dist_check.harness.placement (put the suite on PYTHONPATH)"
else
    if suite plugin -- --checks env,correctness,bandwidth --quick; then
        say "suite, 2 ranks ($(verdict plugin placement/nccl)): every check passed through network ${net}"
        say "  correctness/nccl/cuda $(verdict plugin correctness/nccl/cuda)"
        say "  bandwidth/nccl/cuda $(verdict plugin bandwidth/nccl/cuda)"
    else
        sed -e 's/^/  [suite-plugin] /' "${logs}/suite-plugin.txt"
        fail "the acceptance suite failed through the plugin (${logs}/suite-plugin.txt)"
    fi
    planted fallback "(Could not find:|No plugin found).*${misspelled}" "NCCL_NET_PLUGIN=${misspelled}"
    planted no-provider-fallback "NET/OFI|Failed to initialize NET plugin" FI_PROVIDER=no-such-provider
    if [[ -n "$shadow_path" ]]; then
        planted no-libfabric-fallback "libfabric\.so\.1: cannot open shared object file" "LD_LIBRARY_PATH=${shadow_path}"
    fi
fi
rm -rf "$shadow"

# --- 5. deactivation --------------------------------------------------------------------------
# shellcheck source=/dev/null
source "${prefix}/etc/conda/deactivate.d/nccl-ofi-plugin.sh"
if [[ "$(state NCCL_NET)" != "$before_net" || "$(state NCCL_NET_PLUGIN)" != "$before_plugin" ]]; then
    fail "deactivation left NCCL_NET='$(state NCCL_NET)' NCCL_NET_PLUGIN='$(state NCCL_NET_PLUGIN)'"
fi

if ((failures > 0)); then
    say "${failures} check(s) failed; NCCL's logs are in ${logs}"
    exit 1
fi
say "NCCL loaded the aws-ofi-nccl plugin of ${prefix} and used network ${net}; planted failures were caught"
