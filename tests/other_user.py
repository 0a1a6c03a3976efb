"""Another user on the same login node, for the tests that play one (issue 69): a Unix user made for the
test run, and the attacker's steps, run as that user with setpriv.

The attacker's program (ATTACKER) uses the standard library only, run by the system's python3: it must
not need anything the test user's files hold.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

# The attacker's steps, one per first argument:
#   steal DIR                  rename the victim's folder DIR away and put a folder of ours (0777) in its place
#   swap FORGED TARGET         put FORGED's bytes at TARGET by rename (in any folder we can write)
#   plant TREE CACHE STEM HEX  put TREE in the package cache CACHE as STEM, with a .lock naming the sha256 HEX
#   live TMPDIR BUNDLE PACKAGE STOP  until STOP exists: steal every folder made in TMPDIR, and put BUNDLE over
#                              every env.tar or bundle.tar the victim writes into one we stole, PACKAGE over every
#                              package file made in TMPDIR; prints how many of each it did
ATTACKER = r"""
import os, shutil, sys, time
mine = os.getuid()

def swap(source, target):
    part = target + ".part"
    shutil.copyfile(source, part)
    os.chmod(part, 0o644)
    os.replace(part, target)

mode, args = sys.argv[1], sys.argv[2:]
if mode == "steal":
    os.rename(args[0], args[0] + ".stolen")
    os.mkdir(args[0])
    os.chmod(args[0], 0o777)
elif mode == "swap":
    swap(*args)
elif mode == "plant":
    tree, cache, stem, hex_digest = args
    shutil.copytree(tree, os.path.join(cache, stem), symlinks=True)
    with open(os.path.join(cache, stem + ".lock"), "wb") as lock:
        lock.write((1).to_bytes(8, "big") + bytes.fromhex(hex_digest))
elif mode == "live":
    tmpdir, bundle, package, stop = args
    stolen, counts = set(), {"stolen": 0, "bundles": 0, "packages": 0}
    while not os.path.exists(stop):
        try:
            entries = list(os.scandir(tmpdir))
        except OSError:
            entries = []
        for entry in entries:
            try:
                info = entry.stat(follow_symlinks=False)
                if info.st_uid == mine or entry.name.endswith((".stolen", ".part")):
                    if entry.path in stolen:
                        for name in ("env.tar", "bundle.tar"):
                            target = os.path.join(entry.path, name)
                            if os.path.exists(target) and os.stat(target).st_uid != mine:
                                swap(bundle, target)
                                counts["bundles"] += 1
                    continue
                if entry.is_dir(follow_symlinks=False):
                    os.rename(entry.path, entry.path + ".stolen")
                    os.mkdir(entry.path)
                    os.chmod(entry.path, 0o777)
                    stolen.add(entry.path)
                    counts["stolen"] += 1
                elif entry.name.endswith(".conda"):
                    swap(package, entry.path)
                    counts["packages"] += 1
            except OSError:
                pass
        time.sleep(0.0005)
    print(counts)
"""


# Where root's tools live: a clean environment's PATH (CI's: /usr/local/bin:/usr/bin:/bin) lacks the sbin folders.
_SBIN = ("/usr/local/sbin", "/usr/sbin", "/sbin")


def tool(name: str) -> str | None:
    """The path of ``name`` on PATH or in the sbin folders, or None."""
    return shutil.which(name, path=os.pathsep.join([os.environ.get("PATH", ""), *_SBIN]))


def why_no_other_user() -> str:
    """Why no other user can be made here ('' when one can)."""
    if os.geteuid() != 0:
        return "making a second Unix user (the attacker) needs root"
    for name in ("useradd", "userdel", "setpriv"):
        if tool(name) is None:
            return f"{name} is not installed (Debian: passwd, util-linux): no second user can be made"
    if not os.path.exists("/usr/bin/python3"):
        return "/usr/bin/python3 is missing: the attacker's steps run with the system's python3"
    return ""


@contextmanager
def other_user() -> Iterator[pwd.struct_passwd]:
    """A Unix user made for the test (a system user with its own group, no home), removed afterwards;
    the test is skipped with the reason where none can be made."""
    reason = why_no_other_user()
    if reason:
        pytest.skip(reason)
    name = f"cs-other-{os.getpid()}"
    made = subprocess.run(
        [str(tool("useradd")), "--system", "--user-group", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
        capture_output=True,
        text=True,
    )
    if made.returncode != 0:
        pytest.skip(f"useradd could not make the attacker's user: {made.stderr.strip()}")
    try:
        yield pwd.getpwnam(name)
    finally:
        subprocess.run([str(tool("userdel")), name], capture_output=True, check=False)


def as_user(user: pwd.struct_passwd, *args: str) -> list[str]:
    """The argv that runs the attacker's step ``args`` (see ATTACKER) as ``user``."""
    return [
        str(tool("setpriv")), f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups",
        "/usr/bin/python3", "-c", ATTACKER, *args,
    ]  # fmt: skip
