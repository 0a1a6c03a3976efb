"""The watcher's settings: heartbeat interval and timeout, connect timeout, advertised address, secret.

Read from the environment (``TORCH_PEER_WATCHER_*``) or given in code; validated once, here, with
errors that name the variable and what to change.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field

from torch_peer_watcher.losses import WatcherError

# Auto-start switch read by torch_peer_watcher.autostart ("1" on; unset, "0" or empty off).
ENABLE_ENV = "TORCH_PEER_WATCHER"
INTERVAL_ENV = "TORCH_PEER_WATCHER_INTERVAL_S"
TIMEOUT_ENV = "TORCH_PEER_WATCHER_TIMEOUT_S"
CONNECT_TIMEOUT_ENV = "TORCH_PEER_WATCHER_CONNECT_TIMEOUT_S"
HOST_ENV = "TORCH_PEER_WATCHER_HOST"
# The secret every rank of a job shares (never written to the store): in the variable, or in a file
# only its owner can read, named by the other variable. The launcher (torchrun, srun, mpiexec)
# hands the environment to every rank.
SECRET_ENV = "TORCH_PEER_WATCHER_SECRET"
SECRET_FILE_ENV = "TORCH_PEER_WATCHER_SECRET_FILE"
# "1": wake the proxy threads of the NCCL communicators the watcher aborts (torch_peer_watcher.proxywake); "0":
# never; unset or empty: only where the loaded NCCL is a release the waker was proven on (proxywake.PROVEN_NCCL).
WAKE_NCCL_PROXY_ENV = "TORCH_PEER_WATCHER_WAKE_NCCL_PROXY"
MIN_SECRET_CHARS = 16
_MAKE_SECRET = "python3 -c 'import secrets; print(secrets.token_hex(32))'"


class WatcherConfigError(WatcherError, ValueError):
    """A setting of the watcher is invalid; the message says which and what to change.

    A :class:`WatcherError` (the watcher cannot set up) and a ``ValueError`` (a bad value).
    """


@dataclass(frozen=True)
class WatcherSettings:
    """How the watcher judges its peers (seconds).

    ``interval_s``: a heartbeat goes to every peer this often. ``timeout_s``: a peer silent this long
    (no heartbeat, no data) is declared dead; 0 turns the heartbeat verdict off (only a closed
    connection counts). A cut link that heals is tolerated (no verdict) when it heals before
    ``timeout_s`` minus the time since the last heartbeat (up to ``interval_s``) minus 0.3 s: always
    below timeout - interval - 0.3 s (from half the timeout, the silent peer is asked on new
    connections, which TCP's backed-off retransmissions do not hold back; docs/explain/peer-watcher.md,
    "Split brain"). ``connect_timeout_s``: how long :meth:`PeerWatcher.watch` waits for its
    peers' connections. ``host``: the address peers connect to (None: the interface that reaches
    the rendezvous store). ``secret``: the key the links authenticate with (HMAC-SHA256 over a
    challenge of both sides; by default from ``TORCH_PEER_WATCHER_SECRET(_FILE)``; None: no secret,
    any process that reaches the port can pose as a peer, see docs/explain/peer-watcher.md, "Security").
    ``wake_nccl_proxy``: wake the proxy threads of each NCCL communicator the watcher aborts, so that stock
    NCCL's abort does not wait out its proxy's 500 ms ``poll()`` (docs/explain/nccl-abort-wakeup.md); None (the
    default where the variable is unset): only where the NCCL the process loaded is a release the waker was
    proven on (:data:`torch_peer_watcher.proxywake.PROVEN_NCCL`).
    """

    interval_s: float = 1.0
    timeout_s: float = 5.0
    connect_timeout_s: float = 120.0
    host: str | None = None
    # The job's secret is a property of the launch, not of the code: settings made in code read it too.
    secret: str | None = field(default_factory=lambda: secret_from_env(os.environ), repr=False)
    # Like the secret, a property of the launch (the NCCL the job runs on): settings made in code read it too.
    wake_nccl_proxy: bool | None = field(default_factory=lambda: wake_nccl_proxy_from_env(os.environ))

    def __post_init__(self) -> None:
        if not self.interval_s > 0:
            raise WatcherConfigError(f"heartbeat interval must be > 0 s, got {self.interval_s}")
        if self.timeout_s < 0:
            raise WatcherConfigError(f"heartbeat timeout must be >= 0 s, got {self.timeout_s}")
        if self.timeout_s and self.timeout_s < 2 * self.interval_s:
            raise WatcherConfigError(
                f"heartbeat timeout {self.timeout_s} s is shorter than two intervals ({self.interval_s} s each): "
                "one late heartbeat would declare a live peer dead; raise the timeout or shorten the interval"
            )
        if not self.connect_timeout_s > 0:
            raise WatcherConfigError(f"connect timeout must be > 0 s, got {self.connect_timeout_s}")
        if self.secret is not None and len(self.secret) < MIN_SECRET_CHARS:
            raise WatcherConfigError(
                f"the watcher's secret has {len(self.secret)} characters, fewer than {MIN_SECRET_CHARS}: "
                f"make one with {_MAKE_SECRET}"
            )

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> WatcherSettings:
        """Settings from ``TORCH_PEER_WATCHER_*`` variables, defaults for those unset."""
        env = os.environ if env is None else env
        defaults = cls()
        return cls(
            interval_s=_seconds(env, INTERVAL_ENV, defaults.interval_s),
            timeout_s=_seconds(env, TIMEOUT_ENV, defaults.timeout_s),
            connect_timeout_s=_seconds(env, CONNECT_TIMEOUT_ENV, defaults.connect_timeout_s),
            host=env.get(HOST_ENV) or None,
            secret=secret_from_env(env),
            wake_nccl_proxy=wake_nccl_proxy_from_env(env),
        )


def secret_from_env(env: Mapping[str, str]) -> str | None:
    """The secret from ``TORCH_PEER_WATCHER_SECRET`` or the file ``TORCH_PEER_WATCHER_SECRET_FILE`` names.

    None when neither is set. A file must be a regular file of this user that nobody else can read
    or write (mode 0600 or stricter): a secret others can read protects nothing.
    """
    value = env.get(SECRET_ENV, "").strip()
    path = env.get(SECRET_FILE_ENV, "").strip()
    if value and path:
        raise WatcherConfigError(f"both {SECRET_ENV} and {SECRET_FILE_ENV} are set: set one of them")
    if value:
        if len(value) < MIN_SECRET_CHARS:
            raise WatcherConfigError(
                f"{SECRET_ENV} has {len(value)} characters, fewer than {MIN_SECRET_CHARS}: make one with {_MAKE_SECRET}"
            )
        return value
    if not path:
        return None
    try:
        # O_NONBLOCK: a FIFO put in the file's place (by anyone, in a directory others can write) would
        # block the open until a writer came; with it the open returns and the check below refuses it.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        raise WatcherConfigError(f"{SECRET_FILE_ENV}={path!r}: cannot open it ({exc.strerror or exc})") from None
    try:
        # Judged on the descriptor, before any file object is made of it: a directory opens too, and
        # Python's file object refuses it with IsADirectoryError, no error of the settings.
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            kind = ("a FIFO" if stat.S_ISFIFO(info.st_mode) else "a directory" if stat.S_ISDIR(info.st_mode)
                    else "a device" if stat.S_ISCHR(info.st_mode) or stat.S_ISBLK(info.st_mode) else "not a regular file")  # fmt: skip
            raise WatcherConfigError(
                f"{SECRET_FILE_ENV}={path!r} is {kind}, not a regular file: write the secret to a file of your own "
                f"(umask 077; {_MAKE_SECRET} > FILE)"
            )
        if info.st_uid != os.getuid():
            raise WatcherConfigError(f"{SECRET_FILE_ENV}={path!r} belongs to uid {info.st_uid}, not to this user ({os.getuid()})")
        if info.st_mode & 0o077:
            raise WatcherConfigError(
                f"{SECRET_FILE_ENV}={path!r} can be read or written by others (mode {stat.S_IMODE(info.st_mode):04o}): "
                f"chmod 600 {path}"
            )
        raw = os.read(fd, 4096)
    except OSError as exc:
        raise WatcherConfigError(f"{SECRET_FILE_ENV}={path!r}: cannot read it ({exc.strerror or exc})") from None
    finally:
        os.close(fd)
    try:
        text = raw.decode().strip()
    except UnicodeDecodeError:
        raise WatcherConfigError(f"{SECRET_FILE_ENV}={path!r} is not UTF-8 text") from None
    if len(text) < MIN_SECRET_CHARS:
        raise WatcherConfigError(
            f"{SECRET_FILE_ENV}={path!r} holds {len(text)} characters, fewer than {MIN_SECRET_CHARS}: "
            f"write one with {_MAKE_SECRET}"
        )
    return text


def enabled(env: Mapping[str, str] | None = None) -> bool:
    """True when the auto-start switch is on (``TORCH_PEER_WATCHER=1``)."""
    return _switch(os.environ if env is None else env, ENABLE_ENV)


def _switch(env: Mapping[str, str], name: str) -> bool:
    value = env.get(name, "").strip()
    if value in ("", "0"):
        return False
    if value == "1":
        return True
    raise WatcherConfigError(f"{name}={value!r}: expected 1 (on) or 0 (off)")


def wake_nccl_proxy_from_env(env: Mapping[str, str]) -> bool | None:
    """The proxy waker's setting (``TORCH_PEER_WATCHER_WAKE_NCCL_PROXY``): True, False, or None (its default)."""
    return _tristate(env, WAKE_NCCL_PROXY_ENV)


def _tristate(env: Mapping[str, str], name: str) -> bool | None:
    """1: True, 0: False, unset or empty: None (the setting's own default)."""
    value = env.get(name, "").strip()
    if value == "":
        return None
    if value in ("0", "1"):
        return value == "1"
    raise WatcherConfigError(
        f"{name}={value!r}: expected 1 (on), 0 (off), or unset (on for the NCCL releases it was proven on)"
    )


def _seconds(env: Mapping[str, str], name: str, default: float) -> float:
    text = env.get(name, "").strip()
    if not text:
        return default
    try:
        return float(text)
    except ValueError:
        raise WatcherConfigError(f"{name}={text!r} is not a number of seconds") from None
