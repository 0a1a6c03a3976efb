#!/usr/bin/env bash
# Runs the watcher for real on CPU inside the test environment.
set -euo pipefail

# The .pth imports the auto-start hook only when the switch is on (and costs nothing otherwise).
TORCH_PEER_WATCHER=1 python -c 'import sys; assert "torch_peer_watcher.autostart" in sys.modules'
TORCH_PEER_WATCHER=0 python -c 'import sys; assert "torch_peer_watcher.autostart" not in sys.modules'

# A SIGKILLed gloo peer: the watcher sees it, aborts its group, and a fresh group works.
python -m torch_dist_check --checks peerloss --backends gloo --peerloss-backend gloo --peerloss-cases single \
  --peerloss-ops allreduce --peerloss-watcher on --json peerloss.json
python - <<'PY'
import json

check = {c["name"]: c for c in json.load(open("peerloss.json"))["checks"]}["peerloss/gloo/allreduce/watcher"]
assert check["status"] == "pass", check
run = check["details"]["runs"][0]
assert run["detected_s"] < 1.0, run
print("peer watcher: death seen after", run["detected_s"], "s")
PY
