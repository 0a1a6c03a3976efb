#!/usr/bin/env bash
# Issue 57 on a machine of two GPUs: where the time of one cudampi all_reduce goes, in one call of at most 600 s.
#   1. MPICH 4.3.2 with CUDA from the carried autogen'ed tree (scripts/build-mpich-cuda.sh), against Debian's
#      libfabric and hwloc unpacked from the carried .debs (docs/howto/mpi-without-a-rebuild.md, "A CUDA-aware MPICH").
#   2. torch-mpi-backend for the machine's torch with site_mpi=mpich-cuda, as tests/test_cudampi_gpu.py builds it
#      (the recipe's source block for that torch, applied to the carried pytorch-2.6.0-pgmpi.tar.gz).
#   3. The raw MPICH calls on device memory (scripts/mpi-gpu-bench.c: MPI_Allreduce, MPI_Alltoall, MPI_Allgather,
#      MPI_Reduce_scatter_block) and the backend (benchmarks/mpi_split_gpu.py: CUDAMPI_COMPOSED=cuda, none and
#      auto, each with CUDAMPI_PROFILE off and on, NCCL in the same job) at 1, 16, 64 and 256 MiB.
#   4. The same two with one MPICH variable changed at a time (CVARS below, most likely first), while time is left.
# The baseline environment is the gpu-cluster site's (recipes/site-env/sites/gpu-cluster.sh) plus FI_PROVIDER=tcp.
# Usage, from the repository root, the carried folder holding mpich-4.3.2-autogen.tar.xz, pytorch-2.6.0-pgmpi.tar.gz,
# debs/*.deb and pylib/ (a pure-Python PyYAML, used where the machine's Python has none):
#   OUT=DIR bash benchmarks/mpi_split_gpu.sh
#   CARRY (.carry/mpi), JOBS (32, make jobs), BUDGET_S (540: start no step after this many seconds, and cut the
#   running one there), WORK (/tmp/mpi-split), CUDA (/usr/local/cuda), PYTHON (python3); TRIALS (labels of CVARS
#   below to run after the baseline, default all), BASE_MODES (cuda,none,auto) and MODES (cuda,none): the backend's
#   CUDAMPI_COMPOSED modes measured in the baseline and in each trial.
# Writes $OUT/mpi_split_gpu.tar.gz (every JSON document and log, packed again after each step) and
# $OUT/summary.txt (a line per step, also on stderr). A failed step is logged and the script goes on.
set -uo pipefail
[ -n "${OUT:-}" ] || { echo "set OUT to the folder for the results" >&2; exit 2; }
repo=$PWD
carry=$(cd "${CARRY:-.carry/mpi}" && pwd) || { echo "no carried folder ${CARRY:-.carry/mpi}" >&2; exit 2; }
work=${WORK:-/tmp/mpi-split}; res=$work/results; jobs=${JOBS:-32}; budget=${BUDGET_S:-540}
cuda=${CUDA:-/usr/local/cuda}; python=${PYTHON:-python3}
for input in mpich-4.3.2-autogen.tar.xz pytorch-2.6.0-pgmpi.tar.gz debs; do
  [ -e "$carry/$input" ] || { echo "missing $carry/$input (see the header of $0)" >&2; exit 2; }
done
rm -rf "$work"; mkdir -p "$res" "$OUT"
mpich=$work/mpich
sizes=1M,16M,64M,256M
export PYTHONUNBUFFERED=1 FI_PROVIDER=tcp NCCL_NVLS_ENABLE=0 CUDA_VISIBLE_DEVICES=0,1 MASTER_ADDR=127.0.0.1
# The gpu-cluster site's settings: every run starts from them.
export MPIR_CVAR_BCAST_POSIX_INTRA_ALGORITHM=mpir MPIR_CVAR_CH4_GPU_COLL_SWAP_BUFFER_SZ=0

