#!/usr/bin/env bash
# Issue 74 on one GPU: watcher.synchronize() (a step's end that raises on the verdict instead of when the aborted
# kernel ends) measured as the examples' and the suite's workers' step end, against the blocking synchronize.
#   test  the GPU test of the wait itself (tests/test_peer_watcher_gloo.py, -m gpu): gloo ranks, a stream kept busy,
#         a rank SIGKILLed; the raise must come while the stream is still busy.
#   cost  a healthy step's cost of the new wait against the blocking synchronize, alternated step by step
#         (benchmarks/step_wait.py, SWSTEPS steps each way at 2, 10 and 50 ms of GPU work).
#   ab    the suite's train-fresh and train-hsdp over NCCL's network with PyTorch's settings, this tree against the
#         tree in ARM (the switch), interleaved run by run, one run at a time (AB runs a row): exception and first
#         step after the death (benchmarks/peer_loss_net.py).
#   ex    the DDP and HSDP examples and the suite's train-hsdp with the flavor's settings, from ARM, EXPAR at once
#         (EX runs a row): the switched examples' failure rate over NCCL's network.
# ARM is a tree of the repository with the switch; on this machine, before the device call (.carry is ignored):
#   git worktree add /tmp/sw HEAD && git -C /tmp/sw revert --no-edit e25a8ed 57b05fd fd7ed57
#   rm -rf .carry/stepwait && mkdir -p .carry/stepwait && git -C /tmp/sw archive HEAD | tar -x -C .carry/stepwait
# then, on the device (carry [".carry"]; the parts that fit one call, ~600 s at most):
#   OUT=$OUT PARTS=test,cost,ab AB=10 bash benchmarks/step_wait_gpu.sh
#   OUT=$OUT PARTS=ex EX=6 bash benchmarks/step_wait_gpu.sh
# Settings: PARTS (test,cost,ab,ex), ARM (.carry/stepwait), SWSTEPS (200), AB (10), ABUDGET (start no A/B run after
# this many seconds of the A/B, 270), EX (6), EXPAR (6), EXBUDGET (60).
# Run on 2026-12-07 (docs/records/2026-12-07-step-wait-ab-one-h100.md): the switch was not merged.
# Writes $OUT/summary.txt (each part's lines) and $OUT/<part>/ (peer_loss_net's summary, results and logs).
set -uo pipefail
: "${OUT:?set OUT to the folder for the results}"
parts=,${PARTS:-test,cost,ab,ex},
arm=${ARM:-.carry/stepwait}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
mkdir -p "$OUT"
log() { echo "[$SECONDS s] $*" | tee -a "$OUT/summary.txt" >&2; }
case $parts in *,ab,*|*,ex,*)
  if [ ! -d "$arm/scripts/torch_dist_check" ]; then
    echo "step_wait_gpu: ARM=$arm is not a tree of this repository; make it as this script's header says" >&2
    exit 2
  fi ;;
esac
log "$(python3 -c 'import torch; print("torch", torch.__version__, "NCCL", torch.cuda.nccl.version(), torch.cuda.get_device_name(0))')"
if [[ $parts == *,test,* ]]; then
  PYTHONPATH=$PWD/scripts timeout 180 python3 -m pytest -q -p no:cacheprovider -n 0 -m gpu tests/test_peer_watcher_gloo.py \
    -k steps_wait_raises_on_the_verdict > "$OUT/test.log" 2>&1
  log "test rc=$?: $(tail -n 1 "$OUT/test.log")"
fi
if [[ $parts == *,cost,* ]]; then
  PYTHONPATH=$PWD/scripts timeout 240 python3 benchmarks/step_wait.py --steps "${SWSTEPS:-200}" > "$OUT/cost.log" 2>&1
  log "cost rc=$?:"; tee -a "$OUT/summary.txt" < "$OUT/cost.log" >&2
fi
if [[ $parts == *,ab,* ]]; then
  OUT=$OUT/ab timeout 420 python3 benchmarks/peer_loss_net.py --arm "stepwait=$arm" --runs "${AB:-10}" --parallel 1 \
    --budget-s "${ABUDGET:-270}" \
    --rows train-fresh-pytorch,train-fresh-pytorch@stepwait,train-hsdp-pytorch,train-hsdp-pytorch@stepwait > /dev/null
  log "ab rc=$?:"; tee -a "$OUT/summary.txt" < "$OUT/ab/summary.txt" >&2
fi
if [[ $parts == *,ex,* ]]; then
  OUT=$OUT/ex timeout 420 python3 benchmarks/peer_loss_net.py --arm "stepwait=$arm" --runs "${EX:-6}" \
    --parallel "${EXPAR:-6}" --budget-s "${EXBUDGET:-60}" \
    --rows ddp-pytorch@stepwait,hsdp-pytorch@stepwait,train-hsdp-flavor@stepwait > /dev/null
  log "ex rc=$?:"; tee -a "$OUT/summary.txt" < "$OUT/ex/summary.txt" >&2
fi
