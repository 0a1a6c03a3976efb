"""Issue 69's cost: the genuine air-gap installs of two builds of channelsmith, alternated in one run.

Each build (a checkout's scripts/ folder) packs the multi-package environment of tests/multi_env.py with
its own channelsmith (so each bundle carries that build's unpack.sh), and then each route of the README
installs it into a fresh prefix, whole commands timed: ``deploy --bundle --sha256``, ``deploy --bundle
--allowed-signers``, and the step 3' scripts of that build's examples/ run with sh. py-rattler's shared
cache is warm and private (today's fast case). Prints the median per build and route and their ratio:

    python benchmarks/airgap_private_ab.py --base /tmp/base-checkout --repeat 7
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(HERE / "tests"))

from multi_env import build_multi_packages  # noqa: E402

from channelsmith import channel  # noqa: E402

PRINCIPAL = "builder@site.example"


def _run(build: Path, argv: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(build / "scripts"), **kw.pop("env", {})}  # type: ignore[dict-item]
    return subprocess.run(argv, capture_output=True, text=True, env=env, check=True, **kw)  # type: ignore[arg-type]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=Path, required=True, help="a checkout of the build to compare against")
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="channelsmith-ab-"))
    os.environ["RATTLER_CACHE_DIR"] = str(work / "rattler")
    try:
        source = work / "channel"
        channel.publish(source, build_multi_packages(work))
        key = work / "key"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
        signers = work / "signers"
        signers.write_text(f"{PRINCIPAL} {' '.join(Path(f'{key}.pub').read_text().split()[:2])}\n")
        builds = {"base": args.base.resolve(), "new": HERE}
        bundles = {}
        for name, build in builds.items():
            folder = work / name
            folder.mkdir()
            cli = [sys.executable, "-m", "channelsmith"]
            _run(build, [*cli, "deploy", "greet-py", "oldformat", "--channel-dir", str(source), "--prefix",
                         str(folder / "deployed")])  # fmt: skip
            _run(build, [*cli, "pack", "--lock", str(folder / "deployed" / "channelsmith.lock"), "-o",
                         str(folder / "env.tar"), "--anchor-dir", str(folder / "anchors"), "--sign", str(key)])  # fmt: skip
            bundles[name] = (folder, channel.sha256_of(folder / "env.tar"))
        times: dict[tuple[str, str], list[float]] = {}
        for run in range(args.repeat):
            for name, build in builds.items():
                folder, digest = bundles[name]
                anchors = folder / "anchors"
                cli = [sys.executable, "-m", "channelsmith", "deploy", "--bundle", "env.tar"]
                routes = {
                    "deploy --bundle --sha256": [*cli, "--sha256", digest],
                    "deploy --bundle --allowed-signers": [*cli, "--allowed-signers", str(signers), "--signature",
                                                          str(anchors / "env.tar.sig")],  # fmt: skip
                    "sha256 script": ["sh", str(build / "examples" / "airgap_check_sha256.sh")],
                    "signature script": ["sh", str(build / "examples" / "airgap_check_signature.sh")],
                }
                for route, argv in routes.items():
                    prefix = work / f"p-{name}-{run}"
                    argv = [*argv, "--prefix", str(prefix)] if argv[0] == sys.executable else argv
                    env = {"ANCHORS": str(anchors), "HEX": digest, "SIGNERS": str(signers), "PRINCIPAL": PRINCIPAL,
                           "PREFIX": str(prefix)}  # fmt: skip
                    started = time.perf_counter()
                    _run(build, argv, cwd=folder, env=env)
                    times.setdefault((route, name), []).append(time.perf_counter() - started)
                    shutil.rmtree(prefix)
        for route in ("deploy --bundle --sha256", "deploy --bundle --allowed-signers", "sha256 script", "signature script"):
            base, new = (statistics.median(times[(route, name)]) for name in ("base", "new"))
            print(f"{route:36s} base {base:.3f} s  new {new:.3f} s  ratio {new / base:.2f}  ({args.repeat} runs each)")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
