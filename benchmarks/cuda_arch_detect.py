"""Issue 53 on a GPU node: what py-rattler detects, and whether `channelsmith deploy` refuses a build without code.

Prints VirtualPackage.detect()'s `__cuda_arch` and `__cuda` (no CONDA_OVERRIDE_* in effect), then deploys
from a channel made here: the real site-env packages of derecho (A100, declares __cuda_arch 8.0) and
gpu-cluster (H100, 9.0), this repository's cuda-arch 8.0 and 9.0 (recipes/cuda-arch) in a channel of
their own, and empty stand-ins of each site's nccl with the name, build string and run requirements the
real nccl recipe renders (as tests/test_gpu_target.py builds them). Three deploys:
  derecho-profile  `nccl site-env-derecho`: the GPU disagrees with the profile, exit 2 expected on an H100
  derecho-build    `nccl * derecho_cuda*` (no profile named): the solver finds no cuda-arch, exit 2 expected
  hopper-build     `nccl site-env-gpu-cluster`: installs, solved for the detected GPU (exit 0 expected)
Exit 0 when each deploy ends as expected for the detected __cuda_arch; a JSON summary on stdout.

The GPU machine has no package index: fetch the wheels where pip reaches one (about 55 MB; .whl/ is
ignored by git), carry that folder, and run from the repository root:
    for v in 3.10 3.11 3.12 3.13; do pip download --no-deps --only-binary=:all: --python-version $v \
        --platform manylinux2014_x86_64 -d .whl/cuda-arch-detect py-rattler==0.28.0 py-rattler-build==0.73.0 \
        pyyaml rich markdown-it-py mdurl pygments; done
    python3 benchmarks/cuda_arch_detect.py --wheelhouse .whl/cuda-arch-detect
Rehearsed without a GPU as `CONDA_OVERRIDE_CUDA=13.0 CONDA_OVERRIDE_CUDA_ARCH=9.0 python3 benchmarks/cuda_arch_detect.py
--wheelhouse .whl/cuda-arch-detect --keep-overrides` (system Python 3, wheels from the folder): ok, 4 s.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NCCL_RELEASE = "2.29.7-1"
CUDA = "12.9"
SITES = ("derecho", "gpu-cluster")


def ensure_wheels(wheelhouse: Path | None, target: Path) -> None:
    """Make py-rattler, py-rattler-build, rich and pyyaml importable, from the wheelhouse if missing."""
    try:
        import rattler  # noqa: F401
        import rattler_build  # noqa: F401
        import rich  # noqa: F401
        import yaml  # noqa: F401

        return
    except ImportError:
        if wheelhouse is None:
            sys.exit("py-rattler, py-rattler-build, rich or pyyaml is missing: pass --wheelhouse DIR")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--find-links", str(wheelhouse),
         "--target", str(target), "py-rattler==0.28.0", "py-rattler-build==0.73.0", "rich", "pyyaml"],
        check=True,
    )
    sys.path.insert(0, str(target))


def detected() -> dict[str, str | None]:
    """__cuda_arch and __cuda as py-rattler detects them, with and without the CONDA_OVERRIDE_* variables."""
    from rattler import VirtualPackage, VirtualPackageOverrides

    def pick(packages) -> dict[str, str | None]:
        generic = {p.name.normalized: str(p.version) for p in (v.into_generic() for v in packages)}
        return {"__cuda_arch": generic.get("__cuda_arch"), "__cuda": generic.get("__cuda")}

    return {"detect()": pick(VirtualPackage.detect()),
            "detect(from_env())": pick(VirtualPackage.detect(VirtualPackageOverrides.from_env()))}


def stand_in(name: str, version: str, string: str, run: list[str], noarch: bool) -> str:
    """An empty package recipe with this name, version, build string and run requirements."""
    number = string.rsplit("_", 1)[-1]
    noarch_line = "  noarch: generic\n" if noarch else ""
    return (
        f'package:\n  name: {name}\n  version: "{version}"\n'
        f'build:\n  number: {number}\n  string: "{string}"\n{noarch_line}'
        f"  script:\n    - mkdir -p $PREFIX/share/{name}\n    - echo {string} > $PREFIX/share/{name}/build.txt\n"
        f"requirements:\n  run: {json.dumps(run)}\n"
        f"about:\n  license: Apache-2.0\n  summary: channelsmith stand-in for {name} {string}\n"
    )


def make_channels(work: Path) -> tuple[Path, Path]:
    """(site channel, cuda-arch channel)."""
    from channelsmith import channel
    from channelsmith.build import build
    from channelsmith.recipes import render_recipe, select_recipes
    from rattler_build import Stage0Recipe, ToolConfiguration, VariantConfig

    site, cuda_arch = work / "site", work / "cuda-arch"
    for capability in ("8.0", "9.0"):
        build(REPO, ["cuda-arch"], cuda_arch, overrides={"cuda_arch_version": capability}, run_tests=False)
    (found,) = select_recipes(REPO, ["nccl"])
    outputs = render_recipe(REPO, found, {"nccl_version": NCCL_RELEASE, "cuda_compiler_version": CUDA}).outputs
    recipes = [stand_in("cuda-version", CUDA, "0", [], noarch=True)]
    for out in outputs:
        if out.name == "nccl" and out.variant["site"] in SITES:
            major = int(CUDA.split(".")[0])
            run = [f"cuda-version >={CUDA},<{major + 1}.0a0" if r.startswith("{'pin_compatible'") else r
                   for r in out.requirements["run"]]
            recipes.append(stand_in("nccl", out.version, out.build_string, run, noarch=False))
    empty = channel.ensure_channel(work / "empty")
    packages = []
    for text in recipes:
        for result in Stage0Recipe.from_yaml(text).run_build(
            variant_config=VariantConfig(), tool_config=ToolConfiguration(test_strategy="skip"),
            output_dir=str(work / "output"), channels=[channel.channel_url(empty)], no_include_recipe=True,
        ):
            packages.extend(result.packages)
    channel.publish(site, packages)
    for name in SITES:
        build(REPO, ["site-env"], site, overrides={"site": name}, run_tests=False)
    return site, cuda_arch


def deploy(site: Path, cuda_arch: Path, prefix: Path, specs: list[str], keep_overrides: bool) -> dict:
    """`channelsmith deploy SPECS --json` in a child process: its exit code, report and error lines."""
    env = {k: v for k, v in os.environ.items() if keep_overrides or not k.startswith("CONDA_OVERRIDE_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "scripts"), *sys.path])
    proc = subprocess.run(
        [sys.executable, "-m", "channelsmith", "deploy", *specs, "--prefix", str(prefix), "--channel-dir", str(site),
         "-c", str(cuda_arch), "--json"],
        env=env, capture_output=True, text=True, check=False,
    )
    report = json.loads(proc.stdout) if proc.returncode == 0 else None
    return {
        "specs": specs,
        "exit_code": proc.returncode,
        "gpu": report["gpu"] if report else None,
        "cuda_arch_installed": next((p["version"] for p in report["packages"] if p["name"] == "cuda-arch"), None)
        if report else None,
        "error": " ".join(proc.stderr.split())[:600] if proc.returncode else "",
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheelhouse", type=Path, help="folder of the wheels to install if they are missing")
    parser.add_argument(
        "--keep-overrides", action="store_true",
        help="let CONDA_OVERRIDE_CUDA/_CUDA_ARCH stand for a GPU (a rehearsal on a machine without one)",
    )
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="cuda-arch-detect-"))
    os.environ.setdefault("RATTLER_CACHE_DIR", str(work / "rattler-cache"))
    ensure_wheels(args.wheelhouse, work / "site-packages")
    sys.path.insert(0, str(REPO / "scripts"))
    seen = detected()
    arch = seen["detect(from_env())" if args.keep_overrides else "detect()"]["__cuda_arch"]
    site, cuda_arch = make_channels(work)
    runs = {
        "derecho-profile": deploy(site, cuda_arch, work / "env-a", ["nccl", "site-env-derecho"], args.keep_overrides),
        "derecho-build": deploy(site, cuda_arch, work / "env-b", ["nccl * derecho_cuda*"], args.keep_overrides),
        "hopper-build": deploy(site, cuda_arch, work / "env-c", ["nccl", "site-env-gpu-cluster"], args.keep_overrides),
    }
    # On Hopper (9.x) both Derecho deploys must be refused and gpu-cluster's must install for 9.0.
    expected = {"derecho-profile": 2, "derecho-build": 2, "hopper-build": 0} if arch and arch.startswith("9.") else None
    ok = expected is not None and all(runs[k]["exit_code"] == code for k, code in expected.items())
    print(json.dumps({"detected": seen, "deploys": runs, "expected_exit_codes": expected, "ok": ok}, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
