"""Benchmark: `channelsmith build` through Slurm against a direct build on the same machine.

Prints two figures (not a timed test; run it by hand against a running cluster, for the record):
1. the overhead of building `site-env` (three packages, about a second of engine work) through Slurm:
   wall time of `build site-env --scheduler slurm` against `build site-env`, both as whole commands,
   interleaved in the same run, median of --repeat runs each;
2. N independent variants of a toy recipe whose build script keeps one CPU busy for --seconds:
   through Slurm (one job each, --cpus-per-task 1, as many side by side as the node has CPUs)
   against a direct build (one after another).

Usage (on this machine's test cluster):
  eval "$(bash scripts/slurm-local.sh start)"
  PYTHONPATH=scripts python3 benchmarks/slurm_build.py [--repeat 3] [--variants 4] [--seconds 10]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# A recipe with one variant per value of `n`; each build keeps one CPU busy for BUSY_SECONDS.
BUSY_RECIPE = """\
package:
  name: busy-${{ n }}
  version: "1.0"
build:
  noarch: generic
  script:
    - end=$((SECONDS + ${{ busy_seconds }})); while [ "$SECONDS" -lt "$end" ]; do :; done
"""


def channelsmith(*args: str) -> float:
    """Wall time of one whole `channelsmith` command (it must succeed)."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "channelsmith", *args], capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"channelsmith {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}")
    return elapsed


def site_env_overhead(work: Path, repeat: int) -> dict[str, float]:
    direct, slurm = [], []
    for run in range(repeat + 1):  # the first pair warms caches and is not counted
        d = channelsmith("--root", str(ROOT), "build", "site-env", "--channel-dir", str(work / f"direct-{run}"))
        s = channelsmith("--root", str(ROOT), "build", "site-env", "--scheduler", "slurm", "--cpus-per-task", "1",
                         "--channel-dir", str(work / f"slurm-{run}"), "--build-dir", str(work / f"jobs-{run}"))  # fmt: skip
        if run:
            direct.append(d)
            slurm.append(s)
    direct_s, slurm_s = statistics.median(direct), statistics.median(slurm)
    return {"direct_s": direct_s, "slurm_s": slurm_s, "overhead_s": slurm_s - direct_s, "ratio": slurm_s / direct_s}


def independent_variants(work: Path, variants: int, seconds: int) -> dict[str, float]:
    repo = work / "busy-repo"
    (repo / "recipes" / "busy").mkdir(parents=True)
    (repo / "recipes" / "busy" / "recipe.yaml").write_text(BUSY_RECIPE)
    values = "".join(f"  - {n}\n" for n in range(1, variants + 1))
    (repo / "conda_build_config.yaml").write_text(f"n:\n{values}busy_seconds:\n  - {seconds}\n")
    direct = channelsmith("--root", str(repo), "build", "busy", "--channel-dir", str(work / "busy-direct"))
    slurm = channelsmith("--root", str(repo), "build", "busy", "--scheduler", "slurm", "--cpus-per-task", "1",
                         "--channel-dir", str(work / "busy-slurm"), "--build-dir", str(work / "busy-jobs"))  # fmt: skip
    return {"variants": variants, "busy_s_each": seconds, "one_after_another_s": direct, "slurm_s": slurm,
            "speedup": direct / slurm}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--variants", type=int, default=4)
    parser.add_argument("--seconds", type=int, default=10)
    args = parser.parse_args()
    if not os.environ.get("SLURM_CONF"):
        raise SystemExit('SLURM_CONF is not set: eval "$(bash scripts/slurm-local.sh start)" first')
    cpus = subprocess.run(["sinfo", "-h", "-o", "%c"], capture_output=True, text=True, check=True).stdout.split()
    with tempfile.TemporaryDirectory(prefix="channelsmith-bench-") as tmp:
        overhead = site_env_overhead(Path(tmp), args.repeat)
        fanout = independent_variants(Path(tmp), args.variants, args.seconds)
    print(textwrap.dedent(f"""\
        site-env (3 packages): direct {overhead['direct_s']:.2f} s, through Slurm {overhead['slurm_s']:.2f} s, \
ratio {overhead['ratio']:.2f}, {overhead['overhead_s']:.1f} s more (median of {args.repeat})
        {fanout['variants']} independent variants x {args.seconds} s of one CPU each, node with {cpus[0]} CPUs: \
one after another {fanout['one_after_another_s']:.1f} s, through Slurm {fanout['slurm_s']:.1f} s, \
speed-up {fanout['speedup']:.2f}"""))
    print(json.dumps({"site_env": overhead, "independent_variants": fanout}, indent=2))


if __name__ == "__main__":
    main()
