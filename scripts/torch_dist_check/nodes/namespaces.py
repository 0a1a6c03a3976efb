"""Several nodes on one host: each node a network namespace with its own address, joined by a bridge.

``--nodes N`` runs each node's ranks in a network namespace of its own. Every node has one
interface, :data:`IFNAME`, with the address ``10.99.0.<n+1>/24``; its other end sits on a bridge in a
hub namespace, as a switch port would. Nothing of this touches the host's own network: the bridge,
the links and the addresses exist only inside namespaces made here, so the faults between nodes
(:meth:`NodeNetwork.cut`, :meth:`NodeNetwork.degrade`) never reach an address of the real host.

No namespace is named (nothing in ``/var/run/netns``): each lives while a process is in it. A
holder process (``cat`` on a pipe from the process that made the namespaces) keeps it; the pipe
closes when that process ends, however it ends (SIGKILL included), and so the holder exits. The
ranks entered into a node are started with ``setpriv --pdeathsig KILL``, so they end with the
process that started them. The kernel sends that signal only for a parent that dies after it was
asked to; a parent killed while the rank was still starting (before ``setpriv`` asked) would leave
the rank running for good, so the rank, once armed, checks that its parent is still the process
that made its command line (:data:`_PARENT_CHECK`) and ends if not. With the holders and the ranks
gone, the kernel deletes the namespaces
and every link and address in them. Without root, the namespaces live in a user namespace made
with ``unshare --user --map-root-user`` (where the kernel allows it).

Tools: ``unshare``, ``nsenter`` and ``setpriv`` (util-linux) and ``ip`` (iproute2); ``tc`` with the
kernel's ``sch_netem`` for a lossy or slow link. Where the kernel has no netem: a delay line in user
space (:mod:`torch_dist_check.nodes.delayline`, a TAP device in place of the node's switch port; needs
``/dev/net/tun``) for a slow link, and ``nft`` (nftables) with ``nf_tables`` for loss alone.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

# The same interface name on every node, as a cluster's nodes share one (NCCL_SOCKET_IFNAME=tdc0).
IFNAME = "tdc0"
BRIDGE = "tdcbr0"
# Only inside the namespaces made here: never an address of the host's network.
SUBNET_PREFIX = "10.99.0"
PREFIX_LEN = 24
MAX_NODES = 200
# The JSON of the node network, for rank 0's peer-loss workers (they start processes on other nodes).
NETWORK_ENV = "TORCH_DIST_CHECK_NODE_NETWORK"
# This process's node index and address.
NODE_ENV = "TORCH_DIST_CHECK_NODE"
NODE_ADDR_ENV = "TORCH_DIST_CHECK_NODE_ADDR"
TOOLS = ("unshare", "nsenter", "setpriv", "ip")
# How a link is made lossy (NodeNetwork.degrade): tc's netem (loss and delay), a delay line in user
# space (loss and delay, where the kernel has no netem), or nftables (loss alone).
NETEM, DELAYLINE, NFTABLES = "netem", "delay line", "nftables"
NFT_TABLE = "tdcloss"
DELAYLINE_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "delayline.py")
# The delay lines this process runs, by (hub, node): NodeNetwork is plain data, so they are kept here.
_delay_lines: dict[tuple[int, int], subprocess.Popen[str]] = {}

# Run after ``setpriv --pdeathsig KILL`` has armed the signal: ``$0`` is the pid of the process that
# made the command line, ``$PPID`` the parent this shell found at its start. If they differ, that
# parent died before the signal was armed (the rank was reparented) and no signal will ever come:
# the rank must not start. From then on the kernel kills it with its parent.
_PARENT_CHECK = (
    'if [ "$PPID" != "$0" ]; then echo "torch_dist_check: the process that started this rank ($0) is gone;'
    ' not starting $1" >&2; exit 1; fi; exec "$@"'
)
# Where Debian and others keep tc (and some keep ip): not on a user's PATH, nor on a clean one (env -i).
SYSTEM_SBIN = "/usr/local/sbin:/usr/sbin:/sbin"


def tool(name: str) -> str | None:
    """The path of the program ``name``: on PATH, else in the system's sbin folders; None if neither has it."""
    return shutil.which(name) or shutil.which(name, path=SYSTEM_SBIN)


class NodesUnavailable(Exception):
    """Namespaces cannot be made here (no privilege, a tool missing); the message says which."""


class NodeError(RuntimeError):
    """A command that sets up or changes the node network failed."""


