#!/usr/bin/env bash
# The peer-loss training matrix on a GPU machine (issues 42, 55): stock and patched NCCL 2.30.7 and the wheel's, rounds of
# the DDP train cases (two placements) and train-hsdp, interleaved so that a time limit leaves every row with runs.
# Usage, from the repository root: NCCL_TARBALL=nccl-2.30.7-1.tar.gz OUT=DIR bash benchmarks/peerloss_matrix.sh
# (the tarball: `git archive --prefix=nccl-2.30.7-1/ v2.30.7-1 | gzip -n` of NVIDIA/nccl).
#   ROWS     which rows, in this order each round (default: all of them):
#            train-{stock,wheel,channel}-pergpu  train-{stock,channel}-shared  hsdp-{wheel,stock,channel}
#   ROUNDS   rounds (default 5); RUNS: --peerloss-runs of each suite run (default 1; hsdp rows 2, or HSDP_RUNS)
#   BUDGET_S start no suite run after this many seconds (default 560)
#   OLD      a second tree (e.g. `git archive <commit> scripts | tar -x -C DIR`): each row also runs on DIR/scripts,
#            alternated with this tree's, labelled `-old` (a before/after in one session;
#            which of the two runs first alternates by round)
#   NCCL_LIBS a folder with {stock,channel}.tar.gz as an earlier run left them in $OUT (no build then); else both
#            are built from NCCL_TARBALL in the background (about 130 s on 64 cores) while the wheel rows run,
#            and left in $OUT as stock.tar.gz and channel.tar.gz for the next run to carry
# Logs, one JSON per suite run and summary.txt (median/worst of every figure per row) go to $OUT/results.tar.gz.
# With fewer than three GPUs the one-GPU-per-rank rows are skipped (the DDP cases need three) and HSDP runs its four
# ranks on the GPUs there are (NCCL_MULTI_RANK_GPU_ENABLE=1, NCCL >= 2.30).
# No -e: a suite run that fails is recorded (its rc and JSON) and the matrix goes on.
set -uo pipefail
: "${OUT:?set OUT to the folder for the results}"
repo=$PWD
budget=${BUDGET_S:-560}
rounds=${ROUNDS:-5}
runs=${RUNS:-}
rows=${ROWS:-train-stock-shared train-stock-pergpu train-wheel-pergpu train-channel-pergpu train-channel-shared hsdp-wheel hsdp-stock hsdp-channel}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
work=/tmp/i42; res=$work/results
mkdir -p "$work" "$res"
nccl_lib_dir=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))')
[ -f "$work/wheel-libnccl.so.2" ] || cp "$nccl_lib_dir/libnccl.so.2" "$work/wheel-libnccl.so.2"
log() { echo "[$SECONDS s] $*" | tee -a "$res/run.log" >&2; }
{ nvidia-smi -L; nvidia-smi topo -m | head -6; python3 -c 'import torch; print("torch", torch.__version__, "wheel nccl", torch.cuda.nccl.version())'; } >> "$res/run.log" 2>&1

build() {  # $1 = stock|channel: built (or unpacked from NCCL_LIBS) into $work/$1/lib, packed into $OUT/$1.tar.gz
  [ -f "$work/$1/lib/libnccl.so.2" ] && return 0
  if [ -n "${NCCL_LIBS:-}" ]; then mkdir -p "$work/$1" && tar -xzf "$NCCL_LIBS/$1.tar.gz" -C "$work/$1"; return; fi
  CPU_COUNT=24 bash "$repo/benchmarks/build_nccl_variant.sh" "$1" "${NCCL_TARBALL:?the NCCL 2.30.7-1 source tarball}" "$work/$1" \
    > "$res/build-$1.log" 2>&1 || return 1
  tar -czhf "$OUT/$1.tar.gz" -C "$work/$1" lib/libnccl.so.2  # -h: the library, not its link
}
declare -A building
for n in stock channel; do
  case " $rows " in *"-$n"*) build "$n" & building[$n]=$! ;; esac
