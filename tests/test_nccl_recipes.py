"""The nccl and nccl-ofi-plugin recipes: activation in a real shell, NVCC_GENCODE, variants, linkage check."""

from __future__ import annotations

import ctypes.util
import filecmp
import fnmatch
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from rattler import Version, VersionSpec
from rattler_build import Stage0Recipe, VariantConfig

REPO = Path(__file__).resolve().parents[1]
NCCL = REPO / "recipes" / "nccl"
OFI = REPO / "recipes" / "nccl-ofi-plugin"

# Plugin version -> (NCCL_NET, NCCL_NET_PLUGIN or None when the release has no libnccl-net-ofi.so).
PLUGIN_SETTINGS = {
    "1.6.0": ("AWS Libfabric", None),
    "1.12.1": ("AWS Libfabric", None),
    "1.13.0": ("Libfabric", None),
    "1.14.2": ("Libfabric", None),
    "1.15.0": ("Libfabric", "ofi"),
    "1.19.2": ("Libfabric", "ofi"),
}
UNSET = "<unset>"


def install_activation(prefix: Path, version: str) -> None:
    env = dict(os.environ, PREFIX=str(prefix), RECIPE_DIR=str(OFI), PKG_VERSION=version)
    subprocess.run(["bash", str(OFI / "install-activation.sh")], env=env, check=True)


def shell_session(shell: str, prefix: Path, prior: dict[str, str | None], steps: list[str]) -> list[dict[str, str]]:
    """Run activate/deactivate steps in a real ``shell`` (with ``set -u``, as a strict user would);
    after each step report NCCL_NET and NCCL_NET_PLUGIN (UNSET when unset)."""
    lines = ["set -u"]
    for name, value in prior.items():
        lines.append(f"unset {name}" if value is None else f"export {name}='{value}'")
    report = (
        'printf "%s|%s\\n" "${NCCL_NET-' + UNSET + '}" "${NCCL_NET_PLUGIN-' + UNSET + '}"'
    )
    scripts = {
        "activate": prefix / "etc/conda/activate.d/nccl-ofi-plugin.sh",
        "deactivate": prefix / "etc/conda/deactivate.d/nccl-ofi-plugin.sh",
    }
    for step in steps:
        lines += [f". '{scripts[step]}'", report]
    if steps[-1] == "deactivate":
        lines.append('env | grep "^NCCL_OFI_PLUGIN_" || true')
    env = {k: v for k, v in os.environ.items() if not k.startswith("NCCL_")}
    out = subprocess.run([shell, "-c", "\n".join(lines)], env=env, capture_output=True, text=True, check=True)
    rows = out.stdout.splitlines()
    states = [dict(zip(("NCCL_NET", "NCCL_NET_PLUGIN"), row.split("|"))) for row in rows[: len(steps)]]
    assert rows[len(steps):] == [], f"bookkeeping variables left behind: {rows[len(steps):]}"
    return states


def shells() -> list[str]:
    return [s for s in ("bash", "dash") if shutil.which(s)]


@pytest.mark.parametrize("version", sorted(PLUGIN_SETTINGS))
def test_activation_sets_the_network_name_of_each_plugin_version(tmp_path: Path, version: str) -> None:
    install_activation(tmp_path, version)
    net, plugin = PLUGIN_SETTINGS[version]
    [active] = shell_session("bash", tmp_path, {"NCCL_NET": None, "NCCL_NET_PLUGIN": None}, ["activate"])
    assert active == {"NCCL_NET": net, "NCCL_NET_PLUGIN": plugin or UNSET}


@pytest.mark.parametrize("shell", shells())
@pytest.mark.parametrize("prior", [None, "", "Socket"], ids=["unset", "empty", "set"])
@pytest.mark.parametrize("version", ["1.6.0", "1.19.2"])
def test_deactivation_restores_prior_values(tmp_path: Path, shell: str, prior: str | None, version: str) -> None:
    install_activation(tmp_path, version)
    before = {"NCCL_NET": prior, "NCCL_NET_PLUGIN": prior}
    states = shell_session(shell, tmp_path, before, ["activate", "activate", "deactivate"])
    net, plugin = PLUGIN_SETTINGS[version]
    expected_plugin = plugin if plugin else (UNSET if prior is None else prior)
    assert states[1] == {"NCCL_NET": net, "NCCL_NET_PLUGIN": expected_plugin}
    restored = UNSET if prior is None else prior
    assert states[2] == {"NCCL_NET": restored, "NCCL_NET_PLUGIN": restored}


