"""site-env: the activation scripts of the built packages, sourced in real shells.

The packages come from ``site_env_channel`` (built by channelsmith.build); each is extracted, and
its etc/conda/activate.d and deactivate.d scripts are sourced the way conda sources them.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from rattler.package_streaming import extract

from conftest import SITES

DERECHO = {
    "MPICH_GPU_SUPPORT_ENABLED": "1",
    "MPICH_OFI_NIC_POLICY": "GPU",
    "FI_MR_CACHE_MONITOR": "userfaultfd",
    "FI_CXI_DISABLE_HOST_REGISTER": "1",
    "FI_CXI_DEFAULT_CQ_SIZE": "131072",
    "NCCL_CROSS_NIC": "1",
    "NCCL_SOCKET_IFNAME": "hsn",
}
DOCKER_NCCL_EXCLUDE = "^docker,lo,veth,br-"

# Every variable each profile touches (sets, or removes while active).
TOUCHED = {
    "derecho": [*DERECHO, "NCCL_NET_GDR_LEVEL", "SITE_ENV_PROFILE"],
    "docker-host": ["NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "SITE_ENV_PROFILE"],
    "generic": ["SITE_ENV_PROFILE"],
    "gpu-cluster": ["MPIR_CVAR_BCAST_POSIX_INTRA_ALGORITHM", "MPIR_CVAR_CH4_GPU_COLL_SWAP_BUFFER_SZ", "SITE_ENV_PROFILE"],
}

# The environment every shell starts from, so that before/after comparisons see only our changes.
BASE_ENV = {"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", "LC_ALL": "C"}

# The trailing builtin keeps zsh from exec'ing the last `env` in place of the shell (which lowers SHLVL).
SNAPSHOTS = """
env -0 > "$1/before"
. "$2"
env -0 > "$1/active"
. "$3"
env -0 > "$1/after"
true
"""


@pytest.fixture(scope="module")
def installed(site_env_packages: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Site -> the directory a site-env package was extracted into (its files as conda installs them)."""
    prefixes = {}
    for site in SITES:
        prefix = tmp_path_factory.mktemp(f"prefix-{site}")
        extract(site_env_packages[f"site-env-{site}"], prefix)
        prefixes[site] = prefix
    return prefixes


def scripts(prefix: Path, site: str) -> tuple[Path, Path]:
    name = f"site-env-{site}.sh"
    return prefix / "etc/conda/activate.d" / name, prefix / "etc/conda/deactivate.d" / name


def read_env(path: Path) -> dict[str, str]:
    entries = [e for e in path.read_bytes().decode().split("\0") if e]
    return dict(e.split("=", 1) for e in entries)


