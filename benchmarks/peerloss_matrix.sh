#!/usr/bin/env bash
# The peer-loss training matrix on a GPU machine (issue 42): build stock and patched NCCL 2.30.7, then rounds of the DDP train cases on three NCCLs x
# two placements and train-hsdp, interleaved so that a time limit leaves every configuration with runs.
# Usage, from the repository root: NCCL_TARBALL=nccl-2.30.7-1.tar.gz OUT=DIR bash benchmarks/peerloss_matrix.sh
# (the tarball: `git archive --prefix=nccl-2.30.7-1/ v2.30.7-1` of NVIDIA/nccl). Logs and one JSON per suite
# run go to $OUT/i42.tar.gz. BUDGET_S: start no suite run after this many seconds; ROUNDS; ONLY=1 FIRST_ROUND=N:
# the channel NCCL rows and HSDP only, from round N. Libraries already at /tmp/i42/{stock,channel}/lib/libnccl.so.2
# are used as they are (built on another machine with the same build.sh command and copied there: no build on the
# GPU machine's time). With fewer than three GPUs the one-GPU-per-rank rows are skipped (the DDP cases need three)
# and HSDP runs its four ranks on the GPUs there are (NCCL_MULTI_RANK_GPU_ENABLE=1, NCCL >= 2.30).
# No -e: a suite run that fails is recorded (its rc and JSON) and the matrix goes on.
set -uo pipefail
: "${OUT:?set OUT to the folder for the results}"
repo=$PWD
budget=${BUDGET_S:-560}
rounds=${ROUNDS:-5}
export PYTHONUNBUFFERED=1 PYTHONPATH=$repo/scripts NCCL_NVLS_ENABLE=0
funcs="AllReduce * f32 * *|ReduceScatter * f32 * *|AllGather * *|Broadcast * *|SendRecv"
work=/tmp/i42; res=$work/results
mkdir -p "$work" "$res"
nccl_lib_dir=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))')
[ -f "$work/wheel-libnccl.so.2" ] || cp "$nccl_lib_dir/libnccl.so.2" "$work/wheel-libnccl.so.2"
log() { echo "[$SECONDS s] $*" | tee -a "$res/run42.log" >&2; }
{ nvidia-smi -L; nvidia-smi topo -m | head -6; python3 -c 'import torch; print("torch", torch.__version__, "wheel nccl", torch.cuda.nccl.version())'; } >> "$res/run42.log" 2>&1

build() {  # $1 = stock|channel
  local src=$work/src-$1
  [ -f "$work/$1/lib/libnccl.so.2" ] && return 0
  mkdir -p "$src" && tar -xzf "${NCCL_TARBALL:?the NCCL 2.30.7-1 source tarball}" -C "$src" --strip-components=1
  if [ "$1" = channel ]; then
    for p in "$repo"/patches/nccl/2.30.7-1/abort-wakeup/*.patch; do patch -d "$src" -p1 -F0 --no-backup-if-mismatch -s < "$p" || return 1; done
  fi
  BUILD_PREFIX=$work/no-build-prefix RECIPE_DIR=$repo/recipes/nccl SRC_DIR=$src PREFIX=$work/$1 NCCL_CUDA_ARCH_LIST=9.0 CUDA_HOME=/usr/local/cuda \
    CPU_COUNT=32 ONLY_FUNCS="$funcs" bash "$repo/recipes/nccl/build.sh" > "$res/build-$1.log" 2>&1
}
use() {  # $1 = wheel|stock|channel
  if [ "$1" = wheel ]; then cp "$work/wheel-libnccl.so.2" "$nccl_lib_dir/libnccl.so.2"
  else cp "$work/$1/lib/libnccl.so.2" "$nccl_lib_dir/libnccl.so.2"; fi
}
gpu_count=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
all_gpus=$(seq -s, 0 $((gpu_count > 0 ? gpu_count - 1 : 0)))
suite() {  # $1 = nccl, $2 = label, $3 = visible GPUs, $4 = round, rest = suite args
  local nccl=$1 label=$2 gpus=$3 round=$4; shift 4
  if [ "$SECONDS" -gt "$budget" ]; then log "SKIPPED $label round $round: past the ${budget} s budget"; return; fi
  case $label in *-pergpu) if [ "$gpu_count" -lt 3 ]; then log "SKIPPED $label round $round: one GPU per rank needs 3 GPUs, this machine has $gpu_count"; return; fi;; esac
  use "$nccl"
  CUDA_VISIBLE_DEVICES=$gpus timeout 150 python3 -m torch_dist_check --nproc 1 --checks peerloss --peerloss-watcher on \
    --json "$res/$label.r$round.json" "$@" > "$res/$label.r$round.out" 2>&1
  log "$label round $round (CUDA_VISIBLE_DEVICES=$gpus, $nccl NCCL): rc=$?"
}

log "building stock and channel NCCL 2.30.7 ($funcs)"
build stock & a=$!; build channel & b=$!
wait $a; ra=$?; wait $b; rb=$?
log "builds: stock rc=$ra channel rc=$rb"
if [ "$ra" != 0 ] || [ "$rb" != 0 ]; then tail -n 20 "$res"/build-*.log; tar -czf "$OUT/i42.tar.gz" -C "$work" results; exit 1; fi
for round in $(seq "${FIRST_ROUND:-1}" "$rounds"); do
  if [ -n "${ONLY:-}" ]; then
    suite channel train-channel-pergpu "$all_gpus" "$round" --peerloss-cases train --peerloss-recover-timeout 30
    suite channel train-channel-shared 0,1     "$round" --peerloss-cases train --peerloss-recover-timeout 30
    suite channel "hsdp-channel-${gpu_count}gpu" "$all_gpus" "$round" --peerloss-cases train-hsdp --peerloss-runs 2 --peerloss-recover-timeout 60
    continue
  fi
  suite stock   train-stock-shared   0,1     "$round" --peerloss-cases train --peerloss-recover-timeout 30
  suite stock   train-stock-pergpu   "$all_gpus" "$round" --peerloss-cases train --peerloss-recover-timeout 30
  suite wheel   train-wheel-pergpu   "$all_gpus" "$round" --peerloss-cases train --peerloss-recover-timeout 30
  suite channel train-channel-pergpu "$all_gpus" "$round" --peerloss-cases train --peerloss-recover-timeout 30
  suite channel train-channel-shared 0,1     "$round" --peerloss-cases train --peerloss-recover-timeout 30
  suite channel "hsdp-channel-${gpu_count}gpu" "$all_gpus" "$round" --peerloss-cases train-hsdp --peerloss-runs 2 --peerloss-recover-timeout 60
done
use wheel
tar -czf "$OUT/i42.tar.gz" -C "$work" results
log "done"
