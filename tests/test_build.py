"""`channelsmith build`: real py-rattler-build builds (offline), published all or nothing.

Broken inputs live in small throw-away repositories (a conda_build_config.yaml and recipes/) under
tmp_path, so a failing build never touches the real recipes.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import tarfile
import tempfile
import textwrap
import time
from pathlib import Path

import pytest
from channelsmith.cli import main
from conftest import SITES
from servers import file_server
from test_interrupts import interrupt_after

TWO_SITES = "site:\n  - a\n  - b\n"


def make_repo(tmp_path: Path, recipes: dict[str, str], config: str = TWO_SITES) -> Path:
    """A repository root holding ``config`` as conda_build_config.yaml and one recipe.yaml per entry."""
    root = tmp_path / "repo"
    (root / "recipes").mkdir(parents=True)
    (root / "conda_build_config.yaml").write_text(config)
    for name, text in recipes.items():
        (root / "recipes" / name).mkdir()
        (root / "recipes" / name / "recipe.yaml").write_text(textwrap.dedent(text))
    return root


def snapshot(directory: Path) -> dict[str, bytes]:
    """Every file below ``directory`` with its bytes: equal snapshots mean an untouched channel."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def leftover_work_dirs(tmp: Path) -> list[Path]:
    return sorted(tmp.glob("channelsmith-build-*"))


