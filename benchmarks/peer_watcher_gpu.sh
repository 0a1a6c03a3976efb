#!/usr/bin/env bash
# Issues 50 and 52 on GPUs (NCCL), on a machine of two or more GPUs: the watcher's protocol 3 and its verdict
# arbitration where NCCL groups are watched.
#   1. SIGKILL to the verdict and to PeerLostError, the watcher before issue 50 against the current one,
#      alternated in one call (torch_dist_check's `single` all_reduce case, watcher on, RUNS runs each, ROUNDS
#      rounds): OLD_WATCHER=DIR names a folder holding the earlier torch_peer_watcher package (e.g.
#      `git archive e67071f scripts/torch_peer_watcher | tar -x -C DIR --strip-components=1`); without it,
#      only the current watcher runs.
#   2. tests/test_peer_watcher_verdicts.py (both ranks' watcher threads stopped at once, the store in rank 0
#      and apart) and the real-job test of tests/test_peer_watcher_links.py (a stranger rewriting the store's
#      address, bytes injected, a link shut down, a SIGKILL) on NCCL, VERDICT_RUNS times.
# Usage, from the repository root: OUT=DIR bash benchmarks/peer_watcher_gpu.sh
#   RUNS (5), ROUNDS (2), VERDICT_RUNS (5), BUDGET_S (500): start nothing after this many seconds.
# Writes $OUT/peer_watcher_gpu.tar.gz (every JSON and log) and a line per step to stderr and $OUT/summary.txt.
set -uo pipefail
: "${OUT:?set OUT to the folder for the results}"
repo=$PWD; res=/tmp/peer-watcher-gpu; rm -rf "$res"; mkdir -p "$res"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
runs=${RUNS:-5}; rounds=${ROUNDS:-2}; verdict_runs=${VERDICT_RUNS:-5}; budget=${BUDGET_S:-500}
log() { echo "[$SECONDS s] $*" | tee -a "$OUT/summary.txt" >&2; }
pack() { tar -czf "$OUT/peer_watcher_gpu.tar.gz" -C "$res" .; }
log "$(python3 -c 'import torch; print("torch", torch.__version__, "GPUs", torch.cuda.device_count(), "NCCL", torch.cuda.nccl.version())')"
kinds=(new)
[ -n "${OLD_WATCHER:-}" ] && kinds=(old new)
for round in $(seq 1 "$rounds"); do
  for which in "${kinds[@]}"; do
    if [ "$SECONDS" -gt "$budget" ]; then log "SKIPPED $which round $round: past the ${budget} s budget"; continue; fi
    path=$repo/scripts
    [ "$which" = old ] && path=$OLD_WATCHER:$repo/scripts
    PYTHONPATH=$path timeout 240 python3 -m torch_dist_check --checks peerloss --backends nccl --peerloss-backend nccl \
      --peerloss-cases single --peerloss-ops allreduce --peerloss-watcher on --peerloss-signal kill \
      --peerloss-runs "$runs" --json "$res/kill-$which-$round.json" > "$res/kill-$which-$round.out" 2>&1
    log "kill $which round $round rc=$?: $(python3 - "$res/kill-$which-$round.json" <<'PY'
import json, sys
try:
    doc = json.load(open(sys.argv[1]))
except (OSError, ValueError) as exc:
    print("no JSON:", exc); sys.exit()
for check in doc.get("checks", []):
    if "/watcher" in check.get("name", ""):
        runs = check.get("details", {}).get("runs", [])
        print(check["name"], check.get("status"), "detected_s", [r.get("detected_s") for r in runs],
              "exception_s", [r.get("exception_s") for r in runs])
PY
)"
    pack
  done
done
export PYTHONPATH=$repo/scripts PEER_WATCHER_RANK_BACKEND=nccl
for run in $(seq 1 "$verdict_runs"); do
  if [ "$SECONDS" -gt "$budget" ]; then log "SKIPPED verdict run $run: past the ${budget} s budget"; continue; fi
  timeout 180 python3 -m pytest -q -p no:cacheprovider -n 0 tests/test_peer_watcher_verdicts.py \
    "tests/test_peer_watcher_links.py::test_a_stranger_who_rewrites_the_address_injects_or_cuts_costs_no_rank_and_a_sigkill_is_seen_at_once" \
    > "$res/verdicts-$run.out" 2>&1
  log "verdicts+links on NCCL run $run rc=$?: $(tail -n 1 "$res/verdicts-$run.out")"
  pack
done
