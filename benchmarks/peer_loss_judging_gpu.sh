#!/usr/bin/env bash
# Issue 74 in one device call (566 s on one H100 on 2026-12-07: docs/records/2026-12-07-issue-74-wheel-nccl-one-h100.md):
#  (A) the survivor's exception and first step after a death, one run at a time, on this tree (the wheel's NCCL);
#  (B) while the channel's NCCL builds in the background: the +slowjudge rows (every watcher judges 1 s late, so
#      that PyTorch's watchdog aborts first) on OLD's tree and on this one, and the slow-judging GPU test;
#  (C) train-hsdp on the wheel's NCCL and on the channel's (preloaded) alternated, one run at a time: the join's split.
# Usage, from the repository root on the GPU machine:
#   OUT=DIR OLD=DIR NCCL_TARBALL=nccl-2.30.7-1.tar.gz bash benchmarks/peer_loss_judging_gpu.sh
#   OLD: a tree from before the fix (`git archive 1e855b2 scripts | tar -x -C DIR`); the tarball: `git archive
#   --prefix=nccl-2.30.7-1/ v2.30.7-1 | gzip -n` of NVIDIA/nccl (both carried in an ignored folder).
#   ABUDGET (default 185 s), AROWS, CEND (C starts no run after this many seconds; default 545), NOBUILD=1 (no C).
set -u
: "${OUT:?set OUT}" "${OLD:?set OLD to a tree from before the fix}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
nvidia-smi -L; nproc
python3 -c 'import torch; print(torch.__version__, torch.cuda.nccl.version())'
mkdir -p "$OUT/a" "$OUT/b" "$OUT/c" "$OUT/channel"
OUT=$OUT/a python3 benchmarks/peer_loss_net.py --rows "${AROWS:-train-fresh-pytorch,train-hsdp-pytorch}" --runs 10 --parallel 1 \
  --budget-s "${ABUDGET:-185}" 2> "$OUT/a/runs.err" > /dev/null
echo "== A"; cat "$OUT/a/summary.txt"
echo "[$SECONDS s] build starts"
[ -n "${NOBUILD:-}" ] || (
  CPU_COUNT=12 nice -n 19 bash benchmarks/build_nccl_variant.sh channel "${NCCL_TARBALL:?the NCCL 2.30.7-1 source tarball}" /tmp/channel &&
    cp -L /tmp/channel/lib/libnccl.so.2 "$OUT/channel/libnccl.so.2"
) > "$OUT/channel/build.log" 2>&1 &
build=$!
PYTHONPATH=scripts timeout 200 python3 -m pytest -q -p no:cacheprovider -n 0 -m gpu tests/test_dist_check_train.py -k watchdog_aborted > "$OUT/b/gputest.log" 2>&1 &
gputest=$!
OUT=$OUT/b JUDGING_S=1 python3 benchmarks/peer_loss_net.py --arm old="$OLD" --runs "${BRUNS:-3}" --parallel 4 --budget-s 80 \
  --rows train-fresh-pytorch+slowjudge@old,train-fresh-pytorch+slowjudge,train-hsdp-pytorch+slowjudge@old,train-hsdp-pytorch+slowjudge \
  2> "$OUT/b/runs.err" > /dev/null
echo "== B"; cat "$OUT/b/summary.txt"
wait $gputest; echo "[$SECONDS s] gpu test rc=$?"; tail -3 "$OUT/b/gputest.log"
wait $build; rc=$?; [ -n "${NOBUILD:-}" ] && rc=skipped; echo "[$SECONDS s] build rc=$rc"; tail -2 "$OUT/channel/build.log"; ls -la "$OUT/channel"
if [ "$rc" = 0 ]; then
  left=$(( ${CEND:-545} - SECONDS ))
  OUT=$OUT/c python3 benchmarks/peer_loss_net.py --arm channel="$OUT/channel/libnccl.so.2" --runs 10 --parallel 1 --budget-s "$left" \
    --rows train-hsdp-pytorch,train-hsdp-pytorch@channel 2> "$OUT/c/runs.err" > /dev/null
  echo "== C"; cat "$OUT/c/summary.txt"
fi
echo "[$SECONDS s] done"
grep -h "failed:" "$OUT"/a/runs.err "$OUT"/b/runs.err "$OUT"/c/runs.err 2>/dev/null | cut -c1-1200 | head -12