def interrupt_build(root: Path, recipe: str, channel: Path, started: Path, env: dict[str, str]) -> tuple[int, str, float]:
    """``channelsmith build RECIPE`` into ``channel``, SIGINT to it alone once its build script made ``started``:
    its exit status, its stderr, and the seconds from the signal to its end."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "channelsmith", "--root", str(root), "build", recipe, "--channel-dir", str(channel)],
        env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    return interrupt_after(proc, started.exists, 60, "the build script never started")


@pytest.fixture
def private_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A temporary-files folder of this test's own, to see that build removes its work directories."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    return tmp


def test_site_env_builds_one_package_per_site_into_an_indexed_channel(site_env_build, site_env_channel):
    assert site_env_build.ok
    assert sorted(r.variant["site"] for r in site_env_build.results) == sorted(SITES)
    repodata = json.loads((site_env_channel / "noarch" / "repodata.json").read_text())
    listed = {record["name"]: (file, record) for file, record in repodata["packages.conda"].items()}
    for site in SITES:
        file, record = listed[f"site-env-{site}"]
        assert (site_env_channel / "noarch" / file).is_file()
        assert record["version"] == "1.0.0"
        assert record["noarch"] == "generic"
    assert sorted(p.name for p in site_env_build.published) == sorted(f for f, _ in listed.values())


def test_build_json_reports_each_variant_and_what_was_published(repo_root, tmp_path, capsys, private_tmp):
    channel = tmp_path / "channel"
    code = main(["--root", str(repo_root), "build", "site-env", "--variant", "site=generic",
                 "--channel-dir", str(channel), "--json"])
    assert code == 0
    document = json.loads(capsys.readouterr().out)
    assert document["ok"] is True
    [entry] = document["builds"]
    # The site's GPU keys are zipped with it (issue 53): generic declares none.
    assert entry["variant"] == {"site": "generic", "site_cuda_arch": "", "site_cuda_driver": ""}
    assert entry["result"] == "ok"
    [package] = entry["packages"]
    assert package["name"] == "site-env-generic"
    assert document["published"] == [str(channel.resolve() / "noarch" / package["file"])]
    assert Path(document["published"][0]).is_file()
    assert leftover_work_dirs(private_tmp) == []


def test_build_prints_a_summary_table(repo_root, tmp_path, capsys):
    code = main(["--root", str(repo_root), "build", "site-env", "--variant", "site=derecho",
                 "--channel-dir", str(tmp_path / "channel")])
    assert code == 0
    shown = capsys.readouterr().out
    for column in ("recipe", "package", "build string", "variant", "seconds", "result"):
        assert column in shown
    assert "site-env-derecho" in shown
    assert "site=derecho" in shown


def test_a_recipe_can_use_packages_from_the_local_channel(tmp_path, site_env_channel_copy):
    root = make_repo(tmp_path, {"uses-site": """\
        package:
          name: uses-site
          version: "1.0"
        build:
          noarch: generic
          script:
            - true
        requirements:
          run:
            - site-env-derecho
        tests:
          - script:
              - test -f "$PREFIX/etc/conda/activate.d/site-env-derecho.sh"
              - test "$MPICH_GPU_SUPPORT_ENABLED" = 1
        """}, config="{}\n")
    code = main(["--root", str(root), "build", "uses-site", "--channel-dir", str(site_env_channel_copy)])
    assert code == 0
    assert list((site_env_channel_copy / "noarch").glob("uses-site-1.0-*.conda"))


def test_unknown_recipe_is_refused_and_the_channel_untouched(repo_root, site_env_channel_copy, capsys):
    before = snapshot(site_env_channel_copy)
    code = main(["--root", str(repo_root), "build", "no-such-recipe", "--channel-dir", str(site_env_channel_copy)])
    assert code == 2
    err = capsys.readouterr().err
    assert "unknown recipe 'no-such-recipe'" in err
    assert "site-env" in err  # the hint lists the known recipes
    assert snapshot(site_env_channel_copy) == before


def test_unknown_variant_key_is_refused_and_the_channel_untouched(repo_root, site_env_channel_copy, capsys):
    before = snapshot(site_env_channel_copy)
    code = main(["--root", str(repo_root), "build", "site-env", "--variant", "sight=derecho",
                 "--channel-dir", str(site_env_channel_copy)])
    assert code == 2
    assert "unknown variant key 'sight'" in capsys.readouterr().err
    assert snapshot(site_env_channel_copy) == before


def test_missing_patch_names_recipe_and_patch_before_building(tmp_path, site_env_channel_copy, capsys, private_tmp):
    root = make_repo(tmp_path, {"patched": """\
        package:
          name: patched-${{ site }}
          version: "1.0"
        source:
          path: src
          patches:
            - ../../patches/patched/1.0/fix/0001-missing.patch
        build:
          noarch: generic
          script:
            - true
        """})
    (root / "recipes/patched/src").mkdir()
    (root / "recipes/patched/src/file.txt").write_text("upstream\n")
    before = snapshot(site_env_channel_copy)
    code = main(["--root", str(root), "build", "patched", "--channel-dir", str(site_env_channel_copy)])
    assert code == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "recipe patched lists patch" in err
    assert "patches/patched/1.0/fix/0001-missing.patch" in err
    assert "does not exist" in err
    assert snapshot(site_env_channel_copy) == before
    assert leftover_work_dirs(private_tmp) == []  # refused before any engine call


HALF_BROKEN = """\
    package:
      name: half-broken-${{ site }}
      version: "1.0"
    build:
      noarch: generic
      script:
        - if: site == "b"
          then:
            - echo "about to fail on purpose"
            - exit 3
          else:
            - true
    """


def test_a_failed_build_leaves_the_channel_byte_identical(tmp_path, site_env_channel_copy, capsys, private_tmp):
    """site=a builds fine, site=b fails: nothing at all is published, and the work dirs are gone."""
    root = make_repo(tmp_path, {"half-broken": HALF_BROKEN})
    before = snapshot(site_env_channel_copy)
    code = main(["--root", str(root), "build", "half-broken", "--channel-dir", str(site_env_channel_copy)])
    assert code == 2
    captured = capsys.readouterr()
    err = " ".join(captured.err.split())
    assert "build of half-broken [site=b] failed" in err
    assert "about to fail on purpose" in err  # the tail of the engine log
    assert "nothing was published" in err
    assert "half-broken-a" in captured.out  # the summary still shows what did build
    assert snapshot(site_env_channel_copy) == before
    assert leftover_work_dirs(private_tmp) == []


def test_a_failed_build_into_a_new_channel_creates_nothing(tmp_path, capsys):
    root = make_repo(tmp_path, {"half-broken": HALF_BROKEN})
    channel = tmp_path / "new-channel"
    assert main(["--root", str(root), "build", "half-broken", "--channel-dir", str(channel)]) == 2
    assert not channel.exists()


FAILING_TEST = """\
    package:
      name: failing-test
      version: "1.0"
    build:
      noarch: generic
      script:
        - true
    tests:
      - script:
          - echo "the recipe test fails on purpose"
          - exit 1
    """


def test_a_failing_recipe_test_publishes_nothing(tmp_path, site_env_channel_copy, capsys):
    root = make_repo(tmp_path, {"failing-test": FAILING_TEST}, config="{}\n")
    before = snapshot(site_env_channel_copy)
    assert main(["--root", str(root), "build", "failing-test", "--channel-dir", str(site_env_channel_copy)]) == 2
    assert "the recipe test fails on purpose" in capsys.readouterr().err
    assert snapshot(site_env_channel_copy) == before


def test_no_test_skips_the_recipe_tests(tmp_path, site_env_channel_copy):
    root = make_repo(tmp_path, {"failing-test": FAILING_TEST}, config="{}\n")
    code = main(["--root", str(root), "build", "failing-test", "--no-test",
                 "--channel-dir", str(site_env_channel_copy)])
    assert code == 0
    assert list((site_env_channel_copy / "noarch").glob("failing-test-1.0-*.conda"))


def test_dependencies_come_only_from_the_channels_given(tmp_path, site_env_channel_copy, capsys):
    """No default channel (conda-forge) sneaks in: a missing dependency fails against the local channel only."""
    root = make_repo(tmp_path, {"needs-zlib": """\
        package:
          name: needs-zlib
          version: "1.0"
        build:
          noarch: generic
          script:
            - true
        requirements:
          host:
            - zlib
        """}, config="{}\n")
    before = snapshot(site_env_channel_copy)
    assert main(["--root", str(root), "build", "needs-zlib", "--channel-dir", str(site_env_channel_copy)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "Failed to resolve dependencies" in err
    assert site_env_channel_copy.resolve().as_uri() in err
    assert "conda-forge" not in err.split("hint:")[0]
    assert "anaconda.org" not in err
    assert snapshot(site_env_channel_copy) == before


def test_an_interrupt_stops_the_running_build_and_publishes_nothing(tmp_path, site_env_channel_copy):
    """SIGINT to channelsmith alone (not its process group) still stops the build script at once."""
    started = tmp_path / "build-started"
    root = make_repo(tmp_path, {"slow": f"""\
        package:
          name: slow
          version: "1.0"
        build:
          noarch: generic
          script:
            - touch "{started}"
            - sleep 120
        """}, config="{}\n")
    before = snapshot(site_env_channel_copy)
    returncode, err, after_s = interrupt_build(root, "slow", site_env_channel_copy, started, {"TMPDIR": str(tmp_path)})
    assert after_s < 20, "the build ran on after the interrupt"
    assert returncode == 130
    assert "interrupted; nothing was published" in err
    assert snapshot(site_env_channel_copy) == before
    assert leftover_work_dirs(tmp_path) == []


# A build step that outlives the interrupt (it handles SIGINT) and starts its next command after it: the
# signal reaches that command too, so the build stops well before the grace's SIGKILL (one forward reached
# only the processes there were at the interrupt: the new command ran on, and channelsmith ended killed).
LATE_CHILD = """\
import signal, subprocess, sys, time
signal.signal(signal.SIGINT, lambda *_: None)
time.sleep(1.5)
sys.exit(subprocess.run(["sleep", "120"], preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)).returncode)
"""


def test_an_interrupt_reaches_a_command_the_build_starts_after_it(tmp_path, site_env_channel_copy):
    started, step = tmp_path / "build-started", tmp_path / "late_child.py"
    step.write_text(LATE_CHILD)
    root = make_repo(tmp_path, {"late": f"""\
        package:
          name: late
          version: "1.0"
        build:
          noarch: generic
          script:
            - touch "{started}"
            - {sys.executable} {step}
        """}, config="{}\n")
    before = snapshot(site_env_channel_copy)
    returncode, err, after_s = interrupt_build(root, "late", site_env_channel_copy, started,
                                               {"TMPDIR": str(tmp_path), "CHANNELSMITH_INTERRUPT_GRACE": "30"})  # fmt: skip
    assert after_s < 20, "the command started after the interrupt ran on to the grace's kill"
    assert returncode == 130, err
    assert snapshot(site_env_channel_copy) == before


STAGED = """\
    context:
      version: "1.0"
    recipe:
      name: toy
      version: ${{{{ version }}}}
    outputs:
      - staging:
          name: toy-compile
        build:
          script:
            # The flavor is used only inside the staging script: the engine's own staging cache key
            # does not see it (py-rattler-build 0.73), so only separate output dirs keep flavors apart.
            - echo "${{{{ flavor }}}}" >> "{compile_log}"
            - mkdir -p "$PREFIX/share/toy"
            - echo "${{{{ flavor }}}}" > "$PREFIX/share/toy/flavor.txt"
      - package:
          name: libtoy
        inherit: toy-compile
        build:
          string: ${{{{ flavor }}}}_h${{{{ hash }}}}_0
          files:
            - share/toy/**
      - package:
          name: py-toy
        inherit: toy-compile
        requirements:
          run:
            - ${{{{ pin_subpackage('libtoy', exact=True) }}}}
        build:
          string: py${{{{ python | replace('.', '') }}}}_${{{{ flavor }}}}_h${{{{ hash }}}}_0
          script:
            - mkdir -p "$PREFIX/share/py-toy"
            - cp "$PREFIX/share/toy/flavor.txt" "$PREFIX/share/py-toy/flavor.txt"
          files:
            - share/py-toy/**
    about:
      license: MIT
    """


def test_staging_compiles_are_shared_across_python_versions_but_never_across_flavors(tmp_path):
    from rattler.package_streaming import extract

    compile_log = tmp_path / "compiles.log"
    config = 'python:\n  - "3.10"\n  - "3.11"\n  - "3.12"\nflavor:\n  - x\n  - y\n'
    root = make_repo(tmp_path, {"toy": STAGED.format(compile_log=compile_log)}, config=config)
    channel = tmp_path / "channel"
    assert main(["--root", str(root), "build", "toy", "--channel-dir", str(channel)]) == 0

    compiles = compile_log.read_text().split()
    # Four packages per flavor (libtoy + three py-toy); the Python count does not multiply the compile.
    # py-rattler-build 0.73's staging cache key includes the build prefix, whose path names the output,
    # so libtoy and py-toy each compile it once: two per flavor, not one per package.
    assert compiles.count("x") == compiles.count("y") == 2

    repodata = json.loads((channel / "linux-64" / "repodata.json").read_text())
    records = repodata["packages.conda"]
    libtoy = {r["build"].split("_")[0]: r["build"] for r in records.values() if r["name"] == "libtoy"}
    py_toys = {f: r for f, r in records.items() if r["name"] == "py-toy"}
    assert len(py_toys) == 6
    for file, record in py_toys.items():
        flavor = record["build"].split("_")[1]
        # pin_subpackage(exact=True) points at the same flavor's libtoy (one engine call per combination).
        assert record["depends"] == [f"libtoy ==1.0 {libtoy[flavor]}"]
        # The staged files are the flavor's own, not the first flavor's cache.
        extracted = tmp_path / "extracted" / file
        extract(channel / "linux-64" / file, extracted)
        assert (extracted / "share/py-toy/flavor.txt").read_text().strip() == flavor


def test_building_again_keeps_what_the_channel_has(repo_root, site_env_channel_copy, capsys):
    """A package file never changes in a channel, so a second build leaves the channel as it is."""
    before = snapshot(site_env_channel_copy)
    code = main(["--root", str(repo_root), "build", "site-env", "--channel-dir", str(site_env_channel_copy), "--json"])
    assert code == 0
    document = json.loads(capsys.readouterr().out)
    kept = sorted(p["name"] for b in document["builds"] for p in b["already_in_channel"])
    assert kept == sorted(f"site-env-{site}" for site in SITES)
    assert document["published"] == []
    assert snapshot(site_env_channel_copy) == before


# The file server runs in its own process (servers.file_server): py-rattler-build holds the GIL while it
# downloads, so a server thread inside the test process could never answer.
@pytest.fixture
def tarball_server(tmp_path):
    """An HTTP server on 127.0.0.1 serving one upstream-like tarball; yields (url, sha256, request log)."""
    served = tmp_path / "served"
    (served / "toy-1.0").mkdir(parents=True)
    (served / "toy-1.0" / "hello.txt").write_text("hello from upstream\n")
    tarball = served / "toy-1.0.tar.gz"
    with tarfile.open(tarball, "w:gz") as archive:
        archive.add(served / "toy-1.0", arcname="toy-1.0")
    log = tmp_path / "requests.log"
    log.touch()
    with file_server(served, log) as url:
        yield f"{url}/toy-1.0.tar.gz", hashlib.sha256(tarball.read_bytes()).hexdigest(), log


def test_upstream_sources_are_downloaded_once_and_kept_in_the_source_cache(tmp_path, tarball_server, monkeypatch):
    url, sha256, log = tarball_server
    monkeypatch.setenv("CHANNELSMITH_CACHE", str(tmp_path / "cache"))
    root = make_repo(tmp_path, {"from-url": f"""\
        package:
          name: from-url-${{{{ site }}}}
          version: "1.0"
        source:
          url: {url}
          sha256: {sha256}
        build:
          noarch: generic
          script:
            - mkdir -p "$PREFIX/share" && cp hello.txt "$PREFIX/share/"
        """})
    assert main(["--root", str(root), "build", "from-url", "--channel-dir", str(tmp_path / "one")]) == 0
    assert log.read_text().count("GET /toy-1.0.tar.gz") == 1  # two sites, one download
    assert main(["--root", str(root), "build", "from-url", "--channel-dir", str(tmp_path / "two")]) == 0
    assert log.read_text().count("GET /toy-1.0.tar.gz") == 1  # a later build takes it from the cache
    assert len(list((tmp_path / "two" / "noarch").glob("from-url-*.conda"))) == 2


def test_an_engine_that_does_not_stop_is_killed_after_the_grace_period(tmp_path, site_env_channel_copy):
    """A download that never answers keeps the engine busy inside the process: SIGTERM must still end it."""
    import socket

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(4)  # the kernel accepts connections; nobody ever answers
    url = f"http://127.0.0.1:{silent.getsockname()[1]}/never.tar.gz"
    root = make_repo(tmp_path, {"stuck": f"""\
        package:
          name: stuck
          version: "1.0"
        source:
          url: {url}
          sha256: {"0" * 64}
        build:
          noarch: generic
          script:
            - true
        """}, config="{}\n")
    before = snapshot(site_env_channel_copy)
    env = {**os.environ, "TMPDIR": str(tmp_path), "CHANNELSMITH_CACHE": str(tmp_path / "cache"),
           "CHANNELSMITH_INTERRUPT_GRACE": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "channelsmith", "--root", str(root), "build", "stuck",
         "--channel-dir", str(site_env_channel_copy)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while not list(tmp_path.glob("channelsmith-build-*/*")):  # the engine has its output dir
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the build never started"
            time.sleep(0.1)
        time.sleep(1)
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        silent.close()
    assert time.monotonic() - signalled < 10
    assert proc.returncode == -signal.SIGKILL
    assert "did not stop within 1 s of the interrupt" in err
    assert snapshot(site_env_channel_copy) == before
    assert leftover_work_dirs(tmp_path) == []