log() { echo "[$SECONDS s] $*" | tee -a "$OUT/summary.txt" >&2; }
pack() { tar -czf "$OUT/mpi_split_gpu.tar.gz" -C "$res" . || log "packing the results failed"; }
# step NAME LIMIT_S COMMAND...: runs COMMAND with its stdout in $res/NAME.out and its stderr in $res/NAME.log,
# cut at LIMIT_S or at the budget, whichever comes first.
step() {
  local name=$1 limit=$2; shift 2
  local left=$((budget - SECONDS))
  if [ "$left" -le 5 ]; then log "SKIPPED $name: past the ${budget} s budget"; return 1; fi
  [ "$limit" -gt "$left" ] && limit=$left
  local start=$SECONDS rc=0
  timeout --kill-after=5 "$limit" "$@" > "$res/$name.out" 2> "$res/$name.log" || rc=$?
  log "$name rc=$rc in $((SECONDS - start)) s$([ "$rc" = 124 ] && echo " (cut at $limit s)")"
  pack
  return "$rc"
}

log "$("$python" -c 'import torch; print("torch", torch.__version__, "GPUs", torch.cuda.device_count(), "NCCL", torch.cuda.nccl.version())' 2>&1 | tail -n 1); $(nproc) cores"
nvidia-smi topo -m > "$res/topology.txt" 2>&1 || log "nvidia-smi topo failed"

