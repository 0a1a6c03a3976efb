"""Anchors: what vouches for a bundle from outside it, and how each is checked.

A bundle's own lock shows damage, not a change: whoever can change a package inside it can rewrite
that lock too. Only something kept apart from the bundle shows a change:

- its sha256 (``FILE.tar.sha256``, sha256sum's format), which must travel by another path;
- an OpenSSH signature (``FILE.tar.sig``, ``ssh-keygen -Y sign`` in the namespace
  ``channelsmith-bundle``), checked against a signers file the site publishes once
  (``ssh-keygen``'s allowed-signers format): the signature may travel with the bundle, the signers
  file may not;
- a trusted lock (``deploy --bundle --lock``; see checking.py).

Signing and checking are OpenSSH's own (``ssh-keygen -Y sign|find-principals|verify``), so a site
can run the very same check with the tools it already trusts before anything from the bundle runs.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from channelsmith.errors import DeployError

# The signature namespace: a signature made for another purpose (a git commit, a file) never passes as a bundle's.
NAMESPACE = "channelsmith-bundle"
DIGEST_SUFFIX = ".sha256"
SIGNATURE_SUFFIX = ".sig"
# A site setting: with it set to 1, a bundle with no outside anchor is refused (exit 2) by every install route.
REQUIRE_ANCHOR_ENV = "CHANNELSMITH_REQUIRE_ANCHOR"
NO_ANCHOR = "none"


def digest_file(bundle: Path, anchor_dir: Path | None = None) -> Path:
    """Where pack writes a bundle's sha256: FILE.tar.sha256 in ``anchor_dir``, else beside the bundle."""
    return (anchor_dir or bundle.parent) / (bundle.name + DIGEST_SUFFIX)


def signature_file(bundle: Path, anchor_dir: Path | None = None) -> Path:
    """Where pack writes a bundle's signature (and deploy looks for it): FILE.tar.sig, likewise."""
    return (anchor_dir or bundle.parent) / (bundle.name + SIGNATURE_SUFFIX)


def check_sha256(given: str) -> str:
    """``given`` as a lowercase sha256 hex digest (case and surrounding blanks do not matter); DeployError
    when it is not one, saying so when it is a whole line of FILE.tar.sha256."""
    digest = given.strip().lower()
    if len(digest) == 64 and all(c in "0123456789abcdef" for c in digest):
        return digest
    first = digest.split()[0] if digest.split() else ""
    if len(first) == 64 and all(c in "0123456789abcdef" for c in first):
        raise DeployError(
            f"--sha256 {given!r} is a whole line of FILE.tar.sha256, not the digest alone",
            hint="pass its first word only: --sha256 \"$(cut -d' ' -f1 FILE.tar.sha256)\"",
        )
    raise DeployError(
        f"--sha256 {given!r} is not a sha256 (64 hex digits)",
        hint="pass the digest channelsmith pack printed (the first word of FILE.tar.sha256)",
    )


def require_anchor() -> bool:
    """Whether the site refuses unanchored bundles: CHANNELSMITH_REQUIRE_ANCHOR=1 (0 or unset: no)."""
    value = os.environ.get(REQUIRE_ANCHOR_ENV, "").strip()
    if value not in ("", "0", "1"):
        raise DeployError(
            f"{REQUIRE_ANCHOR_ENV}={value!r} is neither 1 nor 0",
            hint=f"set {REQUIRE_ANCHOR_ENV}=1 to refuse bundles with no outside anchor, or 0 (or unset it) to "
            "allow them",
        )
    return value == "1"


def refuse_unanchored(bundle: Path) -> None:
    """DeployError (exit 2) for a bundle given with no outside anchor, where the site requires one."""
    if require_anchor():
        raise DeployError(
            f"{bundle} comes with no outside anchor, and {REQUIRE_ANCHOR_ENV}=1 refuses such bundles",
            hint="pass --sha256 HEX (FILE.tar.sha256, carried apart from the bundle), --allowed-signers FILE "
            "(the site's signers file) or --lock LOCK (a trusted lock)",
        )


def _ssh_keygen() -> str:
    found = shutil.which("ssh-keygen")
    if found is None:
        raise DeployError(
            "signing and checking signatures need ssh-keygen (OpenSSH >= 8.2), which is not on PATH",
            hint="install OpenSSH's client tools (Debian: openssh-client), or anchor the bundle with its sha256",
        )
    return found


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "no message"


def _all_lines(*texts: str) -> str:
    """Every line ssh-keygen wrote, joined: it says why (such as "key has expired") before its last line."""
    lines = [line.strip() for text in texts for line in text.splitlines() if line.strip()]
    return "; ".join(dict.fromkeys(lines)) or "no message"


