"""A TCP port for a listener that another process will open (a store's MASTER_PORT), drawn where no other
socket of the machine can take it meanwhile.

A port read from a bind to port 0 comes from the kernel's ephemeral range, which the kernel also hands to
every outgoing connection and to every other bind to port 0 (NCCL's, gloo's and the stores' listeners).
Between the draw and the other process's bind, one of those could take it: on one GPU machine with four
suite runs at once, a launcher's store failed with EADDRINUSE in 1 of 60 runs. Ports below the ephemeral
range are never handed out by the kernel, so a port checked free there stays free unless another caller of
this function draws the same one (a chance of 1 in about 12,000 per pair at once).
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

# The kernel's default ephemeral range starts at 32768; ports under 20000 are left to services.
LOWEST = 20000
_draw = random.SystemRandom()


def ephemeral_start() -> int:
    """The first port of the kernel's ephemeral range (32768 where /proc does not say)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port no socket of this machine is bound to, below the ephemeral range."""
    high = ephemeral_start() - 1
    if high <= LOWEST:
        raise RuntimeError(f"the ephemeral port range starts at {high + 1}: no room below it for a test's port")
    for _ in range(200):
        port = _draw.randint(LOWEST, high)
        with socket.socket() as sock:
            try:
                sock.bind(("", port))  # every address, as a store binds
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port among 200 drawn in {LOWEST}-{high}")
