"""Installing a bundle where no network is: into a new or empty prefix, from the one copy that was checked.

The checked members (checking.py) go to py-rattler's installer as records whose URLs are the
extracted files: nothing is fetched. A failure removes the prefix it created (or empties the empty
directory it was given); a prefix that already holds anything is refused before anything is
written.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import rattler

from channelsmith.bundle.anchors import (
    NO_ANCHOR,
    SignatureCheck,
    SignatureVerifier,
    check_sha256,
    refuse_unanchored,
    signature_file,
    signer_of,
)
from channelsmith.bundle.checking import anchor_hint, bundled_records, check_bundle_file, extracted, read_trusted_lock
from channelsmith.bundle.layout import ACTIVATE_NAME, package_member, package_stem
from channelsmith.channel import run_rattler
from channelsmith.deploy import (
    DeployedPackage,
    DeployReport,
    check_lock_gpus,
    check_prefix,
    prefix_packages,
    restore_urls,
)
from channelsmith.errors import DeployError
from channelsmith.expansion import check_expansions, check_room
from channelsmith.lock import LOCK_NAME
from channelsmith.private import PrivateFolder, make_private_folder


def activate_script(prefix: Path) -> str:
    """A POSIX activate.sh for ``prefix``: CONDA_PREFIX, PATH, then every etc/conda/activate.d/*.sh.

    Written here rather than by rattler.shell, whose script bakes in the installing shell's whole PATH.
    """
    quoted = "'" + str(prefix).replace("'", "'\\''") + "'"
    return (
        "# Activate the environment in this prefix: . PREFIX/activate.sh (what conda activate also runs).\n"
        f"CONDA_PREFIX={quoted}\n"
        "export CONDA_PREFIX\n"
        'PATH="$CONDA_PREFIX/bin${PATH:+:$PATH}"\n'
        "export PATH\n"
        'for _channelsmith_script in "$CONDA_PREFIX"/etc/conda/activate.d/*.sh; do\n'
        '    if [ -f "$_channelsmith_script" ]; then . "$_channelsmith_script"; fi\n'
        "done\n"
        "unset _channelsmith_script\n"
    )


def _refuse_used_prefix(prefix: Path) -> bool:
    """Whether ``prefix`` exists (it must then be an empty directory); DeployError if it holds anything."""
    if not prefix.exists():
        return False
    if prefix.is_dir() and not any(prefix.iterdir()):
        return True
    if (prefix / "conda-meta").is_dir():
        held = ", ".join(f"{p.name} {p.version}" for p in prefix_packages(prefix)[:5]) or "no packages"
        raise DeployError(
            f"prefix {prefix} already holds an environment ({held})",
            hint="a bundle installs into a new or empty directory: pass another --prefix, or remove this one first",
        )
    if not prefix.is_dir():
        check_prefix(prefix)  # a file: its own message
    held = ", ".join(sorted(entry.name for entry in prefix.iterdir())[:3])
    raise DeployError(
        f"prefix {prefix} is not empty (it holds {held}) and a bundle installs only into a new or empty directory",
        hint="pass a --prefix that does not exist yet or is an empty directory, or empty this one first",
    )


@contextmanager
def _scratch(beside: Path) -> Iterator[PrivateFolder]:
    """A private folder for one install, removed afterwards: the bundle's members and py-rattler's package
    cache, both made from the checked bytes in this run (no shared cache, which another user may be able
    to write, or may have written when it could). Beside the prefix (``beside``, its parent: the same
    filesystem, so py-rattler hard-links the files instead of copying them) where no one else can
    change that folder, else in $TMPDIR likewise, else DeployError."""
    folder = make_private_folder(
        [("the prefix's folder", beside), ("TMPDIR", Path(tempfile.gettempdir()))], "the bundle's checked packages"
    )
    try:
        yield folder
    finally:
        shutil.rmtree(folder.path, ignore_errors=True)


def _drop_cache_tag(prefix: Path) -> None:
    """Remove the CACHEDIR.TAG py-rattler 0.28 writes into every prefix it installs into, unless a package
    installed it: the prefix holds what the lock lists, and a backup tool would skip a tagged prefix."""
    tag = prefix / "CACHEDIR.TAG"
    if not tag.is_file():
        return
    for meta in (prefix / "conda-meta").glob("*.json"):
        if "CACHEDIR.TAG" in json.loads(meta.read_text(encoding="utf-8")).get("files", []):
            return
    tag.unlink()


def _clear(path: Path, existed: bool) -> None:
    """Undo a failed install: remove what it created (``path``), or empty the empty directory it was given.

    py-rattler 0.28's linking tasks can outlive the failed install's future and write a few more files
    (after one pass, 2 of 8 runs of tests/test_bundle.py found bin/, etc/ ... back on the full disk;
    0 of 10 with this loop), so the clearing repeats until the path has stayed clear for two checks
    0.1 s apart (at most 5 s).
    """

    def clear_once() -> None:
        if not existed:
            shutil.rmtree(path, ignore_errors=True)
            return
        for entry in list(path.iterdir()):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)

    def is_clear() -> bool:
        return not any(path.iterdir()) if existed else not path.exists()

    deadline = time.monotonic() + 5
    quiet = 0
    while quiet < 2 and time.monotonic() < deadline:
        clear_once()
        time.sleep(0.1)
        quiet = quiet + 1 if is_clear() else 0


def install_bundle(
    bundle: Path,
    *,
    prefix: Path,
    sha256: str | None = None,
    trusted_lock: Path | None = None,
    allowed_signers: Path | None = None,
    signature: Path | None = None,
    show_progress: bool = False,
) -> DeployReport:
    """Install exactly the packages of a bundle's lock into a new or empty ``prefix``, with no network.

    ``sha256`` (the digest pack printed), ``allowed_signers`` (the site's signers file, with the
    bundle's ``signature``, default FILE.tar.sig beside it) and ``trusted_lock`` (a lock kept apart
    from the bundle) are anchors from outside it: the bundle file must have that sha256, be signed
    by a key the signers file lists, and every package must be one the trusted lock pins, with its
    sha256; any failing is refused before anything is written into the prefix. With none of them
    and CHANNELSMITH_REQUIRE_ANCHOR=1, the bundle is refused. The report's ``anchor`` says which
    were checked (``none`` when none was).

    Writes the bundle's lock (the trusted one, when given) to PREFIX/channelsmith.lock and a
    PREFIX/activate.sh. The members are extracted, and py-rattler's package cache made, in one private
    folder (:func:`_scratch`): what was checked is what is installed, whatever TMPDIR or a shared cache
    allow others. The report's ``notes`` say where that folder went when the first choice was passed
    over. On any failure the prefix is removed (or emptied, if it was an empty directory before).
    """
    start = time.perf_counter()
    bundle = Path(bundle)
    prefix = Path(prefix).absolute()
    expected = check_sha256(sha256) if sha256 is not None else None
    trusted = read_trusted_lock(trusted_lock) if trusted_lock is not None else None
    if signature is not None and allowed_signers is None:
        raise DeployError(
            "--signature is checked against a signers file; it takes --allowed-signers",
            hint="pass --allowed-signers FILE (the site's signers file) too",
        )
    anchors = [name for name, given in (("signature", allowed_signers), ("sha256", sha256), ("lock", trusted_lock))
               if given is not None]  # fmt: skip
    if not anchors:
        refuse_unanchored(bundle)
    existed = _refuse_used_prefix(prefix)
    check_prefix(prefix)
    check_bundle_file(bundle)  # a missing bundle is said before its missing signature is
    signer = verifier = None
    if allowed_signers is not None:
        # Who signed is found from the signature and the signers file alone, before the bundle is read.
        check = SignatureCheck(Path(allowed_signers), Path(signature) if signature else signature_file(bundle))
        signer = signer_of(check, bundle)
        verifier = SignatureVerifier(check, signer)
    # What a failed install removes: the prefix, or its first missing parent that the install creates.
    created = prefix
    while not created.parent.exists():
        created = created.parent
    scratch_in = (prefix if existed else created).parent
    with _scratch(scratch_in) as scratch, extracted(bundle, scratch.path, verifier) as (files, whole):
        if verifier is not None:
            verifier.finish(bundle)
        if expected is not None and whole != expected:
            raise DeployError(
                f"{bundle} has the sha256 {whole}, not the {expected} given with --sha256: it is not the "
                "bundle that was packed (damaged or changed on the way)",
                hint=anchor_hint("the digest"),
            )
        pointed, lock_bytes = bundled_records(bundle, files, trusted)
        check_lock_gpus([record for record, _url in pointed], f"the bundle {bundle}")
        # Before py-rattler extracts them into the cache: a package that holds more than its info/paths.json
        # records is refused having written nothing (the count stops at the record), not at a full disk, and
        # so are packages that record more than the disk has free.
        expansions = check_expansions({record.file_name: files[package_member(record)][0] for record, _url in pointed})
        cache_dir = scratch.path / "pkgs"
        check_room(expansions, cache_dir, prefix)
        try:
            prefix.mkdir(parents=True, exist_ok=True)
            records = [record for record, _url in pointed]
            run_rattler(
                rattler.install(
                    records, prefix, cache_dir=cache_dir, show_progress=show_progress, execute_link_scripts=False
                )
            )
            _drop_cache_tag(prefix)
            restore_urls(prefix, {package_stem(record.file_name): url for record, url in pointed})
            (prefix / LOCK_NAME).write_bytes(lock_bytes)
            (prefix / ACTIVATE_NAME).write_text(activate_script(prefix))
        except BaseException as exc:
            _clear(prefix if existed else created, existed)
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            full = isinstance(exc, OSError) and exc.errno == errno.ENOSPC or "No space left" in str(exc)
            raise DeployError(
                f"installing {bundle} into {prefix} failed: {_first_and_last_line(exc)}; the prefix was "
                + ("emptied" if existed else "removed"),
                hint="free space on the prefix's filesystem (df -h), then install again"
                if full
                else f"check that you can write to {created if not existed else prefix} and to the package "
                f"cache {cache_dir}, then install again",
            ) from None
    installed = tuple(
        DeployedPackage(
            r.name.normalized,
            str(r.version),
            str(r.build),
            r.subdir,
            str(r.channel or "").rstrip("/"),
            url,
            r.sha256.hex(),
        )
        for r, url in pointed
    )
    return DeployReport(
        prefix=prefix,
        lock_file=prefix / LOCK_NAME,
        channels=(),
        specs=(),
        packages=installed,
        from_lock=True,
        seconds=time.perf_counter() - start,
        anchor="+".join(anchors) or NO_ANCHOR,
        signer=signer,
        notes=tuple(note for note in [scratch.note("the bundle's checked packages")] if note),
    )


def _first_and_last_line(exc: BaseException) -> str:
    # rattler's errors say what failed on the first line and the cause (e.g. ENOSPC) on the last.
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if len(lines) > 1:
        return f"{lines[0]} ({lines[-1]})"
    return _first_line(exc)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
