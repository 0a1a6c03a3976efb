"""Which GPU each process of a communicator uses, and how NCCL is told when processes share one.

NCCL refuses two ranks of one communicator on one GPU ("Duplicate GPU detected") unless it is told
how they share it. Two ways, chosen by what the run is meant to exercise:

- ``net`` (:data:`HOST_IDS`): each process gets its own ``NCCL_HOSTID``. NCCL then believes every
  process is on a host of its own and connects them through its network (Socket, IB or a net
  plugin): the placement for network tests and the peer-loss ``net`` transport. Any NCCL version.
- ``node`` (:data:`MULTI_RANK_GPU`): ``NCCL_MULTI_RANK_GPU_ENABLE=1``, NCCL >= 2.30 only; the
  processes stay one host and use the in-node transports (P2P, SHM), as the peer-loss ``p2p`` and
  ``shm`` transports need. With an older NCCL the placement is a skip, with the reason.

With a GPU for every slot (:data:`GPU_PER_RANK`) nothing changes: each process takes the GPU of
its slot and no variable is set. Pure logic: the callers probe the GPU count and the loaded NCCL.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

GPU_PER_RANK = "gpu-per-rank"
HOST_IDS = "host-ids"
MULTI_RANK_GPU = "multi-rank-gpu"
UNPLACED = "unplaced"

HOSTID_ENV = "NCCL_HOSTID"
MULTI_RANK_ENV = "NCCL_MULTI_RANK_GPU_ENABLE"
# The variables a placement sets; inherited values would change what a placement means.
PLACEMENT_ENV = (HOSTID_ENV, MULTI_RANK_ENV)
# NCCL_MULTI_RANK_GPU_ENABLE appeared in NCCL 2.30.
MULTI_RANK_MIN_NCCL = (2, 30, 0)
SHARING = ("net", "node")


@dataclass(frozen=True)
class Seat:
    """Where one process runs: its GPU index and the variables it needs for the placement."""

    device: int
    env: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Placement:
    """Every process's seat, or why the processes cannot be placed here (``skip``)."""

    kind: str
    gpus: int
    seats: tuple[Seat, ...]
    skip: str | None = None

    def describe(self) -> dict[str, Any]:
        """The placement for the JSON document."""
        return {
            "kind": self.kind,
            "gpus": self.gpus,
            "processes": len(self.seats),
            "devices": [seat.device for seat in self.seats],
            "env": [dict(seat.env) for seat in self.seats],
            "skip": self.skip,
        }

    def summary(self) -> str:
        """One line for the report."""
        n = len(self.seats)
        what = f"{n} process{'es' if n != 1 else ''}"
        if self.skip:
            return self.skip
        if self.kind == GPU_PER_RANK:
            return f"{what}, one GPU each ({self.gpus} GPU{'s' if self.gpus != 1 else ''})"
        if self.kind == HOST_IDS:
            return f"{what} on {self.gpus} GPU(s), one {HOSTID_ENV} each (NCCL connects them through its network)"
        return f"{what} on {self.gpus} GPU(s), {MULTI_RANK_ENV}=1 (NCCL's in-node transports)"


def _version_text(version: tuple[int, int, int] | None) -> str:
    return ".".join(map(str, version)) if version else "unknown"


def place(
    gpus: int,
    slots: Sequence[int],
    nccl_version: tuple[int, int, int] | None,
    sharing: str,
    host_label: str,
) -> Placement:
    """Seat processes whose GPU slots are ``slots`` on ``gpus`` GPUs.

    ``slots[i]`` is the GPU process ``i`` takes when there are enough; two processes of one
    communicator never share a slot. ``sharing`` says how processes share a GPU when there are
    fewer GPUs than slots: ``net`` (one ``NCCL_HOSTID`` each, named from ``host_label`` and the
    process index) or ``node`` (``NCCL_MULTI_RANK_GPU_ENABLE=1``, NCCL >= 2.30).
    """
    if sharing not in SHARING:
        raise ValueError(f"sharing must be one of {', '.join(SHARING)}, not {sharing!r}")
    if not slots:
        raise ValueError("no process to place")
    if gpus < 1:
        return Placement(UNPLACED, gpus, tuple(Seat(0) for _ in slots), "no CUDA device is visible")
    needed = max(slots) + 1
    if gpus >= needed:
        return Placement(GPU_PER_RANK, gpus, tuple(Seat(slot) for slot in slots))
    devices = [slot % gpus for slot in slots]
    if sharing == "net":
        seats = tuple(Seat(device, {HOSTID_ENV: f"{host_label}.{i}"}) for i, device in enumerate(devices))
        return Placement(HOST_IDS, gpus, seats)
    if nccl_version is None or nccl_version < MULTI_RANK_MIN_NCCL:
        reason = (
            f"{len(slots)} processes on {gpus} GPU(s) need {MULTI_RANK_ENV} for NCCL's in-node transports: "
            f"NCCL >= {_version_text(MULTI_RANK_MIN_NCCL)}, loaded {_version_text(nccl_version)} "
            "(the net transport shares a GPU with any NCCL)"
        )
        return Placement(UNPLACED, gpus, tuple(Seat(device) for device in devices), reason)
    return Placement(MULTI_RANK_GPU, gpus, tuple(Seat(device, {MULTI_RANK_ENV: "1"}) for device in devices))


def place_on_node(
    gpus: int, node: int, nproc_per_node: int, nccl_version: tuple[int, int, int] | None, sharing: str, hostid: str
) -> Placement:
    """Seat the ranks of stand-in node ``node`` (``--nodes``), ``nproc_per_node`` of them, on a host's ``gpus`` GPUs.

    Node ``n`` takes GPU slots ``n * nproc_per_node ...``, so that nodes take distinct GPUs while there
    are enough. Every seat carries the node's ``NCCL_HOSTID``: NCCL then joins a node's ranks by its
    in-node transports (P2P, SHM) and the nodes by its network, as on a cluster. Where a GPU is shared
    through the network (``net``), each process keeps the host id of its own that :func:`place` gives it.
    """
    slots = range(node * nproc_per_node, (node + 1) * nproc_per_node)
    placed = place(gpus, slots, nccl_version, sharing, hostid)
    return replace(placed, seats=tuple(Seat(seat.device, {HOSTID_ENV: hostid, **seat.env}) for seat in placed.seats))