@pytest.mark.parametrize("version", ["1.6.0", "1.13.0", "1.19.2"])
def test_recipe_activation_test_passes_on_installed_scripts(tmp_path: Path, version: str) -> None:
    install_activation(tmp_path, version)
    env = dict(os.environ, PREFIX=str(tmp_path), OFI_VERSION=version)
    out = subprocess.run(["bash", str(OFI / "tests" / "activation.sh")], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert f"aws-ofi-nccl {version} sets NCCL_NET" in out.stdout


def gencode(arch_list: str) -> subprocess.CompletedProcess[str]:
    script = f'source "{NCCL / "gencode.sh"}" && nccl_gencode "$1"'
    return subprocess.run(["bash", "-c", script, "gencode", arch_list], capture_output=True, text=True)


@pytest.mark.parametrize(
    ("arch_list", "expected"),
    [
        ("8.0", "-gencode=arch=compute_80,code=sm_80"),
        ("9.0", "-gencode=arch=compute_90,code=sm_90"),
        ("8.0;9.0", "-gencode=arch=compute_80,code=sm_80 -gencode=arch=compute_90,code=sm_90"),
        ("8.0 9.0a", "-gencode=arch=compute_80,code=sm_80 -gencode=arch=compute_90a,code=sm_90a"),
        ("9.0+PTX", "-gencode=arch=compute_90,code=sm_90 -gencode=arch=compute_90,code=compute_90"),
    ],
)
def test_nvcc_gencode_follows_the_site_arch_list(arch_list: str, expected: str) -> None:
    result = gencode(arch_list)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == expected


@pytest.mark.parametrize("arch_list", ["", ";", "sm_80", "80"])
def test_nvcc_gencode_refuses_an_empty_or_malformed_arch_list(arch_list: str) -> None:
    result = gencode(arch_list)
    assert result.returncode != 0 and "nccl_gencode" in result.stderr


def render(recipe: Path) -> list:
    config = VariantConfig.from_file(str(REPO / "conda_build_config.yaml"))
    config = config.merge(VariantConfig.from_file(str(recipe / "variants.yaml")))
    return Stage0Recipe.from_file(str(recipe / "recipe.yaml")).render(variant_config=config)


def shared_site_group() -> list[str]:
    shared = yaml.safe_load((REPO / "conda_build_config.yaml").read_text())
    [group] = [g for g in shared["zip_keys"] if "site" in g]
    return group


def test_nccl_renders_every_version_for_every_site_with_its_arch_list() -> None:
    shared = yaml.safe_load((REPO / "conda_build_config.yaml").read_text())
    arch_of = dict(zip(shared["site"], shared["cuda_arch_list"]))
    versions = yaml.safe_load((NCCL / "variants.yaml").read_text())["nccl_version"]
    rendered = render(NCCL)
    seen = set()
    for variant in rendered:
        data = variant.recipe.to_dict()
        site = variant.variant["site"]
        assert data["package"]["name"] == "nccl"
        assert data["build"]["string"].startswith(site.replace("-", "_") + "_cuda")
        # Every version carries the abort-wakeup series, and its build string says so.
        assert "_abortwake_h" in data["build"]["string"]
        version = variant.variant["nccl_version"]
        [source] = data["source"]
        series = f"../../patches/nccl/{version}/abort-wakeup/"
        expected = [series + "0001-proxy-wake-service-threads-on-stop-and-abort.patch"]
        shrink = version != "2.21.5-1"  # ncclCommShrink came with 2.27
        if shrink:
            expected.append(series + "0002-shrink-abort-past-the-parents-peer-error.patch")
        expected.append(series + "0003-kernels-after-one-saw-the-abort-skip-their-work.patch")
        if shrink:
            expected.append(series + "0004-shrink-abort-leaves-the-parent-revoked.patch")
        assert source["patches"] == expected
        assert data["build"]["script"]["env"]["NCCL_CUDA_ARCH_LIST"] == arch_of[site]
        [export] = data["requirements"]["run_exports"]["weak"]
        assert export["pin_subpackage"]["upper_bound"] == "x"
        seen.add((site, data["package"]["version"]))
    assert seen == {(s, v.replace("-", ".")) for s in shared["site"] for v in versions}


def test_ncclft_requires_an_nccl_built_with_the_abort_wakeup_series() -> None:
    """pytorch-nccl-fault's NCCL pins select this channel's patched nccl, never a stock build."""
    nccl_strings = {v.recipe.to_dict()["build"]["string"] for v in render(NCCL)}
    specs = set()
    for variant in render(REPO / "recipes" / "pytorch-nccl-fault"):
        requirements = variant.recipe.to_dict().get("requirements", {})
        for group in ("host", "run"):
            specs |= {str(s) for s in requirements.get(group, []) if str(s).startswith("nccl ")}
    assert specs == {"nccl >=2.13.4 *_abortwake_*"}
    pattern = specs.pop().split()[-1]
    assert all(fnmatch.fnmatchcase(s, pattern) for s in nccl_strings)
    # conda-forge's nccl build strings (h<hash>_<number>) do not match.
    assert not fnmatch.fnmatchcase("h4ee1b5a_0", pattern)


@pytest.mark.parametrize(
    ("built_against", "site_version"),
    [("2.21.5.1", "2.21.5.1"), ("2.27.3.1", "2.29.7.1"), ("2.29.7.1", "2.29.7.1"), ("2.29.7.1", "2.30.7.1")],
)
def test_site_nccl_version_satisfies_conda_forge_nccl_pins(built_against: str, site_version: str) -> None:
    # conda-forge's nccl run_exports: pin_subpackage(nccl, max_pin="x") -> >=V,<3.0a0
    assert VersionSpec(f">={built_against},<3.0a0").matches(Version(site_version))


def test_plugin_variants_restate_the_whole_shared_site_group() -> None:
    ours = yaml.safe_load((OFI / "variants.yaml").read_text())["zip_keys"]
    [group] = [g for g in ours if "site" in g]
    assert set(shared_site_group()) <= set(group), "variants.yaml must restate the shared site zip group"


def test_each_site_gets_one_plugin_matched_to_its_libfabric() -> None:
    outputs: dict[tuple[str, str], dict] = {}
    for variant in render(OFI):
        data = variant.recipe.to_dict()
        outputs[(variant.variant["site"], data["package"]["name"])] = data
    shared = yaml.safe_load((REPO / "conda_build_config.yaml").read_text())
    assert len(outputs) == 2 * len(shared["site"])
    for site, root in zip(shared["site"], shared["libfabric_root"]):
        plugin, meta = outputs[(site, "aws-ofi-nccl")], outputs[(site, "nccl-ofi-plugin")]
        host = [str(s) for s in plugin["requirements"]["host"]]
        linking = plugin["build"].get("dynamic_linking") or {}
        if root == "conda":
            assert "libfabric-devel >=1.14,<1.20" in host
            assert not linking
        else:
            assert not any(s.startswith("libfabric") for s in host)
            assert linking["rpath_allowlist"] == [f"{root}/**"]
            assert f"{root}/**" in linking["missing_dso_allowlist"]
        version = plugin["package"]["version"]
        assert ("libhwloc" in host) == (version != "1.6.0")
        nccl_pin = meta["requirements"]["run"][0]
        assert nccl_pin.startswith("nccl ==") and nccl_pin.endswith(f" {site.replace('-', '_')}_cuda*")
        assert meta["package"]["version"] == version
    assert outputs[("derecho", "aws-ofi-nccl")]["package"]["version"] == "1.6.0"
    assert outputs[("derecho", "nccl-ofi-plugin")]["requirements"]["run"][0] == "nccl ==2.21.5.1 derecho_cuda*"


def test_both_recipes_carry_the_same_linkage_check() -> None:
    assert filecmp.cmp(NCCL / "tests" / "linkage.sh", OFI / "tests" / "linkage.sh", shallow=False)


def _system_library(name: str) -> Path:
    found = ctypes.util.find_library(name)
    if not found:
        pytest.skip(f"lib{name} not found on this system")
    out = subprocess.run(["/sbin/ldconfig", "-p"], capture_output=True, text=True).stdout
    for line in out.splitlines():
        if line.strip().startswith(found) and "x86-64" in line:
            return Path(line.split("=>")[-1].strip()).resolve()
    pytest.skip(f"{found} not in the ldconfig cache")


def linkage(prefix: Path, lib: str, host_paths: str = "") -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PREFIX=str(prefix), LINKAGE_HOST_PATHS=host_paths)
    return subprocess.run(["bash", str(NCCL / "tests" / "linkage.sh"), lib], env=env, capture_output=True, text=True)


