"""A delay line for one node's link where the kernel has no netem: frames held a set time, some dropped.

``--nodes`` puts each node's link on a bridge in a hub namespace (:mod:`torch_dist_check.nodes.namespaces`). To
make node N's link slow and lossy without the kernel's ``sch_netem``, the hub takes N's switch port
(``tdchN``, the hub's end of N's veth) off the bridge and puts a TAP device in its place; this
process, run in the hub, carries every frame between the two: what the bridge sends to the TAP goes
out of the port to node N, what node N sends arrives on the port (read with a packet socket) and goes
into the TAP, so to the bridge. Each frame is held ``--delay-ms`` and dropped with the chance
``--loss-pct``, each way, as netem would on both ends of the link. Frames keep their order.

It is a wire, not a router: Ethernet frames, MAC addresses and ARP pass unchanged, so no node sees a
change but the delay and the loss. Both ends carry the kernel's virtio-net header (``IFF_VNET_HDR``,
``PACKET_VNET_HDR``), so TCP's large segments (GSO) and their unfinished checksums pass through as
they came, as they do through a veth; a loss drops such a segment whole, as netem does.

Standard library only; Linux only; needs ``/dev/net/tun`` and a packet socket in the hub (root, or a
user namespace whose kernel lets it open the TUN device). It prints ``ready`` on stdout once both ends
are open, and runs until it is killed; the TAP device goes with it. ``--probe`` opens both and exits
(``nodes.delayline_reason``).
"""

from __future__ import annotations

import argparse
import collections
import fcntl
import os
import random
import select
import socket
import struct
import sys
import time

# <linux/if_tun.h>
TUNSETIFF = 0x400454CA
TUNSETOFFLOAD = 0x400454D0
IFF_TAP = 0x0002
IFF_NO_PI = 0x1000
IFF_VNET_HDR = 0x4000
TUN_F_CSUM, TUN_F_TSO4, TUN_F_TSO6 = 0x01, 0x02, 0x04
# <linux/if_packet.h>, <linux/if_ether.h>
SOL_PACKET = 263
PACKET_VNET_HDR = 15
PACKET_OUTGOING = 4
ETH_P_ALL = 0x0003
SO_RCVBUFFORCE = 33
# A GSO frame is at most 64 KiB of IP, plus the Ethernet and virtio-net headers.
MAX_FRAME = 65536 + 64
# Frames taken from one end before the other end and the due frames get their turn.
BURST = 64


def open_tap(name: str) -> int:
    """A TAP device ``name`` (non-blocking fd) whose frames carry the virtio-net header."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    try:
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH22x", name.encode(), IFF_TAP | IFF_NO_PI | IFF_VNET_HDR))
        # Large segments and partial checksums from the bridge, as the port would take them; without
        # it the kernel segments them first, which is slower but the same on the wire.
        try:
            fcntl.ioctl(fd, TUNSETOFFLOAD, TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6)
        except OSError:
            pass
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_port(name: str) -> socket.socket:
    """A packet socket on the link ``name``: every frame that arrives there, with the virtio-net header."""
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    try:
        sock.setsockopt(SOL_PACKET, PACKET_VNET_HDR, 1)
        try:  # room for a burst while this process is not running
            sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 16 << 20)
        except OSError:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 20)
        sock.bind((name, ETH_P_ALL))
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


class Line:
    """Both directions of the delay line: each a queue of (due time, frame), in arrival order."""

    def __init__(self, tap: int, port: socket.socket, delay_s: float, loss: float, rng: random.Random) -> None:
        self.tap, self.port, self.delay_s, self.loss, self.rng = tap, port, delay_s, loss, rng
        self.to_node: collections.deque[tuple[float, bytes]] = collections.deque()
        self.to_bridge: collections.deque[tuple[float, bytes]] = collections.deque()
        self.carried = self.dropped = 0

    def _take(self, frame: bytes, queue: collections.deque[tuple[float, bytes]]) -> None:
        if self.loss and self.rng.random() < self.loss:
            self.dropped += 1
        else:
            queue.append((time.monotonic() + self.delay_s, frame))

    def read_tap(self) -> None:
        for _ in range(BURST):
            try:
                frame = os.read(self.tap, MAX_FRAME)
            except BlockingIOError:
                return
            self._take(frame, self.to_node)

    def read_port(self) -> None:
        for _ in range(BURST):
            try:
                frame, address = self.port.recvfrom(MAX_FRAME)
            except BlockingIOError:
                return
            if address[2] != PACKET_OUTGOING:  # what this process itself sent to the node
                self._take(frame, self.to_bridge)

    def send_due(self) -> float | None:
        """Send every frame whose time has come; the seconds until the next one is due (None: none held)."""
        now = time.monotonic()
        for queue, send in ((self.to_node, self.port.send), (self.to_bridge, lambda f: os.write(self.tap, f))):
            while queue and queue[0][0] <= now:
                frame = queue.popleft()[1]
                try:
                    send(frame)
                    self.carried += 1
                except OSError:  # a full queue or a frame the far end refuses: lost, as on a wire
                    self.dropped += 1
        due = [q[0][0] for q in (self.to_node, self.to_bridge) if q]
        return max(0.0, min(due) - time.monotonic()) if due else None

    def run(self) -> None:
        poller = select.poll()
        poller.register(self.tap, select.POLLIN)
        poller.register(self.port.fileno(), select.POLLIN)
        while True:
            wait = self.send_due()
            # poll's unit is the millisecond: round up, so a frame is never sent early.
            for fd, _ in poller.poll(-1 if wait is None else int(wait * 1000) + 1):
                if fd == self.tap:
                    self.read_tap()
                else:
                    self.read_port()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="delayline", description=__doc__.split("\n\n")[0])
    p.add_argument("--port", required=True, help="the link to the node (the hub's end of its veth), off the bridge")
    p.add_argument("--tap", required=True, help="the name of the TAP device to make (it takes the port's place on the bridge)")
    p.add_argument("--delay-ms", type=float, default=0.0, help="each frame is held this long, each way")
    p.add_argument("--loss-pct", type=float, default=0.0, help="the share of frames dropped at random, each way")
    p.add_argument("--seed", type=int, default=None, help="the random drops' seed (default: from the system)")
    p.add_argument("--probe", action="store_true", help="open both ends and exit")
    args = p.parse_args(argv)
    if args.delay_ms < 0 or not 0 <= args.loss_pct <= 100:
        p.error("--delay-ms must be >= 0 and --loss-pct within 0-100")
    try:
        tap = open_tap(args.tap)
        port = open_port(args.port)
    except OSError as e:
        print(f"delayline: cannot open the TAP device {args.tap} and a packet socket on {args.port}: {e}", file=sys.stderr)
        return 1
    if args.probe:
        return 0
    print("ready", flush=True)
    Line(tap, port, args.delay_ms / 1000, args.loss_pct / 100, random.Random(args.seed)).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
