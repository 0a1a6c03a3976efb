#!/usr/bin/env bash
# Issue 68's campaigns: each test of a stranger's attack (tests/test_peer_watcher_strangers.py: another Unix user
# against a real 2-rank job with the secret set) and the verdicts' two stranger tests, RUNS times each, one pytest
# process per run, with BURNERS busy loops beside them (the load; 0 for an idle machine). Needs root (the stranger is
# a user made for the test) and the test environment (scripts/install-test-deps.sh) active.
# Usage, from the repository root: OUT=DIR bash benchmarks/peer_watcher_strangers.sh
#   RUNS     runs of each test (default 10)
#   BURNERS  busy loops while they run (default 4)
#   TESTS    pytest node ids, space-separated (default: every test of the two modules named above that a stranger runs)
# Prints one line per run (test, outcome, seconds) and a count per test; leaves each run's log in $OUT.
set -euo pipefail
: "${OUT:?set OUT to the folder for the results}"
runs=${RUNS:-10}
burners=${BURNERS:-4}
default_tests="tests/test_peer_watcher_strangers.py tests/test_peer_watcher_verdicts.py::test_no_key_a_stranger_can_name_or_write_decides_and_every_verdict_kind_is_settled tests/test_peer_watcher_verdicts.py::test_a_claim_deleted_between_two_claims_leaves_at_most_one_side_going_on"
tests=${TESTS:-$default_tests}
mkdir -p "$OUT"
burner_pids=()
stop_burners() {
  local pid
  for pid in "${burner_pids[@]}"; do
    if kill -0 "$pid" 2>/dev/null; then kill "$pid"; fi
  done
}
trap stop_burners EXIT
for _ in $(seq 1 "$burners"); do
  sh -c 'while :; do :; done' &
  burner_pids+=("$!")
done
: >"$OUT/runs.txt"
# shellcheck disable=SC2086  # the node ids are words
ids=$(python3 -m pytest -p no:cacheprovider -q --collect-only $tests | grep '::')
for id in $ids; do
  name=${id##*::}
  for run in $(seq 1 "$runs"); do
    t0=$SECONDS
    if python3 -m pytest -p no:cacheprovider -q -n 0 "$id" >"$OUT/$name-$run.log" 2>&1; then outcome=pass; else outcome=FAIL; fi
    echo "$name $outcome $((SECONDS - t0)) s" | tee -a "$OUT/runs.txt"
  done
done
echo "load average at the end: $(cut -d' ' -f1-3 /proc/loadavg) (burners: $burners)" | tee -a "$OUT/runs.txt"
awk '$2 == "pass" || $2 == "FAIL" { n[$1]++; if ($2 == "pass") p[$1]++ } END { for (t in n) printf "%s: %d of %d passed\n", t, p[t], n[t] }' \
  "$OUT/runs.txt" | sort | tee "$OUT/summary.txt"