def test_linkage_check_accepts_glibc_and_refuses_libraries_outside_the_environment(tmp_path: Path) -> None:
    (tmp_path / "lib").mkdir()
    stdcxx = _system_library("stdc++")  # needs libgcc_s from outside a conda prefix
    shutil.copy(stdcxx, tmp_path / "lib" / "libstdc++.so.6")
    refused = linkage(tmp_path, "lib/libstdc++.so.6")
    assert refused.returncode == 1 and "libgcc_s.so.1 resolves outside the environment" in refused.stderr
    allowed = linkage(tmp_path, "lib/libstdc++.so.6", str(_system_library("gcc_s").parent))
    assert allowed.returncode == 0, allowed.stderr
    assert linkage(tmp_path, "lib/missing.so").returncode == 1


def test_linkage_check_leaves_a_host_librarys_own_dependencies_to_the_host(tmp_path: Path) -> None:
    if shutil.which("gcc") is None:
        pytest.skip("gcc is missing: it builds the probe library")
    host = tmp_path / "opt" / "vendor" / "lib64"  # stands for /opt/cray/libfabric/<v>/lib64
    host.mkdir(parents=True)
    shutil.copy(_system_library("stdc++"), host / "libstdc++.so.6")
    (host / "libstdc++.so").symlink_to("libstdc++.so.6")
    prefix = tmp_path / "env"
    (prefix / "lib").mkdir(parents=True)
    source = tmp_path / "probe.c"
    source.write_text("int probe(void) { return 0; }\n")
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(prefix / "lib" / "libprobe.so"), str(source),
                    f"-L{host}", "-Wl,--no-as-needed", "-lstdc++", f"-Wl,-rpath,{host}"], check=True)
    judged = linkage(prefix, "lib/libprobe.so", str(host.parent))
    assert judged.returncode == 0, judged.stderr
    assert f"libstdc++.so.6 -> {host}/libstdc++.so.6" in judged.stdout
    assert "libgcc_s.so.1" in judged.stdout and "(needed by a host library)" in judged.stdout
    refused = linkage(prefix, "lib/libprobe.so")
    assert refused.returncode == 1 and "libstdc++.so.6 resolves outside the environment" in refused.stderr


