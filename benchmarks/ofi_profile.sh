#!/usr/bin/env bash
# Issue 57: where the time of NCCL's data path goes through the aws-ofi-nccl plugin against NCCL's own Socket
# transport, all_reduce of 64 MiB between two GPUs of one host (P2P and SHM off, so every byte crosses the
# network: loopback TCP). For each network, in turn (ROUNDS times): two ranks make calls for PROFILE_S + 3 s;
# once both are past warm-up a system-wide `perf record -a -g` samples PROFILE_S seconds; then `perf report` by
# shared object, by thread, by symbol and by caller, and each rank's bus bandwidth over its calls.
# Usage, on the GPU machine from the repository root (what it carries is in .carry/, see docs/records/2026-11-28-ofi-plugin-profile-two-h100.md,
# "Where the plugin's time goes"):
#   OUT=DIR PERF=.carry/perf OFI_TARBALL=.carry/ofi/aws-ofi-nccl-1.6.0-configured.tar.gz \
#     FABRIC_INCLUDE=.carry/ofi/libfabric-1.17-include.tar.gz bash benchmarks/ofi_profile.sh
#   PERF     a folder with a `perf` binary and lib/ holding the libraries it needs beyond libc
#   OFI_TARBALL  aws-ofi-nccl's source with `configure` generated (autogen.sh run where autotools are)
#   FABRIC_INCLUDE  libfabric's include/rdma headers (the machine's own libfabric.so.1 is linked and used)
#   ROUNDS (default 2), PROFILE_S (default 4), PROFILE_BYTES (default 64 MiB), FI_PROVIDER (default tcp), PROBES,
#   OFI_EXTRA (see the loop)
# With one GPU both ranks share it as two "hosts" (their own NCCL_HOSTID): the figures then say little about
# the gap between two GPUs, which is the GPU's time slices on one (docs/records/2026-11-25-ofi-plugin-data-one-h100.md, issue 21).
set -uo pipefail
: "${OUT:?set OUT to the folder for the results}"
repo=$PWD
work=/tmp/ofi-profile; res=$work/results
rm -rf "$work"; mkdir -p "$res" "$work/fabric/lib"
log() { echo "[$SECONDS s] $*" | tee -a "$res/run.log" >&2; }
perf_dir=$(cd "${PERF:?a folder with perf and its lib/}" && pwd)
perf_bin=$perf_dir/perf PERF_LD=$perf_dir/lib
perf() { LD_LIBRARY_PATH=$PERF_LD "$perf_bin" "$@"; }

# The plugin, built by the recipe's build.sh against the machine's libfabric.so.1 and the carried headers.
fabric_so=$(ldconfig -p | awk '/libfabric\.so\.1 /{print $NF; exit}')
[ -n "$fabric_so" ] || { log "no libfabric.so.1 on this machine"; exit 2; }
tar -xzf "${FABRIC_INCLUDE:?}" -C "$work/fabric" && ln -s "$fabric_so" "$work/fabric/lib/libfabric.so"
mkdir -p "$work/src" && tar -xzf "${OFI_TARBALL:?}" -C "$work/src" --strip-components=1
version=$(sed -n 's/^PACKAGE_VERSION=.\([0-9.]*\).*/\1/p' "$work/src/configure" | head -1)
( cd "$work/src" && PKG_VERSION=$version OFI_LIBFABRIC_ROOT=$work/fabric PREFIX=$work/prefix CUDA_HOME=/usr/local/cuda \
    CPU_COUNT=$(nproc) bash "$repo/recipes/nccl-ofi-plugin/build.sh" ) > "$res/build.log" 2>&1 \
  || { tail -n 30 "$res/build.log" >&2; log "plugin build failed"; exit 1; }
log "aws-ofi-nccl $version built into $work/prefix"
{ nvidia-smi -L; python3 -c 'import torch; print("torch", torch.__version__, "nccl", torch.cuda.nccl.version())'; \
  echo "libfabric: $fabric_so"; nproc; } >> "$res/run.log" 2>&1

gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
common=(NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_NVLS_ENABLE=0 NCCL_DEBUG=INFO "NCCL_DEBUG_SUBSYS=INIT,NET"
        PROFILE_BYTES="${PROFILE_BYTES:-$((64 << 20))}" PROFILE_S="${PROFILE_S:-4}" PYTHONUNBUFFERED=1)
