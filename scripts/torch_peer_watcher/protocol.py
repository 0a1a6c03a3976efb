"""The watcher's wire protocol: the handshake's proofs, the MAC on every message, signed store addresses.

Everything here is keyed with the job key (:func:`job_key`): HMAC-SHA256 of the job's secret
(``TORCH_PEER_WATCHER_SECRET``; the empty key when there is none, which anyone can compute: nothing is
authenticated then) over the job's binding (:func:`job_binding`: the store's address and the launcher's
job ids). Sites reuse one secret across jobs, so every proof, link key, signed address, store-host
record and verdict claim is made with the job key: a value made by another job with the same secret
does not verify here (issue 68). Version 3 (issue 50) binds each link to the address the dialer
dialled, authenticates every message after the handshake and signs each rank's address in the store,
because the store is writable by anyone who reaches it:

    dialer -> listener   HELLO <dialer rank> <dialer nonce> <dialer id> <dialer's listener host|port>
    listener -> dialer   CHALLENGE <listener nonce> <listener id> <proof("listener")>
    dialer -> listener   AUTH <proof("dialer")>

A nonce is 16 random bytes (hex) made for this connection; an id (16 random bytes, hex) names the
process (:class:`torch_peer_watcher.links.LinkLoop` makes one), so that a redial from a process that
was declared lost is told so instead of being taken for its replacement. The ids and nonces are
public (anyone may ask a listener for them): nothing that decides a verdict is named by them alone
(:mod:`torch_peer_watcher.verdicts` names its keys with the job key). ``proof(role)`` is
HMAC-SHA256 of the job key over :data:`PROTOCOL`, the role, both ranks, both nonces, both ids, the
address the dialer dialled (``host|port``, as the store gave it) and the dialer's own listener
address. The listener computes its proof and checks the dialer's with its *own* advertised address:
a relay, which the dialer dials at another address, gets a proof neither side accepts.

A process whose link closed confirms the loss before any verdict (links.py): the lower rank dials
again with HELLO; the higher rank asks the lower rank's listener whether it lives:

    prober -> listener   PROBE <prober rank> <prober nonce> <prober id>
    listener -> prober   ALIVE <listener nonce> <listener id> <proof("alive")>      then closes
                      or LOST <listener nonce> <listener id> <proof("lost")>       (it declared the prober lost)

``LOST`` answers a HELLO too, from a process the listener declared lost. After the handshake each
message is one line ``<body> <mac>``: the MAC is HMAC-SHA256 (first 16 bytes, hex) under a key of the
link and direction (:func:`link_keys`) over the message's sequence number in that direction and the
body, so that nothing can be injected, replayed, dropped or reordered without the next MAC failing.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from collections.abc import Mapping
from typing import Any

from torch_peer_watcher.sockets import Endpoint

PROTOCOL = "torch_peer_watcher/4"
MAX_HANDSHAKE_LINE = 512
MAX_LINE = 1 << 20
_MAX_ENDPOINTS = 1 << 16
_MAC_HEX = 32

_HEX32 = rb"[0-9a-f]{32}"
_HOST = rb"[0-9A-Za-z.:%_-]{1,255}"
_PORT = rb"[1-9][0-9]{0,4}"
_RANK = rb"0|[1-9][0-9]{0,8}"
HELLO = re.compile(rb"HELLO (" + _RANK + rb") (" + _HEX32 + rb") (" + _HEX32 + rb") (" + _HOST + rb")\|(" + _PORT + rb")")
PROBE = re.compile(rb"PROBE (" + _RANK + rb") (" + _HEX32 + rb") (" + _HEX32 + rb")")
# CHALLENGE, ALIVE and LOST share one form: <word> <nonce> <id> <proof>.
ANSWER = re.compile(rb"(CHALLENGE|ALIVE|LOST) (" + _HEX32 + rb") (" + _HEX32 + rb") ([0-9a-f]{64})")
AUTH = re.compile(rb"AUTH ([0-9a-f]{64})")


# The launcher's ids of a job, the same on every rank of it and new for the next one (where set).
RUN_ID_ENVS = ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "PBS_JOBID")
_TAG_HEX = 16


def job_binding(store_host: str | None, store_port: int | None, env: Mapping[str, str]) -> str:
    """What names this job to every rank of it: the rendezvous store's address as the ranks dial it, and
    the launcher's job ids (:data:`RUN_ID_ENVS`) that are set. Two jobs that run at once never share a
    store address; a later job at the same address differs in its launcher's id where there is one."""
    parts = [f"store={store_host or ''}|{store_port or ''}"]
    parts += [f"{name}={env[name].strip()}" for name in RUN_ID_ENVS if env.get(name, "").strip()]
    return " ".join(parts)


def job_key(secret: str | None, job: str) -> bytes:
    """The key of every proof, MAC and signed value of the job named ``job`` (:func:`job_binding`)."""
    return hmac.new((secret or "").encode(), f"{PROTOCOL} job {job}".encode(), hashlib.sha256).digest()


def job_tag(job: str) -> str:
    """A short public digest of ``job``, written beside a signed address: a value from another job is
    told apart from a forged one (it proves nothing: the MAC does)."""
    return hashlib.sha256(job.encode()).hexdigest()[:_TAG_HEX]