def check_signing_key(key: Path) -> None:
    """DeployError unless ``key`` is a readable file and ssh-keygen is there: checked before pack fetches anything."""
    _ssh_keygen()
    if not key.is_file() or not os.access(key, os.R_OK):
        raise DeployError(
            f"--sign {key} is no readable key file",
            hint="pass an OpenSSH private key (ssh-keygen -t ed25519 -f KEY makes one), or its .pub with the "
            "key loaded in ssh-agent",
        )


def sign(data: Path, key: Path) -> bytes:
    """The OpenSSH signature of the file ``data`` by ``key``, in the bundle namespace (ssh-keygen -Y sign)."""
    done = subprocess.run(
        [_ssh_keygen(), "-q", "-Y", "sign", "-f", str(key), "-n", NAMESPACE, str(data)],
        capture_output=True,
        text=True,
    )
    made = Path(str(data) + SIGNATURE_SUFFIX)
    try:
        if done.returncode != 0:
            raise DeployError(
                f"ssh-keygen could not sign with {key}: {_last_line(done.stderr)}",
                hint="pass an OpenSSH private key you can read (with its passphrase at the prompt, or loaded in "
                "ssh-agent)",
            )
        return made.read_bytes()
    finally:
        made.unlink(missing_ok=True)


@dataclass(frozen=True)
class SignatureCheck:
    """A signature to check against a site's signers file."""

    signers: Path
    signature: Path


def signer_of(check: SignatureCheck, bundle: Path) -> str:
    """The principal of ``check.signers`` whose key made the signature (ssh-keygen -Y find-principals).

    Reads the signature and the signers file only, not the bundle: an unsigned bundle, or one
    signed by a key the site does not list, is refused before a byte of the bundle is read.
    """
    if not check.signers.is_file():
        raise DeployError(
            f"--allowed-signers {check.signers} does not exist",
            hint="pass the site's signers file (ssh-keygen's allowed-signers format: PRINCIPAL KEYTYPE KEY per line)",
        )
    if not check.signature.is_file():
        raise DeployError(
            f"{bundle} is unsigned: its signature {check.signature} does not exist",
            hint="do not install it: fetch FILE.tar.sig from where the packer put it (pack --sign KEY) and "
            "pass --signature FILE.sig, or pack and sign it again",
        )
    done = subprocess.run(
        [_ssh_keygen(), "-Y", "find-principals", "-f", str(check.signers), "-s", str(check.signature)],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
    )
    principals = [line.strip() for line in done.stdout.splitlines() if line.strip()]  # one a line
    if done.returncode != 0 or not principals:
        raise DeployError(
            f"{bundle}'s signature {check.signature} is by no key that {check.signers} lists "
            f"({_all_lines(done.stderr)})",
            hint="do not install this bundle: it was not signed by anyone the site trusts. Ask for one signed "
            "with a key in the signers file",
        )
    return principals[0]


class SignatureVerifier:
    """ssh-keygen -Y verify fed the bundle's bytes as they are read: the bytes checked are the bytes used."""

    def __init__(self, check: SignatureCheck, signer: str) -> None:
        self.check = check
        self.signer = signer
        self._process = subprocess.Popen(
            [_ssh_keygen(), "-Y", "verify", "-f", str(check.signers), "-I", signer, "-n", NAMESPACE,
             "-s", str(check.signature)],  # fmt: skip
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        self._fed = True

    def update(self, data: bytes) -> None:
        """Feed the next bytes of the bundle."""
        if not self._fed or not data:
            return
        try:
            self._process.stdin.write(data)
        except BrokenPipeError:  # ssh-keygen refused the signature before reading: finish() says why
            self._fed = False

    def finish(self, bundle: Path) -> None:
        """DeployError unless the signature is good for every byte fed, by ``signer``, in the bundle namespace."""
        out, err = self._process.communicate()  # closes ssh-keygen's stdin: the end of the bundle
        if self._process.returncode != 0 or not self._fed:
            raise DeployError(
                f"{bundle} does not match its signature {self.check.signature} by {self.signer} "
                f"({_all_lines(err.decode(errors='replace'), out.decode(errors='replace'))}): it is not the "
                "bundle that was signed",
                hint="do not install this bundle: copy it again from the packing node (or pack and sign it again "
                "there) and check it against the same signers file",
            )

    def abandon(self) -> None:
        """Stop ssh-keygen if the read failed half-way (nothing to do after :meth:`finish`)."""
        if self._process.returncode is None:
            self._process.kill()
            self._process.communicate()