@dataclass(frozen=True)
class Node:
    """One node: the process that holds its namespace, its address and its NCCL host id."""

    index: int
    holder_pid: int
    address: str
    hostid: str

    def env(self) -> dict[str, str]:
        """What a process of this node needs: its interface for gloo and NCCL, its host id, its address."""
        return {
            "GLOO_SOCKET_IFNAME": IFNAME,
            "NCCL_SOCKET_IFNAME": IFNAME,
            "NCCL_HOSTID": self.hostid,
            NODE_ENV: str(self.index),
            NODE_ADDR_ENV: self.address,
        }


@dataclass(frozen=True)
class NodeNetwork:
    """The nodes and the hub that joins them; plain data, passed to other processes as JSON."""

    hub_pid: int
    nodes: tuple[Node, ...]
    userns: bool

    def to_json(self) -> str:
        """The network as one line of JSON (:data:`NETWORK_ENV`)."""
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> NodeNetwork:
        """The network that :meth:`to_json` wrote."""
        data = json.loads(text)
        return cls(data["hub_pid"], tuple(Node(**n) for n in data["nodes"]), data["userns"])

    def _enter(self, pid: int, argv: Sequence[str]) -> list[str]:
        user = ["--user", "--preserve-credentials"] if self.userns else []
        return ["nsenter", "--target", str(pid), "--net", *user, "--", *argv]

    def node_argv(self, node: int, argv: Sequence[str]) -> list[str]:
        """``argv`` run on node ``node``; it is killed when the process that starts it ends.

        The command line belongs to this process: started by any other (or after this one died), it
        ends at once, without running ``argv``.
        """
        return self._enter(self.nodes[node].holder_pid, _armed(argv))

    def node_start(self, node: int, argv: Sequence[str]) -> tuple[list[str], dict[str, Any]]:
        """(command, keywords) for :func:`torch_dist_check.harness.forkserver.start` that run ``argv`` on
        node ``node``: forked into the node's namespace, with :meth:`node_argv` where it is not forked.
        Not root (a user namespace to enter too), always :meth:`node_argv`."""
        wrapped = self.node_argv(node, argv)
        if self.userns:
            return wrapped, {}
        return list(argv), {"netns": self.nodes[node].holder_pid, "fallback": wrapped}

    def hub_link(self, node: int) -> str:
        """The hub's end of node ``node``'s link (its switch port)."""
        return f"tdch{node}"

    def delay_link(self, node: int) -> str:
        """The TAP device that takes node ``node``'s port on the bridge while its delay line runs."""
        return f"tdcd{node}"

    def cut(self, node: int) -> None:
        """Take node ``node``'s link off the bridge: both ends stay up, and what is sent is lost in silence,
        as when a switch port or a cable fails (no RST, no ICMP)."""
        _run(self._enter(self.hub_pid, [_program("ip"), "link", "set", self.hub_link(node), "nomaster"]))

    def heal(self, node: int) -> None:
        """Put node ``node``'s link back on the bridge."""
        _run(self._enter(self.hub_pid, [_program("ip"), "link", "set", self.hub_link(node), "master", BRIDGE]))

    def drop_sent_by(self, node: int) -> None:
        """Lose in silence everything node ``node`` sends (dropped where it arrives, in every other node, as a
        wire loses it); what it receives still arrives. Needs nftables (:func:`nftables_reason`)."""
        for other in self.nodes:
            if other.index != node:
                _run(self._enter(other.holder_pid, [_program("nft"), "-f", "-"]), _nft_drop_rules(self.nodes[node].address))

    def undrop_sent_by(self, node: int) -> None:
        """Take :meth:`drop_sent_by`'s rules off again."""
        for other in self.nodes:
            if other.index != node:
                _run(self._enter(other.holder_pid, [_program("nft"), "delete", "table", "inet", NFT_TABLE]))

    def degrade(self, node: int, loss_pct: float, delay_ms: float, method: str = NETEM) -> None:
        """Make node ``node``'s link lossy (and slow) both ways: netem on each end; where the kernel has
        no netem (:func:`degrade_method`), a delay line in place of its switch port, or, for loss alone,
        nftables rules in the node that drop that share of what comes in and of what goes out at random."""
        if method == DELAYLINE:
            self._start_delay_line(node, loss_pct, delay_ms)
            return
        if method == NFTABLES:
            if delay_ms:
                raise NodeError(f"nftables drops packets but cannot delay them: {delay_ms:g} ms needs netem")
            # Dropped where they arrive, as a wire loses them: into this node, and from it into every
            # other node (a drop on the way out would fail the sender's send with EPERM instead).
            for other in self.nodes:
                source = None if other.index == node else self.nodes[node].address
                _run(self._enter(other.holder_pid, [_program("nft"), "-f", "-"]), _nft_loss_rules(loss_pct, source))
            return
        rule = ["root", "netem", "loss", f"{loss_pct}%", "delay", f"{delay_ms}ms"]
        _run(self._enter(self.hub_pid, [_program("tc"), "qdisc", "replace", "dev", self.hub_link(node), *rule]))
        _run(self._enter(self.nodes[node].holder_pid, [_program("tc"), "qdisc", "replace", "dev", IFNAME, *rule]))

    def undegrade(self, node: int, method: str = NETEM) -> None:
        """Take the lossy and slow rules off node ``node``'s link."""
        if method == DELAYLINE:
            self._stop_delay_line(node)
            return
        if method == NFTABLES:
            for other in self.nodes:
                _run(self._enter(other.holder_pid, [_program("nft"), "delete", "table", "inet", NFT_TABLE]))
            return
        _run(self._enter(self.hub_pid, [_program("tc"), "qdisc", "del", "dev", self.hub_link(node), "root"]))
        _run(self._enter(self.nodes[node].holder_pid, [_program("tc"), "qdisc", "del", "dev", IFNAME, "root"]))

    def _start_delay_line(self, node: int, loss_pct: float, delay_ms: float) -> None:
        """Start the delay line in the hub, then swap it in for the port: the port leaves the bridge
        first, so no frame is ever carried twice (the frames of the few microseconds between are lost)."""
        if (self.hub_pid, node) in _delay_lines:
            raise NodeError(f"node {node}'s link already has a delay line")
        port, tap = self.hub_link(node), self.delay_link(node)
        argv = [sys.executable, DELAYLINE_SCRIPT, "--port", port, "--tap", tap, "--delay-ms", f"{delay_ms:g}", "--loss-pct", f"{loss_pct:g}"]
        proc = subprocess.Popen(self._enter(self.hub_pid, _armed(argv)), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert proc.stdout is not None and proc.stderr is not None
        ready = select.select([proc.stdout], [], [], 10)[0] and proc.stdout.readline().strip() == "ready"
        if not ready:
            proc.kill()
            _, err = proc.communicate()
            raise NodeError(f"the delay line for node {node} did not start: {err.strip()[:300] or 'no ready within 10 s'}")
        _delay_lines[(self.hub_pid, node)] = proc
        try:
            _run(self._enter(self.hub_pid, [_program("ip"), "-batch", "-"]),
                 f"link set {port} nomaster\nlink set {tap} master {BRIDGE} up\n")  # fmt: skip
        except NodeError:
            self._stop_delay_line(node)
            raise

    def _stop_delay_line(self, node: int) -> None:
        """Put the port back on the bridge and end the delay line (its TAP device goes with it)."""
        proc = _delay_lines.pop((self.hub_pid, node), None)
        try:
            _run(self._enter(self.hub_pid, [_program("ip"), "link", "set", self.hub_link(node), "master", BRIDGE]))
        finally:
            if proc is not None:
                proc.kill()
                proc.communicate()

    def namespace_ids(self) -> set[str]:
        """The kernel's ids of every namespace of the network (``net:[inode]``), to prove they are gone."""
        ids = set()
        for pid in (self.hub_pid, *(n.holder_pid for n in self.nodes)):
            try:
                ids.add(os.readlink(f"/proc/{pid}/ns/net"))
            except OSError:
                continue
        return ids


def _program(name: str) -> str:
    """``name`` as a path where :func:`tool` finds it (nsenter runs it with the caller's PATH)."""
    return tool(name) or name


def _armed(argv: Sequence[str]) -> list[str]:
    """``argv``, killed when this process ends; started by any other process (or after this one died),
    it ends at once without running."""
    return ["setpriv", "--pdeathsig", "KILL", "--", "sh", "-c", _PARENT_CHECK, str(os.getpid()), *argv]


def _run(argv: Sequence[str], stdin: str | None = None) -> None:
    done = subprocess.run(list(argv), input=stdin, text=True, capture_output=True, check=False)
    if done.returncode != 0:
        raise NodeError(f"{' '.join(argv[-6:])} failed (exit {done.returncode}): {done.stderr.strip()[:300]}")


def _unshare_argv(userns: bool) -> list[str]:
    return ["unshare", "--user", "--map-root-user", "--net"] if userns else ["unshare", "--net"]


def unavailable_reason() -> str | None:
    """Why node namespaces cannot be made here, or None if they can."""
    missing = [name for name in TOOLS if tool(name) is None]
    if missing:
        return f"{', '.join(missing)} not found (util-linux for unshare/nsenter/setpriv, iproute2 for ip)"
    userns = os.geteuid() != 0
    probe = subprocess.run([*_unshare_argv(userns), "true"], capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        how = "unshare --user --map-root-user --net (not root)" if userns else "unshare --net"
        return f"cannot make a network namespace: {how} failed: {probe.stderr.strip()[:200]}"
    return None


def _nft_loss_rules(loss_pct: float, source: str | None = None) -> str:
    """An nftables table that drops, at random, ``loss_pct`` percent of the packets arriving on the node
    link (only those from ``source`` if given)."""
    per_10k = round(loss_pct * 100)
    match = f"iifname \"{IFNAME}\"" + (f" ip saddr {source}" if source else "")
    return (
        f"table inet {NFT_TABLE} {{\n"
        f"  chain in {{ type filter hook input priority 0; policy accept; {match} numgen random mod 10000 < {per_10k} drop; }}\n"
        "}\n"
    )


def _nft_drop_rules(source: str) -> str:
    """An nftables table that drops every packet from ``source`` arriving on the node link."""
    return (
        f"table inet {NFT_TABLE} {{\n"
        f"  chain in {{ type filter hook input priority 0; policy accept; iifname \"{IFNAME}\" ip saddr {source} drop; }}\n"
        "}\n"
    )


def nftables_reason(network: NodeNetwork) -> str | None:
    """Why packets cannot be dropped at random with nftables here (no nft, no nf_tables), or None."""
    if tool("nft") is None:
        return f"nft not found on PATH or in {SYSTEM_SBIN} (Debian's nftables)"
    # In the hub, which has no tdc0: the rules load but match nothing, and the table goes at once.
    argv = network._enter(network.hub_pid, ["sh", "-c", f"{_program('nft')} -f - && {_program('nft')} delete table inet {NFT_TABLE}"])
    done = subprocess.run(argv, input=_nft_loss_rules(1.0), capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return f"nft could not load a random-drop rule (nf_tables with numgen): {done.stderr.strip()[:160]}"
    return None


def degrade_method(network: NodeNetwork, delay_ms: float) -> tuple[str | None, str | None]:
    """How a link is made lossy here: (:data:`NETEM`, None); where the kernel has no netem,
    (:data:`DELAYLINE`, None) for a delay, or (:data:`NFTABLES`, None) for loss alone (``delay_ms`` 0);
    or (None, why it cannot be)."""
    no_netem = netem_reason(network)
    if no_netem is None:
        return NETEM, None
    if delay_ms:
        no_line = delayline_reason(network)
        if no_line is None:
            return DELAYLINE, None
        return None, f"{no_netem}; and no delay line: {no_line} (loss alone, --peerloss-link-delay 0, is made with nftables)"
    no_nft = nftables_reason(network)
    if no_nft is None:
        return NFTABLES, None
    return None, f"{no_netem}; and for loss alone: {no_nft}"


def delayline_reason(network: NodeNetwork) -> str | None:
    """Why no delay line can run in the hub (no /dev/net/tun, no packet socket), or None."""
    # On a scratch link in the hub, so the probe never changes a node's link.
    probe = f"{sys.executable} {DELAYLINE_SCRIPT} --probe --port tdcprobe --tap tdcprobe2"
    argv = network._enter(network.hub_pid, ["sh", "-c", f"{_program('ip')} link add tdcprobe type veth peer name tdcprobe1 && "
                          f"{probe}; rc=$?; {_program('ip')} link del tdcprobe; exit $rc"])  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return done.stderr.strip()[:200] or f"the probe failed (exit {done.returncode})"
    return None


def netem_reason(network: NodeNetwork) -> str | None:
    """Why a link cannot be made lossy here (no tc, no sch_netem in the kernel), or None."""
    if tool("tc") is None:
        return f"tc not found on PATH or in {SYSTEM_SBIN} (iproute2)"
    # A scratch link in the hub, so the probe never changes a node's link.
    argv = network._enter(network.hub_pid, ["sh", "-c", f"{_program('ip')} link add tdcprobe type veth peer name tdcprobe1 && "
                          f"{_program('tc')} qdisc add dev tdcprobe root netem delay 1ms; rc=$?; {_program('ip')} link del tdcprobe; exit $rc"])  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return f"the kernel has no netem queueing discipline (sch_netem): {done.stderr.strip()[:160]}"
    return None


class NodeSet:
    """Make ``count`` nodes; :meth:`close` (or leaving the ``with`` block) ends them.

    Raises :class:`NodesUnavailable` when namespaces cannot be made here.
    """

    def __init__(self, count: int, label: str = "tdc") -> None:
        if not 1 <= count <= MAX_NODES:
            raise ValueError(f"between 1 and {MAX_NODES} nodes, not {count}")
        reason = unavailable_reason()
        if reason:
            raise NodesUnavailable(reason)
        self.userns = os.geteuid() != 0
        self._holders: list[subprocess.Popen[bytes]] = []
        try:
            self.network = self._make(count, label)
        except BaseException:
            self.close()
            raise

    def _hold(self, argv: Sequence[str]) -> subprocess.Popen[bytes]:
        """A holder: ``cat`` on a pipe from this process, so it ends when this process does."""
        proc = subprocess.Popen([*argv, "cat"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self._holders.append(proc)
        mine = os.readlink("/proc/self/ns/net")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise NodeError(f"{' '.join(argv)} ended at once: {proc.stderr.read().decode(errors='replace').strip()[:300]}")  # type: ignore[union-attr]
            try:
                # unshare has made the namespace and become cat once its namespace differs from ours.
                if os.readlink(f"/proc/{proc.pid}/ns/net") != mine and _comm(proc.pid) == "cat":
                    return proc
            except OSError:
                pass
            time.sleep(0.002)
        raise NodeError(f"{' '.join(argv)} did not make its namespace within 10 s")

    def _make(self, count: int, label: str) -> NodeNetwork:
        hub = self._hold([*_unshare_argv(self.userns), "--"])
        empty = NodeNetwork(hub.pid, (), self.userns)
        nodes = []
        for index in range(count):
            # Inside the hub's user namespace (if any), so the hub may move a link into the node.
            prefix = ["nsenter", "--target", str(hub.pid), "--user", "--preserve-credentials", "--"] if self.userns else []
            holder = self._hold([*prefix, "unshare", "--net", "--"])
            nodes.append(Node(index, holder.pid, f"{SUBNET_PREFIX}.{index + 1}", f"{label}-node{index}"))
        hub_lines = [f"link add {BRIDGE} type bridge", f"link set {BRIDGE} up"]
        for node in nodes:
            port = empty.hub_link(node.index)
            hub_lines += [f"link add {port} type veth peer name {IFNAME} netns {node.holder_pid}",
                          f"link set {port} master {BRIDGE} up"]  # fmt: skip
        _run(empty._enter(hub.pid, [_program("ip"), "-batch", "-"]), "\n".join(hub_lines) + "\n")
        for node in nodes:
            lines = ["link set lo up", f"addr add {node.address}/{PREFIX_LEN} dev {IFNAME}", f"link set {IFNAME} up"]
            _run(empty._enter(node.holder_pid, [_program("ip"), "-batch", "-"]), "\n".join(lines) + "\n")
        return NodeNetwork(hub.pid, tuple(nodes), self.userns)

    def close(self) -> None:
        """End the holders; the namespaces go with the last process in them."""
        for proc in self._holders:
            if proc.stdin is not None:
                proc.stdin.close()
            if proc.poll() is None:
                proc.kill()
        for proc in self._holders:
            proc.wait()
            if proc.stderr is not None:
                proc.stderr.close()
        self._holders.clear()

    def __enter__(self) -> NodeNetwork:
        return self.network

    def __exit__(self, *exc: object) -> None:
        self.close()


def _comm(pid: int) -> str:
    with open(f"/proc/{pid}/comm") as f:
        return f.read().strip()


def processes_in(namespace_ids: set[str]) -> list[int]:
    """Every process still in one of ``namespace_ids`` (empty once the namespaces are gone)."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if os.readlink(f"/proc/{name}/ns/net") in namespace_ids:
                found.append(int(name))
        except OSError:
            continue
    return found


def network_from_env(env: Mapping[str, str]) -> NodeNetwork | None:
    """The node network this process was started in (``--nodes``), or None."""
    text = env.get(NETWORK_ENV)
    return NodeNetwork.from_json(text) if text else None
