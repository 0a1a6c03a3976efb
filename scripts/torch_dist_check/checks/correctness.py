"""Correctness of every collective on one backend and device, checked on every rank.

Every rank fills its input from its rank number and a fixed pattern, so each rank can compute the
exact expected output by itself: integers must match exactly, floats within a per-dtype tolerance.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch_dist_check.checks.collectives import Unsupported, all_gather_flat, reduce_scatter_flat
from torch_dist_check.report.results import FAIL, PASS, CheckResult

# Relative tolerances per float dtype name (the pattern's values are exact in float32/64; the
# tolerance covers reduction order on half types and MPI's own reductions).
FLOAT_RTOL = {"float16": 2e-3, "bfloat16": 1.6e-2, "float32": 1e-6, "float64": 1e-12}


@dataclass(frozen=True)
class Plan:
    """What one correctness check runs: dtypes and element counts per rank."""

    dtypes: tuple[str, ...]
    counts: tuple[int, ...]


def default_counts(quick: bool) -> tuple[int, ...]:
    """Element counts per rank: one element, an odd count, and a large count (smaller with --quick)."""
    return (1, 1023, 65_537) if quick else (1, 1023, 1_048_583)


def pattern(torch: Any, count: int, dtype: Any, device: Any) -> Any:
    """The base pattern v[i]: (i mod 13) + 1 for integers, the same over 4 for floats (exact in binary)."""
    base = torch.arange(count, device=device, dtype=torch.int64) % 13 + 1
    if dtype.is_floating_point:
        return (base.to(torch.float64) / 4).to(dtype)
    return base.to(dtype)


def _mismatch(torch: Any, got: Any, expected: Any, dtype_name: str) -> str | None:
    """None if equal (exact for ints, within tolerance for floats), else the first bad element."""
    if dtype_name in FLOAT_RTOL:
        rtol = FLOAT_RTOL[dtype_name]
        ok = torch.isclose(got.double(), expected.double(), rtol=rtol, atol=rtol)
    else:
        ok = got == expected
    if bool(ok.all()):
        return None
    index = int((~ok).nonzero()[0][0])
    return f"element {index}: got {got.flatten()[index].item()}, expected {expected.flatten()[index].item()}"


def has_device_backend(group: Any, device: Any) -> bool:
    """True if ``group`` holds a backend per device (what PyTorch's ``init_process_group`` makes), False for a
    plug-in whose creator returned a ``ProcessGroup`` subclass, which is its own backend and holds none."""
    try:
        group._get_backend(device)
    except RuntimeError:  # "No backend type associated with device type cpu"
        return False
    return True


def backend_class(group: Any, device: Any) -> str:
    """The class name of ``group``'s backend for ``device`` (the group's own for a plug-in that is one)."""
    backend = group._get_backend(device) if has_device_backend(group, device) else group
    return type(backend).__name__


def post_send_recv(dist: Any, ops: list[Any], group: Any, device: Any) -> list[Any]:
    """Post the point-to-point ``ops`` (``dist.P2POp``) on ``group``; the works to wait for.

    ``batch_isend_irecv`` where the group has a backend for ``device`` (NCCL needs the batch: a ring of
    separate sends can wait on each other). Otherwise each op alone, as ``batch_isend_irecv`` itself posts them
    for every backend that does not coalesce: from PyTorch 2.15.0 it asks any ``ProcessGroup`` for its
    device's backend first (2.13.0 asked only an instance of ``ProcessGroup`` itself, not of a subclass), and
    a plug-in that is its own ``ProcessGroup`` then raised "No backend type associated with device type cpu"
    from PyTorch, not from the plug-in.
    """
    if has_device_backend(group, device):
        return list(dist.batch_isend_irecv(ops))
    works = [op.op(op.tensor, op.peer, group=op.group, tag=op.tag) for op in ops]
    return [work for work in works if work is not None]


def run_correctness(
    backend: str, device: Any, group: Any, rank: int, world: int, plan: Plan
) -> list[CheckResult]:
    """Run every collective for every dtype and count on ``group``; fail listing each wrong result.

    The first result covers every case that ran. A collective the backend says it does not
    implement (see collectives.Unsupported) adds a skipped result of its own, named
    ``correctness/BACKEND/DEVICE/COLLECTIVE``; its cases are not counted, and any other error or
    wrong value in any case still fails the first result.
    """
    import torch
    import torch.distributed as dist

    name = f"correctness/{backend}/{device.type}"
    start = time.monotonic()
    failures: list[str] = []
    cases = 0
    unsupported: dict[str, Unsupported] = {}
    total = world * (world + 1) // 2  # sum over ranks of (r + 1)

    def case(label: str, fn: Callable[[], str | None], collective: str = "") -> None:
        nonlocal cases
        try:
            problem = fn()
        except Unsupported as exc:
            unsupported.setdefault(collective, exc)
            return
        except Exception as exc:  # a backend error is a failed case, reported with its type
            problem = f"raised {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        cases += 1
        if problem:
            failures.append(f"{label}: {problem}")

    for dtype_name in plan.dtypes:
        dtype = getattr(torch, dtype_name)
        for count in plan.counts:
            v = pattern(torch, count, dtype, device)
            mine = v * (rank + 1)
            tag = f"{dtype_name} n={count}"

            def all_reduce(op: Any, expected: Any) -> str | None:
                t = mine.clone()
                dist.all_reduce(t, op=op, group=group)
                return _mismatch(torch, t, expected, dtype_name)

            case(f"all_reduce(sum) {tag}", lambda: all_reduce(dist.ReduceOp.SUM, v * total))
            case(f"all_reduce(max) {tag}", lambda: all_reduce(dist.ReduceOp.MAX, v * world))

            def broadcast() -> str | None:
                t = mine.clone()
                # Root is the last rank, so a backend that ignores src is caught.
                dist.broadcast(t, src=world - 1, group=group)
                return _mismatch(torch, t, v * world, dtype_name)

            case(f"broadcast {tag}", broadcast)

            def all_gather() -> str | None:
                out = torch.empty(world * count, dtype=dtype, device=device)
                all_gather_flat(out, mine.clone(), group)
                expected = torch.cat([v * (r + 1) for r in range(world)])
                return _mismatch(torch, out, expected, dtype_name)

            case(f"all_gather {tag}", all_gather, "all_gather")

            def reduce_scatter() -> str | None:
                # Block k of rank r's input is (r+1)(k+1)v, so rank r receives total*(r+1)*v.
                inp = torch.cat([mine * (k + 1) for k in range(world)])
                out = torch.empty(count, dtype=dtype, device=device)
                reduce_scatter_flat(out, inp, group)
                return _mismatch(torch, out, v * (total * (rank + 1)), dtype_name)

            case(f"reduce_scatter {tag}", reduce_scatter, "reduce_scatter")

            if world > 1:

                def send_recv() -> str | None:
                    # A ring: send to the next rank, receive from the previous one.
                    received = torch.empty_like(mine)
                    ops = [
                        dist.P2POp(dist.isend, mine.clone(), (rank + 1) % world, group=group),
                        dist.P2POp(dist.irecv, received, (rank - 1) % world, group=group),
                    ]
                    for work in post_send_recv(dist, ops, group, device):
                        work.wait()
                    return _mismatch(torch, received, v * ((rank - 1) % world + 1), dtype_name)

                case(f"send/recv {tag}", send_recv)

    def barrier() -> str | None:
        if backend == "nccl":
            dist.barrier(group=group, device_ids=[device.index])
        else:
            dist.barrier(group=group)
        return None

    case("barrier", barrier)
    if device.type == "cuda":
        torch.cuda.synchronize(device)

    details = {
        "backend": backend,
        "device": str(device),
        "dtypes": list(plan.dtypes),
        "counts": list(plan.counts),
        "cases": cases,
        "send_recv": "batch_isend_irecv" if has_device_backend(group, device) else "isend/irecv",
        # Which implementation the name ran on: PyTorch 2.15.0's "nccl" is nccl2 (ProcessGroupNCCL2) unless
        # TORCH_DIST_USE_NCCL2=0 selects the legacy ProcessGroupNCCL.
        "backend_class": backend_class(group, device),
        "failures": failures,
        "unsupported": {c: f"{exc.op}: {exc.error}" for c, exc in unsupported.items()},
    }
    duration = time.monotonic() - start
    skipped = [
        CheckResult.skipped(f"{name}/{c}", f"{backend} does not implement {exc.op}", op=exc.op, error=exc.error)
        for c, exc in unsupported.items()
    ]
    if failures:
        more = f" (+{len(failures) - 1} more)" if len(failures) > 1 else ""
        return [CheckResult(name, FAIL, f"{len(failures)}/{cases} cases wrong: {failures[0]}{more}", details, duration), *skipped]
    return [CheckResult(name, PASS, f"{cases} cases correct", details, duration), *skipped]