# 1. MPICH with CUDA.
mkdir -p "$work/debs"
for deb in "$carry"/debs/*.deb; do dpkg -x "$deb" "$work/debs" || log "dpkg -x $deb failed"; done
if ! step mpich-build 330 bash scripts/build-mpich-cuda.sh --source "$carry/mpich-4.3.2-autogen.tar.xz" \
    --prefix "$mpich" --cuda "$cuda" --libfabric "$work/debs/usr" --hwloc "$work/debs/usr" --jobs "$jobs"; then
  tail -n 30 "$res/mpich-build.log" "$res/mpich-build.out" >&2
  log "no MPICH: nothing else can run"; exit 1
fi
# The unpacked libfabric and hwloc are found at run time through the loader path, as on the earlier runs.
fabric_lib=$(dirname "$(find "$work/debs" -name 'libfabric.so.1' -print -quit)")
export LD_LIBRARY_PATH=$mpich/lib:$fabric_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
mpiexec=$mpich/bin/mpiexec

# 2. The raw benchmark and the backend.
step bench-build 60 "$mpich/bin/mpicc" -O2 -DMPI_GPU_BENCH_CUDA -I"$cuda/include" -o "$work/mpi-gpu-bench" \
  scripts/mpi-gpu-bench.c -L"$cuda/lib64" -lcudart -Wl,-rpath,"$cuda/lib64"
cat > "$work/build_backend.py" <<'PY'
"""Build torch-mpi-backend for the installed torch with site_mpi=mpich-cuda, as tests/test_cudampi_gpu.py does."""
import os, subprocess, sys
from pathlib import Path

sys.path[:0] = ["tests", "scripts"]
import torch
import torch_mpi_backend_build as build

work, torch_source, mpich = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
version = torch.__version__.split("+")[0]
source = build.recipe_source(version)
(release,) = {Path(p).parts[Path(p).parts.index("pytorch") + 1] for p in source["patches"]}
src_dir, prefix = work / "src", work / "prefix"
src_dir.mkdir(parents=True)
prefix.mkdir()
build.prepare_source(src_dir, source, torch_source)
env = dict(os.environ, PREFIX=str(prefix), SRC_DIR=str(src_dir), RECIPE_DIR=str(build.RECIPE_DIR),
           CPU_COUNT=str(os.cpu_count() or 1), PYTHON=sys.executable, TORCH_MPI_BACKEND_TORCH_VERSION=version,
           TORCH_MPI_BACKEND_SOURCE_VERSION=release, TORCH_MPI_BACKEND_SITE_MPI="mpich-cuda",
           TORCH_MPI_BACKEND_MPI_ROOT=str(mpich), MPICC=str(mpich / "bin" / "mpicc"))
# build.sh's own output goes to stderr (the step's log); stdout carries only the result line.
subprocess.run(["bash", str(build.RECIPE_DIR / "build.sh")], env=env, check=True, stdout=sys.stderr)
print("SITE_PACKAGES", build.site_packages(Path(sys.executable), prefix))
PY
# pylib: a pure-Python PyYAML, behind the machine's own (the recipe is read with it).
step backend-build 200 env PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$carry/pylib" "$python" "$work/build_backend.py" "$work/backend" "$carry/pytorch-2.6.0-pgmpi.tar.gz" "$mpich"
site_packages=$(sed -n 's/^SITE_PACKAGES //p' "$res/backend-build.out")
[ -n "$site_packages" ] || log "no backend: only the raw MPICH calls run"
export PYTHONPATH=$site_packages:$repo/scripts

# One trial: the raw calls, then the backend, in the environment given (NAME=VALUE words; - for none).
trial() {
  local label=$1; shift
  local -a setting=()
  [ "$1" != - ] && setting=("$@")
  step "raw-$label" 60 env "${setting[@]}" "$mpiexec" -n 2 "$work/mpi-gpu-bench" --mem cuda \
    --collectives all_reduce,all_to_all,all_gather,reduce_scatter --sizes "$sizes" --iters 10 --warmup 2 \
    --max-call-s 0.5 --label "$label" --json
  if [ -n "$site_packages" ]; then
    # NCCL in every job: each trial's table compares with the NCCL of its own job.
    local modes=${MODES:-cuda,none} nccl=(--nccl)
    [ "$label" = baseline ] && modes=${BASE_MODES:-cuda,none,auto}
    step "backend-$label" 90 env "${setting[@]}" MASTER_PORT=$((29500 + RANDOM % 1000)) "$mpiexec" -n 2 \
      "$python" benchmarks/mpi_split_gpu.py --device cuda --modes "$modes" "${nccl[@]}" --sizes "$sizes" \
      --iters 10 --warmup 2 --max-call-s 1 --label "$label" --json "$res/backend-$label.json"
  fi
}
trial baseline -
# MPICH variables one at a time, the most likely place of the fixed cost first: the composition's 512 KiB
# chunks at 1 MiB are under the 1 MiB GPU IPC threshold; the IPC read algorithms of all-to-all and all-gather;
# the copy engine, the IPC handle cache and its address tracking; GPU fast copies; the write protocol; then
# MPI_Allreduce's own path (the swap buffer, the yaksa engine, the CH4 GPU collectives).
CVARS=(
  "p2p-threshold-0 MPIR_CVAR_CH4_IPC_GPU_P2P_THRESHOLD=0"
  "ipc-read MPIR_CVAR_ALLTOALL_POSIX_INTRA_ALGORITHM=ipc_read MPIR_CVAR_ALLGATHER_POSIX_INTRA_ALGORITHM=ipc_read"
  "engine-low-latency MPIR_CVAR_CH4_IPC_GPU_ENGINE_TYPE=copy_low_latency"
  "engine-compute MPIR_CVAR_CH4_IPC_GPU_ENGINE_TYPE=compute"
  "handle-cache-generic MPIR_CVAR_CH4_IPC_GPU_HANDLE_CACHE=generic"
  "handle-cache-off MPIR_CVAR_CH4_IPC_GPU_HANDLE_CACHE=disabled"
  "repeat-addr-off MPIR_CVAR_CH4_IPC_MAP_REPEAT_ADDR=0"
  "fast-copy-1M MPIR_CVAR_GPU_FAST_COPY_MAX_SIZE=1048576"
  "write-protocol MPIR_CVAR_CH4_IPC_GPU_READ_WRITE_PROTOCOL=write"
  "swap-buffer-default MPIR_CVAR_CH4_GPU_COLL_SWAP_BUFFER_SZ=1048576"
  "yaksa-reduction-off MPIR_CVAR_ENABLE_YAKSA_REDUCTION=0"
  "allreduce-mpir MPIR_CVAR_ALLREDUCE_POSIX_INTRA_ALGORITHM=mpir"
  "device-collectives-none MPIR_CVAR_DEVICE_COLLECTIVES=none"
  # The two that helped in the first run (issue 57: 1 MiB 0.424 -> 0.267 and 0.281 ms), together.
  "winners MPIR_CVAR_CH4_IPC_GPU_P2P_THRESHOLD=0 MPIR_CVAR_CH4_IPC_GPU_HANDLE_CACHE=generic"
)
for entry in "${CVARS[@]}"; do
  read -r -a words <<< "$entry"
  case " ${TRIALS:-${words[0]}} " in *" ${words[0]} "*) ;; *) continue ;; esac
  if [ $((budget - SECONDS)) -lt 20 ]; then log "SKIPPED ${words[0]}: past the ${budget} s budget"; continue; fi
  trial "${words[@]}"
done
log "done"
pack