def activate_and_deactivate(
    prefix: Path, site: str, tmp_path: Path, env: dict[str, str] | None = None, shell: str = "bash",
    snapshots: str = SNAPSHOTS,
) -> tuple[dict[str, str], dict[str, str], dict[str, str], str]:
    """Source activate then deactivate in ``shell``; the environment before, while active, after; stderr."""
    activate, deactivate = scripts(prefix, site)
    proc = subprocess.run(
        [shell, "-c", snapshots, "site-env-test", str(tmp_path), str(activate), str(deactivate)],
        env={**BASE_ENV, **(env or {})},
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return (read_env(tmp_path / "before"), read_env(tmp_path / "active"), read_env(tmp_path / "after"), proc.stderr)


def fake_net(tmp_path: Path, interfaces: dict[str, str]) -> Path:
    """A stand-in for /sys/class/net: interface name -> operstate."""
    net = tmp_path / "net"
    for name, state in interfaces.items():
        (net / name).mkdir(parents=True)
        (net / name / "operstate").write_text(state + "\n")
    return net


def test_every_site_of_the_matrix_has_a_profile_and_every_profile_a_site(repo_root):
    profiles = {p.stem for p in (repo_root / "recipes/site-env/sites").glob("*.sh")}
    assert profiles == set(SITES)
    assert {"derecho", "docker-host", "generic"} <= set(SITES)
    assert set(TOUCHED) == set(SITES), "add the variables a new profile touches to TOUCHED"


def test_derecho_activation_exports_the_slingshot_settings(installed, tmp_path):
    before, active, after, _ = activate_and_deactivate(installed["derecho"], "derecho", tmp_path)
    assert {k: active.get(k) for k in DERECHO} == DERECHO
    assert active["SITE_ENV_PROFILE"] == "derecho"
    assert "NCCL_NET_GDR_LEVEL" not in active
    assert after == before


def test_derecho_removes_a_leftover_gdr_level_while_active_and_restores_it(installed, tmp_path):
    before, active, after, _ = activate_and_deactivate(
        installed["derecho"], "derecho", tmp_path, env={"NCCL_NET_GDR_LEVEL": "PHB"}
    )
    assert "NCCL_NET_GDR_LEVEL" not in active
    assert after["NCCL_NET_GDR_LEVEL"] == "PHB"
    assert after == before


def test_generic_sets_only_the_profile_name(installed, tmp_path):
    before, active, after, _ = activate_and_deactivate(installed["generic"], "generic", tmp_path)
    added = {k: v for k, v in active.items() if before.get(k) != v}
    assert added == {"SITE_ENV_PROFILE": "generic", "SITE_ENV_VARS_0": "SITE_ENV_PROFILE"}
    assert after == before


def test_gpu_cluster_sends_mpich_device_broadcasts_through_gpu_ipc(installed, tmp_path):
    # MPICH's default intra-node MPI_Bcast of CUDA buffers copies 8 KiB at a time through host
    # memory (0.5 GB/s on one H100); its MPIR algorithms move them by GPU IPC (docs/records/2026-11-25-cudampi-one-h100.md).
    # Below 1 MiB its ch4 collectives stage device buffers through a host swap buffer unless it is 0
    # (1 MiB broadcast between two H100s: 0.40-0.45 ms, against 0.09 ms with 0).
    before, active, after, _ = activate_and_deactivate(
        installed["gpu-cluster"], "gpu-cluster", tmp_path, env={"MPIR_CVAR_BCAST_POSIX_INTRA_ALGORITHM": "auto"}
    )
    added = {k: v for k, v in active.items() if before.get(k) != v}
    assert added == {
        "MPIR_CVAR_BCAST_POSIX_INTRA_ALGORITHM": "mpir",
        "MPIR_CVAR_CH4_GPU_COLL_SWAP_BUFFER_SZ": "0",
        "SITE_ENV_PROFILE": "gpu-cluster",
        "SITE_ENV_VARS_0": "SITE_ENV_PROFILE MPIR_CVAR_BCAST_POSIX_INTRA_ALGORITHM MPIR_CVAR_CH4_GPU_COLL_SWAP_BUFFER_SZ",
        "SITE_ENV_BACKUP_0_MPIR_CVAR_BCAST_POSIX_INTRA_ALGORITHM": "auto",
    }
    assert after == before


@pytest.mark.parametrize("site", SITES)
@pytest.mark.parametrize("prior", ["set", "empty", "unset"])
def test_deactivation_restores_every_prior_state(installed, tmp_path, site, prior):
    env = {"SITE_ENV_NET_DIR": str(fake_net(tmp_path, {"eth7": "up"}))}
    if prior != "unset":
        env.update({name: ("value before activation" if prior == "set" else "") for name in TOUCHED[site]})
    before, active, after, _ = activate_and_deactivate(installed[site], site, tmp_path, env=env)
    assert active["SITE_ENV_PROFILE"] == site
    assert after == before
    for name in TOUCHED[site]:
        if prior == "unset":
            assert name not in after
        else:
            assert after[name] == env[name]


def test_docker_host_keeps_nccl_and_gloo_off_docker_bridges_and_loopback(installed, tmp_path):
    net = fake_net(
        tmp_path,
        {"br-3f2a": "up", "docker0": "up", "eno1": "up", "eth0": "up", "lo": "unknown", "veth12ab": "up"},
    )
    before, active, after, _ = activate_and_deactivate(
        installed["docker-host"], "docker-host", tmp_path, env={"SITE_ENV_NET_DIR": str(net)}
    )
    assert active["NCCL_SOCKET_IFNAME"] == DOCKER_NCCL_EXCLUDE
    assert active["GLOO_SOCKET_IFNAME"] == "eno1"
    assert after == before


def test_docker_host_gloo_skips_interfaces_that_are_down(installed, tmp_path):
    net = fake_net(tmp_path, {"eno1": "down", "eth0": "up", "lo": "unknown"})
    _, active, _, _ = activate_and_deactivate(
        installed["docker-host"], "docker-host", tmp_path, env={"SITE_ENV_NET_DIR": str(net)}
    )
    assert active["GLOO_SOCKET_IFNAME"] == "eth0"


def test_docker_host_without_a_usable_interface_leaves_gloo_alone_and_says_so(installed, tmp_path):
    net = fake_net(tmp_path, {"docker0": "up", "lo": "unknown"})
    before, active, after, stderr = activate_and_deactivate(
        installed["docker-host"], "docker-host", tmp_path,
        env={"SITE_ENV_NET_DIR": str(net), "GLOO_SOCKET_IFNAME": "ib0"},
    )
    assert active["GLOO_SOCKET_IFNAME"] == "ib0"
    assert active["NCCL_SOCKET_IFNAME"] == DOCKER_NCCL_EXCLUDE
    assert "GLOO_SOCKET_IFNAME left as it was" in stderr
    assert after == before


def test_docker_host_on_this_machine_picks_a_real_interface(installed, tmp_path):
    usable = [
        p.name for p in sorted(Path("/sys/class/net").iterdir())
        if not p.name.startswith(("lo", "docker", "veth", "br-"))
        and (p / "operstate").read_text().strip() != "down"
    ] if Path("/sys/class/net").is_dir() else []
    if not usable:
        pytest.skip("this machine has no network interface besides loopback and docker bridges")
    _, active, _, _ = activate_and_deactivate(installed["docker-host"], "docker-host", tmp_path)
    assert active["GLOO_SOCKET_IFNAME"] == usable[0]


def test_activating_twice_then_deactivating_restores_the_first_state(installed, tmp_path):
    twice = """
env -0 > "$1/before"
. "$2"
. "$2"
env -0 > "$1/active"
. "$3"
env -0 > "$1/after"
"""
    before, active, after, _ = activate_and_deactivate(
        installed["derecho"], "derecho", tmp_path, env={"NCCL_SOCKET_IFNAME": "ib"}, snapshots=twice
    )
    assert active["NCCL_SOCKET_IFNAME"] == "hsn"
    assert after == before


def test_sourcing_leaves_the_users_shell_options_and_functions_alone(installed, tmp_path):
    """A user's `set -u` shell survives activation; no helper function or shell option is left behind."""
    activate, deactivate = scripts(installed["docker-host"], "docker-host")
    script = """
set -u
options="$(set +o)"; functions="$(declare -F)"
. "$1"
test "$(set +o)" = "$options" || { echo "shell options changed" >&2; exit 1; }
test "$(declare -F)" = "$functions" || { echo "functions left behind: $(declare -F)" >&2; exit 1; }
. "$2"
test "$(set +o)" = "$options" || { echo "shell options changed by deactivation" >&2; exit 1; }
"""
    proc = subprocess.run(["bash", "-c", script, "t", str(activate), str(deactivate)], env=BASE_ENV,
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("shell", ["dash", "zsh"])
def test_scripts_work_in_other_posix_shells(installed, tmp_path, shell):
    if shutil.which(shell) is None:
        pytest.skip(f"{shell} is not installed")
    before, active, after, _ = activate_and_deactivate(
        installed["derecho"], "derecho", tmp_path, env={"NCCL_SOCKET_IFNAME": ""}, shell=shell
    )
    assert {k: active.get(k) for k in DERECHO} == DERECHO
    assert after == before


def test_installed_scripts_pass_shellcheck(installed):
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck)")
    files = [str(p) for site in SITES for p in scripts(installed[site], site)]
    proc = subprocess.run(["shellcheck", "--shell=sh", *files], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout


# conda's order for `conda activate A; conda activate --stack B; conda deactivate; conda deactivate`
# (conda/activate.py, mamba's activation.cpp): CONDA_SHLVL is the level being activated while
# activate.d runs and the level being left while deactivate.d runs; after leaving a level, conda
# sources the activate.d scripts of the environment below again.
STACKED = """
env -0 > "$1/before"
CONDA_SHLVL=1; export CONDA_SHLVL; . "$2"
env -0 > "$1/A"
CONDA_SHLVL=2; . "$4"
env -0 > "$1/B"
. "$5"
CONDA_SHLVL=1
env -0 > "$1/B-left"
if [ "$6" = conda ]; then . "$2"; fi
env -0 > "$1/A-again"
. "$3"
unset CONDA_SHLVL
env -0 > "$1/after"
true
"""


def stacked(installed, tmp_path, env, site_a, site_b, activator="conda", shell="bash"):
    """Environment snapshots of site_a's profile at level 1 with site_b's stacked at level 2."""
    (a_on, a_off), (b_on, b_off) = scripts(installed[site_a], site_a), scripts(installed[site_b], site_b)
    proc = subprocess.run(
        [shell, "-c", STACKED, "stacked", str(tmp_path), str(a_on), str(a_off), str(b_on), str(b_off), activator],
        env={**BASE_ENV, **env}, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return {name: read_env(tmp_path / name) for name in ("before", "A", "B", "B-left", "A-again", "after")}


def profile_of(snapshot):
    return {k: v for k, v in snapshot.items() if not k.startswith("SITE_ENV_") or k == "SITE_ENV_PROFILE"}


@pytest.mark.parametrize("activator", ["conda", "no-reactivation"])
def test_leaving_a_stacked_level_gives_back_the_level_below_with_its_settings(installed, tmp_path, activator):
    """derecho at level 1, docker-host stacked at level 2: leaving level 2 restores derecho exactly.

    "no-reactivation" leaves out conda's second sourcing of level 1's activate.d: the records alone
    must bring level 1 back (a user whose own value of a level-1 variable changed keeps it too).
    """
    env = {"NCCL_SOCKET_IFNAME": "ib0", "SITE_ENV_NET_DIR": str(fake_net(tmp_path, {"eth7": "up"}))}
    snaps = stacked(installed, tmp_path, env, "derecho", "docker-host", activator)
    assert {k: snaps["A"].get(k) for k in DERECHO} == DERECHO
    assert snaps["B"]["NCCL_SOCKET_IFNAME"] == DOCKER_NCCL_EXCLUDE
    assert snaps["B"]["GLOO_SOCKET_IFNAME"] == "eth7"
    assert snaps["B"]["SITE_ENV_PROFILE"] == "docker-host"
    # Leaving level 2 gives back level 1 as it was, record included.
    assert snaps["B-left"] == snaps["A"]
    assert snaps["A-again"] == snaps["A"]
    assert snaps["after"] == snaps["before"]
    assert profile_of(snaps["after"])["NCCL_SOCKET_IFNAME"] == "ib0"


def test_the_same_profile_stacked_twice_comes_off_one_level_at_a_time(installed, tmp_path):
    snaps = stacked(installed, tmp_path, {"NCCL_SOCKET_IFNAME": ""}, "derecho", "derecho", "no-reactivation")
    assert snaps["B-left"] == snaps["A"]
    assert snaps["A"]["SITE_ENV_BACKUP_1_NCCL_SOCKET_IFNAME"] == ""
    assert snaps["B"]["SITE_ENV_BACKUP_2_NCCL_SOCKET_IFNAME"] == "hsn"
    assert snaps["after"] == snaps["before"]


def wrappers(prefix: Path, site: str, ext: str) -> tuple[Path, Path]:
    name = f"site-env-{site}.{ext}"
    return prefix / "etc/conda/activate.d" / name, prefix / "etc/conda/deactivate.d" / name


# The same snapshots in csh and fish: conda's csh and fish activators `source` these files with
# CONDA_PREFIX set to the environment (conda/activate.py, CshActivator and FishActivator).
CSH_SNAPSHOTS = """env -0 > "$argv[1]/before"
source "$argv[2]"
env -0 > "$argv[1]/active"
source "$argv[3]"
env -0 > "$argv[1]/after"
"""
FISH_SNAPSHOTS = """env -0 > "$argv[1]/before"
source "$argv[2]"
env -0 > "$argv[1]/active"
source "$argv[3]"
env -0 > "$argv[1]/after"
"""


def in_shell(shell: str, prefix: Path, site: str, tmp_path: Path, env: dict[str, str]):
    """before, active, after in tcsh or fish (their wrappers), and the same three in sh."""
    ext, body = ("csh", CSH_SNAPSHOTS) if shell == "tcsh" else ("fish", FISH_SNAPSHOTS)
    if shutil.which(shell) is None:
        pytest.skip(f"{shell} is not installed (apt-get install {shell}; scripts/install-test-deps.sh does)")
    script = tmp_path / f"snapshots.{ext}"
    script.write_text(body)
    on, off = wrappers(prefix, site, ext)
    out = tmp_path / shell
    out.mkdir()
    full = {**BASE_ENV, "CONDA_PREFIX": str(prefix), **env}
    proc = subprocess.run([shell, str(script), str(out), str(on), str(off)], env=full,
                          capture_output=True, text=True, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    ours = tuple(read_env(out / n) for n in ("before", "active", "after"))
    sh_out = tmp_path / "sh"
    sh_out.mkdir()
    posix = activate_and_deactivate(prefix, site, sh_out, env={"CONDA_PREFIX": str(prefix), **env}, shell="sh")
    return ours, posix[:3], proc.stderr


# Variables a shell sets for itself (fish exports SHLVL and friends; tcsh sets HOST, GROUP...).
def changed(before: dict[str, str], now: dict[str, str]) -> dict[str, str | None]:
    return {k: now.get(k) for k in set(before) | set(now) if before.get(k) != now.get(k)}


@pytest.mark.parametrize("shell", ["tcsh", "fish"])
@pytest.mark.parametrize("site", SITES)
def test_csh_and_fish_activation_make_the_posix_scripts_changes(installed, tmp_path, shell, site):
    env = {
        "SITE_ENV_NET_DIR": str(fake_net(tmp_path, {"eth7": "up"})),
        # Values that need quoting in both shells: blanks, quotes, a backslash, a dollar sign, csh's
        # history character.
        "NCCL_SOCKET_IFNAME": "it's \\ \"$HOME\" ib0 !x",
        "NCCL_NET_GDR_LEVEL": "",
    }
    (before, active, after), (sh_before, sh_active, sh_after), _ = in_shell(shell, installed[site], site, tmp_path, env)
    assert changed(before, active) == changed(sh_before, sh_active)
    assert active["SITE_ENV_PROFILE"] == site
    assert after == before


def test_csh_activation_restores_a_stacked_level_like_posix(installed, tmp_path):
    if shutil.which("tcsh") is None:
        pytest.skip("tcsh is not installed (apt-get install tcsh; scripts/install-test-deps.sh does)")
    (a_on, a_off), (b_on, b_off) = wrappers(installed["derecho"], "derecho", "csh"), wrappers(installed["generic"], "generic", "csh")
    body = """env -0 > "$argv[1]/before"
setenv CONDA_SHLVL 1; setenv CONDA_PREFIX "$argv[6]"; source "$argv[2]"
env -0 > "$argv[1]/A"
setenv CONDA_SHLVL 2; setenv CONDA_PREFIX "$argv[7]"; source "$argv[4]"
source "$argv[5]"
setenv CONDA_SHLVL 1; setenv CONDA_PREFIX "$argv[6]"
env -0 > "$argv[1]/B-left"
source "$argv[3]"
env -0 > "$argv[1]/after"
"""
    script = tmp_path / "stacked.csh"
    script.write_text(body)
    args = [str(p) for p in (tmp_path, a_on, a_off, b_on, b_off, installed["derecho"], installed["generic"])]
    proc = subprocess.run(["tcsh", str(script), *args], env=BASE_ENV, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    snaps = {n: read_env(tmp_path / n) for n in ("before", "A", "B-left", "after")}
    assert snaps["B-left"] == snaps["A"]
    assert {k: snaps["A"].get(k) for k in DERECHO} == DERECHO
    assert changed(snaps["before"], snaps["after"]).keys() == {"CONDA_SHLVL", "CONDA_PREFIX"}  # set by this test
