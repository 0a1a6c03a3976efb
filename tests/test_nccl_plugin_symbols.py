"""recipes/nccl-ofi-plugin/tests/plugin_symbols.py against real shared libraries, no GPU.

Plugins are compiled here with gcc: each exports (or hides) an ``ncclNetPlugin_v<N>`` struct whose
first field is the network's name, as aws-ofi-nccl's do. The NCCL side is the real libnccl.so.2 of
the cached nvidia-nccl-cu12 wheel (2.21.5: v8 to v5) where `channelsmith patches compile-check` has
fetched it, and libraries compiled here that dlsym exactly the names NCCL 2.29.7 (v11 to v6) and
2.30.7 (v12 to v6) do, read in NVIDIA/nccl src/plugin/net/net_v<N>.cc at those tags.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "recipes" / "nccl-ofi-plugin" / "tests" / "plugin_symbols.py"
sys.path.insert(0, str(REPO / "scripts"))

from channelsmith.patches.compiling import unpack_wheel  # noqa: E402
from channelsmith.sources import cache_root  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc is not installed")

# The versions each NCCL release dlsyms, newest first (NVIDIA/nccl at the tag).
NCCL_2_29_7 = list(range(11, 5, -1))
NCCL_2_30_7 = list(range(12, 5, -1))


def _gcc(tmp_path: Path, name: str, source: str, *flags: str) -> Path:
    c_file = tmp_path / f"{name}.c"
    c_file.write_text(source)
    library = tmp_path / f"{name}.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(library), str(c_file), *flags], check=True,
                   capture_output=True, text=True)  # fmt: skip
    return library


def fake_nccl(tmp_path: Path, versions: list[int]) -> Path:
    """A library that dlsyms ncclNetPlugin_v<N> for ``versions`` in turn, as NCCL's plugin loader does."""
    lookups = "\n".join(f'    if ((s = dlsym(lib, "ncclNetPlugin_v{v}"))) return s;' for v in versions)
    source = f"#include <dlfcn.h>\nvoid* load_net_plugin(void* lib) {{\n    void* s;\n{lookups}\n    return 0;\n}}\n"
    return _gcc(tmp_path, f"libnccl-like-v{versions[0]}", source, "-ldl")


def plugin(tmp_path: Path, name: str, versions: list[int], net: str = "Libfabric", *, hidden: bool = False,
           needs: Path | None = None) -> Path:
    """A plugin exporting a struct ncclNetPlugin_v<N> (first field: the network name) per version."""
    visibility = '__attribute__((visibility("hidden"))) ' if hidden else ""
    structs = "\n".join(f'{visibility}struct net ncclNetPlugin_v{v} = {{"{net}", 0}};' for v in versions)
    source = f"struct net {{ const char* name; void* init; }};\n{structs}\n"
    flags = ["-Wl,--no-as-needed", f"-L{needs.parent}", f"-l:{needs.name}"] if needs else []
    return _gcc(tmp_path, name, source, *flags)


def run(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True,
                          check=False, env={"PATH": "/usr/bin:/bin"})  # fmt: skip


@pytest.fixture(scope="module")
def wheel_nccl() -> Path:
    wheels = sorted((cache_root() / "wheels").glob("nvidia_nccl_cu12-*.whl"))
    if not wheels:
        pytest.skip(f"no nvidia-nccl-cu12 wheel in {cache_root() / 'wheels'} (`channelsmith patches compile-check` fetches it)")
    return unpack_wheel(wheels[-1], "nvidia/nccl/lib/", cache_root()) / "libnccl.so.2"


def test_the_wheels_nccl_looks_for_the_versions_its_source_names(wheel_nccl, tmp_path):
    if "2.21.5" not in str(wheel_nccl):
        pytest.skip(f"the names NCCL looks up were read for 2.21.5 only, the cached wheel is {wheel_nccl}")
    proc = run("--nccl", wheel_nccl, plugin(tmp_path, "libnccl-net", [6]))
    # NCCL 2.21.5 src/net.cc dlsyms ncclNetPlugin_v8, then v7, v6 and v5.
    assert proc.stdout.splitlines()[0].endswith(
        "looks for ncclNetPlugin_v8, ncclNetPlugin_v7, ncclNetPlugin_v6, ncclNetPlugin_v5"
    )


def test_a_plugin_of_aws_ofi_nccl_1_6s_api_passes_with_the_wheels_nccl(wheel_nccl, tmp_path):
    lib = plugin(tmp_path, "libnccl-net", [6, 5, 4, 3], net="AWS Libfabric")
    proc = run("--nccl", wheel_nccl, "--expect-net", "aws libfabric", lib)
    assert proc.returncode == 0, proc.stderr
    assert "NCCL will use ncclNetPlugin_v6 (network 'AWS Libfabric')" in proc.stdout


def test_a_plugin_newer_than_the_wheels_nccl_is_refused_with_what_it_exports(wheel_nccl, tmp_path):
    lib = plugin(tmp_path, "libnccl-net", [12])
    proc = run("--nccl", wheel_nccl, lib)
    assert proc.returncode == 1
    assert "exports ncclNetPlugin_v12; this NCCL looks only for ncclNetPlugin_v8" in proc.stderr


