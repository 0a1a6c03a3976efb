"""Bandwidth sweep like NVIDIA's nccl-tests, per backend and collective.

Figures follow nccl-tests (doc/PERFORMANCE.md there): ``size`` is the largest buffer of the
operation (the full output of all_gather, the full input of reduce_scatter), ``algbw = size / time``
and ``busbw = algbw * factor`` with factor 2(n-1)/n for all_reduce, (n-1)/n for all_gather and
reduce_scatter, and 1 for broadcast. GB/s are 1e9 bytes per second, as in nccl-tests.

Each size gets warm-up iterations, then timed iterations; the time of a size is the median of
the per-iteration times (CUDA events on GPUs, so CPU launch cost is not counted when the GPU queue
is full), and the slowest rank's median is reported.

The sweep is bounded where the backend is slow: warm-ups and timed iterations are cut to fit the
per-size budget, and a collective's sweep ends after the first size whose single call takes longer
than ``max_call_s`` (gloo on a 2-core CPU node: one call of 0.3-1.3 s at 512 MiB-1 GiB; NCCL on NVLink takes
milliseconds at 1 GiB and sweeps the whole range). Every count that depends on a timing is agreed
between the ranks first (the slowest rank's timing), so all ranks issue the same calls: ranks that
chose their own counts would wait for each other's missing calls forever.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from torch_dist_check.checks.collectives import Unsupported, all_gather_flat, reduce_scatter_flat
from torch_dist_check.report.results import FAIL, PASS, CheckResult

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")


def bus_factor(collective: str, world: int) -> float:
    """nccl-tests' bus bandwidth factor for a collective on ``world`` ranks."""
    if collective == "all_reduce":
        return 2.0 * (world - 1) / world
    if collective in ("all_gather", "reduce_scatter"):
        return (world - 1) / world
    if collective == "broadcast":
        return 1.0
    raise ValueError(f"unknown collective {collective!r}")


def sweep_sizes(min_bytes: int, max_bytes: int, factor: int = 2) -> list[int]:
    """Buffer sizes from min_bytes to max_bytes (inclusive), multiplying by ``factor``."""
    sizes = []
    size = max(min_bytes, 1)
    while size <= max_bytes:
        sizes.append(size)
        size *= factor
    return sizes


@dataclass(frozen=True)
class SweepRow:
    """One size of one collective: what was moved and how fast."""

    collective: str
    bytes: int
    count: int
    dtype: str
    iters: int
    time_us: float
    algbw_GBps: float
    busbw_GBps: float


@dataclass(frozen=True)
class SweepSettings:
    """How a sweep runs."""

    min_bytes: int
    max_bytes: int
    warmup: int
    iters: int
    size_budget_s: float
    # A collective's sweep ends after the first size whose single call took longer than this.
    max_call_s: float = 0.5


# Share of the per-size budget that warm-ups may take beyond the first one.
WARMUP_BUDGET_SHARE = 0.25