def address_text(address: Endpoint) -> str:
    """``host|port``: how an address is written in the store and in every proof."""
    return f"{address[0]}|{address[1]}"


def parse_address(text: str) -> Endpoint | None:
    """(host, port) from ``host|port``, or None when it is not one."""
    host, sep, port = text.rpartition("|")
    if not sep or not re.fullmatch(_HOST.decode(), host) or not re.fullmatch(_PORT.decode(), port) or int(port) > 65535:
        return None
    return host, int(port)


def proof(key: bytes, role: str, dialer: int, listener: int, nonces: tuple[str, str], ids: tuple[str, str],
          dialled: str, dialer_listens: str = "") -> str:  # fmt: skip
    """HMAC-SHA256 (hex) that ``role`` of this connection holds ``key``.

    ``nonces`` and ``ids`` are (the dialer's, the listener's); ``dialled`` the listener's address
    as the dialer dialled it (the listener: its own advertised address); ``dialer_listens`` the
    dialer's listener address as its HELLO gave it (empty for a PROBE).
    """
    message = f"{PROTOCOL} {role} {dialer} {listener} {nonces[0]} {nonces[1]} {ids[0]} {ids[1]} {dialled} {dialer_listens}"
    return hmac.new(key, message.encode(), hashlib.sha256).hexdigest()


def proof_matches(expected: str, given: bytes) -> bool:
    """Constant-time comparison of a proof or MAC received with the one expected."""
    return hmac.compare_digest(expected.encode(), given)


def link_keys(key: bytes, dialer: int, listener: int, nonces: tuple[str, str], dialled: str) -> tuple[bytes, bytes]:
    """The MAC keys of one link: (dialer to listener, listener to dialer)."""
    base = hmac.new(key, f"{PROTOCOL} link {dialer} {listener} {nonces[0]} {nonces[1]} {dialled}".encode(), hashlib.sha256)
    return (hmac.new(base.digest(), b"dialer", hashlib.sha256).digest(),
            hmac.new(base.digest(), b"listener", hashlib.sha256).digest())  # fmt: skip


class Sealer:
    """Frames the messages of one direction of a link: ``<body> <mac>\\n``, numbered implicitly."""

    def __init__(self, key: bytes) -> None:
        self._key = key
        self.sequence = 0

    def seal(self, body: bytes) -> bytes:
        """The line that carries ``body`` (one line, no newline in it) as the next message."""
        mac = _mac(self._key, self.sequence, body)
        self.sequence += 1
        return body + b" " + mac + b"\n"


class Opener:
    """Checks the messages of one direction of a link, in order."""

    def __init__(self, key: bytes) -> None:
        self._key = key
        self.sequence = 0

    def open(self, line: bytes) -> bytes | None:
        """The body of ``line`` (without its newline) if its MAC is the next message's; None if not."""
        body, sep, mac = line.rpartition(b" ")
        if not sep or len(mac) != _MAC_HEX or not proof_matches(_mac(self._key, self.sequence, body).decode(), mac):
            return None
        self.sequence += 1
        return body


def _mac(key: bytes, sequence: int, body: bytes) -> bytes:
    return hmac.new(key, sequence.to_bytes(8, "big") + body, hashlib.sha256).hexdigest()[:_MAC_HEX].encode()


def sign_address(key: bytes, rank: int, address: Endpoint, job: str) -> str:
    """What a rank writes to the store: ``host|port|tag|mac``, the job's tag (:func:`job_tag`) and the
    MAC (under the job key) over the rank, the address and the tag."""
    text = f"{address_text(address)}|{job_tag(job)}"
    return f"{text}|{_address_mac(key, rank, text)}"


def verify_address(key: bytes, rank: int, value: str, job: str) -> tuple[Endpoint | None, str]:
    """The address in a store value written by :func:`sign_address` for ``rank`` of this job, or None and
    why not: ``"another job"`` (the value names another job's tag), ``"forged"`` (no valid MAC, or malformed)."""
    text, sep, mac = value.rpartition("|")
    address_part, tag_sep, tag = text.rpartition("|")
    if not sep or not tag_sep:
        return None, "forged"
    if tag != job_tag(job):
        return None, "another job"
    if not proof_matches(_address_mac(key, rank, text), mac.encode()):
        return None, "forged"
    return parse_address(address_part), ""


def _address_mac(key: bytes, rank: int, text: str) -> str:
    return hmac.new(key, f"{PROTOCOL} addr {rank} {text}".encode(), hashlib.sha256).hexdigest()


def parse_endpoints(data: bytes) -> frozenset[Endpoint] | None:
    """The endpoints of an ``E`` message, or None when it is not a valid list of (host, port)."""
    if len(data) > MAX_LINE:
        return None
    try:
        value = json.loads(data, parse_float=_reject, parse_constant=_reject)
    except (ValueError, RecursionError):
        return None
    if not isinstance(value, list) or len(value) > _MAX_ENDPOINTS:
        return None
    found = set()
    for item in value:
        if not isinstance(item, list) or len(item) != 2:
            return None
        host, port = item
        if not isinstance(host, str) or not 0 < len(host) <= 255 or not host.isascii():
            return None
        if type(port) is not int or not 0 < port < 65536:
            return None
        found.add((host, port))
    return frozenset(found)


def _reject(text: str) -> Any:
    raise ValueError(f"not a port: {text[:20]}")