@pytest.mark.parametrize(("nccl_versions", "plugin_versions", "used"), [
    (NCCL_2_29_7, [10, 9, 8, 7, 6], 10),   # a 1.19-style plugin with NCCL 2.29.7
    (NCCL_2_30_7, [12, 11, 10], 12),
    (NCCL_2_29_7, [12, 11, 10], 11),       # NCCL takes the newest API both know
])  # fmt: skip
def test_nccl_uses_the_newest_version_both_sides_know(tmp_path, nccl_versions, plugin_versions, used):
    nccl = fake_nccl(tmp_path, nccl_versions)
    lib = plugin(tmp_path, "libnccl-net-ofi", plugin_versions)
    proc = run("--nccl", nccl, "--expect-net", "Libfabric", lib)
    assert proc.returncode == 0, proc.stderr
    assert f"NCCL will use ncclNetPlugin_v{used} (network 'Libfabric')" in proc.stdout


def test_a_plugin_only_older_than_what_nccl_looks_for_fails(tmp_path):
    nccl = fake_nccl(tmp_path, NCCL_2_30_7)
    lib = plugin(tmp_path, "libnccl-net", [5, 4])
    proc = run("--nccl", nccl, lib)
    assert proc.returncode == 1
    assert "exports ncclNetPlugin_v5, ncclNetPlugin_v4; this NCCL looks only for ncclNetPlugin_v12" in proc.stderr


def test_a_hidden_symbol_is_not_exported(tmp_path):
    nccl = fake_nccl(tmp_path, NCCL_2_29_7)
    lib = plugin(tmp_path, "libnccl-net", [9], hidden=True)
    proc = run("--nccl", nccl, lib)
    assert proc.returncode == 1
    assert "exports no ncclNetPlugin_v<N> symbol" in proc.stderr


def test_a_plugin_whose_library_is_missing_fails_with_the_loaders_words(tmp_path):
    nccl = fake_nccl(tmp_path, NCCL_2_29_7)
    gone = _gcc(tmp_path, "libfabric-gone", "int fi_getinfo_stand_in(void) { return 0; }\n")
    lib = plugin(tmp_path, "libnccl-net", [9], needs=gone)
    gone.unlink()
    proc = run("--nccl", nccl, lib)
    assert proc.returncode == 1
    assert "does not load as NCCL loads it (RTLD_NOW)" in proc.stderr and "libfabric-gone.so" in proc.stderr


def test_the_wrong_network_name_fails(tmp_path):
    nccl = fake_nccl(tmp_path, NCCL_2_29_7)
    lib = plugin(tmp_path, "libnccl-net", [9], net="AWS Libfabric")
    proc = run("--nccl", nccl, "--expect-net", "Libfabric", lib)
    assert proc.returncode == 1
    assert "ncclNetPlugin_v9 names the network 'AWS Libfabric', expected 'Libfabric'" in proc.stderr


def test_every_plugin_is_checked_and_one_failure_fails_the_run(tmp_path):
    nccl = fake_nccl(tmp_path, NCCL_2_29_7)
    good = plugin(tmp_path, "libnccl-net-ofi", [9])
    bad = plugin(tmp_path, "libnccl-net", [4])
    proc = run("--nccl", nccl, good, bad)
    assert proc.returncode == 1
    assert "NCCL will use ncclNetPlugin_v9" in proc.stdout and str(bad) in proc.stderr


def test_a_library_that_is_not_nccl_is_said_so(tmp_path):
    not_nccl = _gcc(tmp_path, "libother", "int x(void) { return 0; }\n")
    proc = run("--nccl", not_nccl, plugin(tmp_path, "libnccl-net", [9]))
    assert proc.returncode == 1
    assert "names no ncclNetPlugin_v<N> symbol: not an NCCL library" in proc.stderr


def test_without_prefix_or_arguments_it_is_a_usage_error():
    proc = run()
    assert proc.returncode == 2
    assert "set PREFIX or name --nccl" in proc.stderr


def test_prefix_gives_the_environments_nccl_and_plugins(tmp_path):
    prefix = tmp_path / "prefix"
    (prefix / "lib").mkdir(parents=True)
    shutil.copy(fake_nccl(tmp_path, NCCL_2_29_7), prefix / "lib" / "libnccl.so.2")
    shutil.copy(plugin(tmp_path, "libnccl-net", [8]), prefix / "lib" / "libnccl-net.so")
    shutil.copy(plugin(tmp_path, "libnccl-net-ofi", [10]), prefix / "lib" / "libnccl-net-ofi.so")
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, check=False,
                          env={"PATH": "/usr/bin:/bin", "PREFIX": str(prefix)})  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "libnccl-net.so: NCCL will use ncclNetPlugin_v8" in proc.stdout
    assert "libnccl-net-ofi.so: NCCL will use ncclNetPlugin_v10" in proc.stdout


def test_the_recipe_runs_the_symbol_check_with_each_releases_network_name(repo_root):
    from channelsmith.recipes import load_stage0, render_variants, select_recipes, variant_config

    recipe = select_recipes(repo_root, ["nccl-ofi-plugin"])[0]
    seen = {}
    for rendered in render_variants(recipe, load_stage0(recipe), variant_config(repo_root, recipe)):
        data = rendered.recipe.to_dict()
        if data["package"]["name"] != "nccl-ofi-plugin":
            continue
        for test in data.get("tests", []):
            script = test.get("script")
            if isinstance(script, dict) and "tests/plugin_symbols.py" in script["content"]:
                assert test["files"]["recipe"] == ["tests/plugin_symbols.py"]
                seen[str(rendered.variant["aws_ofi_nccl_version"])] = script["env"]["OFI_NET"]
    # The names install-activation.sh gives NCCL_NET: "AWS Libfabric" up to 1.12, "Libfabric" since 1.13.
    assert seen == {"1.6.0": "AWS Libfabric", "1.19.2": "Libfabric"}
