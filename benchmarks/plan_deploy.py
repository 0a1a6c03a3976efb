"""Benchmark: `channelsmith plan` against bare py-rattler-build renders, and a local deploy.

Prints two figures (not a timed test; run it by hand or in CI for the record):
1. wall time of `channelsmith plan` over the full matrix of every recipe, against the bare
   py-rattler-build calls that render the same recipes and variants (goal: ratio <= 1.5);
2. wall time of deploying site-env-derecho from a local channel into a fresh prefix (goal: < 3 s).

Usage: python benchmarks/plan_deploy.py [--repeat N]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from rattler_build import RenderConfig, Stage0Recipe

from channelsmith.build import build
from channelsmith.deploy import deploy
from channelsmith.plan import make_plan
from channelsmith.recipes import list_recipes, variant_config

ROOT = Path(__file__).resolve().parents[1]


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


if __name__ == "__main__":
    main()