def test_nccl_loads_plugin_says_why_it_cannot_run_without_a_gpu(tmp_path: Path) -> None:
    # CI's path: no NVIDIA GPU, so the script must succeed and say it skipped (the GPU path is the
    # same file, run on a GPU node; docs/records/nccl-and-ofi-plugin-builds-cpu.md records that run).
    if subprocess.run("nvidia-smi -L", shell=True, capture_output=True).returncode == 0:
        pytest.skip("a GPU is visible here: this case covers machines without one")
    env = dict(os.environ, PREFIX=str(tmp_path))
    out = subprocess.run(["bash", str(OFI / "tests" / "nccl-loads-plugin.sh")], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("nccl-loads-plugin: skipped: no NVIDIA GPU visible")


# Stands in for python on a fake GPU node. It replays what NCCL and the suite said on one H100
# (aws-ofi-nccl 1.6.0, NCCL 2.28.9, FI_PROVIDER=tcp; 2026-11-25), trimmed to the lines the script
# reads, and hands the script's own small programs (python -) to the real interpreter.
FAKE_PYTHON = r"""
import json, os, sys

args = sys.argv[1:]
if args[:1] == ["-"]:
    os.execv(sys.executable, [sys.executable, *args])
if args[:1] == ["-c"]:
    sys.exit(0)  # torch and torch_dist_check.harness.placement import
env = os.environ
lib = env["PREFIX"] + "/lib"
libfabric = os.path.exists(os.path.join(env["LD_LIBRARY_PATH"].split(":")[0], "libfabric.so.1"))
head = "vm:1:1 [0] NCCL INFO NCCL version 2.28.9+cuda13.0\n"
plugin = f"vm:1:1 [0] NCCL INFO NET/Plugin: Loaded net plugin AWS Libfabric (v6)\nvm:1:1 [0] NCCL INFO Successfully loaded external network plugin {lib}/libnccl-net.so\n"
refused = "nccl_init: mapped /opt/nccl/lib/libnccl.so.2\nncclCommInitAll failed: invalid usage (run with NCCL_DEBUG=WARN for details)\n"
# NCCL 2.28.9 after the v6 plugin's failed init: a call through a null finalize, caught by
# libinfinipath's handler, which exits 1.
crash = (
    "[2026-11-25 06:02:58] vm:1:1 [0] find_ofi_provider:753 NCCL WARN NET/OFI Couldn't find any optimal provider\n"
    "[2026-11-25 06:02:58] vm:1:1 [0] nccl_net_ofi_init:1472 NCCL WARN NET/OFI aws-ofi-nccl initialization failed\n"
    "vm:1:1 [0] NCCL INFO Failed to initialize NET plugin AWS Libfabric\n\n"
    "python3:1 terminated with signal 11 at PC=0 SP=7ffd07613ec8.  Backtrace:\n"
    "/tmp/p/lib/libinfinipath.so.4(+0x431f)[0x7eff1c00931f]\n"
)
no_provider = env.get("FI_PROVIDER") == "no-such-provider"
misspelled = env.get("NCCL_NET_PLUGIN") == "0fi"
if args[0].endswith("nccl_init.py"):
    if no_provider:
        sys.stdout.write(head + plugin + crash)
        sys.exit(1)
    if misspelled and "NCCL_NET" in env:
        sys.stdout.write(head + "vm:1:1 [0] NCCL INFO NET/Plugin: Could not find: 0fi libnccl-net-0fi.so\n" + refused)
        sys.exit(1)
    if misspelled:
        sys.stdout.write(head + "vm:1:1 [0] NCCL INFO NET/Plugin: Could not find: 0fi libnccl-net-0fi.so\nvm:1:1 [0] NCCL INFO Using network Socket\nncclCommInitAll: ok\n")
        sys.exit(0)
    if not libfabric:
        sys.stdout.write(head + "vm:1:1 [0] NCCL INFO NET/Plugin: libnccl-net.so: libfabric.so.1: cannot open shared object file: No such file or directory\n" + refused)
        sys.exit(1)
    sys.stdout.write(head + plugin + "vm:1:1 [0] NCCL INFO Using network AWS Libfabric\nncclCommInitAll: ok\n")
    sys.exit(0)

# python -m torch_dist_check ... --json FILE
def check(name, status, reason):
    return {"name": name, "status": status, "reason": reason, "details": {}, "duration_s": 0.0, "ranks": [0, 1]}

placement = check("placement/nccl", "pass", "2 processes on 1 GPU(s), one NCCL_HOSTID each (NCCL connects them through its network)")
moved = check("correctness/nccl/cuda", "pass", "109 cases correct")
def fallback(why):
    return [check("env/nccl-network", "fail", f"rank 0: NCCL used network Socket, expected AWS Libfabric (--expect-nccl-net): {why}"), moved]

if no_provider and env["FAKE_CRASH_REPORT"] == "with-why":
    checks = [
        check("env/nccl-network", "fail", "rank 0: NCCL's log names no network ('Using network ...' missing): Failed to initialize "
              "NET plugin AWS Libfabric; NET/OFI Couldn't find any optimal provider (read from NCCL's logs after the ranks ended abnormally)"),
        check("harness/ranks", "fail", "a rank ended abnormally; rank 0: exit 1 in stage 'correctness/nccl/cuda' before its verdict; "
              "last words: python3:1 terminated with signal 11 at PC=0 SP=7ffd07613ec8.  Backtrace:"),
    ]
elif no_provider:
    checks = []  # the suite before it accounted for dead ranks: rank 0's report so far, nothing failing
elif misspelled:
    checks = fallback("NET/Plugin: Could not find: 0fi libnccl-net-0fi.so")
elif not libfabric:
    checks = fallback("NET/Plugin: libnccl-net.so: libfabric.so.1: cannot open shared object file: No such file or directory")
else:
    checks = [check("env/nccl-network", "pass", "NCCL used network AWS Libfabric, as --expect-nccl-net expects"), moved,
              check("bandwidth/nccl/cuda", "pass", "peak busbw GB/s: all_reduce 0.93")]
with open(args[args.index("--json") + 1], "w") as out:
    json.dump({"schema": 1, "checks": [placement, *checks]}, out)
sys.exit(1 if any(c["status"] == "fail" for c in checks) or no_provider else 0)
"""


@pytest.mark.parametrize("report", ["with-why", "without-why"])
def test_nccl_loads_plugin_takes_a_crash_of_the_planted_missing_provider_only_when_the_report_says_why(tmp_path: Path, report: str) -> None:
    # 1.6.0 on NCCL 2.28.9: with FI_PROVIDER=no-such-provider NCCL crashes in its init instead of
    # falling back to Socket, so no data can move; the script takes that only from a report that
    # says the ranks died and quotes NCCL's failure to initialize the plugin.
    prefix = tmp_path / "env"
    (prefix / "lib").mkdir(parents=True)
    for name in ("libnccl-net.so", "libfabric.so.1", "libnccl.so.2"):
        (prefix / "lib" / name).write_text("")
    install_activation(prefix, "1.6.0")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H100 80GB HBM3'\n")
    (tmp_path / "fake_python.py").write_text(FAKE_PYTHON)
    (bin_dir / "python").write_text(f"#!/bin/sh\nexec '{sys.executable}' '{tmp_path / 'fake_python.py'}' \"$@\"\n")
    for tool in ("nvidia-smi", "python"):
        (bin_dir / tool).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NCCL_", "FI_"))}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", PREFIX=str(prefix), PYTHON=str(bin_dir / "python"),
               OFI_TEST_LOGS=str(tmp_path / "logs"), FAKE_CRASH_REPORT=report)  # fmt: skip
    out = subprocess.run(["bash", str(OFI / "tests" / "nccl-loads-plugin.sh")], env=env, capture_output=True, text=True)
    assert ("NCCL said 'Failed to initialize NET plugin AWS Libfabric' and the process died inside ncclCommInitAll "
            "(exit 1; terminated with signal 11)") in out.stdout  # fmt: skip
    assert "caught with data moving (NCCL_NET_PLUGIN=0fi, NCCL_NET unset)" in out.stdout
    assert "caught with data moving (LD_LIBRARY_PATH=" in out.stdout
    if report == "with-why":
        assert out.returncode == 0, out.stdout + out.stderr
        assert ("caught, no data moved (FI_PROVIDER=no-such-provider, NCCL_NET unset): the ranks died in NCCL's init after it "
                "failed to initialize the plugin (CRASH): harness/ranks fail: a rank ended abnormally; rank 0: exit 1 in stage "
                "'correctness/nccl/cuda'") in out.stdout  # fmt: skip
    else:
        assert out.returncode == 1
        assert ("FAIL: planted FI_PROVIDER=no-such-provider with NCCL_NET unset: the suite did not fail env/nccl-network quoting "
                "'NET/OFI|Failed to initialize NET plugin' with data moving, nor report CRASH") in out.stderr  # fmt: skip
        assert "harness/ranks missing: no check harness/ranks" in out.stderr