# A noarch library every Python build pins exactly, and its per-Python package (two Pythons).
PAIR = """\
        context:
          version: "1.0"
        recipe:
          name: pair
          version: ${{ version }}
        outputs:
          - package:
              name: libpair
            build:
              noarch: generic
              script:
                - true
          - package:
              name: py-pair
            requirements:
              run:
                - ${{ pin_subpackage('libpair', exact=True) }}
            build:
              string: py${{ python | replace('.', '') }}_h${{ hash }}_0
              script:
                - true
            tests:
              - script:
                  - test -f "$PREFIX/conda-meta/$(ls "$PREFIX/conda-meta" | grep '^libpair-')"
        about:
          license: MIT
        """
PAIR_CONFIG = 'python:\n  - "3.10"\n  - "3.11"\n'


def test_a_package_built_for_one_combination_serves_the_later_ones(tmp_path):
    """libpair is built once (noarch, no staging); py-pair for each Python pins it exactly and is tested."""
    root = make_repo(tmp_path, {"pair": PAIR}, config=PAIR_CONFIG)
    channel = tmp_path / "channel"
    assert main(["--root", str(root), "build", "pair", "--channel-dir", str(channel)]) == 0
    names = sorted(p.name.rsplit("-", 2)[0] for p in channel.rglob("*.conda"))
    assert names == ["libpair", "py-pair", "py-pair"]
