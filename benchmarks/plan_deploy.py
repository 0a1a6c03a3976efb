"""Benchmark: `channelsmith plan` against bare py-rattler-build renders, a local deploy, and air-gap bundles.

Prints three figures (not a timed test; run it by hand or in CI for the record):
1. wall time of `channelsmith plan` over the full matrix of every recipe, against the bare
   py-rattler-build calls that render the same recipes and variants (goal: ratio <= 1.5);
2. wall time of deploying site-env-derecho from a local channel into a fresh prefix (goal: < 3 s);
3. for the multi-package environment of tests/multi_env.py (python, libgreet, noarch greet-py): a
   deploy from the local channel, `channelsmith pack` of its lock, `deploy --bundle` of that bundle
   and the bundle's unpack.sh, each into a fresh prefix, interleaved in one run; the ratios against the
   deploy (goal: deploy --bundle <= 1.2x the local deploy).

Usage: python benchmarks/plan_deploy.py [--repeat N]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from rattler_build import RenderConfig, Stage0Recipe

from channelsmith.build import build
from channelsmith.bundle import install_bundle, pack
from channelsmith.channel import publish
from channelsmith.deploy import deploy
from channelsmith.plan import make_plan
from channelsmith.recipes import list_recipes, variant_config

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from multi_env import build_multi_packages  # noqa: E402  (the tests' recipes, not an installed module)


def bare_render() -> int:
    """What the engine alone does for the plan: load, merge variants, render every recipe."""
    count = 0
    for recipe in list_recipes(ROOT):
        config = variant_config(ROOT, recipe)
        stage0 = Stage0Recipe.from_file(str(recipe.recipe_file))
        count += len(stage0.render(variant_config=config, render_config=RenderConfig()))
    return count


def timed(fn: Callable[[], object], repeat: int) -> float:
    """Median wall time of ``repeat`` calls, after one warm-up call."""
    fn()
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()

    plan_s = timed(lambda: make_plan(ROOT), args.repeat)
    bare_s = timed(bare_render, args.repeat)
    plan = make_plan(ROOT)
    print(f"plan: {plan.packages} packages, {plan.heavy_compiles} heavy compiles, "
          f"{len(plan.recipes)} recipes")
    print(f"channelsmith plan (median of {args.repeat}): {plan_s:.3f} s")
    print(f"bare py-rattler-build render (median of {args.repeat}): {bare_s:.3f} s")
    print(f"ratio: {plan_s / bare_s:.2f} (goal <= 1.5)")

    with tempfile.TemporaryDirectory() as tmp:
        channel = Path(tmp) / "channel"
        build(ROOT, ["site-env"], channel_dir=channel)
        samples = []
        for index in range(args.repeat):
            prefix = Path(tmp) / f"env{index}"
            start = time.perf_counter()
            deploy(["site-env-derecho"], prefix=prefix, channel_dir=channel)
            samples.append(time.perf_counter() - start)
        print(f"deploy site-env-derecho from the local channel (median of {args.repeat}): "
              f"{statistics.median(samples):.3f} s (goal < 3 s)")
        bundle_figures(Path(tmp), args.repeat)


def bundle_figures(tmp: Path, repeat: int) -> None:
    """Figure 3: deploy, pack, deploy --bundle and unpack.sh of the multi-package environment, interleaved."""
    channel = tmp / "multi-channel"
    publish(channel, [p for p in build_multi_packages(tmp / "multi") if "bigdata" not in p.name])
    times: dict[str, list[float]] = {"deploy": [], "pack": [], "deploy --bundle": [], "unpack.sh": []}
    # One warm-up round: py-rattler's package cache then holds the packages for every later round.
    for index in range(repeat + 1):
        round_dir = tmp / f"round{index}"
        start = time.perf_counter()
        deployed = deploy(["greet-py"], prefix=round_dir / "deployed", channel_dir=channel)
        after_deploy = time.perf_counter()
        packed = pack(deployed.lock_file, round_dir / "env.tar", cache_dir=round_dir / "cache")
        tar = packed.bundle
        after_pack = time.perf_counter()
        install_bundle(tar, prefix=round_dir / "unpacked")
        after_install = time.perf_counter()
        extracted = round_dir / "bundle"
        extracted.mkdir()
        subprocess.run(["tar", "-xf", str(tar), "-C", str(extracted)], check=True)
        # The documented route: unpack.sh checks the outside anchor on its own private copy of the bundle.
        subprocess.run(["sh", str(extracted / "unpack.sh"), "--bundle", str(tar), "--sha256", packed.sha256, str(round_dir / "sh")],
                       check=True, capture_output=True)  # fmt: skip
        after_sh = time.perf_counter()
        if index == 0:
            continue
        times["deploy"].append(after_deploy - start)
        times["pack"].append(after_pack - after_deploy)
        times["deploy --bundle"].append(after_install - after_pack)
        times["unpack.sh"].append(after_sh - after_install)
        shutil.rmtree(round_dir)
    medians = {name: statistics.median(samples) for name, samples in times.items()}
    print(f"multi-package environment ({len(deployed.packages)} packages), median of {repeat} interleaved rounds:")
    for name, seconds in medians.items():
        print(f"  {name:16s} {seconds:.3f} s  ({seconds / medians['deploy']:.2f}x the local deploy)")
    print(f"ratio deploy --bundle / local deploy: {medians['deploy --bundle'] / medians['deploy']:.2f} (goal <= 1.2)")


if __name__ == "__main__":
    main()
