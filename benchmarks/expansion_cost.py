"""What the expansion check (channelsmith.expansion) adds to an install that extracts a package.

Builds one noarch package with py-rattler-build from the folders given (real files: shared objects,
Python sources), then alternates, --repeat times, the check (the archive's members decompressed and
counted, nothing written) with py-rattler's own extraction of the same archive into a fresh folder,
which is what a cold install does first. Prints the medians and their ratio:

    python benchmarks/expansion_cost.py --from /path/site-packages/numpy /path/site-packages/sympy --repeat 5
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import zipfile
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(HERE / "scripts"))
sys.path.insert(0, str(HERE / "tests"))

from multi_env import build_packages  # noqa: E402
from rattler.package_streaming import extract  # noqa: E402

from channelsmith.expansion import check_expansion  # noqa: E402

RECIPE = """
package: {name: expansion-bench, version: "1.0.0"}
build:
  number: 0
  noarch: generic
  script:
    - mkdir -p $PREFIX/share/bench
%s
about: {license: Apache-2.0, summary: channelsmith expansion benchmark}
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--from", dest="sources", type=Path, nargs="+", required=True, help="folders to package")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="channelsmith-expansion-"))
    try:
        copies = "\n".join(f"    - cp -r {source.resolve()} $PREFIX/share/bench/" for source in args.sources)
        started = time.perf_counter()
        (package,) = build_packages(RECIPE % copies, work)
        size = package.stat().st_size / 2**20
        print(f"built {package.name}: {size:.1f} MiB in {time.perf_counter() - started:.0f} s", file=sys.stderr)
        checks, extractions = [], []
        for _ in range(args.repeat):
            started = time.perf_counter()
            measured = check_expansion(package)
            checks.append(time.perf_counter() - started)
            into = work / "extracted"
            started = time.perf_counter()
            extract(package, into)
            extractions.append(time.perf_counter() - started)
            shutil.rmtree(into)
        check, extraction = statistics.median(checks), statistics.median(extractions)
        print(f"archive {package.stat().st_size / 2**20:.1f} MiB, files {measured.files / 2**20:.1f} MiB "
              f"(recorded {measured.recorded / 2**20:.1f} MiB), info/ {measured.info / 2**10:.0f} KiB")  # fmt: skip
        print(f"check   median {check:.3f} s  ({', '.join(f'{s:.3f}' for s in checks)})")
        print(f"extract median {extraction:.3f} s  ({', '.join(f'{s:.3f}' for s in extractions)})")
        print(f"check / extract: {check / extraction:.2f}")
        if shutil.which("zstd"):  # the bound unpack.sh counts the payload tar against, and that tar's length
            with zipfile.ZipFile(package) as archive:
                (member,) = [n for n in archive.namelist() if n.startswith("pkg-")]
                payload = subprocess.run(["zstd", "-dc"], input=archive.read(member), capture_output=True, check=True)
            print(f"payload tar {len(payload.stdout)} bytes, unpack.sh's bound {measured.tar_bound} bytes "
                  f"({measured.tar_bound / len(payload.stdout):.3f} times)")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
