#!/usr/bin/env bash
# Issue 45's GPU runs across stand-in nodes (torch_dist_check --nodes), on a machine of two or more GPUs, as root:
# the node faults on the wheel's NCCL and on the channel's, one case per suite run (a case's runs stay within the
# call's time), then the DDP train cases across three nodes.
# Usage, from the repository root: OUT=DIR bash benchmarks/nodes_gpu.sh
#   NET_TOOLS=DIR  a folder with ip, tc and nft to put first on PATH (an image without iproute2/nftables);
#   CHANNEL_NCCL=FILE  the channel's libnccl.so.2 (NCCL >= 2.30; default /tmp/i42/channel/lib/libnccl.so.2, where
#                  benchmarks/peerloss_matrix.sh builds it); without it only the wheel's NCCL runs;
#   NCCLS ("wheel channel"): which NCCLs, in order; FAULTS ("partition node-kill store-lost lossy-link"): the node
#   faults, one suite run each; TRAIN ("train"): the DDP cases across three nodes, empty for none; RUNS (3) each;
#   SINGLE_RUNS (1): runs of the `single` cases (six variants) after the train cases, 0 for none; LINK_DELAY (50):
#   the lossy link's delay each way, ms (a delay line where the kernel has no netem; 0: loss alone, nftables);
#   BUDGET_S (540): start no suite run after this many seconds, and end each by then plus 45 s.
# Each run's JSON and log go to $OUT/nodes.tar.gz; a line per run to stderr. The wheel's libnccl is put back at the end.
# Ran on two H100s on 2026-11-26 in four calls (NCCLS=wheel, NCCLS=channel, then FAULTS/TRAIN subsets; the figures
# are in docs/explain/peer-watcher.md, "Split brain" and "Across nodes, the rebuild measured").
set -uo pipefail
: "${OUT:?set OUT to the folder for the results}"
repo=$PWD; res=/tmp/nodes-gpu; mkdir -p "$res"
export PYTHONUNBUFFERED=1 PYTHONPATH=$repo/scripts NCCL_NVLS_ENABLE=0
[ -n "${NET_TOOLS:-}" ] && export PATH=$NET_TOOLS:$PATH
runs=${RUNS:-3}; budget=${BUDGET_S:-540}; single_runs=${SINGLE_RUNS:-1}
channel=${CHANNEL_NCCL:-/tmp/i42/channel/lib/libnccl.so.2}
lib_dir=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))')
# Kept outside $res: the results' tarball must stay small enough to come back.
wheel_copy=/tmp/nodes-gpu-wheel-libnccl.so.2
[ -f "$wheel_copy" ] || cp "$lib_dir/libnccl.so.2" "$wheel_copy"
log() { echo "[$SECONDS s] $*" | tee -a "$res/nodes.log" >&2; }
one() {  # one LABEL NODES ARGS...: a suite run across NODES nodes, one rank each
  local label=$1 nodes=$2; shift 2
  if [ "$SECONDS" -gt "$budget" ]; then log "SKIPPED $label: past the ${budget} s budget"; return; fi
  timeout $((budget + 45 - SECONDS)) python3 -m torch_dist_check --nodes "$nodes" --nproc-per-node 1 --json "$res/$label.json" "$@" > "$res/$label.out" 2>&1
  log "$label rc=$?: $(grep -E '^peerloss' "$res/$label.out" | cut -c1-400 | tr '\n' '|')"
  tar -czf "$OUT/nodes.tar.gz" -C "$res" .
}
faults=(--checks peerloss --peerloss-backend nccl --peerloss-transports net --peerloss-heartbeat 0.5
  --peerloss-heartbeat-timeout 1 --peerloss-runs "$runs" --peerloss-link-delay "${LINK_DELAY:-50}")
for nccl in ${NCCLS:-wheel channel}; do
  if [ "$nccl" = channel ]; then
    [ -f "$channel" ] || { log "SKIPPED the channel's NCCL: no $channel"; continue; }
    cp "$channel" "$lib_dir/libnccl.so.2"
  fi
  for case in ${FAULTS-partition node-kill store-lost lossy-link}; do one "$case-$nccl" 2 "${faults[@]}" --peerloss-cases "$case"; done
  train=${TRAIN-train}
  [ -n "$train" ] && one "${train// /,}-$nccl" 3 --checks peerloss --peerloss-backend nccl --peerloss-transports net \
    --peerloss-cases "${train// /,}" --peerloss-watcher on --peerloss-runs "$runs" --peerloss-recover-timeout 30
  [ "$single_runs" -gt 0 ] && one "single-$nccl" 2 --checks peerloss --peerloss-backend nccl --peerloss-transports net \
    --peerloss-cases single --peerloss-runs "$single_runs"
  cp "$wheel_copy" "$lib_dir/libnccl.so.2"
done
log "done"
