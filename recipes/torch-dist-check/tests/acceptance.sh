#!/usr/bin/env bash
# Runs the acceptance suite on CPU inside the test environment and checks its JSON verdicts.
set -euo pipefail

# Two gloo ranks: every correctness case right, bandwidth figures for every size.
python -m torch_dist_check --nproc 2 --backends gloo --quick --checks env,correctness,bandwidth --json suite.json
python - <<'PY'
import json

doc = json.load(open("suite.json"))
checks = {c["name"]: c for c in doc["checks"]}
assert doc["summary"]["ok"], doc["summary"]
assert checks["correctness/gloo/cpu"]["status"] == "pass"
rows = checks["bandwidth/gloo/cpu"]["details"]["rows"]
assert rows and all(r["busbw_GBps"] > 0 for r in rows)
print("suite: ok,", len(rows), "bandwidth rows")
PY

# The fault harness on CPU: a survivor that catches the dead peer's error passes ...
python -m torch_dist_check --checks fault --backends gloo --fault-backend gloo --fault-ops allreduce --json fault.json

# ... and a planted abort after the exception must be reported as a failure (exit code 1).
status=0
python -m torch_dist_check --checks fault --backends gloo --fault-backend gloo --fault-ops allreduce \
  --fault-plant abort --json planted.json || status=$?
if [ "${status}" -ne 1 ]; then
  echo "planted abort: expected exit code 1, got ${status}" >&2
  exit 1
fi
grep -q SIGABRT planted.json
echo "fault harness: pass for a survivor, fail for a planted abort"
