#!/usr/bin/env bash
# Ranks and workers forked from one torch import against each started on its own (issue 58), alternated in one
# session: each round runs the same suite once with TORCH_DIST_CHECK_FORK=0 and once with forking on, which of the two
# first alternating by round. Per run: wall seconds, CPU seconds of the whole machine (from /proc/stat) and the JSON.
# Usage, from the repository root: OUT=DIR bash benchmarks/forkserver_ab.sh
#   ROUNDS  rounds (default 3)
#   SUITE   the suite's arguments (default: two ranks on NCCL, env, correctness and bandwidth up to 256M; the fault
#           check takes minutes on a stock NCCL, whose device does not come back)
#   BUDGET_S start no run after this many seconds (default 420); RUN_LIMIT_S: a run's own limit (default 120)
# Prints one line per run and, at the end, the medians; leaves the JSONs and logs in $OUT.
set -uo pipefail
: "${OUT:?set OUT to the folder for the results}"
rounds=${ROUNDS:-3}
budget=${BUDGET_S:-420}
run_limit=${RUN_LIMIT_S:-120}
suite=${SUITE:---nproc 2 --backends nccl --checks env,correctness,bandwidth --max-bytes 256M}
export PYTHONPATH="$PWD/scripts${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
mkdir -p "$OUT"
cpu() { awk '/^cpu /{print $2+$3+$4+$7+$8}' /proc/stat; }
ticks=$(getconf CLK_TCK)
start=$SECONDS
one() {  # one run: $1 = 0 (each rank its own interpreter) or 1 (forked)
  local mode=$1 tag="fork$1-r$round" c0 t0 rc
  c0=$(cpu); t0=$(date +%s.%N)
  # shellcheck disable=SC2086  # the suite's arguments are words
  TORCH_DIST_CHECK_FORK=$mode timeout "$run_limit" python3 -m torch_dist_check $suite --json "$OUT/$tag.json" \
    >"$OUT/$tag.log" 2>&1
  rc=$?
  awk -v tag="$tag" -v rc="$rc" -v t0="$t0" -v t1="$(date +%s.%N)" -v c0="$c0" -v c1="$(cpu)" -v hz="$ticks" \
    'BEGIN { printf "%s rc=%s wall_s=%.2f cpu_s=%.2f\n", tag, rc, t1 - t0, (c1 - c0) / hz }' | tee -a "$OUT/runs.txt"
}
for round in $(seq 1 "$rounds"); do
  if [ $((SECONDS - start)) -gt "$budget" ]; then echo "budget reached before round $round" | tee -a "$OUT/runs.txt"; break; fi
  if [ $((round % 2)) -eq 1 ]; then one 0; one 1; else one 1; one 0; fi
done
python3 - "$OUT" <<'EOF'
import json, pathlib, re, statistics, sys
out = pathlib.Path(sys.argv[1])
rows = [dict(re.findall(r"(\S+?)=(\S+)", line), tag=line.split()[0]) for line in (out / "runs.txt").read_text().splitlines() if "=" in line]
for mode in ("0", "1"):
    mine = [r for r in rows if r["tag"].startswith(f"fork{mode}-")]
    if not mine:
        continue
    walls = [float(r["wall_s"]) for r in mine]
    cpus = [float(r["cpu_s"]) for r in mine]
    peaks = {}
    for r in mine:
        path = out / f"{r['tag']}.json"
        if path.exists():
            for check in json.loads(path.read_text())["checks"]:
                peak = (check.get("details") or {}).get("peak_busbw_GBps", {}).get("all_reduce")
                if peak:
                    peaks.setdefault(check["name"], []).append(peak)
    label = "forked" if mode == "1" else "own interpreter"
    print(f"{label}: {len(mine)} runs, rc {sorted(set(r['rc'] for r in mine))}, wall median {statistics.median(walls):.2f} s"
          f" ({min(walls):.2f}-{max(walls):.2f}), CPU median {statistics.median(cpus):.2f} s ({min(cpus):.2f}-{max(cpus):.2f})")
    for name, values in peaks.items():
        print(f"  {name} all_reduce peak busbw GB/s: median {statistics.median(values):.1f} of {len(values)}"
              f" ({min(values):.1f}-{max(values):.1f})")
EOF