def parse_size(text: str) -> int:
    """'8', '64K', '256M', '1G' to bytes (binary multiples, as nccl-tests' -b/-e)."""
    text = text.strip().upper().removesuffix("B")
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def _timed_op(collective: str, group: Any, world: int, nbytes: int, device: Any) -> tuple[Any, int, int]:
    """A callable running one collective of ``nbytes`` (largest buffer), its element count and real size."""
    import torch
    import torch.distributed as dist

    elem = 4  # float32, as nccl-tests' default
    if collective in ("all_gather", "reduce_scatter"):
        chunk = max(1, nbytes // (elem * world))
        total = chunk * world
    else:
        chunk = total = max(1, nbytes // elem)
    if collective == "all_reduce":
        buf = torch.ones(total, dtype=torch.float32, device=device)

        def op() -> None:
            dist.all_reduce(buf, group=group)

    elif collective == "all_gather":
        inp = torch.ones(chunk, dtype=torch.float32, device=device)
        out = torch.empty(total, dtype=torch.float32, device=device)

        def op() -> None:
            all_gather_flat(out, inp, group)

    elif collective == "reduce_scatter":
        inp = torch.ones(total, dtype=torch.float32, device=device)
        out = torch.empty(chunk, dtype=torch.float32, device=device)

        def op() -> None:
            reduce_scatter_flat(out, inp, group)

    else:
        buf = torch.ones(total, dtype=torch.float32, device=device)

        def op() -> None:
            dist.broadcast(buf, src=0, group=group)

    return op, total, total * elem


def _call_seconds(op: Any, device: Any) -> float:
    """Seconds one call of ``op`` takes on this rank (CUDA events on GPUs, wall time on CPUs)."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        op()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    op()
    return time.perf_counter() - t0


def _slowest(seconds: float, control_group: Any) -> float:
    """The largest of every rank's ``seconds``: the figure all ranks then base their counts on."""
    import torch
    import torch.distributed as dist

    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=control_group)
    return float(value.item())


def _measure(op: Any, device: Any, settings: SweepSettings, control_group: Any) -> tuple[float, int, float]:
    """Median seconds per call of ``op``, the timed iterations, and the slowest rank's probe call.

    The first warm-up is timed; further warm-ups (up to ``settings.warmup`` in all) only while they
    fit a quarter of the size budget. A probe call then sets how many timed iterations fit the budget
    (``settings.iters`` at most, 3 at least). Both counts come from the slowest rank's timing, so
    every rank makes the same number of calls.
    """
    import torch

    first_warmup = _slowest(_call_seconds(op, device), control_group)
    more = min(settings.warmup - 1, int(WARMUP_BUDGET_SHARE * settings.size_budget_s / max(first_warmup, 1e-9)))
    for _ in range(max(0, more)):
        op()
    probe = _slowest(_call_seconds(op, device), control_group)
    n = max(3, min(settings.iters, int(settings.size_budget_s / max(probe, 1e-9))))
    if device.type == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
        for start, end in events:
            start.record()
            op()
            end.record()
        torch.cuda.synchronize(device)
        times = [start.elapsed_time(end) / 1e3 for start, end in events]
    else:
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            op()
            times.append(time.perf_counter() - t0)
    return statistics.median(times), n, probe


def run_sweep(
    backend: str,
    device: Any,
    group: Any,
    world: int,
    settings: SweepSettings,
    collectives: Sequence[str],
    expect_busbw: float | None,
    control_group: Any,
) -> list[CheckResult]:
    """Sweep sizes for each collective; every rank measures, the slowest rank's time counts.

    ``control_group`` is a CPU (gloo) group over the same ranks, used to agree on the timings.
    The first result holds every row; a collective the backend says it does not implement
    (collectives.Unsupported) has no rows and a skipped result ``bandwidth/BACKEND/DEVICE/COLLECTIVE``.
    """
    import torch
    import torch.distributed as dist

    name = f"bandwidth/{backend}/{device.type}"
    started = time.monotonic()
    rows: list[SweepRow] = []
    errors: list[str] = []
    unsupported: dict[str, Unsupported] = {}
    # Collective -> why its sweep ended below max_bytes (one call too slow for this backend).
    stopped: dict[str, str] = {}
    for collective in collectives:
        for nbytes in sweep_sizes(settings.min_bytes, settings.max_bytes):
            try:
                op, count, real_bytes = _timed_op(collective, group, world, nbytes, device)
                seconds, n, probe = _measure(op, device, settings, control_group)
            except Unsupported as exc:
                unsupported[collective] = exc
                break
            except Exception as exc:  # an unsupported op or a backend error ends this collective's sweep
                errors.append(f"{collective} at {nbytes} B raised {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
                break
            finally:
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            # The slowest rank decides (a collective is as fast as its slowest member).
            slowest = torch.tensor([seconds], dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=control_group)
            t = float(slowest.item())
            algbw = real_bytes / t / 1e9
            rows.append(
                SweepRow(collective, real_bytes, count, "float32", n, t * 1e6, algbw, algbw * bus_factor(collective, world))
            )
            if probe > settings.max_call_s and nbytes * 2 <= settings.max_bytes:
                stopped[collective] = (
                    f"stopped after {real_bytes} B: one call took {probe:.2f} s > max_call_s {settings.max_call_s} s"
                )
                break
    details: dict[str, Any] = {
        "backend": backend,
        "device": str(device),
        "world_size": world,
        "warmup": settings.warmup,
        "iters": settings.iters,
        "max_bytes": settings.max_bytes,
        "size_budget_s": settings.size_budget_s,
        "max_call_s": settings.max_call_s,
        "stopped": stopped,
        "rows": [asdict(r) for r in rows],
        "errors": errors,
        "unsupported": {c: f"{exc.op}: {exc.error}" for c, exc in unsupported.items()},
    }
    duration = time.monotonic() - started
    peak = {c: max((r.busbw_GBps for r in rows if r.collective == c), default=0.0) for c in collectives}
    details["peak_busbw_GBps"] = peak
    summary = ", ".join(f"{c} {peak[c]:.2f}" for c in collectives if peak[c] > 0)
    skipped = [
        CheckResult.skipped(f"{name}/{c}", f"{backend} does not implement {exc.op}", op=exc.op, error=exc.error)
        for c, exc in unsupported.items()
    ]
    if errors:
        return [CheckResult(name, FAIL, f"{errors[0]}", details, duration), *skipped]
    if expect_busbw is not None and peak.get("all_reduce", 0.0) < expect_busbw:
        reason = f"all_reduce peak busbw {peak.get('all_reduce', 0.0):.2f} GB/s < expected {expect_busbw} GB/s"
        return [CheckResult(name, FAIL, reason, details, duration), *skipped]
    return [CheckResult(name, PASS, f"peak busbw GB/s: {summary}", details, duration), *skipped]

