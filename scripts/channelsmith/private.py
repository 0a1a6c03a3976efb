"""Folders no other user can touch: where an install keeps the bytes it checked until it has installed them.

An install hashes a file, then hands its path to py-rattler, which opens it again. That is safe only
if no one else can put other bytes behind that path meanwhile: nobody else may write in the folder
holding it, nor rename that folder or any folder above it. A folder that others can write lets them
rename any entry in it unless it is sticky (like /tmp, mode 1777): then only an entry's owner, the
folder's owner and root can. So a path is private when every folder on it is this user's or root's,
and each folder above the last is writable by no one else or sticky. A group-writable folder counts
as writable by others (the group may have other members), and so does one with a POSIX access ACL.

Paths are resolved first (symlinks followed once) and the resolved path is the one used afterwards:
a symlink on the way could otherwise be swapped by whoever can write the folder holding it.
"""

from __future__ import annotations

import errno
import os
import pwd
import stat
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from channelsmith.errors import DeployError

PRIVATE_HINT = (
    "point TMPDIR at a folder only you can write (mkdir -m 700 -p ~/tmp && export TMPDIR=~/tmp), "
    "or install into a prefix whose parent folder only you can write"
)


def _owner(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def _has_access_acl(path: Path) -> bool:
    """Whether ``path`` carries a POSIX access ACL beyond its mode bits (which may let others write it)."""
    try:
        os.getxattr(path, "system.posix_acl_access", follow_symlinks=False)
    except OSError as exc:  # ENODATA: none; ENOTSUP: a filesystem without ACLs
        if exc.errno in (errno.ENODATA, errno.ENOTSUP, errno.EOPNOTSUPP):
            return False
        raise
    except AttributeError:  # no xattr calls on this platform
        return False
    return True


def who_else_can_change(folder: Path, *, files_inside: bool = True) -> str | None:
    """Why a user other than this one (and root) could change what ``folder`` holds; None when none can.

    With ``files_inside`` (files are made in ``folder`` itself), nobody else may write ``folder``; without
    (``folder`` only holds a folder this user makes in it, as TMPDIR holds mkdtemp's), a sticky
    ``folder`` is enough. Every folder above must be this user's or root's, and writable by no one
    else unless sticky. ``folder`` must exist; it is resolved first, and the answer holds for the
    resolved path only (:func:`resolved`).
    """
    me = os.geteuid()
    path = Path(os.path.realpath(folder))
    first = True
    for current in (path, *path.parents):
        info = os.lstat(current)
        if not stat.S_ISDIR(info.st_mode):
            return f"{current} is not a folder"
        if info.st_uid not in (me, 0):
            return f"{current} belongs to {_owner(info.st_uid)}, who can rename or replace what it holds"
        writable_by_others = info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
        if writable_by_others and (first and files_inside or not info.st_mode & stat.S_ISVTX):
            who = "its group and others" if info.st_mode & stat.S_IWOTH else "its group"
            return (
                f"{current} can be written by {who} (mode {stat.S_IMODE(info.st_mode):04o}"
                + ("" if info.st_mode & stat.S_ISVTX else ", not sticky")
                + "), who can rename what it holds and put their own in its place"
            )
        if _has_access_acl(current):
            return f"{current} has an access ACL (getfacl {current}) that may let others write it"
        first = False
    return None


def resolved(folder: Path) -> Path:
    """``folder`` with every symlink followed: the path :func:`who_else_can_change` vouches for."""
    return Path(os.path.realpath(folder))


@dataclass(frozen=True)
class PrivateFolder:
    """A folder made for one install, and why each folder tried before it was passed over."""

    path: Path
    passed_over: tuple[str, ...]

    def note(self, what: str) -> str | None:
        """A line saying where ``what`` went instead of the first folder tried, or None if it went there."""
        if not self.passed_over:
            return None
        return f"{what} went to {self.path}, not to {'; nor to '.join(self.passed_over)}"


def make_private_folder(candidates: Sequence[tuple[str, Path]], purpose: str) -> PrivateFolder:
    """A new folder (mode 0700) in the first of ``candidates`` (label, folder) whose path no one else can change.

    ``purpose`` names what it is for, in the error. DeployError (exit 2) naming each candidate and
    why it was passed over when none will do.
    """
    passed_over: list[str] = []
    for label, candidate in candidates:
        if not Path(candidate).is_dir():
            passed_over.append(f"{label} {candidate} (not a folder)")
            continue
        reason = who_else_can_change(candidate, files_inside=False)
        if reason is not None:
            passed_over.append(f"{label} {candidate} ({reason})")
            continue
        try:
            made = Path(tempfile.mkdtemp(prefix=".channelsmith-", dir=resolved(candidate)))
        except OSError as exc:
            passed_over.append(f"{label} {candidate} (cannot make a folder there: {exc.strerror or exc})")
            continue
        info = os.lstat(made)
        if info.st_uid != os.geteuid() or stat.S_IMODE(info.st_mode) & 0o077 or _has_access_acl(made):
            # mkdtemp makes it 0700; a default ACL or a mount option can widen it: then it is no use.
            os.rmdir(made)
            passed_over.append(f"{label} {candidate} (a folder made there is not private: mode "
                               f"{stat.S_IMODE(info.st_mode):04o})")  # fmt: skip
            continue
        return PrivateFolder(made, tuple(passed_over))
    raise DeployError(
        f"no folder to keep {purpose} in that only you can change: " + "; ".join(passed_over),
        hint=PRIVATE_HINT,
    )
