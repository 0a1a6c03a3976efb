#!/usr/bin/env bash
# NCCL 2.30.7-1 built from its source tarball on a GPU machine for the peer-loss benchmarks (peerloss_matrix.sh,
# peer_loss_judging_gpu.sh): stock, or the channel's (patches/nccl/2.30.7-1/abort-wakeup applied, no fuzz), for
# Hopper (NCCL_CUDA_ARCH_LIST 9.0), with only the functions those benchmarks use (ONLY_FUNCS overrides; an op left out
# is silently skipped), by the recipe's own build.sh; the library stripped.
# Usage, from the repository root: [CPU_COUNT=N] bash benchmarks/build_nccl_variant.sh stock|channel TARBALL PREFIX
# (TARBALL: `git archive --prefix=nccl-2.30.7-1/ v2.30.7-1 | gzip -n` of NVIDIA/nccl; the library: PREFIX/lib/libnccl.so.2).
set -euo pipefail
[ "$#" = 3 ] && { [ "$1" = stock ] || [ "$1" = channel ]; } || { echo "usage: $0 stock|channel TARBALL PREFIX" >&2; exit 2; }
variant=$1 tarball=$2 prefix=$3 repo=$PWD
src=$(mktemp -d "/tmp/nccl-src-$variant.XXXXXX")
tar -xzf "$tarball" -C "$src" --strip-components=1
if [ "$variant" = channel ]; then
  for p in "$repo"/patches/nccl/2.30.7-1/abort-wakeup/*.patch; do patch -d "$src" -p1 -F0 --no-backup-if-mismatch -s < "$p"; done
fi
BUILD_PREFIX=$src/no-build-prefix RECIPE_DIR=$repo/recipes/nccl SRC_DIR=$src PREFIX=$prefix NCCL_CUDA_ARCH_LIST=9.0 \
  CUDA_HOME=/usr/local/cuda CPU_COUNT=${CPU_COUNT:-$(nproc)} \
  ONLY_FUNCS=${ONLY_FUNCS:-"AllReduce * f32 * *|ReduceScatter * f32 * *|AllGather * *|Broadcast * *|SendRecv"} \
  bash "$repo/recipes/nccl/build.sh"
strip --strip-unneeded "$prefix/lib/libnccl.so.2" 2>/dev/null || true
