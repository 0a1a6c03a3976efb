"""The watcher's settings: heartbeat interval and timeout, connect timeout, advertised address.

Read from the environment (``TORCH_PEER_WATCHER_*``) or given in code; validated once, here, with
errors that name the variable and what to change.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

# Auto-start switch read by torch_peer_watcher.autostart ("1" on; unset, "0" or empty off).
ENABLE_ENV = "TORCH_PEER_WATCHER"
INTERVAL_ENV = "TORCH_PEER_WATCHER_INTERVAL_S"
TIMEOUT_ENV = "TORCH_PEER_WATCHER_TIMEOUT_S"
CONNECT_TIMEOUT_ENV = "TORCH_PEER_WATCHER_CONNECT_TIMEOUT_S"
HOST_ENV = "TORCH_PEER_WATCHER_HOST"


class WatcherConfigError(ValueError):
    """A setting of the watcher is invalid; the message says which and what to change."""


@dataclass(frozen=True)
class WatcherSettings:
    """How the watcher judges its peers (seconds).

    ``interval_s``: a heartbeat goes to every peer this often. ``timeout_s``: a peer silent this long
    (no heartbeat, no data) is declared dead; 0 turns the heartbeat verdict off (only a closed
    connection counts). ``connect_timeout_s``: how long :meth:`PeerWatcher.watch` waits for its
    peers' connections. ``host``: the address peers connect to (None: the interface that reaches
    the rendezvous store).
    """

    interval_s: float = 1.0
    timeout_s: float = 5.0
    connect_timeout_s: float = 120.0
    host: str | None = None

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
        )


def enabled(env: Mapping[str, str] | None = None) -> bool:
    """True when the auto-start switch is on (``TORCH_PEER_WATCHER=1``)."""
    env = os.environ if env is None else env
    value = env.get(ENABLE_ENV, "").strip()
    if value in ("", "0"):
        return False
    if value == "1":
        return True
    raise WatcherConfigError(f"{ENABLE_ENV}={value!r}: expected 1 (on) or 0 (off)")


def _seconds(env: Mapping[str, str], name: str, default: float) -> float:
    text = env.get(name, "").strip()
    if not text:
        return default
    try:
        return float(text)
    except ValueError:
        raise WatcherConfigError(f"{name}={text!r} is not a number of seconds") from None