[ "$gpus" -lt 2 ] && log "one GPU: both ranks share it as two hosts (NCCL_HOSTID)"
one() {  # $1 = label, then the network's variables
  local label=$1; shift
  local dir=$res/$label; mkdir -p "$dir"
  rm -f "$work/ready"
  local hostid=()
  # shellcheck disable=SC2016  # expanded by the rank's own shell
  [ "$gpus" -lt 2 ] && hostid=(--no-python bash -c 'NCCL_HOSTID=host.$LOCAL_RANK exec python3 "$@"' _)
  env "${common[@]}" "$@" READY="$work/ready" STOP="$work/stop" LD_LIBRARY_PATH="$work/prefix/lib:${LD_LIBRARY_PATH:-}" \
    timeout 120 python3 -m torch.distributed.run --nproc_per_node 2 --master-port 29517 "${hostid[@]}" \
    "$repo/benchmarks/ofi_profile.py" > "$dir/ranks.out" 2> "$dir/ranks.log" &
  local ranks=$!
  for _ in $(seq 600); do [ -e "$work/ready" ] || ! kill -0 "$ranks" 2>/dev/null && break; sleep 0.1; done
  if [ -e "$work/ready" ]; then
    perf record -a -g -F 997 -o "$dir/perf.data" -- sleep "${PROFILE_S:-4}" > "$dir/perf-record.log" 2>&1
  fi
  wait "$ranks"; local rc=$?
  # NCCL's log goes to stdout with the ranks' JSON lines.
  grep '^{' "$dir/ranks.out" > "$dir/ranks.jsonl"
  grep -h -o -E 'Using network .*|NET/OFI Selected .*|Using transport .*|NET/Socket : Using .*|Using [0-9]+ threads and [0-9]+ sockets.*|\[Proxy Progress\].*|[0-9]+ coll channels.*' "$dir/ranks.out" | sort | uniq -c > "$dir/network.txt"
  if [ -e "$dir/perf.data" ]; then
    perf report -i "$dir/perf.data" --stdio --no-children --sort dso -g none --percent-limit 0.5 > "$dir/by-dso.txt" 2>/dev/null
    perf report -i "$dir/perf.data" --stdio --no-children --sort pid -g none --percent-limit 0.5 > "$dir/by-thread.txt" 2>/dev/null
    perf report -i "$dir/perf.data" --stdio --no-children --sort sym --percent-limit 0.5 -g none > "$dir/by-symbol.txt" 2>/dev/null
    perf report -i "$dir/perf.data" --stdio --no-children --sort comm,sym --percent-limit 1 -g caller,0.5,callee --max-stack 12 \
      > "$dir/callers.txt" 2>/dev/null
    rm -f "$dir/perf.data"
  fi
  log "$label: rc=$rc $(tr '\n' ' ' < "$dir/ranks.jsonl")"
}
# Probes of the cause, with PROBES=1: Socket held to one thread and one socket per connection (the plugin
# drives each connection from the proxy thread alone), and the plugin with twice the channels.
for round in $(seq "${ROUNDS:-2}"); do
  one "socket-r$round" NCCL_NET=Socket NCCL_NET_PLUGIN=none
  one "ofi-r$round" NCCL_NET="AWS Libfabric" FI_PROVIDER="${FI_PROVIDER:-tcp}"
  if [ -n "${PROBES:-}" ]; then
    one "socket-1thread-r$round" NCCL_NET=Socket NCCL_NET_PLUGIN=none NCCL_SOCKET_NTHREADS=1 NCCL_NSOCKS_PERTHREAD=1
    one "ofi-4channels-r$round" NCCL_NET="AWS Libfabric" FI_PROVIDER="${FI_PROVIDER:-tcp}" NCCL_MIN_NCHANNELS=4
  fi
  # OFI_EXTRA="VAR=value ...": the plugin once more with those variables (a libfabric setting tried).
  if [ -n "${OFI_EXTRA:-}" ]; then
    read -r -a extra <<< "$OFI_EXTRA"
    one "ofi-extra-r$round" NCCL_NET="AWS Libfabric" FI_PROVIDER="${FI_PROVIDER:-tcp}" "${extra[@]}"
  fi
done
tar -czf "$OUT/ofi-profile.tar.gz" -C "$work" results
log "done"