def test_nccl_2_29_on_ships_the_device_bitcode_and_wrapper_the_release_installs() -> None:
    """NVIDIA's nvidia-nccl-cu13 2.30.7 wheel and conda-forge's nccl 2.29.7/2.30.4 ship
    lib/libnccl_device.bc and include/nccl_device_wrapper.h (bindings/ir, from 2.29); 2.21.5 has no
    bindings/ir. The build makes them with clang and LLVM's tools, and the package test requires them."""
    for variant in render(NCCL):
        data = variant.recipe.to_dict()
        version = variant.variant["nccl_version"]
        emits = version != "2.21.5-1"
        assert data["build"]["script"]["env"]["NCCL_EMIT_LLVM_IR"] == ("1" if emits else "0")
        build = " ".join(str(spec) for spec in data["requirements"]["build"])
        # clang 21 with CUDA 12, 22 with CUDA 13 (both in the matrix)
        major = "21" if variant.variant["cuda_compiler_version"].startswith("12.") else "22"
        assert (f"clang {major}.*" in build and f"llvm-tools {major}.*" in build) == emits
        (contents,) = [t["package_contents"] for t in data["tests"] if "package_contents" in t]
        shipped = {"include/nccl_device_wrapper.h", "lib/libnccl_device.bc"} <= set(contents["files"]["exists"])
        assert shipped == emits
    build_sh = (NCCL / "build.sh").read_text()
    assert 'make -C "${SRC_DIR}" ir.build EMIT_LLVM_IR=1' in build_sh