done
use() {  # $1 = wheel|stock|channel; waits for that build; false when it failed
  if [ "$1" = wheel ]; then cp "$work/wheel-libnccl.so.2" "$nccl_lib_dir/libnccl.so.2"; return; fi
  if [ -n "${building[$1]:-}" ]; then
    wait "${building[$1]}"; local rc=$?; unset "building[$1]"
    log "NCCL $1 ready: rc=$rc"; [ "$rc" = 0 ] || { tail -n 20 "$res/build-$1.log" >&2; touch "$work/$1.failed"; }
  fi
  [ ! -e "$work/$1.failed" ] && cp "$work/$1/lib/libnccl.so.2" "$nccl_lib_dir/libnccl.so.2"
}
gpu_count=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
all_gpus=$(seq -s, 0 $((gpu_count > 0 ? gpu_count - 1 : 0)))
suite() {  # $1 = row, $2 = round, $3 = tree (scripts folder), $4 = label suffix
  local row=$1 round=$2 tree=$3 suffix=$4 nccl gpus args
  nccl=${row#*-}; nccl=${nccl%%-*}
  case $row in
    *-pergpu) gpus=$all_gpus; args=(--peerloss-cases train --peerloss-recover-timeout 30 --peerloss-runs "${runs:-1}")
              if [ "$gpu_count" -lt 3 ]; then log "SKIPPED $row: one GPU per rank needs 3 GPUs, this machine has $gpu_count"; return; fi ;;
    *-shared) gpus=0,1; args=(--peerloss-cases train --peerloss-recover-timeout 30 --peerloss-runs "${runs:-1}") ;;
    hsdp-*)   gpus=$all_gpus; args=(--peerloss-cases train-hsdp --peerloss-recover-timeout 60 --peerloss-runs "${HSDP_RUNS:-${runs:-2}}") ;;
    *) log "unknown row $row"; return ;;
  esac
  if [ "$SECONDS" -gt "$budget" ]; then log "SKIPPED $row$suffix round $round: past the ${budget} s budget"; return; fi
  use "$nccl" || { log "SKIPPED $row$suffix round $round: NCCL $nccl did not build"; return; }
  PYTHONPATH=$tree CUDA_VISIBLE_DEVICES=$gpus timeout 240 python3 -m torch_dist_check --nproc 1 --checks peerloss \
    --peerloss-watcher on --json "$res/$row$suffix.r$round.json" "${args[@]}" > "$res/$row$suffix.r$round.out" 2>&1
  log "$row$suffix round $round (CUDA_VISIBLE_DEVICES=$gpus, $nccl NCCL): rc=$?"
}

pair() {  # $1 = row, $2 = round: this tree's run and OLD's, the first of the two alternating by round
  if [ -n "${OLD:-}" ] && [ $(($2 % 2)) = 0 ]; then
    suite "$1" "$2" "$OLD/scripts" "-old"; suite "$1" "$2" "$repo/scripts" ""
  else
    suite "$1" "$2" "$repo/scripts" ""; [ -n "${OLD:-}" ] && suite "$1" "$2" "$OLD/scripts" "-old"
  fi
}
for round in $(seq "${FIRST_ROUND:-1}" "$rounds"); do
  for row in $rows; do
    # The wheel's rows first while the builds run: reorder so that each round starts with them.
    case $row in *wheel*) pair "$row" "$round" ;; esac
  done
  for row in $rows; do
    case $row in *wheel*) ;; *) pair "$row" "$round" ;; esac
  done
done
use wheel
for n in "${!building[@]}"; do wait "${building[$n]}"; done
summary=()
for f in "$res"/*.json; do [ -e "$f" ] && { b=${f##*/}; summary+=(--run "${b%.r*.json}=$f"); }; done
[ "${#summary[@]}" -gt 0 ] && PYTHONPATH=$repo/scripts python3 -m torch_dist_check.tables peerloss "${summary[@]}" > "$res/summary.txt" 2>&1
cat "$res/summary.txt" >&2
tar -czf "$OUT/results.tar.gz" -C "$work" results
log "done"
